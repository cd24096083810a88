"""Wall-clock timing, the same method on every side of a comparison.

A sample is a batch of back-to-back calls lasting about `batch_s` (at most 50 calls), ended by one
device synchronisation; the time per call is the batch's time over its calls, and the result the
median of `reps` samples after a warm-up call. Dispatching a call from the host takes up to ~0.6 ms
on an H200 host; spread over a batch it costs what it costs inside a training step, and both
sides pay it alike. jax calls are synchronised with `jax.block_until_ready`, torch calls (fla)
with `torch.cuda.synchronize`. (triton's `do_bench` on the same fla calls agreed within 1.5%.)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def _median_ms(call: Callable, wait: Callable, reps: int, batch_s: float) -> float:
  wait(call())
  t0 = time.perf_counter()
  wait(call())
  estimate = time.perf_counter() - t0
  calls = max(1, min(50, int(batch_s / max(estimate, 1e-6))))
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
      out = call()
    wait(out)
    samples.append((time.perf_counter() - t0) / calls)
  return round(statistics.median(samples) * 1e3, 4)


def time_jax(fn: Callable, *args, reps: int = 7, batch_s: float = 0.2) -> float:
  """Median ms per call of `fn(*args)` (a jitted function)."""
  import jax
  return _median_ms(lambda: fn(*args), jax.block_until_ready, reps, batch_s)


def time_torch(fn: Callable, *, reps: int = 7, batch_s: float = 0.2) -> float:
  """Median ms per call of `fn()` (torch work on the current CUDA device)."""
  import torch
  return _median_ms(fn, lambda _: torch.cuda.synchronize(), reps, batch_s)
