"""How fast is our NSA layer? Against fla's NSA, our PISA layer and cuDNN dense, forward and
forward + backward.

All sides in one process on the same bf16 q, k, v `[1, N, 32, 64]` (B = 1, HQ = 32, GQA groups
4, 8, 16) and the same gates sigmoid(normal) `[1, N, HQ, 3]`:
  nsa          `pisa_jax.nsa_attention(implementation="pallas")` in fla's configuration: mean
               compression, l = d = l' = 64, top_n = 16, window 512 (the compressed attention
               and the window on the range kernels, the window on cuDNN where it takes the
               arguments, the selected branch on the sparse-attention kernel)
  fla nsa      fla's `parallel_nsa` with the same gates, block_size 64, block_counts 16,
               window_size 512 (its window is flash-attn's; without flash-attn, fla's own
               `parallel_attn` with the same window, noted in the result). fla takes only GQA
               groups that are powers of two >= 16: a refusal is recorded as a row with
               `refused`. Its forward's largest difference from ours is recorded (same rule,
               selection tested equal)
  pisa layer   `pisa_jax.pisa_attention(implementation="pallas")`, C = 64, K = 16
  cudnn dense  causal `jax.nn.dot_product_attention(implementation="cudnn")`
and our NSA's branches alone, to show where its time goes and which window is faster: the
compressed attention (range kernel), the window on cuDNN and on the range kernel. Rows: median
ms (benchmarks/timing.py) and x_ours, a side's time over our NSA layer's in the same case and
phase. The plot is bars per case, log time.

  python -m benchmarks.nsa                          # 16K, 64K, 128K x groups 4, 8, 16
  python -m benchmarks.nsa --case 65536:32:2:64 --out /tmp/nsa
  python -m benchmarks.nsa --replot benchmarks/results/nsa.json
  python -m benchmarks.nsa --case 256:4:1:16 --implementation xla --no-fla --out /tmp/n  # CPU
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import pisa_jax
from benchmarks import _fla, _record
from benchmarks.attention import dense_fn, inputs, with_grads
from benchmarks.timing import time_jax, time_torch
from pisa_jax import nsa

NAME = "nsa"
BLOCK, TOP_N, WINDOW = 64, 16, 512
# (N, HQ, HKV, D)
CASES = tuple((n, 32, 32 // g, 64) for n in (16384, 65536, 131072) for g in (4, 8, 16))
SIDES = ("nsa", "fla nsa", "pisa layer", "cudnn dense")
BRANCHES = ("compressed kernel", "window cudnn", "window kernel")


def nsa_fn(implementation: str, window: int):
  return functools.partial(nsa.nsa_attention, compression="mean", block_length=BLOCK,
                           stride=BLOCK, select_block_size=BLOCK, top_n=TOP_N, window=window,
                           implementation=implementation)


def branch_fns(n: int, d: int, window: int) -> dict:
  """Our NSA's attentions alone, each f(q, k, v, gates) (gates unused)."""
  scale = d ** -0.5

  def compressed(q, k, v, gates):
    k_cmp, v_cmp = (nsa.nsa_compress(x, compression="mean", block_length=BLOCK, stride=BLOCK)
                    for x in (k, v))
    return nsa.compressed_attention(q, k_cmp, v_cmp, block_length=BLOCK, stride=BLOCK,
                                    implementation="pallas")[0]

  def window_on(backend):
    return lambda q, k, v, gates: nsa.sliding_window_attention_pallas(
        q, k, v, None, window=window, scale=scale, interpret=False, backend=backend)

  return {"compressed kernel": compressed, "window cudnn": window_on("cudnn"),
          "window kernel": window_on("pallas")}


def time_fla(q, k, v, gates, do, d, window, ours_out):
  """fla's `parallel_nsa` forward and forward + backward; its forward's largest difference from
  ours. Raises what fla raises (its GQA rule, a missing flash-attn)."""
  import torch
  from fla.ops.nsa.parallel import parallel_nsa
  qt, kt, vt = (_fla.to_torch(x).requires_grad_() for x in (q, k, v))
  gt = [_fla.to_torch(gates[..., i]) for i in range(3)]
  dot = _fla.to_torch(do)
  fwd = functools.partial(parallel_nsa, qt, kt, vt, *gt, block_counts=TOP_N, block_size=BLOCK,
                          window_size=window, scale=d ** -0.5)
  out = {}
  try:
    with torch.no_grad():
      o = fwd().float().cpu().numpy()
    out["max_abs_vs_ours"] = float(np.max(np.abs(o - np.asarray(ours_out, np.float32))))
    out["fwd"] = time_torch(fwd)
    out["fwd+bwd"] = time_torch(lambda: fwd().backward(dot))
  finally:
    del qt, kt, vt, gt, dot
    torch.cuda.empty_cache()
  return out


