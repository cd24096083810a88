"""Pallas (Triton) HiLS attention: a window plus selected chunks in one two-level softmax.

The attention twin of `pisa_jax.hils` (its `_attend_rows` given the chunks): for query t, a KV
head and its G query heads, one program streams the window's chunk-grid blocks and then the
selected chunks through one base-2 online softmax that starts with the zero logit (softmax1:
m = 0, l = 1). A selected chunk is one C-key tile, so its own log-sum-exp log Z_ic is exact in
the tile, and its keys enter with logits s_ij - log Z_ic + s^_ic: together they weigh e^{s^_ic},
the two-level softmax w_ij = [e^{s_ij} / Z_ic] [e^{s^_ic} / denominator]. The chunk score
s^_ic = lq_i . k'_c * scale + b'_c is a `[G, D]` row-wise dot of the group's landmark queries
with the chunk's landmark keys (per query head), computed where it is used: the `[T, HQ, K]`
scores are never an input.

The block list of a query is the window's `NW` chunk-grid blocks (from its first eligible block,
-1 past the query's own block) followed by the K selected chunks: the layout of
`kernels.attention` (one program per (query, KV head), G heads as dot rows padded to >= 16,
blocks loaded as C contiguous rows from the document start) with a per-slot logit offset.

Backward (the selection held fixed). With P the final weights, delta = rowsum(o * do) and, for a
chunk, delta_c = sum_{j in c} pi_j dp_j (pi the chunk-local softmax, dp = do . v):
  window key:  ds_j = P_j (dp_j - delta);
  chunk key:   ds_j = P_j (dp_j - delta_c)   (log Z_ic depends on s: its term cancels delta);
  chunk score: ds^_ic = W_ic (delta_c - delta), W_ic = e^{s^_ic} / denominator.
So every key's gradient is a plain attention backward with a per-(query, slot) log-sum-exp
(lse, or log Z_ic - s^_ic + lse for a chunk) and delta: the dq kernel re-streams a query's blocks
and also writes ds^ and the landmark query's gradient scale * sum_c ds^_ic k'_c; dk / dv run over
an inverted index of the block lists (work items of at most `items_entries` entries, float32
partials summed in a fixed order: no atomics, bit-identical), as `kernels.attention_backward`.
The landmark keys' and biases' gradients (scale * sum_t ds^_tc lq_t, sum_t ds^_tc) come from a
third index, grouped by landmark slot, and a kernel that sums each slot's (query, head) rows.

Packed documents: each query's document start and its document's first landmark slot are
per-query inputs; a block starts at start + i C (aligned to nothing) and the `key <= query`
compare masks everything outside the document, as in `kernels.attention`. Their dk / dv items
load the 2C keys of the two array blocks a document block may touch and mask each entry to its
block's C keys.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pisa_jax import checkpoint_names
from pisa_jax.kernels._common import (LOG2E, call_kernel, dkv_tile_step, dot_precision,
                                      next_pow2)
from pisa_jax.kernels.attention import _block_slot, _load_rows, _store_rows
from pisa_jax.kernels.attention_backward import _group_by_block, _reduce_kernel


@dataclasses.dataclass(frozen=True)
class HiLSAttentionConfig:
  """Tile sizes and Triton launch parameters of the HiLS attention kernels.

  Attributes:
    min_rows: the smallest M of a tensor-core dot: the G heads of a program are padded to
      max(min_rows, next power of two of G).
    fwd_num_warps, fwd_num_stages, dq_num_warps, dq_num_stages: forward and dq launches.
    dkv_rows: (query, head) rows per inner step of the dk / dv kernel, a power of two >= G.
    dkv_num_warps, dkv_num_stages: dk / dv launch (packed rows take twice the warps: 2C keys).
    items_entries: most entries (query, block) of one dk / dv program.
  """

  min_rows: int = 16
  fwd_num_warps: int = 4
  fwd_num_stages: int = 2
  dq_num_warps: int = 4
  dq_num_stages: int = 2
  dkv_rows: int = 64
  dkv_num_warps: int = 4
  dkv_num_stages: int = 2
  items_entries: int = 512

  def __post_init__(self):
    for name in ("min_rows", "dkv_rows", "fwd_num_warps", "dq_num_warps", "dkv_num_warps"):
      value = getattr(self, name)
      if value < 1 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= 1")
    if self.items_entries < 1:
      raise ValueError(f"items_entries={self.items_entries} must be >= 1")

  @classmethod
  def default(cls, *, head_dim: int, group: int, num_blocks: int, chunk_size: int
              ) -> "HiLSAttentionConfig":
    """`kernels.attention`'s whole-block launch, untuned here: 2 warps hold a `[16, C]` tile at
    d <= 64, 4 at d = 128 (its 1-warp setting needs 16-key steps, which a chunk's exact
    log-sum-exp in one tile does not take); `benchmarks.hils` times the result."""
    dp = next_pow2(max(16, head_dim))
    warps = 2 if dp <= 64 else 4
    return cls(fwd_num_warps=warps, dq_num_warps=warps, dkv_rows=max(64, next_pow2(group)),
               items_entries=max(64, num_blocks * chunk_size))


# ----------------------------------------------------------------------------- shared pieces


def _chunk_score2(b_lq, lk_ref, lb_ref, slot, group: int, rows: int, scale: float):
  """s^ of the G heads against the landmark in `slot`, base 2: `[R]` (padded rows 0)."""
  b_lk = _load_rows(lk_ref, slot, group, rows)
  b_lb = _load_rows(lb_ref, slot, group, rows)
  return (jnp.sum(b_lq * b_lk, axis=1) * scale + b_lb) * LOG2E, b_lk


def _landmark_slot(blk_ref, t, i, slot0, num_slots: int):
  """The landmark slot of block slot i of query t: its document's first slot + the chunk."""
  return jnp.clip(jnp.maximum(blk_ref[t, i], 0) + slot0, 0, num_slots - 1)


