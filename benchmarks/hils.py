"""How fast is a HiLS layer beside our PISA and NSA layers and dense attention, fwd and fwd+bwd?

Each side is a whole attention layer from its q, k, v (projections excluded), bf16, B=1:
  hils layer   `pisa_jax.hils_attention` (chunk 64, top-k 32, window 512; its landmark queries
               one more input, as the layer's low-rank projection gives them): landmarks in
               XLA, the selection kernel, the attention kernels; gradients of q, k, v and the
               landmark queries;
  pisa layer   `pisa_jax.pisa_attention` (C 64, K `--pisa-top-k`, default 32): selection then
               attention over the selected blocks;
  nsa layer    `pisa_jax.nsa_attention` at NSA's defaults (MLP compression of 32 tokens at
               stride 16, 16 selected blocks of 64, window 512, gates as an input): whatever
               implementation `--implementation` names (its selected branch on our sparse
               kernel, its other branches in XLA);
  cudnn dense  causal `jax.nn.dot_product_attention(implementation="cudnn")`.
Rows: median ms (benchmarks/timing.py) of each side and phase, and `x_hils`, that side's time
over the HiLS layer's. The plot is bars per case, log time.

  python -m benchmarks.hils                        # 16K, 64K, 128K at d64 and d128
  python -m benchmarks.hils --case 65536:32:2:128 --out /tmp/hils
  python -m benchmarks.hils --replot benchmarks/results/hils.json
  python -m benchmarks.hils --case 512:4:2:64 --implementation xla --out /tmp/h  # any CPU
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import pisa_jax
from pisa_jax.nsa import init_compression_mlp
from benchmarks import _record
from benchmarks.attention import C, dense_fn, inputs
from benchmarks.timing import time_jax

NAME = "hils"
CHUNK, TOP_K, WINDOW = 64, 32, 512
# (N, HQ, HKV, D)
CASES = ((16384, 32, 2, 64), (16384, 32, 2, 128), (65536, 32, 2, 64), (65536, 32, 2, 128),
         (131072, 32, 2, 64), (131072, 32, 2, 128))
SIDES = ("hils layer", "pisa layer", "nsa layer", "cudnn dense")


def layers(args, n, hq, hkv, d):
  """{side: (fn, extra inputs after q, k, v, differentiated)}."""
  impl = args.implementation
  keys = jax.random.split(jax.random.key(1), 3)
  landmark_q = jax.random.normal(keys[0], (1, n, hq, d), jnp.float32).astype(jnp.bfloat16)
  gates = jax.nn.sigmoid(jax.random.normal(keys[1], (1, n, hq, 3), jnp.float32)).astype(
      jnp.bfloat16)
  key_mlp, value_mlp = (init_compression_mlp(kk, block_length=32, head_dim=d)
                        for kk in jax.random.split(keys[2]))
  out = {
      "hils layer": (functools.partial(pisa_jax.hils_attention, chunk_size=CHUNK, top_k=TOP_K,
                                       window=WINDOW, implementation=impl), (landmark_q,)),
      "pisa layer": (functools.partial(pisa_jax.pisa_attention, block_size=C,
                                       top_k=args.pisa_top_k, implementation=impl), ()),
      "nsa layer": (lambda q, k, v, g: pisa_jax.nsa_attention(
          q, k, v, g, key_mlp=key_mlp, value_mlp=value_mlp, implementation=impl), (gates,)),
  }
  if jax.default_backend() == "gpu":
    out["cudnn dense"] = (dense_fn, ())
  return out


def with_all_grads(fn):
  """The gradients of <fn(*xs), do> in every input, jitted; `do` comes last."""
  def fwdbwd(*args):
    *xs, do = args
    _, vjp = jax.vjp(fn, *xs)
    return vjp(do)
  return jax.jit(fwdbwd)


def measure(args, rec: _record.Recorder) -> None:
  if jax.default_backend() != "gpu":
    rec.note("cuDNN dense needs a CUDA GPU: skipped")
  for n, hq, hkv, d in args.cases:
    base = dict(case=_record.head_case_name(n, hq, hkv, d), n=n, hq=hq, hkv=hkv, d=d)
    q, k, v, do = inputs(n, hq, hkv, d)
    times = {}
    for side, (fn, extra) in layers(args, n, hq, hkv, d).items():
      for phase, jitted, call_args in (("fwd", jax.jit(fn), (q, k, v, *extra)),
                                       ("fwd+bwd", with_all_grads(fn), (q, k, v, *extra, do))):
        try:
          times[side, phase] = time_jax(jitted, *call_args)
        except Exception as e:  # one side failing (memory, a missing backend) ends only its row
          rec.add(**base, side=side, phase=phase, error=f"{type(e).__name__}: {str(e)[:300]}")
    for (side, phase), ms in times.items():
      row = dict(base, side=side, phase=phase, ms=ms)
      ours = times.get(("hils layer", phase))
      if ours:
        row["x_hils"] = round(ms / ours, 3)
      rec.add(**row)
    print(table({"rows": [r for r in rec.rows if r["case"] == base["case"]]}), flush=True)
    del q, k, v, do


def table(record: dict) -> str:
  return _record.phase_table(record, SIDES,
                             [(f"{side.split()[0]} / hils", side, "x_hils") for side in SIDES[1:]])


def plot(record: dict, path) -> None:
  _record.phase_bars(
      record, path, SIDES, lambda phase: (f"HiLS layer vs PISA, NSA and dense, {phase}, bf16\n"
                                          f"{record['device']} (annotations: side / HiLS)"),
      _record.ratio_notes(SIDES[1:], "x_hils", ".2g"), note_size=6)


def settings(args) -> dict:
  return dict(batch=1, dtype="bfloat16", seed=0, implementation=args.implementation,
              hils=dict(chunk_size=CHUNK, top_k=TOP_K, window=WINDOW),
              pisa=dict(block_size=C, top_k=args.pisa_top_k, branching=2),
              nsa=dict(compression="mlp", block_length=32, stride=16, select_block_size=64,
                       top_n=16, window=512),
              cases=[dict(zip(("n", "hq", "hkv", "d"), c)) for c in args.cases],
              timing="median of 7 batches of back-to-back calls (benchmarks/timing.py)")


def main(argv=None) -> dict:
  p = _record.parser(__doc__, append=True)
  p.add_argument("--case", dest="cases", type=_record.parse_head_case, action="append",
                 help="N:HQ:HKV:D, repeatable (default: the six cases of CASES)")
  p.add_argument("--pisa-top-k", type=int, default=32,
                 help="PISA's K (default 32: HiLS's chunk count, beside its window)")
  p.add_argument("--implementation", default="pallas", choices=("pallas", "xla"),
                 help="every layer on its kernels (default) or the jnp references (a CPU run)")
  args = p.parse_args(argv)
  args.cases = args.cases or list(CASES)
  names = [_record.head_case_name(*c) for c in args.cases]
  measure_into = _record.appending(NAME, args, measure, names)
  return _record.run(NAME, args, measure_into, settings, plot, table)


if __name__ == "__main__":
  main()
