"""Types and geometry shared by the jnp reference and the kernels.

A leaf module: it imports nothing of pisa-jax, so `pisa_jax.kernels` can depend on it without
depending on the reference (and the reference can import the kernels at module level).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
from jaxtyping import Array, Float, Int


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["summaries", "counts"],
    meta_fields=["block_size", "branching", "seq_len"],
)
@dataclasses.dataclass(frozen=True)
class Pyramid:
  """Mean summaries of every level, leaves first.

  Attributes:
    summaries: level 1 (the leaf blocks) first and the single root last; level l is float32 (or
      the spec's summary_dtype, bfloat16) `[B, M_l, HKV, D]` with `M_1 = ceil(T / block_size)`
      and `M_{l+1} = ceil(M_l / branching)` (Eq. 10, 13).
    counts: int32 `[M_l]` per level: the number of valid keys of each leaf at level 1, and the number
      of valid children of each node above it: the denominators of Eq. 15.
    block_size: C, keys per leaf block.
    branching: g, children per upper node.
    seq_len: T, the number of keys summarised.
  """

  summaries: tuple[Float[Array, "B M H D"], ...]
  counts: tuple[Int[Array, "M"], ...]
  block_size: int
  branching: int
  seq_len: int

  @property
  def num_levels(self) -> int:
    return len(self.summaries)

  @property
  def num_blocks(self) -> int:
    """M, the number of leaf blocks."""
    return self.summaries[0].shape[1]


def level_sizes(seq_len: int, block_size: int, branching: int) -> tuple[int, ...]:
  """Number of nodes per level, leaves first, ending with the root (Eq. 10, 13)."""
  sizes = [-(-seq_len // block_size)]
  while sizes[-1] > 1:
    sizes.append(-(-sizes[-1] // branching))
  return tuple(sizes)


def node_span(level: int, block_size: int, branching: int) -> int:
  """Number of key positions a full node at `level` (1 = leaf) covers."""
  return block_size * branching ** (level - 1)


def stacked_offsets(sizes) -> tuple[int, ...]:
  """Where each of the consecutive runs of `sizes` elements starts when they are stacked along
  one axis: 0, sizes[0], sizes[0] + sizes[1], ..."""
  offsets, acc = [], 0
  for m in sizes:
    offsets.append(acc)
    acc += m
  return tuple(offsets)


def level_offsets(seq_len: int, block_size: int, branching: int) -> tuple[int, ...]:
  """First index of each level (leaves first) of the pyramid over seq_len keys when its levels
  are stacked along one axis (the decode cache's summaries `[B, S, HKV, D]`); S = offsets[-1] + 1
  (the root)."""
  return stacked_offsets(level_sizes(seq_len, block_size, branching))


def round_summaries(x: Float[Array, "..."], summary_dtype: str) -> Float[Array, "..."]:
  """float32 means rounded to `summary_dtype` ("float32": unchanged; "bfloat16": to nearest
  even), still float32: a node's one rounding, before it is stored and read as a child.
  `lax.reduce_precision`, not a round trip through bfloat16, which XLA on the GPU may fold away
  (xla_allow_excess_precision); the kernels round with a conversion, which Triton keeps."""
  if summary_dtype == "float32":
    return x
  return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
