"""Selected-block attention on the GPU: pisa-jax Pallas kernels against fla, cuDNN dense and XLA.

Every side gets the same random valid causal block indices (sorted, unique, current block forced,
-1 padding while fewer than K blocks are eligible), bf16 inputs, B=1.

  python benchmarks/bench_attention.py --mode check   # GPU correctness at moderate T + tile sweep
  python benchmarks/bench_attention.py --mode bench   # the side-by-side table, JSON + PNG
  python benchmarks/bench_attention.py --mode bench --fwd-probes s1,w4 --real-indices --fwd-only
      # also forward launch variants (config probes) beside the default forward, and every
      # forward again on indices with PISA's forced blocks (0, cur-1, cur), fla's forward included

Results go to $OUT (or benchmarks/results/) as attention.json and attention.png (bench mode) or
attention_check.json (check mode). Times are medians in milliseconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
import traceback
import warnings

import numpy as np

warnings.filterwarnings("ignore", message=".*Triton.*deprecated.*")
warnings.filterwarnings("ignore", category=DeprecationWarning)

import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plt  # noqa: E402

from pisa_jax.kernels import attention as attn  # noqa: E402

# The device sets PYTHONSAFEPATH=1, so a script's own folder is not on sys.path by itself.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import time_jax  # noqa: E402

BLOCK = 64
RESULTS = {}
# Off the GPU (a smoke run of this script on a CPU) the kernels run in the Pallas interpreter.
INTERPRET = jax.default_backend() != "gpu"


def log(key, value):
  RESULTS[key] = value
  print(f"{key}: {value}", flush=True)


def random_causal_indices(seed: int, t: int, hkv: int, top_k: int, block_size: int = BLOCK):
  """int32 [1, T, HKV, K]: K distinct blocks <= t // C, current block forced, ascending, -1 pad."""
  rng = np.random.default_rng(seed)
  cur = (np.arange(t) // block_size)[:, None, None]
  m = top_k - 1
  # K-1 distinct past blocks from [0, cur): sorted draws from [0, cur - m] plus 0..m-1.
  span = np.maximum(cur - m + 1, 1)
  draw = np.sort(np.floor(rng.random((t, hkv, m)) * span).astype(np.int64), axis=-1)
  past = draw + np.arange(m)
  # Queries with fewer than K-1 past blocks take all of them, then -1.
  few = cur < m
  all_past = np.broadcast_to(np.arange(m), past.shape)
  past = np.where(few, np.where(all_past < cur, all_past, -1), past)
  idx = np.concatenate([past, np.broadcast_to(cur, (t, hkv, 1))], axis=-1)
  idx = np.where(idx < 0, np.iinfo(np.int32).max, idx)
  idx = np.sort(idx, axis=-1)
  idx = np.where(idx == np.iinfo(np.int32).max, -1, idx)
  return idx[None].astype(np.int32)


def forced_causal_indices(seed: int, t: int, hkv: int, top_k: int, block_size: int = BLOCK):
  """int32 [1, T, HKV, K] with the structure of PISA's selections: for query t (cur = t // C) the
  forced blocks 0, cur-1 and cur plus K-3 random distinct blocks from [1, cur-2], ascending; a
  query with at most K eligible blocks takes all of them, -1 padded. Neighbouring queries share
  the forced blocks, which is what a multi-query forward program can reuse."""
  if top_k < 3:
    raise ValueError(f"{top_k=} must be >= 3: the first, previous and current blocks are forced")
  rng = np.random.default_rng(seed)
  cur = (np.arange(t) // block_size)[:, None, None]
  m = top_k - 3
  # m distinct sorted blocks from [1, cur - 1): sorted draws from [0, cur - 2 - m] plus 0..m-1.
  span = np.maximum(cur - 2 - m + 1, 1)
  draw = np.sort(np.floor(rng.random((t, hkv, m)) * span).astype(np.int64), axis=-1)
  past = 1 + draw + np.arange(m)
  forced = np.broadcast_to(np.concatenate([np.zeros_like(cur), cur - 1, cur], axis=-1),
                           (t, hkv, 3))
  idx = np.sort(np.concatenate([forced, past], axis=-1), axis=-1)
  # Queries with cur + 1 <= K eligible blocks: 0..cur, then -1.
  few = cur + 1 <= top_k
  slots = np.arange(top_k)
  idx = np.where(few, np.where(slots <= cur, slots, -1), idx)
  return idx[None].astype(np.int32)


def matmul_tflops():
  a = jax.random.normal(jax.random.PRNGKey(0), (8192, 8192), jnp.bfloat16)
  b = jax.random.normal(jax.random.PRNGKey(1), (8192, 8192), jnp.bfloat16)
  f = jax.jit(lambda a, b: a @ b)
  ms = time_jax(f, a, b)
  return round(2 * 8192 ** 3 / (ms * 1e-3) / 1e12, 1)


def make_inputs(t, hq, hkv, d, top_k, seed=0, dtype=jnp.bfloat16):
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(keys[0], (1, t, hq, d), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (1, t, hkv, d), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (1, t, hkv, d), jnp.float32).astype(dtype)
  do = jax.random.normal(keys[3], (1, t, hq, d), jnp.float32).astype(dtype)
  idx = random_causal_indices(seed, t, hkv, top_k)
  return q, k, v, do, idx


def ours_fns(d, config=None):
  scale = d ** -0.5

  def fwd(q, k, v, idx):
    return attn.sparse_attention_pallas(q, k, v, idx, block_size=BLOCK, scale=scale,
                                        interpret=INTERPRET, config=config)

  def fwdbwd(q, k, v, idx, do):
    _, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, idx), q, k, v)
    return vjp(do)

  return jax.jit(fwd), jax.jit(fwdbwd)


