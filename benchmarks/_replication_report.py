"""summary.md, the plots and README's results block of `benchmarks.replication`, made from the
run JSONs alone (no GPU): the paper's Tables 2, 3, 6 and 7 with our numbers beside the paper's,
and each of the paper's claims marked reproduced, not reproduced, not testable at this scale, or
pending (a run it needs is missing).

Numbers over seeds are the mean and, with two or more seeds, +- half their range. A comparison
between methods counts as reproduced only when the difference is larger than the seed noise: the
largest range over seeds that any method shows for that number (one seed everywhere: the sign
decides, and the claim says the spread is unknown).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from benchmarks import _record

REPRODUCED, NOT_REPRODUCED = "reproduced", "not reproduced"
UNTESTABLE, PENDING = "not testable at this scale", "pending"
LABELS = {"dense": "Full attention", "nsa": "NSA", "hils": "HiLS", "bsa": "BSA",
          "pisa1": "PISA-1", "pisa2": "PISA-2", "pisa": "PISA"}
COLORS = {"dense": "black", "nsa": "tab:purple", "hils": "tab:brown", "bsa": "tab:red",
          "pisa1": "tab:orange", "pisa2": "tab:green", "pisa": "tab:blue"}
FAMILIES = ("single_key", "multi_key", "multi_query", "multi_value")
SELECTORS = ("bsa", "pisa1", "pisa2", "pisa")
README_BEGIN, README_END = "<!-- replication:begin -->", "<!-- replication:end -->"

# The paper's numbers. Table 2 (418M, after 100B tokens at 4K): loss, WikiText ppl, LAMBADA ppl,
# multiple-choice average (Acc-8), containment average.
PAPER_T2 = {
    "dense": (2.5557, 20.40, 25.60, 49.11, 45.15), "nsa": (2.5727, 21.46, 26.13, 49.93, 37.46),
    "hils": (2.5596, 20.83, 26.67, 50.42, 40.79), "bsa": (2.5684, 21.47, 25.02, 49.63, 38.18),
    "pisa1": (2.5683, 21.53, 24.94, 49.36, 39.24), "pisa2": (2.5663, 21.31, 24.78, 49.74, 40.97),
    "pisa": (2.5630, 21.17, 24.91, 50.52, 41.77),
}
# Table 3 (2.67B after 10B tokens of CPT at 16K): per family the scores at 1K, 2K, 4K, 8K, 16K,
# then the average.
PAPER_T3 = {
    "dense": ((99.67, 99.60, 99.47, 99.13, 98.80), (43.33, 38.40, 34.67, 28.00, 23.13),
              (85.60, 72.45, 50.05, 51.55, 34.85), (90.15, 84.55, 77.05, 57.10, 57.20), 66.24),
    "nsa": ((99.93, 99.53, 99.33, 97.47, 91.67), (57.47, 52.00, 40.67, 18.00, 15.20),
            (72.60, 79.85, 32.65, 50.10, 24.20), (83.80, 69.55, 59.85, 48.65, 28.90), 61.07),
    "bsa": ((99.20, 98.40, 93.60, 85.33, 59.67), (37.33, 32.20, 20.87, 13.40, 7.13),
            (80.75, 69.85, 66.85, 37.90, 15.10), (83.80, 75.15, 63.45, 38.15, 21.70), 54.99),
    "pisa1": ((99.87, 99.73, 97.33, 81.87, 60.27), (66.80, 53.40, 39.40, 12.60, 9.93),
              (93.40, 89.90, 73.75, 38.50, 21.70), (83.30, 82.95, 70.50, 38.15, 20.45), 61.69),
    "pisa2": ((99.47, 99.33, 99.00, 90.00, 72.40), (51.13, 40.00, 27.20, 13.13, 9.33),
              (91.45, 86.95, 77.85, 59.55, 25.20), (89.60, 81.25, 69.60, 52.55, 23.30), 62.92),
    "pisa": ((99.07, 94.60, 96.33, 91.47, 71.27), (68.20, 52.33, 32.47, 13.53, 10.00),
             (88.65, 85.35, 79.00, 48.50, 20.85), (93.40, 87.10, 58.60, 43.95, 21.30), 62.80),
}
PAPER_T3_LENGTHS = (1024, 2048, 4096, 8192, 16384)
# Table 6 (after 10B tokens of CPT at 16K): loss and average ppl at 1.47B, then at 2.67B.
PAPER_T6 = {
    "dense": (1.6993, 11.69, 1.6312, 10.04), "nsa": (1.6990, 11.55, 1.6243, 9.73),
    "bsa": (1.7039, 11.64, 1.6324, 9.95), "pisa1": (1.7042, 11.70, 1.6331, 10.00),
    "pisa2": (1.7007, 11.59, 1.6302, 9.91), "pisa": (1.7010, 11.68, 1.6297, 9.91),
}
# Table 7 (418M dense q/k, C = 64, K = 8): Recall@8, captured mass, mass ratio, in percent.
PAPER_T7 = {"bsa": (85.91, 85.67, 98.42), "pisa1": (84.75, 85.50, 98.22),
            "pisa2": (88.24, 86.13, 99.02), "pisa": (90.95, 86.47, 99.46)}


# ----------------------------------------------------------------------------- results


def truncated_stages(record: dict) -> list[str]:
  """The stages of a run's record that stopped at their max_seconds before their last step."""
  return [row["stage"] for row in record.get("rows", []) if row.get("truncated")]


