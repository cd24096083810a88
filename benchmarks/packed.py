"""What do packed documents cost? Selection and attention with segment_ids against one sequence.

A row of N tokens (default 128K) is packed with documents of random lengths (default 2K-16K
tokens, seeded; the last absorbs the remainder), and each stage is timed on the same bf16 inputs
twice: packed (`segment_ids`, every document on its own block grid and pyramid) and unpacked (one
sequence of N tokens). The ratio packed / unpacked is the price of packing; the goal is <= 1.10.
Stages:
  selection         `pisa_jax.select_blocks(selector="pisa")` (its pyramid included)
  attention fwd     `pisa_jax.sparse_attention` on fixed indices: K random valid blocks per query
                    (document-relative when packed, `pisa_jax.testing.random_block_indices` per
                    document), the current block forced
  attention fwd+bwd the same, with dq, dk and dv; ours also split by GPU kernel (a profiler
                    trace: device ms per call of each kernel, unpacked beside packed), to show
                    which kernel pays for packing
Sides: pisa-jax (`implementation="pallas"` by default) and fla's NSA (`fla.ops.nsa`), packed
through its varlen mode (`cu_seqlens`): BSA selection (mean pooling + `parallel_nsa_topk`) and
`ParallelNSAFunction` on the same indices. fla is skipped, with a note, where it cannot be
imported; a side that fails records its error in its row.

  python -m benchmarks.packed                              # both cases, benchmarks/results/
  python -m benchmarks.packed --case 64:8 --total 65536 --out /tmp/packed
  python -m benchmarks.packed --replot benchmarks/results/packed.json
  python -m benchmarks.packed --total 256 --min-doc 16 --max-doc 96 --case 32:3 --hq 4 \\
      --implementation xla --no-fla --out /tmp/p             # any CPU

Correctness is not checked here: tests/test_packed_pallas.py does that.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import pisa_jax
from pisa_jax.testing import random_block_indices
from benchmarks import _fla, _record
from benchmarks.timing import device_kernel_ms, time_jax, time_torch

NAME = "packed"
C = 64
# (D, K): the two anchor settings of benchmarks/attention.py.
CASES = ((64, 8), (128, 32))
STAGES = ("selection", "attention fwd", "attention fwd+bwd")
KERNELS = "fwd+bwd kernels"  # rows: {"kernels": {name: device ms per call}} (GPU only)
GOAL = 1.10


def parse_case(text: str) -> tuple[int, int]:
  try:
    d, k = (int(x) for x in text.split(":"))
  except ValueError:
    raise SystemExit(f"--case {text!r} must be D:K, e.g. 64:8") from None
  return d, k


def document_lengths(total: int, low: int, high: int, seed: int = 0) -> list[int]:
  """Random lengths in [low, high] summing to total; a remainder shorter than low joins the last
  document."""
  rng = np.random.default_rng(seed)
  lengths = []
  while sum(lengths) < total:
    lengths.append(int(min(rng.integers(low, high + 1), total - sum(lengths))))
  if len(lengths) > 1 and lengths[-1] < low:
    last = lengths.pop()
    lengths[-1] += last
  return lengths


def inputs(n, hq, hkv, d, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  shapes = ((1, n, hq, d), (1, n, hkv, d), (1, n, hkv, d), (1, n, hq, d))
  return tuple(jax.random.normal(kk, s, jnp.float32).astype(jnp.bfloat16)
               for kk, s in zip(keys, shapes))


def packed_indices(lengths, hkv, top_k):
  """Document-relative random valid indices `[1, N, HKV, K]`, each document's own."""
  return np.concatenate([random_block_indices(i, n, hkv, top_k, C)
                         for i, n in enumerate(lengths)], axis=1)


def with_grads(fn):
  """fn(q, k, v, *rest) -> (dq, dk, dv) of <fn(...), do>, jitted; `do` comes last."""
  def fwdbwd(q, k, v, *rest):
    *rest, do = rest
    _, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, *rest), q, k, v)
    return vjp(do)
  return jax.jit(fwdbwd)


def time_ours(q, k, v, do, idx, seg, *, d, top_k, implementation):
  """Median ms of each stage; seg None times the unpacked sequence."""
  select = jax.jit(lambda q, k, seg: pisa_jax.select_blocks(
      q, k, block_size=C, top_k=top_k, segment_ids=seg, implementation=implementation))
  attend = functools.partial(pisa_jax.sparse_attention, block_size=C, scale=d ** -0.5,
                             implementation=implementation)

  def attend_seg(q, k, v, idx, seg):
    return attend(q, k, v, idx, segment_ids=seg)

  fwdbwd = with_grads(attend_seg)  # one jitted function: the kernel trace reuses its compile
  out = {}
  for stage, run in (("selection", lambda: time_jax(select, q, k, seg)),
                     ("attention fwd", lambda: time_jax(jax.jit(attend_seg), q, k, v, idx, seg)),
                     ("attention fwd+bwd", lambda: time_jax(fwdbwd, q, k, v, idx, seg, do))):
    try:
      out[stage] = run()
    except Exception as e:  # recorded: one failing stage must not hide the others
      out[stage] = f"{type(e).__name__}: {str(e)[:300]}"
  if not isinstance(out["attention fwd+bwd"], str):
    out[KERNELS] = device_kernel_ms(fwdbwd, q, k, v, idx, seg, do)
  return out