def attention_flops(t, hq, d, top_k):
  """Forward FLOPs counted as fla does: 4 * T * HQ * (K * C) * D (two dots per selected key)."""
  return 4.0 * t * hq * top_k * BLOCK * d


# ----------------------------------------------------------------------------- check mode


def check_mode(smoke: bool, sweep: bool = True):
  """GPU correctness against the float32 reference on several shapes (bitwise repeat included),
  then (with `sweep`) a forward launch-config sweep at 16K."""
  from pisa_jax.attention import sparse_attention_reference
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
  import tolerances as tol

  cases = [(200, 4, 2, 48, 4, jnp.bfloat16)] if smoke else [(4096, 32, 2, 128, 32, jnp.bfloat16), (4096, 32, 2, 64, 8, jnp.float32),
           (1000, 6, 2, 64, 8, jnp.bfloat16), (777, 8, 8, 48, 5, jnp.float16),
           (2048, 32, 1, 64, 16, jnp.bfloat16), (300, 3, 1, 128, 64, jnp.float32)]
  for t, hq, hkv, d, top_k, dtype in cases:
    name = f"check.T{t}-HQ{hq}-HKV{hkv}-D{d}-K{top_k}-{jnp.dtype(dtype).name}"
    try:
      q, k, v, do, idx = make_inputs(t, hq, hkv, d, top_k, seed=t, dtype=dtype)
      fwd, fwdbwd = ours_fns(d)
      o = fwd(q, k, v, idx)
      g = fwdbwd(q, k, v, idx, do)
      g2 = fwdbwd(q, k, v, idx, do)
      f32 = lambda x: x.astype(jnp.float32)
      ref = lambda q, k, v: sparse_attention_reference(q, k, v, jnp.asarray(idx), block_size=BLOCK,
                                                       scale=d ** -0.5)
      o_r, vjp = jax.vjp(ref, f32(q), f32(k), f32(v))
      g_r = vjp(f32(do))
      errs = {n: float(jnp.max(jnp.abs(f32(a) - b)))
              for n, a, b in zip(("o", "dq", "dk", "dv"), (o,) + tuple(g), (o_r,) + tuple(g_r))}
      rel = {n: float(jnp.linalg.norm(f32(a) - b) / jnp.linalg.norm(b))
             for n, a, b in zip(("o", "dq", "dk", "dv"), (o,) + tuple(g), (o_r,) + tuple(g_r))}
      same = all(bool(jnp.array_equal(a, b)) for a, b in zip(g, g2))
      # The CI suite's criterion, |got - want| <= atol + rtol * |want| elementwise, with its
      # tolerances (tests/tolerances.py: output, then gradients, by input dtype).
      key = jnp.dtype(dtype).type
      bounds = [(tol.OUTPUT_ATOL[key], tol.OUTPUT_RTOL[key])] + [
          (tol.GRAD_ATOL[key], tol.GRAD_RTOL[key])] * 3
      within = {n: bool(jnp.all(jnp.abs(f32(a) - b) <= atol + rtol * jnp.abs(b)))
                for n, a, b, (atol, rtol) in zip(("o", "dq", "dk", "dv"), (o,) + tuple(g),
                                                 (o_r,) + tuple(g_r), bounds)}
      log(name, {"max_abs": errs, "rel_l2": rel, "within_tolerance": within,
                 "bitwise_repeat": same,
                 "finite": all(bool(jnp.all(jnp.isfinite(x))) for x in (o,) + tuple(g))})
    except Exception:  # keep going: one failing case must not hide the others
      log(name + ".error", traceback.format_exc()[-1500:])

  if not sweep:
    return
  log("bf16_matmul_tflops", matmul_tflops())
  for d, top_k in ((64, 8), (128, 32)):
    t, hq, hkv = (256, 32, 2) if smoke else (16384, 32, 2)
    q, k, v, do, idx = make_inputs(t, hq, hkv, d, top_k)
    base = attn.SparseAttentionConfig.default(head_dim=d, group=hq // hkv, top_k=top_k,
                                              block_size=BLOCK)
    log(f"sweep.d{d}.default_config", dataclasses.asdict(base))
    fl = attention_flops(t, hq, d, top_k)
    for w, s in ((4, 1), (4, 2), (4, 3), (8, 2), (2, 2)):
      cfg = dataclasses.replace(base, fwd_num_warps=w, fwd_num_stages=s)
      try:
        fwd, _ = ours_fns(d, cfg)
        ms = time_jax(fwd, q, k, v, idx)
        log(f"sweep.d{d}.fwd.w{w}s{s}.ms", ms)
      except Exception as e:
        log(f"sweep.d{d}.fwd.w{w}s{s}.error", str(e)[-500:])
    for w, s in ((4, 2), (8, 2), (4, 1), (4, 3), (2, 2), (2, 3), (1, 2)):
      cfg = dataclasses.replace(base, dq_num_warps=w, dq_num_stages=s)
      try:
        ms = time_component(cfg, "dq", q, k, v, do, idx, d)
        log(f"sweep.d{d}.dq.w{w}s{s}.ms", ms)
      except Exception as e:
        log(f"sweep.d{d}.dq.w{w}s{s}.error", str(e)[-500:])
    for rows, w, s, items in ((64, 4, 2, None), (32, 4, 2, None), (128, 8, 2, None),
                              (64, 8, 2, None), (64, 4, 1, None), (64, 4, 2, 128)):
      cfg = dataclasses.replace(base, dkv_rows=rows, dkv_num_warps=w, dkv_num_stages=s,
                                items_entries=items or base.items_entries)
      try:
        ms = time_component(cfg, "dkv", q, k, v, do, idx, d)
        log(f"sweep.d{d}.dkv.r{rows}w{w}s{s}i{cfg.items_entries}.ms", ms)
      except Exception as e:
        log(f"sweep.d{d}.dkv.r{rows}w{w}s{s}.error", str(e)[-500:])
    try:
      ms = time_component(base, "index", q, k, v, do, idx, d)
      log(f"sweep.d{d}.inverted_index.ms", ms)
      time_fwdbwd(f"sweep.d{d}.fwdbwd_default", d, base, q, k, v, idx, do, fl)
    except Exception:
      log(f"sweep.d{d}.fwdbwd.error", traceback.format_exc()[-1500:])
    RESULTS.update(fla_times(q, k, v, do, idx, d, top_k, tag=f"sweep.d{d}"))


