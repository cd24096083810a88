"""The selection benchmark's floor model (benchmarks/bench_selection.py: selection_floor), which
WORKSPACE.md and selection.json quote as "how far from the floor": its counts, checked by hand."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_selection  # noqa: E402


def test_selection_floor_counts_at_4k():
  # N = 4096, C = 64: 64 leaves, levels 64, 32, 16, 8, 4, 2, 1; with K = beam = 8 the first
  # level with more than 8 nodes is level 3 (16 nodes), so levels 3 and 2 are scored: per
  # (query, KV head) 2 levels x 16 heads x 16 candidates x 2 children = 1,024 exponentials.
  # Leaves: queries t >= 960 have 16 eligible candidates (13 scored after the 3 forced), t in
  # [512, 960) have 9..15 (6..12 scored, 64 queries each), earlier ones keep all (none scored):
  # 64 * (6 + ... + 12) + (4096 - 960) * 13 = 44,800 scored leaves per KV head.
  f = bench_selection.selection_floor(4096)
  scored = 64 * sum(range(6, 13)) + (4096 - 960) * 13
  assert scored == 44_800
  assert f["exponentials"] == 2 * (4096 * 1024 + scored * 16 * 64)
  # Per KV head: queries x levels x (hi + lo) x 2 FLOPs x G x NC x g x D, and the leaf dots.
  walk_flops = 4096 * 2 * 2 * 2 * 16 * 16 * 2 * 64
  assert f["flops"] == 2 * (walk_flops + scored * 2 * 16 * 64 * 64)
  assert f["bytes"] == 4096 * 32 * 64 * 2 + 4096 * 2 * 64 * 2 + 4096 * 2 * 8 * 4
  assert f["bound"] == "exponentials" and f["ms"] == max(f["ms_by_resource"].values())
