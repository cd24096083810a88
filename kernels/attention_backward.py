"""dk / dv of the Pallas block-sparse attention (Appendix B): inverted index, kernels, reduction.

Part of `pisa_jax.kernels.attention` (which holds the forward and dq kernels and the
`custom_vjp` op); kept apart so that each file reads in one sitting.

The inverted index is built outside the kernels with a stable argsort: for each (KV head, key
block) the queries that selected it, in ascending order. The list of a block is cut into work
items of at most `items_entries` entries so that a block selected by every query (block 0 is
forced for all of them) does not become a long tail; each item writes a float32 partial and a
second kernel sums the partials of a block in item order. No atomics: results are bit-identical
run to run.

Packed documents (segment_ids): a query's selected block i covers its document's keys
lo .. lo + C - 1 with lo = start + i C, which need not align with the key array's blocks, so it
spans array block n = lo // C and, unless aligned, the head of block n + 1. The packed index
holds one entry per (query, selected block), listed under array block n and sorted by lo, so
the entries of one document block are contiguous. Partials have 2C rows (keys of blocks n and
n + 1): array block n sums the first C rows of its own items, then the last C rows of block
n - 1's items, each in item order (no atomics, bit-identical). Two launches fill them:
- an item whose entries share one lo (all but the few that straddle a document boundary
  inside an array block) loads the C keys lo .. lo + C - 1 and computes exactly the unpacked
  kernel's work, written at rows lo - nC .. lo - nC + C - 1 of its 2C rows (zeros elsewhere);
- an item with several lo values loads the 2C keys of blocks n and n + 1 and masks each
  entry's keys outside [lo, lo + C): twice the dots, once per straddling item. Its launch
  writes into the first launch's partials (aliased) and skips every other item.
A 2C window for every item does twice the dots (WORKSPACE.md, "Tried and dropped").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Int

from pisa_jax.kernels._common import (LOG2E, call_kernel, dkv_tile_step, dot_precision,
                                      next_pow2)


# ----------------------------------------------------------------------------- inverted index


def _group_by_block(key, *, num_blocks: int, items_entries: int, num_items: int, sort_key=None):
  """Entries `[B, HKV, E]` keyed by key block (num_blocks: no block), grouped and cut into items.

  Returns (order, item_block, item_start, item_end, item_offsets) as in `inverted_index`; order
  is the stable argsort of sort_key (default key; it must order the entries by key first), so
  entries of equal sort_key keep their original order."""
  order = jnp.argsort(key if sort_key is None else sort_key, axis=-1, stable=True).astype(jnp.int32)

  def per_head(key_h):
    counts = jnp.zeros((num_blocks + 1,), jnp.int32).at[key_h].add(1)[:num_blocks]
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
    n_items = -(-counts // items_entries)
    item_offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                    jnp.cumsum(n_items, dtype=jnp.int32)])
    item = jnp.arange(num_items, dtype=jnp.int32)
    blk = jnp.searchsorted(item_offsets[1:], item, side="right").astype(jnp.int32)
    in_range = blk < num_blocks
    blk = jnp.minimum(blk, num_blocks - 1)
    start = offsets[blk] + (item - item_offsets[blk]) * items_entries
    end = jnp.minimum(start + items_entries, offsets[blk + 1])
    start = jnp.where(in_range, start, 0)
    end = jnp.where(in_range, end, 0)
    return blk, start, end, item_offsets

  return (order,) + jax.vmap(jax.vmap(per_head))(key)


def inverted_index(block_indices: Int[Array, "B T HKV K"], *, num_blocks: int, block_size: int,
                   items_entries: int, offset=None):
  """For each (batch, KV head, key block), the queries that selected it, cut into work items.

  Built with a stable argsort, so within a block the queries come out ascending and the result is
  deterministic. Only valid entries count: index in [0, t // C] for query t, at position
  offset + t when offset (int32 `[1]`, a sequence shard's first position) is given.

  Returns:
    entry_query: int32 `[B, HKV, T * K]`, the query position of each entry, grouped by block
      (invalid entries sorted to the end).
    item_block, item_start, item_end: int32 `[B, HKV, NI]`; item i covers entries
      [item_start, item_end) of block item_block (empty items: start == end, block 0).
    item_offsets: int32 `[B, HKV, M + 1]`; the items of block n are [item_offsets[n],
      item_offsets[n + 1]).
  """
  b, t, hkv, top_k = block_indices.shape
  num_items = -(-t * top_k // items_entries) + num_blocks
  pos = jnp.arange(t, dtype=jnp.int32)
  if offset is not None:
    pos = pos + offset[0]
  cur = (pos // block_size)[None, :, None, None]
  valid = (block_indices >= 0) & (block_indices <= cur)
  # [B, HKV, T * K], t-major then slot: the stable sort keeps queries ascending within a block.
  key = jnp.where(valid, block_indices, num_blocks).transpose(0, 2, 1, 3).reshape(b, hkv, t * top_k)
  order, item_block, item_start, item_end, item_offsets = _group_by_block(
      key, num_blocks=num_blocks, items_entries=items_entries, num_items=num_items)
  return order // top_k, item_block, item_start, item_end, item_offsets


def packed_inverted_index(block_indices: Int[Array, "B T HKV K"], starts: Int[Array, "B T"], *,
                          num_blocks: int, block_size: int, items_entries: int):
  """`inverted_index` of packed rows: one entry per (query, selected block).

  block_indices are document-relative and starts `[B, T]` each query's document start. A valid
  block (index in [0, (t - start) // C]) covers keys lo .. lo + C - 1, lo = start + i C; its
  entry is listed under array block lo // C, sorted by lo and then by query, so a document block's
  entries are contiguous: an item within one document block shares one lo (the C-key launch of
  `backward_dkv`), one across a document boundary does not (the 2C-key launch). A query selects
  a block once, so it appears at most once in a block's list.

  Returns `inverted_index`'s five arrays over T K entries, then entry_lo: int32 `[B, HKV, T K]`,
  the first key of each entry's selected block.
  """
  b, t, hkv, top_k = block_indices.shape
  num_items = -(-t * top_k // items_entries) + num_blocks
  pos = jnp.arange(t, dtype=jnp.int32)[None, :, None, None]
  start = starts[:, :, None, None]
  valid = (block_indices >= 0) & (block_indices <= (pos - start) // block_size)
  lo = start + jnp.maximum(block_indices, 0) * block_size
  # [B, HKV, T * K], t-major then slot: the stable sort keeps queries ascending within a block.
  lo_flat = jnp.where(valid, lo, num_blocks * block_size).transpose(0, 2, 1, 3).reshape(
      b, hkv, t * top_k)
  order, item_block, item_start, item_end, item_offsets = _group_by_block(
      lo_flat // block_size, num_blocks=num_blocks, items_entries=items_entries,
      num_items=num_items, sort_key=lo_flat)
  entry_lo = jnp.take_along_axis(lo_flat, order, axis=-1)
  return order // top_k, item_block, item_start, item_end, item_offsets, entry_lo


# ----------------------------------------------------------------------------- dk/dv kernels


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, entry_ref, blk_ref, start_ref,
                end_ref, *refs, block_size: int, scale: float, group: int, rows: int,
                packed: str | None = None, offset: bool = False):
  """One program: one work item (a key block and a run of the queries that selected it).

  Each step gathers `rows // G` queries x G heads as the M dimension of the dots (Appendix B
  gradients for the keys of one block). Writes float32 partials, scale not yet applied to dk.
  Packed rows (packed = "single" or "mixed") add lo_ref, each entry's selected-block start, and
  write 2C-row partials: "single" handles the items whose entries share one lo (C keys from lo,
  written at rows lo - nC ..), "mixed" the others (the 2C keys of array blocks n and n + 1, each
  entry's keys outside [lo, lo + C) masked); each skips the other's items. A sequence shard adds
  off_ref `[1]`: query row t sits at position off + t.
  """
  lo_ref = refs[0] if packed else None
  off_ref = refs[int(bool(packed))] if offset else None
  dk_ref, dv_ref = refs[-2:]  # "mixed" also receives the aliased partials just before them
  i = pl.program_id(0)
  n = blk_ref[i]
  first = start_ref[i]
  last = end_ref[i]
  per_step = rows // group
  qk_scale = scale * LOG2E
  d = k_ref.shape[-1]
  o_r = jnp.arange(rows)
  o_j = o_r // group
  o_g = o_r % group
  o_d = jnp.arange(d)

  def accumulate(start, window: int, mask_lo: bool):
    """dk, dv partials `[window, D]` of keys start .. start + window - 1 over the item."""
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
      # [R, D] gathered (query, head) rows; clamped addresses, masked rows zeroed.
      m_rd = m_r[:, None] & (o_d[None, :] < d)
      i_t = jnp.broadcast_to(o_t[:, None], (rows, d))
      i_g = jnp.broadcast_to(o_g[:, None], (rows, d))
      i_d = jnp.broadcast_to(o_d[None, :], (rows, d))
      b_q = plt.load(q_ref.at[i_t, i_g, i_d], mask=m_rd, other=0.0)
      b_do = plt.load(do_ref.at[i_t, i_g, i_d], mask=m_rd, other=0.0)
      b_lse2 = plt.load(lse_ref.at[o_t, o_g], mask=m_r, other=0.0) * LOG2E
      b_delta = plt.load(delta_ref.at[o_t, o_g], mask=m_r, other=0.0)
      def visible_of():
        o_pos = o_t + off_ref[0] if offset else o_t
        # A single-lo item's keys past its document's end lie after all of its queries.
        visible = m_r[None, :] & (key_pos[:, None] <= o_pos[None, :])
        if mask_lo:
          # The entry's selected block: keys lo .. lo + C - 1, inside the window.
          o_lo = lo_ref[o_e]
          visible = visible & (key_pos[:, None] >= o_lo[None, :]) & (
              key_pos[:, None] < o_lo[None, :] + block_size)
        return visible

      return dkv_tile_step(b_k, b_v, b_q, b_do, b_lse2, b_delta, visible_of, b_dk, b_dv,
                           qk_scale=qk_scale, precision=precision)

    num_steps = (last - first + per_step - 1) // per_step
    zeros = jnp.zeros((window, d), jnp.float32)
    return lax.fori_loop(0, num_steps, body, (zeros, zeros))

  aligned = pl.multiple_of(n * block_size, block_size)
  if packed is None:
    dk_ref[...], dv_ref[...] = accumulate(aligned, block_size, False)
    return
  # Entries are sorted by lo within the block: the item is single-lo iff its ends agree.
  lo_first = lo_ref[first]
  single = (last <= first) | (lo_first == lo_ref[jnp.maximum(last - 1, first)])
  if packed == "mixed":
    @pl.when(~single)
    def _():
      dk_ref[...], dv_ref[...] = accumulate(aligned, 2 * block_size, True)
    return

  @pl.when(single)
  def _():
    shift = jnp.where(last > first, lo_first - aligned, 0)  # in [0, C)
    b_dk, b_dv = accumulate(aligned + shift, block_size, False)
    # Rows [shift, shift + C) of the 2C take the sums, the others zeros: disjoint stores on the
    # GPU. Interpret mode writes a masked lane's old value back, so the sums are stored last.
    o_c = jnp.arange(block_size)[:, None]
    zeros = jnp.zeros((block_size, d), jnp.float32)
    for ref, value in ((dk_ref, b_dk), (dv_ref, b_dv)):
      plt.store(ref.at[pl.ds(0, block_size), :], zeros, mask=o_c < shift)
      plt.store(ref.at[pl.ds(block_size, block_size), :], zeros, mask=o_c >= shift)
      ref[pl.ds(shift, block_size), :] = value


def _reduce_kernel(item_offsets_ref, dk_part_ref, dv_part_ref, dk_ref, dv_ref, *, scale: float,
                   packed: bool = False):
  """Sums the partials of key block n in item order (deterministic), applies the dk scale.

  Packed partials hold 2C rows, keys of blocks m and m + 1 for an item of block m: block n sums
  the first C rows of its own items, then the last C rows of block n - 1's items."""
  n = pl.program_id(0)
  first = item_offsets_ref[n]
  last = item_offsets_ref[n + 1]

  def summed(lo, hi, rows, carry):
    def body(i, carry):
      b_dk, b_dv = carry
      return b_dk + dk_part_ref[i, rows], b_dv + dv_part_ref[i, rows]
    return lax.fori_loop(lo, hi, body, carry)

  zeros = jnp.zeros(dk_ref.shape, jnp.float32)
  if packed:
    c = dk_ref.shape[0]
    carry = summed(first, last, pl.ds(0, c), (zeros, zeros))
    # Block n - 1's items are [item_offsets[n - 1], first): none for block 0.
    b_dk, b_dv = summed(item_offsets_ref[jnp.maximum(n - 1, 0)], first, pl.ds(c, c), carry)
  else:
    b_dk, b_dv = summed(first, last, ..., (zeros, zeros))
  dk_ref[...] = (b_dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = b_dv.astype(dv_ref.dtype)


def backward_dkv(q5, k, v, block_indices, starts, do5, lse, delta, *, block_size, scale,
                 interpret, config, offset=None):
  """dk, dv like k, v `[B, Tk, HKV, D]` (Tk a multiple of C); starts: None, or the document
  start `[B, T]` of each query of packed rows (Tk then at least one block past the last query's
  block); offset: None, or int32 `[1]`, the position of q's first row among the Tk keys (a
  sequence shard; unpacked rows only)."""
  b, t, hkv, g, d = q5.shape
  tk = k.shape[1]
  num_blocks = tk // block_size
  top_k = block_indices.shape[-1]
  rows = max(config.dkv_rows, next_pow2(g))
  items_entries = config.items_entries
  packed = starts is not None
  window = 2 * block_size if packed else block_size
  if packed:
    # An item of array block n loads keys [nC, nC + 2C), n at most the last query's block.
    if tk < (-(-t // block_size) + 1) * block_size:
      raise ValueError(f"k.shape[1]={tk} must hold a block of padding past the {t} queries "
                       f"({block_size=}) for packed rows")
    entry_query, item_block, item_start, item_end, item_offsets, entry_lo = (
        packed_inverted_index(block_indices, starts, num_blocks=num_blocks,
                              block_size=block_size, items_entries=items_entries))
    extra = (entry_lo,)
  else:
    entry_query, item_block, item_start, item_end, item_offsets = inverted_index(
        block_indices, num_blocks=num_blocks, block_size=block_size,
        items_entries=items_entries, offset=offset)
    extra = ()
  num_items = item_block.shape[-1]
  num_entries = entry_query.shape[-1]
  off_specs, off_args = ([], ()) if offset is None else (
      [pl.BlockSpec((1,), lambda i, h, bb: (0,))], (offset,))
  q_spec = pl.BlockSpec((None, t, None, g, d), lambda i, h, bb: (bb, 0, h, 0, 0))
  kv_spec = pl.BlockSpec((None, tk, None, d), lambda i, h, bb: (bb, 0, h, 0))
  lse_spec = pl.BlockSpec((None, t, None, g), lambda i, h, bb: (bb, 0, h, 0))
  entry_spec = pl.BlockSpec((None, None, num_entries), lambda i, h, bb: (bb, h, 0))
  item_spec = pl.BlockSpec((None, None, num_items), lambda i, h, bb: (bb, h, 0))
  part_spec = pl.BlockSpec((None, None, None, window, d), lambda i, h, bb: (bb, h, i, 0, 0))
  part_shape = jax.ShapeDtypeStruct((b, hkv, num_items, window, d), jnp.float32)
  args = (q5, k, v, do5, lse, delta, entry_query, item_block, item_start, item_end, *extra,
          *off_args)
  in_specs = [q_spec, kv_spec, kv_spec, q_spec, lse_spec, lse_spec, entry_spec, item_spec,
              item_spec, item_spec] + [entry_spec] * len(extra) + off_specs

  def dkv_call(mode, warps, rows, partials=()):
    kernel = functools.partial(_dkv_kernel, block_size=block_size, scale=scale, group=g,
                               rows=rows, packed=mode, offset=offset is not None)
    aliases = {len(args) + j: j for j in range(len(partials))}
    return call_kernel(pl.pallas_call(
        kernel,
        grid=(num_items, hkv, b),
        in_specs=in_specs + [part_spec] * len(partials),
        out_specs=[part_spec, part_spec],
        out_shape=[part_shape, part_shape],
        input_output_aliases=aliases,
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=config.dkv_num_stages),
        interpret=interpret,
        name="pisa_sparse_attention_dkv" + (f"_packed_{mode}" if mode else "")
        + ("_offset" if offset is not None else ""),
    ), *args, *partials)

  if not packed:
    dk_part, dv_part = dkv_call(None, config.dkv_num_warps, rows)
  else:
    # The single-lo items: the unpacked kernel's shape and launch. Then the few items that
    # straddle a document boundary, on twice the keys: twice the warps hold twice the
    # accumulators; float32 operands take half the rows (2C keys of float32 k, v and the
    # [2C, R] p, ds tiles of 64 rows overflow the shared memory at d = 128).
    dk_part, dv_part = dkv_call("single", config.dkv_num_warps, rows)
    mixed_rows = rows if k.dtype.itemsize < 4 else max(next_pow2(g), rows // 2)
    dk_part, dv_part = dkv_call("mixed", config.packed_dkv_num_warps, mixed_rows,
                                (dk_part, dv_part))

  offsets_spec = pl.BlockSpec((None, None, num_blocks + 1), lambda n, h, bb: (bb, h, 0))
  parts_spec = pl.BlockSpec((None, None, num_items, window, d),
                            lambda n, h, bb: (bb, h, 0, 0, 0))
  out_spec = pl.BlockSpec((None, block_size, None, d), lambda n, h, bb: (bb, n, h, 0))
  dk, dv = call_kernel(pl.pallas_call(
      functools.partial(_reduce_kernel, scale=scale, packed=packed),
      grid=(num_blocks, hkv, b),
      in_specs=[offsets_spec, parts_spec, parts_spec],
      out_specs=[out_spec, out_spec],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=plt.CompilerParams(num_warps=config.reduce_num_warps, num_stages=1),
      interpret=interpret,
      name="pisa_sparse_attention_dkv_reduce" + ("_packed" if packed else ""),
  ), item_offsets, dk_part, dv_part)
  return dk, dv