def _load_slot_row(ref, t, i, group: int, rows: int):
  """Row `[R]` of ref `[T, K, G]` at (t, i), padded rows 0."""
  if rows == group:
    return ref[t, i]
  return plt.load(ref.at[t, i, pl.ds(0, rows)], mask=jnp.arange(rows) < group, other=0.0)


def _store_slot_row(ref, t, i, value, group: int, rows: int):
  if rows == group:
    ref[t, i] = value
  else:
    plt.store(ref.at[t, i, pl.ds(0, rows)], value, mask=jnp.arange(rows) < group)


def _split_refs(refs, packed: bool):
  """(start_ref, slot0_ref, outputs...): the packed rows' per-query inputs, None if absent."""
  if packed:
    return refs[0], refs[1], refs[2:]
  return None, None, refs


# ----------------------------------------------------------------------------- forward kernel


def _fwd_kernel(q_ref, lq_ref, k_ref, v_ref, blk_ref, lk_ref, lb_ref, *refs, chunk_size: int,
                scale: float, group: int, rows: int, num_window: int, top_k: int,
                packed: bool):
  """One program: query t, KV head h. q_ref, lq_ref `[T, G, D]`, k_ref, v_ref `[Tk, D]`,
  blk_ref `[T, NW + K]`, lk_ref `[N, G, D]` float32, lb_ref `[N, G]` float32; packed rows add
  start_ref and slot0_ref `[T]`. Writes o `[T, G, D]`, lse2 `[T, G]` (base 2, the zero logit
  included) and res2 `[T, K, G]`: log2 Z_ic - s^_ic * log2 e of each chunk slot (0 if empty)."""
  start_ref, slot0_ref, (o_ref, lse_ref, res_ref) = _split_refs(refs, packed)
  t = pl.program_id(0)
  doc_start = start_ref[t] if packed else None
  slot0 = slot0_ref[t] if packed else 0
  num_slots = lk_ref.shape[0]
  # [R, D]
  b_q = _load_rows(q_ref, t, group, rows)
  b_lq = _load_rows(lq_ref, t, group, rows).astype(jnp.float32)
  precision = dot_precision(b_q.dtype)
  qk_scale = scale * LOG2E
  d = b_q.shape[-1]

  def load_block(i):
    start, visible = _block_slot(blk_ref, t, i, chunk_size, doc_start=doc_start)
    b_k = k_ref[pl.ds(start, chunk_size), :]
    # Values of hidden keys load as zeros: their weight is 0, but 0 * NaN = NaN.
    b_v = plt.load(v_ref.at[pl.ds(start, chunk_size), :], mask=visible[:, None], other=0.0)
    # [R, C] base-2 logits
    b_s = jnp.dot(b_q, b_k.T, precision=precision, preferred_element_type=jnp.float32) * qk_scale
    return jnp.where(visible[None, :], b_s, -jnp.inf), b_v, visible

  def update(carry, b_a, b_v):
    # The running max starts at the zero logit's 0, so it is always finite.
    b_m, b_l, b_acc = carry
    m_new = jnp.maximum(b_m, jnp.max(b_a, axis=1))
    alpha = jnp.exp2(b_m - m_new)
    b_p = jnp.exp2(b_a - m_new[:, None])
    b_l = b_l * alpha + jnp.sum(b_p, axis=1)
    b_acc = b_acc * alpha[:, None] + jnp.dot(
        b_p.astype(b_v.dtype), b_v, precision=precision, preferred_element_type=jnp.float32)
    return m_new, b_l, b_acc

  def window_body(i, carry):
    b_s, b_v, _ = load_block(i)
    return update(carry, b_s, b_v)

  def chunk_body(kk, carry):
    i = num_window + kk
    b_s, b_v, visible = load_block(i)
    shat2, _ = _chunk_score2(b_lq, lk_ref, lb_ref, _landmark_slot(blk_ref, t, i, slot0, num_slots),
                             group, rows, scale)
    # The chunk's own log-sum-exp (log Z_ic): the whole chunk is this tile.
    m_c = jnp.max(b_s, axis=1)
    m_c = jnp.where(m_c == -jnp.inf, 0.0, m_c)
    l_c = jnp.sum(jnp.exp2(b_s - m_c[:, None]), axis=1)
    has = l_c > 0
    res2 = jnp.where(has, m_c + jnp.log2(jnp.where(has, l_c, 1.0)) - shat2, 0.0)
    _store_slot_row(res_ref, t, kk, res2, group, rows)
    # s_ij - log Z_ic + s^_ic
    b_a = jnp.where(visible[None, :], b_s - res2[:, None], -jnp.inf)
    return update(carry, b_a, b_v)

  init = (jnp.zeros((rows,), jnp.float32), jnp.ones((rows,), jnp.float32),
          jnp.zeros((rows, d), jnp.float32))
  carry = lax.fori_loop(0, num_window, window_body, init)
  b_m, b_l, b_acc = lax.fori_loop(0, top_k, chunk_body, carry)
  _store_rows(o_ref, t, (b_acc / b_l[:, None]).astype(o_ref.dtype), group, rows)
  _store_rows(lse_ref, t, b_m + jnp.log2(b_l), group, rows)


