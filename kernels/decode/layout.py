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
from pisa_jax.kernels._common import KernelGeometry, load_rows
from pisa_jax.spec import SelectionSpec


@dataclasses.dataclass(frozen=True)
class Geometry(KernelGeometry):
  """Static shapes of one decode call: `KernelGeometry` (B, heads, D, the spec), the cache's
  capacity and its pyramid's stacked levels, and the dot modes."""

  capacity: int
  # q and the cache share one 16-bit dtype: raw keys meet the queries in a 16-bit tensor-core dot
  # with float32 accumulation; otherwise both are upcast to float32 (`_common.qk_dot`).
  inputs_16bit: bool
  # bfloat16 queries meet float32 summaries as two bfloat16 dots (`scoring.split_logits`), and
  # a bfloat16 pyramid (spec.summary_dtype) in one bfloat16 dot; otherwise one float32 dot.
  split_summaries: bool
  bf16_summary_dot: bool = False

  @property
  def sizes(self) -> tuple[int, ...]:
    return level_sizes(self.capacity, self.block_size, self.branching)

  @property
  def offsets(self) -> tuple[int, ...]:
    return level_offsets(self.capacity, self.block_size, self.branching)

  @property
  def num_nodes(self) -> int:
    return self.offsets[-1] + 1


def make_geometry(q, k_cache, spec: SelectionSpec) -> Geometry:
  """The geometry of queries q `[B, HQ, D]` against a cache `[B, N, HKV, D]`."""
  b, hq, d = q.shape
  _, capacity, hkv, _ = k_cache.shape
  inputs_16bit = q.dtype == k_cache.dtype and q.dtype in (jnp.bfloat16, jnp.float16)
  bf16_queries = inputs_16bit and q.dtype == jnp.bfloat16
  bf16_summaries = spec.summary_dtype == "bfloat16"
  return Geometry(batch=b, hq=hq, hkv=hkv, d=d, spec=spec, capacity=capacity,
                  inputs_16bit=inputs_16bit,
                  split_summaries=bf16_queries and not bf16_summaries,
                  bf16_summary_dot=bf16_queries and bf16_summaries)


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
  o_head = jnp.arange(geo.group_padded)
  m_head = o_head < geo.group
  rows = i_b * geo.hq + i_h * geo.group + jnp.minimum(o_head, geo.group - 1)
  qg = load_rows(q_ref, rows, m_head, geo.d, geo.head_dim_padded)
  return (qg if geo.inputs_16bit else qg.astype(jnp.float32)), m_head
