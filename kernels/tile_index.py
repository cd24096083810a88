"""Index pre-passes of the query-tile attention kernels (`pisa_jax.kernels.tile_attention`).

Neighbouring queries select nearly the same leaf blocks (the forced first, previous and current
blocks of Eq. 6's selection are shared by every query of a block, and the scored ones overlap),
so a program that owns a tile of TQ consecutive queries can read each distinct block once and
mask per query. These jnp pre-passes give it the blocks to read, and give the dk/dv kernel the
tiles that read each block. Everything here is integer work ordered by stable sorts: the results
are deterministic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Int

# The tile kernel's time over the per-query kernel's, per unit of (mean union / K): on the H200
# both run their dots at the same tensor-core rate (about 155 TFLOP/s of useful work for the
# per-query forward at 16K), and a tile computes every (row, union block) pair, union / K times
# the per-query FLOPs. Measured on PISA's selection of random q/k at 16K, 32/2 heads
# (benchmarks/results/attention_pisa.json, 2026-12-02): forward 4.31x at union / K = 4.19
# (d64 K8, TQ 8) and 2.76x at 2.28 (d128 K32, TQ 4): 1.03 and 1.21. The larger is the rule's.
TILE_TIME_PER_UNION = 1.21
# A tile's queries are the bits of one int32 per union entry.
MAX_TILE_QUERIES = 32


def union_length(tile_queries: int, top_k: int, num_blocks: int) -> int:
  """Static length of a tile's union list: no tile can read more than TQ * K or M blocks."""
  return min(tile_queries * top_k, num_blocks)