# ----------------------------------------------------------------------------- dq kernel


def _dq_kernel(q_ref, lq_ref, k_ref, v_ref, blk_ref, lk_ref, lb_ref, o_ref, do_ref, lse_ref,
               res_ref, *refs, chunk_size: int, scale: float, group: int, rows: int,
               num_window: int, top_k: int, packed: bool):
  """One program: query t, KV head h. Writes dq and dlq `[T, G, D]`, delta `[T, G]`, and per
  chunk slot delta_c and ds^ `[T, K, G]` (the module docstring's rules)."""
  start_ref, slot0_ref, (dq_ref, dlq_ref, delta_ref, delta_c_ref, dshat_ref) = _split_refs(
      refs, packed)
  t = pl.program_id(0)
  doc_start = start_ref[t] if packed else None
  slot0 = slot0_ref[t] if packed else 0
  num_slots = lk_ref.shape[0]
  b_q = _load_rows(q_ref, t, group, rows)
  b_lq = _load_rows(lq_ref, t, group, rows).astype(jnp.float32)
  b_do = _load_rows(do_ref, t, group, rows)
  b_o = _load_rows(o_ref, t, group, rows)
  # [R]
  b_delta = jnp.sum(b_o.astype(jnp.float32) * b_do.astype(jnp.float32), axis=1)
  b_lse2 = _load_rows(lse_ref, t, group, rows)
  precision = dot_precision(b_q.dtype)
  qk_scale = scale * LOG2E
  d = b_q.shape[-1]

  def load_block(i):
    start, visible = _block_slot(blk_ref, t, i, chunk_size, doc_start=doc_start)
    # Hidden keys load as zeros: ds = 0 does not cancel a NaN key in ds @ k (0 * NaN = NaN).
    b_k = plt.load(k_ref.at[pl.ds(start, chunk_size), :], mask=visible[:, None], other=0.0)
    b_v = v_ref[pl.ds(start, chunk_size), :]
    b_s = jnp.dot(b_q, b_k.T, precision=precision, preferred_element_type=jnp.float32) * qk_scale
    # A hidden key's dp is NaN when its value is: masked before any product.
    b_dp = jnp.dot(b_do, b_v.T, precision=precision, preferred_element_type=jnp.float32)
    return b_s, jnp.where(visible[None, :], b_dp, 0.0), b_k, visible

  def window_body(i, b_dq):
    b_s, b_dp, b_k, visible = load_block(i)
    b_p = jnp.where(visible[None, :], jnp.exp2(b_s - b_lse2[:, None]), 0.0)
    b_ds = b_p * (b_dp - b_delta[:, None])
    return b_dq + jnp.dot(b_ds.astype(b_k.dtype), b_k, precision=precision,
                          preferred_element_type=jnp.float32)

  def chunk_body(kk, carry):
    b_dq, b_dlq = carry
    i = num_window + kk
    b_s, b_dp, b_k, visible = load_block(i)
    shat2, b_lk = _chunk_score2(b_lq, lk_ref, lb_ref,
                                _landmark_slot(blk_ref, t, i, slot0, num_slots), group, rows,
                                scale)
    res2 = _load_slot_row(res_ref, t, kk, group, rows)
    # pi: the chunk-local softmax; P = W pi the final weights.
    b_pi = jnp.where(visible[None, :], jnp.exp2(b_s - (res2 + shat2)[:, None]), 0.0)
    b_p = jnp.where(visible[None, :], jnp.exp2(b_s - (res2 + b_lse2)[:, None]), 0.0)
    delta_c = jnp.sum(b_pi * b_dp, axis=1)
    b_ds = b_p * (b_dp - delta_c[:, None])
    valid = jnp.max(visible.astype(jnp.int32)) > 0
    w = jnp.where(valid, jnp.exp2(shat2 - b_lse2), 0.0)
    dshat = w * (delta_c - b_delta)
    _store_slot_row(delta_c_ref, t, kk, delta_c, group, rows)
    _store_slot_row(dshat_ref, t, kk, dshat, group, rows)
    b_dq = b_dq + jnp.dot(b_ds.astype(b_k.dtype), b_k, precision=precision,
                          preferred_element_type=jnp.float32)
    return b_dq, b_dlq + dshat[:, None] * b_lk

  zeros = jnp.zeros((rows, d), jnp.float32)
  b_dq = lax.fori_loop(0, num_window, window_body, zeros)
  b_dq, b_dlq = lax.fori_loop(0, top_k, chunk_body, (b_dq, zeros))
  _store_rows(dq_ref, t, (b_dq * scale).astype(dq_ref.dtype), group, rows)
  _store_rows(dlq_ref, t, (b_dlq * scale).astype(dlq_ref.dtype), group, rows)
  _store_rows(delta_ref, t, b_delta, group, rows)


# ----------------------------------------------------------------------------- dk / dv


