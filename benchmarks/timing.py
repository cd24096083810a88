"""Wall-clock timing, the same method on every side of a comparison.

A sample is a batch of back-to-back calls lasting about `batch_s` (at most 50 calls), ended by one
device synchronisation; the time per call is the batch's time over its calls, and the result the
median of `reps` samples after a warm-up call. Dispatching a call from the host takes up to ~0.6 ms
on an H200 host; spread over a batch it costs what it costs inside a training step, and both
sides pay it alike. jax calls are synchronised with `jax.block_until_ready`, torch calls (fla)
with `torch.cuda.synchronize`. (triton's `do_bench` on the same fla calls agreed within 1.5%.)
"""

from __future__ import annotations

import re
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


def per_call(events, calls: int) -> tuple[float, float]:
  """(kernels, device ms) per call from the (name, duration ns) events of `calls` calls."""
  return len(events) / calls, sum(ns for _, ns in events) / 1e6 / calls


def kernel_totals(events, calls: int, top: int = 12) -> dict[str, float]:
  """ms per call of each kernel name from (name, duration ns) events of `calls` calls: XLA's
  numbered fusions and copies folded by name (`loop_fusion_12` -> `loop_fusion`), the `top`
  largest kept and the rest summed under "other", largest first."""
  total: dict[str, float] = {}
  for name, ns in events:
    key = re.sub(r"([._]\d+)+$", "", name)
    total[key] = total.get(key, 0.0) + ns / 1e6 / calls
  ranked = sorted(total.items(), key=lambda kv: -kv[1])
  out = {k: round(v, 4) for k, v in ranked[:top]}
  if len(ranked) > top:
    out["other"] = round(sum(v for _, v in ranked[top:]), 4)
  return out


def gpu_kernel_events(run: Callable) -> list[tuple[str, int]]:
  """(name, duration ns) of every GPU kernel that `run()` launches, from a jax.profiler trace
  (`run` ends by waiting for its results). Only GPU stream lines count, so on a CPU backend the
  list is empty."""
  import glob
  import os
  import tempfile

  import jax
  from jax._src.profiler import ProfileData
  events = []
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      run()
    for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
      for plane in ProfileData.from_file(path).planes:
        if "/device:GPU" not in plane.name:
          continue
        for line in plane.lines:
          # The stream lines hold the kernels; XLA's op and module lines would count them twice.
          if "Stream" in line.name:
            events += [(ev.name, ev.duration_ns) for ev in line.events]
  return events


def device_kernel_ms(fn: Callable, *args, calls: int = 5) -> dict[str, float]:
  """ms per call of each GPU kernel that `fn(*args)` (jitted, already compiled) launches, from a
  jax.profiler trace of `calls` back-to-back calls (`kernel_totals`); empty on a CPU backend."""
  import jax
  jax.block_until_ready(fn(*args))

  def run():
    out = None
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)

  return kernel_totals(gpu_kernel_events(run), calls)
