"""Training-free PISA on a pretrained model: the model's own dense attention swapped for PISA, BSA
or PISA-2 at K = 8, 16 and 32 (PISA also with a wider beam), without any training; and continued
pretraining (the paper's CPT) of the imported model with PISA and with BSA, measured before and
after.

  python -m benchmarks.fetch_smollm2                               # SmolLM2-135M-Instruct, GGUF
  pisa-import ~/.cache/pisa_jax/pretrained/SmolLM2-135M-Instruct.Q4_1.gguf --out runs/smol
  pisa-prepare-data --tokenizer runs/smol --corpus wiki-offline --corpus sotu --out data/smol
  python -m benchmarks.pretrained --data data/smol                 # on a GPU

Parts (--parts, any of): "free", the training-free variants (--only picks some by name);
"selection", Recall@K on the dense model's q / k; "cpt", for each of --cpt-kinds, the model
imported into a run folder (`pisa-import`: model.attention=KIND, K = --cpt-top-k, train.seq_len =
--cpt-seq-len) and trained by `pisa-train`'s trainer on the train split of --data for --cpt-steps
steps or --cpt-seconds, whichever ends first (the paper's CPT schedule, cosine from 3e-5),
with perplexity and NIAH of the run's checkpoint before and after. --append keeps the rows of an
earlier result in --out that this call does not measure again, so that the parts can be measured
in separate processes (each a bounded time on a GPU) into one result, e.g.

  python -m benchmarks.pretrained --data data/smol --parts free,selection \
      --only "dense,pisa K8,pisa K16,pisa K32"
  python -m benchmarks.pretrained --data data/smol --parts free --append \
      --only "bsa K8,bsa K16,bsa K32,pisa2 K8,pisa2 K16,pisa2 K32"
  python -m benchmarks.pretrained --data data/smol --parts free --append \
      --only "pisa K8 beam 16,pisa K16 beam 32,pisa K32 beam 64"
  python -m benchmarks.pretrained --data data/smol --parts cpt --cpt-kinds pisa --append
  python -m benchmarks.pretrained --data data/smol --parts cpt --cpt-kinds bsa --append

Each variant, the selection part and each CPT stage print their seconds. Nothing is fetched: the
model is --model (default `benchmarks.fetch_smollm2`'s path, which `--join` fills from parts on a
machine without a package index), RULER's haystack `$PISA_DATA_DIR/ruler/essays.txt`.

For every variant: perplexity on held-out windows of real text (the val split of --data, a
pisa-prepare-data corpus in the model's own tokens) at --ppl-lengths (2K and 8K), and RULER's
needle-in-a-haystack tasks (the four families, `pisa-eval`'s generator, prompts in the model's
tokenizer, greedy through the decode path until the model's end-of-sequence token) at
--ruler-lengths (1K to 8K). Once, on the dense model: Recall@K and captured attention mass of each
selector at each K on the model's own post-RoPE q / k of every layer (`pisa-eval`'s selection
suite, Table 7's measure) at --selection-length. Rows:

  {"part": "ppl", "variant", "attention", "top_k", "beam", "length", "loss", "ppl"}
  {"part": "ruler", "variant", ..., "length", "score"}  and  {"part": "ruler", ..., "length":
      "average", "score"}  (the paper's average over families and lengths)
  {"part": "selection", "length", "top_k", "selector", "beam", "recall", "captured_mass", ...}
  {"part": "cpt", "variant", "attention", "top_k", "stage": "before" | "after", "step",
      "metric": "ppl" | "niah", "length", "value"}  (NIAH's "average" too)
  {"part": "cpt-train", "variant", "steps", "tokens", "seconds", "first_loss", "last_loss",
      "stop_reason"}
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks import _record

NAME = "pretrained"
PARTS = ("free", "selection", "cpt")


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def _names(text: str) -> list[str]:
  return [x.strip() for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
  return [float(x) for x in text.split(",") if x]


def variants(top_ks: list[int], beam_factors: list[float],
             kinds: tuple[str, ...] = ("pisa", "bsa", "pisa2")) -> list[tuple[str, int, int]]:
  """(attention, top_k, beam) of every variant: dense first (K and beam 0: none), then each K's
  kinds, and PISA at each wider beam (beam_factor x K)."""
  out = [("dense", 0, 0)]
  for k in top_ks:
    for kind in kinds:
      out.append((kind, k, 0))
      if kind == "pisa":
        out += [("pisa", k, int(round(f * k))) for f in beam_factors if round(f * k) > k]
  return out


def variant_name(attention: str, top_k: int, beam: int) -> str:
  if attention == "dense":
    return "dense"
  return f"{attention} K{top_k}" + (f" beam {beam}" if beam else "")


def settings(args) -> dict:
  return {"model": str(args.model), "data": str(args.data), "ppl_lengths": args.ppl_lengths,
          "ruler_lengths": args.ruler_lengths, "top_ks": args.top_ks,
          "beam_factors": args.beam_factors, "block_size": args.block_size,
          "ppl_samples": args.ppl_samples, "ruler_samples": args.ruler_samples,
          "selection_length": args.selection_length,
          "selection_samples": args.selection_samples, "compute_dtype": args.compute_dtype,
          "implementation": args.implementation, "only": args.only, "parts": args.parts,
          "cpt_kinds": args.cpt_kinds, "cpt_top_k": args.cpt_top_k,
          "cpt_seq_len": args.cpt_seq_len, "cpt_steps": args.cpt_steps,
          "cpt_seconds": args.cpt_seconds, "cpt_batch": args.cpt_batch, "cpt_set": args.cpt_set}


def evaluate(model, cfg, args, encoding, stop) -> tuple[list[dict], dict]:
  """Perplexity rows at --ppl-lengths and RULER's result at --ruler-lengths of `model`."""
  from pisa_jax.configs import Config, DataConfig, TrainConfig
  from pisa_jax.train.evaluation import needles, perplexity

  config = Config(model=cfg, data=DataConfig(source="tokens", path=str(args.data)),
                  train=TrainConfig(seq_len=max(args.ppl_lengths + args.ruler_lengths)))
  ppl = perplexity.run_perplexity(model, config, lengths=args.ppl_lengths,
                                  samples=args.ppl_samples, seed=0, data=str(args.data),
                                  batch_size=args.batch_size, progress=False)
  ruler, _ = needles.run_ruler(model, config, lengths=args.ruler_lengths,
                               samples=args.ruler_samples, seed=0, batch_size=args.batch_size,
                               progress=False, encoding=encoding, stop=stop)
  return ppl["rows"], ruler


