"""The one result layout every benchmark writes, and the command line they share.

Each benchmark writes exactly one result, `<out>/<name>.json` beside its plot `<out>/<name>.png`,
and overwrites both on every run (default out: benchmarks/results). The JSON says what produced it:

  {"benchmark": "selection",
   "commit": "<git sha>", with "-dirty" when tracked files differ from it,
   "jax": "0.11.2", "jaxlib": "0.11.2",
   "device": "1 x NVIDIA H200",
   "date": "2026-12-01T09:30:00Z",           (UTC, when the run started)
   "settings": {...},                         (the shapes and options of this run)
   "notes": ["fla not importable: ..."],      (peers skipped, failures, caveats)
   "rows": [{...}, ...]}                      (one measurement each; times are medians in ms)

The file is rewritten after every row, so a run stopped early keeps what it measured.
`--replot JSON` redraws a saved result's plot (and prints its table) without a GPU.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from pisa_jax.train.provenance import environment

KEYS = ("benchmark", "commit", "jax", "jaxlib", "device", "date", "settings", "notes", "rows")
DEFAULT_OUT = Path(__file__).resolve().parent / "results"


class Recorder:
  """Builds one benchmark's result and writes `<out>/<name>.json` after every change."""

  def __init__(self, name: str, settings: dict, out_dir: str | Path):
    self.path = Path(out_dir) / f"{name}.json"
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self.record = {"benchmark": name, **environment(), "settings": settings, "notes": [],
                   "rows": []}
    self.save()

  @property
  def rows(self) -> list[dict]:
    return self.record["rows"]

  def add(self, **row) -> dict:
    self.rows.append(row)
    self.save()
    return row

  def note(self, text: str) -> None:
    print(f"note: {text}", flush=True)
    if text not in self.record["notes"]:  # an --append run may repeat an earlier note
      self.record["notes"].append(text)
    self.save()

  def save(self) -> None:
    self.path.write_text(json.dumps(self.record, indent=1, default=float) + "\n")


def load(path: str | Path) -> dict:
  """A saved result; raises if it is not in this layout."""
  record = json.loads(Path(path).read_text())
  missing = [k for k in KEYS if k not in record]
  if missing:
    raise ValueError(f"{path} is not a benchmark result in the shared layout: it lacks {missing}")
  return record


def header(record: dict) -> str:
  """One line naming what produced the result."""
  return (f"{record['benchmark']}: {record['device']}, jax {record['jax']}, commit "
          f"{record['commit']}, {record['date']}")


def parser(doc: str, *, append: bool = False) -> argparse.ArgumentParser:
  """The arguments every benchmark takes: --out and --replot; with `append`, --append (see
  `appending`)."""
  p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                 help=f"folder for <name>.json and <name>.png (default {DEFAULT_OUT})")
  p.add_argument("--replot", metavar="JSON", type=Path,
                 help="no measurement: redraw the plot of a saved result into --out and print "
                      "its table")
  if append:
    p.add_argument("--append", action="store_true",
                   help="keep the rows of --out's earlier result that this call does not measure "
                        "(a suite measured over several calls)")
  return p


def parse_ints(text: str) -> tuple[int, ...]:
  """A comma-separated list of ints >= 1 (an argument's value); SystemExit naming it otherwise."""
  try:
    values = tuple(int(x) for x in text.split(","))
  except ValueError:
    raise SystemExit(f"{text!r} must be comma-separated ints") from None
  if not values or min(values) < 1:
    raise SystemExit(f"{text!r} must hold ints >= 1")
  return values


def parse_head_case(text: str, *, with_top_k: bool = False) -> tuple[int, ...]:
  """`--case N:HQ:HKV:D` (with `with_top_k`, `N:HQ:HKV:D:K`) as ints: sequence length, query
  heads, KV heads, head dim (and K). SystemExit naming the case otherwise."""
  form, example = ("N:HQ:HKV:D:K", "16384:32:2:64:8") if with_top_k else ("N:HQ:HKV:D",
                                                                         "16384:32:2:64")
  try:
    values = tuple(int(x) for x in text.split(":"))
  except ValueError:
    values = ()
  if len(values) != len(form.split(":")):
    raise SystemExit(f"--case {text!r} must be {form}, e.g. {example}")
  if values[1] % values[2]:
    raise SystemExit(f"--case {text!r}: HQ must be a multiple of HKV")
  return values


