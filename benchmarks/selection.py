"""How fast is block selection as the sequence grows? PISA against flat BSA, ours and fla's.

The paper's Table 4 / Figure 3 setting: B=1, 32 query heads, 2 KV heads (a GQA group of 16),
d=64, C=64, K=8, g=2, bf16 random q/k (seed 0). Each time covers building the summaries and every
selection stage, not attention. Side by side in one run:
  pisa-jax pisa   `pisa_jax.select_blocks(selector="pisa")`, beam K (the paper's PISA) and any
                  wider beams given by --beams (more recall for more time)
  pisa-jax bsa    `selector="bsa"`, the flat baseline (O(N^2) work, no [T, M] scores in memory)
  fla bsa         fla's NSA top-k after mean pooling, the same BSA rule (skipped, with a note,
                  when fla is not importable)
Rows hold the median ms (benchmarks/timing.py: both sides timed the same way), the memory the
jitted call needs (temporaries + output; fla: the allocator's peak during a call) and the time
over pisa-jax PISA's at the same N, d and K (x_pisa). The plot is log-log time against N.

The wide budget: the same sides at K = 32 (and d = 128) over --budget-sizes (16K, 64K, 128K by
default), each PISA row with its time over PISA's at K = 8, same N and d (x_k8): what a budget
four times wider costs.

  python -m benchmarks.selection                          # 4K .. 1M, writes benchmarks/results/
  python -m benchmarks.selection --sizes 16384,131072 --beams 8,16 --out /tmp/sel
  python -m benchmarks.selection --replot benchmarks/results/selection.json
  python -m benchmarks.selection --sizes 256 --budget-sizes 256 --implementation xla --out /tmp/s
  python -m benchmarks.selection --sizes 131072 --budget-sizes 131072 --budget-cases 128:32

--kernels adds each PISA row's device ms per kernel (a profiler trace of a few calls).

  python -m benchmarks.selection --sizes 16384,65536,131072 --budget-sizes 16384,65536,131072 \
      --budget-cases 64:32,128:32 --selectors pisa --kernels --no-memory --no-fla --out DIR

Correctness is not checked here: tests/test_gpu_selection.py and tests/test_gpu_fla.py do that.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

import pisa_jax
from benchmarks import _fla, _record
from benchmarks.timing import device_kernel_ms, time_jax, time_torch

NAME = "selection"
HQ, HKV, D, C, G = 32, 2, 64, 64, 2
SIZES = (4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576)


def inputs(n: int, d: int = D, seed: int = 0):
  kq, kk = jax.random.split(jax.random.PRNGKey(seed))
  q = jax.random.normal(kq, (1, n, HQ, d), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(kk, (1, n, HKV, d), jnp.float32).astype(jnp.bfloat16)
  return q, k


def select_fn(selector: str, top_k: int, beam: int | None, implementation: str):
  # The scale is the default d ** -0.5 of the inputs' head dim.
  return jax.jit(functools.partial(pisa_jax.select_blocks, block_size=C, top_k=top_k,
                                   branching=G, selector=selector, beam=beam,
                                   implementation=implementation))


def memory_mb(fn, *args) -> float | None:
  analysis = fn.lower(*args).compile().memory_analysis()
  if analysis is None:
    return None
  return round((analysis.temp_size_in_bytes + analysis.output_size_in_bytes) / 2**20, 2)


def time_fla(n: int, top_k: int, d: int = D) -> tuple[float, float]:
  """fla's BSA selection on its own bf16 inputs of the same shapes: (ms, peak MiB)."""
  import torch
  torch.manual_seed(0)
  q = torch.randn(1, n, HQ, d, device="cuda", dtype=torch.bfloat16)
  k = torch.randn(1, n, HKV, d, device="cuda", dtype=torch.bfloat16)
  run = functools.partial(_fla.bsa_select, q, k, block_size=C, top_k=top_k, scale=d ** -0.5)
  run()
  torch.cuda.synchronize()
  torch.cuda.reset_peak_memory_stats()
  base = torch.cuda.memory_allocated()
  run()
  torch.cuda.synchronize()
  peak = (torch.cuda.max_memory_allocated() - base) / 2**20
  return time_torch(run), round(peak, 2)