def time_fwdbwd(key, d, cfg, q, k, v, idx, do, fl):
  """Times our forward + backward under `cfg`; logs `{key}.ms` and `{key}.tflops` (forward +
  backward counted as 3.5 forwards' FLOPs)."""
  _, fwdbwd = ours_fns(d, cfg)
  ms = time_jax(fwdbwd, q, k, v, idx, do)
  log(f"{key}.ms", ms)
  log(f"{key}.tflops", round(3.5 * fl / (ms * 1e-3) / 1e12, 1))


def time_component(cfg, which, q, k, v, do, idx, d):
  """Times one backward stage alone on the residuals of a forward pass."""
  b, t, hq, _ = q.shape
  hkv = k.shape[2]
  g = hq // hkv
  q5 = q.reshape(b, t, hkv, g, d)
  do5 = do.reshape(b, t, hkv, g, d)
  idx = jnp.asarray(idx)
  kw = dict(block_size=BLOCK, scale=d ** -0.5, interpret=INTERPRET, config=cfg)
  o5, lse = jax.jit(lambda *a: attn._forward(*a, **kw))(q5, k, v, idx)
  if which == "dq":
    f = jax.jit(lambda *a: attn._backward_dq(*a, **kw))
    return time_jax(f, q5, k, v, idx, o5, do5, lse)
  _, delta = jax.jit(lambda *a: attn._backward_dq(*a, **kw))(q5, k, v, idx, o5, do5, lse)
  if which == "dkv":
    f = jax.jit(lambda *a: attn._backward_dkv(*a, **kw))
    return time_jax(f, q5, k, v, idx, do5, lse, delta)
  f = jax.jit(lambda i: attn.inverted_index(i, num_blocks=t // BLOCK, block_size=BLOCK,
                                            items_entries=cfg.items_entries))
  return time_jax(f, idx)


