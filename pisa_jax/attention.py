"""Block-sparse attention over selected leaf blocks (Eq. 6), and the full PISA layer.

The jnp reference computes in float32 whatever the input dtype and rounds its output (and each
gradient) once. It has two forms of Eq. 6: gathered (each query's K * C selected keys, chunked
over queries, under a `custom_vjp` whose dk and dv go key block by key block through an inverted
index, so that no gradient is a scatter-add) and masked (dense `[T, T]` products under the
selection's mask, for short sequences with finite inputs). The gathered form takes packed
documents (segment_ids) too: one document is the case whose document start is 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from pisa_jax import _chunking, _dispatch, _validation, checkpoint_names, segments
from pisa_jax.selection import select_blocks
from pisa_jax.spec import SelectionSpec

_HIGHEST = lax.Precision.HIGHEST


def _selected_keys(positions, q, block_indices, start, k, v, *, block_size):
  """The keys and values of the blocks each query selected, and which of them it sees.

  Args:
    positions: int32 `[Tc]`, the sequence position of each query.
    q: float32 `[B, Tc, HQ, D]`; block_indices: int32 `[B, Tc, HKV, K]`.
    start: None (one document: the sequence), or int32 `[B, Tc]`, each query's document start
      (packed rows): its block i covers the keys start + i C .. start + i C + C - 1.
    k, v: float32 `[B, T, HKV, D]`, every key.

  Returns:
    qg `[B, Tc, HKV, G, D]`, k_sel and v_sel `[B, Tc, HKV, K, C, D]` and visible
    `[B, Tc, HKV, K, C]`. A query at position t of its document sees key r of a selected block
    of that document when r <= t (so the key is in its document and not after it) and the key
    exists; -1 padding and entries outside [0, t // C] select nothing. Keys and values the query
    does not see are zeroed, so that a NaN among them cannot reach it through a zero weight
    (0 * NaN = NaN).
  """
  b, tc, hq, d = q.shape
  seq_len, hkv = k.shape[1], k.shape[2]
  doc_start = 0 if start is None else start[:, :, None, None, None]
  key_rel = jnp.maximum(block_indices, 0)[..., None] * block_size + jnp.arange(block_size)
  key_pos = doc_start + key_rel
  visible = ((block_indices >= 0)[..., None] & (key_pos < seq_len)
             & (key_rel <= positions[None, :, None, None, None] - doc_start))
  gather_pos = jnp.minimum(key_pos, seq_len - 1)
  b_idx = jnp.arange(b)[:, None, None, None, None]
  h_idx = jnp.arange(hkv)[None, None, :, None, None]
  k_sel = jnp.where(visible[..., None], k[b_idx, gather_pos, h_idx], 0.0)
  v_sel = jnp.where(visible[..., None], v[b_idx, gather_pos, h_idx], 0.0)
  return q.reshape(b, tc, hkv, hq // hkv, d), k_sel, v_sel, visible


def _log_sum_exp(logits, visible, axes):
  """Log of the softmax denominator over the visible logits (reduced over `axes`); -inf for a
  row that sees no key. A NaN logit makes it NaN: nothing here hides a non-finite input."""
  masked = jnp.where(visible, logits, -jnp.inf)
  has_key = jnp.any(visible, axis=axes)
  row_max = jnp.where(has_key, jnp.max(masked, axis=axes), 0.0)
  shifted = masked - jnp.expand_dims(row_max, axes)
  return jnp.where(has_key, row_max + jnp.log(jnp.sum(jnp.exp(shifted), axis=axes)), -jnp.inf)


def _weights(logits, lse, visible):
  """Softmax weights exp(logit - lse) of the visible keys, exactly zero elsewhere."""
  return jnp.where(visible, jnp.exp(logits - lse), 0.0)


def attend_selected(qg, k_sel, v_sel, visible, *, scale):
  """Eq. 6 over each query's selected keys (`_selected_keys`' outputs): out `[B, Tc, HKV, G, D]`
  and its log-sum-exp `[B, Tc, HKV, G]`."""
  visible = visible[:, :, :, None]  # [B, Tc, HKV, 1, K, C]: shared by the group's heads
  logits = scale * jnp.einsum("bthgd,bthkcd->bthgkc", qg, k_sel, precision=_HIGHEST)
  lse = _log_sum_exp(logits, visible, axes=(-2, -1))
  p = _weights(logits, lse[..., None, None], visible)
  out = jnp.einsum("bthgkc,bthkcd->bthgd", p, v_sel, precision=_HIGHEST)
  return out, lse


def dq_selected(qg, k_sel, v_sel, visible, do, lse, delta, *, scale):
  """dq `[B, Tc, HKV, G, D]` of Eq. 6 over each query's selected keys, from the forward's lse and
  delta = rowsum(out * do)."""
  visible = visible[:, :, :, None]
  logits = scale * jnp.einsum("bthgd,bthkcd->bthgkc", qg, k_sel, precision=_HIGHEST)
  p = _weights(logits, lse[..., None, None], visible)
  dp = jnp.einsum("bthgd,bthkcd->bthgkc", do.reshape(qg.shape), v_sel, precision=_HIGHEST)
  ds = jnp.where(visible, p * (dp - delta[..., None, None]), 0.0)
  return scale * jnp.einsum("bthgkc,bthkcd->bthgd", ds, k_sel, precision=_HIGHEST)


def _forward_chunk(positions, q, block_indices, start, k, v, *, block_size, scale):
  """Eq. 6 for one chunk of queries: out `[B, Tc, HQ, D]` and its log-sum-exp `[B, Tc, HKV, G]`."""
  qg, k_sel, v_sel, visible = _selected_keys(positions, q, block_indices, start, k, v,
                                             block_size=block_size)
  out, lse = attend_selected(qg, k_sel, v_sel, visible, scale=scale)
  return out.reshape(q.shape), lse


def _dq_chunk(positions, q, block_indices, start, do, lse, delta, k, v, *, block_size, scale):
  """dq of Eq. 6 for one chunk of queries, from the forward's lse and delta = rowsum(out * do)."""
  qg, k_sel, v_sel, visible = _selected_keys(positions, q, block_indices, start, k, v,
                                             block_size=block_size)
  return dq_selected(qg, k_sel, v_sel, visible, do, lse, delta, scale=scale).reshape(q.shape)


