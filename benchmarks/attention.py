"""How fast is attention over selected blocks? Ours against fla's NSA attention and cuDNN dense.

Every side gets the same bf16 inputs (B=1) and, for the sparse sides, the same block indices:
  --indices random  K distinct valid causal blocks per (query, KV head), the current block forced,
                    ascending, -1 while fewer are eligible (the peers' usual benchmark)
  --indices pisa    PISA's own selection of these q/k (`pisa_jax.select_blocks`): the first,
                    previous and current blocks are shared by the queries of a block
  --indices real    PISA's selection (K of the case) on a trained model's post-RoPE q/k, read
                    from --qk-npz (written by `benchmarks.dump_qk`; its first N tokens); its KV
                    heads are repeated over the case's HKV. Neighbouring queries select nearly
                    the same blocks here, unlike random indices.
Sides, each forward and forward + backward (dq, dk, dv):
  pisa-jax      `pisa_jax.sparse_attention(implementation="pallas")`
  fla           `fla.ops.nsa`'s ParallelNSAFunction (Triton; its backward needs a GQA group of at
                least 16; skipped, with a note, when fla is not importable)
  cudnn dense   causal `jax.nn.dot_product_attention(implementation="cudnn")` over all keys
Rows: median ms (benchmarks/timing.py, the same method for every side), TFLOP/s (sparse: 4 T HQ K C
D FLOPs forward as fla counts them, dense: the causal half of 4 T^2 HQ D; forward + backward: 3.5x
the forward), and x_ours, the time over ours in the same case and phase. fla's forward output is
compared with ours (max_abs_vs_ours). The plot is bars per case, log time.

Each kind of indices writes its own result: attention.json, attention_pisa.json and
attention_real.json.

  python -m benchmarks.attention                     # the default cases, benchmarks/results/
  python -m benchmarks.attention --case 65536:32:2:128:32 --indices pisa --out /tmp/att
  python -m benchmarks.attention --indices real --qk-npz /tmp/qk64k.npz --case 65536:32:2:128:32
  python -m benchmarks.attention --replot benchmarks/results/attention.json
  python -m benchmarks.attention --case 256:4:2:64:4 --implementation xla --out /tmp/a  # any CPU

Correctness is not checked here: tests/test_gpu_attention.py does that.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import pisa_jax
from pisa_jax.testing import random_block_indices
from benchmarks import _fla, _record
from benchmarks.timing import time_jax, time_torch

NAME = "attention"
C = 64
# (N, HQ, HKV, D, K): the anchors' settings, then GQA groups 8 and 4, then 128K.
CASES = ((16384, 32, 2, 64, 8), (16384, 32, 2, 128, 32), (65536, 32, 2, 64, 8),
         (65536, 32, 2, 128, 32), (16384, 32, 4, 64, 8), (16384, 32, 8, 64, 8),
         (16384, 32, 4, 128, 32), (16384, 32, 8, 128, 32), (131072, 32, 2, 64, 8),
         (131072, 32, 2, 128, 32))


def inputs(n, hq, hkv, d, seed=0, dtype=jnp.bfloat16):
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(keys[0], (1, n, hq, d), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (1, n, hkv, d), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (1, n, hkv, d), jnp.float32).astype(dtype)
  do = jax.random.normal(keys[3], (1, n, hq, d), jnp.float32).astype(dtype)
  return q, k, v, do


def with_grads(fn):
  """fn(q, k, v, *rest) -> (dq, dk, dv) of <fn(...), do>, jitted; `do` comes last."""
  def fwdbwd(q, k, v, *rest):
    *rest, do = rest
    _, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, *rest), q, k, v)
    return vjp(do)
  return jax.jit(fwdbwd)


def sparse_fn(implementation: str, d: int):
  return functools.partial(pisa_jax.sparse_attention, block_size=C, scale=d ** -0.5,
                           implementation=implementation)


# --case N:HQ:HKV:D:K (the layer benchmark's too).
parse_case = functools.partial(_record.parse_head_case, with_top_k=True)


def dense_fn(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def sparse_flops(n, hq, d, k) -> float:
  return 4.0 * n * hq * k * C * d


def dense_flops(n, hq, d) -> float:
  return 4.0 * n * n * hq * d / 2


def tflops(flops: float, ms: float) -> float:
  return round(flops / (ms * 1e-3) / 1e12, 1)


def time_ours(q, k, v, do, idx, d, implementation):
  fwd = jax.jit(sparse_fn(implementation, d))
  return ({"fwd": time_jax(fwd, q, k, v, idx),
           "fwd+bwd": time_jax(with_grads(sparse_fn(implementation, d)), q, k, v, idx, do)},
          fwd(q, k, v, idx))


def real_indices(qk, n, hkv, top_k, implementation):
  """PISA's selection (K = top_k) on the first n tokens of a trained model's q/k, its KV heads
  repeated over hkv: int32 `[1, n, hkv, K]`."""
  if qk is None:
    raise SystemExit("--indices real needs --qk-npz (write one with benchmarks.dump_qk)")
  if qk["q"].shape[1] < n:
    raise SystemExit(f"--qk-npz holds {qk['q'].shape[1]} tokens, fewer than the case's N={n}")
  q, k = (jnp.asarray(qk[name][:, :n]).astype(jnp.bfloat16) for name in ("q", "k"))
  idx = pisa_jax.select_blocks(q, k, block_size=C, top_k=top_k, implementation=implementation)
  return idx[:, :, jnp.arange(hkv) % idx.shape[2]]


def time_fla(q, k, v, do, idx, d, ours_out):
  """fla's forward and forward + backward; the forward's largest difference from ours."""
  import torch
  qt, kt, vt = (_fla.to_torch(x).requires_grad_() for x in (q, k, v))
  dot, it = _fla.to_torch(do), _fla.to_torch(idx)
  fwd = functools.partial(_fla.sparse_attention, qt, kt, vt, it, block_size=C, scale=d ** -0.5)
  out = {}
  with torch.no_grad():
    o = fwd().float().cpu().numpy()
  out["max_abs_vs_ours"] = float(np.max(np.abs(o - np.asarray(ours_out.astype(jnp.float32)))))
  out["fwd"] = time_torch(fwd)
  try:
    out["fwd+bwd"] = time_torch(lambda: fwd().backward(dot))
  except Exception as e:  # fla's backward compiles only for GQA groups >= 16
    out["fwd+bwd error"] = f"{type(e).__name__}: {str(e)[:200]}"
  del qt, kt, vt, dot, it
  torch.cuda.empty_cache()
  return out


def measure(args, rec: _record.Recorder) -> None:
  fla_reason = _fla.missing() if args.fla else "fla left out (--no-fla)"
  if fla_reason:
    rec.note(fla_reason)
  dense_reason = None if jax.default_backend() == "gpu" else "cuDNN dense needs a CUDA GPU: skipped"
  if dense_reason:
    rec.note(dense_reason)
  dense_done = {}
  qk = None
  if args.qk_npz:
    with np.load(args.qk_npz) as f:
      qk = {name: f[name] for name in ("q", "k")}
      rec.note(f"real indices: {args.qk_npz} (layer {int(f['layer'])}, step {int(f['step'])}, "
               f"q {list(f['q'].shape)}, k {list(f['k'].shape)})")
  for n, hq, hkv, d, top_k in args.cases:
    name = _record.head_case_name(n, hq, hkv, d, top_k)
    base = dict(case=name, n=n, hq=hq, hkv=hkv, d=d, top_k=top_k)
    q, k, v, do = inputs(n, hq, hkv, d)
    if args.indices == "random":
      idx = jnp.asarray(random_block_indices(0, n, hkv, top_k, C))
    elif args.indices == "real":
      idx = real_indices(qk, n, hkv, top_k, args.implementation)
    else:
      idx = pisa_jax.select_blocks(q, k, block_size=C, top_k=top_k,
                                   implementation=args.implementation)
    fl = sparse_flops(n, hq, d, top_k)
    ours, ours_out = {}, None
    try:
      ours, ours_out = time_ours(q, k, v, do, idx, d, args.implementation)
    except Exception as e:
      rec.add(**base, side="pisa-jax", phase="fwd", error=f"{type(e).__name__}: {str(e)[:300]}")
    for phase, ms in ours.items():
      rec.add(**base, side="pisa-jax", phase=phase, ms=ms,
              tflops=tflops(fl * (1 if phase == "fwd" else 3.5), ms), x_ours=1.0)
    if not fla_reason and ours_out is not None:
      try:
        res = time_fla(q, k, v, do, idx, d, ours_out)
      except Exception as e:
        res = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
      for phase in ("fwd", "fwd+bwd"):
        row = dict(base, side="fla", phase=phase)
        if phase in res:
          row.update(ms=res[phase], tflops=tflops(fl * (1 if phase == "fwd" else 3.5), res[phase]))
          if phase in ours:
            row["x_ours"] = round(res[phase] / ours[phase], 3)
        else:
          row["error"] = res.get(f"{phase} error", res.get("error"))
        if phase == "fwd" and "max_abs_vs_ours" in res:
          row["max_abs_vs_ours"] = res["max_abs_vs_ours"]
        rec.add(**row)
    if not dense_reason:
      key = (n, hq, hkv, d)  # dense attention does not depend on K: timed once per shape
      if key not in dense_done:
        try:
          dense_done[key] = {"fwd": time_jax(jax.jit(dense_fn), q, k, v),
                             "fwd+bwd": time_jax(with_grads(dense_fn), q, k, v, do)}
        except Exception as e:
          dense_done[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
      for phase in ("fwd", "fwd+bwd"):
        row = dict(base, side="cudnn dense", phase=phase)
        ms = dense_done[key].get(phase)
        if ms:
          row.update(ms=ms, tflops=tflops(dense_flops(n, hq, d) * (1 if phase == "fwd" else 3.5),
                                          ms))
          if phase in ours:
            row["x_ours"] = round(ms / ours[phase], 3)
        else:
          row["error"] = dense_done[key].get("error")
        rec.add(**row)
    print(table({"rows": [r for r in rec.rows if r["case"] == name]}), flush=True)
    del q, k, v, do, idx, ours_out


SIDES = ("pisa-jax", "fla", "cudnn dense")


def table(record: dict) -> str:
  return _record.phase_table(record, SIDES, [("fla / ours", "fla", "x_ours")])


def plot(record: dict, path) -> None:
  def annotate(by, case, phase):
    ours, fla = (by.get((case, side, phase), {}).get("ms") for side in ("pisa-jax", "fla"))
    if ours and fla:
      yield None, ours, f"{fla / ours:.2f}x"

  _record.phase_bars(
      record, path, SIDES, lambda phase: (
          f"selected-block attention, {phase}, bf16, {record['settings']['indices']} indices\n"
          f"{record['device']} (annotations: fla / ours)"), annotate)


def settings(args) -> dict:
  return dict(batch=1, block_size=C, dtype="bfloat16", seed=0, indices=args.indices,
              qk_npz=args.qk_npz,
              cases=[dict(zip(("n", "hq", "hkv", "d", "top_k"), c)) for c in args.cases],
              implementation=args.implementation, peers=_fla.versions(),
              timing="median of 7 batches of back-to-back calls (benchmarks/timing.py)")


def main(argv=None) -> dict:
  p = _record.parser(__doc__)
  p.add_argument("--case", dest="cases", type=parse_case, action="append",
                 help="N:HQ:HKV:D:K, repeatable (default: the ten cases of CASES)")
  p.add_argument("--indices", choices=("random", "pisa", "real"), default="random")
  p.add_argument("--qk-npz", default=None,
                 help="q/k of a trained run for --indices real (benchmarks.dump_qk)")
  p.add_argument("--implementation", default="pallas", choices=("pallas", "xla"),
                 help="ours: the Pallas kernels (default) or the jnp reference (a CPU smoke run)")
  p.add_argument("--no-fla", dest="fla", action="store_false", help="leave fla out")
  args = p.parse_args(argv)
  args.cases = args.cases or list(CASES)
  return _record.run(result_name(args), args, measure, settings, plot, table)


def result_name(args) -> str:
  """One result per kind of indices: attention.json (random), attention_pisa.json,
  attention_real.json; --replot keeps the name its JSON holds."""
  if args.replot:
    name = _record.load(args.replot)["benchmark"]
    if name != NAME and not name.startswith(NAME + "_"):
      raise SystemExit(f"--replot {args.replot} holds a {name!r} result, not an attention one")
    return name
  return NAME if args.indices == "random" else f"{NAME}_{args.indices}"


if __name__ == "__main__":
  main()
