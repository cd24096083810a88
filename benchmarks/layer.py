"""How much faster is a whole PISA layer than dense attention, forward and backward?

The layer is `pisa_jax.pisa_attention(implementation="pallas")`: the selection (under
stop_gradient, its time included) then attention over the selected blocks. Dense is causal
`jax.nn.dot_product_attention(implementation="cudnn")` over all keys. Same bf16 q/k/v (B=1, C=64,
g=2, beam K), forward and forward + backward (dq, dk, dv). Rows: median ms (benchmarks/timing.py)
and speedup, dense time over the layer's. The plot is bars per case, log time.

  python -m benchmarks.layer                        # the default cases, benchmarks/results/
  python -m benchmarks.layer --case 65536:32:2:128:32 --out /tmp/layer
  python -m benchmarks.layer --replot benchmarks/results/layer.json
  python -m benchmarks.layer --case 256:4:2:64:4 --implementation xla --out /tmp/l  # any CPU
"""

from __future__ import annotations

import functools

import jax

import pisa_jax
from benchmarks import _record
from benchmarks.attention import C, dense_fn, inputs, parse_case, with_grads
from benchmarks.timing import time_jax

NAME = "layer"
# (N, HQ, HKV, D, K)
CASES = ((16384, 32, 2, 64, 8), (16384, 32, 2, 128, 32), (65536, 32, 2, 64, 8),
         (65536, 32, 2, 128, 32), (131072, 32, 2, 64, 8), (131072, 32, 2, 128, 32))
SIDES = ("pisa layer", "cudnn dense")


def layer_fn(top_k: int, implementation: str):
  return functools.partial(pisa_jax.pisa_attention, block_size=C, top_k=top_k,
                           implementation=implementation)


def measure(args, rec: _record.Recorder) -> None:
  dense_ok = jax.default_backend() == "gpu"
  if not dense_ok:
    rec.note("cuDNN dense needs a CUDA GPU: skipped")
  for n, hq, hkv, d, top_k in args.cases:
    base = dict(case=_record.head_case_name(n, hq, hkv, d, top_k), n=n, hq=hq, hkv=hkv, d=d,
                top_k=top_k)
    q, k, v, do = inputs(n, hq, hkv, d)
    fns = {"pisa layer": layer_fn(top_k, args.implementation)}
    if dense_ok:
      fns["cudnn dense"] = dense_fn
    times = {}
    for side, fn in fns.items():
      for phase, jitted, call_args in (("fwd", jax.jit(fn), (q, k, v)),
                                       ("fwd+bwd", with_grads(fn), (q, k, v, do))):
        try:
          times[side, phase] = time_jax(jitted, *call_args)
        except Exception as e:
          rec.add(**base, side=side, phase=phase, error=f"{type(e).__name__}: {str(e)[:300]}")
    for (side, phase), ms in times.items():
      row = dict(base, side=side, phase=phase, ms=ms)
      dense = times.get(("cudnn dense", phase))
      if side != "cudnn dense" and dense:
        row["speedup_vs_dense"] = round(dense / ms, 3)
      rec.add(**row)
    print(table({"rows": [r for r in rec.rows if r["case"] == base["case"]]}), flush=True)
    del q, k, v, do


def table(record: dict) -> str:
  return _record.phase_table(record, SIDES, [("dense / layer", "pisa layer", "speedup_vs_dense")])


def plot(record: dict, path) -> None:
  _record.phase_bars(
      record, path, SIDES, lambda phase: (f"PISA layer vs dense attention, {phase}, bf16\n"
                                          f"{record['device']} (annotations: dense / layer)"),
      _record.ratio_notes(SIDES[:2], "speedup_vs_dense", ".1f"))


def settings(args) -> dict:
  return dict(batch=1, block_size=C, branching=2, beam="top_k", dtype="bfloat16", seed=0,
              cases=[dict(zip(("n", "hq", "hkv", "d", "top_k"), c)) for c in args.cases],
              implementation=args.implementation,
              timing="median of 7 batches of back-to-back calls (benchmarks/timing.py)")


def main(argv=None) -> dict:
  p = _record.parser(__doc__)
  p.add_argument("--case", dest="cases", type=parse_case, action="append",
                 help="N:HQ:HKV:D:K, repeatable (default: the six cases of CASES)")
  p.add_argument("--implementation", default="pallas", choices=("pallas", "xla"),
                 help="ours: the Pallas kernels (default) or the jnp reference (a CPU smoke run)")
  args = p.parse_args(argv)
  args.cases = args.cases or list(CASES)
  return _record.run(NAME, args, measure, settings, plot, table)


if __name__ == "__main__":
  main()