def time_fla(q, k, v, do, idx, cu_seqlens, *, d, top_k):
  """fla's stages on the same inputs; cu_seqlens None times the unpacked sequence."""
  import torch
  qt, kt, vt = (_fla.to_torch(x).requires_grad_() for x in (q, k, v))
  dot, it = _fla.to_torch(do), _fla.to_torch(idx)
  cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.long).cuda()
  select = functools.partial(_fla.bsa_select, qt.detach(), kt.detach(), block_size=C,
                             top_k=top_k, scale=d ** -0.5, cu_seqlens=cu)
  fwd = functools.partial(_fla.sparse_attention, qt, kt, vt, it, block_size=C, scale=d ** -0.5,
                          cu_seqlens=cu)
  out = {}
  for stage, run in (("selection", lambda: time_torch(select)),
                     ("attention fwd", lambda: time_torch(fwd)),
                     ("attention fwd+bwd", lambda: time_torch(lambda: fwd().backward(dot)))):
    try:
      with torch.no_grad() if stage != "attention fwd+bwd" else torch.enable_grad():
        out[stage] = run()
    except Exception as e:
      out[stage] = f"{type(e).__name__}: {str(e)[:300]}"
  del qt, kt, vt, dot, it
  torch.cuda.empty_cache()
  return out


def measure(args, rec: _record.Recorder) -> None:
  fla_reason = _fla.missing() if args.fla else "fla left out (--no-fla)"
  if fla_reason:
    rec.note(fla_reason)
  lengths = document_lengths(args.total, args.min_doc, args.max_doc)
  rec.record["settings"]["documents"] = lengths
  rec.save()
  seg = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None].astype(np.int32))
  cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).tolist()
  for d, top_k in args.cases:
    size = f"{args.total // 1024}K" if args.total % 1024 == 0 else str(args.total)
    case = f"{size} d{d} K{top_k}"
    q, k, v, do = inputs(args.total, args.hq, args.hkv, d)
    layouts = {
        "unpacked": (jnp.asarray(random_block_indices(0, args.total, args.hkv, top_k, C)), None,
                     None),
        "packed": (jnp.asarray(packed_indices(lengths, args.hkv, top_k)), seg, cu_seqlens)}
    for side in ["pisa-jax"] + ([] if fla_reason else ["fla"]):
      times = {}
      for layout, (idx, segment, cu) in layouts.items():
        if side == "pisa-jax":
          times[layout] = time_ours(q, k, v, do, idx, segment, d=d, top_k=top_k,
                                    implementation=args.implementation)
        else:
          times[layout] = time_fla(q, k, v, do, idx, cu, d=d, top_k=top_k)
      for stage in STAGES:
        for layout in ("unpacked", "packed"):
          row = dict(case=case, d=d, top_k=top_k, side=side, stage=stage, layout=layout)
          ms = times[layout][stage]
          if isinstance(ms, str):
            row["error"] = ms
          else:
            row["ms"] = ms
            base = times["unpacked"][stage]
            if layout == "packed" and not isinstance(base, str):
              row["x_unpacked"] = round(ms / base, 3)
          rec.add(**row)
      for layout in ("unpacked", "packed"):
        if times[layout].get(KERNELS):
          rec.add(case=case, d=d, top_k=top_k, side=side, stage=KERNELS, layout=layout,
                  kernels=times[layout][KERNELS])
    print(table({"rows": [r for r in rec.rows if r["case"] == case]}), flush=True)
    del q, k, v, do, layouts


def table(record: dict) -> str:
  by = {(r["case"], r["side"], r["stage"], r["layout"]): r for r in record["rows"]}
  keys = list(dict.fromkeys((r["case"], r["stage"]) for r in record["rows"]
                            if r["stage"] in STAGES))
  cols = ["case", "stage"]
  for side in ("pisa-jax", "fla"):
    cols += [f"{side} unpacked ms", f"{side} packed ms", f"{side} packed / unpacked"]
  body = []
  for case, stage in keys:
    line = [case, stage]
    for side in ("pisa-jax", "fla"):
      line += [by.get((case, side, stage, "unpacked"), {}).get("ms"),
               by.get((case, side, stage, "packed"), {}).get("ms"),
               by.get((case, side, stage, "packed"), {}).get("x_unpacked")]
    body.append(line)
  ours = [r["x_unpacked"] for r in record["rows"]
          if r["side"] == "pisa-jax" and "x_unpacked" in r]
  summary = (f"\npisa-jax packed / unpacked: worst {max(ours):.3f}, mean "
             f"{sum(ours) / len(ours):.3f} (goal <= {GOAL})" if ours else "")
  return _record.markdown(cols, body) + summary + kernel_table(record)