def head_case_name(n: int, hq: int, hkv: int, d: int, top_k: int | None = None) -> str:
  """A case's name in rows and tables: "16K d64 g16", with K "16K d64 K8 g16"."""
  size = f"{n // 1024}K" if n % 1024 == 0 else str(n)
  budget = "" if top_k is None else f" K{top_k}"
  return f"{size} d{d}{budget} g{hq // hkv}"


def run(name: str, args: argparse.Namespace, measure: Callable[[argparse.Namespace, Recorder], None],
        settings: Callable[[argparse.Namespace], dict], plot: Callable[[dict, Path], None],
        table: Callable[[dict], str]) -> dict:
  """A benchmark's main: measure into a fresh result (or load one with --replot), plot, print."""
  if args.replot:
    record = load(args.replot)
    if record["benchmark"] != name:
      raise SystemExit(f"--replot {args.replot} holds a {record['benchmark']!r} result, "
                       f"not {name!r}")
  else:
    recorder = Recorder(name, settings(args), args.out)
    try:
      measure(args, recorder)
    finally:
      recorder.save()
    record = recorder.record
  args.out.mkdir(parents=True, exist_ok=True)
  png = args.out / f"{name}.png"
  if record["rows"]:
    plot(record, png)
  print(header(record))
  print(table(record))
  if args.replot:
    for text in record["notes"]:
      print(f"note: {text}")
  print(f"wrote {png}" + ("" if args.replot else f" and {args.out / f'{name}.json'}"), flush=True)
  return record


def appending(name: str, args: argparse.Namespace,
              measure: Callable[[argparse.Namespace, Recorder], None],
              cases: list[str]) -> Callable[[argparse.Namespace, Recorder], None]:
  """`measure`, starting from the earlier result in --out when --append is given: its rows of
  cases this call does not measure are kept (rows name their case), and the note says from which
  commit and date they come. The earlier result must be of the same benchmark and device."""
  path = args.out / f"{name}.json"
  if not args.append or args.replot or not path.is_file():
    return measure
  earlier, device = load(path), environment()["device"]
  if earlier["benchmark"] != name or earlier["device"] != device:  # before anything overwrites it
    raise SystemExit(f"--append: {path} holds a {earlier['benchmark']!r} result on "
                     f"{earlier['device']!r}; this run is {name!r} on {device!r}")

  def measure_after_earlier(args, rec: Recorder) -> None:
    kept = [r for r in earlier["rows"] if r.get("case") not in cases]
    rec.record["rows"] = kept
    peers = earlier["settings"].get("peers")
    rec.record["notes"] = earlier["notes"] + [
        f"{len(kept)} rows kept from the result of {earlier['date']} (commit "
        f"{earlier['commit']}), cases {sorted({r['case'] for r in kept})}"
        + (f", peers {peers}" if peers and peers != rec.record["settings"].get("peers") else "")]
    # The earlier settings list the cases it meant to run; keep those it has rows of.
    old = [c for c in earlier["settings"].get("cases", [])
           if any(all(r.get(k) == v for k, v in c.items()) for r in kept)]
    if "cases" in rec.record["settings"]:
      rec.record["settings"]["cases"] = old + rec.record["settings"]["cases"]
    rec.save()
    measure(args, rec)

  return measure_after_earlier


def markdown(columns: list[str], lines: list[list]) -> str:
  """A markdown table; floats to 4 significant digits, None as a blank."""
  def cell(x):
    if x is None:
      return ""
    if isinstance(x, float):
      return f"{x:.4g}"
    return str(x)
  out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  out += ["| " + " | ".join(cell(x) for x in line) + " |" for line in lines]
  return "\n".join(out)