class Results:
  """The complete results made from this manifest's settings, by method; the rest aside."""

  def __init__(self, manifest, folder: Path):
    self.manifest = manifest
    self.by_method: dict[str, list[dict]] = defaultdict(list)
    self.aside: list[tuple[str, str]] = []
    for path in sorted(folder.glob("*.json")):
      try:
        record = _record.load(path)
      except (ValueError, OSError):
        continue
      if record.get("benchmark") != "replication":
        continue
      if record.get("fingerprint") != manifest.fingerprint(record.get("method")):
        self.aside.append((path.name, f"made from other settings (fingerprint "
                                      f"{record.get('fingerprint')})"))
      elif record.get("status") != "complete":
        self.aside.append((path.name, f"status {record.get('status')}: "
                                      f"{'; '.join(record.get('notes', []))[:200]}"))
      elif truncated := truncated_stages(record):
        self.aside.append((path.name, f"stage {', '.join(truncated)} stopped at its max_seconds "
                                      f"before its last step: not comparable"))
      else:
        self.by_method[record["method"]].append(record)
    for records in self.by_method.values():
      records.sort(key=lambda r: r["seed"])

  @property
  def methods(self) -> list[str]:
    return [name for name, _ in self.manifest.methods]

  def stage_rows(self, method: str, stage: str | None) -> list[dict]:
    if stage is None:
      return []
    return [row for r in self.by_method.get(method, []) for row in r["rows"]
            if row["stage"] == stage]

  def values(self, method: str, stage: str | None, get) -> list[float]:
    """`get(row)` for each seed's row of `stage` where it is not None, in seed order."""
    return list(self.by_seed(method, stage, get).values())

  def by_seed(self, method: str, stage: str | None, get) -> dict[int, float]:
    """`get(row)` of each seed's row of `stage`, keyed by seed, where it is not None."""
    out = {}
    for record in self.by_method.get(method, []):
      for row in record["rows"]:
        if row["stage"] != stage:
          continue
        try:
          value = get(row)
        except (KeyError, StopIteration, TypeError):
          value = None
        if value is not None:
          out[record["seed"]] = float(value)
    return out

  def paired_noise(self, stage: str | None, get) -> float | None:
    """The largest range over seeds of one method's value less another's on the same seed, over
    the pairs of methods that share two or more seeds; None where no pair does. A seed fixes the
    data order and the initialisation, which differ between seeds and not between methods: the
    noise of a same-seed difference is far below that of a single method's value."""
    values = {m: self.by_seed(m, stage, get) for m in self.methods}
    spreads = []
    for i, a in enumerate(self.methods):
      for b in self.methods[i + 1:]:
        common = sorted(set(values[a]) & set(values[b]))
        if len(common) > 1:
          diffs = [values[a][s] - values[b][s] for s in common]
          spreads.append(max(diffs) - min(diffs))
    return max(spreads) if spreads else None

  def noise(self, stage: str | None, get) -> float | None:
    """The largest range over seeds of `get` among the methods with two or more seeds."""
    spreads = [max(v) - min(v) for v in (self.values(m, stage, get) for m in self.methods)
               if len(v) > 1]
    return max(spreads) if spreads else None


def final_loss(row):
  return row["final_loss"]


def mixture_accuracy(family: str, length: int):
  return lambda row: next(r["accuracy"] for r in row["eval"]["mixture"]["rows"]
                          if r["family"] == family and r["length"] == length)


def ppl_at(length):
  return lambda row: next(r["ppl"] for r in row["eval"]["ppl"]["rows"] if r["length"] == length)


def ruler_cell(family, length):
  return lambda row: next(r["score"] for r in row["eval"]["ruler"]["families"]
                          if r["family"] == family and r["length"] == length)


def ruler_answer_hit(family, length):
  """The share of `family`'s samples at `length` whose answer the model ranks first token by
  token after RULER's answer prefix (None for runs evaluated without answer scores)."""
  return lambda row: next((r["hit"] for r in row["eval"]["ruler"].get("answer_scores", ())
                           if r["family"] == family and r["length"] == length), None)


def ruler_average(row):
  return row["eval"]["ruler"]["average"]


def single_key_short(row):
  """Single-key accuracy averaged over the evaluated lengths up to 4K (the 80% bar of
  `_retrieval_gate`)."""
  cells = [r["score"] for r in row["eval"]["ruler"]["families"]
           if r["family"] == "single_key" and r["length"] <= 4096]
  return sum(cells) / len(cells) if cells else None


def selection_metric(selector, metric, beam_factor=1):
  def get(row):
    part = row["eval"]["selection"]
    length, top_k = max(r["length"] for r in part["rows"]), part["top_k"][0]
    beam = top_k * beam_factor
    return next(r[metric] for r in part["rows"] if r["length"] == length
                and r["top_k"] == top_k and r["selector"] == selector and r["beam"] == beam)
  return get


