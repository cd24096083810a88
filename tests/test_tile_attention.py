"""Query-tile sparse attention (interpret mode on CPU) against the jnp reference, and its index
pre-passes against plain Python.

Interpret mode fills every output buffer with NaN before the kernel runs, so an element the
kernel never writes fails the finiteness checks (`test_attention_pallas.assert_matches`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pisa_jax.kernels import tile_index
from test_attention_pallas import random_indices


def test_tile_unions_match_python_sets():
  t, hkv, top_k, c, tq = 77, 2, 3, 8, 16
  idx = np.array(random_indices(2, 2, t, hkv, top_k, c))
  idx[0, 9, 0, 1] = 5  # a future block of query 9 (current block 1): not read by its tile
  idx[1, 40, 1, :] = [2, 2, -1]  # a repeat counts once
  num_blocks = -(-t // c)
  union, count = jax.tree.map(np.asarray, tile_index.tile_unions(
      jnp.asarray(idx), block_size=c, tile_queries=tq, num_blocks=num_blocks))
  length = tile_index.union_length(tq, top_k, num_blocks)
  assert union.shape == (2, -(-t // tq), hkv, length) and count.shape == union.shape[:3]
  for b in range(2):
    for i in range(union.shape[1]):
      for h in range(hkv):
        want = sorted({int(n) for ti in range(i * tq, min(t, (i + 1) * tq))
                       for n in idx[b, ti, h] if 0 <= n <= ti // c})
        assert count[b, i, h] == len(want)
        assert list(union[b, i, h]) == want + [-1] * (length - len(want)), (b, i, h)


def test_tile_inverted_index_lists_every_tile_once():
  t, hkv, top_k, c, tq, items = 100, 2, 4, 8, 8, 3
  idx = random_indices(4, 1, t, hkv, top_k, c)
  num_blocks = -(-t // c)
  union, _ = tile_index.tile_unions(idx, block_size=c, tile_queries=tq, num_blocks=num_blocks)
  entry_tile, item_block, item_start, item_end, item_offsets = jax.tree.map(
      np.asarray, tile_index.tile_inverted_index(union, num_blocks=num_blocks, items_tiles=items))
  union = np.asarray(union)
  for h in range(hkv):
    for n in range(num_blocks):
      want = [i for i in range(union.shape[1]) if n in union[0, i, h]]
      got = []
      for it in range(item_offsets[0, h, n], item_offsets[0, h, n + 1]):
        assert item_block[0, h, it] == n
        assert 0 < item_end[0, h, it] - item_start[0, h, it] <= items
        got += list(entry_tile[0, h, item_start[0, h, it]:item_end[0, h, it]])
      assert got == want, (h, n)
    # Items past the last block's are empty.
    last = item_offsets[0, h, -1]
    assert np.all(item_start[0, h, last:] == item_end[0, h, last:])


def test_union_fraction_and_rule():
  count = jnp.array([[[4], [12]]], jnp.int32)
  assert float(tile_index.union_fraction(count, tile_queries=16, top_k=8)) == 8 / 128
  assert bool(tile_index.prefers_tile_kernel(count, tile_queries=16, top_k=8))
  assert not bool(tile_index.prefers_tile_kernel(count * 8, tile_queries=16, top_k=8))
