"""Static shapes of one decode call (`Geometry`), the row layout of the cache and the pyramid, and
the loads, stores and launch every decode kernel shares."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.experimental import pallas as pl
# Imported for its side effect: it registers a config flag that the first `pallas_call` would
# otherwise register lazily, changing jit's tracing context once and recompiling whatever jitted
# function (a decode step) ran before it.
from jax.experimental.pallas import fuser as _fuser  # noqa: F401
from jax.experimental.pallas import triton as plt

from pisa_jax.geometry import level_offsets, level_sizes
from pisa_jax.kernels._common import MIN_DOT, load_rows, next_pow2


@dataclasses.dataclass(frozen=True)
class Geometry:
  batch: int
  capacity: int
  hq: int
  hkv: int
  d: int
  block_size: int
  branching: int
  top_k: int
  beam: int
  selector: str
  scale: float
  key_mode: str  # raw keys: "native" (16-bit dot) or "f32"
  score_mode: str  # float32 summaries: "split" (bfloat16 queries) or "f32"

  @property
  def group(self) -> int:
    return self.hq // self.hkv

  @property
  def gp(self) -> int:
    return max(MIN_DOT, next_pow2(self.group))

  @property
  def dp(self) -> int:
    return max(MIN_DOT, next_pow2(self.d))

  @property
  def cp(self) -> int:
    return max(MIN_DOT, next_pow2(self.block_size))

  @property
  def nc(self) -> int:
    """Candidate slots per level: up to beam * g children (and every leaf of a short row)."""
    return max(MIN_DOT, next_pow2(self.beam * self.branching))

  @property
  def kp(self) -> int:
    return next_pow2(self.top_k)

  @property
  def sizes(self) -> tuple[int, ...]:
    return level_sizes(self.capacity, self.block_size, self.branching)

  @property
  def offsets(self) -> tuple[int, ...]:
    return level_offsets(self.capacity, self.block_size, self.branching)

  @property
  def num_nodes(self) -> int:
    return self.offsets[-1] + 1


def make_geometry(q, k_cache, *, block_size, branching, top_k, beam, selector, scale) -> Geometry:
  b, hq, d = q.shape
  _, capacity, hkv, _ = k_cache.shape
  native = q.dtype == k_cache.dtype and q.dtype in (jnp.bfloat16, jnp.float16)
  return Geometry(
      batch=b, capacity=capacity, hq=hq, hkv=hkv, d=d, block_size=block_size, branching=branching,
      top_k=top_k, beam=beam, selector=selector, scale=float(scale),
      key_mode="native" if native else "f32",
      score_mode="split" if native and q.dtype == jnp.bfloat16 else "f32")



def load_row(ref, row, m_row, d: int, dp: int):
  """Row `row` (a scalar) of a `[*, D]` ref as `[Dp]`, zero where masked or padded."""
  return plt.load(ref.at[row, pl.ds(0, dp)], mask=(jnp.arange(dp) < d) & m_row, other=0.0)


def store_row(ref, row, value, m_row, d: int, dp: int):
  """Stores `[Dp]` into row `row` of a `[*, D]` ref where m_row (the padded columns never). A
  scalar row and a slice, not clamped index arrays: in interpret mode a masked store writes
  every lane's address (the masked ones their old value), so clamped duplicates would race."""
  plt.store(ref.at[row, pl.ds(0, dp)], value, mask=(jnp.arange(dp) < d) & m_row)


def load_scalar(ref, i, n: int = 2):
  """ref[i] of a 1-D ref, loaded as an n-vector (a value's shape is a power of two)."""
  return jnp.max(plt.load(ref.at[jnp.full((n,), i, jnp.int32)]))


def load_group_queries(q_ref, i_b, i_h, geo: Geometry):
  """The group's query heads `[Gp, Dp]` (padded heads and columns zero), and the head mask."""
  o_head = jnp.arange(geo.gp)
  m_head = o_head < geo.group
  rows = i_b * geo.hq + i_h * geo.group + jnp.minimum(o_head, geo.group - 1)
  qg = load_rows(q_ref, rows, m_head, geo.d, geo.dp)
  return (qg if geo.key_mode == "native" else qg.astype(jnp.float32)), m_head