def block_list_index(blocks: Int[Array, "B T HKV NB"], starts, *, num_blocks: int,
                     chunk_size: int, items_entries: int):
  """For each (batch, KV head, key-array block), the (query, slot) entries whose block covers
  it, grouped and cut into work items (`attention_backward.inverted_index`'s layout).

  blocks: document-relative block numbers, -1 empty; starts: None or `[B, T]` document starts
  (packed: an entry is listed under the array block of its first key lo, sorted by lo).

  Returns entry_query, entry_slot `[B, HKV, T * NB]`, item_block, item_start, item_end
  `[B, HKV, NI]`, item_offsets `[B, HKV, M + 1]` and entry_lo (None when not packed).
  """
  b, t, hkv, nb = blocks.shape
  num_items = -(-t * nb // items_entries) + num_blocks
  pos = jnp.arange(t, dtype=jnp.int32)[None, :, None, None]
  start = 0 if starts is None else starts[:, :, None, None]
  valid = (blocks >= 0) & (blocks <= (pos - start) // chunk_size)
  lo = start + jnp.maximum(blocks, 0) * chunk_size
  # t-major then slot: the stable sort keeps queries ascending within a block.
  lo_flat = jnp.where(valid, lo, num_blocks * chunk_size).transpose(0, 2, 1, 3).reshape(
      b, hkv, t * nb)
  order, item_block, item_start, item_end, item_offsets = _group_by_block(
      lo_flat // chunk_size, num_blocks=num_blocks, items_entries=items_entries,
      num_items=num_items, sort_key=lo_flat)
  entry_lo = None if starts is None else jnp.take_along_axis(lo_flat, order, axis=-1)
  return order // nb, order % nb, item_block, item_start, item_end, item_offsets, entry_lo


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, entry_ref, slot_ref, blk_ref,
                start_ref, end_ref, *refs, chunk_size: int, scale: float, group: int, rows: int,
                packed: bool):
  """One program: one work item (a key-array block and a run of its entries). lse_ref and
  delta_ref `[T, NB, G]`: each (query, slot)'s base-2 log-sum-exp and delta. Rows are
  (entry, head) pairs; writes float32 partials (`window` = C rows, 2C packed), dk unscaled."""
  if packed:
    lo_ref, dk_ref, dv_ref = refs
  else:
    dk_ref, dv_ref = refs
  i = pl.program_id(0)
  n = blk_ref[i]
  first = start_ref[i]
  last = end_ref[i]
  per_step = rows // group
  qk_scale = scale * LOG2E
  d = k_ref.shape[-1]
  window = dk_ref.shape[0]
  o_r = jnp.arange(rows)
  o_j = o_r // group
  o_g = o_r % group
  o_d = jnp.arange(d)
  start = pl.multiple_of(n * chunk_size, chunk_size)
  b_k = k_ref[pl.ds(start, window), :]
  b_v = v_ref[pl.ds(start, window), :]
  precision = dot_precision(b_k.dtype)
  key_pos = start + jnp.arange(window)

  def body(step, carry):
    b_dk, b_dv = carry
    entry = first + step * per_step + o_j
    m_r = (o_j < per_step) & (entry < last)
    o_e = jnp.where(m_r, entry, first)
    o_t = entry_ref[o_e]
    o_s = slot_ref[o_e]
    m_rd = m_r[:, None] & (o_d[None, :] < d)
    i_t = jnp.broadcast_to(o_t[:, None], (rows, d))
    i_g = jnp.broadcast_to(o_g[:, None], (rows, d))
    i_d = jnp.broadcast_to(o_d[None, :], (rows, d))
    b_q = plt.load(q_ref.at[i_t, i_g, i_d], mask=m_rd, other=0.0)
    b_do = plt.load(do_ref.at[i_t, i_g, i_d], mask=m_rd, other=0.0)
    b_lse2 = plt.load(lse_ref.at[o_t, o_s, o_g], mask=m_r, other=0.0)
    b_delta = plt.load(delta_ref.at[o_t, o_s, o_g], mask=m_r, other=0.0)
    def visible_of():
      visible = m_r[None, :] & (key_pos[:, None] <= o_t[None, :])
      if packed:
        o_lo = lo_ref[o_e]
        visible = visible & (key_pos[:, None] >= o_lo[None, :]) & (
            key_pos[:, None] < o_lo[None, :] + chunk_size)
      return visible

    return dkv_tile_step(b_k, b_v, b_q, b_do, b_lse2, b_delta, visible_of, b_dk, b_dv,
                         qk_scale=qk_scale, precision=precision)

  num_steps = (last - first + per_step - 1) // per_step
  zeros = jnp.zeros((window, d), jnp.float32)
  dk_ref[...], dv_ref[...] = lax.fori_loop(0, num_steps, body, (zeros, zeros))


def _backward_dkv(q5, k, v, do5, blocks, starts, lse_e, delta_e, *, chunk_size, scale,
                  interpret, config):
  """dk, dv like k, v `[B, Tk, HKV, D]` from the per-(query, slot) lse_e, delta_e
  `[B, T, HKV, NB, G]`."""
  b, t, hkv, g, d = q5.shape
  tk = k.shape[1]
  nb = blocks.shape[-1]
  num_blocks = tk // chunk_size
  packed = starts is not None
  window = 2 * chunk_size if packed else chunk_size
  rows = max(config.dkv_rows, next_pow2(g))
  entry_t, entry_slot, item_block, item_start, item_end, item_offsets, entry_lo = (
      block_list_index(blocks, starts, num_blocks=num_blocks, chunk_size=chunk_size,
                       items_entries=config.items_entries))
  num_items = item_block.shape[-1]
  num_entries = entry_t.shape[-1]
  q_spec = pl.BlockSpec((None, t, None, g, d), lambda i, h, bb: (bb, 0, h, 0, 0))
  kv_spec = pl.BlockSpec((None, tk, None, d), lambda i, h, bb: (bb, 0, h, 0))
  slot_spec = pl.BlockSpec((None, t, None, nb, g), lambda i, h, bb: (bb, 0, h, 0, 0))
  entry_spec = pl.BlockSpec((None, None, num_entries), lambda i, h, bb: (bb, h, 0))
  item_spec = pl.BlockSpec((None, None, num_items), lambda i, h, bb: (bb, h, 0))
  part_spec = pl.BlockSpec((None, None, None, window, d), lambda i, h, bb: (bb, h, i, 0, 0))
  part_shape = jax.ShapeDtypeStruct((b, hkv, num_items, window, d), jnp.float32)
  extra = (entry_lo,) if packed else ()
  kernel = functools.partial(_dkv_kernel, chunk_size=chunk_size, scale=scale, group=g, rows=rows,
                             packed=packed)
  dk_part, dv_part = call_kernel(pl.pallas_call(
      kernel,
      grid=(num_items, hkv, b),
      in_specs=[q_spec, kv_spec, kv_spec, q_spec, slot_spec, slot_spec, entry_spec, entry_spec,
                item_spec, item_spec, item_spec] + [entry_spec] * len(extra),
      out_specs=[part_spec, part_spec],
      out_shape=[part_shape, part_shape],
      compiler_params=plt.CompilerParams(num_warps=config.dkv_num_warps * (1 + packed),
                                         num_stages=config.dkv_num_stages),
      interpret=interpret,
      name="hils_attention_dkv" + ("_packed" if packed else ""),
  ), q5, k, v, do5, lse_e, delta_e, entry_t, entry_slot, item_block, item_start, item_end,
      *extra)
  offsets_spec = pl.BlockSpec((None, None, num_blocks + 1), lambda n, h, bb: (bb, h, 0))
  parts_spec = pl.BlockSpec((None, None, num_items, window, d), lambda n, h, bb: (bb, h, 0, 0, 0))
  out_spec = pl.BlockSpec((None, chunk_size, None, d), lambda n, h, bb: (bb, n, h, 0))
  return call_kernel(pl.pallas_call(
      functools.partial(_reduce_kernel, scale=scale, packed=packed),
      grid=(num_blocks, hkv, b),
      in_specs=[offsets_spec, parts_spec, parts_spec],
      out_specs=[out_spec, out_spec],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="hils_attention_dkv_reduce" + ("_packed" if packed else ""),
  ), item_offsets, dk_part, dv_part)


# ----------------------------------------------------------------------------- launches


def _specs(t, tk, n, g, d, nb, top_k, packed):
  q_spec = pl.BlockSpec((None, t, None, g, d), lambda i, h, bb: (bb, 0, h, 0, 0))
  kv_spec = pl.BlockSpec((None, tk, None, d), lambda i, h, bb: (bb, 0, h, 0))
  blk_spec = pl.BlockSpec((None, t, None, nb), lambda i, h, bb: (bb, 0, h, 0))
  lk_spec = pl.BlockSpec((None, n, None, g, d), lambda i, h, bb: (bb, 0, h, 0, 0))
  lb_spec = pl.BlockSpec((None, n, None, g), lambda i, h, bb: (bb, 0, h, 0))
  lse_spec = pl.BlockSpec((None, t, None, g), lambda i, h, bb: (bb, 0, h, 0))
  slot_spec = pl.BlockSpec((None, t, None, top_k, g), lambda i, h, bb: (bb, 0, h, 0, 0))
  row_specs = [pl.BlockSpec((None, t), lambda i, h, bb: (bb, 0))] * (2 * packed)
  return q_spec, kv_spec, blk_spec, lk_spec, lb_spec, lse_spec, slot_spec, row_specs


def _forward(q5, lq5, k, v, blocks, lk5, lb4, starts, slot0, *, chunk_size, num_window, scale,
             interpret, config):
  b, t, hkv, g, d = q5.shape
  tk, n, nb = k.shape[1], lk5.shape[1], blocks.shape[-1]
  top_k = nb - num_window
  packed = starts is not None
  rows = max(config.min_rows, next_pow2(g))
  q_spec, kv_spec, blk_spec, lk_spec, lb_spec, lse_spec, slot_spec, row_specs = _specs(
      t, tk, n, g, d, nb, top_k, packed)
  kernel = functools.partial(_fwd_kernel, chunk_size=chunk_size, scale=scale, group=g, rows=rows,
                             num_window=num_window, top_k=top_k, packed=packed)
  call = pl.pallas_call(
      kernel,
      grid=(t, hkv, b),
      in_specs=[q_spec, q_spec, kv_spec, kv_spec, blk_spec, lk_spec, lb_spec] + row_specs,
      out_specs=[q_spec, lse_spec, slot_spec],
      out_shape=[jax.ShapeDtypeStruct(q5.shape, q5.dtype),
                 jax.ShapeDtypeStruct((b, t, hkv, g), jnp.float32),
                 jax.ShapeDtypeStruct((b, t, hkv, top_k, g), jnp.float32)],
      compiler_params=plt.CompilerParams(num_warps=config.fwd_num_warps,
                                         num_stages=config.fwd_num_stages),
      interpret=interpret,
      name="hils_attention_fwd" + ("_packed" if packed else ""),
  )
  rows_args = (starts, slot0) if packed else ()
  return call_kernel(call, q5, lq5, k, v, blocks, lk5, lb4, *rows_args)


def _backward_dq(q5, lq5, k, v, blocks, lk5, lb4, starts, slot0, o5, do5, lse2, res2, *,
                 chunk_size, num_window, scale, interpret, config):
  b, t, hkv, g, d = q5.shape
  tk, n, nb = k.shape[1], lk5.shape[1], blocks.shape[-1]
  top_k = nb - num_window
  packed = starts is not None
  rows = max(config.min_rows, next_pow2(g))
  q_spec, kv_spec, blk_spec, lk_spec, lb_spec, lse_spec, slot_spec, row_specs = _specs(
      t, tk, n, g, d, nb, top_k, packed)
  kernel = functools.partial(_dq_kernel, chunk_size=chunk_size, scale=scale, group=g, rows=rows,
                             num_window=num_window, top_k=top_k, packed=packed)
  per_slot = jax.ShapeDtypeStruct((b, t, hkv, top_k, g), jnp.float32)
  call = pl.pallas_call(
      kernel,
      grid=(t, hkv, b),
      in_specs=[q_spec, q_spec, kv_spec, kv_spec, blk_spec, lk_spec, lb_spec, q_spec, q_spec,
                lse_spec, slot_spec] + row_specs,
      out_specs=[q_spec, q_spec, lse_spec, slot_spec, slot_spec],
      out_shape=[jax.ShapeDtypeStruct(q5.shape, q5.dtype),
                 jax.ShapeDtypeStruct(q5.shape, jnp.float32),
                 jax.ShapeDtypeStruct((b, t, hkv, g), jnp.float32), per_slot, per_slot],
      compiler_params=plt.CompilerParams(num_warps=config.dq_num_warps,
                                         num_stages=config.dq_num_stages),
      interpret=interpret,
      name="hils_attention_dq" + ("_packed" if packed else ""),
  )
  rows_args = (starts, slot0) if packed else ()
  return call_kernel(call, q5, lq5, k, v, blocks, lk5, lb4, o5, do5, lse2, res2, *rows_args)


# ----------------------------------------------------------------------------- custom_vjp op


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11, 12, 13))
def _core(q5, lq5, k, v, lk5, lb4, blocks, starts, slot0, chunk_size, num_window, scale,
          interpret, config):
  o5, _, _ = _forward(q5, lq5, k, v, blocks, lk5, lb4, starts, slot0, chunk_size=chunk_size,
                      num_window=num_window, scale=scale, interpret=interpret, config=config)
  return o5


