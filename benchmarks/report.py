"""The figures tables of README.md and WORKSPACE.md, generated from `benchmarks/results/`.

Every figure in the two tables is read from a committed result (`<name>.json`, the layout of
`_record.py`; the evaluations' `evals/<run>/eval.json`), and every row names the date, device and
commit that produced it. The tables sit between marker comments in each document:

  <!-- figures:begin -->
  | benchmark | setting | figures | date, device, commit |
  ...
  <!-- figures:end -->

    python -m benchmarks.report            # rewrite both tables from the results
    python -m benchmarks.report --check    # exit 1 where a committed table differs

WORKSPACE.md gets a row per result; README.md the headline rows (`README_ROWS`). A result file
that a row needs and the folder lacks fails loudly (but for a benchmark that has not run yet,
`PENDING`, whose row says so); so does a row whose figures are missing.
Reads JSON only: no jax, no GPU (`tests/test_report.py` runs the check in CI).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"
HEADER = ("| benchmark | setting | figures | date, device, commit |\n"
          "|---|---|---|---|")


# ----------------------------------------------------------------------------- formatting


def num(x: float) -> str:
  """A measurement to three significant digits (thousands with a comma)."""
  if x >= 1000:
    return f"{x:,.0f}"
  if x >= 100:
    return f"{x:.0f}"
  if x >= 10:
    return f"{x:.1f}"
  return f"{x:.3g}"


def kilo(x: float) -> str:
  """Tokens per second in thousands: 204491.5 -> "204K"."""
  return f"{x / 1000:.1f}K" if x < 100_000 else f"{x / 1000:.0f}K"


def length(n: int) -> str:
  """A sequence length: 131072 -> "128K", 1048576 -> "1M"."""
  return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}K"


def source(record: dict) -> str:
  """The row's provenance: the result's UTC day, device and short commit."""
  commit = record["commit"]
  short = commit[:7] + ("-dirty" if commit.endswith("-dirty") else "")
  return f"{record['date'][:10]}, {record['device']}, {short}"


def rows(record: dict, name: str, **match) -> list[dict]:
  """The result's rows whose fields equal `match`; raises if there are none."""
  found = [r for r in record["rows"] if all(r.get(k) == v for k, v in match.items())]
  if not found:
    raise ValueError(f"{name}: no row with {match}")
  return found


def one(record: dict, name: str, **match) -> dict:
  return rows(record, name, **match)[0]


# ----------------------------------------------------------------------------- one row a result


def selection(r: dict) -> tuple[str, str]:
  s = r["settings"]
  setting = (f"{s['hq']}/{s['hkv']} heads, d{s['d']}, C{s['block_size']}, K{s['top_k']}, "
             f"{s['dtype']} (Table 4)")
  def case(x):  # rows written before the wide-budget cases are all at the settings' d and K
    return x.get("d", s["d"]), x.get("top_k", s["top_k"])

  table4 = (s["d"], s["top_k"])
  parts = []
  for row in rows(r, "selection", side="pisa-jax", selector="pisa"):
    if case(row) != table4 or row["beam"] != s["top_k"]:
      continue
    fla = [x for x in r["rows"] if x["n"] == row["n"] and x["side"] == "fla" and case(x) == table4]
    peer = f" / {num(fla[0]['ms'])} ({num(fla[0]['x_pisa'])}x)" if fla else ""
    parts.append(f"{length(row['n'])} {num(row['ms'])}{peer}")
  text = "PISA ms / fla NSA top-k ms (x): " + " · ".join(parts)
  wide = [x for x in r["rows"] if "x_k8" in x and x["selector"] == "pisa"]
  if wide:
    text += f"; wider K over K{s['top_k']}, time: " + " · ".join(
        f"{length(x['n'])} d{x['d']} K{x['top_k']} {num(x['x_k8'])}x" for x in wide)
  return setting, text