def kernel_table(record: dict) -> str:
  """Our fwd+bwd by GPU kernel, unpacked beside packed, the largest packed - unpacked first."""
  body = []
  for case in dict.fromkeys(r["case"] for r in record["rows"] if r["stage"] == KERNELS):
    got = {r["layout"]: r["kernels"] for r in record["rows"]
           if r["case"] == case and r["stage"] == KERNELS and r["side"] == "pisa-jax"}
    un, pk = got.get("unpacked", {}), got.get("packed", {})
    names = sorted(set(un) | set(pk), key=lambda n: -(pk.get(n, 0.0) - un.get(n, 0.0)))
    body += [[case, n, un.get(n), pk.get(n), round(pk.get(n, 0.0) - un.get(n, 0.0), 4)]
             for n in names]
  if not body:
    return ""
  return "\n\npisa-jax fwd+bwd by GPU kernel (device ms per call):\n" + _record.markdown(
      ["case", "kernel", "unpacked ms", "packed ms", "packed - unpacked"], body)


def plot(record: dict, path) -> None:
  plt = _record.pyplot()
  by = {(r["case"], r["side"], r["stage"], r["layout"]): r.get("ms") for r in record["rows"]}
  keys = list(dict.fromkeys((r["case"], r["stage"]) for r in record["rows"]
                            if r["stage"] in STAGES))
  bars = [(side, layout) for side in ("pisa-jax", "fla") for layout in ("unpacked", "packed")]
  fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(keys) + 3), 5))
  width = 0.8 / len(bars)
  x = np.arange(len(keys))
  for j, (side, layout) in enumerate(bars):
    vals = [by.get((case, side, stage, layout)) or np.nan for case, stage in keys]
    ax.bar(x + (j - 1.5) * width, vals, width, label=f"{side} {layout}",
           hatch="//" if layout == "packed" else None)
  for i, (case, stage) in enumerate(keys):
    a, b = by.get((case, "pisa-jax", stage, "packed")), by.get((case, "pisa-jax", stage,
                                                                "unpacked"))
    if a and b:
      ax.annotate(f"{a / b:.2f}x", (i - 0.5 * width, a), textcoords="offset points",
                  xytext=(0, 3), fontsize=7, ha="center")
  ax.set_yscale("log")
  ax.set_ylim(bottom=_record.bar_floor(by.values()))
  ax.set_xticks(x)
  ax.set_xticklabels([f"{case}\n{stage}" for case, stage in keys], fontsize=7)
  ax.set_ylabel("ms (median, log)")
  s = record["settings"]
  ax.set_title(f"packed documents ({len(s.get('documents', []))} of {s['min_doc']}-"
               f"{s['max_doc']} tokens) vs one sequence, {s['hq']}/{s['hkv']} heads, C={C}, "
               f"bf16\n{record['device']} (annotations: pisa-jax packed / unpacked, goal <= "
               f"{GOAL})", fontsize=9)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def settings(args) -> dict:
  return dict(batch=1, total=args.total, min_doc=args.min_doc, max_doc=args.max_doc,
              hq=args.hq, hkv=args.hkv, block_size=C, dtype="bfloat16", seed=0,
              cases=[dict(d=d, top_k=k) for d, k in args.cases], selector="pisa",
              implementation=args.implementation, peers=_fla.versions(),
              timing="median of 7 batches of back-to-back calls (benchmarks/timing.py)")


def main(argv=None) -> dict:
  p = _record.parser(__doc__)
  p.add_argument("--case", dest="cases", type=parse_case, action="append",
                 help="D:K, repeatable (default: 64:8 and 128:32)")
  p.add_argument("--total", type=int, default=131072, help="tokens in the row, N")
  p.add_argument("--min-doc", type=int, default=2048, help="shortest document")
  p.add_argument("--max-doc", type=int, default=16384, help="longest document")
  p.add_argument("--hq", type=int, default=32, help="query heads")
  p.add_argument("--hkv", type=int, default=2, help="KV heads")
  p.add_argument("--implementation", default="pallas", choices=("pallas", "xla"),
                 help="ours: the Pallas kernels (default) or the jnp reference (a CPU smoke run)")
  p.add_argument("--no-fla", dest="fla", action="store_false", help="leave fla out")
  args = p.parse_args(argv)
  if not 1 <= args.min_doc <= args.max_doc:
    raise SystemExit(f"--min-doc {args.min_doc} and --max-doc {args.max_doc} must satisfy "
                     "1 <= min-doc <= max-doc")
  if args.hq % args.hkv:
    raise SystemExit(f"--hq {args.hq} must be a multiple of --hkv {args.hkv}")
  args.cases = args.cases or list(CASES)
  return _record.run(NAME, args, measure, settings, plot, table)


if __name__ == "__main__":
  main()