_forward_jit = jax.jit(_forward, static_argnames=("chunk_size", "num_window", "scale",
                                                  "interpret", "config"))


def _core_fwd(q5, lq5, k, v, lk5, lb4, blocks, starts, slot0, chunk_size, num_window, scale,
              interpret, config):
  o5, lse2, res2 = _forward_jit(q5, lq5, k, v, blocks, lk5, lb4, starts, slot0,
                                chunk_size=chunk_size, num_window=num_window, scale=scale,
                                interpret=interpret, config=config)
  o5 = checkpoint_name(o5, checkpoint_names.ATTENTION_OUT)
  lse2 = checkpoint_name(lse2, checkpoint_names.ATTENTION_LSE)
  return o5, (q5, lq5, k, v, lk5, lb4, blocks, starts, slot0, o5, lse2, res2)


def _core_bwd(chunk_size, num_window, scale, interpret, config, residuals, do5):
  q5, lq5, k, v, lk5, lb4, blocks, starts, slot0, o5, lse2, res2 = residuals
  do5 = do5.astype(q5.dtype)
  dq5, dlq5, delta, delta_c, dshat = _backward_dq(
      q5, lq5, k, v, blocks, lk5, lb4, starts, slot0, o5, do5, lse2, res2,
      chunk_size=chunk_size, num_window=num_window, scale=scale, interpret=interpret,
      config=config)
  # Per (query, slot): a window block's lse and delta are the query's, a chunk's
  # log2 Z_ic - s^_ic log2 e + lse2 and delta_c.
  lse_e = jnp.concatenate([jnp.broadcast_to(lse2[:, :, :, None], lse2.shape[:3] + (
      num_window,) + lse2.shape[3:]), res2 + lse2[:, :, :, None]], axis=3)
  delta_e = jnp.concatenate([jnp.broadcast_to(delta[:, :, :, None], delta.shape[:3] + (
      num_window,) + delta.shape[3:]), delta_c], axis=3)
  dk, dv = _backward_dkv(q5, k, v, do5, blocks, starts, lse_e, delta_e, chunk_size=chunk_size,
                         scale=scale, interpret=interpret, config=config)
  dlk5, dlb4 = _landmark_cotangents(lq5, blocks[..., num_window:], slot0, dshat, lk5.shape[1],
                                    scale=scale, interpret=interpret, config=config)
  return (dq5, dlq5.astype(lq5.dtype), dk, dv, dlk5.astype(lk5.dtype), dlb4.astype(lb4.dtype),
          None, None, None)


