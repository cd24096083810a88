"""One switch, `implementation=`, picks the jnp reference or the Pallas kernels.

"xla" is the jnp reference in `pisa_jax`; "pallas" is the kernel twin in `pisa_jax.kernels`,
compiled through Triton on a GPU and run by the Pallas interpreter on any other backend (that is
how CI tests the kernels). None means "pallas" on a GPU backend and "xla" elsewhere. A name that
cannot run raises: nothing ever falls back silently to another implementation.
"""

from __future__ import annotations

import jax

IMPLEMENTATIONS = ("xla", "pallas")


def resolve_implementation(implementation: str | None) -> str:
  """Returns "xla" or "pallas" for an `implementation=` argument."""
  if implementation is None:
    return "pallas" if on_gpu() else "xla"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"{implementation=} is unknown: expected one of {IMPLEMENTATIONS} or None"
    )
  return implementation


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def interpret_mode() -> bool:
  """Pallas kernels compile through Triton only on a GPU; elsewhere they are interpreted."""
  return not on_gpu()
