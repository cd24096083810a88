"""One registry per op: `implementation=` picks the jnp reference or a kernel backend.

Each op (`build_pyramid`, `select_blocks`, `sparse_attention`, the decode step's parts...) has
its implementations registered under one name each, all with the reference's signature: "xla"
is the jnp reference in `pisa_jax`, "pallas" the kernel twin in `pisa_jax.kernels` (compiled
through Triton on a GPU, run by the Pallas interpreter on any other backend: that is how CI
tests the kernels). Every `register` call is in `pisa_jax._ops`, which `lookup` imports before
its first lookup: what is registered never depends on which modules a program imported, or in
what order. Another backend (Mosaic GPU) is one more `register` call; callers do not change.

None means "pallas" on a GPU backend and "xla" elsewhere. A name that is not registered raises:
nothing ever falls back silently to another implementation.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import jax

from pisa_jax._checks import IMPLEMENTATIONS

_REGISTRY: dict[str, dict[str, Callable]] = {}


def register(op: str, **implementations: Callable) -> None:
  """Registers `op`'s implementations by name, e.g. `register("select_blocks", xla=f, pallas=g)`."""
  for name in implementations:
    if name not in IMPLEMENTATIONS:
      raise ValueError(f"implementation {name=} for {op=} must be one of {IMPLEMENTATIONS}")
  _REGISTRY.setdefault(op, {}).update(implementations)


def lookup(op: str, implementation: str | None) -> Callable:
  """The function registered for `op` under `implementation` (None: the platform default)."""
  name = resolve_implementation(implementation)
  # The registrations, on the first lookup (`_ops` imports the whole library: not at import).
  importlib.import_module("pisa_jax._ops")
  if op not in _REGISTRY:
    raise ValueError(f"{op=} is not registered: expected one of {tuple(_REGISTRY)}")
  table = _REGISTRY[op]
  if name not in table:
    raise ValueError(f"{implementation=} is not available for {op}: expected one of "
                     f"{tuple(table)} or None")
  return table[name]


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


def with_interpret(kernel_fn: Callable) -> Callable:
  """A Pallas entry point with the reference's signature: `interpret=` chosen by the backend."""

  def call(*args, **kwargs):
    return kernel_fn(*args, interpret=interpret_mode(), **kwargs)

  call.__name__ = getattr(kernel_fn, "__name__", "pallas")
  call.__doc__ = kernel_fn.__doc__
  return call