def cases(args) -> list[tuple[int, int, int]]:
  """(N, d, K) in the order they run: Table 4's d and K over --sizes, then the budget cases."""
  main = [(n, D, args.top_k) for n in args.sizes]
  wide = [(n, d, k) for n in args.budget_sizes for d, k in args.budget_cases]
  base = [(n, d, args.top_k) for n in args.budget_sizes for d, _ in args.budget_cases]
  out = []
  for case in main + base + wide:  # each K = 8 reference runs before its wide case
    if case not in out:
      out.append(case)
  return out


def measure(args, rec: _record.Recorder) -> None:
  fla_reason = _fla.missing() if args.fla else "fla left out (--no-fla)"
  if fla_reason:
    rec.note(fla_reason)
  for n, d, top_k in cases(args):
    # Wider beams belong to Table 4's sweep; the budget cases run the paper's beam = K.
    beams = args.beams if (top_k == args.top_k and n in args.sizes and d == D) else [top_k]
    ours = [("pisa", beam) for beam in beams if "pisa" in args.selectors]
    if "bsa" in args.selectors:
      ours.append(("bsa", None))
    q, k = inputs(n, d)
    pisa_ms = None
    for selector, beam in ours:
      row = dict(n=n, d=d, top_k=top_k, side="pisa-jax", selector=selector, beam=beam)
      try:
        fn = select_fn(selector, top_k, beam, args.implementation)
        row["ms"] = time_jax(fn, q, k)
        if args.memory:
          row["memory_mb"] = memory_mb(fn, q, k)
        if args.kernels and selector == "pisa":
          row["kernel_ms"] = device_kernel_ms(fn, q, k)
      except Exception as e:  # recorded: one failing side must not hide the others
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      if selector == "pisa" and beam == beams[0]:
        pisa_ms = row.get("ms")
      rec.add(**row)
      print(row, flush=True)
    del q, k
    if not fla_reason:
      row = dict(n=n, d=d, top_k=top_k, side="fla", selector="bsa", beam=None)
      try:
        ms, peak = time_fla(n, top_k, d)
        row.update(ms=ms, memory_mb=peak)
      except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      rec.add(**row)
      print(row, flush=True)
    same = [row for row in rec.rows if (row["n"], row["d"], row["top_k"]) == (n, d, top_k)]
    for row in same:
      if pisa_ms and "ms" in row:
        row["x_pisa"] = round(row["ms"] / pisa_ms, 3)
    if top_k != args.top_k:
      k8 = [row for row in rec.rows if (row["n"], row["d"], row["top_k"]) == (n, d, args.top_k)
            and row["side"] == "pisa-jax" and row["selector"] == "pisa" and "ms" in row
            and row["beam"] == args.top_k]
      for row in same:  # PISA against PISA: BSA's rows have their own K = 8 time
        if k8 and "ms" in row and row["side"] == "pisa-jax" and row["selector"] == "pisa":
          row["x_k8"] = round(row["ms"] / k8[0]["ms"], 3)
          print(f"{label(row)} at N={n}: {row['ms']} ms, K{args.top_k} {k8[0]['ms']} ms, "
                f"x_k8 {row['x_k8']}", flush=True)
    rec.save()


def label(row: dict) -> str:
  beam = f", beam {row['beam']}" if row["selector"] == "pisa" else ""
  wide = f" d{row['d']} K{row['top_k']}" if (row.get("d", D), row.get("top_k", 8)) != (D, 8) else ""
  return f"{row['side']} {row['selector']}{beam}{wide}"


def series(record: dict) -> dict[str, list[tuple[int, float]]]:
  out: dict[str, list[tuple[int, float]]] = {}
  for row in record["rows"]:
    if "ms" in row:
      out.setdefault(label(row), []).append((row["n"], row["ms"]))
  return {name: sorted(points) for name, points in out.items()}


