"""eval.json as markdown tables and PNG plots, and one table across runs (`pisa-eval --compare`).

Scores in eval.json are fractions; the tables print them in percent as the paper does (Table 3,
Table 7), losses in nats.
"""

from __future__ import annotations

from pathlib import Path

PARTS = ("ppl", "ruler", "mqar", "induction", "selection", "mixture")
FAMILY_TITLES = {"single_key": "niah_single", "multi_key": "niah_multikey",
                 "multi_query": "niah_multiquery", "multi_value": "niah_multivalue"}


def _table(header: list[str], rows: list[list]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def _pct(x) -> str:
  return "–" if x is None else f"{100 * x:.2f}"


def _num(x, digits: int = 4) -> str:
  return "–" if x is None else f"{x:.{digits}f}"


def _length(n: int) -> str:
  return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _selector(row: dict) -> str:
  if row["selector"] == "pisa" and row["beam"] != row["top_k"]:
    return f"pisa beam {row['beam']}"
  return row["selector"]


# ----------------------------------------------------------------------------- one run


def ppl_markdown(part: dict) -> str:
  rows = part["rows"]
  out = [_table(["length", "windows", "tokens", "loss", "ppl"],
                [[r["length"], r["windows"], f"{r['tokens']:,}", _num(r["loss"]), _num(r["ppl"], 3)]
                 for r in rows])]
  spans = sorted({(b["start"], b["end"]) for r in rows for b in r["buckets"]})
  loss = {(r["length"], b["start"], b["end"]): b["loss"] for r in rows for b in r["buckets"]}
  out.append("Loss by target position:\n\n" + _table(
      ["positions"] + [_length(r["length"]) for r in rows],
      [[f"{lo}-{hi - 1}"] + [_num(loss.get((r["length"], lo, hi))) for r in rows]
       for lo, hi in spans]))
  return "\n\n".join(out)


def ruler_table3(labelled: list[tuple[str, dict]]) -> str:
  """Table 3's layout: one row per run, every family at every length, then the average."""
  lengths = sorted({n for _, part in labelled for n in part["lengths"]})
  families = list(dict.fromkeys(r["family"] for _, part in labelled for r in part["families"]))
  header = ["run"] + [f"{FAMILY_TITLES.get(f, f)} {_length(n)}" for f in families
                      for n in lengths] + ["Avg"]
  rows = []
  for label, part in labelled:
    score = {(r["family"], r["length"]): r["score"] for r in part["families"]}
    rows.append([label] + [_pct(score.get((f, n))) for f in families for n in lengths]
                + [_pct(part["average"])])
  return _table(header, rows)


def ruler_markdown(part: dict, label: str) -> str:
  lengths = part["lengths"]
  score = {(r["task"], r["length"]): r["score"] for r in part["tasks"]}
  tasks = list(dict.fromkeys(r["task"] for r in part["tasks"]))
  per_task = _table(["task"] + [_length(n) for n in lengths],
                    [[t] + [_pct(score[(t, n)]) for n in lengths] for t in tasks])
  return (f"Accuracy in percent, {part['samples']} samples per task and length; the average is "
          f"over the families and lengths.\n\n{ruler_table3([(label, part)])}\n\nPer task:\n\n"
          f"{per_task}\n\nEach sample's prediction: {part['predictions']}.")


def mqar_markdown(part: dict) -> str:
  lengths = sorted({r["length"] for r in part["rows"]} | {r["length"] for r in part["skipped"]})
  pairs = sorted({r["pairs"] for r in part["rows"]} | {r["pairs"] for r in part["skipped"]})
  acc = {(r["pairs"], r["length"]): r["accuracy"] for r in part["rows"]}
  note = f" (trained with {part['trained_pairs']})" if part.get("trained_pairs") else ""
  return (f"Accuracy in percent over answer positions, {part['samples']} examples per cell; "
          f"rows: key-value pairs{note}; – : the length cannot hold the pairs.\n\n"
          + _table(["pairs"] + [_length(n) for n in lengths],
                   [[p] + [_pct(acc.get((p, n))) for n in lengths] for p in pairs]))


def induction_markdown(part: dict) -> str:
  vocabulary = part.get("vocabulary")
  drawn = (f" of the held-out data's {vocabulary['tokens']:,} most common tokens"
           if vocabulary else "")
  return (f"A random sequence{drawn} repeated once, {part['samples']} windows a length: mean NLL "
          f"(nats) of each copy's targets after its first token, the first minus the second, and "
          f"the percent of the second copy's tokens predicted (argmax).\n\n"
          + _table(["length", "first copy", "second copy", "score", "copied"],
                   [[_length(r["length"]), _num(r["first_loss"], 3), _num(r["second_loss"], 3),
                     _num(r["score"], 3), _pct(r["copy_accuracy"])] for r in part["rows"]]))


def mixture_markdown(part: dict) -> str:
  lengths = sorted({r["length"] for r in part["rows"]})
  families = list(dict.fromkeys(r["family"] for r in part["rows"]))
  cell = {(r["family"], r["length"]): r for r in part["rows"]}
  return (f"Held-out needle documents of the training templates, {part['samples']} per family "
          f"and length: percent whose whole answer is the argmax at every token (answer "
          f"tokens' mean NLL in nats); average {_pct(part['average'])}.\n\n"
          + _table(["family"] + [_length(n) for n in lengths],
                   [[f.replace("_", "-")] + [f"{_pct(cell[(f, n)]['accuracy'])} "
                                             f"({cell[(f, n)]['answer_nll']:.2f})"
                                             for n in lengths] for f in families]))


def selection_markdown(part: dict) -> str:
  out = []
  settings = sorted({(r["length"], r["top_k"]) for r in part["rows"]})
  for length, top_k in settings:
    rows = [r for r in part["rows"] if (r["length"], r["top_k"]) == (length, top_k)]
    if not any(r["rows"] for r in rows):
      out.append(f"Length {length}, K = {top_k}: no query has more than K eligible blocks "
                 f"(K x C = {top_k * part['block_size']} >= {length} tokens)")
      continue
    out.append(f"Length {length}, C = {part['block_size']}, K = {top_k}, {part['layers']} layers "
               f"(percent; rows with more than K eligible blocks):\n\n" + _table(
                   ["selector", f"Recall@{top_k}", "captured mass", "mass ratio", "rows"],
                   [[_selector(r), _pct(r["recall"]), _pct(r["captured_mass"]),
                     _pct(r["mass_ratio"]), f"{r['rows']:,}"] for r in rows]))
    buckets = [b for b in part["by_position"] if (b["length"], b["top_k"]) == (length, top_k)]
    spans = list(dict.fromkeys((b["start"], b["end"]) for b in buckets))
    names = list(dict.fromkeys(_selector(b) for b in buckets))
    cell = {(_selector(b), b["start"]): b for b in buckets}
    for metric, title in (("recall", f"Recall@{top_k}"), ("mass_ratio", "Mass ratio")):
      out.append(f"{title} by query position:\n\n" + _table(
          ["positions"] + names,
          [[f"{lo}-{hi - 1}"] + [_pct(cell[(n, lo)][metric]) for n in names]
           for lo, hi in spans]))
  return "\n\n".join(out)


def part_markdown(name: str, part: dict, label: str) -> str:
  """One part's tables (`label`: the run's name, which RULER's table rows carry)."""
  if name == "ruler":
    return ruler_markdown(part, label)
  return {"ppl": ppl_markdown, "mqar": mqar_markdown, "induction": induction_markdown,
          "selection": selection_markdown, "mixture": mixture_markdown}[name](part)


def markdown(result: dict) -> str:
  ckpt = result.get("checkpoint") or {}
  model = (result.get("config") or {}).get("model", {})
  title = (f"step {ckpt['step']} of {ckpt['workdir']} ({model.get('attention')} attention)"
           if ckpt else "attention arrays")
  out = [f"# pisa-eval: {title}",
         f"commit {result['commit']}, jax {result['jax']}, {result['device']}, {result['date']}"]
  label = Path(ckpt["workdir"]).name if ckpt else "arrays"
  for name in PARTS:
    part = result["parts"].get(name)
    if part is None:
      continue
    out.append(f"## {name} ({part['wall_seconds']:.1f} s)\n\n{part_markdown(name, part, label)}")
  return "\n\n".join(out) + "\n"


# ----------------------------------------------------------------------------- plots


def _pyplot():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def plot_ppl(part: dict, path: Path) -> None:
  """Loss against target position (log-spaced buckets), one line per length."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for r in part["rows"]:
    pts = [((b["start"] + b["end"] - 1) / 2, b["loss"]) for b in r["buckets"]
           if b["loss"] is not None]
    if pts:
      ax.plot(*zip(*pts), "o-", label=f"{r['length']} (ppl {_num(r['ppl'], 2)})")
  ax.set_xscale("log", base=2)
  ax.set(xlabel="target position (bucket middle)", ylabel="loss (nats)",
         title="held-out loss by position")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _save_percent_plot(plt, fig, ax, path: Path, *, xlabel: str, ylabel: str, title: str) -> None:
  """A percentage against a log2 axis: labels, grid and legend, saved to `path` and closed."""
  ax.set_xscale("log", base=2)
  ax.set(xlabel=xlabel, ylabel=ylabel, ylim=(-2, 102), title=title)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_ruler(part: dict, path: Path) -> None:
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for family in dict.fromkeys(r["family"] for r in part["families"]):
    pts = [(r["length"], 100 * r["score"]) for r in part["families"] if r["family"] == family]
    ax.plot(*zip(*pts), "o-", label=FAMILY_TITLES.get(family, family))
  ax.plot([r["length"] for r in part["by_length"]], [100 * r["score"] for r in part["by_length"]],
          "k--", label=f"average ({_pct(part['average'])})")
  _save_percent_plot(plt, fig, ax, path, xlabel="context length (tokens)",
                     ylabel="accuracy (%)", title="RULER needle-in-a-haystack")


def plot_mqar(part: dict, path: Path) -> None:
  if not part["rows"]:
    return
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for length in sorted({r["length"] for r in part["rows"]}):
    pts = sorted((r["pairs"], 100 * r["accuracy"]) for r in part["rows"] if r["length"] == length)
    ax.plot(*zip(*pts), "o-", label=f"{length} tokens")
  _save_percent_plot(plt, fig, ax, path, xlabel="key-value pairs", ylabel="accuracy (%)",
                     title="MQAR")


def plot_induction(part: dict, path: Path) -> None:
  """Percent of the second copy predicted by length."""
  if not part["rows"]:
    return
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(7, 4.5))
  pts = sorted((r["length"], 100 * r["copy_accuracy"]) for r in part["rows"])
  ax.plot(*zip(*pts), "o-", label="second copy")
  _save_percent_plot(plt, fig, ax, path, xlabel="window length (tokens)",
                     ylabel="tokens copied (%)", title="Induction: a random sequence repeated")


def plot_selection(part: dict, path: Path) -> None:
  """Figure 2: Recall@K and mass ratio by query position, one row of panels per (length, K)."""
  plt = _pyplot()
  settings = sorted({(r["length"], r["top_k"]) for r in part["rows"] if r["rows"]})
  if not settings:
    return
  fig, axes = plt.subplots(len(settings), 2, figsize=(12, 4 * len(settings)), squeeze=False)
  for (length, top_k), (left, right) in zip(settings, axes):
    buckets = [b for b in part["by_position"] if (b["length"], b["top_k"]) == (length, top_k)]
    for name in dict.fromkeys(_selector(b) for b in buckets):
      mine = [b for b in buckets if _selector(b) == name and b["rows"]]
      x = [(b["start"] + b["end"] - 1) / 2 for b in mine]
      left.plot(x, [100 * b["recall"] for b in mine], "o-", label=name)
      right.plot(x, [100 * b["mass_ratio"] for b in mine], "o-", label=name)
    for ax, what in ((left, f"Recall@{top_k} (%)"), (right, "mass ratio (%)")):
      ax.set_xscale("log", base=2)
      ax.set(xlabel="query position", ylabel=what,
             title=f"{length} tokens, C = {part['block_size']}, K = {top_k}")
      ax.grid(True, which="both", alpha=0.3)
      ax.ticklabel_format(axis="y", useOffset=False)
    left.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_mixture(part: dict, path: Path) -> None:
  """Accuracy on held-out needle documents by length, a line a family."""
  if not part["rows"]:
    return
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for family in dict.fromkeys(r["family"] for r in part["rows"]):
    pts = sorted((r["length"], 100 * r["accuracy"]) for r in part["rows"]
                 if r["family"] == family)
    ax.plot(*zip(*pts), "o-", label=family.replace("_", "-"))
  _save_percent_plot(plt, fig, ax, path, xlabel="document length (tokens)",
                     ylabel="answers retrieved (%)",
                     title="Held-out needle documents (training templates)")


PLOTS = {"ppl": plot_ppl, "ruler": plot_ruler, "mqar": plot_mqar, "induction": plot_induction,
         "selection": plot_selection, "mixture": plot_mixture}


def write_plots(result: dict, out: Path) -> list[Path]:
  """One PNG per part that has something to draw."""
  paths = []
  for name, part in result["parts"].items():
    path = out / f"{name}.png"
    path.unlink(missing_ok=True)
    PLOTS[name](part, path)
    if path.exists():
      paths.append(path)
  return paths


# ----------------------------------------------------------------------------- across runs


def compare(labelled: list[tuple[str, dict]]) -> str:
  """One summary table across runs, then each part's table where any run has that part."""
  def parts(name):
    return [(label, r["parts"][name]) for label, r in labelled if name in r["parts"]]

  ppl_lengths = sorted({row["length"] for _, p in parts("ppl") for row in p["rows"]})
  header = (["run", "step", "attention"] + [f"ppl {_length(n)}" for n in ppl_lengths]
            + ["RULER avg", "MQAR mean acc", "Recall@K pisa"])
  summary = []
  for label, r in labelled:
    p = r["parts"]
    ppl = {row["length"]: row["ppl"] for row in p.get("ppl", {}).get("rows", [])}
    mqar = [row["accuracy"] for row in p.get("mqar", {}).get("rows", [])]
    pisa = [row for row in p.get("selection", {}).get("rows", [])
            if row["selector"] == "pisa" and row["beam"] == row["top_k"]]
    summary.append(
        [label, (r.get("checkpoint") or {}).get("step", "–"),
         (r.get("config") or {}).get("model", {}).get("attention", "–")]
        + [_num(ppl.get(n), 3) for n in ppl_lengths]
        + [_pct(p["ruler"]["average"]) if "ruler" in p else "–",
           _pct(sum(mqar) / len(mqar)) if mqar else "–",
           f"{_pct(pisa[0]['recall'])} (K={pisa[0]['top_k']}, {pisa[0]['length']})" if pisa
           else "–"])
  out = ["# pisa-eval across runs", _table(header, summary)]
  if parts("ppl"):
    out.append("## Perplexity\n\n" + _table(
        ["run"] + [_length(n) for n in ppl_lengths],
        [[label] + [_num({r["length"]: r["ppl"] for r in p["rows"]}.get(n), 3)
                    for n in ppl_lengths] for label, p in parts("ppl")]))
  if parts("ruler"):
    out.append("## RULER (accuracy, percent)\n\n" + ruler_table3(parts("ruler")))
  if parts("mqar"):
    cells = sorted({(r["pairs"], r["length"]) for _, p in parts("mqar") for r in p["rows"]})
    out.append("## MQAR (accuracy, percent; pairs @ length)\n\n" + _table(
        ["run"] + [f"{pr} @ {_length(n)}" for pr, n in cells],
        [[label] + [_pct({(r["pairs"], r["length"]): r["accuracy"] for r in p["rows"]}.get(c))
                    for c in cells] for label, p in parts("mqar")]))
  if parts("induction"):
    lengths = sorted({r["length"] for _, p in parts("induction") for r in p["rows"]})
    out.append("## Induction (second copy of a repeated random sequence: percent copied)\n\n"
               + _table(["run"] + [_length(n) for n in lengths],
                        [[label] + [_pct({r["length"]: r["copy_accuracy"]
                                          for r in p["rows"]}.get(n)) for n in lengths]
                         for label, p in parts("induction")]))
  if parts("mixture"):
    cells = sorted({(r["family"], r["length"]) for _, p in parts("mixture") for r in p["rows"]})
    out.append("## Held-out needle documents (answers retrieved, percent; family @ length)\n\n"
               + _table(["run"] + [f"{f.replace('_', '-')} @ {_length(n)}" for f, n in cells],
                        [[label] + [_pct({(r["family"], r["length"]): r["accuracy"]
                                          for r in p["rows"]}.get(c)) for c in cells]
                         for label, p in parts("mixture")]))
  if parts("selection"):
    settings = sorted({(r["length"], r["top_k"]) for _, p in parts("selection")
                       for r in p["rows"]})
    for length, top_k in settings:
      names = list(dict.fromkeys(_selector(r) for _, p in parts("selection") for r in p["rows"]
                                 if (r["length"], r["top_k"]) == (length, top_k)))
      rows = []
      for label, p in parts("selection"):
        got = {_selector(r): r for r in p["rows"] if (r["length"], r["top_k"]) == (length, top_k)}
        rows.append([label] + [_pct(got[n]["recall"]) if n in got else "–" for n in names])
      out.append(f"## Selection, Recall@{top_k} at {length} tokens (percent)\n\n"
                 + _table(["run"] + names, rows))
  return "\n\n".join(out) + "\n"
