"""Static shapes of one selection call (`Geometry`), the row layout of its inputs, and the loads and
launch every selection kernel shares.

q `[B, T, HQ, D]` and k `[B, T, HKV, D]` are viewed as rows `[B*T*HQ, D]` / `[B*T*HKV, D]` (free
reshapes, native layout) and gathered with clamped, masked 2-D index arrays. Every value in a kernel
has power-of-two shapes: the group's heads are padded to `group_padded`, the candidates to
`num_slots`, the head dim to `head_dim_padded` and the block to `block_padded`, with masks. The
pyramid's levels 1..L-1 are stacked into one row array, addressed through a level table.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float

from pisa_jax import geometry
from pisa_jax.kernels import _common
from pisa_jax.kernels._common import KernelGeometry, int32_table, next_pow2
from pisa_jax.kernels.selection.config import SelectionConfig
from pisa_jax.spec import SelectionSpec, takes_spec


@dataclasses.dataclass(frozen=True)
class Geometry(KernelGeometry):
  """Static shapes of one selection call: `KernelGeometry` (B, heads, D, the spec) and the
  sequence, the pyramid's level sizes and the dot mode."""

  seq_len: int
  level_sizes: tuple[int, ...]  # nodes per level, leaves first, the root last
  # q and k share one 16-bit dtype: scores come from 16-bit tensor-core dots with float32
  # accumulation (`_common.qk_dot`), the float32 summaries split into two 16-bit rows
  # (`summary_rows`). Otherwise every dot is an IEEE float32 one.
  inputs_16bit: bool
  approx_log: bool = False  # log2 by the MUFU (compiled for the GPU; not in the interpreter)
  # A sequence shard: q holds query_len queries (None: seq_len) at positions offset .. offset +
  # query_len - 1 of the seq_len keys, the offset an int32 `[1]` input after the others when
  # has_offset (`query_position`). Rows of q and of the output count the shard's queries.
  query_len: int | None = None
  has_offset: bool = False
  # bfloat16 queries and keys against a bfloat16 pyramid (spec.summary_dtype): one bfloat16
  # tensor-core dot per summary, no split (exact products, float32 accumulation).
  bf16_summary_dot: bool = False

  @property
  def split_summaries(self) -> bool:
    """16-bit inputs against float32 summaries: each summary as a 16-bit high + low pair."""
    return self.inputs_16bit and self.spec.summary_dtype == "float32"

  @property
  def num_queries(self) -> int:
    return self.seq_len if self.query_len is None else self.query_len

  @property
  def num_blocks(self) -> int:
    return self.level_sizes[0]


@takes_spec
def make_geometry(q, k, *, spec: SelectionSpec, interpret: bool = True,
                  has_offset: bool = False) -> Geometry:
  """The geometry of a selection of q `[B, Tq, HQ, D]` against k `[B, T, HKV, D]`."""
  b, tq, hq, d = q.shape
  t, hkv = k.shape[1], k.shape[2]
  # Anything but 16-bit inputs of one dtype is upcast to float32.
  inputs_16bit = q.dtype == k.dtype and q.dtype in (jnp.bfloat16, jnp.float16)
  return Geometry(
      batch=b, hq=hq, hkv=hkv, d=d, spec=spec, seq_len=t,
      level_sizes=geometry.level_sizes(t, spec.block_size, spec.branching),
      inputs_16bit=inputs_16bit, approx_log=not interpret, query_len=None if tq == t else tq,
      has_offset=has_offset,
      bf16_summary_dot=(inputs_16bit and q.dtype == jnp.bfloat16
                        and spec.summary_dtype == "bfloat16"))


def launch(kernel, out_shape, grid: int, config: SelectionConfig, warps: int, interpret: bool,
           name: str, *args):
  """One `pallas_call` over a 1-D grid."""
  return _common.pallas_launch(kernel, out_shape, (grid,), warps=warps, stages=config.num_stages,
                               interpret=interpret, name=name)(*args)


def query_tile_program(geo: Geometry, q_tile: int):
  """(batch, KV head, tile index) of this program in a grid over (batch, KV head, tile of q_tile
  consecutive queries)."""
  n_tiles = pl.cdiv(geo.num_queries, q_tile)
  i_p = pl.program_id(0)
  i_bh, i_tile = i_p // n_tiles, i_p % n_tiles
  return i_bh // geo.hkv, i_bh % geo.hkv, i_tile


def load_rows(ref, rows, m_row, geo: Geometry):
  """Rows `[N]` of a `[*, D]` ref as `[N, Dp]`, masked rows and padded columns zero."""
  return _common.load_rows(ref, rows, m_row, geo.d, geo.head_dim_padded)


def query_position(i_q, off_ref):
  """The position among the keys of query row i_q (a scalar or an array): i_q itself, or i_q plus
  the shard's offset from off_ref `[1]` (loaded as a 2-vector: values have power-of-two shapes)."""
  if off_ref is None:
    return i_q
  return i_q + jnp.max(plt.load(off_ref.at[jnp.zeros((2,), jnp.int32)]))