def tile_unions(block_indices: Int[Array, "B T HKV K"], *, block_size: int, tile_queries: int,
                num_blocks: int):
  """The sorted union of the blocks each tile of `tile_queries` consecutive queries selected, and
  which of the tile's queries selected each.

  Only valid entries count (0 <= index <= t // C for query t, the rule of Eq. 6); -1 padding,
  future blocks and repeats add nothing. The last tile may be partial (T not a multiple of TQ).
  One sort per tile of its TQ * K (block, query) pairs; the bits are an integer scatter-add of
  distinct powers of two (exact, so deterministic).

  Returns:
    union: int32 `[B, NT, HKV, U]`, NT = ceil(T / TQ), U = `union_length`: each tile's distinct
      blocks ascending, then -1.
    bits: int32 `[B, NT, HKV, U]`: bit q of entry u of tile i is set when query i * TQ + q
      selected union[u] (TQ <= 32; bit 31 is the sign bit).
    count: int32 `[B, NT, HKV]`, the number of blocks in each union.
  """
  b, t, hkv, top_k = block_indices.shape
  if not 1 <= tile_queries <= MAX_TILE_QUERIES:
    raise ValueError(f"tile_queries={tile_queries} must be in [1, {MAX_TILE_QUERIES}] (one bit "
                     "per query of a tile in an int32)")
  num_tiles = -(-t // tile_queries)
  length = union_length(tile_queries, top_k, num_blocks)
  cur = (jnp.arange(t, dtype=jnp.int32) // block_size)[None, :, None, None]
  local = (jnp.arange(t, dtype=jnp.int32) % tile_queries)[None, :, None, None]
  idx = block_indices.astype(jnp.int32)
  # (block, query in tile) as one key; invalid entries and the last tile's padding sort last.
  end = num_blocks * tile_queries
  key = jnp.where((idx >= 0) & (idx <= cur), idx * tile_queries + local, end)
  key = jnp.pad(key, ((0, 0), (0, num_tiles * tile_queries - t), (0, 0), (0, 0)),
                constant_values=end)
  key = key.reshape(b, num_tiles, tile_queries, hkv, top_k).transpose(0, 1, 3, 2, 4)
  key = jnp.sort(key.reshape(b * num_tiles * hkv, tile_queries * top_k), axis=-1)
  block, query = key // tile_queries, key % tile_queries
  real = key < end
  new_pair = jnp.concatenate([real[:, :1], real[:, 1:] & (key[:, 1:] != key[:, :-1])], axis=1)
  new_block = jnp.concatenate([real[:, :1], real[:, 1:] & (block[:, 1:] != block[:, :-1])],
                              axis=1)
  # The union slot of each entry: how many blocks start at or before it, minus one.
  slot = jnp.cumsum(new_block, axis=1, dtype=jnp.int32) - 1

  def per_tile(slot, block, query, new_pair, new_block):
    union = jnp.full((length,), -1, jnp.int32).at[jnp.where(new_block, slot, length)].set(
        block, mode="drop")
    bit = jnp.where(new_pair, jnp.left_shift(jnp.int32(1), query), 0)
    bits = jnp.zeros((length,), jnp.int32).at[jnp.where(new_pair, slot, length)].add(
        bit, mode="drop")
    return union, bits

  union, bits = jax.vmap(per_tile)(slot, block, query, new_pair, new_block)
  count = jnp.sum(new_block, axis=1, dtype=jnp.int32)
  shape = (b, num_tiles, hkv)
  return union.reshape(shape + (length,)), bits.reshape(shape + (length,)), count.reshape(shape)


def union_fraction(count: Int[Array, "B NT HKV"], *, tile_queries: int, top_k: int) -> Array:
  """Mean union size over TQ * K: the tile kernel's share of the per-query kernel's block reads."""
  return jnp.mean(count.astype(jnp.float32)) / (tile_queries * top_k)


def prefers_tile_kernel(count: Int[Array, "B NT HKV"], *, tile_queries: int, top_k: int) -> Array:
  """Scalar bool: whether the tile kernel should run on these indices: its predicted time,
  `TILE_TIME_PER_UNION` x mean union / K of the per-query kernel's, is below the per-query
  time. A tile whose queries all select K valid blocks has a union of at least K, so this holds
  only where queries select fewer valid blocks than K (early positions, -1 padding)."""
  union_over_k = union_fraction(count, tile_queries=tile_queries, top_k=top_k) * tile_queries
  return union_over_k * TILE_TIME_PER_UNION < 1.0


def split_tiles(union: Int[Array, "B NT HKV U"], bits: Int[Array, "B NT HKV U"], *,
                tile_queries: int, sub_queries: int):
  """The union lists of sub-tiles of `sub_queries` consecutive queries: sub-tile i * S + j
  (S = TQ / sub_queries) holds union[i] where its run j of the bits is not zero (else -1, which
  the inverted index drops), and those bits shifted down. `[B, NT * S, HKV, U]` each.

  The dk/dv kernel takes sub-tiles of fewer rows than a tile (registers), and the pairs whose
  sub-tile selected nothing never become work."""
  splits = tile_queries // sub_queries
  if splits == 1:
    return union, bits
  b, num_tiles, hkv, length = union.shape
  shift = (jnp.arange(splits, dtype=jnp.int32) * sub_queries)[None, None, :, None, None]
  mask = (1 << sub_queries) - 1  # sub_queries < 32 here (it is less than TQ <= 32)
  sub_bits = lax.shift_right_logical(bits[:, :, None], shift) & mask
  sub_union = jnp.where(sub_bits != 0, union[:, :, None], -1)
  shape = (b, num_tiles * splits, hkv, length)
  return sub_union.reshape(shape), sub_bits.reshape(shape)


def default_items_tiles(num_tiles: int, length: int, num_blocks: int) -> int:
  """Tiles per dk/dv work item: the static entry count NT * U spread over about 2 M items, so
  the float32 partials stay about twice dk and dv, and block 0 (in every tile's union) is split
  over several programs instead of one long one."""
  return max(1, -(-num_tiles * length // (2 * num_blocks)))


def tile_inverted_index(union: Int[Array, "B NT HKV U"], bits: Int[Array, "B NT HKV U"], *,
                        num_blocks: int, items_tiles: int):
  """For each (batch, KV head, key block), the tiles whose union holds it, cut into work items.

  The analogue of `attention.inverted_index` with tiles for queries: a stable argsort keeps the
  tiles of a block ascending, so the dk/dv partials are summed in a fixed order.

  Returns:
    entry_tile: int32 `[B, HKV, NT * U]`, the tile of each entry, grouped by block (padding last).
    entry_bits: int32 `[B, HKV, NT * U]`, which queries of that tile selected the block (`bits`).
    item_block, item_start, item_end: int32 `[B, HKV, NI]`; item i covers entries
      [item_start, item_end) of block item_block (empty items: start == end).
    item_offsets: int32 `[B, HKV, M + 1]`; the items of block n are [item_offsets[n],
      item_offsets[n + 1]).
  """
  b, num_tiles, hkv, length = union.shape
  entries = num_tiles * length
  num_items = -(-entries // items_tiles) + num_blocks
  key = jnp.where(union >= 0, union, num_blocks).transpose(0, 2, 1, 3).reshape(b, hkv, entries)
  order = jnp.argsort(key, axis=-1, stable=True).astype(jnp.int32)
  entry_tile = order // length
  entry_bits = jnp.take_along_axis(bits.transpose(0, 2, 1, 3).reshape(b, hkv, entries), order,
                                   axis=-1)

  def per_head(key_h):
    counts = jnp.zeros((num_blocks + 1,), jnp.int32).at[key_h].add(1)[:num_blocks]
    offsets = _exclusive_cumsum(counts)
    item_offsets = _exclusive_cumsum(-(-counts // items_tiles))
    item = jnp.arange(num_items, dtype=jnp.int32)
    blk = jnp.searchsorted(item_offsets[1:], item, side="right").astype(jnp.int32)
    in_range = blk < num_blocks
    blk = jnp.minimum(blk, num_blocks - 1)
    start = offsets[blk] + (item - item_offsets[blk]) * items_tiles
    end = jnp.minimum(start + items_tiles, offsets[blk + 1])
    return blk, jnp.where(in_range, start, 0), jnp.where(in_range, end, 0), item_offsets

  item_block, item_start, item_end, item_offsets = jax.vmap(jax.vmap(per_head))(key)
  return entry_tile, entry_bits, item_block, item_start, item_end, item_offsets


def _exclusive_cumsum(x):
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(x, dtype=jnp.int32)])
