"""The paper's comparison in miniature: every attention kind trained on the same data by the
project's trainer, then evaluated by pisa-eval's code (Tables 2, 3, 6 and 7 at small scale).

  python -m benchmarks.replication --prepare              # here, with registry access: the data
  python -m benchmarks.replication --list                 # every run and whether it is done
  python -m benchmarks.replication --next 1 --out DIR     # on the GPU: the next run not done
  python -m benchmarks.replication --next 9 --time-limit 3000   # as many as fit a job's time
  python -m benchmarks.replication --run pisa-s0          # one run (or --method pisa --seed 0)
  python -m benchmarks.replication --summarize            # summary.md and plots from the JSONs

One manifest (`--manifest`, default benchmarks/replication.toml) names the backbone, the data,
the stages with their budgets, the evaluation's sample counts and the methods with their seeds.
A run is one (method, seed): each stage trains with `pisa_jax.train.trainer.train` in its own
run folder (`--workdir`), the next stage starting from its checkpoint (`train.init_from`:
parameters and Adam moments, a fresh schedule), and after each stage the stage's evaluations
run in-process (`pisa_jax.train.evaluation`: perplexity, RULER, MQAR, the selection diagnostic).
Its record, `<out>/<run>.json` (the layout of `_record.py`, one row per stage: config, tokens,
passes over the data, wall time, loss curve, every evaluation number), is rewritten after every
stage and every evaluation, so a run stopped early keeps what it finished.

A run is done when `<results>/<run>.json` (or `<out>/<run>.json`) is complete and was made from
this manifest's settings for it (`Manifest.fingerprint`); `--next` and `--run` skip done runs
(`--force` runs again). A run folder left by an interrupted run resumes from its checkpoint.
A method without a complete run is listed as pending in every table.

`--shared-device N`: this process is one of N runs started side by side on one GPU (a small
backbone leaves most of a large GPU idle). Each takes 0.9 / N of its memory
(XLA_PYTHON_CLIENT_MEM_FRACTION, unless set); the record says so, its tokens/s and wall times are
not speed figures, and a stage that matches another run's wall time refuses it (either side).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._replication_manifest import (
    DEFAULT_MANIFEST, GPT2_VOCAB, REPO, Manifest, ManifestError, Run, Stage, load_manifest,
    stage_config)
from benchmarks import _replication_report

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results" / "replication"
# --time-limit's clock (a test steps it by hand).
_clock = time.monotonic


# ----------------------------------------------------------------------------- status


def read_result(path: Path) -> dict | None:
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def status(m: Manifest, run: Run, dirs: list[Path]) -> tuple[str, Path | None]:
  """("done" | "truncated" | "stale" | "incomplete" | "pending" | "unavailable", the result file
  found). "truncated": complete, but a stage stopped at its max_seconds before its last step, so
  the summary sets it aside; `--next` leaves it (its run folder would give the same), `--run
  ... --force` with a fresh --workdir trains it again."""
  from pisa_jax.models.config import ATTENTION_KINDS

  found = []
  for folder in dirs:
    record = read_result(folder / f"{run.name}.json")
    if record is None:
      continue
    current = record.get("fingerprint") == m.fingerprint(run.method)
    if record.get("status") == "complete" and current:
      state = "truncated" if _replication_report.truncated_stages(record) else "done"
      return state, folder / f"{run.name}.json"
    found.append((current, folder / f"{run.name}.json"))
  if run.method not in ATTENTION_KINDS:
    return "unavailable", None
  if found:
    # A result of these settings that did not finish says more than one of other settings.
    current, path = max(found, key=lambda f: f[0])
    return ("incomplete" if current else "stale"), path
  return "pending", None


# ----------------------------------------------------------------------------- preflight


def set_environment(m: Manifest) -> None:
  """Points the tokenizer and RULER's haystack at the manifest's copies (before first use)."""
  d = m.data
  if d["tokenizer"]:
    os.environ["PISA_GPT2_TIKTOKEN"] = str(m.resolve(d["tokenizer"]))
  if d["ruler_dir"]:
    os.environ["PISA_DATA_DIR"] = str(m.resolve(d["ruler_dir"]))


def _unavailable(run: Run) -> str:
  from pisa_jax.models.config import ATTENTION_KINDS

  return (f"run {run.name}: model.attention={run.method!r} is not an attention kind of this "
          f"build ({', '.join(ATTENTION_KINDS)}): its rows stay pending")


def preflight(m: Manifest, run: Run) -> None:
  """Everything a run reads, checked before anything compiles: a missing file fails now, not
  after the training it would have followed."""
  from pisa_jax.models.config import ATTENTION_KINDS
  from pisa_jax.train.data import TokenWindows
  from pisa_jax.train.tokenizer import gpt2_encoding

  if run.method not in ATTENTION_KINDS:
    raise ManifestError(_unavailable(run))
  hint = "prepare it with `python -m benchmarks.replication --prepare`"
  d = m.data
  stages = m.stages_of(run.method)
  longest = max(s.seq_len for _, s in stages)
  try:
    gpt2_encoding()
    for split in ("train", "val"):
      TokenWindows(m.resolve(d["text"]), split, seq_len=1, global_batch=1, accum=1, seed=0,
                   vocab_size=GPT2_VOCAB, packing=True)
    TokenWindows(m.resolve(d["haystack"]), "train", seq_len=longest, global_batch=1, accum=1,
                 seed=0, vocab_size=GPT2_VOCAB, packing=True)
    if any(s.eval["mixture"] for _, s in stages):
      TokenWindows(m.resolve(d["haystack"]), "val", seq_len=max(
          n for _, s in stages for n in s.eval["mixture"]), global_batch=1, accum=1, seed=0,
          vocab_size=GPT2_VOCAB, packing=True)
  except (FileNotFoundError, ValueError) as e:
    raise ManifestError(f"{m.path}: data: {' '.join(str(e).splitlines())}; {hint}") from None
  from pisa_jax.train.evaluation import common
  for _, stage in stages:
    for suite in ("ppl", "selection"):
      if stage.eval[suite]:
        config = stage_config(m, run, 0, init_from=None, devices=1)
        try:
          common.check_data(config, lengths=list(stage.eval[suite]), data=None, what=suite)
        except common.EvalArgumentError as e:
          raise ManifestError(f"{m.path}: stage {stage.name!r}: eval.{suite}: {e}") from None
  ruler_lengths = sorted({n for _, s in stages for n in s.eval["ruler"]})
  if ruler_lengths:
    _check_ruler(m, ruler_lengths[0], hint)


def _check_ruler(m: Manifest, shortest: int, hint: str) -> None:
  """RULER's essays and word lists are there, and every task fits the shortest length."""
  from pisa_jax.train.evaluation import haystack, ruler

  path = haystack.essay_path()
  if not path.is_file():
    raise ManifestError(f"{m.path}: data.ruler_dir: RULER's essays {path} are missing; {hint}")
  try:
    haystack.word_lists()
  except ModuleNotFoundError as e:
    raise ManifestError(f"{m.path}: data.wheels: {e}; install the wheels of data.wheels "
                        f"first") from None
  text = haystack.load_haystack()
  for task in ruler.TASKS:
    try:
      ruler.make_samples(task, length=shortest, num_samples=1, seed=m.eval["seed"],
                         haystack=text)
    except ValueError as e:
      raise ManifestError(f"{m.path}: eval.ruler length {shortest}: {e}") from None