def fmt(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
  if not values:
    return "pending"
  mean = sum(values) / len(values) * scale
  text = f"{mean:.{digits}f}"
  if len(values) > 1:
    text += f" ±{(max(values) - min(values)) / 2 * scale:.{digits}f}"
  return text


def span(n: int) -> str:
  """A length as the paper writes it: 1K, 16K; 256 stays 256."""
  return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def mean(values):
  return sum(values) / len(values) if values else None


# ----------------------------------------------------------------------------- tables


def setup_section(res: Results) -> str:
  m = res.manifest
  b, d = m.backbone, m.data
  lines = [
      f"Manifest `{m.path.name}`. Backbone: {b['num_layers']} "
      f"layers, d {b['d_model']}, MLP {b['mlp_dim']}, {b['num_heads']} query / "
      f"{b['num_kv_heads']} KV heads of {b['head_dim']}, C = {b['block_size']}, GPT-2 "
      f"vocabulary. Text: `{d['text']}` ({', '.join(d['text_corpora']) or 'as prepared'}); "
      f"needle haystack: `{d['haystack']}` ({', '.join(d['haystack_corpora']) or 'as prepared'})"
      + (f", the text's in {100 * d['retrieval_text_share']:.0f}% of the documents"
         if d.get("retrieval_text_share") else "") + ";"
      f" {100 * d['retrieval_fraction']:.0f}% of each batch's rows are needle documents "
      f"(at least {d['retrieval_min_length']} tokens).", "",
  ]
  rows = []
  for s in m.stages:
    tokens = s.steps * s.batch * s.grad_accum * s.seq_len
    run_rows = [row for rs in res.by_method.values() for r in rs for row in r["rows"]
                if row["stage"] == s.name]
    passes = (f"{mean([r['passes']['text'] for r in run_rows]):.2f} / "
              f"{mean([r['passes']['haystack'] for r in run_rows]):.2f}") if run_rows else ""
    rows.append([s.name, "yes" if s.enabled else "no", ", ".join(s.methods or ["all"]),
                 s.seq_len, s.top_k, f"{s.rope_base:g}", s.steps, s.batch,
                 f"{tokens / 1e6:.3g}M", f"{s.peak_lr:g}",
                 f"{m.data['retrieval_min_length']}-{s.retrieval_max_length or s.seq_len + 1}",
                 passes,
                 "; ".join(f"{k} {','.join(map(str, v))}" for k, v in s.eval.items() if v)])
  lines.append(_record.markdown(
      ["stage", "on", "methods", "seq", "K", "RoPE base", "steps", "batch", "tokens", "peak lr",
       "needle doc tokens", "passes text / haystack", "evaluations"], rows))
  e = m.eval
  lines += ["", f"Evaluation samples: ppl {e['ppl_samples']} windows a length; RULER "
            f"{e['ruler_samples']} a task and length (8 tasks); MQAR {e['mqar_samples']} a cell; "
            f"held-out needle documents {e['mixture_samples']} a family and length; "
            f"selection {e['selection_samples']} windows, K {list(e['selection_top_k'])}, beams "
            f"x{list(e['selection_beam_factors'])}, on {', '.join(e['selection_methods'])}."]
  return "\n".join(lines)


def runs_section(res: Results) -> str:
  rows = []
  for method in res.methods:
    for r in res.by_method.get(method, []):
      stages = "; ".join(
          f"{row['stage']} {row['tokens'] / 1e6:.3g}M tok, {row['train_seconds']:.0f} s train, "
          f"{(row['tokens_per_s'] or 0) / 1e3:.3g}K tok/s" + (" TRUNCATED" if row["truncated"]
                                                              else "")
          for row in r["rows"])
      shared = r.get("shared_device", 1)
      device = r["device"] + (f" (shared by {shared} runs)" if shared > 1 else "")
      # A run resumed from stages trained by an earlier process: its wall time is this one's.
      resumed = any("trained earlier in" in n or "resumed at step" in n
                    for n in r.get("notes", []))
      rows.append([r["run"], device, r["date"][:10], r["commit"][:10],
                   f"{r['wall_seconds']} (resumed)" if resumed else r["wall_seconds"], stages])
  text = _record.markdown(["run", "device", "date", "commit", "wall s", "stages"], rows) \
      if rows else "No run is complete yet."
  if res.aside:
    text += "\n\nNot used: " + "; ".join(f"`{n}` ({why})" for n, why in res.aside)
  return text


def table2(res: Results) -> str:
  stage = res.manifest.summary["pretrain"]
  lengths = _lengths(res, stage, "ppl")
  rows = []
  for method in LABELS:
    if method not in res.methods:
      continue
    params = res.values(method, stage, lambda row: row["params"] / 1e6)
    ours = [fmt(params, digits=1) + "M" if params else "pending",
            fmt(res.values(method, stage, final_loss), digits=4)]
    ours += [fmt(res.values(method, stage, ppl_at(n))) for n in lengths]
    paper = PAPER_T2.get(method)
    rows.append([LABELS[method]] + ours + (_paper_cells(paper, (4, 2, 2, 2, 2)) if paper
                                           else [""] * 5))
  cols = (["Method", "params", "loss"] + [f"ppl {span(n)}" for n in lengths]
          + ["paper loss", "paper Wiki ppl", "paper LMB ppl", "paper Acc-8",
             "paper containment"])
  return (f"After stage `{stage}`. Loss: the mean training loss over the last 5% of steps (the "
          f"mixture included); ppl: held-out text of `data.text`. The paper's columns are its "
          f"418M models after 100B tokens; its multiple-choice and containment tasks are not "
          f"available offline.\n\n" + _record.markdown(cols, rows))


def table3(res: Results, stage: str | None) -> str:
  lengths = _lengths(res, stage, "ruler")
  if not lengths:
    return "No RULER results yet."
  cols = ["Method"] + [f"{f.replace('_', '-')} {span(n)}" for f in FAMILIES
                       for n in lengths] + ["Avg"]
  rows = []
  for method in LABELS:
    if method not in res.methods:
      continue
    cells = [fmt(res.values(method, stage, ruler_cell(f, n)), 100, 1) for f in FAMILIES
             for n in lengths]
    rows.append([LABELS[method]] + cells + [fmt(res.values(method, stage, ruler_average), 100, 1)])
  for method, paper in PAPER_T3.items():
    if method not in res.methods:
      continue
    cells = []
    for family in paper[:4]:
      by_length = dict(zip(PAPER_T3_LENGTHS, family))
      cells += [f"{by_length[n]:.2f}" if n in by_length else "" for n in lengths]
    rows.append([f"paper 2.67B {LABELS[method]}"] + cells + [f"{paper[4]:.2f}"])
  return (f"After stage `{stage}`, accuracy in percent (RULER NIAH via pisa-eval's generator, "
          f"greedy decoding; a family averages its tasks; Avg over families and lengths). The "
          f"paper's rows: its 2.67B models after 10B tokens of CPT at 16K (Avg over 1K-16K)."
          f"\n\n" + _record.markdown(cols, rows))


def ruler_answers_table(res: Results, stage: str | None) -> str:
  """The one-answer families' answers teacher-forced after RULER's answer prefix."""
  lengths = _lengths(res, stage, "ruler")
  families = ("single_key", "multi_key")
  rows = []
  for method in LABELS:
    cells = [res.values(method, stage, ruler_answer_hit(f, n)) for f in families
             for n in lengths]
    if method in res.methods and any(cells):
      rows.append([LABELS[method]] + [fmt(c, 100, 1) for c in cells])
  if not rows:
    return "No answer scores yet."
  cols = ["Method"] + [f"{f.replace('_', '-')} {span(n)}" for f in families for n in lengths]
  return (f"After stage `{stage}`: the share of samples (%) whose answer the model ranks first, "
          f"token by token, when it follows RULER's prompt and answer prefix as \" {{value}}\" "
          f"(teacher-forced). Where this is above the greedy accuracy, the model finds the "
          f"needle but does not write it.\n\n"
          + _record.markdown(cols, rows))


def table6(res: Results) -> str:
  stage = res.manifest.summary["cpt"]
  lengths = _lengths(res, stage, "ppl")
  rows = []
  for method in LABELS:
    if method not in res.methods:
      continue
    paper = PAPER_T6.get(method)
    rows.append([LABELS[method], fmt(res.values(method, stage, final_loss), digits=4)]
                + [fmt(res.values(method, stage, ppl_at(n))) for n in lengths]
                + (_paper_cells(paper, (4, 2, 4, 2)) if paper else [""] * 4))
  cols = (["Method", "loss"] + [f"ppl {span(n)}" for n in lengths]
          + ["paper 1.47B loss", "paper 1.47B avg ppl", "paper 2.67B loss", "paper 2.67B avg ppl"])
  return f"After stage `{stage}`.\n\n" + _record.markdown(cols, rows)


def table7(res: Results) -> str:
  stage = res.manifest.summary["pretrain"]
  dense = res.stage_rows("dense", stage)
  parts = [row["eval"]["selection"] for row in dense if "selection" in row["eval"]]
  if not parts:
    return "No selection diagnostic yet (it runs on the dense model after pretraining)."
  part = parts[0]
  length, top_k = max(r["length"] for r in part["rows"]), part["top_k"][0]
  variants = sorted({(r["selector"], r["beam"]) for r in part["rows"]},
                    key=lambda v: (["bsa", "pisa1", "pisa2", "pisa", "exact"].index(v[0]), v[1]))
  rows = []
  for selector, beam in variants:
    factor = beam // top_k
    name = selector if selector != "pisa" or beam == top_k else f"pisa beam {beam}"
    metric = lambda key: res.values("dense", stage, _selection(selector, key, beam, length,
                                                               top_k))
    paper = PAPER_T7.get(selector) if factor == 1 else None
    rows.append([name] + [fmt(metric(k), 100, 1) for k in ("recall", "captured_mass",
                                                            "mass_ratio")]
                + ([f"{x:.2f}" for x in paper] if paper else ["", "", ""]))
  return (f"Every selector on the dense model's own post-RoPE q and k after stage `{stage}`, "
          f"{length} tokens, K = {top_k}, {part['source']['windows']} windows, rows with more "
          f"than K eligible blocks (percent). Paper: its 418M dense model on 100 FDA prompts."
          f"\n\n" + _record.markdown(["selector", f"Recall@{top_k}", "captured mass",
                                      "mass ratio", "paper Recall@8", "paper captured",
                                      "paper ratio"], rows))


def _paper_cells(values, digits) -> list[str]:
  """The paper's numbers as it prints them (losses to 4 decimals, the rest to 2)."""
  return [f"{x:.{d}f}" for x, d in zip(values, digits)]


def _selection(selector, key, beam, length, top_k):
  return lambda row: next(r[key] for r in row["eval"]["selection"]["rows"]
                          if r["selector"] == selector and r["beam"] == beam
                          and r["length"] == length and r["top_k"] == top_k)


def mqar_table(res: Results) -> str:
  stage = res.manifest.summary["cpt"]
  cells = sorted({(r["pairs"], r["length"]) for m in res.methods
                  for row in res.stage_rows(m, stage) if "mqar" in row["eval"]
                  for r in row["eval"]["mqar"]["rows"]})
  if not cells:
    return "No MQAR results yet."
  rows = []
  for method in res.methods:
    get = lambda p, n: lambda row: next(r["accuracy"] for r in row["eval"]["mqar"]["rows"]
                                        if r["pairs"] == p and r["length"] == n)
    rows.append([LABELS.get(method, method)] + [fmt(res.values(method, stage, get(p, n)), 100, 1)
                                                for p, n in cells])
  return _record.markdown(["Method"] + [f"{p} pairs @ {n}" for p, n in cells], rows)


def mixture_table(res: Results) -> str:
  """Held-out needle documents of the training families (`train.evaluation.mixture`), after
  each stage that measured them: whether a model retrieves at all, in its own templates."""
  m = res.manifest
  stages = [s.name for s in m.stages if s.eval["mixture"]]
  if not any("mixture" in row["eval"] for method in res.methods for s in stages
             for row in res.stage_rows(method, s)):
    return "No held-out mixture results yet."
  rows = []
  for method in res.methods:
    for stage in stages:
      for n in m.stage(stage).eval["mixture"]:
        rows.append([LABELS.get(method, method), stage, n]
                    + [fmt(res.values(method, stage, mixture_accuracy(f, n)), 100, 1)
                       for f in FAMILIES])
  return _record.markdown(["Method", "stage", "length"] + [f.replace("_", "-") for f in FAMILIES],
                          rows)


def induction_table(res: Results) -> str:
  """A random sequence repeated once (`train.evaluation.induction`), after each stage that
  measured it: the percent of the second copy predicted, and the loss it saves (nats)."""
  m = res.manifest
  stages = [s.name for s in m.stages if s.eval["induction"]]
  if not any("induction" in row["eval"] for method in res.methods for s in stages
             for row in res.stage_rows(method, s)):
    return "No induction results yet."
  cells = [(stage, n) for stage in stages for n in m.stage(stage).eval["induction"]]
  rows = []
  for method in res.methods:
    line = [LABELS.get(method, method)]
    for stage, n in cells:
      get = lambda key, n=n: lambda row: next(
          r[key] for r in row["eval"]["induction"]["rows"] if r["length"] == n)
      copied = res.values(method, stage, get("copy_accuracy"))
      line.append(f"{fmt(copied, 100, 1)} ({fmt(res.values(method, stage, get('score')))})"
                  if copied else fmt(copied))
    rows.append(line)
  return _record.markdown(["Method"] + [f"{stage} {span(n)}" for stage, n in cells], rows)


def _lengths(res: Results, stage: str | None, suite: str) -> list[int]:
  s = res.manifest.stage(stage)
  return list(s.eval[suite]) if s is not None else []


# ----------------------------------------------------------------------------- claims


def _compare(res, stage, get, a: str, others: list[str], *, lower: bool, what: str):
  """Whether `a` beats each of `others` on `get` by more than the noise. Where two methods share
  seeds, the gain is their mean same-seed difference and the noise the spread of same-seed
  differences (`Results.paired_noise`), once any pair of methods has two seeds in common; else the
  gain is the difference of means and the noise the spread of one method's seeds."""
  missing = [x for x in [a] + others if not res.by_seed(x, stage, get)]
  if missing:
    return PENDING, f"needs {', '.join(missing)}"
  mine = res.by_seed(a, stage, get)
  gains, parts = [], [f"{LABELS[a]} {mean(list(mine.values())):.4g}"]
  for other in others:
    theirs = res.by_seed(other, stage, get)
    common = sorted(set(mine) & set(theirs))
    part = f"{LABELS[other]} {mean(list(theirs.values())):.4g}"
    if common:
      # The verdict reads the same-seed difference: say it, where the means could mislead.
      diff = mean([mine[s] - theirs[s] for s in common])
      seeds = ", ".join(map(str, common))
      part += f" ({LABELS[a]} {diff:+.3g} on seed{'s' * (len(common) > 1)} {seeds})"
    else:
      diff = mean(list(mine.values())) - mean(list(theirs.values()))
    gains.append((-diff if lower else diff, bool(common)))
    parts.append(part)
  paired = res.paired_noise(stage, get)
  if paired is not None and all(same_seed for _, same_seed in gains):
    noise, spread = paired, f"same-seed differences, spread over seeds {paired:.3g}"
  else:
    noise = res.noise(stage, get)
    spread = (f"seed spread {noise:.3g}" if noise is not None
              else "one seed each: the spread is unknown")
  if noise is not None and noise < 1e-9:
    # Seeds that agree exactly (a coarse metric: few samples) say nothing about the spread.
    noise, spread = None, spread + ", which bounds nothing: the spread is unknown"
  # True: better by more than the noise; False: worse by more; None: within it.
  verdicts = [gain > 0 if noise is None else
              True if gain > noise else False if gain < -noise else None
              for gain, _ in gains]
  evidence = f"{what}: " + ", ".join(parts) + f" ({spread})"
  if all(v is True for v in verdicts):
    return REPRODUCED, evidence
  if False not in verdicts:
    return NOT_REPRODUCED, evidence + "; within the seed spread"
  return NOT_REPRODUCED, evidence


def _retrieval_gate(res: Results, stage) -> tuple[str, str] | None:
  """(status, why) where the RULER claims cannot be read yet: pending until dense has RULER
  results, not testable while its single-key accuracy at 1K-4K is below 80%; else None."""
  values = res.values("dense", stage, single_key_short)
  if not values:
    return PENDING, "needs dense: RULER's claims are read only once dense retrieves"
  if mean(values) < 0.8:
    return UNTESTABLE, (f"dense single-key NIAH at 1K-4K is {100 * mean(values):.1f}% (< 80%): "
                        f"the model does not retrieve, so the RULER table says nothing about "
                        f"the attention kinds")
  return None


def claims(res: Results) -> list[tuple[str, str, str, str]]:
  """(source, claim, status, evidence) for each claim of the paper this benchmark can speak to."""
  pre, cpt = res.manifest.summary["pretrain"], res.manifest.summary["cpt"]
  out = []

  def add(source, claim, result):
    out.append((source, claim, *result))

  add("Sec. 4.4, Table 2", "PISA's pretraining loss is lower than PISA-1's, PISA-2's and BSA's",
      _compare(res, pre, final_loss, "pisa", ["pisa1", "pisa2", "bsa"], lower=True,
               what="final loss"))
  add("Table 2", "PISA's pretraining loss is lower than NSA's (2.5630 against 2.5727)",
      _compare(res, pre, final_loss, "pisa", ["nsa"], lower=True, what="final loss"))
  ppl_lengths = _lengths(res, pre, "ppl")
  comparable = ("PISA is comparable to BSA in language modelling (held-out ppl within 2% or the "
                "seed spread)")
  if ppl_lengths:
    n = ppl_lengths[-1]
    va, vb = res.values("pisa", pre, ppl_at(n)), res.values("bsa", pre, ppl_at(n))
    if va and vb:
      noise = res.noise(pre, ppl_at(n)) or 0.0
      gap = abs(mean(va) - mean(vb))
      status = REPRODUCED if gap <= max(0.02 * mean(vb), noise) else NOT_REPRODUCED
      add("Sec. 4.2, Table 2", comparable,
          (status, f"ppl {span(n)}: PISA {mean(va):.2f}, BSA {mean(vb):.2f}"))
    else:
      add("Sec. 4.2, Table 2", comparable, (PENDING, "needs pisa and bsa"))
  add("Sec. 4.2, Table 2", "PISA has the highest containment and a comparable multiple-choice "
      "accuracy among sparse methods",
      (UNTESTABLE, "SWDE, SQuAD, FDA, TriviaQA, NQ, DROP and the eight multiple-choice sets "
                   "cannot be had offline"))
  gate = _retrieval_gate(res, cpt)
  ruler_claims = [
      ("Table 3", "Full attention has the highest RULER average after CPT",
       lambda: _compare(res, cpt, ruler_average, "dense",
                        [m for m in res.methods if m != "dense"], lower=False,
                        what="RULER avg")),
      ("Table 3", "PISA's RULER average is above BSA's",
       lambda: _compare(res, cpt, ruler_average, "pisa", ["bsa"], lower=False, what="RULER avg")),
      ("Table 3", "PISA-1 and PISA-2 are also above BSA",
       lambda: _both(_compare(res, cpt, ruler_average, "pisa1", ["bsa"], lower=False,
                              what="RULER avg"),
                     _compare(res, cpt, ruler_average, "pisa2", ["bsa"], lower=False,
                              what="RULER avg"))),
      ("Table 3", "PISA's RULER average is above NSA's (62.80 against 61.07)",
       lambda: _compare(res, cpt, ruler_average, "pisa", ["nsa"], lower=False, what="RULER avg")),
      ("Table 3", "At 16K, PISA keeps more single-key accuracy than BSA",
       lambda: _compare(res, cpt, ruler_cell("single_key", 16384), "pisa", ["bsa"],
                        lower=False, what="single-key 16K")),
  ]
  for source, claim, fn in ruler_claims:
    add(source, claim, gate or fn())
  short = {m: res.values(m, cpt, single_key_short) for m in res.methods}
  done = {m: v for m, v in short.items() if v}
  missing = [m for m in res.methods if m not in done]
  if gate:
    add("Table 3", "Every method retrieves single-key needles at 1K-4K (>= 90%)", gate)
  elif missing:
    add("Table 3", "Every method retrieves single-key needles at 1K-4K (>= 90%)",
        (PENDING, f"needs {', '.join(missing)}"))
  else:
    worst = min(done, key=lambda m: mean(done[m]))
    status = REPRODUCED if mean(done[worst]) >= 0.9 else NOT_REPRODUCED
    add("Table 3", "Every method retrieves single-key needles at 1K-4K (>= 90%)",
        (status, f"lowest: {LABELS.get(worst, worst)} {100 * mean(done[worst]):.1f}% over "
                 f"{', '.join(LABELS.get(m, m) for m in done)}"))
  add("Table 6, App. D.1", "After CPT, PISA's training loss is lower than BSA's and PISA-1's",
      _compare(res, cpt, final_loss, "pisa", ["bsa", "pisa1"], lower=True, what="final loss"))
  add("Table 7, Sec. 4.4", "On dense q/k, PISA has the highest Recall@8 of the four selectors",
      _selector_claim(res, pre, "recall"))
  add("Table 7", "... and the highest captured mass and attention mass ratio",
      _both(_selector_claim(res, pre, "captured_mass"), _selector_claim(res, pre, "mass_ratio")))
  values = res.values("dense", pre, selection_metric("pisa", "mass_ratio"))
  add("Table 7", "PISA's blocks capture nearly all of the reference set's mass (ratio >= 98%)",
      (PENDING, "needs the dense run") if not values else
      ((REPRODUCED if mean(values) >= 0.98 else NOT_REPRODUCED),
       f"mass ratio {100 * mean(values):.2f}%"))
  return out


def _selector_claim(res: Results, stage, metric: str):
  values = {s: res.values("dense", stage, selection_metric(s, metric)) for s in SELECTORS}
  if not all(values.values()):
    return PENDING, "needs the dense run's selection diagnostic"
  top = max(mean(v) for v in values.values())
  text = ", ".join(f"{LABELS[s]} {100 * mean(v):.2f}" for s, v in values.items())
  # A tie for the highest counts: no selector beats PISA.
  return (REPRODUCED if mean(values["pisa"]) >= top else NOT_REPRODUCED), f"{metric}: {text}"


def _both(a, b):
  """Two verdicts as one: the weaker status, both pieces of evidence."""
  order = [REPRODUCED, PENDING, UNTESTABLE, NOT_REPRODUCED]
  status = max(a[0], b[0], key=order.index)
  return status, a[1] if a[1] == b[1] else f"{a[1]}; {b[1]}"


# ----------------------------------------------------------------------------- plots


def plot_loss(res: Results, path: Path) -> bool:
  stages = [s for s in res.manifest.stages
            if any(res.stage_rows(m, s.name) for m in res.methods)]
  if not stages:
    return False
  plt = _record.pyplot()
  fig, axes = plt.subplots(1, len(stages), figsize=(6 * len(stages), 4.2), squeeze=False)
  for ax, stage in zip(axes[0], stages):
    for method in res.methods:
      for r in res.by_method.get(method, []):
        for row in r["rows"]:
          if row["stage"] != stage.name or not row["loss_curve"]:
            continue
          steps, losses = zip(*row["loss_curve"])
          ax.plot([s * row["tokens_per_step"] / 1e6 for s in steps], losses,
                  color=COLORS.get(method), linestyle="-" if r["seed"] == 0 else "--",
                  label=f"{LABELS.get(method, method)} s{r['seed']}", linewidth=1.2)
    ax.set_title(f"{stage.name}: {span(stage.seq_len)}, K={stage.top_k}")
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def plot_niah(res: Results, path: Path) -> bool:
  stage = res.manifest.summary["cpt"]
  lengths = _lengths(res, stage, "ruler")
  methods = [m for m in res.methods if res.values(m, stage, ruler_average)]
  if not methods:
    return False
  plt = _record.pyplot()
  fig, (by_length, by_depth) = plt.subplots(1, 2, figsize=(12, 4.2))
  bins = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0001]
  for method in methods:
    color, label = COLORS.get(method), LABELS.get(method, method)
    avg = [mean([mean(res.values(method, stage, ruler_cell(f, n))) for f in FAMILIES])
           for n in lengths]
    by_length.plot(lengths, [100 * a for a in avg], marker="o", color=color, label=label)
    hits = [[] for _ in bins[:-1]]
    for row in res.stage_rows(method, stage):
      for rec in row["eval"]["ruler"].get("records", []):
        if len(rec["depths"]) != 1:
          continue
        i = next(i for i in range(len(bins) - 1) if bins[i] <= rec["depths"][0] < bins[i + 1])
        hits[i].append(rec["score"])
    centres = [(a + b) / 2 for a, b in zip(bins[:-1], bins[1:])]
    by_depth.plot([100 * c for c, h in zip(centres, hits) if h],
                  [100 * mean(h) for h in hits if h], marker="o", color=color, label=label)
  by_length.set_xscale("log", base=2)
  by_length.set_xticks(lengths, [span(n) for n in lengths])
  by_length.set_title("RULER NIAH, mean of the four families")
  by_length.set_xlabel("context length")
  by_depth.set_title("single-needle tasks, all lengths, by needle depth")
  by_depth.set_xlabel("needle depth (% of the haystack)")
  for ax in (by_length, by_depth):
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