# ----------------------------------------------------------------------------- peers


def fla_times(q, k, v, do, idx, d, top_k, tag, ours_fwd=None, fwdbwd=True):
  """fla ParallelNSAFunction fwd and (with `fwdbwd`) fwd+bwd on the same inputs and indices
  (torch, do_bench)."""
  out = {}
  try:
    import torch
    import triton
    from fla.ops.nsa.parallel import ParallelNSAFunction

    dev = "cuda"
    tq = lambda x: torch.from_numpy(np.asarray(x.astype(jnp.float32))).to(dev).to(torch.bfloat16)
    q_t, k_t, v_t, do_t = (tq(x).requires_grad_(x is not do) for x in (q, k, v, do))
    bi = torch.from_numpy(np.asarray(idx)).to(dev)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    f = lambda: ParallelNSAFunction.apply(q_t, k_t, v_t, bi, top_k, BLOCK, d ** -0.5, None)
    out[f"{tag}.fla.fwd.ms"] = round(bench(f), 4)

    def fb():
      o = ParallelNSAFunction.apply(q_t, k_t, v_t, bi, top_k, BLOCK, d ** -0.5, None)
      o.backward(do_t)

    if fwdbwd:
      out[f"{tag}.fla.fwdbwd.ms"] = round(bench(fb), 4)
    # Same function? Compare fla's output with ours on these inputs.
    if ours_fwd is not None:
      with torch.no_grad():
        o_fla = f().float().cpu().numpy()
      o_ours = np.asarray(ours_fwd(q, k, v, jnp.asarray(idx)).astype(jnp.float32))
      out[f"{tag}.fla_vs_ours.max_abs"] = float(np.max(np.abs(o_fla - o_ours)))
    del q_t, k_t, v_t, do_t, bi
    torch.cuda.empty_cache()
  except Exception as e:
    out[f"{tag}.fla.error"] = str(e)[-400:]
  for key, value in out.items():
    print(f"{key}: {value}", flush=True)
  return out


def dense_cudnn_fns():
  def fwd(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

  def fwdbwd(q, k, v, do):
    _, vjp = jax.vjp(fwd, q, k, v)
    return vjp(do)

  return jax.jit(fwd), jax.jit(fwdbwd)


def xla_fns(d):
  from pisa_jax.attention import sparse_attention_reference

  def fwd(q, k, v, idx):
    return sparse_attention_reference(q, k, v, idx, block_size=BLOCK, scale=d ** -0.5)

  def fwdbwd(q, k, v, idx, do):
    _, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, idx), q, k, v)
    return vjp(do)

  return jax.jit(fwd), jax.jit(fwdbwd)


def layer_fwdbwd_fn(top_k: int):
  """The whole PISA layer, forward + backward: Pallas selection (under stop_gradient) + attention."""
  import pisa_jax

  def loss(q, k, v, do):
    out = pisa_jax.pisa_attention(q, k, v, block_size=BLOCK, top_k=top_k, implementation="pallas")
    return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


# ----------------------------------------------------------------------------- bench mode

# Session 5 also timed multi-query programs and several blocks per online-softmax step here
# (WORKSPACE.md, "Attention on the H200"): neither helped, so the kernel lost those options.
_PROBE_FIELDS = {"s": "fwd_num_stages", "w": "fwd_num_warps", "k": "fwd_step_keys"}


def parse_probe(name: str) -> dict:
  """`s1w4` -> {fwd_num_stages: 1, fwd_num_warps: 4}: s = fwd_num_stages, w = fwd_num_warps,
  k = fwd_step_keys, changed on the setting's default config."""
  parts = re.findall(r"([a-z])(\d+)", name)
  if not parts or "".join(f"{c}{n}" for c, n in parts) != name:
    raise ValueError(f"fwd probe {name!r} must be letter-number pairs, e.g. s1, w4, s3w4")
  unknown = [c for c, _ in parts if c not in _PROBE_FIELDS]
  if unknown:
    raise ValueError(f"fwd probe {name!r}: letters must be among {sorted(_PROBE_FIELDS)}")
  letters = [c for c, _ in parts]
  if len(set(letters)) != len(letters):
    raise ValueError(f"fwd probe {name!r} names a letter twice")
  for c, n in parts:
    # Triton launches 1-8 warps (a power of two) and pipelines over 1 or more stages.
    if (c == "w" and int(n) not in (1, 2, 4, 8)) or (c == "s" and int(n) < 1):
      raise ValueError(f"fwd probe {name!r}: {c}{n} must be w1, w2, w4, w8 or s1 and up")
    if c == "k" and int(n) not in (16, 32):
      raise ValueError(f"fwd probe {name!r}: {c}{n} must be k16 or k32 (keys per step, C = 64)")
  return {_PROBE_FIELDS[c]: int(n) for c, n in parts}