# ----------------------------------------------------------------------------- one run


class Record:
  """A run's result, `<out>/<run>.json`, in `_record.py`'s layout, rewritten on every change."""

  def __init__(self, m: Manifest, run: Run, out: Path):
    from pisa_jax.train.provenance import environment

    self.path = out / f"{run.name}.json"
    out.mkdir(parents=True, exist_ok=True)
    self.record = {
        "benchmark": "replication", "run": run.name, "method": run.method, "seed": run.seed,
        "status": "running", "fingerprint": m.fingerprint(run.method), **environment(),
        "settings": {"manifest": str(m.path), "backbone": m.backbone, "optimizer": m.optimizer,
                     "data": m.data, "eval": m.eval,
                     "stages": [dataclasses.asdict(s) for _, s in m.stages_of(run.method)]},
        "notes": [], "rows": [], "data": {}, "wall_seconds": None}
    self.started = time.perf_counter()
    self.save()

  def save(self) -> None:
    self.record["wall_seconds"] = round(time.perf_counter() - self.started, 1)
    tmp = self.path.with_name(self.path.name + ".tmp")
    tmp.write_text(json.dumps(self.record, indent=1, default=float) + "\n")
    os.replace(tmp, self.path)

  def note(self, text: str) -> None:
    print(f"note: {text}", flush=True)
    self.record["notes"].append(text)
    self.save()