def with_attention(model, cfg, **fields):
  """(model, config): `model`'s parameters under `cfg` with `fields` changed (an attention's
  fields: the parameters are the same for every attention kind)."""
  from flax import nnx

  from pisa_jax.models.decoder import Decoder
  from pisa_jax.models.pretrained import check_options

  changed = dataclasses.replace(cfg, **fields)
  check_options(changed)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(changed, rngs=nnx.Rngs(0))))
  return nnx.merge(graphdef, nnx.state(model)), changed


def measure(args, rec: _record.Recorder) -> None:
  from pisa_jax.models import load_pretrained
  from pisa_jax.models.pretrained import read_pretrained
  from pisa_jax.train.tokenizer import RunTokenizer

  source = read_pretrained(args.model)
  source.tensors.close()
  encoding, stop = RunTokenizer(source.tokenizer), source.eos_token_ids
  if not stop:
    rec.note("the model names no end-of-sequence token: RULER generates each answer's full "
             "budget")
  if "free" in args.parts or "selection" in args.parts:
    # The weights are read once; each variant is the same parameters under its attention.
    start = time.perf_counter()
    dense, cfg, _ = load_pretrained(args.model, compute_dtype=args.compute_dtype)
    print(f"loaded {args.model} ({time.perf_counter() - start:.0f} s)", flush=True)
    if "free" in args.parts:
      for attention, top_k, beam in chosen_variants(args):
        fields = {} if attention == "dense" else dict(
            attention=attention, top_k=top_k, beam=beam or None, block_size=args.block_size,
            attention_implementation=args.implementation)
        model, variant_cfg = with_attention(dense, cfg, **fields)
        head = {"variant": variant_name(attention, top_k, beam), "attention": attention,
                "top_k": top_k or None, "beam": beam or None}
        start = time.perf_counter()
        ppl, ruler = evaluate(model, variant_cfg, args, encoding, stop)
        for row in ppl:
          rec.add(part="ppl", **head, length=row["length"], loss=row["loss"], ppl=row["ppl"])
        for row in ruler["by_length"]:
          rec.add(part="ruler", **head, length=row["length"], score=row["score"])
        rec.add(part="ruler", **head, length="average", score=ruler["average"])
        print(f"{head['variant']}: ppl {[round(r['ppl'], 3) for r in ppl]}, RULER "
              f"{ruler['average']:.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
    if "selection" in args.parts:
      measure_selection(args, rec, dense, cfg)
    del dense
  if "cpt" in args.parts:
    for kind in args.cpt_kinds:
      continued_pretraining(args, rec, kind, encoding, stop)


def chosen_variants(args) -> list[tuple[str, int, int]]:
  chosen = variants(args.top_ks, args.beam_factors)
  if args.only:
    names = [variant_name(*v) for v in chosen]
    unknown = [n for n in args.only if n not in names]
    if unknown:
      raise SystemExit(f"--only: {unknown[0]!r} is no variant of these --top-ks and "
                       f"--beam-factors: {names}")
    chosen = [v for v in chosen if variant_name(*v) in args.only]
  return chosen


def measure_selection(args, rec: _record.Recorder, model, cfg) -> None:
  from pisa_jax.configs import Config, DataConfig, TrainConfig
  from pisa_jax.train.evaluation import selection

  if not args.selection_length:
    return
  start = time.perf_counter()
  config = Config(model=cfg, data=DataConfig(source="tokens", path=str(args.data)),
                  train=TrainConfig(seq_len=args.selection_length))
  part = selection.run_on_checkpoint(
      model, config, lengths=[args.selection_length], samples=args.selection_samples,
      seed=0, data=str(args.data), block_size=args.block_size, top_ks=args.top_ks,
      beam_factors=[1.0, *args.beam_factors], progress=False)
  for row in part["rows"]:
    rec.add(part="selection", **row)
  print(f"selection at {args.selection_length}: {len(part['rows'])} rows "
        f"({time.perf_counter() - start:.0f} s)", flush=True)


def cpt_overrides(args, kind: str) -> list[str]:
  """pisa-import's --set for the run of `kind`: the attention, the CPT length and schedule,
  the data; then --cpt-set."""
  steps = args.cpt_steps
  return [f"model.attention={kind}", f"model.top_k={args.cpt_top_k}",
          f"model.block_size={args.block_size}", f"model.compute_dtype={args.compute_dtype}",
          f"train.seq_len={args.cpt_seq_len}", f"train.per_device_batch={args.cpt_batch}",
          f"train.steps={steps}", f"train.checkpoint_every={steps}", "train.eval_batches=0",
          f"train.eval_every={steps}", f"data.path={args.data}"] + (
              [] if args.implementation is None
              else [f"model.attention_implementation={args.implementation}"]) + args.cpt_set


def continued_pretraining(args, rec: _record.Recorder, kind: str, encoding, stop) -> None:
  """Imports --model as a run of attention `kind`, measures it, trains it, measures it again."""
  from pisa_jax.train import trainer
  from pisa_jax.train.import_cli import import_checkpoint
  from pisa_jax.train.restore import restore_model

  if args.cpt_dir is not None:
    args.cpt_dir.mkdir(parents=True, exist_ok=True)
  run = Path(tempfile.mkdtemp(prefix=f"pisa-cpt-{kind}-", dir=args.cpt_dir))
  start = time.perf_counter()
  config = import_checkpoint(args.model, run, cpt_overrides(args, kind))
  head = {"variant": f"{kind} K{args.cpt_top_k}", "attention": kind, "top_k": args.cpt_top_k}
  print(f"cpt {kind}: imported into {run} ({time.perf_counter() - start:.0f} s)", flush=True)

  def measure_run(stage: str) -> None:
    start = time.perf_counter()
    run_config, model, step = restore_model(run)
    ppl, ruler = evaluate(model, run_config.model, args, encoding, stop)
    for row in ppl:
      rec.add(part="cpt", **head, stage=stage, step=step, metric="ppl", length=row["length"],
              value=row["ppl"])
    for row in ruler["by_length"] + [{"length": "average", "score": ruler["average"]}]:
      rec.add(part="cpt", **head, stage=stage, step=step, metric="niah", length=row["length"],
              value=row["score"])
    print(f"cpt {kind} {stage} (step {step}): ppl {[round(r['ppl'], 3) for r in ppl]}, RULER "
          f"{ruler['average']:.3f} ({time.perf_counter() - start:.0f} s)", flush=True)

  measure_run("before")
  start = time.perf_counter()
  trained = trainer.train(config, run, max_seconds=args.cpt_seconds, progress=False, quiet=True)
  seconds = time.perf_counter() - start
  losses = [trained.losses[s] for s in sorted(trained.losses)]
  done = trained.end_step - trained.start_step
  rec.add(part="cpt-train", **head, steps=done,
          tokens=done * config.train.seq_len * config.train.per_device_batch, seconds=seconds,
          first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
          stop_reason=trained.stop_reason)
  print(f"cpt {kind}: {done} steps, loss {losses[0] if losses else None} -> "
        f"{losses[-1] if losses else None} ({seconds:.0f} s)", flush=True)
  measure_run("after")
  if args.cpt_dir is None:  # a temporary run (GBs of checkpoints): measured, so removed
    shutil.rmtree(run, ignore_errors=True)


# The settings every row of one result shares: an --append call must match them.
SHARED_SETTINGS = ("model", "data", "ppl_lengths", "ruler_lengths", "block_size", "ppl_samples",
                   "ruler_samples", "compute_dtype", "implementation")


def append_mismatch(args, earlier: dict) -> str | None:
  """What differs between an earlier result and this call (device, shared settings), or None."""
  from pisa_jax.train.provenance import environment

  device = environment()["device"]
  if earlier.get("device") != device:
    return f"device {earlier.get('device')!r}, this call runs on {device!r}"
  mine = settings(args)
  for key in SHARED_SETTINGS:
    if earlier.get("settings", {}).get(key) != mine[key]:
      return f"{key}={earlier.get('settings', {}).get(key)!r}, this call {mine[key]!r}"
  return None


def kept_rows(args, record: dict) -> list[dict]:
  """The rows of an earlier result that this call's parts and variants do not measure again."""
  measured = {variant_name(*v) for v in chosen_variants(args)} if "free" in args.parts else set()
  cpt = {f"{k} K{args.cpt_top_k}" for k in args.cpt_kinds} if "cpt" in args.parts else set()

  def again(row) -> bool:
    part = row["part"]
    if part in ("ppl", "ruler"):
      return row["variant"] in measured
    if part == "selection":
      return "selection" in args.parts and bool(args.selection_length)
    return part in ("cpt", "cpt-train") and row["variant"] in cpt

  return [r for r in record["rows"] if not again(r)]


def free_names(rows: list[dict]) -> list[str]:
  """The training-free variants of a result, in measured order."""
  return list(dict.fromkeys(r["variant"] for r in rows if r["part"] in ("ppl", "ruler")))


def cpt_lines(rows: list[dict]) -> list[list]:
  """[variant, stage, step, ppl at each length..., NIAH at each length..., NIAH average] of the
  continued pretraining, and a header; empty without cpt rows."""
  cpt = [r for r in rows if r["part"] == "cpt"]
  if not cpt:
    return []
  lengths = {m: sorted({r["length"] for r in cpt if r["metric"] == m and r["length"] != "average"})
             for m in ("ppl", "niah")}
  header = (["variant", "stage", "step"] + [f"ppl {n}" for n in lengths["ppl"]]
            + [f"NIAH {n}" for n in lengths["niah"]] + ["NIAH avg"])
  out = [header]
  for name in dict.fromkeys(r["variant"] for r in cpt):
    for stage in ("before", "after"):
      got = [r for r in cpt if r["variant"] == name and r["stage"] == stage]
      if not got:
        continue
      value = lambda m, n: next((r["value"] for r in got if r["metric"] == m
                                 and r["length"] == n), None)
      out.append([name, stage, got[0]["step"]] + [value("ppl", n) for n in lengths["ppl"]]
                 + [value("niah", n) for n in lengths["niah"]] + [value("niah", "average")])
  return out


def table(record: dict) -> str:
  rows = record["rows"]
  names = free_names(rows)
  ppl_lengths = sorted({r["length"] for r in rows if r["part"] == "ppl"})
  ruler_lengths = sorted({r["length"] for r in rows if r["part"] == "ruler"
                          and r["length"] != "average"})

  def value(part, name, length, key):
    hit = [r[key] for r in rows if r["part"] == part and r.get("variant") == name
           and r["length"] == length]
    return hit[0] if hit else None

  lines = [[n] + [value("ppl", n, L, "ppl") for L in ppl_lengths]
           + [value("ruler", n, L, "score") for L in ruler_lengths]
           + [value("ruler", n, "average", "score")] for n in names]
  out = _record.markdown(["variant"] + [f"ppl {L}" for L in ppl_lengths]
                         + [f"NIAH {L}" for L in ruler_lengths] + ["NIAH avg"], lines)
  chosen = [r for r in rows if r["part"] == "selection"]
  if chosen:
    out += "\n\n" + _record.markdown(
        ["length", "K", "selector", "beam", "Recall@K", "captured mass"],
        [[r["length"], r["top_k"], r["selector"], r["beam"], r["recall"], r["captured_mass"]]
         for r in chosen])
  lines = cpt_lines(rows)
  if lines:
    out += "\n\n" + _record.markdown(lines[0], lines[1:])
    trained = [r for r in rows if r["part"] == "cpt-train"]
    out += "\n\n" + _record.markdown(
        ["variant", "steps", "tokens", "seconds", "first loss", "last loss", "stopped by"],
        [[r["variant"], r["steps"], r["tokens"], r["seconds"], r["first_loss"], r["last_loss"],
          r["stop_reason"] or "train.steps"] for r in trained])
  return out


def plot(record: dict, path: Path) -> None:
  plt = _record.pyplot()
  rows = record["rows"]
  names = free_names(rows)
  fig, axes = plt.subplots(1, 4, figsize=(24, 5))
  ax = axes[0]
  ppl_lengths = sorted({r["length"] for r in rows if r["part"] == "ppl"})
  width = 0.8 / max(len(ppl_lengths), 1)
  for i, length in enumerate(ppl_lengths):
    values = [next((r["ppl"] for r in rows if r["part"] == "ppl" and r["variant"] == n
                    and r["length"] == length), 0) for n in names]
    ax.bar([j + i * width for j in range(len(names))], values, width, label=f"{length} tokens")
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=60, ha="right")
  ax.set_ylabel("perplexity")
  ax.set_title("held-out perplexity")
  ax.legend()
  ax = axes[1]
  scores = [next((r["score"] for r in rows if r["part"] == "ruler" and r["variant"] == n
                  and r["length"] == "average"), 0) for n in names]
  ax.bar(range(len(names)), scores, color="tab:green")
  ax.set_xticks(range(len(names)), names, rotation=60, ha="right")
  ax.set_ylim(0, 1)
  ax.set_ylabel("RULER NIAH average")
  ax.set_title("needle in a haystack (training-free)")
  ax = axes[2]
  chosen = [r for r in rows if r["part"] == "selection"]
  labels = list(dict.fromkeys(f"{r['selector']}" + (f" beam {r['beam']}" if r["selector"]
                                                    == "pisa" else "") for r in chosen))
  ks = sorted({r["top_k"] for r in chosen})
  for label in labels:
    ys = [next((r["recall"] for r in chosen if r["top_k"] == k and (
        f"{r['selector']}" + (f" beam {r['beam']}" if r["selector"] == "pisa" else "")) == label),
               None) for k in ks]
    ax.plot(ks, ys, marker="o", label=label)
  ax.set_xlabel("K (blocks)")
  ax.set_ylabel("Recall@K")
  ax.set_title("selection on the model's own q / k")
  if labels:
    ax.legend(fontsize=7)
  ax = axes[3]
  lines = cpt_lines(rows)
  if lines:
    header, body = lines[0], lines[1:]
    ppl_column = max(i for i, h in enumerate(header) if h.startswith("ppl "))
    labels = [f"{line[0]}\n{line[1]} (step {line[2]})" for line in body]
    ax.bar(range(len(body)), [line[ppl_column] or 0 for line in body], color="tab:purple")
    ax.set_xticks(range(len(body)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(header[ppl_column].replace("ppl", "perplexity at"))
    twin = ax.twinx()
    twin.plot(range(len(body)), [line[-1] or 0 for line in body], "o", color="tab:green")
    twin.set_ylim(0, 1)
    twin.set_ylabel("NIAH average (dots)")
  ax.set_title("continued pretraining, before and after")
  fig.suptitle(_record.header(record), fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
  p = _record.parser(__doc__, append=True)
  p.add_argument("--model", type=Path, default=None,
                 help="a .gguf file or Hugging Face folder (default: benchmarks.fetch_smollm2's)")
  p.add_argument("--data", type=Path, help="a pisa-prepare-data folder in the model's tokens")
  p.add_argument("--ppl-lengths", type=_ints, default=[2048, 8192])
  p.add_argument("--ruler-lengths", type=_ints, default=[1024, 2048, 4096, 8192])
  p.add_argument("--top-ks", type=_ints, default=[8, 16, 32])
  p.add_argument("--beam-factors", type=_floats, default=[2.0],
                 help="PISA's wider beams, as multiples of K")
  p.add_argument("--block-size", type=int, default=64)
  p.add_argument("--ppl-samples", type=int, default=16)
  p.add_argument("--ruler-samples", type=int, default=10)
  p.add_argument("--selection-length", type=int, default=8192, help="0: no selection part")
  p.add_argument("--selection-samples", type=int, default=2)
  p.add_argument("--batch-size", type=int, default=4)
  p.add_argument("--compute-dtype", default="auto", choices=("auto", "float32", "bfloat16"))
  p.add_argument("--implementation", default=None, choices=("xla", "pallas"),
                 help="sparse attention's (default: the library's for the device)")
  p.add_argument("--only", type=_names, default=None,
                 help="comma-separated training-free variant names, e.g. 'dense,pisa K8'")
  p.add_argument("--parts", type=_names, default=["free", "selection"],
                 help=f"comma-separated, of {PARTS} (default free,selection)")
  p.add_argument("--cpt-kinds", type=_names, default=["pisa", "bsa"])
  p.add_argument("--cpt-top-k", type=int, default=16)
  p.add_argument("--cpt-seq-len", type=int, default=8192)
  p.add_argument("--cpt-batch", type=int, default=4, help="sequences a step")
  p.add_argument("--cpt-steps", type=int, default=150,
                 help="the schedule's length (at ~1 s a step on one GPU, it fits --cpt-seconds)")
  p.add_argument("--cpt-seconds", type=float, default=240.0,
                 help="training stops here at the latest (compilation excluded)")
  p.add_argument("--cpt-set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                 help="more config overrides of the CPT runs (repeatable)")
  p.add_argument("--cpt-dir", type=Path, default=None,
                 help="keep the CPT run folders here (a new folder each); default: a temporary "
                      "folder, removed once the run is measured")
  args = p.parse_args(argv)
  unknown = [x for x in args.parts if x not in PARTS]
  if unknown:
    p.error(f"--parts: {unknown[0]!r} is not one of {PARTS}")
  if not args.replot:
    if args.model is None:
      from benchmarks.fetch_smollm2 import default_path

      args.model = default_path()
    if args.data is None:
      p.error("--data: give a pisa-prepare-data folder tokenized with the model's tokenizer "
              "(pisa-prepare-data --tokenizer RUN)")
  if not args.replot:
    for attention, top_k, _ in chosen_variants(args) + [(k, args.cpt_top_k, 0)
                                                        for k in args.cpt_kinds]:
      if attention != "dense" and top_k < 3:
        p.error(f"top_k={top_k} ({attention}) must be >= 3: the first, previous and current "
                f"blocks are forced")
  measure_into = measure
  if args.append and not args.replot and (args.out / f"{NAME}.json").is_file():
    earlier = _record.load(args.out / f"{NAME}.json")
    mismatch = append_mismatch(args, earlier)
    if mismatch:
      p.error(f"--append: {args.out / f'{NAME}.json'} was measured with {mismatch}: rows of "
              f"both would not compare; give another --out")
    kept = kept_rows(args, earlier)

    def measure_into(args, rec):
      rec.record["rows"] = kept
      rec.record["notes"] = earlier["notes"] + [
          f"{len(kept)} rows kept from the result of {earlier['date']} (commit "
          f"{earlier['commit']}, {earlier['device']})"]
      rec.save()
      measure(args, rec)

  return _record.run(NAME, args, measure_into, settings, plot, table)


if __name__ == "__main__":
  main()
