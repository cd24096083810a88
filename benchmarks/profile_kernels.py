"""Per-kernel device time of the selection and attention pipelines, from a JAX profiler trace.

Each case jits one call, runs it once, traces `--calls` more and sums the GPU events by name (per
trace line: the streams' kernels and XLA's op view), divided by the number of calls. This is what
the stage breakdown of bench_selection.py cannot show: the XLA glue (argsort, scatters, gathers)
beside each Pallas kernel.

  python3 benchmarks/profile_kernels.py --out $OUT [--cases sel.K8.d64.N131072,...]
  ncu ... python3 benchmarks/profile_kernels.py --no-trace --calls 0 --cases ...  (h200_session.sh's
  NCU_S stage: hardware counters of each kernel's first launch)

Writes profile_kernels.json: {case: {"wall_ms": ..., "lines": {line: [[name, ms per call,
launches per call], ...]}}}.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import glob
import json
import os
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp

from pisa_jax.kernels import selection as sel

warnings.filterwarnings("ignore", message=".*Triton.*deprecated.*")
INTERPRET = jax.default_backend() != "gpu"


def _inputs(n, hq, hkv, d, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q, do = (jax.random.normal(ks[i], (1, n, hq, d), jnp.float32).astype(jnp.bfloat16) for i in (0, 3))
  k, v = (jax.random.normal(ks[i], (1, n, hkv, d), jnp.float32).astype(jnp.bfloat16) for i in (1, 2))
  return q, k, v, do


def _selection_case(n, top_k, d, beam=None, **changes):
  q, k, _, _ = _inputs(n, 32, 2, d)
  nc = sel.candidate_slots(beam or top_k, 2)
  cfg = dataclasses.replace(sel.SelectionConfig.default(seq_len=n, group=16, candidates=nc),
                            **changes)
  fn = jax.jit(functools.partial(
      sel.select_blocks_pallas, block_size=64, top_k=top_k, branching=2, selector="pisa",
      scale=d ** -0.5, beam=beam or top_k, interpret=INTERPRET, config=cfg))
  return fn, (q, k)


def _layer_case(n, top_k, d):
  import pisa_jax
  q, k, v, do = _inputs(n, 32, 2, d)

  def loss(q, k, v):
    out = pisa_jax.pisa_attention(q, k, v, block_size=64, top_k=top_k, implementation="pallas")
    return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, k, v)


RANK1 = dict(topk_impl="rank", topk_rows=1, topk_warps=2)
CASES = {
    "sel.K8.d64.N131072": lambda: _selection_case(131072, 8, 64),
    "sel.K8.d64.N262144": lambda: _selection_case(262144, 8, 64),
    "sel.K8.d64.N131072.q8.w1024": lambda: _selection_case(131072, 8, 64, q_tile=8,
                                                           leaf_window=1024),
    "sel.K8.d64.N131072.beam16": lambda: _selection_case(131072, 8, 64, beam=16, q_tile=8),
    "sel.K8.d64.N131072.beam16.rank": lambda: _selection_case(131072, 8, 64, beam=16, q_tile=8,
                                                              **RANK1),
    "sel.K8.d64.N131072.dense64": lambda: _selection_case(131072, 8, 64, walk_dense_nodes=64),
    "sel.K8.d64.N131072.dense256": lambda: _selection_case(131072, 8, 64, walk_dense_nodes=256),
    "sel.K8.d64.N131072.olse": lambda: _selection_case(131072, 8, 64, walk_online_lse=True,
                                                        walk_pair_lse=False),
    "sel.K8.d64.N131072.beam16.olse": lambda: _selection_case(131072, 8, 64, beam=16,
                                                              walk_online_lse=True,
                                                              walk_pair_lse=False),
    "sel.K32.d128.N65536": lambda: _selection_case(65536, 32, 128),
    "sel.K32.d128.N65536.dense64": lambda: _selection_case(65536, 32, 128, walk_dense_nodes=64),
    "sel.K32.d128.N65536.q8": lambda: _selection_case(65536, 32, 128, q_tile=8),
    "sel.K32.d128.N65536.rank": lambda: _selection_case(65536, 32, 128, q_tile=8, **RANK1),
    "sel.K32.d128.N65536.rank.w4": lambda: _selection_case(65536, 32, 128, q_tile=8, walk_warps=4,
                                                           **RANK1),
    "sel.K32.d128.N65536.w2": lambda: _selection_case(65536, 32, 128, q_tile=8, walk_warps=2),
    "layer.K32.d128.N65536": lambda: _layer_case(65536, 32, 128),
    "layer.K8.d64.N131072": lambda: _layer_case(131072, 8, 64),
}


def _aggregate(trace_dir, calls):
  from jax._src.profiler import ProfileData
  lines = {}
  for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
    for plane in ProfileData.from_file(path).planes:
      if "GPU" not in plane.name and "gpu" not in plane.name:
        continue
      for line in plane.lines:
        acc = collections.defaultdict(lambda: [0.0, 0])
        for ev in line.events:
          acc[ev.name][0] += ev.duration_ns / 1e6 / calls
          acc[ev.name][1] += 1
        top = sorted(acc.items(), key=lambda kv: -kv[1][0])[:25]
        # [name, ms per call, launches per call]
        lines[f"{plane.name}|{line.name}"] = [[name, round(ms, 4), round(c / calls, 2)]
                                               for name, (ms, c) in top]
  return lines


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
  ap.add_argument("--cases", default=",".join(CASES))
  ap.add_argument("--calls", type=int, default=3)
  ap.add_argument("--no-trace", action="store_true",
                  help="only run each case 1 + --calls times (under ncu, which owns the profiler)")
  args = ap.parse_args()
  results = {"device": str(jax.devices()[0]), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
  out_path = os.path.join(args.out, "profile_kernels.json")
  for name in [c for c in args.cases.split(",") if c]:
    try:
      fn, inputs = CASES[name]()
      jax.block_until_ready(fn(*inputs))
      if args.no_trace:
        for _ in range(args.calls):
          jax.block_until_ready(fn(*inputs))
        print(f"== {name}: ran {1 + args.calls} calls", flush=True)
        continue
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*inputs))
      wall = (time.perf_counter() - t0) * 1e3
      with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
          for _ in range(args.calls):
            jax.block_until_ready(fn(*inputs))
        results[name] = {"wall_ms": round(wall, 3), "lines": _aggregate(trace_dir, args.calls)}
      print(f"== {name}: wall {wall:.3f} ms", flush=True)
      for line, rows in results[name]["lines"].items():
        if rows:
          print(f"  {line}: " + "; ".join(f"{n[:60]} {ms:.3f} ms x{c:g}" for n, ms, c in rows[:12]),
                flush=True)
    except Exception as e:  # recorded, the other cases still run
      results[name] = {"error": repr(e)[:800]}
      print(f"== {name}: error {e!r}"[:800], flush=True)
    with open(out_path, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
