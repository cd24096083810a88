"""`SelectionSpec`: the options of a block selection in one frozen, hashable value.

Block size, top-k, branching, selector, scale, beam and the pyramid's summary dtype travel
together from the public functions (`select_blocks`, `pisa_attention`, `sparse_attention`,
`build_pyramid`, `selection_quality`, `decode_step`) to the jnp reference and the kernels. Each public function takes them as keyword
arguments or whole as `spec=` (a keyword that disagrees with the spec is an error naming both),
checks them once here, and passes the spec on, resolved (`resolved`: the scale and the beam
filled in). The defaults live here and nowhere else. Like every option, a spec is static under
`jax.jit`: close over it or mark `spec` static.

A leaf module (it imports only the jax-free `_checks`), so a config or a command line can build
and check a spec before jax is imported.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from pisa_jax import _checks

FIELDS = ("block_size", "top_k", "branching", "selector", "scale", "beam", "summary_dtype")


@dataclasses.dataclass(frozen=True)
class SelectionSpec:
  """What a block selection computes (Section 3, Appendix B), checked on construction.

  Attributes:
    block_size: C, keys per leaf block.
    top_k: K, leaf blocks selected per query (>= 3: the first, previous and current blocks are
      forced).
    branching: g, children per upper pyramid node (>= 2).
    selector: "pisa" (LSE, Eq. 21), "pisa1" (mean, Eq. 33), "pisa2" (mean + variance / 2,
      Eq. 34), "bsa" (flat softmax over mean-key summaries) or "exact" (flat, exact raw-key LSE;
      reference only).
    scale: the logit scale, a finite float > 0; None: 1 / sqrt(D) (`resolved`).
    beam: nodes kept per level above the leaves, >= top_k, hierarchical selectors only; None:
      top_k, the paper's rule (`resolved`).
    summary_dtype: "float32" (the default) or "bfloat16" (`jnp.bfloat16` is accepted and stored
      by name): the dtype the pyramid's summaries are stored in. Each node's mean is computed in
      float32 from its stored children (a leaf from its raw keys) and rounded once to this dtype;
      scores accumulate in float32. bfloat16 halves the pyramid's memory and the walk's loads,
      and a bfloat16 query meets a bfloat16 summary in one tensor-core dot.
  """

  block_size: int = 64
  top_k: int = 8
  branching: int = 2
  selector: str = "pisa"
  scale: float | None = None
  beam: int | None = None
  summary_dtype: str = "float32"

  def __post_init__(self):
    _checks.check_block_size(self.block_size)
    _checks.check_top_k(self.top_k)
    _checks.check_branching(self.branching)
    _checks.check_selector(self.selector)
    _checks.check_beam(self.beam, self.top_k, self.selector)
    _checks.check_scale(self.scale)
    object.__setattr__(self, "summary_dtype", _checks.summary_dtype_name(self.summary_dtype))
    # Python numbers, so that equal specs hash alike whatever integer or float type came in.
    for name in ("block_size", "top_k", "branching", "beam"):
      if getattr(self, name) is not None:
        object.__setattr__(self, name, int(getattr(self, name)))
    if self.scale is not None:
      object.__setattr__(self, "scale", float(self.scale))

  @property
  def hierarchical(self) -> bool:
    """Whether the selector walks the pyramid ("pisa", "pisa1", "pisa2")."""
    return self.selector in _checks.HIERARCHICAL_SELECTORS

  @property
  def is_resolved(self) -> bool:
    return self.scale is not None and (self.beam is not None or not self.hierarchical)

  @property
  def kept_per_level(self) -> int:
    """Nodes kept per level above the leaves: the beam, or top_k (a flat selector's "level")."""
    return self.top_k if self.beam is None else self.beam

  def resolved(self, head_dim: int) -> SelectionSpec:
    """The spec with its defaults filled in: scale 1 / sqrt(head_dim), and for a hierarchical
    selector beam top_k."""
    if self.is_resolved:
      return self
    return dataclasses.replace(
        self, scale=1.0 / math.sqrt(head_dim) if self.scale is None else self.scale,
        beam=self.kept_per_level if self.hierarchical else None)

  @classmethod
  def merge(cls, spec: SelectionSpec | None = None, **options) -> SelectionSpec:
    """A spec from `spec` and keyword options (None: not given). Without a spec, the options over
    the defaults; with one, an option must equal its field."""
    unknown = set(options) - set(FIELDS)
    if unknown:
      raise TypeError(f"{sorted(unknown)} are not SelectionSpec fields: expected {FIELDS}")
    given = {name: value for name, value in options.items() if value is not None}
    if "summary_dtype" in given:
      # Compared by name: jnp.bfloat16 and "bfloat16" are one option.
      given["summary_dtype"] = _checks.summary_dtype_name(given["summary_dtype"])
    if spec is None:
      return cls(**given)
    if not isinstance(spec, SelectionSpec):
      raise TypeError(f"spec must be a SelectionSpec, got {type(spec).__name__}")
    for name, value in given.items():
      if value != getattr(spec, name):
        raise ValueError(f"{name}={value!r} conflicts with spec.{name}={getattr(spec, name)!r}: "
                         f"pass {name} in the spec or as a keyword, not both")
    return spec


def takes_spec(fn):
  """An entry point `fn(q, ..., *, spec, **rest)` that also takes the spec's fields as keywords,
  `fn(q, ..., block_size=64, top_k=8, ...)`, as its callers in tests and benchmarks do; for a
  flat selector a beam of top_k (what the kernels' walk geometry uses) is no option and is
  dropped. The spec is resolved for the head dim of the first argument (q)."""

  @functools.wraps(fn)
  def call(*args, spec: SelectionSpec | None = None, **kwargs):
    options = {name: kwargs.pop(name) for name in FIELDS if name in kwargs}
    if (options.get("selector") not in (None, *_checks.HIERARCHICAL_SELECTORS)
        and options.get("beam") is not None and options["beam"] == options.get("top_k")):
      del options["beam"]
    spec = SelectionSpec.merge(spec, **options).resolved(args[0].shape[-1])
    return fn(*args, spec=spec, **kwargs)

  return call