def attention(name: str) -> Callable[[dict], tuple[str, str]]:
  """Sparse attention (one of the `attention*` results): each case's forward and forward +
  backward, with every peer as a multiple of ours."""

  def summary(r: dict) -> tuple[str, str]:
    s = r["settings"]
    setting = f"{s['dtype']}, C{s['block_size']}, {s['indices']} indices"
    cases = []
    for case in dict.fromkeys(x["case"] for x in r["rows"]):
      phases = []
      for phase in ("fwd", "fwd+bwd"):
        ours = one(r, name, case=case, side="pisa-jax", phase=phase)
        peers = [f"{x['side']} {num(x['x_ours'])}x" for x in r["rows"]
                 if x["case"] == case and x["phase"] == phase and x["side"] != "pisa-jax"]
        phases.append(f"{phase} {num(ours['ms'])}" + (f" ({', '.join(peers)})" if peers else ""))
      cases.append(f"{case}: " + ", ".join(phases))
    return setting, "ms: " + "; ".join(cases)

  return summary


def layer(r: dict) -> tuple[str, str]:
  s = r["settings"]
  cases = []
  for case in dict.fromkeys(x["case"] for x in r["rows"]):
    ours = one(r, "layer", case=case, side="pisa layer", phase="fwd+bwd")
    dense = one(r, "layer", case=case, side="cudnn dense", phase="fwd+bwd")
    cases.append(f"{case} {num(ours['ms'])} vs {num(dense['ms'])} "
                 f"({num(ours['speedup_vs_dense'])}x)")
  return (f"selection + attention, {s['dtype']}, g{s['branching']}",
          "fwd+bwd ms, PISA layer vs cuDNN dense: " + "; ".join(cases))


def nsa(r: dict) -> tuple[str, str]:
  s = r["settings"]
  cases = []
  for case in dict.fromkeys(x["case"] for x in r["rows"]):
    ours = one(r, "nsa", case=case, side="nsa", phase="fwd+bwd")
    peers = []
    for side in ("fla nsa", "pisa layer", "cudnn dense"):
      found = [x for x in r["rows"] if x["case"] == case and x["side"] == side
               and x["phase"] == "fwd+bwd"]
      if found and found[0].get("refused"):
        peers.append(f"{side} refused")
      elif found and "ms" in found[0]:
        peers.append(f"{side} {num(found[0]['x_ours'])}x")
    cases.append(f"{case} {num(ours['ms'])}" + (f" ({', '.join(peers)})" if peers else ""))
  return (f"mean compression, l = d = l' = {s['block_length']}, n {s['top_n']}, "
          f"w {s['window']}, {s['dtype']}",
          "fwd+bwd ms of our NSA layer (a peer's time over ours): " + "; ".join(cases))
def hils(r: dict) -> tuple[str, str]:
  s = r["settings"]
  h = s["hils"]
  cases = []
  for case in dict.fromkeys(x["case"] for x in r["rows"]):
    phases = []
    for phase in ("fwd", "fwd+bwd"):
      ours = one(r, "hils", case=case, side="hils layer", phase=phase)
      peers = [f"{x['side'].split()[0]} {num(x['x_hils'])}x" for x in r["rows"]
               if x["case"] == case and x["phase"] == phase and x["side"] != "hils layer"
               and "x_hils" in x]
      phases.append(f"{phase} {num(ours['ms'])}" + (f" ({', '.join(peers)})" if peers else ""))
    cases.append(f"{case}: " + ", ".join(phases))
  return (f"{s['dtype']}, C{h['chunk_size']} K{h['top_k']} W{h['window']}; PISA K"
          f"{s['pisa']['top_k']}; NSA's defaults",
          "HiLS layer ms (each peer's time over HiLS's): " + "; ".join(cases))


def packed(r: dict) -> tuple[str, str]:
  s = r["settings"]
  cases = []
  for case in dict.fromkeys(x["case"] for x in r["rows"]):
    stages = []
    for side in ("pisa-jax", "fla"):
      for stage in ("selection", "attention fwd", "attention fwd+bwd"):
        found = [x for x in r["rows"] if x["case"] == case and x["side"] == side
                 and x["stage"] == stage and x["layout"] == "packed"]
        if found:
          label = stage.replace("attention ", "") if side == "pisa-jax" else f"fla {stage}"
          stages.append(f"{label} {num(found[0]['ms'])} ({num(found[0]['x_unpacked'])}x)")
    cases.append(f"{case}: " + ", ".join(stages))
  return (f"{length(s['total'])} of {length(s['min_doc'])}-{length(s['max_doc'])} documents",
          "packed ms (x one unpacked row): " + "; ".join(cases))