def passes(tokens: int, mixture: dict, data: dict) -> dict:
  """How many times a stage of `tokens` training tokens reads the text and the haystack corpus:
  the needle documents' share of the tokens is haystack, the text's in mixture["text_share"] of
  them (at most: a needle document's haystack is its length less its needles and question)."""
  needles = tokens * mixture["token_fraction"]
  share = mixture.get("text_share", 0.0)
  return {"text": (tokens - needles + needles * share) / data["text_train_tokens"],
          "haystack": needles * (1 - share) / data["haystack_train_tokens"]}


def _metrics(workdir: Path) -> list[dict]:
  path = workdir / "metrics.jsonl"
  if not path.is_file():
    return []
  return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def waits_for(m: Manifest, run: Run, dirs: list[Path]) -> Run | None:
  """The run whose result a stage of `run` matches its wall time to, while that is not done."""
  for _, stage in m.stages_of(run.method):
    if stage.match_wall and stage.match_wall != run.method:
      other = Run(stage.match_wall, run.seed)
      if status(m, other, dirs)[0] != "done":
        return other
  return None


def matched_steps(m: Manifest, run: Run, stage: Stage, config, dirs: list[Path]) -> dict:
  """Steps of `stage` for `run` that take the wall time the `match_wall` run's steps took.

  That run's time is its steady-state loop time (steps x tokens per step / tokens per second);
  this run's time per step is measured on a few steps of the compiled stage from fresh
  parameters (the time of a step does not depend on the weights)."""
  import jax

  from pisa_jax.train.data import make_batches
  from pisa_jax.train.trainer import build_trainer

  other = Run(stage.match_wall, run.seed)
  state, path = status(m, other, dirs)
  if state != "done":
    raise ManifestError(f"stage {stage.name!r} of {run.name} trains for the wall time of "
                        f"{other.name}'s, which is not done ({state}): run {other.name} first")
  row = next((r for r in read_result(path)["rows"] if r["stage"] == stage.name), None)
  if row is None or not row.get("tokens_per_s"):
    raise ManifestError(f"{path} has no timed stage {stage.name!r} to match")
  if read_result(path).get("shared_device", 1) > 1:
    raise ManifestError(f"{path} shared its GPU with other runs: its wall time is no target for "
                        f"stage {stage.name!r}; run {other.name} alone")
  target = row["steps"] * row["tokens_per_step"] / row["tokens_per_s"]
  trainer = build_trainer(config)
  batches = make_batches(config, "train", global_batch=trainer.global_batch,
                         accum=config.train.grad_accum)
  state = trainer.init_state()
  timed = 3
  for i in range(timed + 1):
    if i == 1:  # the first step warms up
      jax.block_until_ready(state)
      t0 = time.perf_counter()
    state, metrics = trainer.train_step(
        state, trainer.place_batch(batches.batch(i), trainer.batch_shardings))
  jax.block_until_ready(metrics)
  per_step = (time.perf_counter() - t0) / timed
  del state, trainer
  steps = max(1, int(target / per_step))
  print(f"== {run.name}: {stage.name}: {other.name} trained {target:.1f} s; at {per_step:.3f} s "
        f"a step that is {steps} steps", flush=True)
  return {"run": other.name, "target_seconds": target, "seconds_per_step": per_step,
          "steps": steps}


