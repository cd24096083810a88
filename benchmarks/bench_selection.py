"""Block-selection latency on the GPU: the paper's Table 4 / Figure 3 setting, side by side.

B=1, 32 query heads, 2 KV heads, d=64, C=64, K=8, g=2, bf16 random q/k (seed 0). Each time covers
the summaries (pyramid or leaf means) and every selection stage, not attention. Every row starts
from `SelectionConfig.default` (one-warp walk and final top-k) and changes only what it names:
  pisa_q1 / pisa_q2 / pisa_q4 / pisa_q8  two-stage Pallas kernels with key-tile reuse over
                               1/2/4/8 queries (pisa_q8 is the default config)
  pisa_fused                   per-query fused Pallas kernel (all levels incl. leaves)
  bsa_pallas                   our flat BSA kernel (two passes, running top-k, no [T, M] in HBM)
  fla_bsa                      fla's NSA top-k after mean pooling (= BSA), fla-core 0.6.0
Probes, timed at --probe-sizes only (see PROBES): the one-pass rank top-k (topk_impl="rank") and
several queries per walk program (walk_q_tile), beside the default.
plus the stage breakdown of the default variant (and of the rank walk) and the memory each jitted
selection needs.
Before timing, the kernels are checked against the jnp reference on float32 inputs (and bf16 at
128K) at 4K, 32K, 128K and 1M; every mismatching row must be a proven near-tie
(tests/test_selection_pallas.py: decision_margin).

Run on the H200: `python3 benchmarks/bench_selection.py --out $OUT`. Writes selection.json and
selection.png (log-log latency against N, like the paper's Figure 3).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import os
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_default_matmul_precision", "highest")  # the reference, not our kernels

from pisa_jax.kernels import selection as sel  # noqa: E402
from pisa_jax.kernels.pyramid import build_pyramid_pallas  # noqa: E402
from pisa_jax.selection import select_blocks_reference, select_blocks_reference_at  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_selection_pallas import decision_margin  # noqa: E402

# The device sets PYTHONSAFEPATH=1, so a script's own folder is not on sys.path by itself.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import time_jax  # noqa: E402

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

HQ, HKV, D, C, TOP_K, G = 32, 2, 64, 64, 8, 2
SCALE = D ** -0.5
# Compiled through Triton on the GPU; the interpreter elsewhere (a CPU smoke run of this script).
INTERPRET = jax.default_backend() != "gpu"
RESULTS: dict = {"setting": dict(B=1, HQ=HQ, HKV=HKV, D=D, C=C, K=TOP_K, g=G, dtype="bfloat16",
                                 seed=0)}


def log(msg):
  print(msg, flush=True)


def inputs(n, dtype, seed=0, key_scale=1.0):
  kq, kk = jax.random.split(jax.random.PRNGKey(seed))
  q = jax.random.normal(kq, (1, n, HQ, D), jnp.float32).astype(dtype)
  k = (jax.random.normal(kk, (1, n, HKV, D), jnp.float32) * key_scale).astype(dtype)
  return q, k


def config(beam=TOP_K, **changes) -> sel.SelectionConfig:
  """`SelectionConfig.default` for the Table 4 setting at this beam (what `select_blocks_pallas`
  would pick: its NC = next power of two >= max(beam * g, 16)), with `changes` applied."""
  nc = sel.candidate_slots(beam, G)
  return dataclasses.replace(
      sel.SelectionConfig.default(seq_len=0, group=HQ // HKV, candidates=nc), **changes)


# The rank top-k's final kernel compares [topk_rows, NC, NC]: 8 rows on 2 warps is the largest
# tile without spills on sm_90a (ptxas, 2026-11-29: 96 registers; 32 rows spill on 1-2 warps).
RANK = dict(topk_impl="rank", topk_rows=8, topk_warps=2)
# name -> config changes of the tuning probes (two-stage Q4 unless they say otherwise).
PROBES = {
    "pisa_q4_rank": dict(RANK),  # rank top-k in walk and final kernel, 1-warp walk
    "pisa_q4_rank_w2": dict(RANK, walk_warps=2),
    "pisa_q4_rank_wq2": dict(RANK, walk_q_tile=2),  # 2 queries per walk program
    "pisa_q4_rank_wq4": dict(RANK, walk_q_tile=4),
    "pisa_q4_passes_wq2": dict(walk_q_tile=2),  # the current top-k, 2 queries per walk program
    "pisa_fused_rank": dict(variant="fused", topk_impl="rank"),
    # Longer leaf tiles: fewer programs, dots of q_tile * 16 rows.
    "pisa_q8": dict(q_tile=8),
    "pisa_q16": dict(q_tile=16),
    "pisa_q16_lw8": dict(q_tile=16, leaf_warps=8),
    "pisa_q16_rank": dict(RANK, q_tile=16),
    # Windowed leaf grouping: a batched sort per window of queries instead of one global argsort.
    "pisa_q8_w64": dict(q_tile=8, leaf_window=64),
    "pisa_q8_w256": dict(q_tile=8, leaf_window=256),
    "pisa_q8_w1024": dict(q_tile=8, leaf_window=1024),
    "pisa_q16_w1024": dict(q_tile=16, leaf_window=1024),
    "pisa_q8_s1": dict(q_tile=8, num_stages=1),
    "pisa_q8_lw2": dict(q_tile=8, leaf_warps=2),
    # The dense walk of the upper levels (levels of at most N nodes scored for a tile of queries).
    "pisa_q8_dense64": dict(walk_dense_nodes=64),
    "pisa_q8_dense128": dict(walk_dense_nodes=128),
    "pisa_q8_dense256": dict(walk_dense_nodes=256),
    "pisa_q8_dense64_t8": dict(walk_dense_nodes=64, walk_dense_q_tile=8),
    "pisa_q8_dense128_t2": dict(walk_dense_nodes=128, walk_dense_q_tile=2, walk_dense_warps=2),
    "pisa_q8_olse": dict(walk_online_lse=True, walk_pair_lse=False),  # 122 -> 106 walk registers
    "pisa_q8_dense64_olse": dict(walk_dense_nodes=64, walk_online_lse=True, walk_pair_lse=False),
    "pisa_q8_narrow": dict(leaf_wide_loads=False),  # leaf tiles loaded element by element
    # The fused default (K = 8) against its leaf loop over all 16 slots, and with a third
    # pipelining stage (session 5 at 128K: default 5.48, all slots 6.06, 3 stages 7.29 ms).
    "pisa_fused_allslots": dict(variant="fused", fused_compact_leaves=False),
    "pisa_fused_s3": dict(variant="fused", num_stages=3),
    # One stage: plain LDG loads (the 16-byte async copies of the pipelined loop bypass L1), so
    # the walk's upper levels, shared by every query, can hit in L1 (ncu at 128K: L1 hit rate
    # 0.04%, L2 70% busy).
    "pisa_fused_s1": dict(variant="fused", num_stages=1),
    # The walk's general Eq. 21 reduction instead of the pair form max + log(1 + exp(-|d|))
    # (the default since session 6: 5.31 -> 5.07 ms at 128K, 11.47 -> 10.85 at 256K).
    "pisa_fused_generic_lse": dict(variant="fused", walk_pair_lse=False),
    # Two leaves per iteration of the compacted loop (two independent chains per program, at
    # the price of registers; session 5 at 128K: 6.29 ms against the default's 5.48).
    "pisa_fused_u2": dict(variant="fused", fused_leaf_unroll=2),
    # Eq. 21 with the max shift in every program (the default before session 7, which takes the
    # unshifted branch where the logits' Cauchy-Schwarz bound allows it).
    "pisa_fused_shifted": dict(variant="fused", fused_unshifted_lse=False),
}
# Timed on the H200 on 2026-11-29 (session 2, 32K / 128K, ms; default pisa_q4 3.96 / 16.94):
# rank 4.12 / 18.06, rank + 2-warp walk 5.07 / 22.5, rank + wq2 4.29 / 18.7, rank + wq4 6.21 /
# 28.4, passes + wq2 4.17 / 18.3, fused rank 5.72 / 25.5, q8 3.39 / 14.83, q16 3.64 / 15.75,
# q16 8-warp 3.86 / 16.6, q8 + global-sort window 4096 3.41 / 15.95, q16 rank 3.84 / 16.9.
# Session 2 (after the above, Q8 default 2.96 / 12.94): Q8 + window 1024 2.95 / 14.31, one
# pipelining stage 2.91 / 12.89. The dense upper walk is new and untimed.
DEFAULT_PROBES = ("pisa_q8_dense64", "pisa_q8_dense128", "pisa_q8_dense256", "pisa_q8_dense64_t8",
                  "pisa_q8_dense128_t2", "pisa_q8_olse", "pisa_q8_dense64_olse")


def kernel_fn(selector="pisa", variant="two_stage", q_tile=8, beam=TOP_K, interpret=INTERPRET,
              **tiles):
  cfg = config(beam=beam, variant=variant, q_tile=q_tile, **tiles)
  return jax.jit(functools.partial(
      sel.select_blocks_pallas, block_size=C, top_k=TOP_K, branching=G, selector=selector,
      scale=SCALE, beam=beam, interpret=interpret, config=cfg))


def stage_fns():
  """Cumulative prefixes of the default two-stage pipeline, for the stage breakdown, and the
  pyramid + walk prefix with the rank top-k."""
  cfg = config()
  cfg_rank = config(**RANK)

  def geo(q, k):
    return sel._geometry(q, k, block_size=C, top_k=TOP_K, branching=G, selector="pisa",
                         scale=SCALE, beam=TOP_K, interpret=INTERPRET)

  def pyr(q, k):
    return build_pyramid_pallas(k, block_size=C, branching=G, interpret=INTERPRET).summaries

  def walk(q, k, cfg=cfg):
    s = build_pyramid_pallas(k, block_size=C, branching=G, interpret=INTERPRET).summaries
    return sel.leaf_candidates_pallas(q, k, s, geo(q, k), interpret=INTERPRET, config=cfg)

  def leaf(q, k):
    cand = walk(q, k)
    return sel.leaf_scores_pallas(q, k, cand, geo(q, k), interpret=INTERPRET, config=cfg)

  return {"pyramid": jax.jit(pyr), "pyramid+walk": jax.jit(walk),
          "pyramid+walk+leaf": jax.jit(leaf),
          "pyramid+walk_rank": jax.jit(functools.partial(walk, cfg=cfg_rank))}


def memory_bytes(compiled):
  m = compiled.memory_analysis()
  return int(m.temp_size_in_bytes + m.output_size_in_bytes)


def check(name, fn, q, k, selector, beam=TOP_K, max_proofs=200, sample=None):
  """Kernel vs reference; mismatching rows proven near-ties by a float64 re-walk.

  With `sample`, the reference runs only at the first 1024 and last 2048 positions plus `sample`
  random ones (`select_blocks_reference_at`: the same rows as the full reference), which keeps the
  1M-token check inside a device call; the kernel still runs on the whole sequence.
  """
  t0 = time.perf_counter()
  out = np.asarray(fn(q, k))
  kw = dict(block_size=C, top_k=TOP_K, branching=G, selector=selector, scale=SCALE, beam=beam)
  q32, k32 = q.astype(jnp.float32), k.astype(jnp.float32)
  n = q.shape[1]
  if sample is None:
    pos = np.arange(n)
    ref = np.asarray(select_blocks_reference(q32, k32, **kw))
  else:
    rng = np.random.default_rng(0)
    pos = np.unique(np.concatenate([np.arange(min(n, 1024)), np.arange(max(0, n - 2048), n),
                                    rng.choice(n, min(n, sample), replace=False)]))
    ref = np.asarray(select_blocks_reference_at(q32[:, pos], k32, jnp.asarray(pos, jnp.int32), **kw))
    out = out[:, pos]
  bad = np.argwhere(np.any(out != ref, axis=-1))
  # Host copies (8.6 GB of queries at 1M) only when a mismatch needs a proof.
  qn, kn = (np.asarray(q32), np.asarray(k32)) if len(bad) else (None, None)
  margins, cache = [], {}
  for b, i, h in bad[:max_proofs]:
    margins.append(decision_margin(qn, kn, int(b), int(pos[i]), int(h), cache=cache, **kw))
  proven = all(m < 1e-4 for m in margins)
  # unproven_rows: mismatches past max_proofs (session 6-7 runs proved at most 30 per check).
  res = dict(rows=int(np.prod(out.shape[:3])), mismatched_rows=int(len(bad)),
             proofs_checked=len(margins), unproven_rows=int(len(bad)) - len(margins),
             max_margin_of_mismatch=float(max(margins, default=0)),
             all_checked_mismatches_near_ties=bool(proven), seconds=round(time.perf_counter() - t0, 1))
  if sample is not None:
    res["positions_checked"] = int(len(pos))
  RESULTS.setdefault("correctness", {})[name] = res
  log(f"check {name}: {res}")


def fla_fns(n):
  import torch
  from fla.ops.nsa.parallel import parallel_nsa_topk
  from fla.ops.utils.pooling import mean_pooling
  torch.manual_seed(0)
  q = torch.randn(1, n, HQ, D, device="cuda", dtype=torch.bfloat16)
  k = torch.randn(1, n, HKV, D, device="cuda", dtype=torch.bfloat16)

  def run():
    kc = mean_pooling(k, C)
    return parallel_nsa_topk(q=q, k=kc, lse=None, TK=n, block_counts=TOP_K, block_size=C,
                             scale=SCALE)
  return run


def time_fla(n):
  import torch
  import triton
  run = fla_fns(n)
  run()
  torch.cuda.synchronize()
  torch.cuda.reset_peak_memory_stats()
  base = torch.cuda.memory_allocated()
  t0 = time.perf_counter()
  run()
  torch.cuda.synchronize()
  first = time.perf_counter() - t0
  peak = torch.cuda.max_memory_allocated() - base
  if first < 0.05:
    ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
  else:
    times = []
    for _ in range(3 if first < 1 else 1):
      t0 = time.perf_counter()
      run()
      torch.cuda.synchronize()
      times.append(time.perf_counter() - t0)
    ms = float(np.median(times) * 1e3)
  return float(ms), int(peak)


# H200 ceilings for the floor: 132 SMs at the 1,980 MHz maximum SM clock (nvidia-smi), 16 MUFU
# exp2/log2 per SM per clock, HBM3e 4.8 TB/s; the dense bf16 matmul rate measured in
# bench_attention.py's runs (~700 TFLOP/s; the selection's M = 16 dots cannot reach it, so this
# side of the floor is generous).
H200_SMS, H200_CLOCK_HZ, MUFU_PER_SM_CLOCK, HBM_BYTES_S, MATMUL_FLOPS_S = (
    132, 1.98e9, 16, 4.8e12, 7.0e14)


def scored_leaves_per_kv_head(n: int, block_size: int = C, top_k: int = TOP_K, beam: int = TOP_K,
                             branching: int = G) -> int:
  """How many (query, leaf) scores the leaf stage computes for one KV head (beam >= top_k).

  Query t (current leaf cur = t // C): while at most `beam` level-2 nodes are eligible, all are
  kept and every leaf 0..cur is a candidate; after that, `beam` level-2 nodes are kept and their
  beam * g children are the candidates, less the current node's children after cur (not yet
  eligible). Ranking by score happens only with more than top_k eligible candidates, and the
  forced leaves 0, cur - 1 and cur are not scored.
  """
  cur = np.arange(n) // block_size
  wide = cur // branching + 1 > beam
  eligible = np.where(wide, beam * branching - (branching - 1 - cur % branching), cur + 1)
  return int(np.where(eligible > top_k, eligible - 3, 0).sum())


def selection_floor(n: int) -> dict:
  """Lower bound on the time of PISA selection as the kernels do it (Table 4 setting, beam = K):
  the work every (query, KV head) must do, against the H200's ceilings, each resource alone.

  Per (query t, KV head): at every scored level (`_first_scored_level` down to 2) the group's
  16 heads score NC = 16 candidates from their g = 2 children's float32 summaries (2 * 16 * 32 *
  D FLOPs, twice for the high / low 16-bit split, and 16 * 32 exponentials); at the leaves the
  eligible non-forced candidates (at most NC - 3, and none while at most K leaves are eligible)
  each cost a [16, D] x [D, C] dot and 16 * C exponentials (`scored_leaves_per_kv_head`). Bytes: each query row once, each key
  once, the indices once. The floor is the slowest resource alone (they overlap in the best
  case).
  """
  scored_leaves = scored_leaves_per_kv_head(n)
  geo = sel._geometry(jax.ShapeDtypeStruct((1, n, HQ, D), jnp.bfloat16),
                      jax.ShapeDtypeStruct((1, n, HKV, D), jnp.bfloat16), block_size=C,
                      top_k=TOP_K, branching=G, selector="pisa", scale=SCALE, beam=TOP_K)
  first = sel._first_scored_level(geo)
  levels = max(0, first - 1)  # levels first .. 2
  nc, group = geo.nc, HQ // HKV
  rows = n * HKV
  flops = HKV * (rows // HKV * levels * 2 * 2 * group * nc * G * D
                 + scored_leaves * 2 * group * D * C)
  exps = HKV * (rows // HKV * levels * group * nc * G + scored_leaves * group * C)
  nbytes = n * HQ * D * 2 + n * HKV * D * 2 + rows * TOP_K * 4
  times = {"flops": flops / MATMUL_FLOPS_S, "exponentials": exps / (
      H200_SMS * MUFU_PER_SM_CLOCK * H200_CLOCK_HZ), "bytes": nbytes / HBM_BYTES_S}
  bound = max(times, key=times.get)
  return dict(flops=float(flops), exponentials=float(exps), bytes=float(nbytes),
              ms=round(times[bound] * 1e3, 4), bound=bound,
              ms_by_resource={k: round(v * 1e3, 4) for k, v in times.items()})


def add_floors():
  """RESULTS["floor"] per timed N, and how far the best PISA variant is from it."""
  floors = {}
  for n, row in RESULTS.get("best_pisa", {}).items():
    f = selection_floor(int(n))
    f["best_pisa_over_floor"] = round(row["ms"] / f["ms"], 2)
    floors[n] = f
  RESULTS["floor"] = floors


def plot(out_dir):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  lat = RESULTS["latency_ms"]
  fig, ax = plt.subplots(figsize=(7, 5))
  for name, style in (("fla_bsa", "k--o"), ("bsa_pallas", "r-s"), ("pisa_fused", "m-^"),
                      ("pisa_q1", "y-v"), ("pisa_q2", "g-v"), ("pisa_q4", "c-D"),
                      ("pisa_q8", "b-D")):
    pts = sorted((int(n), v) for n, v in lat.get(name, {}).items())
    if pts:
      ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name, ms=4)
  floor = sorted((int(n), f["ms"]) for n, f in RESULTS.get("floor", {}).items())
  if floor:
    ax.plot([p[0] for p in floor], [p[1] for p in floor], color="0.5", ls=":",
            label="floor (MUFU exp2 bound)")
  best = RESULTS.get("best_pisa", {})
  for n, row in best.items():
    fla = lat.get("fla_bsa", {}).get(n)
    if fla:
      ax.annotate(f"{fla / row['ms']:.1f}x", (int(n), row["ms"]), textcoords="offset points",
                  xytext=(0, -12), fontsize=7, ha="center", color="b")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("sequence length N")
  ax.set_ylabel("selection latency (ms)")
  ax.set_title("Block selection on H200: B=1, 32/2 heads, d=64, C=64, K=8, g=2, bf16\n"
               "(annotations: fla BSA time / best PISA time)", fontsize=9)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "selection.png"), dpi=120)


def check_list(n):
  """(name, selector, beam, dtype, seed, key_scale, kernel) of the GPU checks at size n (before
  any timing counts; built without a GPU, so CI checks that every probe it names exists).
  key_scale multiplies the keys (`inputs`): 40 puts the logits past the fused kernel's
  unshifted bound, so its programs take the shifted branch."""
  out = [(f"pisa_q8.f32.N{n}", "pisa", TOP_K, jnp.float32, 1, 1.0, kernel_fn(q_tile=8))]
  if n <= 32768:
    out.append((f"pisa_fused.f32.N{n}", "pisa", TOP_K, jnp.float32, 1, 1.0,
                kernel_fn(variant="fused")))
    # The probes' new kernels (rank top-k, multi-query walk) before their timings count.
    for name in ("pisa_q4_rank", "pisa_q8_w256", "pisa_fused_rank", "pisa_fused_s1",
                 "pisa_fused_generic_lse", "pisa_q8_dense64", "pisa_q8_dense256",
                 "pisa_q8_dense64_olse"):
      out.append((f"{name}.f32.N{n}", "pisa", TOP_K, jnp.float32, 1, 1.0,
                  kernel_fn(**PROBES[name])))
    out.append((f"bsa_pallas.f32.N{n}", "bsa", TOP_K, jnp.float32, 1, 1.0,
                kernel_fn(selector="bsa")))
  if n == 4096:
    for s in ("pisa1", "pisa2"):
      out.append((f"{s}_q8.f32.N{n}", s, TOP_K, jnp.float32, 1, 1.0, kernel_fn(selector=s)))
    out.append((f"pisa_q2_beam16.f32.N{n}", "pisa", 16, jnp.float32, 1, 1.0,
                kernel_fn(q_tile=2, beam=16)))
    out.append((f"pisa2_q4_rank_wq2_beam16.f32.N{n}", "pisa2", 16, jnp.float32, 1, 1.0,
                kernel_fn(selector="pisa2", beam=16, **PROBES["pisa_q4_rank_wq2"])))
  if n == 131072:
    # 16-bit inputs: the split summaries (high + low 16-bit rows), every variant that reads them.
    out.append((f"pisa_q8.bf16.N{n}", "pisa", TOP_K, jnp.bfloat16, 2, 1.0, kernel_fn(q_tile=8)))
    out.append((f"pisa_fused.f32.N{n}", "pisa", TOP_K, jnp.float32, 1, 1.0,
                kernel_fn(variant="fused")))
    out.append((f"pisa_fused.bf16.N{n}", "pisa", TOP_K, jnp.bfloat16, 2, 1.0,
                kernel_fn(variant="fused")))
    out.append((f"bsa_pallas.bf16.N{n}", "bsa", TOP_K, jnp.bfloat16, 2, 1.0,
                kernel_fn(selector="bsa")))
  if n in (32768, 131072):
    # The fused kernel's shifted branch (logits past its unshifted bound).
    out.append((f"pisa_fused.bf16.N{n}.keys40", "pisa", TOP_K, jnp.bfloat16, 2, 40.0,
                kernel_fn(variant="fused")))
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
  ap.add_argument("--sizes", default="4096,8192,16384,32768,65536,131072,262144,524288,1048576")
  # At 524288 and above only 8192+ sampled positions are checked against the reference
  # (select_blocks_reference_at): the full float32 reference at 1M overran a 165 s limit.
  ap.add_argument("--checks", default="4096,32768,131072,1048576")
  ap.add_argument("--variants", default="pisa_q1,pisa_q2,pisa_q4,pisa_q8,pisa_fused,bsa_pallas")
  # Tuning probes, timed only at --probe-sizes.
  ap.add_argument("--probes", default=",".join(DEFAULT_PROBES))
  ap.add_argument("--probe-sizes", default="32768,131072")
  ap.add_argument("--stage-sizes", default="32768,131072",
                  help="sizes with the stage breakdown of pisa_q8 (4 extra compiles each)")
  ap.add_argument("--compile-threads", type=int, default=16)
  ap.add_argument("--skip-fla", action="store_true")
  ap.add_argument("--replot", metavar="JSON",
                  help="no GPU: recompute the floors of a saved selection.json, write it and the "
                       "plot to --out, and stop")
  args = ap.parse_args()
  if args.replot:
    with open(args.replot) as f:
      RESULTS.update(json.load(f))
    add_floors()
    with open(os.path.join(args.out, "selection.json"), "w") as f:
      json.dump(RESULTS, f, indent=1)
    plot(args.out)
    log(json.dumps({n: (f["ms"], f["bound"], f["best_pisa_over_floor"])
                    for n, f in RESULTS["floor"].items()}))
    return
  sizes = [int(x) for x in args.sizes.split(",") if x]
  checks = [int(x) for x in args.checks.split(",") if x]
  variants = [x for x in args.variants.split(",") if x]
  probes = [x for x in args.probes.split(",") if x]
  probe_sizes = {int(x) for x in args.probe_sizes.split(",") if x}

  stage_sizes = {int(x) for x in args.stage_sizes.split(",") if x}

  def names_at(n):
    return variants + (probes if n in probe_sizes else [])

  def stages_at(n):
    return list(stages) if n in stage_sizes else []
  RESULTS["device"] = str(jax.devices()[0])
  RESULTS["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
  out_json = os.path.join(args.out, "selection.json")

  def dump():
    with open(out_json, "w") as f:
      json.dump(RESULTS, f, indent=1)

  fns = {"pisa_q1": kernel_fn(q_tile=1), "pisa_q2": kernel_fn(q_tile=2),
         "pisa_q4": kernel_fn(q_tile=4), "pisa_q8": kernel_fn(q_tile=8),
         "pisa_fused": kernel_fn(variant="fused"),
         "bsa_pallas": kernel_fn(selector="bsa")}
  unknown = [p for p in probes if p not in PROBES]
  if unknown:
    raise SystemExit(f"--probes {unknown} unknown: expected names from {list(PROBES)}")
  fns.update({name: kernel_fn(**PROBES[name]) for name in probes})
  stages = stage_fns()

  # Compile everything up front, in parallel (Triton compiles are CPU-bound and independent).
  t0 = time.perf_counter()
  jobs = {}
  check_compiled = {}
  with concurrent.futures.ThreadPoolExecutor(args.compile_threads) as pool:
    for n in sizes:
      spec = [jax.ShapeDtypeStruct((1, n, HQ, D), jnp.bfloat16),
              jax.ShapeDtypeStruct((1, n, HKV, D), jnp.bfloat16)]
      for name in names_at(n):
        jobs[(name, n)] = pool.submit(lambda f=fns[name], s=spec: f.lower(*s).compile())
      for name in stages_at(n):
        f = stages[name]
        jobs[(name, n)] = pool.submit(lambda f=f, s=spec: f.lower(*s).compile())
    check_jobs = {}
    for n in checks:
      for name, selector, beam, dtype, seed, _, fn in check_list(n):
        spec = [jax.ShapeDtypeStruct((1, n, HQ, D), dtype), jax.ShapeDtypeStruct((1, n, HKV, D), dtype)]
        check_jobs[name] = pool.submit(lambda f=fn, s=spec: f.lower(*s).compile())
    compiled = {}
    for fut in concurrent.futures.as_completed(list(jobs.values())):
      key = next(k for k, v in jobs.items() if v is fut)
      log(f"compiled {key} at {time.perf_counter() - t0:.1f} s")
      try:
        compiled[key] = fut.result()
      except Exception as e:  # a failing variant is recorded, the others still run
        RESULTS.setdefault("errors", {})[f"compile.{key[0]}.N{key[1]}"] = repr(e)[:600]
        log(f"compile failed {key}: {repr(e)[:600]}")
    for name, fut in check_jobs.items():
      try:
        check_compiled[name] = fut.result()
      except Exception as e:
        RESULTS.setdefault("errors", {})[f"compile.{name}"] = repr(e)[:600]
        log(f"compile failed {name}: {repr(e)[:600]}")
  RESULTS["compile_seconds"] = round(time.perf_counter() - t0, 1)
  log(f"compiled {len(compiled)} in {RESULTS['compile_seconds']} s")

  # Correctness first at the smallest check size, then the timings, then the larger checks.
  def run_checks(ns):
    for n in ns:
      for name, selector, beam, dtype, seed, key_scale, fn in check_list(n):
        try:
          q, k = inputs(n, dtype, seed=seed, key_scale=key_scale)
          check(name, check_compiled.get(name, fn), q, k, selector, beam=beam,
                sample=8192 if n >= 524288 else None)
        except Exception:
          RESULTS.setdefault("errors", {})[f"check.{name}"] = traceback.format_exc()[-1500:]
          log(f"check failed {name}: {traceback.format_exc()[-1500:]}")
        dump()

  run_checks([n for n in checks if n <= 4096])

  lat = RESULTS.setdefault("latency_ms", {})
  mem = RESULTS.setdefault("memory_bytes", {})
  for n in sizes:
    q, k = inputs(n, jnp.bfloat16, seed=0)
    for name in names_at(n) + stages_at(n):
      if (name, n) not in compiled:
        continue
      try:
        lat.setdefault(name, {})[str(n)] = time_jax(compiled[(name, n)], q, k)
        mem.setdefault(name, {})[str(n)] = memory_bytes(compiled[(name, n)])
      except Exception as e:
        RESULTS.setdefault("errors", {})[f"run.{name}.N{n}"] = repr(e)[:600]
        log(f"run failed {name} N{n}: {repr(e)[:600]}")
    if not args.skip_fla:
      try:
        ms, peak = time_fla(n)
        lat.setdefault("fla_bsa", {})[str(n)] = round(ms, 4)
        mem.setdefault("fla_bsa", {})[str(n)] = peak
      except Exception as e:
        RESULTS.setdefault("errors", {})[f"fla.N{n}"] = repr(e)[:600]
        log(f"fla failed N{n}: {repr(e)[:600]}")
    row = {name: lat.get(name, {}).get(str(n)) for name in names_at(n) + ["fla_bsa"] + stages_at(n)}
    log(f"N={n}: " + ", ".join(f"{a}={b}" for a, b in row.items()))
    dump()

  # Derived: best PISA variant per N, ratio to fla, doubling growth, stage breakdown.
  pisa_names = [v for v in variants if v.startswith("pisa")]
  best = {}
  for n in sizes:
    cands = [(lat[v][str(n)], v) for v in pisa_names if str(n) in lat.get(v, {})]
    if cands:
      ms, v = min(cands)
      fla = lat.get("fla_bsa", {}).get(str(n))
      best[str(n)] = dict(ms=ms, variant=v, fla_over_pisa=round(fla / ms, 2) if fla else None)
  RESULTS["best_pisa"] = best
  add_floors()
  growth = {}
  for v in pisa_names + ["bsa_pallas", "fla_bsa"]:
    pts = lat.get(v, {})
    growth[v] = {f"{a}->{b}": round(pts[str(b)] / pts[str(a)], 2)
                 for a, b in zip(sizes, sizes[1:]) if str(a) in pts and str(b) in pts}
  RESULTS["doubling_ratio"] = growth
  brk = {}
  for n in sizes:
    s = {name: lat.get(name, {}).get(str(n)) for name in list(stages) + ["pisa_q8"]}
    if all(x is not None for x in s.values()):
      brk[str(n)] = dict(pyramid=s["pyramid"], walk=round(s["pyramid+walk"] - s["pyramid"], 4),
                         leaf_scoring_incl_sort=round(s["pyramid+walk+leaf"] - s["pyramid+walk"], 4),
                         final_topk=round(s["pisa_q8"] - s["pyramid+walk+leaf"], 4),
                         walk_rank=round(s["pyramid+walk_rank"] - s["pyramid"], 4))
  RESULTS["stage_breakdown_ms_pisa_q8"] = brk
  # Probes against the default (pisa_q8) at the same N: > 1 means the probe is faster.
  RESULTS["probe_speedup_over_pisa_q8"] = {
      p: {n: round(lat["pisa_q8"][n] / ms, 3) for n, ms in lat.get(p, {}).items()
          if n in lat.get("pisa_q8", {})}
      for p in probes}
  dump()
  plot(args.out)

  run_checks([n for n in checks if n > 4096])
  dump()
  log(json.dumps({k: RESULTS[k] for k in ("best_pisa", "doubling_ratio") if k in RESULTS}))
  log("DONE")


if __name__ == "__main__":
  main()