def decode(r: dict) -> tuple[str, str]:
  s = r["settings"]
  steps = []
  heads = dict.fromkeys((x["d"], x["top_k"]) for x in r["rows"] if x["part"] == "step")
  for d, top_k in heads:
    for batch in dict.fromkeys(x["batch"] for x in r["rows"] if x["part"] == "step"):
      ours = rows(r, "decode", part="step", side="pisa-jax", d=d, top_k=top_k, batch=batch)
      dense = one(r, "decode", part="step", side="dense", d=d, top_k=top_k, batch=batch,
                  n=ours[-1]["n"])
      by_n = " · ".join(f"{length(x['n'])} {num(x['loop_ms'])}" for x in ours)
      steps.append(f"d{d} K{top_k} B={batch}: {by_n} (dense at {length(ours[-1]['n'])} "
                   f"{num(dense['loop_ms'])}, {num(dense['loop_ms'] / ours[-1]['loop_ms'])}x)")
  text = "step ms in a jitted loop: " + "; ".join(steps)
  bf16 = []
  for x in r["rows"]:
    if x["part"] == "step" and x.get("side") == "pisa-jax bf16" and x.get("loop_ms"):
      dense = one(r, "decode", part="step", side="dense", d=x["d"], top_k=x["top_k"],
                  batch=x["batch"], n=x["n"])
      bf16.append(f"d{x['d']} K{x['top_k']} B={x['batch']} {length(x['n'])} "
                  f"{num(x['loop_ms'])} ({num(dense['loop_ms'] / x['loop_ms'])}x dense)")
  if bf16:
    text += ". bfloat16 pyramid, in a jitted loop: " + "; ".join(bf16)
  generation = [x for x in r["rows"] if x["part"] == "generation"]
  if generation:
    gen = [f"{x['attention']} {length(x['prompt'])} {num(x['tokens_per_s'])} tokens/s "
           f"(first token {num(x['first_token_s'])} s)" for x in generation
           if x["steps_per_call"] == max(g["steps_per_call"] for g in generation)]
    calls = max(g["steps_per_call"] for g in generation)
    text += (f". Generation (`{generation[0]['preset']}`, B={generation[0]['batch']}, {calls} "
             f"steps a call): " + ", ".join(gen))
  return f"{s['dtype']}, selector {s['selector']}, 32/2 heads", text


def summary_dtype(r: dict) -> tuple[str, str]:
  cases = []
  for x in r["rows"]:
    if x["summary_dtype"] != "bfloat16":
      continue
    f32 = one(r, "summary_dtype", qk=x["qk"], source=x["source"], seq_len=x["seq_len"],
              top_k=x["top_k"], summary_dtype="float32")
    same = ("n/a (no row chooses)" if x["identical_rows"] is None
            else f"{100 * x['identical_rows']:.1f}%")
    cases.append(f"{x['qk']} {length(x['seq_len'])} K{x['top_k']}: identical rows "
                 f"{same}, Recall@K {100 * f32['recall']:.1f} / "
                 f"{100 * x['recall']:.1f} ({x['recall_delta_points']:+.2f} points), captured "
                 f"mass {100 * f32['captured_mass']:.1f} / {100 * x['captured_mass']:.1f}")
  sources = ", ".join(dict.fromkeys(x["source"] for x in r["rows"]))
  return (f"pisa, C{r['settings']['block_size']}, q/k: {sources}",
          "float32 / bfloat16 pyramid: " + "; ".join(cases))