def group_entries(entry_block, *, num_blocks: int, item_size: int):
  """Groups entries by key block and cuts each block's run into items, so that block 0, which
  every query selects, is spread over many items instead of one long one.

  Args:
    entry_block: int32 `[E]`, the key block of each entry; `num_blocks` marks an entry that
      reads no block.

  Returns:
    order: `[E]`, entry ids grouped by block (ascending within a block: a stable sort).
    item_block, item_start, item_end: int32 `[NI]`; item i covers entries [item_start,
      item_end) of the sorted order, all of block item_block (an empty item: start == end).
    item_offsets: int32 `[M + 1]`; the items of block n are [item_offsets[n], item_offsets[n + 1]).
  """
  order = jnp.argsort(entry_block, stable=True)
  # Entries of block n are [offsets[n], offsets[n + 1]) of the sorted order. (An integer count:
  # exact in any order.)
  counts = jnp.bincount(entry_block, length=num_blocks + 1)[:num_blocks]
  offsets = _exclusive_cumsum(counts)
  item_offsets = _exclusive_cumsum(-(-counts // item_size))
  num_items = -(-entry_block.shape[0] // item_size) + num_blocks
  item = jnp.arange(num_items, dtype=jnp.int32)
  # [NI]: the block of each item, the number of blocks whose items all come before it ([NI, M]
  # compares, M = T / C: small beside the items' work).
  block = jnp.minimum(jnp.sum(item_offsets[None, 1:] <= item[:, None], axis=1, dtype=jnp.int32),
                      num_blocks - 1)
  start = offsets[block] + (item - item_offsets[block]) * item_size
  end = jnp.minimum(start + item_size, offsets[block + 1])
  end = jnp.where(item < item_offsets[-1], end, start)  # items past the last block's are empty
  return order, block, start, end, item_offsets


def _exclusive_cumsum(x):
  """[N] -> int32 [N + 1]: 0, x[0], x[0] + x[1], ..."""
  return jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(x, dtype=jnp.int32)])


def sum_items(parts, item_block, item_offsets):
  """Each block's item partials summed, `[NI, C, D]` -> `[M, C, D]`.

  A segmented sum by `lax.associative_scan`: a fixed tree of float32 additions (no scatter-add,
  whose atomics on a GPU add in a different order each run), and no loop (so it stays inside
  `vmap` and `checkify`). The items of a block are contiguous, in order.
  """
  starts = jnp.concatenate([jnp.ones(1, bool), item_block[1:] != item_block[:-1]])

  def combine(a, b):
    (a_sum, a_start), (b_sum, b_start) = a, b
    return jnp.where(b_start[:, None, None], b_sum, a_sum + b_sum), a_start | b_start

  running, _ = lax.associative_scan(combine, (parts, starts))
  # A block's sum is the running sum at its last item; a block that nobody selected gets zeros.
  last = running[jnp.maximum(item_offsets[1:] - 1, 0)]
  return jnp.where((item_offsets[1:] > item_offsets[:-1])[:, None, None], last, 0.0)


def _dkv_one_head(q, k, v, block_indices, start, do, lse, delta, *, positions, block_size,
                  scale):
  """dk, dv `[T, D]` of Eq. 6 for one (batch, KV head), key block by key block through an inverted
  index (which queries selected each key block): q, do `[Tq, G, D]` of the queries at positions
  `[Tq]` (None: Tq = T, at 0 .. T-1); k, v `[T, D]`; block_indices `[Tq, K]`; start None or
  `[Tq]` (as in `_selected_keys`); lse, delta `[Tq, G]`.

  The valid entries (0 <= index <= the query's block in its document) are grouped by key block,
  queries ascending (a stable sort), and cut into items of at most K C entries (`group_entries`).
  A packed document's block need not align with the key array's blocks: it covers parts of at
  most two of them, so each (query, selected block) has an entry per part, and each part's item
  masks the keys outside the document's block. One document (start None) aligns every block:
  one entry each.
  """
  n_queries, group, d = q.shape
  seq_len = k.shape[0]
  top_k = block_indices.shape[-1]
  if positions is None:
    positions = jnp.arange(n_queries, dtype=jnp.int32)
  doc_start = 0 if start is None else start[:, None]
  num_blocks = -(-seq_len // block_size)
  valid = (block_indices >= 0) & (block_indices <= (positions[:, None] - doc_start) // block_size)
  # [Tq, K]: the first key of each selected block, and the key-array block that holds it.
  lo = doc_start + jnp.maximum(block_indices, 0) * block_size
  first = lo // block_size
  parts = [jnp.where(valid, first, num_blocks)]
  if start is not None:
    # The block's other part lies in the next key-array block when it is not aligned, and
    # matters only if that block starts at or before the query.
    second = valid & (lo % block_size != 0) & ((first + 1) * block_size <= positions[:, None])
    parts.append(jnp.where(second, first + 1, num_blocks))
  entry_block = jnp.stack(parts, axis=-1).reshape(-1)
  # An item holds as many entries as a block has on average (T * K / M).
  item_size = top_k * block_size
  order, item_block, item_start, item_end, item_offsets = group_entries(
      entry_block, num_blocks=num_blocks, item_size=item_size)
  entry_query = (order // (len(parts) * top_k)).astype(jnp.int32)
  entry_lo = lo.reshape(-1)[order // len(parts)]
  pad = ((0, num_blocks * block_size - seq_len), (0, 0))
  k_blocks = jnp.pad(k, pad).reshape(num_blocks, block_size, d)
  v_blocks = jnp.pad(v, pad).reshape(num_blocks, block_size, d)

  def item_partials(item):
    block, begin, end = item
    entry = begin + jnp.arange(item_size)
    real = entry < end
    clamped = jnp.minimum(entry, entry_query.shape[0] - 1)
    t, lo_e = entry_query[clamped], entry_lo[clamped]
    # [E, G, D]: padding entries are zeroed (0 * NaN would otherwise reach the block's sums).
    q_e = jnp.where(real[:, None, None], q[t], 0.0)
    do_e = jnp.where(real[:, None, None], do[t], 0.0)
    key_pos = block * block_size + jnp.arange(block_size)
    # The keys of this part: inside the selected block [lo, lo + C) and not after the query.
    visible = (real[:, None] & (key_pos[None, :] >= lo_e[:, None])
               & (key_pos[None, :] < lo_e[:, None] + block_size)
               & (key_pos[None, :] <= positions[t][:, None]))[:, None, :]  # [E, 1, C]
    return item_grads(q_e, do_e, t, block, visible, k_blocks, v_blocks, lse, delta, scale=scale)

  dk_parts, dv_parts = lax.map(item_partials, (item_block, item_start, item_end))
  dk = sum_items(dk_parts, item_block, item_offsets).reshape(-1, d)[:seq_len]
  dv = sum_items(dv_parts, item_block, item_offsets).reshape(-1, d)[:seq_len]
  return dk, dv


def item_grads(q_e, do_e, t, block, visible, k_blocks, v_blocks, lse, delta, *, scale):
  """One item's partial dk, dv `[C, D]` of key block `block`: q_e, do_e `[E, G, D]` of the
  entries' queries t `[E]` (zeros for padding entries), visible `[E, 1, C]`."""
  logits = scale * jnp.einsum("egd,cd->egc", q_e, k_blocks[block], precision=_HIGHEST)
  p = _weights(logits, lse[t][..., None], visible)
  dp = jnp.einsum("egd,cd->egc", do_e, v_blocks[block], precision=_HIGHEST)
  ds = jnp.where(visible, p * (dp - delta[t][..., None]), 0.0)
  # A NaN query also reaches the dk of the keys after it in its own block (ds is 0 there, and
  # 0 * NaN = NaN): masking that would take a [E, G, C, D] product.
  dk = scale * jnp.einsum("egc,egd->cd", ds, q_e, precision=_HIGHEST)
  dv = jnp.einsum("egc,egd->cd", p, do_e, precision=_HIGHEST)
  return dk, dv


def chunk_size(q, k, top_k, block_size):
  """Queries per chunk: a chunk's gathered keys and values and its four `[G, K, C]` weight arrays
  (logits, p, dp, ds in the backward) stay near CHUNK_ELEMENTS."""
  b, seq_len, hq, d = q.shape
  hkv = k.shape[2]
  return _chunking.query_chunk_size(seq_len, b * hkv * top_k * block_size * (2 * d + 4 * hq // hkv))


def _forward(q, k, v, block_indices, positions, start, block_size, scale):
  fn = functools.partial(_forward_chunk, block_size=block_size, scale=scale)
  chunk = chunk_size(q, k, block_indices.shape[-1], block_size)
  return _chunking.map_query_chunks(fn, chunk, (q, block_indices, start), (k, v),
                                    positions=positions)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _sparse_attention_f32(q, k, v, block_indices, positions, start, block_size, scale):
  """Eq. 6 on float32 q, k, v, with a backward pass free of scatter-adds: dq per query chunk,
  dk and dv per key block through an inverted index (`_dkv_one_head`), every sum in a fixed
  order. positions: int32 `[Tq]` of the queries (the keys are all of 0 .. T-1), or None for
  Tq = T at 0 .. T-1; start: None (one document), or each query's document start `[B, Tq]`."""
  return _forward(q, k, v, block_indices, positions, start, block_size, scale)[0]


def _sparse_attention_fwd(q, k, v, block_indices, positions, start, block_size, scale):
  out, lse = _forward(q, k, v, block_indices, positions, start, block_size, scale)
  # Tagged for remat policies, as the kernel's forward rule tags its own (`checkpoint_names`).
  out = checkpoint_name(out, checkpoint_names.ATTENTION_OUT)
  lse = checkpoint_name(lse, checkpoint_names.ATTENTION_LSE)
  return out, (q, k, v, block_indices, positions, start, out, lse)


def _sparse_attention_bwd(block_size, scale, residuals, do):
  q, k, v, block_indices, positions, start, out, lse = residuals
  delta = jnp.sum(out * do, axis=-1).reshape(lse.shape)
  fn = functools.partial(_dq_chunk, block_size=block_size, scale=scale)
  chunk = chunk_size(q, k, block_indices.shape[-1], block_size)
  dq = _chunking.map_query_chunks(fn, chunk, (q, block_indices, start, do, lse, delta), (k, v),
                                  positions=positions)
  b, n_queries, hkv, group = lse.shape
  per_head = functools.partial(_dkv_one_head, positions=positions, block_size=block_size,
                               scale=scale)
  # Over the batch (axis 0), then the KV heads (axis 1 of each batch entry's arrays; the
  # document starts have none).
  start_axis = None if start is None else 0
  per_head = jax.vmap(per_head, in_axes=(1, 1, 1, 1, None, 1, 1, 1), out_axes=1)
  dk, dv = jax.vmap(per_head, in_axes=(0, 0, 0, 0, start_axis, 0, 0, 0))(
      q.reshape(b, n_queries, hkv, group, -1), k, v, block_indices, start,
      do.reshape(b, n_queries, hkv, group, -1), lse, delta)
  # The indices, positions and document starts are integers: no cotangent.
  return dq, dk, dv, None, None, None


_sparse_attention_f32.defvjp(_sparse_attention_fwd, _sparse_attention_bwd)


def _sparse_attention_masked(q, k, v, block_indices, positions=None, *, block_size, scale):
  """Eq. 6 as dense attention under the selection's mask, on float32 q `[B, Tq, HQ, D]` at
  positions int32 `[Tq]` (None: Tq = T at 0 .. T-1) and k, v `[B, T, HKV, D]`.

  The same softmax over the same visible keys as the gathered form, written with a
  `[B, HKV, G, T, T]` mask instead of gathered blocks: cheaper when the selected keys are a large
  share of T (short sequences: the README's main job), whose gathers dominate on a CPU. Its
  products run over every (query, key) pair, hidden ones included, so it takes finite inputs
  only: 0 * NaN = NaN would carry a non-finite key or value to queries that do not see it.
  """
  b, n_queries, hq, d = q.shape
  seq_len, hkv = k.shape[1], k.shape[2]
  num_blocks = -(-seq_len // block_size)
  pos = jnp.arange(seq_len)
  query_pos = pos if positions is None else positions
  # [B, Tq, HKV, M]: how often each (query, KV head) selected each leaf block; -1 and
  # out-of-range entries match none.
  copies = jnp.sum(block_indices[..., None] == jnp.arange(num_blocks), axis=-2)
  # [B, HKV, 1, Tq, T]: the weight of key j for query t, 0 when j > t or its block is not
  # selected.
  weight = jnp.where((pos[None, :] <= query_pos[:, None])[None, :, None],
                     jnp.take(copies, pos // block_size, axis=-1), 0)
  weight = jnp.moveaxis(weight, 2, 1)[:, :, None].astype(jnp.float32)
  visible = weight > 0
  has_key = jnp.any(visible, axis=-1)
  qg = q.reshape(b, n_queries, hkv, hq // hkv, d)
  logits = scale * jnp.einsum("bthgd,bshd->bhgts", qg, k, precision=_HIGHEST)
  # exp of the masked logits, not a masked exp: a hidden logit far above the visible ones would
  # overflow to inf, and the backward pass would multiply it by the mask's zero (NaN).
  masked = jnp.where(visible, logits, -jnp.inf)
  row_max = lax.stop_gradient(jnp.where(has_key, jnp.max(masked, axis=-1), 0.0))
  p = weight * jnp.exp(masked - row_max[..., None])
  # A query with no visible key gets zeros.
  denom = jnp.moveaxis(jnp.where(has_key, p.sum(axis=-1), 1.0), 3, 1)  # [B, Tq, HKV, G]
  out = jnp.einsum("bhgts,bshd->bthgd", p, v, precision=_HIGHEST) / denom[..., None]
  return out.reshape(b, n_queries, hq, d)


def uses_masked_formulation(batch: int, seq_len: int, num_heads: int, top_k: int,
                            block_size: int) -> bool:
  """Whether the reference takes the masked form: when T <= 2 * K * C its `[T, T]` logits are at
  most twice the `[T, K * C]` of the gathered form, and it avoids the gathers; and only while its
  unchunked `[B, HQ, T, T]` temporaries stay within the gathered form's per-chunk bound."""
  return (seq_len <= 2 * top_k * block_size
          and batch * num_heads * seq_len * seq_len <= _chunking.CHUNK_ELEMENTS)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "masked"))
def sparse_attention_reference(q, k, v, block_indices, *, block_size: int, scale: float,
                               masked: bool | None = None):
  """jnp reference of `sparse_attention`; arguments are already validated.

  Float32 throughout: q, k and v are upcast, every sum (logits, softmax, the dk and dv of keys
  that many queries selected) is a float32 sum in a fixed order, and the output, like each
  gradient, is rounded to the input dtype once. Gradients are bit-identical run to run on every
  backend: the gathered form's backward has no scatter-add, the masked form's transposes are
  plain matmuls.

  masked: None picks by `uses_masked_formulation`; True / False force the masked or the gathered
  form (both are Eq. 6; the tests pin them equal). Inputs with a non-finite value always take
  the gathered form, which computes each output from exactly the keys and values its query sees.
  """
  return _reference(q, k, v, block_indices, None, None, block_size=block_size, scale=scale,
                    masked=masked)


@functools.partial(jax.jit, static_argnames=("block_size", "scale"))
def sparse_attention_packed_reference(q, k, v, block_indices, segment_ids, *, block_size: int,
                                      scale: float):
  """jnp reference of `sparse_attention` with segment_ids; arguments are already validated.

  The one-document reference with each query's document start (`_selected_keys`): block i of a
  document that starts at position s covers its keys s + i C .. s + i C + C - 1, and each output
  row, and each row of dq, dk and dv, is its document's own, as if run alone from position 0.
  Costs: the forward and dq are the one-document form's; the inverted index holds 2 T K entries
  in ceil(2T / C) + M items of K C entries (one per part of a block that straddles two key-array
  blocks), so the dk / dv pass does up to 1.5 times the one-document form's work. Packed rows
  always take the gathered form (the masked form of short sequences is not used).
  """
  start, _ = segments.document_bounds(segment_ids)
  return _reference(q, k, v, block_indices, None, start, block_size=block_size, scale=scale,
                    masked=False)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "masked"))
def sparse_attention_reference_at(q, k, v, block_indices, query_offset, *, block_size: int,
                                  scale: float, masked: bool | None = None):
  """`sparse_attention_reference` for a run of queries inside a longer sequence.

  Args:
    q: the queries at positions query_offset .. query_offset + Tq - 1, `[B, Tq, HQ, D]`.
    k, v: every key and value of the sequence, `[B, T, HKV, D]`.
    block_indices: int32 `[B, Tq, HKV, K]`, those queries' selection (`select_blocks_at`).
    query_offset: int32 scalar, may be traced (a device's place in a sharded sequence).

  Returns `[B, Tq, HQ, D]`: the rows query_offset .. query_offset + Tq - 1 of
  `sparse_attention_reference(q_all, k, v, ...)`. Its dk and dv are those queries' share of
  the full gradients (summing the shares of every run of queries gives them whole). The masked
  or gathered form is chosen as for the whole sequence of T queries, so that both agree.
  """
  positions = query_offset + jnp.arange(q.shape[1], dtype=jnp.int32)
  return _reference(q, k, v, block_indices, positions, None, block_size=block_size,
                    scale=scale, masked=masked)


def _reference(q, k, v, block_indices, positions, start, *, block_size, scale, masked):
  """Eq. 6 in float32 for the queries at positions (None: q holds all T, at 0 .. T-1), of one
  document (start None) or of packed documents (start `[B, Tq]`, each query's document start;
  always the gathered form)."""
  b, hq = q.shape[0], q.shape[2]
  block_indices = lax.stop_gradient(block_indices.astype(jnp.int32))
  if masked is None:
    masked = uses_masked_formulation(b, k.shape[1], hq, block_indices.shape[-1], block_size)
  q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))

  def gathered(q, k, v):
    return _sparse_attention_f32(q, k, v, block_indices, positions, start, block_size, scale)

  if masked and start is None:
    dense = functools.partial(_sparse_attention_masked, block_indices=block_indices,
                              positions=positions, block_size=block_size, scale=scale)
    finite = jnp.all(jnp.isfinite(q32)) & jnp.all(jnp.isfinite(k32)) & jnp.all(jnp.isfinite(v32))
    out = lax.cond(finite, dense, gathered, q32, k32, v32)
  else:
    out = gathered(q32, k32, v32)
  return out.astype(q.dtype)


def sparse_attention(
    q: Float[Array, "B T HQ D"],
    k: Float[Array, "B T HKV D"],
    v: Float[Array, "B T HKV D"],
    block_indices: Int[Array, "B T HKV K"],
    *,
    block_size: int | None = None,
    scale: float | None = None,
    spec: SelectionSpec | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    implementation: str | None = None,
) -> Float[Array, "B T HQ D"]:
  """Causal attention of each query over the keys of its selected blocks (Eq. 6).

  Query t, head hq attends to key positions j <= t inside the blocks `block_indices[b, t, hkv]`
  of its KV head `hkv = hq // (HQ // HKV)`; -1 entries are ignored and a query with no visible key
  gets zeros. Nothing is masked away from a non-finite input: an output row is NaN exactly when
  its query, or a key or value that it sees, is NaN (a value only in its own column), in both
  implementations.

  Args:
    q: queries `[B, T, HQ, D]`.
    k: keys `[B, T, HKV, D]`, q's dtype.
    v: values `[B, T, HKV, D]`, q's dtype.
    block_indices: int32 `[B, T, HKV, K]`, entries in [-1, ceil(T / block_size)), no repeats in a
      row. Concrete indices are checked (ValueError). Traced ones (under `jit`) are checked only
      when traced inside `pisa_jax.traced_checks(True)` and run under
      `jax.experimental.checkify.checkify`; an unchecked call treats out-of-range entries like
      -1, and an entry equal to an earlier one of its `[b, t, hkv]` row like -1 too (a block
      is attended once however often it is listed), in both implementations.
    block_size: C, keys per leaf block (default 64).
    scale: logit scale, default 1/sqrt(D).
    spec: the `pisa_jax.SelectionSpec` that selected the blocks, instead of (or agreeing with)
      block_size and scale; its other fields are unused here.
    segment_ids: None, or int32 `[B, T]` non-decreasing within a row: packed documents (runs of
      equal ids). block_indices are then the block numbers of each query's own document (block i
      holds its keys i C .. i C + C - 1, counted from its first token), a query sees only keys
      of its document, and every row of the output and of the gradients is the document's own,
      run alone from position 0 (`pisa_jax.segments`).
    implementation: "xla" (jnp reference), "pallas" (kernel) or None (pallas on GPU, else xla).

  Options (block_size, scale, implementation) fix shapes or compiled code: under `jax.jit` pass
  them as static arguments or bind them first, e.g. `jax.jit(sparse_attention,
  static_argnames=("block_size",))`.

  Returns:
    `[B, T, HQ, D]` in q's dtype. Differentiable in q, k and v; the indices get no gradient.
  """
  _validation.check_static("sparse_attention", implementation=implementation)
  b, t, _, hkv, d = _validation.check_qk(q, k)
  _validation.check_v(v, k)
  spec = _validation.resolve_spec("sparse_attention", spec, d, block_size=block_size,
                                  scale=scale)
  _validation.check_block_indices(
      block_indices, batch=b, seq_len=t, num_kv_heads=hkv, block_size=spec.block_size)
  _validation.check_segment_ids(segment_ids, batch=b, seq_len=t)
  if isinstance(block_indices, jax.core.Tracer):
    # Concrete indices with a repeat have raised; traced ones count a repeat once, in every
    # implementation: the rule is applied here, before dispatch. (pisa_attention skips this
    # pass: its selection never repeats a block.)
    block_indices = _validation.drop_repeated_blocks(block_indices)
  return _attend(q, k, v, block_indices, segment_ids, block_size=spec.block_size,
                 scale=spec.scale, implementation=implementation)


def _attend(q, k, v, block_indices, segment_ids, *, block_size: int, scale: float,
            implementation):
  """Dispatches validated arguments to the reference or the kernel (packed rows: the
  "sparse_attention_packed" op)."""
  if segment_ids is not None:
    attend = _dispatch.lookup("sparse_attention_packed", implementation)
    return attend(q, k, v, block_indices, segment_ids, block_size=block_size, scale=scale)
  attend = _dispatch.lookup("sparse_attention", implementation)
  return attend(q, k, v, block_indices, block_size=block_size, scale=scale)


# Selection inside a jit: a checkpointed backward that has the indices saved leaves it unused and
# drops it (jax keeps every bare pallas_call; `pisa_jax.checkpoint_names`).
_select_blocks_jit = jax.jit(select_blocks, static_argnames=("spec", "implementation"))


def pisa_attention(
    q: Float[Array, "B T HQ D"],
    k: Float[Array, "B T HKV D"],
    v: Float[Array, "B T HKV D"],
    *,
    block_size: int | None = None,
    top_k: int | None = None,
    branching: int | None = None,
    selector: str | None = None,
    scale: float | None = None,
    beam: int | None = None,
    summary_dtype=None,
    spec: SelectionSpec | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    implementation: str | None = None,
) -> Float[Array, "B T HQ D"]:
  """PISA attention: select blocks (no gradient through the choice), then attend to them.

  Appendix B: during backpropagation the selected indices are held fixed; gradients flow through
  attention on the selected entries only. Arguments as in `select_blocks` and `sparse_attention`
  (options static under `jax.jit`; `spec=` the selection options whole). Selection ranks a NaN
  score right after the forced blocks, so the block of a NaN key stays selected wherever there
  is room, and the NaN reaches those queries' outputs instead of being dropped. With
  segment_ids (packed documents), each query selects and attends within its own document, as
  the document alone would.

  Under `jax.checkpoint` a policy may save the indices and the attention's residuals by the
  names of `pisa_jax.checkpoint_names`; the backward pass then does not select again (nor run
  the attention forward, when the residuals are saved too).

  Returns:
    `[B, T, HQ, D]` in q's dtype, differentiable in q, k and v.
  """
  _validation.check_static("pisa_attention", implementation=implementation)
  _validation.check_qk(q, k)
  _validation.check_v(v, k)
  spec = _validation.resolve_spec("pisa_attention", spec, q.shape[-1], block_size=block_size,
                                  top_k=top_k, branching=branching, selector=selector,
                                  scale=scale, beam=beam, summary_dtype=summary_dtype)
  # Concrete segment ids are checked here, where they are still concrete (not inside the jit).
  _validation.check_segment_ids(segment_ids, batch=q.shape[0], seq_len=q.shape[1])
  block_indices = _select_blocks_jit(
      lax.stop_gradient(q), lax.stop_gradient(k), spec=spec, segment_ids=segment_ids,
      implementation=implementation)
  # Tagged so that a remat policy can keep the indices: a backward then never selects again.
  block_indices = checkpoint_name(lax.stop_gradient(block_indices), checkpoint_names.BLOCK_INDICES)
  # select_blocks has validated every argument, and its indices are valid by construction: no
  # second check (which would copy concrete indices to the host on every eager call).
  return _attend(q, k, v, block_indices, segment_ids, block_size=spec.block_size,
                 scale=spec.scale, implementation=implementation)