def train_stage(m: Manifest, run: Run, index: int, workdir: Path, init_from: Path | None,
                record: Record, *, progress: bool, dirs: list[Path],
                shared_device: int = 1) -> dict:
  """Trains one stage (or finds it trained in `workdir`) and returns its row. shared_device:
  the runs this process trains beside (its stage.json keeps it for a later reuse)."""
  import jax

  from pisa_jax.configs import validate
  from pisa_jax.models.decoder import count_params
  from pisa_jax.train.trainer import build_trainer, train

  stage = m.stages[index]
  config = stage_config(m, run, index, init_from=None if init_from is None else str(init_from),
                        devices=jax.device_count())
  print(f"== {run.name}: stage {stage.name} ({stage.steps} steps of {stage.batch} x "
        f"{stage.seq_len} tokens, K={stage.top_k}, RoPE base {stage.rope_base:g})", flush=True)
  done_file = workdir / "stage.json"
  matched = None
  if stage.match_wall and stage.match_wall != run.method and not done_file.is_file():
    matched = matched_steps(m, run, stage, config, dirs)
    config = validate(dataclasses.replace(config, train=dataclasses.replace(
        config.train, steps=matched["steps"], checkpoint_every=matched["steps"])))
  if done_file.is_file():
    timing = json.loads(done_file.read_text())
    if timing.get("matched_wall"):
      steps = timing["matched_wall"]["steps"]
      config = dataclasses.replace(config, train=dataclasses.replace(
          config.train, steps=steps, checkpoint_every=steps))
    if timing["config"] != json.loads(config.to_json()):
      raise ManifestError(f"--workdir: {workdir} holds stage {stage.name} trained with other "
                          f"settings; remove it or give another --workdir")
    record.note(f"stage {stage.name}: trained earlier in {workdir}; its timing is reused")
    # Its tokens/s were measured beside other runs when that stage was: the record says so.
    shared = timing.get("shared_device", 1)
    if shared > record.record["shared_device"]:
      record.record["shared_device"] = shared
      record.note(f"stage {stage.name} trained beside {shared - 1} other run(s) on the same "
                  f"GPU: tokens/s and wall times are not speed figures")
  else:
    t0 = time.perf_counter()
    trainer = build_trainer(config)
    compile_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    result = train(config, workdir, max_seconds=stage.max_seconds, progress=progress,
                   print_config=False, trainer=trainer)
    if result.start_step > 0:
      record.note(f"stage {stage.name}: resumed at step {result.start_step} from a checkpoint "
                  f"in {workdir}; its train_seconds count this process's steps only")
    losses = [result.losses[s] for s in sorted(result.losses)]
    tail = losses[-max(1, len(losses) // 20):]
    timing = {"compile_seconds": round(compile_s, 1),
              "train_seconds": round(time.perf_counter() - t1, 1),
              "end_step": result.end_step, "truncated": result.end_step < config.train.steps,
              "final_loss": float(sum(tail) / len(tail)) if tail else None,
              "tokens_per_step": trainer.tokens_per_step,
              "mixture": _mixture(config, trainer.global_batch),
              "config": json.loads(config.to_json()), "matched_wall": matched,
              "shared_device": shared_device}
    done_file.write_text(json.dumps(timing) + "\n")
    del trainer
  rows = _metrics(workdir)
  logged = [r for r in rows if "tokens_per_s" in r]
  steady = logged[1:] or logged
  tokens = timing["end_step"] * timing["tokens_per_step"]
  mixture = timing["mixture"]
  row = {
      "stage": stage.name, "config": config.to_dict(), "params": count_params(config.model),
      "steps": timing["end_step"], "planned_steps": config.train.steps,
      "truncated": timing["truncated"], "matched_wall": timing.get("matched_wall"),
      "tokens": tokens, "tokens_per_step": timing["tokens_per_step"],
      "passes": passes(tokens, mixture, record.record["data"]),
      "mixture": mixture, "compile_seconds": timing["compile_seconds"],
      "train_seconds": timing["train_seconds"],
      "tokens_per_s": (sum(r["tokens_per_s"] for r in steady) / len(steady)) if steady else None,
      "final_loss": timing["final_loss"] if timing["final_loss"] is not None
      else (logged[-1]["loss"] if logged else None),
      "loss_curve": [[r["step"], r["loss"]] for r in logged],
      "lr_curve": [[r["step"], r["lr"]] for r in logged], "eval": {}}
  if timing["truncated"]:
    record.note(f"stage {stage.name} stopped at step {timing['end_step']} of "
                f"{config.train.steps} "
                f"(max_seconds={stage.max_seconds}): its schedule did not finish, so this run is "
                f"not comparable with the others; raise max_seconds or lower steps")
  return row


def _mixture(config, global_batch: int) -> dict:
  from pisa_jax.train.data import make_batches

  source = make_batches(config, "train", global_batch=global_batch,
                        accum=config.train.grad_accum)
  return source.describe()


def evaluate_stage(m: Manifest, run: Run, stage, workdir: Path, row: dict, record: Record, *,
                   progress: bool) -> None:
  """The stage's evaluations on its checkpoint, each saved into `row["eval"]` as it ends."""
  from pisa_jax.train.evaluation import induction, mixture, mqar, needles, perplexity, selection
  from pisa_jax.train.restore import restore_model

  suites = {k: list(v) for k, v in stage.eval.items() if v}
  if run.method not in m.eval["selection_methods"]:
    suites.pop("selection", None)
  if not suites:
    return
  config, model, step = restore_model(workdir)
  e = m.eval
  kw = dict(seed=e["seed"], progress=progress)
  for suite, lengths in suites.items():
    print(f"== {run.name}: {stage.name}: {suite} at {lengths}", flush=True)
    t0 = time.perf_counter()
    if suite == "ppl":
      part = perplexity.run_perplexity(model, config, lengths=lengths, samples=e["ppl_samples"],
                                       data=None, batch_size=e["batch_size"], **kw)
    elif suite == "ruler":
      part, records = needles.run_ruler(model, config, lengths=lengths,
                                        samples=e["ruler_samples"], batch_size=e["batch_size"],
                                        answer_scores=True, **kw)
      part["records"] = [{k: r[k] for k in ("task", "family", "length", "index", "score",
                                            "depths", "new_tokens", "answer_hit") if k in r}
                         | {"prediction": r["prediction"][:80]} for r in records]
    elif suite == "mixture":
      part = mixture.run_mixture(model, config, lengths=lengths, samples=e["mixture_samples"],
                                 batch_size=e["batch_size"], **kw)
      part["records"] = part["records"][:400]
    elif suite == "mqar":
      pairs = [p for p in e["mqar_pairs"] if 4 * p <= lengths[-1]]
      part = mqar.run_mqar(model, config, lengths=lengths, pairs=pairs,
                           samples=e["mqar_samples"], batch_size=e["batch_size"], **kw)
    elif suite == "induction":
      part = induction.run_induction(model, config, lengths=lengths,
                                     samples=e["induction_samples"], data=None,
                                     batch_size=e["batch_size"], **kw)
    else:
      part = selection.run_on_checkpoint(
          model, config, lengths=lengths, samples=e["selection_samples"], data=None,
          block_size=config.model.block_size, top_ks=list(e["selection_top_k"]),
          beam_factors=list(e["selection_beam_factors"]), **kw)
    part["checkpoint_step"] = step
    part["wall_seconds"] = round(time.perf_counter() - t0, 1)
    row["eval"][suite] = part
    record.save()


def run_one(m: Manifest, run: Run, *, out: Path, workdir: Path, progress: bool,
            dirs: list[Path] = (), shared_device: int = 1) -> dict:
  """The whole pipeline of one run: every stage, trained then evaluated; returns the record.
  shared_device: the number of runs sharing this GPU (the module docstring)."""
  preflight(m, run)
  if shared_device > 1 and any(s.match_wall for _, s in m.stages_of(run.method)):
    raise ManifestError(f"--shared-device {shared_device}: run {run.name} has a stage that "
                        f"matches wall times (match_wall), which needs the GPU to itself")
  metas = {key: prepared_meta(m, key) for key in ("text", "haystack")}
  record = Record(m, run, out)
  r = record.record
  r["shared_device"] = shared_device
  if shared_device > 1:
    record.note(f"trained beside {shared_device - 1} other run(s) on the same GPU: tokens/s and "
                f"wall times are not speed figures")
  for key, meta in metas.items():
    r["data"][f"{key}_train_tokens"] = meta["train_tokens"]
    r["data"][f"{key}_val_tokens"] = meta["val_tokens"]
    r["data"][f"{key}_sources"] = meta["sources"]
  record.save()
  previous = None
  try:
    for index, stage in m.stages_of(run.method):
      folder = workdir / run.name / stage.name
      row = train_stage(m, run, index, folder, previous, record, progress=progress,
                        dirs=[*dirs, out], shared_device=shared_device)
      r["rows"].append(row)
      record.save()
      evaluate_stage(m, run, stage, folder, row, record, progress=progress)
      previous = folder
  except BaseException as e:
    r["status"] = "failed"
    r["notes"].append(f"failed: {type(e).__name__}: {' '.join(str(e).splitlines())[:500]}")
    record.save()
    raise
  r["status"] = "complete"
  record.save()
  print(f"wrote {record.path} ({r['wall_seconds']} s)", flush=True)
  return r


# ----------------------------------------------------------------------------- prepare


def _corpus_names(meta: dict) -> list[str]:
  """The --corpus names a pisa-prepare-data folder was made from ("gcide:dict-gcide_....deb")."""
  return [source.split(":", 1)[0] for source in meta.get("sources", [])]


def prepared_meta(m: Manifest, key: str) -> dict:
  """meta.json of the manifest's data.`key` folder ("text" or "haystack"), refused when it was
  prepared from other corpora than data.`key`_corpora names: a run never trains on stale data."""
  folder = m.resolve(m.data[key])
  path = folder / "meta.json"
  if not path.is_file():
    raise ManifestError(f"{m.path}: data.{key}: {folder} holds no prepared corpus (meta.json): "
                        f"run `python -m benchmarks.replication --prepare` first")
  meta = json.loads(path.read_text())
  corpora = list(m.data[f"{key}_corpora"])
  if corpora and _corpus_names(meta) != corpora:
    raise ManifestError(f"{m.path}: data.{key}_corpora = {corpora}, but {folder} was prepared "
                        f"from {_corpus_names(meta)}: run `python -m benchmarks.replication "
                        f"--prepare` again")
  return meta


def prepare(m: Manifest) -> None:
  """Everything a machine without registry access needs, into the manifest's data folders: the
  two corpora (pisa-prepare-data), RULER's essays, the GPT-2 BPE file and the wonderwords wheel."""
  from pisa_jax.train import prepare_data
  from pisa_jax.train.evaluation import haystack
  from pisa_jax.train.tokenizer import gpt2_bpe_path

  d = m.data
  for key in ("text", "haystack"):
    folder, corpora = m.resolve(d[key]), d[f"{key}_corpora"]
    if (folder / "meta.json").is_file():
      made_from = _corpus_names(json.loads((folder / "meta.json").read_text()))
      if not corpora or made_from == list(corpora):
        print(f"kept {folder}")
        continue
      print(f"{folder} was prepared from {made_from}; data.{key}_corpora names "
            f"{list(corpora)}: preparing it again", flush=True)
    if not corpora:
      raise ManifestError(f"{m.path}: data.{key}_corpora is empty: nothing to prepare {folder} "
                          f"from")
    prepare_data.main([a for c in corpora for a in ("--corpus", c)] + ["--out", str(folder)])
  if d["ruler_dir"]:
    haystack.load_haystack(m.resolve(d["ruler_dir"]))
    print(f"RULER's essays: {haystack.essay_path(m.resolve(d['ruler_dir']))}")
  if d["tokenizer"]:
    target = m.resolve(d["tokenizer"])
    source = gpt2_bpe_path()
    if source is None:
      raise ManifestError(f"{m.path}: data.tokenizer: no gpt2.tiktoken to copy: pip install "
                          f"--no-deps openai-whisper==20250625")
    if source.resolve() != target.resolve():
      target.parent.mkdir(parents=True, exist_ok=True)
      shutil.copyfile(source, target)
    print(f"tokenizer: {target}")
  if d["wheels"]:
    from importlib.metadata import version

    folder = m.resolve(d["wheels"])
    spec = f"wonderwords=={version('wonderwords')}"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "-d", str(folder), spec], check=True)
    print(f"wheels: {', '.join(p.name for p in sorted(folder.glob('*.whl')))}")
  roots = {m.resolve(d[k]).parent for k in ("text", "haystack")}
  size = sum(p.stat().st_size for root in roots for p in root.rglob("*") if p.is_file())
  print(f"prepared {', '.join(map(str, sorted(roots)))}: {size / 2**20:.1f} MiB in all")