def _fastest(key: str, calls) -> float | None:
  """Times each (label, pallas call, args) of `calls`, logs `{key}.{label}.ms` (or `.error`: a
  launch that fails to compile is a finding, not a crash), and returns the fastest ms or None."""
  best = None
  for label, call, args in calls:
    try:
      ms = time_jax(jax.jit(call), *args)
    except Exception:
      log(f"{key}.{label}.error", traceback.format_exc()[-400:])
      continue
    log(f"{key}.{label}.ms", ms)
    best = ms if best is None else min(best, ms)
  return best


def _load_floor_kernel(k_ref, v_ref, idx_ref, o_ref, *, top_k: int):
  """The forward's memory stream alone: query t's selected key and value blocks, loaded in the
  same loop and summed (so no load is dead), no attention math. Triton issues these as plain
  16-byte LDGs (its pipeliner makes async copies only of loads that feed a dot; SASS, session 7),
  where the forward's are async copies: a reference rate, not a strict lower bound."""
  t = pl.program_id(0)

  def body(i, acc):
    start, _ = attn._block_slot(idx_ref, t, i, BLOCK)
    b_k = k_ref[pl.ds(start, BLOCK), :].astype(jnp.float32)
    return acc + b_k + v_ref[pl.ds(start, BLOCK), :].astype(jnp.float32)

  acc = lax.fori_loop(0, top_k, body, jnp.zeros((BLOCK, k_ref.shape[-1]), jnp.float32))
  o_ref[t] = jnp.sum(acc, axis=0)


def load_floor(prefix, k, v, idx):
  """Times `_load_floor_kernel` under several launch configs and logs each and the fastest: the
  bytes every one-read forward (ours, fla's) moves, at the rate of plain loads. A reference for
  the forwards' read rates, not a bound (our forward, whose loads are async copies, beats it at
  16K); the TMA load-only kernel (`mosaic_load_probe.py`) is the tighter reference."""
  _, tk, hkv, d = k.shape
  t, top_k = idx.shape[1], idx.shape[-1]
  # The forward's grid and specs; the output is one [D] row per (query, KV head).
  _, kv_spec, idx_spec, _ = attn._query_grid_specs(t, tk, 1, d, top_k)
  o_spec = pl.BlockSpec((None, t, None, d), lambda i, h, bb: (bb, 0, h, 0))
  calls = ((f"w{warps}s{stages}", pl.pallas_call(
      functools.partial(_load_floor_kernel, top_k=top_k), grid=(t, hkv, 1),
      in_specs=[kv_spec, kv_spec, idx_spec], out_specs=o_spec,
      out_shape=jax.ShapeDtypeStruct((1, t, hkv, d), jnp.float32),
      compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
      interpret=INTERPRET, name="load_floor"), (k, v, idx))
      for warps, stages in ((1, 2), (2, 2), (4, 2), (4, 3), (8, 2)))
  best = _fastest(f"{prefix}.load_floor", calls)
  if best is not None:
    log(f"{prefix}.load_floor.ms", best)
    gb = 2 * t * hkv * top_k * BLOCK * d * k.dtype.itemsize / 1e9
    log(f"{prefix}.load_floor.selected_kv_GB", round(gb, 2))
    log(f"{prefix}.load_floor.TB_per_s", round(gb / best, 2))


def _l2_peak_kernel(x_ref, o_ref, *, steps: int, num_tiles: int, rows: int):
  """Contiguous `[rows, D]` tiles of an L2-resident buffer through a loop like
  `_load_floor_kernel`'s: program p reads tiles (p * 7 + 13 i) mod num_tiles, i < steps, and
  sums them. No gather and no misses: what a program's loop of tile loads can draw from L2."""
  p = pl.program_id(0)

  def body(i, acc):
    start = ((p * 7 + i * 13) % num_tiles) * rows
    return acc + x_ref[pl.ds(start, rows), :].astype(jnp.float32)

  acc = lax.fori_loop(0, steps, body, jnp.zeros((rows, x_ref.shape[-1]), jnp.float32))
  o_ref[p] = jnp.sum(acc, axis=0)