# ----------------------------------------------------------------------------- summary


def headline(res: Results) -> str:
  """One row a method: losses, held-out single-key needles in the training templates after CPT
  (does it retrieve at all), RULER's single-key to 4K and its average (does that transfer)."""
  pre, cpt = res.manifest.summary["pretrain"], res.manifest.summary["cpt"]
  stage = res.manifest.stage(cpt)
  needle_lengths = list(stage.eval["mixture"]) if stage else []
  rows = []
  for method in res.methods:
    runs = res.by_method.get(method, [])
    rows.append([LABELS.get(method, method), len(runs) or "pending",
                 fmt(res.values(method, pre, final_loss), digits=3),
                 fmt(res.values(method, cpt, final_loss), digits=3)]
                + [fmt(res.values(method, cpt, mixture_accuracy("single_key", n)), 100, 1)
                   for n in needle_lengths]
                + [fmt(res.values(method, cpt, single_key_short), 100, 1),
                   fmt(res.values(method, cpt, ruler_average), 100, 1)])
  names = [f"loss {s.name} {span(s.seq_len)}" if s else "loss"
           for s in (res.manifest.stage(pre), stage)]
  needles = [f"held-out single-key needles {span(n)} %" for n in needle_lengths]
  return _record.markdown(["Method", "seeds"] + names + needles
                          + ["RULER single-key to 4K %", "RULER avg %"], rows)