def ceilings(r: dict) -> tuple[str, str]:
  walk = [x for x in r["rows"] if x["part"] == "walk floor"]
  floors = {}
  for x in walk:
    floors.setdefault(x["variant"], []).append(x["us_per_level"])
  walk_text = ", ".join(f"{v} {num(min(u))}-{num(max(u))}" if len(u) > 1 else f"{v} {num(u[0])}"
                        for v, u in floors.items())
  tiles = []
  for d in (64, 128):
    for phase in ("fwd", "fwd+bwd"):
      found = [x for x in r["rows"] if x["part"] == "tile ceiling" and x["kind"] == "tile"
               and x["d"] == d and x["phase"] == phase]
      if found:
        spans = []
        for side in ("cudnn", "mosaic"):
          t = [x["tflops"] for x in found if x["side"] == side]
          spans.append(f"{num(min(t))}-{num(max(t))}")
        tiles.append(f"d{d} {phase} {' / '.join(spans)}")
  return ("walk level: d128, 64 candidates' summaries; dense tiles of 64 rows",
          f"walk floor us a level: {walk_text}; tile TFLOP/s cuDNN / Mosaic: " + ", ".join(tiles))


def training(r: dict) -> tuple[str, str]:
  s = r["settings"]
  runs = [f"{x['attention']} {kilo(x['tokens_per_s'])} tokens/s (loss {x['final_loss']:.2f})"
          for x in r["rows"]]
  return (f"`{s['preset']}`, {s['tokens_per_step'] // 1024}K tokens a step, "
          f"{length(r['rows'][0]['seq_len'])}, {num(s['seconds'])} s runs", ", ".join(runs))


def long_context(r: dict) -> tuple[str, str]:
  s = r["settings"]
  parts = []
  for attention_kind in ("pisa", "dense"):
    timed = [x for x in r["rows"] if x.get("attention") == attention_kind and "tokens_per_s" in x]
    parts.append(f"{attention_kind}: " + " · ".join(
        f"{length(x['seq_len'])} {kilo(x['tokens_per_s'])}" for x in timed))
  peak = max((x for x in r["rows"] if x.get("attention") == "pisa" and "tokens_per_s" in x),
             key=lambda x: x["seq_len"])
  return (f"`{s['preset']}`, batch 1",
          "tokens/s, " + "; ".join(parts) + f"; PISA peak at {length(peak['seq_len'])} "
          f"{num(peak['allocator_peak_gib'])} GiB")


def context_parallel(r: dict) -> tuple[str, str]:
  s = r["settings"]
  run = one(r, "context_parallel", context_parallel=1)
  shards = [x for x in r["rows"] if "shard" in x]
  text = (f"{length(run['seq_len'])} on {run['devices']} GPU: {kilo(run['tokens_per_s'])} "
          f"tokens/s, peak {num(max(run['allocator_peak_gib_per_device_since_start']))} GiB")
  if shards:
    text += "; a shard's layer fwd+bwd vs the fastest: " + ", ".join(
        f"shard {x['shard']} {num(x['vs_fastest'])}x" for x in shards)
  return f"`{s['preset']}`", text


def pretrained(r: dict) -> tuple[str, str]:
  """Training-free variants (perplexity at the longest length, NIAH average), Recall@K at the
  smallest K, and continued pretraining before -> after."""
  s, rows = r["settings"], r["rows"]
  parts = []
  ppl = [x for x in rows if x["part"] == "ppl"]
  if ppl:
    longest = max(x["length"] for x in ppl)
    niah = {x["variant"]: x["score"] for x in rows
            if x["part"] == "ruler" and x["length"] == "average"}
    parts.append(f"ppl {length(longest)} / NIAH avg: " + ", ".join(
        f"{x['variant']} {num(x['ppl'])} / {num(niah[x['variant']])}" for x in ppl
        if x["length"] == longest))
  chosen = [x for x in rows if x["part"] == "selection"]
  if chosen:
    top_k, at = min(x["top_k"] for x in chosen), max(x["length"] for x in chosen)
    parts.append(f"Recall@{top_k} % at {length(at)}: " + ", ".join(
        f"{x['selector']}" + (f" beam {x['beam']}" if x["beam"] != x["top_k"] else "")
        + f" {100 * x['recall']:.1f}" for x in chosen
        if x["top_k"] == top_k and x["length"] == at))
  for trained in (x for x in rows if x["part"] == "cpt-train"):
    cpt = [x for x in rows if x["part"] == "cpt" and x["variant"] == trained["variant"]]
    at = max(x["length"] for x in cpt if x["metric"] == "ppl")

    def value(stage, metric, n):
      return one({"rows": cpt}, "pretrained", stage=stage, metric=metric, length=n)["value"]

    parts.append(f"CPT {trained['variant']} ({trained['steps']} steps at "
                 f"{length(s['cpt_seq_len'])}): ppl {length(at)} {num(value('before', 'ppl', at))}"
                 f" -> {num(value('after', 'ppl', at))}, NIAH avg "
                 f"{num(value('before', 'niah', 'average'))} -> "
                 f"{num(value('after', 'niah', 'average'))}")
  return f"{Path(s['model']).name}, C{s['block_size']}", "; ".join(parts)


