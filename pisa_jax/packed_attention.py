"""Block-sparse attention (Eq. 6) over packed documents: the jnp reference with segment_ids.

block_indices hold document-relative block numbers (what `select_blocks` with the same
segment_ids returns): block i of a document that starts at position s covers its keys
s + i C .. s + i C + C - 1, and a query sees the keys of its own document at or before it. Each
output row, and each row of dq, dk and dv, is its document's own, as if run alone from position 0.

The same computation as the one-document gathered form of `pisa_jax.attention`, in float32, with
the same memory: forward and dq per chunk of queries over the gathered keys, dk and dv key block
by key block through an inverted index (no scatter-add). A document's block need not align with
the key array's blocks: it covers parts of at most two of them, so the inverted index holds two
entries per (query, selected block), one per part, and each part's item masks the keys outside
the document's block. Costs: the forward and dq are the one-document form's; the inverted index
holds 2 T K entries in ceil(2T / C) + M items of K C entries (against T K in ceil(T / C) + M), so
the dk / dv pass does up to 1.5 times the one-document form's work. Packed rows always take this
gathered form (the masked form of short sequences is not used).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pisa_jax import _chunking, segments
from pisa_jax.attention import (attend_selected, chunk_size, dq_selected, group_entries,
                                item_grads, sum_items)


def _selected_keys(positions, q, block_indices, start, k, v, *, block_size):
  """`attention._selected_keys` for packed rows: start `[B, Tc]` is each query's document start.

  A query at document position r = t - start sees key r' of a selected block of its document when
  r' <= r (so the key is in its document and not after it); -1 entries select nothing.
  """
  b, tc, hq, d = q.shape
  seq_len, hkv = k.shape[1], k.shape[2]
  rel = positions[None, :] - start
  key_rel = jnp.maximum(block_indices, 0)[..., None] * block_size + jnp.arange(block_size)
  visible = (block_indices >= 0)[..., None] & (key_rel <= rel[:, :, None, None, None])
  gather_pos = jnp.minimum(start[:, :, None, None, None] + key_rel, seq_len - 1)
  b_idx = jnp.arange(b)[:, None, None, None, None]
  h_idx = jnp.arange(hkv)[None, None, :, None, None]
  # Hidden keys and values are zeroed, so that a NaN among them cannot reach the query.
  k_sel = jnp.where(visible[..., None], k[b_idx, gather_pos, h_idx], 0.0)
  v_sel = jnp.where(visible[..., None], v[b_idx, gather_pos, h_idx], 0.0)
  return q.reshape(b, tc, hkv, hq // hkv, d), k_sel, v_sel, visible


def _forward_chunk(positions, q, block_indices, start, k, v, *, block_size, scale):
  qg, k_sel, v_sel, visible = _selected_keys(positions, q, block_indices, start, k, v,
                                             block_size=block_size)
  out, lse = attend_selected(qg, k_sel, v_sel, visible, scale=scale)
  return out.reshape(q.shape), lse


def _dq_chunk(positions, q, block_indices, start, do, lse, delta, k, v, *, block_size, scale):
  qg, k_sel, v_sel, visible = _selected_keys(positions, q, block_indices, start, k, v,
                                             block_size=block_size)
  return dq_selected(qg, k_sel, v_sel, visible, do, lse, delta, scale=scale).reshape(q.shape)


def _dkv_one_head(q, k, v, block_indices, start, do, lse, delta, *, block_size, scale):
  """dk, dv `[T, D]` for one (batch, KV head) of packed rows: q, do `[T, G, D]`; k, v `[T, D]`;
  block_indices `[T, K]` document-relative; start `[T]`; lse, delta `[T, G]`."""
  seq_len, group, d = q.shape
  top_k = block_indices.shape[-1]
  num_blocks = -(-seq_len // block_size)
  t = jnp.arange(seq_len)
  valid = (block_indices >= 0) & (block_indices <= ((t - start) // block_size)[:, None])
  # [T, K]: the first key of each selected block, and the key-array block that holds it. The
  # selected block's other part lies in the next key-array block when it is not aligned, and
  # matters only if that block starts at or before the query.
  lo = start[:, None] + jnp.maximum(block_indices, 0) * block_size
  first = lo // block_size
  second = valid & (lo % block_size != 0) & ((first + 1) * block_size <= t[:, None])
  entry_block = jnp.stack([jnp.where(valid, first, num_blocks),
                           jnp.where(second, first + 1, num_blocks)], axis=-1).reshape(-1)
  # As in the one-document form, an item holds K * C entries.
  item_size = top_k * block_size
  order, item_block, item_start, item_end, item_offsets = group_entries(
      entry_block, num_blocks=num_blocks, item_size=item_size)
  entry_query = (order // (2 * top_k)).astype(jnp.int32)
  entry_lo = lo.reshape(-1)[order // 2]
  pad = ((0, num_blocks * block_size - seq_len), (0, 0))
  k_blocks = jnp.pad(k, pad).reshape(num_blocks, block_size, d)
  v_blocks = jnp.pad(v, pad).reshape(num_blocks, block_size, d)

  def item_partials(item):
    block, begin, end = item
    entry = begin + jnp.arange(item_size)
    real = entry < end
    clamped = jnp.minimum(entry, entry_query.shape[0] - 1)
    query, lo_e = entry_query[clamped], entry_lo[clamped]
    # [E, G, D]: padding entries are zeroed (0 * NaN would otherwise reach the block's sums).
    q_e = jnp.where(real[:, None, None], q[query], 0.0)
    do_e = jnp.where(real[:, None, None], do[query], 0.0)
    key_pos = block * block_size + jnp.arange(block_size)
    # The keys of this part: inside the selected block [lo, lo + C) and not after the query.
    visible = (real[:, None] & (key_pos[None, :] >= lo_e[:, None])
               & (key_pos[None, :] < lo_e[:, None] + block_size)
               & (key_pos[None, :] <= query[:, None]))[:, None, :]  # [E, 1, C]
    return item_grads(q_e, do_e, query, block, visible, k_blocks, v_blocks, lse, delta,
                      scale=scale)

  dk_parts, dv_parts = lax.map(item_partials, (item_block, item_start, item_end))
  dk = sum_items(dk_parts, item_block, item_offsets).reshape(-1, d)[:seq_len]
  dv = sum_items(dv_parts, item_block, item_offsets).reshape(-1, d)[:seq_len]
  return dk, dv


def _forward(q, k, v, block_indices, start, block_size, scale):
  fn = functools.partial(_forward_chunk, block_size=block_size, scale=scale)
  chunk = chunk_size(q, k, block_indices.shape[-1], block_size)
  return _chunking.map_query_chunks(fn, chunk, (q, block_indices, start), (k, v))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _sparse_attention_f32(q, k, v, block_indices, start, block_size, scale):
  """Eq. 6 of packed rows on float32 q, k, v; start `[B, T]` is each position's document start."""
  return _forward(q, k, v, block_indices, start, block_size, scale)[0]