def summarize(manifest, folder: Path, *, readme: Path | None = None) -> Path:
  """Writes folder/summary.md, loss.png and niah.png from the run JSONs in `folder`; rewrites
  the block between README's replication markers with the headline table."""
  folder.mkdir(parents=True, exist_ok=True)
  res = Results(manifest, folder)
  plots = [name for name, fn in (("loss.png", plot_loss), ("niah.png", plot_niah))
           if fn(res, folder / name)]
  for name in {"loss.png", "niah.png"} - set(plots):
    (folder / name).unlink(missing_ok=True)  # a plot of results no longer counted
  claim_rows = [[source, claim, status, evidence] for source, claim, status, evidence
                in claims(res)]
  long = manifest.summary["long"]
  sections = [
      "# The paper's comparison in miniature",
      "Generated by `python -m benchmarks.replication --summarize` from the run JSONs beside "
      "this file; do not edit by hand. Numbers over seeds: mean ±half their range.",
      "## Headline", headline(res),
      "## Setup", setup_section(res),
      "## Runs", runs_section(res),
      "## Table 2: pretraining", table2(res),
      "## Table 3: RULER needle-in-a-haystack after CPT", table3(res, manifest.summary["cpt"]),
      "## RULER's answers, teacher-forced", ruler_answers_table(res, manifest.summary["cpt"]),
      "## Table 6: after CPT", table6(res),
      "## Table 7: block selection on the dense model's q and k", table7(res),
      "## MQAR after CPT", mqar_table(res),
      "## Retrieval in the training templates (held-out needle documents, accuracy %)",
      mixture_table(res),
      "## Induction: a random sequence repeated once (second copy predicted %, and the loss it "
      "saves in nats)", induction_table(res),
  ]
  if long and manifest.stage(long) is not None and manifest.stage(long).enabled:
    sections += [f"## Beyond the paper: RULER after `{long}`", table3(res, long)]
  sections += ["## The paper's claims", _record.markdown(["source", "claim", "status",
                                                          "evidence"], claim_rows)]
  if plots:
    sections += ["## Plots", "\n".join(f"![{p}]({p})" for p in plots)]
  path = folder / "summary.md"
  path.write_text("\n\n".join(sections) + "\n")
  print(f"wrote {path}" + "".join(f", {folder / p}" for p in plots))
  if readme is not None:
    update_readme(readme, headline(res))
  return path


def update_readme(readme: Path, table: str) -> bool:
  """Replaces the text between README's markers with `table`; False when it has no markers."""
  if not readme.is_file():
    return False
  text = readme.read_text()
  pattern = re.compile(re.escape(README_BEGIN) + r".*?" + re.escape(README_END), re.S)
  if not pattern.search(text):
    return False
  readme.write_text(pattern.sub(lambda _: f"{README_BEGIN}\n{table}\n{README_END}", text))
  print(f"updated the results block of {readme}")
  return True