_core.defvjp(_core_fwd, _core_bwd)


def _landmark_grad_kernel(lq_ref, dshat_ref, entry_ref, blk_ref, start_ref, end_ref, dlk_ref,
                          dlb_ref, *, group: int, rows: int, top_k: int):
  """One program: one work item (a landmark slot and a run of the (query, chunk slot) entries
  that selected it). Rows are (entry, head) pairs; writes the item's float32 partials
  sum ds^ lq `[Gp, D]` (unscaled) and sum ds^ `[Gp]`."""
  i = pl.program_id(0)
  first = start_ref[i]
  last = end_ref[i]
  per_step = rows // group
  d = lq_ref.shape[-1]
  gp = dlk_ref.shape[0]
  o_r = jnp.arange(rows)
  o_j = o_r // group
  o_g = o_r % group
  o_d = jnp.arange(d)

  def body(step, carry):
    b_acc, b_sum = carry
    entry = first + step * per_step + o_j
    m_r = (o_j < per_step) & (entry < last)
    o_e = entry_ref[jnp.where(m_r, entry, first)]
    o_t, o_k = o_e // top_k, o_e % top_k
    m_rd = m_r[:, None] & (o_d[None, :] < d)
    b_lq = plt.load(lq_ref.at[jnp.broadcast_to(o_t[:, None], (rows, d)),
                              jnp.broadcast_to(o_g[:, None], (rows, d)),
                              jnp.broadcast_to(o_d[None, :], (rows, d))], mask=m_rd, other=0.0)
    b_ds = plt.load(dshat_ref.at[o_t, o_k, o_g], mask=m_r, other=0.0)
    return b_acc + b_ds[:, None] * b_lq.astype(jnp.float32), b_sum + b_ds

  num_steps = (last - first + per_step - 1) // per_step
  b_acc, b_sum = lax.fori_loop(0, num_steps, body, (jnp.zeros((rows, d), jnp.float32),
                                                    jnp.zeros((rows,), jnp.float32)))
  # Rows to heads once per item: [Gp, R] one-hot sums in float32.
  hit = o_g[None, :] == jnp.arange(gp)[:, None]
  dlk_ref[...] = jnp.sum(jnp.where(hit[:, :, None], b_acc[None], 0.0), axis=1)
  dlb_ref[...] = jnp.sum(jnp.where(hit, b_sum[None, :], 0.0), axis=1)


