"""Pallas (Triton) attention over selected leaf blocks (Eq. 6), one program per tile of queries.

The same op as `pisa_jax.kernels.attention` (same `custom_vjp` contract, same outputs), read
differently: a program owns TQ consecutive queries and the G query heads of one KV head, so its
rows are R = TQ * G' (G' the group padded to a power of two), and it walks the sorted union of the
blocks its queries selected (`tile_index.tile_unions`) loading each key/value block once. Each
(query, key) pair is masked by that query's own selection (the block is among its K indices: one
bit of the union entry's int32 of query bits) and by causality (key position <= query position),
the rule of Eq. 6. Neighbouring queries select
nearly the same blocks, so the union is a small share of the TQ * K reads of the per-query kernel,
at up to union / K times its FLOPs, on `[R, C]` score tiles with many rows.

Backward (Appendix B: the selection is held fixed): dq and delta = rowsum(o * do) by the same
tile walk; dk/dv per key block over the (sub-)tiles that select it (`tile_inverted_index`),
cut into work items whose float32 partials are summed in item order by the per-query kernel's
reduction. No atomics: reruns are bit-identical.

Non-finite inputs: a key or value that a row does not see must not reach it, but the rows of a
tile share every dot. Scores are masked by a select (not a product); values with a non-finite
entry are zeroed before the PV dot, and the rows that see such an entry are set to NaN from a
second dot, both only in a block flagged (outside the kernel) as holding one (NaN also where the
reference's value would be an infinity). dq multiplies by finite-zeroed keys and dk by finite-zeroed queries: a row
that sees a NaN key or has a NaN query still gets it through its own scores.

Padding: q, o and do are padded to whole tiles and groups (padded rows select nothing), keys to whole blocks (after every query, masked by causality), head dims to a power of
two >= 16 (zero columns change no dot product).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pisa_jax.kernels import attention as per_query
from pisa_jax.kernels import attention_backward
from pisa_jax.kernels import tile_index
from pisa_jax.kernels._common import next_pow2

_LOG2E = per_query._LOG2E
_LN2 = per_query._LN2
KERNELS = ("tile", "auto")


@dataclasses.dataclass(frozen=True)
class TileAttentionConfig:
  """Tile size and launch parameters of the query-tile kernels.

  Attributes:
    tile_queries: TQ, consecutive queries per program, a power of two <= 32; raised to 16 / G'
      when smaller, so that a program has at least 16 rows (the smallest tensor-core dot).
    kernel: "tile" always runs these kernels; "auto" runs them when
      `tile_index.prefers_tile_kernel` holds for the indices, else the per-query kernels (with
      their default config).
    fwd_num_warps, fwd_num_stages, dq_num_warps, dq_num_stages, dkv_num_warps, dkv_num_stages,
      reduce_num_warps: kernel launches.
    dkv_rows: rows per step of the dk/dv kernel, a power of two: a tile is taken in sub-tiles
      of dkv_rows / G' queries (at least 16 rows, at most a tile), and a sub-tile none of whose
      queries selected a block is no work for it (`tile_index.split_tiles`).
    items_tiles: most tiles one dk/dv program handles for one key block; 0 picks
      `tile_index.default_items_tiles`.
  """

  tile_queries: int = 16
  kernel: str = "tile"
  fwd_num_warps: int = 4
  fwd_num_stages: int = 2
  dq_num_warps: int = 4
  dq_num_stages: int = 2
  dkv_rows: int = 64
  dkv_num_warps: int = 4
  dkv_num_stages: int = 2
  items_tiles: int = 0
  reduce_num_warps: int = 4

  def __post_init__(self):
    if (self.tile_queries < 1 or self.tile_queries & (self.tile_queries - 1)
        or self.tile_queries > tile_index.MAX_TILE_QUERIES):
      raise ValueError(f"tile_queries={self.tile_queries} must be a power of two in [1, "
                       f"{tile_index.MAX_TILE_QUERIES}] (a tile's queries are an int32's bits)")
    if self.dkv_rows < 1 or self.dkv_rows & (self.dkv_rows - 1):
      raise ValueError(f"dkv_rows={self.dkv_rows} must be a power of two >= 1")
    if self.kernel not in KERNELS:
      raise ValueError(f"kernel={self.kernel!r} must be one of {KERNELS}")
    if self.items_tiles < 0:
      raise ValueError(f"items_tiles={self.items_tiles} must be >= 0 (0: the default)")

  @classmethod
  def default(cls, *, head_dim: int, group: int) -> "TileAttentionConfig":
    """Heuristic defaults, not yet measured on a GPU; chosen from ptxas' register counts for
    sm_90 at groups 2 and 16 (the float32 accumulator is rows x d): 128 rows per program at
    d <= 64 and 64 at d = 128, 8 warps for them (forward 127-214 registers, dq 149-216, no
    spills; 4 warps spill or sit at 255); dk/dv steps of 64 rows in 4 warps at d <= 64 and of
    32 rows in 8 warps at d = 128 (205 registers; 64 rows spill 56-64 bytes in 8 warps, 4 warps
    spill more)."""
    dp = next_pow2(max(16, head_dim))
    gp = next_pow2(group)
    rows = 128 if dp <= 64 else 64
    tile_queries = max(1, min(tile_index.MAX_TILE_QUERIES, rows // gp))
    warps = 8 if max(16, tile_queries * gp) * dp >= 8192 else 4
    return cls(tile_queries=tile_queries, fwd_num_warps=warps, dq_num_warps=warps,
               dkv_rows=32 if dp >= 128 else 64, dkv_num_warps=8 if dp >= 128 else 4)


def _tile_rows(tile, tile_q: int, gp: int):
  """[R] query position of each row of a tile."""
  return tile * tile_q + jnp.arange(tile_q * gp) // gp


def _selects(word, tile_q: int, group: int, gp: int):
  """[R] whether each row's query selected the block whose query bits are `word` (bit q: query
  q of the tile), for the real heads only. Two scalar-vector ops per block: no per-query index
  list is held in registers."""
  o_r = jnp.arange(tile_q * gp)
  return (lax.shift_right_logical(word, o_r // gp) & 1 == 1) & (o_r % gp < group)


def _finite_or_zero(x):
  return jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x))


def _nonfinite_flags(x, run: int):
  """int32 `[B, L / run, HKV]`: 1 where a run of `run` positions of x `[B, L, HKV, ...]` holds a
  non-finite entry. A kernel reads one flag per block or tile and cleans only flagged ones."""
  b, length, hkv = x.shape[:3]
  bad = ~jnp.isfinite(x.reshape(b, length // run, run, hkv, -1))
  return jnp.any(bad, axis=(2, 4)).astype(jnp.int32)


def _flag_spec(length: int):
  return pl.BlockSpec((None, length, None), lambda i, h, bb: (bb, 0, h))


# ----------------------------------------------------------------------------- forward kernel


def _fwd_kernel(q_ref, k_ref, v_ref, union_ref, bits_ref, count_ref, v_bad_ref, o_ref, lse_ref, *,
                block_size: int, scale: float, group: int):
  """One program: query tile i, KV head h. q_ref `[TQ, G', D]`, k_ref/v_ref `[Tk, D]`,
  union_ref/bits_ref `[NT, U]`, count_ref `[NT]`, v_bad_ref `[M]` (whether a block's values
  hold a non-finite entry)."""
  i = pl.program_id(0)
  tile_q, gp, d = q_ref.shape
  rows = tile_q * gp
  # [R, D]
  b_q = q_ref[...].reshape(rows, d)
  o_t = _tile_rows(i, tile_q, gp)
  precision = per_query._dot_precision(b_q.dtype)
  qk_scale = scale * _LOG2E

  def body(u, carry):
    b_m, b_l, b_acc = carry
    n = union_ref[i, u]
    selects = _selects(bits_ref[i, u], tile_q, group, gp)
    start = pl.multiple_of(n * block_size, block_size)
    # [C, D]: each block of the union is read once for all R rows.
    b_k = k_ref[pl.ds(start, block_size), :]
    b_v = v_ref[pl.ds(start, block_size), :]
    key_pos = start + jnp.arange(block_size)
    # [R, C]: Eq. 6's mask, per row: its query selected block n, and key <= query.
    visible = selects[:, None] & (key_pos[None, :] <= o_t[:, None])
    b_s = jnp.dot(b_q, b_k.T, precision=precision, preferred_element_type=jnp.float32) * qk_scale
    b_s = jnp.where(visible, b_s, -jnp.inf)
    m_new = jnp.maximum(b_m, jnp.max(b_s, axis=1))
    # Until a row has seen a visible key its max is -inf; shift by 0 so no inf - inf appears.
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(b_m - m_use)
    b_p = jnp.exp2(b_s - m_use[:, None])
    b_l = b_l * alpha + jnp.sum(b_p, axis=1)
    # A non-finite value would reach every row through p = 0 (0 * NaN = NaN). In a block that
    # holds one (a flag from outside: finite blocks pay one scalar load) it is zeroed, and the
    # accumulator entries of the rows that see it are set to NaN (they stay NaN).
    has_bad = v_bad_ref[n] > 0
    b_v_use = lax.cond(has_bad, _finite_or_zero, lambda x: x, b_v)
    b_acc = b_acc * alpha[:, None] + jnp.dot(
        b_p.astype(b_v.dtype), b_v_use, precision=precision, preferred_element_type=jnp.float32)

    def poison(b_acc):
      hits = jnp.dot(visible.astype(b_v.dtype), (~jnp.isfinite(b_v)).astype(b_v.dtype),
                     precision=precision, preferred_element_type=jnp.float32)
      return jnp.where(hits > 0, jnp.nan, b_acc)

    return m_new, b_l, lax.cond(has_bad, poison, lambda x: x, b_acc)

  init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
          jnp.zeros((rows, d), jnp.float32))
  b_m, b_l, b_acc = lax.fori_loop(0, count_ref[i], body, init)
  # A row with no visible key has l = 0 and acc = 0: it gets zeros and lse = -inf.
  has_key = b_l > 0
  b_o = b_acc / jnp.where(has_key, b_l, 1.0)[:, None]
  b_lse = jnp.where(has_key, (b_m + jnp.log2(jnp.where(has_key, b_l, 1.0))) * _LN2, -jnp.inf)
  o_ref[...] = b_o.reshape(tile_q, gp, d).astype(o_ref.dtype)
  lse_ref[...] = b_lse.reshape(tile_q, gp)


def _tile_specs(tile_q, gp, d, tk, num_tiles, length):
  """BlockSpecs of the (tile, KV head, batch) grid: a program sees its tile's rows of q/o/do
  `[TQ, G', D]` and lse/delta `[TQ, G']`, its KV head's whole k/v `[Tk, D]`, and the union
  lists and query bits `[NT, U]` and counts `[NT]` of its (batch, KV head)."""
  q_spec = pl.BlockSpec((None, tile_q, None, gp, d), lambda i, h, bb: (bb, i, h, 0, 0))
  lse_spec = pl.BlockSpec((None, tile_q, None, gp), lambda i, h, bb: (bb, i, h, 0))
  kv_spec = pl.BlockSpec((None, tk, None, d), lambda i, h, bb: (bb, 0, h, 0))
  union_spec = pl.BlockSpec((None, num_tiles, None, length), lambda i, h, bb: (bb, 0, h, 0))
  count_spec = pl.BlockSpec((None, num_tiles, None), lambda i, h, bb: (bb, 0, h))
  return q_spec, lse_spec, kv_spec, union_spec, count_spec


def _forward(q5, k, v, union, bits, count, *, block_size, scale, group, interpret, config):
  """q5 `[B, Tp, HKV, G', D]` (Tp = NT * TQ) -> (o5 like q5, lse float32 `[B, Tp, HKV, G']`)."""
  b, tp, hkv, gp, d = q5.shape
  num_tiles, length = union.shape[1], union.shape[3]
  tile_q = tp // num_tiles
  num_blocks = k.shape[1] // block_size
  # [B, M, HKV]: 1 where a block's values hold a non-finite entry.
  v_bad = _nonfinite_flags(v, block_size)
  q_spec, lse_spec, kv_spec, union_spec, count_spec = _tile_specs(
      tile_q, gp, d, k.shape[1], num_tiles, length)
  call = pl.pallas_call(
      functools.partial(_fwd_kernel, block_size=block_size, scale=scale, group=group),
      grid=(num_tiles, hkv, b),
      in_specs=[q_spec, kv_spec, kv_spec, union_spec, union_spec, count_spec,
                _flag_spec(num_blocks)],
      out_specs=[q_spec, lse_spec],
      out_shape=[jax.ShapeDtypeStruct(q5.shape, q5.dtype),
                 jax.ShapeDtypeStruct((b, tp, hkv, gp), jnp.float32)],
      compiler_params=plt.CompilerParams(num_warps=config.fwd_num_warps,
                                         num_stages=config.fwd_num_stages),
      interpret=interpret,
      name="pisa_tile_attention_fwd",
  )
  return per_query._call_kernel(call, q5, k, v, union, bits, count, v_bad)


# ----------------------------------------------------------------------------- dq kernel


def _dq_kernel(q_ref, k_ref, v_ref, union_ref, bits_ref, count_ref, k_bad_ref, o_ref, do_ref,
               lse_ref, dq_ref, delta_ref, *, block_size: int, scale: float, group: int):
  """One program: query tile i, KV head h. Writes dq and delta = rowsum(o * do) for dk/dv."""
  i = pl.program_id(0)
  tile_q, gp, d = q_ref.shape
  rows = tile_q * gp
  # [R, D]
  b_q = q_ref[...].reshape(rows, d)
  b_do = do_ref[...].reshape(rows, d)
  b_o = o_ref[...].reshape(rows, d)
  # [R]
  b_delta = jnp.sum(b_o.astype(jnp.float32) * b_do.astype(jnp.float32), axis=1)
  # Rows without a visible key carry lse = -inf; every entry of theirs is masked below.
  b_lse2 = lse_ref[...].reshape(rows) * _LOG2E
  o_t = _tile_rows(i, tile_q, gp)
  precision = per_query._dot_precision(b_q.dtype)
  qk_scale = scale * _LOG2E

  def body(u, b_dq):
    n = union_ref[i, u]
    start = pl.multiple_of(n * block_size, block_size)
    b_k = k_ref[pl.ds(start, block_size), :]
    b_v = v_ref[pl.ds(start, block_size), :]
    key_pos = start + jnp.arange(block_size)
    selects = _selects(bits_ref[i, u], tile_q, group, gp)
    visible = selects[:, None] & (key_pos[None, :] <= o_t[:, None])
    # [R, C]
    b_s = jnp.dot(b_q, b_k.T, precision=precision, preferred_element_type=jnp.float32) * qk_scale
    b_p = jnp.where(visible, jnp.exp2(b_s - b_lse2[:, None]), 0.0)
    b_dp = jnp.dot(b_do, b_v.T, precision=precision, preferred_element_type=jnp.float32)
    # A hidden key's dp is NaN when its value is, and p = 0 does not cancel it (0 * NaN = NaN).
    b_ds = b_p * jnp.where(visible, b_dp - b_delta[:, None], 0.0)
    # ds = 0 does not cancel a NaN key either: a flagged block's keys are zeroed here, and the
    # rows that see a NaN key get it through their ds.
    b_k = lax.cond(k_bad_ref[n] > 0, _finite_or_zero, lambda x: x, b_k)
    return b_dq + jnp.dot(b_ds.astype(b_k.dtype), b_k, precision=precision,
                          preferred_element_type=jnp.float32)

  b_dq = lax.fori_loop(0, count_ref[i], body, jnp.zeros((rows, d), jnp.float32))
  dq_ref[...] = (b_dq * scale).reshape(tile_q, gp, d).astype(dq_ref.dtype)
  delta_ref[...] = b_delta.reshape(tile_q, gp)


def _backward_dq(q5, k, v, union, bits, count, o5, do5, lse, *, block_size, scale, group,
                 interpret, config):
  b, tp, hkv, gp, d = q5.shape
  num_tiles, length = union.shape[1], union.shape[3]
  q_spec, lse_spec, kv_spec, union_spec, count_spec = _tile_specs(
      tp // num_tiles, gp, d, k.shape[1], num_tiles, length)
  call = pl.pallas_call(
      functools.partial(_dq_kernel, block_size=block_size, scale=scale, group=group),
      grid=(num_tiles, hkv, b),
      in_specs=[q_spec, kv_spec, kv_spec, union_spec, union_spec, count_spec,
                _flag_spec(k.shape[1] // block_size), q_spec, q_spec, lse_spec],
      out_specs=[q_spec, lse_spec],
      out_shape=[jax.ShapeDtypeStruct(q5.shape, q5.dtype),
                 jax.ShapeDtypeStruct((b, tp, hkv, gp), jnp.float32)],
      compiler_params=plt.CompilerParams(num_warps=config.dq_num_warps,
                                         num_stages=config.dq_num_stages),
      interpret=interpret,
      name="pisa_tile_attention_dq",
  )
  return per_query._call_kernel(call, q5, k, v, union, bits, count,
                                _nonfinite_flags(k, block_size), o5, do5, lse)


# ----------------------------------------------------------------------------- dk/dv kernel


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_bad_ref, entry_ref,
                entry_bits_ref, blk_ref, start_ref, end_ref, dk_ref, dv_ref, *, block_size: int,
                scale: float, group: int, step_q: int):
  """One program: one work item (a key block and a run of the sub-tiles that select it).

  Each step loads one sub-tile of `step_q` queries (R = step_q * G' rows) as the N dimension of
  `[C, R]` dots (Appendix B gradients for the keys of one block). The loads sit outside any
  branch, so Triton pipelines them. Writes float32 partials, scale not yet applied to dk."""
  it = pl.program_id(0)
  n = blk_ref[it]
  gp, d = q_ref.shape[1], q_ref.shape[2]
  rows = step_q * gp
  start = pl.multiple_of(n * block_size, block_size)
  # [C, D]
  b_k = k_ref[pl.ds(start, block_size), :]
  b_v = v_ref[pl.ds(start, block_size), :]
  precision = per_query._dot_precision(b_k.dtype)
  qk_scale = scale * _LOG2E
  key_pos = start + jnp.arange(block_size)

  def body(e, carry):
    b_dk, b_dv = carry
    sub = entry_ref[e]
    t0 = pl.multiple_of(sub * step_q, step_q)
    # [R, D] and [R]: rows of queries t0 .. t0 + step_q - 1.
    b_q = q_ref[pl.ds(t0, step_q)].reshape(rows, d)
    b_do = do_ref[pl.ds(t0, step_q)].reshape(rows, d)
    b_lse2 = lse_ref[pl.ds(t0, step_q)].reshape(rows) * _LOG2E
    b_delta = delta_ref[pl.ds(t0, step_q)].reshape(rows)
    o_t = t0 + jnp.arange(rows) // gp
    # [C, R]
    visible = (_selects(entry_bits_ref[e], step_q, group, gp)[None, :]
               & (key_pos[:, None] <= o_t[None, :]))
    b_s = jnp.dot(b_k, b_q.T, precision=precision, preferred_element_type=jnp.float32) * qk_scale
    b_dp = jnp.dot(b_v, b_do.T, precision=precision, preferred_element_type=jnp.float32)
    b_p = jnp.where(visible, jnp.exp2(b_s - b_lse2[None, :]), 0.0)
    # Masked again: a hidden pair's dp (a NaN value) or delta (a NaN output) must not reach
    # that key's dk through p = 0 (0 * NaN = NaN).
    b_ds = b_p * jnp.where(visible, b_dp - b_delta[None, :], 0.0)
    b_dv = b_dv + jnp.dot(b_p.astype(b_do.dtype), b_do, precision=precision,
                          preferred_element_type=jnp.float32)
    # A NaN query reaches the keys it sees through its ds, not the others through ds = 0: a
    # flagged sub-tile's queries are zeroed for this dot.
    b_q = lax.cond(q_bad_ref[sub] > 0, _finite_or_zero, lambda x: x, b_q)
    b_dk = b_dk + jnp.dot(b_ds.astype(b_q.dtype), b_q, precision=precision,
                          preferred_element_type=jnp.float32)
    return b_dk, b_dv

  zeros = jnp.zeros((block_size, d), jnp.float32)
  b_dk, b_dv = lax.fori_loop(start_ref[it], end_ref[it], body, (zeros, zeros))
  dk_ref[...] = b_dk
  dv_ref[...] = b_dv


def _backward_dkv(q5, k, v, union, bits, do5, lse, delta, *, block_size, scale, group,
                  interpret, config):
  b, tp, hkv, gp, d = q5.shape
  tk = k.shape[1]
  num_blocks = tk // block_size
  tile_q = tp // union.shape[1]
  # Queries per step: dkv_rows rows, at least 16 (the smallest tensor-core dot), at most a tile.
  step_q = min(tile_q, max(config.dkv_rows // gp, 16 // gp, 1))
  union, bits = tile_index.split_tiles(union, bits, tile_queries=tile_q, sub_queries=step_q)
  num_tiles, length = union.shape[1], union.shape[3]
  items_tiles = config.items_tiles or tile_index.default_items_tiles(num_tiles, length, num_blocks)
  entry_tile, entry_bits, item_block, item_start, item_end, item_offsets = (
      tile_index.tile_inverted_index(union, bits, num_blocks=num_blocks, items_tiles=items_tiles))
  num_items = item_block.shape[-1]
  q_spec = pl.BlockSpec((None, tp, None, gp, d), lambda i, h, bb: (bb, 0, h, 0, 0))
  kv_spec = pl.BlockSpec((None, tk, None, d), lambda i, h, bb: (bb, 0, h, 0))
  lse_spec = pl.BlockSpec((None, tp, None, gp), lambda i, h, bb: (bb, 0, h, 0))
  entry_spec = pl.BlockSpec((None, None, num_tiles * length), lambda i, h, bb: (bb, h, 0))
  item_spec = pl.BlockSpec((None, None, num_items), lambda i, h, bb: (bb, h, 0))
  part_spec = pl.BlockSpec((None, None, None, block_size, d), lambda i, h, bb: (bb, h, i, 0, 0))
  part_shape = jax.ShapeDtypeStruct((b, hkv, num_items, block_size, d), jnp.float32)
  kernel = functools.partial(_dkv_kernel, block_size=block_size, scale=scale, group=group,
                             step_q=step_q)
  dk_part, dv_part = per_query._call_kernel(pl.pallas_call(
      kernel,
      grid=(num_items, hkv, b),
      in_specs=[q_spec, kv_spec, kv_spec, q_spec, lse_spec, lse_spec, _flag_spec(num_tiles),
                entry_spec, entry_spec, item_spec, item_spec, item_spec],
      out_specs=[part_spec, part_spec],
      out_shape=[part_shape, part_shape],
      compiler_params=plt.CompilerParams(num_warps=config.dkv_num_warps,
                                         num_stages=config.dkv_num_stages),
      interpret=interpret,
      name="pisa_tile_attention_dkv",
  ), q5, k, v, do5, lse, delta, _nonfinite_flags(q5, step_q), entry_tile, entry_bits, item_block,
     item_start, item_end)

  offsets_spec = pl.BlockSpec((None, None, num_blocks + 1), lambda n, h, bb: (bb, h, 0))
  parts_spec = pl.BlockSpec((None, None, num_items, block_size, d),
                            lambda n, h, bb: (bb, h, 0, 0, 0))
  out_spec = pl.BlockSpec((None, block_size, None, d), lambda n, h, bb: (bb, n, h, 0))
  return per_query._call_kernel(pl.pallas_call(
      functools.partial(attention_backward._reduce_kernel, scale=scale),
      grid=(num_blocks, hkv, b),
      in_specs=[offsets_spec, parts_spec, parts_spec],
      out_specs=[out_spec, out_spec],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=plt.CompilerParams(num_warps=config.reduce_num_warps, num_stages=1),
      interpret=interpret,
      name="pisa_tile_attention_dkv_reduce",
  ), item_offsets, dk_part, dv_part)


# ----------------------------------------------------------------------------- custom_vjp op


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _tile_attention_core(q5, k, v, union, bits, count, block_size, scale, group, interpret,
                         config):
  o5, _ = _forward(q5, k, v, union, bits, count, block_size=block_size, scale=scale, group=group,
                   interpret=interpret, config=config)
  return o5


def _core_fwd(q5, k, v, union, bits, count, block_size, scale, group, interpret, config):
  o5, lse = _forward(q5, k, v, union, bits, count, block_size=block_size, scale=scale,
                     group=group, interpret=interpret, config=config)
  return o5, (q5, k, v, union, bits, count, o5, lse)


def _core_bwd(block_size, scale, group, interpret, config, residuals, do5):
  q5, k, v, union, bits, count, o5, lse = residuals
  do5 = do5.astype(q5.dtype)
  kw = dict(block_size=block_size, scale=scale, group=group, interpret=interpret, config=config)
  dq5, delta = _backward_dq(q5, k, v, union, bits, count, o5, do5, lse, **kw)
  dk, dv = _backward_dkv(q5, k, v, union, bits, do5, lse, delta, **kw)
  # Integer indices get no cotangent.
  return dq5, dk, dv, None, None, None


_tile_attention_core.defvjp(_core_fwd, _core_bwd)


def effective_tile_queries(config: TileAttentionConfig, group: int) -> int:
  """TQ of a call: the config's, raised so that TQ * G' >= 16."""
  return max(config.tile_queries, 16 // next_pow2(group))


def sparse_attention_tile(
    q: Float[Array, "B T HQ D"],
    k: Float[Array, "B T HKV D"],
    v: Float[Array, "B T HKV D"],
    block_indices: Int[Array, "B T HKV K"],
    *,
    block_size: int,
    scale: float,
    interpret: bool,
    config: TileAttentionConfig | None = None,
) -> Float[Array, "B T HQ D"]:
  """Query-tile twin of `sparse_attention_reference` (Eq. 6); arguments already validated.

  Arguments and result as `attention.sparse_attention_pallas`; config None picks
  `TileAttentionConfig.default`. A block repeated in a query's row is attended once (the
  per-query kernel attends it once per repetition; validated indices hold no repeats).
  """
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  g = hq // hkv
  top_k = block_indices.shape[-1]
  if config is None:
    config = TileAttentionConfig.default(head_dim=d, group=g)
  tile_q = effective_tile_queries(config, g)
  num_blocks = -(-t // block_size)
  block_indices = lax.stop_gradient(block_indices.astype(jnp.int32))
  union, bits, count = tile_index.tile_unions(block_indices, block_size=block_size,
                                              tile_queries=tile_q, num_blocks=num_blocks)
  tile = functools.partial(_tile_path, union=union, bits=bits, count=count,
                           block_size=block_size, scale=scale, interpret=interpret, config=config)
  if config.kernel == "auto":
    query = functools.partial(per_query.sparse_attention_pallas, block_indices=block_indices,
                              block_size=block_size, scale=scale, interpret=interpret)
    prefers = tile_index.prefers_tile_kernel(count, tile_queries=tile_q, top_k=top_k)
    return lax.cond(prefers, tile, query, q, k, v)
  return tile(q, k, v)


def _tile_path(q, k, v, *, union, bits, count, block_size, scale, interpret, config):
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  g = hq // hkv
  gp = next_pow2(g)
  dp = max(16, next_pow2(d))
  dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
  q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
  tp = union.shape[1] * effective_tile_queries(config, g)
  tk = -(-t // block_size) * block_size
  # Autodiff carries the pads and slices below; the kernels see whole tiles, groups and blocks.
  q5 = jnp.pad(q.reshape(b, t, hkv, g, d), ((0, 0), (0, tp - t), (0, 0), (0, gp - g), (0, dp - d)))
  kv_pad = ((0, 0), (0, tk - t), (0, 0), (0, dp - d))
  k, v = jnp.pad(k, kv_pad), jnp.pad(v, kv_pad)
  o5 = _tile_attention_core(q5, k, v, union, bits, count, int(block_size), float(scale), g,
                            bool(interpret), config)
  return o5[:, :t, :, :g, :d].reshape(b, t, hq, d)


def sparse_attention_kernels(
    q: Float[Array, "B T HQ D"],
    k: Float[Array, "B T HKV D"],
    v: Float[Array, "B T HKV D"],
    block_indices: Int[Array, "B T HKV K"],
    *,
    block_size: int,
    scale: float,
    interpret: bool,
    config: per_query.SparseAttentionConfig | TileAttentionConfig | None = None,
) -> Float[Array, "B T HQ D"]:
  """The "pallas" implementation of `sparse_attention`: the config's type picks the kernels.

  None or a `SparseAttentionConfig`: the per-query kernels (the default: on the H200 the tile
  kernels take about 1.0-1.2 x union / K of their time, `tile_index.TILE_TIME_PER_UNION`). A
  `TileAttentionConfig`: the query-tile kernels, always (kernel="tile") or where the rule,
  `tile_index.prefers_tile_kernel`, prefers them (kernel="auto").
  """
  if isinstance(config, TileAttentionConfig):
    return sparse_attention_tile(q, k, v, block_indices, block_size=block_size, scale=scale,
                                 interpret=interpret, config=config)
  if config is not None and not isinstance(config, per_query.SparseAttentionConfig):
    raise ValueError(f"config={config!r} must be None, a SparseAttentionConfig or a "
                     "TileAttentionConfig")
  return per_query.sparse_attention_pallas(q, k, v, block_indices, block_size=block_size,
                                           scale=scale, interpret=interpret, config=config)
