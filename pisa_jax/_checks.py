"""The argument rules that need no array: sizes, names and options, checked in plain Python.

`pisa_jax._validation` re-exports them beside the array checks; `pisa_jax.configs.validate` and
the command-line tools call them too, before jax is imported (a mistake on a command line is
reported at once). Every check raises ValueError naming the argument as its caller spells it
(`name=`: "top_k" for a function argument, "model.top_k" for a config field, "--top-k" for a
flag) and the value expected.
"""

from __future__ import annotations

import math
import numbers

SELECTORS = ("pisa", "pisa1", "pisa2", "bsa", "exact")
# Selectors that walk the pyramid; "bsa" and "exact" are flat.
HIERARCHICAL_SELECTORS = ("pisa", "pisa1", "pisa2")
# Forced blocks per query: the first, the previous and the current leaf block (Appendix B).
NUM_FORCED = 3
# The names `implementation=` accepts (`pisa_jax._dispatch` keeps one registry per op).
IMPLEMENTATIONS = ("xla", "pallas")


def _is_int(x) -> bool:
  # numbers.Integral covers Python and numpy integers without importing numpy.
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_block_size(block_size, *, name: str = "block_size") -> None:
  if not _is_int(block_size) or block_size < 1:
    raise ValueError(f"{name}={block_size!r} must be an int >= 1")


def check_branching(branching, *, name: str = "branching") -> None:
  if not _is_int(branching) or branching < 2:
    raise ValueError(
        f"{name}={branching!r} must be an int >= 2: each upper node merges at least two children")


def check_top_k(top_k, *, name: str = "top_k") -> None:
  if not _is_int(top_k) or top_k < NUM_FORCED:
    raise ValueError(
        f"{name}={top_k!r} must be an int >= 3: the first, previous and current blocks are forced")


def check_selector(selector, *, name: str = "selector") -> None:
  if selector not in SELECTORS:
    raise ValueError(f"{name}={selector!r} is unknown: expected one of {SELECTORS}")


def check_beam(beam, top_k: int, selector: str, *, name: str = "beam",
               top_k_name: str = "top_k", selector_name: str = "selector") -> None:
  """beam: None, or an int >= top_k for a hierarchical selector."""
  if beam is None:
    return
  if not _is_int(beam) or beam < top_k:
    raise ValueError(f"{name}={beam!r} must be None or an int >= {top_k_name}={top_k}")
  if selector not in HIERARCHICAL_SELECTORS:
    raise ValueError(
        f"{name}={beam!r} applies only to the hierarchical selectors {HIERARCHICAL_SELECTORS}; "
        f"{selector_name}={selector!r} has no levels above the leaves: use {name}=None")


def check_scale(scale, *, name: str = "scale") -> None:
  """scale: None (1 / sqrt(D)), or a finite real number > 0."""
  if scale is None:
    return
  try:
    value = float(scale)
  except (TypeError, ValueError):
    value = math.nan
  if isinstance(scale, bool) or not math.isfinite(value) or value <= 0:
    raise ValueError(f"{name}={scale!r} must be a finite float > 0 (default 1/sqrt(D))")


# The dtypes the pyramid's summaries may be stored in: float32 (the default, exact up to float32
# rounding) or bfloat16 (half the memory and the walk's loads; each node's mean is computed in
# float32 from its stored children or raw keys and rounded once).
SUMMARY_DTYPES = ("float32", "bfloat16")


def summary_dtype_name(summary_dtype, *, name: str = "summary_dtype") -> str:
  """The name ("float32" or "bfloat16") of a summary dtype given as a string, a scalar type
  (`jnp.bfloat16`, `np.float32`) or a numpy dtype; anything else raises ValueError."""
  if isinstance(summary_dtype, str):
    value = summary_dtype
  elif isinstance(summary_dtype, type):
    value = summary_dtype.__name__
  elif isinstance(getattr(summary_dtype, "name", None), str) and hasattr(summary_dtype, "kind"):
    value = summary_dtype.name  # a numpy dtype
  else:
    value = None
  if value not in SUMMARY_DTYPES:
    raise ValueError(f"{name}={summary_dtype!r} must be one of {SUMMARY_DTYPES} (or the matching "
                     "jnp dtype)")
  return value


def check_implementation(implementation, *, name: str = "implementation") -> None:
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"{name}={implementation!r} is unknown: expected one of {IMPLEMENTATIONS} or None")


def resolve_beam(beam, top_k: int, selector: str) -> int:
  """`beam=None` keeps top_k nodes at every level, the paper's rule."""
  check_beam(beam, top_k, selector)
  return top_k if beam is None else int(beam)


# NSA (`pisa_jax.nsa`): how keys and values are compressed.
NSA_COMPRESSIONS = ("mlp", "mean")


def check_nsa_options(*, compression="mlp", block_length=32, stride=16, select_block_size=64,
                  top_n=16, window=512, names: dict[str, str] | None = None) -> None:
  """Every NSA size rule, once. `names` maps an option to how the caller's user spells it
  ("model.nsa_stride" for a config field); each error is one line naming it."""
  name = {k: k for k in ("compression", "block_length", "stride", "select_block_size", "top_n",
                         "window")}
  name.update(names or {})
  if compression not in NSA_COMPRESSIONS:
    raise ValueError(f"{name['compression']}={compression!r} is unknown: expected one of "
                     f"{NSA_COMPRESSIONS}")
  for option, value in (("block_length", block_length), ("stride", stride),
                        ("select_block_size", select_block_size), ("window", window)):
    if not _is_int(value) or value < 1:
      raise ValueError(f"{name[option]}={value!r} must be an int >= 1")
  if block_length % stride:
    raise ValueError(f"{name['stride']}={stride} must divide {name['block_length']}="
                     f"{block_length}: compressed blocks are whole d-token pieces (Eq. 9)")
  if compression == "mean" and stride != block_length:
    raise ValueError(f"{name['stride']}={stride} must equal {name['block_length']}="
                     f"{block_length} for {name['compression']}='mean': mean pooling does not "
                     "overlap")
  if select_block_size % stride:
    raise ValueError(f"{name['select_block_size']}={select_block_size} must be a multiple of "
                     f"{name['stride']}={stride}: selection blocks are whole d-token pieces "
                     "(Eq. 9)")
  check_top_k(top_n, name=name["top_n"])
