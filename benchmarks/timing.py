"""Wall-clock timing of jitted calls, shared by the benchmarks (our side of every comparison)."""

from __future__ import annotations

import statistics
import time

import jax


def time_jax(fn, *args, reps: int = 7, batch_s: float = 0.2) -> float:
  """Median ms per call of a jitted fn: a warm-up call, then `reps` batches of back-to-back calls.

  A batch lasts about batch_s (at most 50 calls), so the host's dispatch latency before its
  first call, up to ~0.6 ms on the H200 host (a 256K selection call is 9.67 ms of kernels in its
  profile and 10.27 ms of wall time alone), is spread over the batch, as it is inside a training
  step. Until session 6 a batch lasted 0.02-0.04 s, one or two calls from 20-40 ms up, so our
  side carried that latency where fla's, timed by triton's `do_bench` on the GPU's clock, did not.
  """
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  estimate = time.perf_counter() - t0
  calls = max(1, min(50, int(batch_s / max(estimate, 1e-6))))
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / calls)
  return round(statistics.median(samples) * 1e3, 4)