def _landmark_reduce_kernel(item_offsets_ref, dlk_part_ref, dlb_part_ref, dlk_ref, dlb_ref, *,
                            scale: float):
  """Sums the partials of landmark slot n in item order (deterministic), applies the scale."""
  n = pl.program_id(0)

  def body(i, carry):
    return carry[0] + dlk_part_ref[i], carry[1] + dlb_part_ref[i]

  b_dlk, b_dlb = lax.fori_loop(item_offsets_ref[n], item_offsets_ref[n + 1], body,
                               (jnp.zeros(dlk_ref.shape, jnp.float32),
                                jnp.zeros(dlb_ref.shape, jnp.float32)))
  dlk_ref[...] = b_dlk * scale
  dlb_ref[...] = b_dlb


def _landmark_cotangents(lq5, chunks, slot0, dshat, num_slots: int, *, scale: float,
                         interpret: bool, config):
  """The landmark keys' and biases' cotangents `[B, N, HKV, G, D]`, `[B, N, HKV, G]` from each
  (query, chunk slot)'s ds^ `[B, T, HKV, K, G]`: scale * sum_t ds^_tc lq_t and sum_t ds^_tc over
  the queries that selected slot c. An inverted index grouped by landmark slot (a document's
  chunk c is slot first_slot + c, so packed rows need nothing more), cut into work items whose
  float32 partials a second kernel sums in a fixed order: T * HQ * K * D multiply-adds, where a
  dense `[T, N]` one-hot matmul per head would move O(T^2 / C) bytes."""
  b, t, hkv, g, d = lq5.shape
  top_k = chunks.shape[-1]
  gp = next_pow2(g)
  rows = max(config.dkv_rows, gp)
  items_entries = config.items_entries
  num_items = -(-t * top_k // items_entries) + num_slots
  slot = chunks + (0 if slot0 is None else slot0[:, :, None, None])
  key = jnp.where(chunks >= 0, slot, num_slots).transpose(0, 2, 1, 3).reshape(b, hkv, t * top_k)
  order, item_block, item_start, item_end, item_offsets = _group_by_block(
      key, num_blocks=num_slots, items_entries=items_entries, num_items=num_items)
  lq_spec = pl.BlockSpec((None, t, None, g, d), lambda i, h, bb: (bb, 0, h, 0, 0))
  ds_spec = pl.BlockSpec((None, t, None, top_k, g), lambda i, h, bb: (bb, 0, h, 0, 0))
  entry_spec = pl.BlockSpec((None, None, t * top_k), lambda i, h, bb: (bb, h, 0))
  item_spec = pl.BlockSpec((None, None, num_items), lambda i, h, bb: (bb, h, 0))
  dlk_part_spec = pl.BlockSpec((None, None, None, gp, d), lambda i, h, bb: (bb, h, i, 0, 0))
  dlb_part_spec = pl.BlockSpec((None, None, None, gp), lambda i, h, bb: (bb, h, i, 0))
  dlk_part, dlb_part = call_kernel(pl.pallas_call(
      functools.partial(_landmark_grad_kernel, group=g, rows=rows, top_k=top_k),
      grid=(num_items, hkv, b),
      in_specs=[lq_spec, ds_spec, entry_spec, item_spec, item_spec, item_spec],
      out_specs=[dlk_part_spec, dlb_part_spec],
      out_shape=[jax.ShapeDtypeStruct((b, hkv, num_items, gp, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, hkv, num_items, gp), jnp.float32)],
      compiler_params=plt.CompilerParams(num_warps=config.dkv_num_warps,
                                         num_stages=config.dkv_num_stages),
      interpret=interpret,
      name="hils_landmark_grad",
  ), lq5, dshat, order, item_block, item_start, item_end)
  dlk, dlb = call_kernel(pl.pallas_call(
      functools.partial(_landmark_reduce_kernel, scale=scale),
      grid=(num_slots, hkv, b),
      in_specs=[pl.BlockSpec((None, None, num_slots + 1), lambda n, h, bb: (bb, h, 0)),
                pl.BlockSpec((None, None, num_items, gp, d), lambda n, h, bb: (bb, h, 0, 0, 0)),
                pl.BlockSpec((None, None, num_items, gp), lambda n, h, bb: (bb, h, 0, 0))],
      out_specs=[pl.BlockSpec((None, None, None, gp, d), lambda n, h, bb: (bb, n, h, 0, 0)),
                 pl.BlockSpec((None, None, None, gp), lambda n, h, bb: (bb, n, h, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, num_slots, hkv, gp, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, num_slots, hkv, gp), jnp.float32)],
      compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="hils_landmark_grad_reduce",
  ), item_offsets, dlk_part, dlb_part)
  return dlk[..., :g, :], dlb[..., :g]


def _window_blocks(seq_len: int, starts, *, chunk_size: int, window: int, num_window: int):
  """The window's chunk-grid blocks of each query, `[B or 1, T, NW]`: from its first eligible
  block, floor((r - W + 1) / C), -1 past its own block r // C (r the document position)."""
  pos = jnp.arange(seq_len, dtype=jnp.int32)[None, :]
  rel = pos - (0 if starts is None else starts)
  first = jnp.maximum((rel - window + 1) // chunk_size, 0)
  blk = first[..., None] + jnp.arange(num_window, dtype=jnp.int32)
  return jnp.where(blk <= (rel // chunk_size)[..., None], blk, -1)


def hils_chunk_attention_pallas(
    q: Float[Array, "B T HQ D"],
    k: Float[Array, "B T HKV D"],
    v: Float[Array, "B T HKV D"],
    landmark_q: Float[Array, "B T HQ D"],
    landmark_k: Float[Array, "B N HQ D"],
    landmark_bias: Float[Array, "B N HQ"],
    chunk_indices: Int[Array, "B T HKV K"],
    starts: Int[Array, "B T"] | None = None,
    first_slot: Int[Array, "B T"] | None = None,
    *,
    chunk_size: int,
    window: int,
    num_window: int,
    scale: float,
    interpret: bool,
    config: HiLSAttentionConfig | None = None,
) -> Float[Array, "B T HQ D"]:
  """HiLS attention of every query over its window and the given chunks; arguments validated.

  Args:
    q, landmark_q: `[B, T, HQ, D]`; k, v: `[B, T, HKV, D]` (one dtype; accumulation float32).
    landmark_k `[B, N, HQ, D]`, landmark_bias `[B, N, HQ]`: the chunks' landmarks (float32 in
      the kernels), slot first_slot + c holding chunk c of a query's document.
    chunk_indices: int32 `[B, T, HKV, K]`, document-relative chunks before the window (-1
      empty); held fixed (no gradient).
    starts, first_slot: None, or int32 `[B, T]` each query's document start and its document's
      first landmark slot (packed rows; both or neither).
    chunk_size, window: C and W; num_window: the window's chunk-grid blocks
      (`pisa_jax.hils.window_chunks`).
    scale: the one logit scale of the attention and the chunk scores.
    interpret: the Pallas interpreter (CPU) instead of Triton; config: None picks the default.

  Returns:
    `[B, T, HQ, D]` in q's dtype, differentiable in q, k, v, landmark_q, landmark_k and
    landmark_bias under `jax.custom_vjp`.
  """
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  g = hq // hkv
  n = landmark_k.shape[1]
  packed = starts is not None
  if packed != (first_slot is not None):
    raise ValueError("starts and first_slot must both be given (packed rows) or both be None")
  dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
  q, k, v, landmark_q = (x.astype(dtype) for x in (q, k, v, landmark_q))
  landmark_k = landmark_k.astype(jnp.float32)
  landmark_bias = landmark_bias.astype(jnp.float32)
  chunk_indices = lax.stop_gradient(chunk_indices.astype(jnp.int32))
  if chunk_indices.shape[-1] == 0:  # no chunk can precede any window: one empty slot
    chunk_indices = jnp.full((b, t, hkv, 1), -1, jnp.int32)
  if n == 0:  # no complete chunk: one zero landmark that no slot reads
    landmark_k = jnp.zeros((b, 1, hq, d), jnp.float32)
    landmark_bias = jnp.zeros((b, 1, hq), jnp.float32)
    n = 1
  win = _window_blocks(t, starts, chunk_size=chunk_size, window=window, num_window=num_window)
  blocks = jnp.concatenate([jnp.broadcast_to(win[:, :, None, :], (b, t, hkv, num_window)),
                            chunk_indices], axis=-1)
  if config is None:
    config = HiLSAttentionConfig.default(head_dim=d, group=g, num_blocks=blocks.shape[-1],
                                         chunk_size=chunk_size)
  # Zero-padded head dims change no dot; keys padded to whole blocks (plus one for packed rows,
  # whose blocks start anywhere and whose dk / dv items load two array blocks).
  dp = max(16, next_pow2(d))
  tk = (-(-t // chunk_size) + packed) * chunk_size
  if dp != d:
    pad = ((0, 0), (0, 0), (0, 0), (0, dp - d))
    q, k, v, landmark_q, landmark_k = (jnp.pad(x, pad) for x in (q, k, v, landmark_q,
                                                                 landmark_k))
  pad = ((0, 0), (0, tk - t), (0, 0), (0, 0))
  k, v = jnp.pad(k, pad), jnp.pad(v, pad)
  if packed:
    starts = lax.stop_gradient(starts.astype(jnp.int32))
    first_slot = lax.stop_gradient(first_slot.astype(jnp.int32))
  o5 = _core(q.reshape(b, t, hkv, g, dp), landmark_q.reshape(b, t, hkv, g, dp), k, v,
             landmark_k.reshape(b, n, hkv, g, dp), landmark_bias.reshape(b, n, hkv, g), blocks,
             starts, first_slot, int(chunk_size), int(num_window), float(scale), bool(interpret),
             config)
  return o5.reshape(b, t, hq, dp)[..., :d]