def offset_input(offset) -> tuple:
  """The kernels' trailing offset input: (), or (int32 `[1]`,)."""
  return () if offset is None else (offset,)


def load_group_queries(q_ref, geo: Geometry, i_b, t, i_h, rows: int):
  """The group's query heads of query row t: `[rows, Dp]` (padded heads and columns read as
  zero)."""
  o_head = jnp.arange(rows)
  q_rows = ((i_b * geo.num_queries + t) * geo.hq + i_h * geo.group
            + jnp.minimum(o_head, geo.group - 1))
  return load_rows(q_ref, q_rows, o_head < geo.group, geo)


def leaf_key_rows(leaf, i_b, i_h, geo: Geometry, first_pos=None):
  """Leaf `leaf`'s raw keys in the `[B*T*HKV, D]` view: (rows `[Cp]`, load mask `[Cp]`, the key
  mask `_common.reduce_keys` needs or None). first_pos: None, or the leaf's first key position
  (a packed document's leaf starts at its document's start + leaf * C, on no block edge).

  Only complete past leaves are scored (`topk.leaf_needs_score`: eligible, not the current or
  previous block), and the callers mask off the other slots' loads and drop their scores. So for
  whole power-of-two tiles every key of a scored leaf exists: the rows are left unclamped (affine
  in the key index), the load mask is constant along it and the scores need no key mask, and
  Triton computes one base address instead of a clamp, an address and a predicate per element.
  """
  o_key = jnp.arange(geo.block_padded)
  pos = (leaf * geo.block_size if first_pos is None else first_pos) + o_key
  if geo.block_padded == geo.block_size:
    return (i_b * geo.seq_len + pos) * geo.hkv + i_h, jnp.full((geo.block_padded,), True), None
  m_key = (o_key < geo.block_size) & (pos < geo.seq_len)
  return (i_b * geo.seq_len + jnp.minimum(pos, geo.seq_len - 1)) * geo.hkv + i_h, m_key, m_key


def level_table(geo: Geometry):
  """int32 `[3, LP]`: per level l (index l - 1) its node count, its first row in the stacked
  summaries `[sum_l B*M_l*HKV, D]` of levels 1..L-1, and its leaves per node g^(l-1).

  The L levels are padded to LP = next_pow2(L + 1) columns of size 1 and g^(l-1) = 1 (never
  read): padding with the powers would reach g^(LP-1) = 2^31, past int32, from L = 16 levels on
  (g = 2, C = 64: T > 1M). The real entries stay small: g^(L-1) < g * M_1.
  """
  num_levels = len(geo.level_sizes)
  lp = next_pow2(num_levels + 1)
  sizes = list(geo.level_sizes) + [1] * (lp - num_levels)
  # The first row of each level: its first node's, times the B * HKV rows of a node.
  offsets = [geo.batch * geo.hkv * o for o in geometry.stacked_offsets(sizes)]
  pows = [geo.branching ** i if i < num_levels else 1 for i in range(lp)]
  return int32_table([sizes, offsets, pows], "the selection level table")


def load_table(tab_ref, geo: Geometry):
  """The level table's three rows as `[LP]` values."""
  lp = tab_ref.shape[1]
  o = jnp.arange(lp)
  return tuple(plt.load(tab_ref.at[jnp.full((lp,), r, jnp.int32), o]) for r in range(3))


def summary_rows(rows: Float[Array, "R D"], geo: Geometry, dtype) -> Array:
  """The summaries ref of `scoring.summary_logits`: the rows as they are (float32, or a bfloat16
  pyramid's), or, for 16-bit inputs against float32 summaries, each row r as its 16-bit high part
  (row 2r) and the 16-bit rounding of the remainder (row 2r + 1), `[2R, D]` in `dtype`: two
  exact-product dots then score a 16-bit query against the float32 summary to ~2^-17 relative.
  Split once here, not after every load inside the walk."""
  if not geo.split_summaries:
    return rows
  # The high part by reduce_precision, not a round trip through the 16-bit dtype: XLA on the GPU
  # (xla_allow_excess_precision, on by default) may fold convert(convert(x, bf16), f32) into x,
  # which made every low part zero (the GPU's bf16 check caught it).
  finfo = jnp.finfo(dtype)
  hi = lax.reduce_precision(rows, exponent_bits=finfo.nexp, mantissa_bits=finfo.nmant)
  lo = (rows - hi).astype(dtype)
  return jnp.stack([hi.astype(dtype), lo], axis=1).reshape(-1, rows.shape[-1])


def stacked_summaries(summaries, geo: Geometry, dtype):
  """Levels 1..L-1 as one row array `[sum_l B*M_l*HKV, D]` (the root is never read), in the
  layout of `summary_rows`."""
  d = summaries[0].shape[-1]
  used = summaries[:-1] or summaries[:1]
  return summary_rows(jnp.concatenate([s.reshape(-1, d) for s in used], axis=0), geo, dtype)