# ----------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="replication", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--manifest", type=Path, default=DEFAULT_MANIFEST)
  what = p.add_mutually_exclusive_group(required=True)
  what.add_argument("--run", help="one run by name, e.g. pisa-s0")
  what.add_argument("--method", help="with --seed: one run")
  what.add_argument("--next", type=int, metavar="N", help="the next N runs not done")
  what.add_argument("--list", action="store_true", help="every run and its status")
  what.add_argument("--summarize", action="store_true",
                    help="summary.md and plots into --results from its JSONs (no GPU)")
  what.add_argument("--prepare", action="store_true",
                    help="fetch and tokenise the data, RULER's essays, the tokenizer, wheels")
  p.add_argument("--seed", type=int, help="with --method")
  p.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                 help=f"results read to skip runs already done (default {DEFAULT_RESULTS})")
  p.add_argument("--out", type=Path, help="where new results go (default: --results)")
  p.add_argument("--workdir", type=Path, default=REPO / "runs" / "replication",
                 help="run folders (checkpoints); a run found there resumes")
  p.add_argument("--force", action="store_true", help="run even when the result is done")
  p.add_argument("--readme", type=Path, default=REPO / "README.md",
                 help="--summarize rewrites the block between its replication markers")
  p.add_argument("--no-progress", action="store_true")
  p.add_argument("--time-limit", type=float, metavar="SECONDS",
                 help="with --next: start another run only while the time left of SECONDS "
                      "(from this command's start) exceeds the longest run so far; exit 3 "
                      "when runs are left")
  p.add_argument("--shared-device", type=int, default=1, metavar="N",
                 help="this run is one of N started side by side on one GPU (0.9 / N of its "
                      "memory each; not speed figures)")
  return p