def _sparse_attention_fwd(q, k, v, block_indices, start, block_size, scale):
  out, lse = _forward(q, k, v, block_indices, start, block_size, scale)
  return out, (q, k, v, block_indices, start, out, lse)


def _sparse_attention_bwd(block_size, scale, residuals, do):
  q, k, v, block_indices, start, out, lse = residuals
  delta = jnp.sum(out * do, axis=-1).reshape(lse.shape)
  fn = functools.partial(_dq_chunk, block_size=block_size, scale=scale)
  chunk = chunk_size(q, k, block_indices.shape[-1], block_size)
  dq = _chunking.map_query_chunks(fn, chunk, (q, block_indices, start, do, lse, delta), (k, v))
  b, seq_len, hkv, group = lse.shape
  per_head = functools.partial(_dkv_one_head, block_size=block_size, scale=scale)
  # Over the KV heads (axis 1 of each batch entry's arrays; start has none), then the batch.
  per_head = jax.vmap(per_head, in_axes=(1, 1, 1, 1, None, 1, 1, 1), out_axes=1)
  dk, dv = jax.vmap(per_head)(q.reshape(b, seq_len, hkv, group, -1), k, v, block_indices, start,
                              do.reshape(b, seq_len, hkv, group, -1), lse, delta)
  # The indices and the document starts are integers: no cotangent.
  return dq, dk, dv, None, None


_sparse_attention_f32.defvjp(_sparse_attention_fwd, _sparse_attention_bwd)


@functools.partial(jax.jit, static_argnames=("block_size", "scale"))
def sparse_attention_packed_reference(q, k, v, block_indices, segment_ids, *, block_size: int,
                                      scale: float):
  """jnp reference of `sparse_attention` with segment_ids; arguments are already validated.

  Float32 throughout, output and gradients rounded to the input dtype once, as the one-document
  reference; its gradients are bit-identical run to run (no scatter-add).
  """
  block_indices = lax.stop_gradient(block_indices.astype(jnp.int32))
  start, _ = segments.document_bounds(segment_ids)
  q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
  out = _sparse_attention_f32(q32, k32, v32, block_indices, start, block_size, scale)
  return out.astype(q.dtype)