def evaluation(name: str) -> Callable[[dict], tuple[str, str]]:
  """A pisa-eval run: perplexity by length and Recall@K of each selector."""

  def summary(r: dict) -> tuple[str, str]:
    parts = r["parts"]
    ppl = " · ".join(f"{length(x['length'])} {num(x['ppl'])}" for x in parts["ppl"]["rows"])
    longest = max(x["length"] for x in parts["selection"]["rows"])
    recall = ", ".join(
        f"{x['selector']}" + (f" beam {x['beam']}" if x["beam"] != x["top_k"] else "")
        + f" {100 * x['recall']:.1f}"
        for x in parts["selection"]["rows"] if x["length"] == longest)
    model = r["config"]["model"]
    top_k = parts["selection"]["rows"][0]["top_k"]
    return (f"`{name}`: {model['attention']}, step {r['checkpoint']['step']}",
            f"ppl {ppl}; Recall@{top_k} % at {length(longest)}: {recall}")

  return summary


def generation(r: dict) -> tuple[str, str]:
  """Per preset: tokens/s of PISA against dense at each B and L, the warm time to the first
  token and the cache a row at the longest L; then the 1M prompt's first token."""
  measured = [x for x in r["rows"] if "case" in x and not x.get("error")]
  parts = []
  for preset in dict.fromkeys(x["preset"] for x in measured):
    mine = [x for x in measured if x["preset"] == preset]
    by = {(x["attention"], x["batch"], x["length"], x.get("prefill_chunk")): x for x in mine}
    speeds = []
    for x in mine:
      if x["attention"] != "pisa" or x["length"] >= 1 << 20 or not x.get("tokens_per_s"):
        continue
      dense = by.get(("dense", x["batch"], x["length"], x.get("prefill_chunk")), {})
      text = f"B={x['batch']} {length(x['length'])} {num(x['tokens_per_s'])}"
      if dense.get("tokens_per_s"):
        text += f" ({num(x['tokens_per_s'] / dense['tokens_per_s'])}x dense)"
      speeds.append(text)
    text = f"`{preset}` tokens/s: " + " · ".join(speeds)
    longest = max((x for x in mine if x["attention"] == "pisa" and x["batch"] == 1
                   and x.get("prefill_warm_s")
                   and not x.get("prefill_chunk")), key=lambda x: x["length"], default=None)
    if longest:
      dense = by.get(("dense", 1, longest["length"], None), {})
      text += (f"; first token warm at {length(longest['length'])}: pisa "
               f"{num(longest['prefill_warm_s'])} s" + (
                   f", dense {num(dense['prefill_warm_s'])} s" if dense.get("prefill_warm_s")
                   else ""))
      text += f", cache {num(longest['cache_mib_per_row'])} MiB a row"
    million = [x for x in mine if x["length"] == 1 << 20 and x["attention"] == "pisa"
               and x.get("prefill_chunk")]
    for x in million:
      text += (f"; 1M in {length(x['prefill_chunk'])} chunks: first token "
               f"{num(x['first_token_cold_s'])} s cold, {num(x['prefill_warm_s'])} s warm")
      dense = by.get(("dense", 1, 1 << 20, None), {})
      if dense.get("first_token_cold_s"):
        text += f" (dense one pass {num(dense['first_token_cold_s'])} s cold)"
    parts.append(text)
  s = r["settings"]
  return (f"random weights, ragged B rows, {s['new_tokens']} new tokens, greedy",
          "; ".join(parts))