def main(argv: list[str] | None = None) -> int:
  started = _clock()
  parser = _parser()
  args = parser.parse_args(argv)
  if (args.method is None) != (args.seed is None):
    parser.error("--method and --seed go together")
  if args.time_limit is not None and (args.next is None or args.time_limit <= 0):
    parser.error(f"--time-limit {args.time_limit} must be > 0 and goes with --next")
  try:
    m = load_manifest(args.manifest)
    out = args.out or args.results
    dirs = [args.results] + ([out] if out != args.results else [])
    if args.summarize:
      _replication_report.summarize(m, args.results, readme=args.readme)
      return 0
    if args.list:
      for run in m.runs:
        state, path = status(m, run, dirs)
        print(f"{run.name:<12} {state:<12} {path or ''}")
      return 0
    if args.prepare:
      prepare(m)
      return 0
    if args.next is not None:
      if args.next < 1:
        raise ManifestError(f"--next {args.next} must be >= 1")
      runs = [r for r in m.runs if status(m, r, dirs)[0] in ("pending", "stale", "incomplete")]
      waiting = {r: other for r in runs if (other := waits_for(m, r, dirs)) is not None}
      for r, other in waiting.items():
        if status(m, other, dirs)[0] == "truncated":
          print(f"{r.name} waits for {other.name}, which stopped at its max_seconds: raise it "
                f"and run `--run {other.name} --force` with a fresh --workdir")
        else:
          print(f"{r.name} waits for {other.name}: later")
        runs.remove(r)
      runs = runs[:args.next]
      if not runs:
        print("every run of the manifest is done (or waits for its attention kind)")
        return 0
    else:
      run = m.run(args.run) if args.run else m.run(Run(args.method, args.seed).name)
      state, path = status(m, run, dirs)
      if state in ("done", "truncated") and not args.force:
        print(f"{run.name}: {state} ({path}); --force runs it again")
        return 0
      if state == "unavailable":
        raise ManifestError(_unavailable(run))
      if (other := waits_for(m, run, dirs)) is not None:
        raise ManifestError(f"run {run.name} matches a stage's wall time to {other.name}, which "
                            f"is not done: run {other.name} first")
      runs = [run]
    if args.shared_device < 1:
      raise ManifestError(f"--shared-device {args.shared_device} must be >= 1")
    if args.shared_device > 1:
      # Before jax starts: each process preallocates its share, not 75% of the GPU.
      os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / args.shared_device:.3f}")
    set_environment(m)
    from pisa_jax.train import compilation_cache

    compilation_cache.enable_for(parser)
    longest = 0.0
    for run in runs:
      left = args.time_limit - (_clock() - started) if args.time_limit else None
      if left is not None and longest and left < longest:
        # A run cut off by the job's end keeps only what it finished: not worth starting.
        print(f"stopping before {run.name}: {left:.0f} s of --time-limit left, and a run here "
              f"took {longest:.0f} s; rerun to go on")
        return 3
      t0 = _clock()
      run_one(m, run, out=out, workdir=args.workdir, progress=not args.no_progress, dirs=dirs,
              shared_device=args.shared_device)
      longest = max(longest, _clock() - t0)
    return 0
  except ManifestError as e:
    print(f"replication: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