def l2_peak(d: int, *, buffer_mb: int = 8, programs: int = 8192, steps: int = 128):
  """Times `_l2_peak_kernel` (bf16 tiles of `[64, d]` or `[128, d]` from an 8 MB buffer, inside
  the H200's L2) under several launches; logs each, the fastest and its TB/s: a reference read
  rate for the forward and the load floor. (Triton issues these loads as plain 16-byte LDGs, not
  async copies: the loop carries nothing else, so bytes in flight come from the warps.)"""
  def launch(warps, stages, rows):
    num_tiles = buffer_mb * 2**20 // (rows * d * 2)
    x = jax.random.normal(jax.random.PRNGKey(5), (num_tiles * rows, d), jnp.bfloat16)
    call = pl.pallas_call(
        functools.partial(_l2_peak_kernel, steps=steps * BLOCK // rows, num_tiles=num_tiles,
                          rows=rows), grid=(programs,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        out_shape=jax.ShapeDtypeStruct((programs, d), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=INTERPRET, name="l2_peak")
    return f"w{warps}s{stages}r{rows}", call, (x,)

  best = _fastest(f"l2_peak.d{d}", (launch(*c) for c in ((2, 2, 64), (4, 2, 64), (4, 2, 128),
                                                          (8, 2, 128), (8, 3, 128))))
  if best is not None:
    gb = programs * steps * BLOCK * d * 2 / 1e9
    log(f"l2_peak.d{d}.ms", best)
    log(f"l2_peak.d{d}.TB_per_s", round(gb / best, 2))


def time_forwards(prefix, q, k, v, idx, d, base, probes, fl):
  """Times our default forward, then each probe config's forward right after it; logs
  `{prefix}.ours.fwd.ms` and `{prefix}.ours_probe.{name}.fwd.ms`, and each probe's largest
  output difference from the default (a probe reorders float sums: bf16 rounding, not more)."""
  fwd = None
  try:
    fwd, _ = ours_fns(d, base)
    ms = time_jax(fwd, q, k, v, idx)
    log(f"{prefix}.ours.fwd.ms", ms)
    log(f"{prefix}.ours.fwd.tflops", round(fl / (ms * 1e-3) / 1e12, 1))
  except Exception:
    log(f"{prefix}.ours.error", traceback.format_exc()[-800:])
    return None
  o_default = fwd(q, k, v, idx).astype(jnp.float32) if probes else None
  for name, changes in probes.items():
    key = f"{prefix}.ours_probe.{name}"
    try:
      probe_fwd, _ = ours_fns(d, dataclasses.replace(base, **changes))
      log(f"{key}.fwd.ms", time_jax(probe_fwd, q, k, v, idx))
      diff = jnp.max(jnp.abs(probe_fwd(q, k, v, idx).astype(jnp.float32) - o_default))
      log(f"{key}.max_abs_vs_default", float(diff))
    except Exception:
      log(f"{key}.error", traceback.format_exc()[-800:])
  return fwd


def bench_mode(sizes, budget_s, out_path, smoke=False, only=frozenset(), probes=None,
               real_indices=False, fwd_only=False, floor=False):
  start = time.perf_counter()
  log("date", time.strftime("%Y-%m-%d %H:%M:%S"))
  log("device", str(jax.devices()[0]))
  log("bf16_matmul_tflops", matmul_tflops())
  if floor:
    for d in (64, 128):
      l2_peak(d, programs=64 if smoke else 8192, steps=4 if smoke else 128)
  # In priority order; settings past the time budget are skipped (and say so in the JSON).
  settings = [(16384, 32, 2, 64, 8), (16384, 32, 2, 128, 32), (65536, 32, 2, 64, 8),
              (65536, 32, 2, 128, 32), (16384, 32, 8, 64, 8), (16384, 32, 4, 64, 8),
              (16384, 32, 8, 128, 32), (16384, 32, 4, 128, 32)]
  settings += [(n, 32, 2, 64, 8) for n in sizes if n > 65536]
  settings += [(n, 32, 2, 128, 32) for n in sizes if n > 65536]
  if smoke:
    settings = [(256, 32, 2, 64, 8), (256, 32, 8, 64, 4)]
  if only:
    settings = [s for s in settings if "N{}.HQ{}.HKV{}.d{}.K{}".format(*s) in only]
  for t, hq, hkv, d, top_k in settings:
    with open(out_path, "w") as f:
      json.dump(RESULTS, f, indent=1)
    if time.perf_counter() - start > budget_s:
      log(f"skipped.N{t}.HQ{hq}.HKV{hkv}.d{d}.K{top_k}", "time budget of this run spent")
      continue
    tag = f"N{t}.HQ{hq}.HKV{hkv}.d{d}.K{top_k}"
    q, k, v, do, idx_np = make_inputs(t, hq, hkv, d, top_k)
    idx = jnp.asarray(idx_np)
    fl = attention_flops(t, hq, d, top_k)
    base = attn.SparseAttentionConfig.default(head_dim=d, group=hq // hkv, top_k=top_k,
                                              block_size=BLOCK)
    fwd = time_forwards(tag, q, k, v, idx, d, base, probes or {}, fl)
    if floor:
      load_floor(tag, k, v, idx)
    if not fwd_only:
      try:
        time_fwdbwd(f"{tag}.ours.fwdbwd", d, base, q, k, v, idx, do, fl)
      except Exception:
        log(f"{tag}.ours.fwdbwd.error", traceback.format_exc()[-800:])
    RESULTS.update(fla_times(q, k, v, do, idx_np, d, top_k, tag, ours_fwd=fwd,
                             fwdbwd=not fwd_only))
    if real_indices:
      # The same forwards on indices with PISA's forced blocks (the case multi-query programs
      # target); fla's forward on them too.
      real_np = forced_causal_indices(1, t, hkv, top_k)
      real_fwd = time_forwards(f"{tag}.real_idx", q, k, v, jnp.asarray(real_np), d, base,
                               probes or {}, fl)
      RESULTS.update(fla_times(q, k, v, do, real_np, d, top_k, f"{tag}.real_idx",
                               ours_fwd=real_fwd, fwdbwd=False))
    if hkv == 2 and not fwd_only:
      try:
        fwd, fwdbwd = dense_cudnn_fns()
        log(f"{tag}.cudnn_dense.fwd.ms", time_jax(fwd, q, k, v))
        log(f"{tag}.cudnn_dense.fwdbwd.ms", time_jax(fwdbwd, q, k, v, do))
      except Exception as e:
        log(f"{tag}.cudnn_dense.error", str(e)[-400:])
      try:
        ms = time_jax(layer_fwdbwd_fn(top_k), q, k, v, do)
        log(f"{tag}.pisa_layer.fwdbwd.ms", ms)
        dense = RESULTS.get(f"{tag}.cudnn_dense.fwdbwd.ms")
        if dense:
          log(f"{tag}.pisa_layer.speedup_vs_cudnn.fwdbwd", round(dense / ms, 3))
      except Exception:
        log(f"{tag}.pisa_layer.error", traceback.format_exc()[-800:])
    if t <= 16384 and hkv == 2 and not fwd_only:
      try:
        fwd, fwdbwd = xla_fns(d)
        log(f"{tag}.xla_reference.fwd.ms", time_jax(fwd, q, k, v, idx, reps=3))
        log(f"{tag}.xla_reference.fwdbwd.ms", time_jax(fwdbwd, q, k, v, idx, do, reps=3))
      except Exception as e:
        log(f"{tag}.xla_reference.error", str(e)[-400:])
    del q, k, v, do, idx


def summary(probes=()):
  """Prints one line per setting (and per setting on real indices): ours against fla (ratio > 1:
  ours faster), cuDNN dense, then each forward probe: ms (default / probe, fla / probe)."""
  tags = sorted({k.rsplit(".ours.", 1)[0] for k in RESULTS if ".ours.fwd.ms" in k})
  print("setting | ours fwd | fla fwd | x | ours f+b | fla f+b | x | cudnn fwd | cudnn f+b"
        + "".join(f" | {name} fwd (vs ours, vs fla)" for name in probes))
  for tag in tags:
    get = lambda key: RESULTS.get(f"{tag}.{key}.ms", float("nan"))
    of, ff, ob, fb = get("ours.fwd"), get("fla.fwd"), get("ours.fwdbwd"), get("fla.fwdbwd")
    RESULTS[f"{tag}.speedup_vs_fla.fwd"] = round(ff / of, 3)
    if f"{tag}.ours.fwdbwd.ms" in RESULTS:
      RESULTS[f"{tag}.speedup_vs_fla.fwdbwd"] = round(fb / ob, 3)
    line = (f"{tag} | {of} | {ff} | {ff / of:.2f} | {ob} | {fb} | {fb / ob:.2f} | "
            f"{get('cudnn_dense.fwd')} | {get('cudnn_dense.fwdbwd')}")
    if f"{tag}.load_floor.ms" in RESULTS:  # --load-floor: each forward against the reference
      floor = get("load_floor")
      RESULTS[f"{tag}.load_floor.fla_over_floor"] = round(ff / floor, 3)
      line += f" | load floor {floor} (fla / floor {ff / floor:.2f}, ours / floor {of / floor:.2f})"
    for name in probes:
      pf = get(f"ours_probe.{name}.fwd")
      RESULTS[f"{tag}.ours_probe.{name}.speedup_vs_fla.fwd"] = round(ff / pf, 3)
      line += f" | {pf} ({of / pf:.2f}x, {ff / pf:.2f}x)"
    print(line, flush=True)


def plot(path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
  tags = sorted({k.rsplit(".ours.", 1)[0] for k in RESULTS
                 if ".ours.fwd.ms" in k and ".real_idx." not in k})
  # The load floor (--load-floor) has no backward: a forward-only bar.
  sides = ("ours", "fla", "cudnn_dense", "xla_reference", "pisa_layer", "load_floor")
  for ax, phase in zip(axes, ("fwd", "fwdbwd")):
    width = 0.14
    for j, side in enumerate(sides):
      if side == "load_floor":
        keys = [f"{tag}.load_floor.ms" if phase == "fwd" else None for tag in tags]
      else:
        keys = [f"{tag}.{side}.{phase}.ms" for tag in tags]
      vals = [RESULTS.get(key, np.nan) for key in keys]
      ax.bar(np.arange(len(tags)) + (j - 2.5) * width, vals, width, label=side)
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(tags)))
    ax.set_xticklabels([tg.replace(".", "\n", 2) for tg in tags], fontsize=6, rotation=0)
    ax.set_ylabel("ms (median, log)")
    ax.set_title(f"selected-block attention {phase}, bf16, H200")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--mode", choices=("check", "bench"), default="bench")
  parser.add_argument("--sizes", default="16384,65536,131072")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, for a CPU dry run")
  parser.add_argument("--only", default="",
                      help="comma-separated setting tags (e.g. N131072.HQ32.HKV2.d64.K8): run only these")
  parser.add_argument("--budget-s", type=float, default=1e9,
                      help="start no new setting after this many seconds")
  parser.add_argument("--fwd-probes", default="",
                      help="comma-separated forward configs timed after the default forward, as "
                           "changes of the default: s<n> fwd_num_stages, w<n> fwd_num_warps, "
                           "k<n> fwd_step_keys (e.g. s1,w4,s3w4,k32s3)")
  parser.add_argument("--fwd-only", action="store_true",
                      help="forwards only (ours, probes, fla): no fwd+bwd, cuDNN, layer or XLA")
  parser.add_argument("--replot", metavar="JSON",
                      help="no GPU: redraw attention.png from a saved attention.json (next to it, "
                           "or in $OUT) and stop")
  parser.add_argument("--skip-sweep", action="store_true",
                      help="check mode: the correctness cases only, no launch-config sweep")
  parser.add_argument("--load-floor", action="store_true",
                      help="also time the forward's K/V block loads alone (no math, plain "
                           "loads) under several launches, a reference rate for a kernel that "
                           "reads each query's selected blocks once; and, once per run, "
                           "contiguous tiles of an L2-resident buffer through the same loop "
                           "(l2_peak)")
  parser.add_argument("--real-indices", action="store_true",
                      help="also time the forwards (default, probes, fla) on indices with PISA's "
                           "forced blocks 0, cur-1, cur")
  args = parser.parse_args()
  if args.replot:
    RESULTS.update(json.load(open(args.replot)))
    out_dir = os.environ.get("OUT") or os.path.dirname(os.path.abspath(args.replot))
    plot(os.path.join(out_dir, "attention.png"))
    return 0
  # A bad probe fails here, before any device time.
  probes = {name: parse_probe(name) for name in args.fwd_probes.split(",") if name}
  out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
  os.makedirs(out_dir, exist_ok=True)
  print("jax", jax.__version__, jax.devices(), flush=True)
  try:
    if args.mode == "check":
      check_mode(args.smoke, sweep=not args.skip_sweep)
    else:
      bench_mode([int(s) for s in args.sizes.split(",")], args.budget_s,
                 os.path.join(out_dir, "attention.json"), smoke=args.smoke,
                 only={x for x in args.only.split(",") if x}, probes=probes,
                 real_indices=args.real_indices, fwd_only=args.fwd_only, floor=args.load_floor)
      summary(tuple(probes))
  finally:
    name = "attention_check.json" if args.mode == "check" else "attention.json"
    with open(os.path.join(out_dir, name), "w") as f:
      json.dump(RESULTS, f, indent=1)
    if args.mode == "bench":
      plot(os.path.join(out_dir, "attention.png"))
  print("DONE", flush=True)


if __name__ == "__main__":
  sys.exit(main())
