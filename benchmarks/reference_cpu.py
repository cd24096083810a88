"""Times the jnp reference on the CPU at T = 32768, 8 query heads / 2 KV heads, D = 64.

`python benchmarks/reference_cpu.py` writes benchmarks/results/reference_cpu.json: the wall time of
each selector and of sparse attention (first call including compilation, then the median of the
following calls) and the peak resident memory of the process.
"""

from __future__ import annotations

import json
import pathlib
import platform
import resource
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import pisa_jax


def timed(fn, repeats: int):
  start = time.perf_counter()
  jax.block_until_ready(fn())
  first = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return first, statistics.median(times)


def main() -> None:
  seq_len = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (1, seq_len, 8, 64), jnp.float32)
  k = jax.random.normal(kk, (1, seq_len, 2, 64), jnp.float32)
  v = jax.random.normal(kv, (1, seq_len, 2, 64), jnp.float32)
  results = {"T": seq_len, "HQ": 8, "HKV": 2, "D": 64, "block_size": 64, "top_k": 8, "branching": 2,
             "device": platform.processor() or platform.machine(), "cpus": len(jax.devices("cpu")),
             "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "seconds": {}}
  idx = None
  for selector in ("pisa", "pisa1", "pisa2", "bsa"):
    fn = lambda: pisa_jax.select_blocks(q, k, selector=selector, implementation="xla")
    first, median = timed(fn, 2)
    results["seconds"][f"select_blocks.{selector}"] = {"first_call": round(first, 2), "median": round(median, 2)}
    print(selector, first, median, flush=True)
    if selector == "pisa":
      idx = fn()
  fn = lambda: pisa_jax.sparse_attention(q, k, v, idx, implementation="xla")
  first, median = timed(fn, 2)
  results["seconds"]["sparse_attention"] = {"first_call": round(first, 2), "median": round(median, 2)}
  results["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
  print(json.dumps(results, indent=1))
  out = pathlib.Path(__file__).parent / "results" / "reference_cpu.json"
  out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
  main()