def table(record: dict) -> str:
  lines = series(record)
  names = list(lines)
  sizes = sorted({n for points in lines.values() for n, _ in points})
  ms = {(name, n): v for name, points in lines.items() for n, v in points}
  first = names[0] if names else None
  fla = "fla bsa"
  cols = ["N"] + [f"{name} ms" for name in names]
  if first and fla in names:
    cols.append(f"{fla} / {first}")
  body = []
  for n in sizes:
    line = [n] + [ms.get((name, n)) for name in names]
    if len(cols) > len(names) + 1:
      a, b = ms.get((fla, n)), ms.get((first, n))
      line.append(round(a / b, 2) if a and b else None)
    body.append(line)
  return _record.markdown(cols, body)


def plot(record: dict, path) -> None:
  plt = _record.pyplot()
  s = record["settings"]
  fig, ax = plt.subplots(figsize=(7, 5))
  lines = series(record)
  for name, points in lines.items():
    ax.plot([n for n, _ in points], [v for _, v in points], "o-" if "pisa-jax" in name else "s--",
            ms=4, label=name)
  pisa = dict(next(iter(lines.values()), []))
  for n, v in lines.get("fla bsa", []):
    if n in pisa:
      ax.annotate(f"{v / pisa[n]:.1f}x", (n, pisa[n]), textcoords="offset points", xytext=(0, -12),
                  fontsize=7, ha="center")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("sequence length N")
  ax.set_ylabel("selection time (ms, median)")
  ax.set_title(f"Block selection, {record['device']}: B=1, {s['hq']}/{s['hkv']} heads, "
               f"d={s['d']}, C={s['block_size']}, K={s['top_k']}, g={s['branching']}, "
               f"{s['dtype']}\n(annotations: fla BSA time / PISA time)", fontsize=9)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def settings(args) -> dict:
  return dict(batch=1, hq=HQ, hkv=HKV, d=D, block_size=C, top_k=args.top_k, branching=G,
              dtype="bfloat16", seed=0, sizes=args.sizes, beams=args.beams,
              budget_sizes=args.budget_sizes,
              budget_cases=[f"d{d} K{k}" for d, k in args.budget_cases],
              implementation=args.implementation, selectors=args.selectors,
              peers=_fla.versions(), timing="median of 7 batches of back-to-back calls (benchmarks/timing.py)")


def ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def names(text: str) -> list[str]:
  return [x for x in text.split(",") if x]


def pairs(text: str) -> list[tuple[int, int]]:
  out = []
  for item in (x for x in text.split(",") if x):
    d, sep, k = item.partition(":")
    if not (sep and d.isdigit() and k.isdigit()):
      raise argparse.ArgumentTypeError(f"{item!r} must be D:K, e.g. 128:32")
    out.append((int(d), int(k)))
  return out


def main(argv=None) -> dict:
  p = _record.parser(__doc__)
  p.add_argument("--sizes", type=ints, default=list(SIZES), help="sequence lengths N")
  p.add_argument("--top-k", type=int, default=8, help="K, blocks per query")
  p.add_argument("--beams", type=ints, default=None,
                 help="PISA beam widths (default: K, the paper's rule); the first is the "
                      "reference of the x_pisa ratios")
  p.add_argument("--budget-sizes", type=ints, default=[16384, 65536, 131072],
                 help="sequence lengths of the wide-budget cases ('' for none)")
  p.add_argument("--budget-cases", type=pairs, default=[(64, 32), (128, 8), (128, 32)],
                 help="D:K pairs run at --budget-sizes, each beside K = --top-k at its d")
  p.add_argument("--implementation", default="pallas", choices=("pallas", "xla"),
                 help="ours: the Pallas kernels (default) or the jnp reference (a CPU smoke run)")
  p.add_argument("--selectors", type=names, default=["pisa", "bsa"],
                 help="ours to time: pisa, bsa or both (default pisa,bsa)")
  p.add_argument("--kernels", action="store_true",
                 help="record each PISA row's device ms per kernel (a profiler trace)")
  p.add_argument("--no-memory", dest="memory", action="store_false",
                 help="skip the compiled memory analysis of each row")
  p.add_argument("--no-fla", dest="fla", action="store_false", help="leave fla out")
  args = p.parse_args(argv)
  bad = sorted(set(args.selectors) - {"pisa", "bsa"})
  if bad:
    p.error(f"--selectors {bad} must be among pisa, bsa")
  args.beams = args.beams or [args.top_k]
  return _record.run(NAME, args, measure, settings, plot, table)


if __name__ == "__main__":
  main()