# (row name, result file under benchmarks/results, summary)
ROWS: list[tuple[str, str, Callable[[dict], tuple[str, str]]]] = [
    ("selection", "selection.json", selection),
    ("attention", "attention.json", attention("attention")),
    ("attention, PISA's indices", "attention_pisa.json", attention("attention_pisa")),
    ("attention, a trained model's indices", "attention_real.json",
     attention("attention_real")),
    ("layer", "layer.json", layer),
    ("NSA layer", "nsa.json", nsa),
    ("HiLS layer", "hils.json", hils),
    ("packed documents", "packed.json", packed),
    ("decode", "decode.json", decode),
    ("generation", "generation.json", generation),
    ("bfloat16 pyramid", "summary_dtype.json", summary_dtype),
    ("ceilings", "ceilings.json", ceilings),
    ("training", "training.json", training),
    ("long context training", "long_context_training.json", long_context),
    ("context parallel", "context_parallel.json", context_parallel),
    ("evaluation, dense", "evals/dense-4096/eval.json", evaluation("dense-4096")),
    ("evaluation, PISA", "evals/pisa-4096/eval.json", evaluation("pisa-4096")),
    ("pretrained model", "pretrained.json", pretrained),
]
# Rows whose benchmark has not run yet: the table says so, with the command, until its result is
# committed (every other row's missing result is an error). A row leaves this with its result.
PENDING = {"generation": "not yet measured: `python -m benchmarks.generation --list` on a GPU "
                         "gives the calls",
           "pretrained model": "not yet measured: `python -m benchmarks.pretrained` on a GPU "
                               "(its docstring gives the calls)",
           "bfloat16 pyramid": "not yet measured: `python -m benchmarks.summary_dtype` on a "
                               "trained run's q/k (its docstring gives the calls)"}
README_ROWS = ("selection", "attention", "layer", "NSA layer", "HiLS layer", "packed documents",
               "decode", "generation", "training", "long context training")


def table(names, results: Path = RESULTS) -> str:
  """The markdown table of the rows `names`, read from `results`."""
  lines = [HEADER]
  for name, filename, summary in ROWS:
    if name not in names:
      continue
    path = results / filename
    if not path.exists() and name in PENDING:
      lines.append(f"| {name} | | {PENDING[name]} | |")
      continue
    if not path.exists():
      raise FileNotFoundError(f"{path}: the {name!r} row reads it (rerun its benchmark)")
    record = json.loads(path.read_text())
    setting, figures = summary(record)
    lines.append(f"| {name} | {setting} | {figures} | {source(record)} |")
  return "\n".join(lines)


DOCUMENTS = {"README.md": README_ROWS, "WORKSPACE.md": tuple(name for name, _, _ in ROWS)}


def replace_table(text: str, new_table: str, document: str) -> str:
  """`text` with the table between the markers replaced; raises if the markers are missing."""
  if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
    raise ValueError(f"{document} must hold one {BEGIN} ... {END} pair")
  head, rest = text.split(BEGIN)
  _, tail = rest.split(END)
  return f"{head}{BEGIN}\n{new_table}\n{END}{tail}"


def stale(root: Path = ROOT, results: Path = RESULTS) -> list[str]:
  """The documents whose committed table differs from what `results` give."""
  return [doc for doc, names in DOCUMENTS.items()
          if (text := (root / doc).read_text()) != replace_table(text, table(names, results), doc)]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--check", action="store_true",
                      help="change nothing; exit 1 where a table differs from the results")
  args = parser.parse_args(argv)
  if args.check:
    differ = stale()
    for doc in differ:
      print(f"{doc}: its figures table differs from benchmarks/results "
            "(python -m benchmarks.report rewrites it)")
    return 1 if differ else 0
  for doc, names in DOCUMENTS.items():
    path = ROOT / doc
    path.write_text(replace_table(path.read_text(), table(names), doc))
    print(f"wrote the figures table of {doc}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