def measure(args, rec: _record.Recorder) -> None:
  on_gpu = jax.default_backend() == "gpu"
  fla_reason = _fla.missing() if args.fla else "fla left out (--no-fla)"
  if fla_reason:
    rec.note(fla_reason)
  elif (substitute := _fla.nsa_window_substitute()) is not None:
    rec.note(substitute)
  if not on_gpu:
    rec.note("cuDNN and the kernels' branch timings need a CUDA GPU: skipped")
  for n, hq, hkv, d in args.cases:
    base = dict(case=_record.head_case_name(n, hq, hkv, d), n=n, hq=hq, hkv=hkv, d=d,
                group=hq // hkv)
    q, k, v, do = inputs(n, hq, hkv, d)
    gates = jax.nn.sigmoid(jax.random.normal(jax.random.key(7), (1, n, hq, 3))).astype(q.dtype)
    fns = {"nsa": nsa_fn(args.implementation, args.window),
           "pisa layer": functools.partial(
               lambda q, k, v, gates, **kw: pisa_jax.pisa_attention(q, k, v, **kw),
               block_size=BLOCK, top_k=TOP_N, implementation=args.implementation)}
    if on_gpu:
      fns["cudnn dense"] = lambda q, k, v, gates: dense_fn(q, k, v)
      fns.update(branch_fns(n, d, args.window))
    times, ours_out = {}, None
    for side, fn in fns.items():
      for phase, jitted, call_args in (("fwd", jax.jit(fn), (q, k, v, gates)),
                                       ("fwd+bwd", with_grads(fn), (q, k, v, gates, do))):
        try:
          times[side, phase] = time_jax(jitted, *call_args)
        except Exception as e:
          rec.add(**base, side=side, phase=phase, error=f"{type(e).__name__}: {str(e)[:300]}")
      if side == "nsa" and ("nsa", "fwd") in times:
        ours_out = jax.jit(fn)(q, k, v, gates).astype(jnp.float32)
    extra = {}
    if not fla_reason and ours_out is not None:
      try:
        res = time_fla(q, k, v, gates, do, d, args.window, ours_out)
        times.update({("fla nsa", p): res[p] for p in ("fwd", "fwd+bwd")})
        extra["max_abs_vs_ours"] = res["max_abs_vs_ours"]
      except Exception as e:  # fla's GQA rule is an assert: groups of 16, 32...
        refused = hq // hkv % 16 != 0
        for phase in ("fwd", "fwd+bwd"):
          rec.add(**base, side="fla nsa", phase=phase, refused=refused,
                  error=f"{type(e).__name__}: {str(e)[:300]}")
    for (side, phase), ms in times.items():
      row = dict(base, side=side, phase=phase, ms=ms)
      ours = times.get(("nsa", phase))
      if side != "nsa" and ours:
        row["x_ours"] = round(ms / ours, 3)
      if side == "fla nsa" and phase == "fwd":
        row.update(extra)
      rec.add(**row)
    print(table({"rows": [r for r in rec.rows if r["case"] == base["case"]]}), flush=True)
    del q, k, v, do, gates, ours_out


def table(record: dict) -> str:
  return _record.phase_table(record, SIDES + BRANCHES, [("fla / ours", "fla nsa", "x_ours")])


def plot(record: dict, path) -> None:
  def annotate(by, case, phase):
    for side in SIDES:
      row = by.get((case, side, phase), {})
      text = ("refused" if row.get("refused") else
              f"{row['x_ours']:.2f}x" if row.get("x_ours") and side == "fla nsa" else None)
      if text:
        yield side, row.get("ms") or by.get((case, "nsa", phase), {}).get("ms") or 1.0, text

  _record.phase_bars(
      record, path, SIDES, lambda phase: (f"NSA layer vs fla's NSA, PISA and dense, {phase}, "
                                          f"bf16\n{record['device']} (annotations: fla / ours)"),
      annotate, note_size=6)


def settings(args) -> dict:
  return dict(batch=1, compression="mean", block_length=BLOCK, stride=BLOCK,
              select_block_size=BLOCK, top_n=TOP_N, window=args.window, dtype="bfloat16",
              pisa_block_size=BLOCK, pisa_top_k=TOP_N, seed=0,
              cases=[dict(zip(("n", "hq", "hkv", "d"), c)) for c in args.cases],
              implementation=args.implementation, peers=_fla.versions(),
              timing="median of 7 batches of back-to-back calls (benchmarks/timing.py)")


def main(argv=None) -> dict:
  p = _record.parser(__doc__, append=True)
  p.add_argument("--case", dest="cases", type=_record.parse_head_case, action="append",
                 help="N:HQ:HKV:D, repeatable (default: the nine cases of CASES)")
  p.add_argument("--window", type=int, default=WINDOW, help=f"NSA's window (default {WINDOW})")
  p.add_argument("--implementation", default="pallas", choices=("pallas", "xla"),
                 help="ours: the kernels (default) or the jnp reference (a CPU smoke run)")
  p.add_argument("--no-fla", dest="fla", action="store_false", help="leave fla out")
  args = p.parse_args(argv)
  args.cases = args.cases or list(CASES)
  names = [_record.head_case_name(*c) for c in args.cases]
  measure_into = _record.appending(NAME, args, measure, names)
  return _record.run(NAME, args, measure_into, settings, plot, table)


if __name__ == "__main__":
  main()
