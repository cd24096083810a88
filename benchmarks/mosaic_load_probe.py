"""Issue 4 probe: the forward's K/V block reads by TMA (Mosaic GPU), no math.

Each program (query t, KV head h) copies its K selected `[64, d]` key and value blocks from
`[T, HKV, d]` into shared memory with TMA (dynamic row start, one barrier per slot, `stages`
slots in flight) and waits for them; nothing else. Our Triton forward is timed beside it on the
same inputs (bench_attention's): the pair says whether TMA reads these gathered blocks faster
than the async copies the Triton kernels issue (about 9-11 TB/s on the H200), and whether any
one-read forward could reach a given time. Writes mosaic_load_probe.json to $OUT.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import BLOCK, make_inputs, ours_fns  # noqa: E402
from timing import time_jax  # noqa: E402
from pisa_jax.kernels import attention as attn  # noqa: E402

RESULTS = {}


def log(key, value):
  RESULTS[key] = value
  print(f"{key}: {value}", flush=True)


def tma_loads(k, v, idx, *, stages: int):
  """k, v `[T, HKV, d]`, idx int32 `[T, HKV, K]` -> `[T, HKV]` float32 (the first index)."""
  t_len, hkv, d = k.shape
  top_k = idx.shape[-1]

  def body(k_ref, v_ref, idx_ref, o_ref, idx_smem, k_smem, v_smem, idx_bar, k_bar, v_bar):
    # One grid axis of T * HKV programs: CUDA's y and z grid sizes stop at 65,535.
    i_p = lax.axis_index("p")
    t, h = lax.div(i_p, hkv), lax.rem(i_p, hkv)
    plgpu.copy_gmem_to_smem(idx_ref.at[t, h], idx_smem, idx_bar.at[0])
    plgpu.barrier_wait(idx_bar.at[0])

    def fetch(i, slot):
      start = jnp.maximum(idx_smem[i], 0) * BLOCK
      plgpu.copy_gmem_to_smem(k_ref.at[pl.ds(start, BLOCK), h], k_smem.at[slot], k_bar.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[pl.ds(start, BLOCK), h], v_smem.at[slot], v_bar.at[slot])

    for s in range(min(stages, top_k)):
      fetch(s, s)

    @pl.loop(0, top_k)
    def _(i):
      slot = lax.rem(i, stages)
      plgpu.barrier_wait(k_bar.at[slot])
      plgpu.barrier_wait(v_bar.at[slot])

      @pl.when(i + stages < top_k)
      def _():
        fetch(i + stages, slot)

    o_ref[t, h] = idx_smem[0].astype(jnp.float32)

  def entry(k_ref, v_ref, idx_ref, o_ref):
    pl.run_scoped(
        lambda *scratch: body(k_ref, v_ref, idx_ref, o_ref, *scratch),
        plgpu.SMEM((top_k,), jnp.int32),
        plgpu.SMEM((stages, BLOCK, d), k.dtype),
        plgpu.SMEM((stages, BLOCK, d), v.dtype),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages))

  return plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct((t_len, hkv), jnp.float32),
                      grid=(t_len * hkv,), grid_names=("p",))(k, v, idx)


def main():
  out_dir = os.environ.get("OUT", "/tmp")
  log("date", time.strftime("%Y-%m-%d %H:%M:%S"))
  log("device", str(jax.devices()[0]))
  only = set(sys.argv[1:])  # tags to run (all by default)
  for t_len, d, top_k in ((16384, 64, 8), (16384, 128, 32), (65536, 128, 32), (131072, 64, 8)):
    tag = f"N{t_len}.HKV2.d{d}.K{top_k}"
    if only and tag not in only:
      continue
    q, k, v, _, idx_np = make_inputs(t_len, 32, 2, d, top_k)
    idx = jnp.asarray(idx_np)
    gb = 2 * t_len * k.shape[2] * top_k * BLOCK * d * k.dtype.itemsize / 1e9
    log(f"{tag}.selected_kv_GB", round(gb, 2))
    try:
      base = attn.SparseAttentionConfig.default(head_dim=d, group=16, top_k=top_k,
                                                block_size=BLOCK)
      ms = time_jax(ours_fns(d, base)[0], q, k, v, idx)
      log(f"{tag}.triton_fwd.ms", ms)
      log(f"{tag}.triton_fwd.TB_per_s", round(gb / ms, 2))
    except Exception:
      log(f"{tag}.triton_fwd.error", traceback.format_exc()[-800:])
    k, v, idx = k[0], v[0], idx[0]
    best = None
    for stages in (2, 3, 4):
      try:
        fn = jax.jit(functools.partial(tma_loads, stages=stages))
        ms = time_jax(fn, k, v, idx)
      except Exception:
        log(f"{tag}.s{stages}.error", traceback.format_exc()[-1500:])
        continue
      log(f"{tag}.s{stages}.ms", ms)
      best = ms if best is None else min(best, ms)
    if best is not None:
      log(f"{tag}.ms", best)
      log(f"{tag}.TB_per_s", round(gb / best, 2))
    with open(os.path.join(out_dir, "mosaic_load_probe.json"), "w") as f:
      json.dump(RESULTS, f, indent=1)
  print("DONE", flush=True)


if __name__ == "__main__":
  main()