def phase_bars(record: dict, path, sides: tuple[str, ...], title: Callable[[str], str],
               annotate: Callable[[dict, str, str], list] | None = None,
               note_size: int = 7) -> None:
  """Two panels, forward and forward + backward: for every case a group of bars, the median ms
  of each of `sides` (log scale). `title(phase)` heads a panel; `annotate(by, case, phase)`, with
  `by` the rows by (case, side, phase), lists the (side, y, text) written above a bar (side None:
  the group's centre)."""
  import numpy as np

  plt = pyplot()
  by = {(r["case"], r["side"], r["phase"]): r for r in record["rows"]}
  cases = list(dict.fromkeys(r["case"] for r in record["rows"]))
  fig, axes = plt.subplots(1, 2, figsize=(max(10, 1.3 * len(cases) + 4), 4.8))
  width = 0.8 / len(sides)
  offset = {side: (j - (len(sides) - 1) / 2) * width for j, side in enumerate(sides)}
  x = np.arange(len(cases))
  for ax, phase in zip(axes, ("fwd", "fwd+bwd")):
    for side in sides:
      ms = [by.get((case, side, phase), {}).get("ms") or np.nan for case in cases]
      ax.bar(x + offset[side], ms, width, label=side)
    for i, case in enumerate(cases):
      for side, y, text in (annotate(by, case, phase) if annotate else []):
        ax.annotate(text, (i + offset.get(side, 0.0), y), textcoords="offset points",
                    xytext=(0, 3), fontsize=note_size, ha="center")
    ax.set_yscale("log")
    ax.set_ylim(bottom=bar_floor(r.get("ms") for r in by.values()))
    ax.set_xticks(x)
    ax.set_xticklabels(cases, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("ms (median, log)")
    ax.set_title(title(phase), fontsize=9)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def ratio_notes(sides: tuple[str, ...], key: str,
                spec: str) -> Callable[[dict, str, str], Iterator]:
  """A `phase_bars` annotate: above each of `sides`' bars, its row's `key` (where set) formatted
  with `spec`, then "x"."""
  def annotate(by, case, phase):
    for side in sides:
      row = by.get((case, side, phase), {})
      if row.get(key):
        yield side, row["ms"], f"{row[key]:{spec}}x"
  return annotate


def phase_table(record: dict, sides: tuple[str, ...],
                ratios: list[tuple[str, str, str]]) -> str:
  """A markdown table of a forward / forward + backward suite: a line per case; for each phase,
  every side's median ms ("refused" where the side refused the case), then each ratio, given as
  (column label, side, the row's key)."""
  by = {(r["case"], r["side"], r["phase"]): r for r in record["rows"]}
  cases = list(dict.fromkeys(r["case"] for r in record["rows"]))

  def cell(case, side, phase):
    row = by.get((case, side, phase), {})
    return "refused" if row.get("refused") else row.get("ms")

  cols, body = ["case"], []
  for phase in ("fwd", "fwd+bwd"):
    cols += [f"{side} {phase} ms" for side in sides] + [f"{label} {phase}" for label, *_ in ratios]
  for case in cases:
    line = [case]
    for phase in ("fwd", "fwd+bwd"):
      line += [cell(case, side, phase) for side in sides]
      line += [by.get((case, side, phase), {}).get(key) for _, side, key in ratios]
    body.append(line)
  return markdown(cols, body)


def with_goals(record: dict, text: str) -> str:
  """`text` followed by a table of the record's goal rows ({"goal", "value", "target", "met"}),
  where it has any."""
  goals = [[g["goal"], g["value"], g["target"], {True: "yes", False: "NO"}.get(g["met"], "n/a")]
           for g in record["rows"] if "goal" in g]
  if not goals:
    return text
  return text + "\n\n" + markdown(["goal", "value", "target", "met"], goals)


def bar_floor(values) -> float | None:
  """A log axis' lower limit that leaves the shortest bar visible (a third of it)."""
  ms = [v for v in values if isinstance(v, (int, float)) and v > 0]
  return min(ms) / 3 if ms else None


def pyplot():
  """matplotlib's pyplot on the file-only Agg backend."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt
