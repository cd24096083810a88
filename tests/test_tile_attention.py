"""Query-tile sparse attention (interpret mode on CPU) against the jnp reference, and its index
pre-passes against plain Python.

Interpret mode fills every output buffer with NaN before the kernel runs, so an element the
kernel never writes fails the finiteness checks (`test_attention_pallas.assert_matches`).
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pisa_jax.kernels import tile_attention as ta
from pisa_jax.kernels import tile_index
import pisa_jax
from pisa_jax import _dispatch
from pisa_jax.kernels import attention as attn
from test_attention_pallas import (assert_matches, make_inputs, random_indices,
                                   reference_value_and_grads, value_and_grads)


def tile_fn(block_size, scale, config):
  def f(q, k, v, idx):
    return ta.sparse_attention_tile(q, k, v, idx, block_size=block_size, scale=scale,
                                    interpret=True, config=config)
  return f


def run_tile(q, k, v, idx, do, block_size, scale, config):
  return jax.jit(lambda *a: value_and_grads(tile_fn(block_size, scale, config), *a))(
      q, k, v, idx, do)


@pytest.mark.parametrize("tq", [16, 32])  # 32: the last query of a tile is the sign bit
def test_tile_unions_match_python_sets(tq):
  t, hkv, top_k, c = 77, 2, 3, 8
  idx = np.array(random_indices(2, 2, t, hkv, top_k, c))
  idx[0, 9, 0, 1] = 5  # a future block of query 9 (current block 1): not read by its tile
  idx[1, 40, 1, :] = [2, 2, -1]  # a repeat counts once
  num_blocks = -(-t // c)
  union, bits, count = jax.tree.map(np.asarray, tile_index.tile_unions(
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
        for u, n in enumerate(want):
          queries = {ti - i * tq for ti in range(i * tq, min(t, (i + 1) * tq))
                     if n in idx[b, ti, h] and n <= ti // c}
          assert {j for j in range(tq) if bits[b, i, h, u] >> j & 1} == queries, (b, i, h, u)
        assert np.all(bits[b, i, h, len(want):] == 0)


def test_tile_inverted_index_lists_every_tile_once():
  t, hkv, top_k, c, tq, items = 100, 2, 4, 8, 8, 3
  idx = random_indices(4, 1, t, hkv, top_k, c)
  num_blocks = -(-t // c)
  union, bits, _ = tile_index.tile_unions(idx, block_size=c, tile_queries=tq,
                                          num_blocks=num_blocks)
  entry_tile, entry_bits, item_block, item_start, item_end, item_offsets = jax.tree.map(
      np.asarray, tile_index.tile_inverted_index(union, bits, num_blocks=num_blocks,
                                                 items_tiles=items))
  union, bits = np.asarray(union), np.asarray(bits)
  for h in range(hkv):
    for n in range(num_blocks):
      want = [i for i in range(union.shape[1]) if n in union[0, i, h]]
      got = []
      for it in range(item_offsets[0, h, n], item_offsets[0, h, n + 1]):
        assert item_block[0, h, it] == n
        assert 0 < item_end[0, h, it] - item_start[0, h, it] <= items
        entries = slice(item_start[0, h, it], item_end[0, h, it])
        got += list(entry_tile[0, h, entries])
        for i, word in zip(entry_tile[0, h, entries], entry_bits[0, h, entries]):
          assert word == bits[0, i, h, list(union[0, i, h]).index(n)]
      assert got == want, (h, n)
    # Items past the last block's are empty.
    last = item_offsets[0, h, -1]
    assert np.all(item_start[0, h, last:] == item_end[0, h, last:])


def test_split_tiles_keep_the_selecting_sub_tiles():
  t, hkv, top_k, c, tq, sub = 70, 2, 3, 8, 16, 4
  idx = np.asarray(random_indices(6, 1, t, hkv, top_k, c))
  num_blocks = -(-t // c)
  union, bits, _ = tile_index.tile_unions(jnp.asarray(idx), block_size=c, tile_queries=tq,
                                          num_blocks=num_blocks)
  sub_union, sub_bits = jax.tree.map(np.asarray, tile_index.split_tiles(
      union, bits, tile_queries=tq, sub_queries=sub))
  # Each sub-tile against its own union, computed directly (a sub-tile's union drops no block
  # of the tile's that one of its queries selected).
  want_union, want_bits, _ = jax.tree.map(np.asarray, tile_index.tile_unions(
      jnp.asarray(idx), block_size=c, tile_queries=sub, num_blocks=num_blocks))
  # The last tile's padding queries make whole sub-tiles that select nothing.
  assert np.all(sub_union[0, want_union.shape[1]:] == -1)
  for i in range(want_union.shape[1]):
    for h in range(hkv):
      kept = sub_union[0, i, h] >= 0
      n = int(kept.sum())
      np.testing.assert_array_equal(sub_union[0, i, h][kept], want_union[0, i, h, :n])
      np.testing.assert_array_equal(sub_bits[0, i, h][kept], want_bits[0, i, h, :n])
      assert np.all(sub_bits[0, i, h][~kept] == 0)


def test_union_fraction_and_rule():
  count = jnp.array([[[4], [12]]], jnp.int32)
  assert float(tile_index.union_fraction(count, tile_queries=16, top_k=8)) == 8 / 128
  # Mean union 8 = K: predicted at 1.21x the per-query time, so not the tile; 6 (queries with
  # fewer than K valid blocks) at 0.91x, the tile.
  assert not bool(tile_index.prefers_tile_kernel(count, tile_queries=16, top_k=8))
  assert bool(tile_index.prefers_tile_kernel(count - 2, tile_queries=16, top_k=8))
  assert not bool(tile_index.prefers_tile_kernel(count * 8, tile_queries=16, top_k=8))


@pytest.mark.parametrize("group,d,top_k,kernel", [(16, 64, 8, "tile"), (2, 128, 32, "tile"),
                                                  (3, 64, 8, "auto")])
def test_tile_kernels_lower_for_sm90(captured, group, d, top_k, kernel):
  # Forward, dq (+ delta), dk/dv and the partial sums under the custom_vjp lower to Triton IR
  # for sm_90 at benchmark-like shapes (group 16 d 64 K 8, group 2 d 128 K 32, an odd group).
  q = jax.ShapeDtypeStruct((1, 4096, 2 * group, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 4096, 2, d), jnp.bfloat16)
  idx = jax.ShapeDtypeStruct((1, 4096, 2, top_k), jnp.int32)
  config = dataclasses.replace(ta.TileAttentionConfig.default(head_dim=d, group=group),
                               kernel=kernel)

  def loss(q, k, v, idx):
    out = ta.sparse_attention_tile(q, k, v, idx, block_size=64, scale=d ** -0.5,
                                   interpret=False, config=config)
    return jnp.sum(out.astype(jnp.float32))

  jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, idx).lower(
      lowering_platforms=("cuda",))
  names = [re.search(r"module @([A-Za-z0-9_]+)", m).group(1) for m in captured]
  for kind in ("fwd", "dq", "dkv", "dkv_reduce"):
    assert f"pisa_tile_attention_{kind}" in names, names
  if kernel == "auto":
    assert "pisa_sparse_attention_fwd" in names, names


CASES = [
    # T, HQ, HKV, D, C, K, TQ, dtype: T not a multiple of C or TQ, groups 1 / 4 / 16 / 3,
    # head dims 64, 128 and 48 (padded to 64), -1 padding in the early rows of every case.
    (1, 4, 2, 64, 16, 3, 16, jnp.float32),
    (63, 4, 4, 64, 16, 3, 16, jnp.float32),
    (100, 16, 4, 48, 16, 4, 8, jnp.bfloat16),
    (130, 16, 1, 128, 16, 5, 4, jnp.float32),
    (77, 3, 1, 128, 8, 8, 32, jnp.bfloat16),
]


def case_id(case):
  t, hq, hkv, d, c, k, tq, dtype = case
  return f"T{t}-HQ{hq}-HKV{hkv}-D{d}-C{c}-K{k}-TQ{tq}-{jnp.dtype(dtype).name}"


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_matches_reference_random_indices(case):
  t, hq, hkv, d, c, top_k, tq, dtype = case
  q, k, v, do = make_inputs(t, 1, t, hq, hkv, d, dtype)
  idx = random_indices(t, 1, t, hkv, top_k, c)
  scale = d ** -0.5
  got = run_tile(q, k, v, idx, do, c, scale, ta.TileAttentionConfig(tile_queries=tq))
  assert got[0].dtype == dtype
  assert_matches(got, reference_value_and_grads(q, k, v, idx, do, c, scale), dtype)


def test_matches_reference_selected_indices_default_config():
  """Indices from the real PISA selection (neighbouring queries share blocks), batch 2, the
  default config (TQ = 64 at a group of 2)."""
  t, hq, hkv, d, c, top_k = 150, 4, 2, 64, 16, 4
  q, k, v, do = make_inputs(7, 2, t, hq, hkv, d, jnp.float32)
  idx = pisa_jax.select_blocks(q, k, block_size=c, top_k=top_k, implementation="xla")
  got = run_tile(q, k, v, idx, do, c, 0.3, None)
  assert_matches(got, reference_value_and_grads(q, k, v, idx, do, c, 0.3), jnp.float32)


def test_split_work_items_and_bitwise_repeat():
  """items_tiles=1: every (tile, block) pair is its own dk/dv program, summed in tile order,
  and dkv_rows=16 takes a tile of 32 queries in two steps; the result matches the reference,
  and two runs are bit-identical."""
  t, hq, hkv, d, c, top_k = 96, 2, 2, 16, 8, 5
  q, k, v, do = make_inputs(3, 1, t, hq, hkv, d, jnp.float32)
  idx = random_indices(3, 1, t, hkv, top_k, c)
  config = ta.TileAttentionConfig(tile_queries=32, items_tiles=1, dkv_rows=16)
  first = run_tile(q, k, v, idx, do, c, 0.25, config)
  second = run_tile(q, k, v, idx, do, c, 0.25, config)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert_matches(first, reference_value_and_grads(q, k, v, idx, do, c, 0.25), jnp.float32)


def test_row_without_visible_key_gives_zeros():
  t, hq, hkv, d, c, top_k = 40, 4, 2, 32, 8, 3
  q, k, v, do = make_inputs(11, 1, t, hq, hkv, d, jnp.float32)
  idx = np.array(random_indices(11, 1, t, hkv, top_k, c))
  idx[0, 5:9, 0, :] = -1  # no block at all, inside a tile whose other queries see keys
  idx[0, 30, 1, :] = [-1, -1, -1]
  idx = jnp.asarray(idx)
  got = run_tile(q, k, v, idx, do, c, d ** -0.5, ta.TileAttentionConfig(tile_queries=16))
  out = np.asarray(got[0])
  np.testing.assert_array_equal(out[0, 5:9, 0:2], 0.0)
  np.testing.assert_array_equal(out[0, 30, 2:4], 0.0)
  assert np.all(np.asarray(got[1])[0, 5:9, 0:2] == 0.0)
  assert_matches(got, reference_value_and_grads(q, k, v, idx, do, c, d ** -0.5), jnp.float32)


@pytest.mark.parametrize("name,pos", [("q", (70, 1, 3)), ("k", (53, 1, 5)), ("k", (2, 0, 0)),
                                      ("v", (53, 1, 5)), ("v", (2, 0, 0))])
def test_nan_reaches_exactly_what_the_reference_shows(name, pos):
  """A NaN in q, k or v (block 0, forced for everyone, or mid-block) makes the same outputs and
  gradients non-finite as in the reference, though the rows of a tile share every dot: dq and dk
  of a NaN key or value, dv of any. A NaN query's dk is NaN at exactly the keys it sees (the
  reference's also reaches the keys after it in its block)."""
  t, hq, hkv, d, c, top_k = 128, 4, 2, 16, 16, 4
  q, k, v, do = make_inputs(4, 1, t, hq, hkv, d, jnp.float32)
  idx = pisa_jax.select_blocks(q, k, block_size=c, top_k=top_k, implementation="xla")
  t0, h0, d0 = pos
  q, k, v = {"q": (q.at[0, t0, h0, d0].set(jnp.nan), k, v),
             "k": (q, k.at[0, t0, h0, d0].set(jnp.nan), v),
             "v": (q, k, v.at[0, t0, h0, d0].set(jnp.nan))}[name]
  got = run_tile(q, k, v, idx, do, c, d ** -0.5, ta.TileAttentionConfig(tile_queries=16))
  want = reference_value_and_grads(q, k, v, idx, do, c, d ** -0.5)
  checked = ("o", "dq", "dv") if name == "q" else ("o", "dq", "dk", "dv")
  if name == "q":
    # The tile kernels' dk: NaN at exactly the keys the NaN query sees.
    h = h0 // (hq // hkv)
    sees = np.isin(np.arange(t) // c, np.asarray(idx)[0, t0, h]) & (np.arange(t) <= t0)
    want_dk = np.zeros((1, t, hkv, d), bool)
    want_dk[0, sees, h] = True
    np.testing.assert_array_equal(~np.isfinite(np.asarray(got[2])), want_dk)
  for label, g, w in zip(("o", "dq", "dk", "dv"), got, want):
    if label in checked:
      bad = ~np.isfinite(np.asarray(w))
      np.testing.assert_array_equal(~np.isfinite(np.asarray(g)), bad, err_msg=label)
      np.testing.assert_allclose(np.asarray(g)[~bad], np.asarray(w)[~bad], atol=1e-4,
                                 err_msg=label)


@pytest.mark.parametrize("window,hq,tq", [(True, 4, 16), (False, 32, 1)])
def test_auto_kernel_matches_reference_either_way(window, hq, tq):
  """kernel="auto": queries that select only their current and first blocks (K = 4 slots, a
  union of about 2 per tile of 16) take the tile kernels, random ones in tiles of one query (a
  group of 16: R = 16 rows) the per-query kernels; both give the reference's output and
  gradients."""
  t, hkv, d, c, top_k = 96, 2, 32, 8, 4
  q, k, v, do = make_inputs(5, 1, t, hq, hkv, d, jnp.float32)
  if window:
    cur = jnp.arange(t)[None, :, None, None] // c
    slot = jnp.arange(top_k)
    idx = jnp.where(slot == 0, 0, jnp.where(slot == 1, jnp.where(cur > 0, cur, -1), -1))
    idx = jnp.broadcast_to(idx, (1, t, hkv, top_k))
  else:
    idx = random_indices(5, 1, t, hkv, top_k, c)
  idx = idx.astype(jnp.int32)
  num_blocks = -(-t // c)
  _, _, count = tile_index.tile_unions(idx, block_size=c, tile_queries=tq,
                                       num_blocks=num_blocks)
  assert bool(tile_index.prefers_tile_kernel(count, tile_queries=tq, top_k=top_k)) == window
  config = ta.TileAttentionConfig(tile_queries=tq, kernel="auto")
  got = run_tile(q, k, v, idx, do, c, 0.2, config)
  assert_matches(got, reference_value_and_grads(q, k, v, idx, do, c, 0.2), jnp.float32)


def test_config_validation_and_dispatch():
  for kw, field in ((dict(tile_queries=24), "tile_queries"), (dict(tile_queries=64), "int32"),
                    (dict(kernel="rows"), "kernel"), (dict(dkv_rows=48), "dkv_rows"),
                    (dict(items_tiles=-1), "items_tiles")):
    with pytest.raises(ValueError, match=field):
      ta.TileAttentionConfig(**kw)
  q = jnp.zeros((1, 8, 2, 16))
  k = jnp.zeros((1, 8, 1, 16))
  idx = jnp.zeros((1, 8, 1, 1), jnp.int32)
  with pytest.raises(ValueError, match="config="):
    ta.sparse_attention_kernels(q, k, k, idx, block_size=4, scale=1.0, interpret=True,
                                config="tile")
  # The registered "pallas" implementation takes either config; the default stays per-query.
  pallas = _dispatch.lookup("sparse_attention", "pallas")
  per_query = pallas(q, k, k, idx, block_size=4, scale=1.0)
  tile = pallas(q, k, k, idx, block_size=4, scale=1.0, config=ta.TileAttentionConfig())
  same = pallas(q, k, k, idx, block_size=4, scale=1.0, config=attn.SparseAttentionConfig())
  np.testing.assert_array_equal(np.asarray(per_query), np.asarray(tile))
  np.testing.assert_array_equal(np.asarray(per_query), np.asarray(same))


def test_vmap_through_the_registered_pallas_implementation():
  t, hq, hkv, d, c, top_k = 33, 4, 2, 16, 8, 3
  qs, ks, vs, dos = zip(*(make_inputs(s, 1, t, hq, hkv, d, jnp.float32) for s in range(2)))
  q, k, v, do = (jnp.stack(x) for x in (qs, ks, vs, dos))
  idx = jnp.stack([random_indices(s, 1, t, hkv, top_k, c) for s in range(2)])
  pallas = _dispatch.lookup("sparse_attention", "pallas")

  def fn(q, k, v, idx):
    return pallas(q, k, v, idx, block_size=c, scale=d ** -0.5,
                  config=ta.TileAttentionConfig(tile_queries=8))

  batched = jax.jit(jax.vmap(lambda *a: value_and_grads(fn, *a)))(q, k, v, idx, do)
  for i in range(2):
    want = reference_value_and_grads(q[i], k[i], v[i], idx[i], do[i], c, d ** -0.5)
    assert_matches([x[i] for x in batched], want, jnp.float32)
