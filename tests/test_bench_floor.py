"""The selection benchmark's floor model (benchmarks/bench_selection.py: selection_floor), which
WORKSPACE.md and selection.json quote as "how far from the floor": its counts, checked by hand;
and its GPU check list, built without a GPU."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_selection  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from pisa_jax.kernels import selection as sel  # noqa: E402
from pisa_jax.kernels.pyramid import build_pyramid_pallas  # noqa: E402


def test_selection_floor_counts_at_4k():
  # N = 4096, C = 64: 64 leaves, levels 64, 32, 16, 8, 4, 2, 1; with K = beam = 8 the first
  # level with more than 8 nodes is level 3 (16 nodes), so levels 3 and 2 are scored: per
  # (query, KV head) 2 levels x 16 heads x 16 candidates x 2 children = 1,024 exponentials.
  # Leaves: current leaf cur <= 15 keeps every level-2 node, so leaves 0..cur are candidates and
  # cur = 8..15 score cur + 1 - 3 = 6..13 of them; from cur = 16 on, 8 kept nodes give 16
  # candidates, less cur + 1 when cur is even: 13 scored (odd cur) or 12 (even), 64 queries each.
  f = bench_selection.selection_floor(4096)
  scored = 64 * sum(range(6, 14)) + 64 * (24 * 13 + 24 * 12)
  assert scored == bench_selection.scored_leaves_per_kv_head(4096) == 43_264
  assert f["exponentials"] == 2 * (4096 * 1024 + scored * 16 * 64)
  # Per KV head: queries x levels x (hi + lo) x 2 FLOPs x G x NC x g x D, and the leaf dots.
  walk_flops = 4096 * 2 * 2 * 2 * 16 * 16 * 2 * 64
  assert f["flops"] == 2 * (walk_flops + scored * 2 * 16 * 64 * 64)
  assert f["bytes"] == 4096 * 32 * 64 * 2 + 4096 * 2 * 64 * 2 + 4096 * 2 * 8 * 4
  assert f["bound"] == "exponentials" and f["ms"] == max(f["ms_by_resource"].values())


@pytest.mark.parametrize("t,block_size,top_k,beam,g", [(1024, 16, 8, 8, 2), (700, 8, 4, 6, 3)])
def test_scored_leaf_count_equals_the_kernels(t, block_size, top_k, beam, g):
  # The model's count against the leaf candidates the Pallas walk really produces (interpret
  # mode): the pairs `_leaf_needs_score` sends to the leaf stage.
  q = jax.random.normal(jax.random.PRNGKey(0), (1, t, 4, 32), jnp.float32)
  k = jax.random.normal(jax.random.PRNGKey(1), (1, t, 1, 32), jnp.float32)
  geo = sel._geometry(q, k, block_size=block_size, top_k=top_k, branching=g, selector="pisa",
                      scale=0.25, beam=beam)
  summaries = build_pyramid_pallas(k, block_size=block_size, branching=g, interpret=True).summaries
  cand = sel.leaf_candidates_pallas(q, k, summaries, geo, interpret=True,
                                    config=sel.SelectionConfig(variant="two_stage"))
  need, _, _ = sel._leaf_needs_score(cand, jnp.arange(t)[:, None], geo)
  assert int(need.sum()) == bench_selection.scored_leaves_per_kv_head(
      t, block_size=block_size, top_k=top_k, beam=beam, branching=g)


def test_check_list_builds_at_every_checked_size():
  # The GPU checks run before the timings of a device call; building their kernels needs no GPU,
  # so a probe renamed without updating the list (a lost device call in session 6) fails here.
  names = set()
  for n in (4096, 32768, 131072, 1048576):
    entries = bench_selection.check_list(n)
    assert entries and all(callable(e[-1]) for e in entries)
    names.update(e[0] for e in entries)
  assert len(names) == sum(len(bench_selection.check_list(n)) for n in (4096, 32768, 131072,
                                                                        1048576))


@pytest.mark.parametrize("t,d,top_k,stages", [(1024, 64, 8, 2), (65536, 128, 32, 3)])
def test_mosaic_load_probe_lowers_for_cuda(t, d, top_k, stages):
  # benchmarks/mosaic_load_probe.py (issue 4: the forward's block reads by TMA, no math) runs
  # only on the H200, but its Mosaic GPU kernel lowers here, so an API change fails in CI. (The
  # launch itself is not checked: its first 2-D grid put T = 65,536 past CUDA's 65,535 limit,
  # which only the H200 showed.)
  import mosaic_load_probe

  kv = jax.ShapeDtypeStruct((t, 2, d), jnp.bfloat16)
  idx = jax.ShapeDtypeStruct((t, 2, top_k), jnp.int32)
  fn = jax.jit(lambda k, v, i: mosaic_load_probe.tma_loads(k, v, i, stages=stages))
  text = fn.trace(kv, kv, idx).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
