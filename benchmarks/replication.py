"""The paper's comparison in miniature: every attention kind trained on the same data by the
project's trainer, then evaluated by pisa-eval's code (Tables 2, 3, 6 and 7 at small scale).

  python -m benchmarks.replication --prepare              # here, with registry access: the data
  python -m benchmarks.replication --list                 # every run and whether it is done
  python -m benchmarks.replication --next 1 --out DIR     # on the GPU: the next run not done
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
Methods whose attention kind this build lacks (nsa, hils) are listed as pending.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MANIFEST = Path(__file__).resolve().parent / "replication.toml"
DEFAULT_RESULTS = Path(__file__).resolve().parent / "results" / "replication"
GPT2_VOCAB = 50_257
EVAL_SUITES = ("ppl", "ruler", "mqar", "selection")


class ManifestError(ValueError):
  """A manifest or run that cannot be used; the message is one line naming the field."""


# ----------------------------------------------------------------------------- manifest

_REQUIRED = object()
_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
          "ints": "a list of positive integers", "seeds": "a list of integers >= 0",
          "floats": "a list of numbers",
          "strs": "a list of strings", "table": "a table"}


def _value(value: Any, kind, where: str) -> Any:
  optional = isinstance(kind, tuple)
  kind = kind[0] if optional else kind
  ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str), bool: lambda v: isinstance(v, bool),
        "ints": lambda v: isinstance(v, list) and all(
            isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v),
        "seeds": lambda v: isinstance(v, list) and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v),
        "floats": lambda v: isinstance(v, list) and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in v),
        "strs": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        "table": lambda v: isinstance(v, dict)}[kind]
  if not ok(value):
    raise ManifestError(f"{where}={value!r} must be {_KINDS[kind]}")
  if kind is float:
    return float(value)
  if kind in ("ints", "seeds", "strs"):
    return tuple(value)
  if kind == "floats":
    return tuple(float(x) for x in value)
  return value


def _table(raw: Any, spec: dict, where: str) -> dict:
  """`raw` checked against `spec` (name -> (kind, default)); (kind,) marks an optional value."""
  if not isinstance(raw, dict):
    raise ManifestError(f"{where} must be a table")
  unknown = sorted(set(raw) - set(spec))
  if unknown:
    raise ManifestError(f"{where}.{unknown[0]} is not a field of {where}: expected one of "
                        f"{', '.join(spec)}")
  out = {}
  for name, (kind, default) in spec.items():
    if name not in raw:
      if default is _REQUIRED:
        raise ManifestError(f"{where}.{name} is missing: it must be "
                            f"{_KINDS[kind[0] if isinstance(kind, tuple) else kind]}")
      out[name] = default
    else:
      out[name] = _value(raw[name], kind, f"{where}.{name}")
  return out


_BACKBONE = {
    "num_layers": (int, _REQUIRED), "d_model": (int, _REQUIRED), "mlp_dim": (int, _REQUIRED),
    "num_heads": (int, _REQUIRED), "num_kv_heads": (int, _REQUIRED),
    "head_dim": (int, _REQUIRED), "block_size": (int, 64), "branching": (int, 2),
    "beam": ((int,), None), "init_std": (float, 0.02), "norm_eps": (float, 1e-5),
    "vocab_pad_multiple": (int, 256), "param_dtype": (str, "float32"),
    "compute_dtype": (str, "auto"), "attention_implementation": ((str,), None),
}
_OPTIMIZER = {"adam_b1": (float, 0.9), "adam_b2": (float, 0.95), "adam_eps": (float, 1e-8),
              "weight_decay": (float, 0.1), "grad_clip": (float, 1.0)}
_DATA = {
    "text": (str, _REQUIRED), "text_corpora": ("strs", ()), "haystack": (str, _REQUIRED),
    "haystack_corpora": ("strs", ()), "tokenizer": ((str,), None), "ruler_dir": ((str,), None),
    "wheels": ((str,), None), "retrieval_fraction": (float, _REQUIRED),
    "retrieval_min_length": (int, 256), "retrieval_answer_weight": (float, 1.0),
}
_STAGE = {
    "name": (str, _REQUIRED), "enabled": (bool, True), "methods": (("strs",), None),
    "seq_len": (int, _REQUIRED), "top_k": (int, _REQUIRED), "rope_base": (float, _REQUIRED),
    "batch": (int, _REQUIRED), "grad_accum": (int, 1), "steps": (int, _REQUIRED),
    "peak_lr": (float, _REQUIRED), "warmup_fraction": (float, 0.1),
    "lr_schedule": (str, "cosine"), "final_lr_ratio": (float, 0.1),
    "loss_chunk": ((int,), None), "remat": (str, "none"), "max_seconds": ((float,), None),
    "log_every": (int, 10), "match_wall": ((str,), None), "eval": ("table", {}),
}
_STAGE_EVAL = {name: ("ints", ()) for name in EVAL_SUITES}
_EVAL = {
    "seed": (int, 0), "batch_size": (int, 8), "ppl_samples": (int, 8), "ruler_samples": (int, 4),
    "mqar_samples": (int, 16), "mqar_pairs": ("ints", (16, 64)), "selection_samples": (int, 2),
    "selection_top_k": ("ints", (8,)), "selection_beam_factors": ("floats", (1.0, 2.0)),
    "selection_methods": ("strs", ("dense",)),
}
_METHOD = {"name": (str, _REQUIRED), "seeds": ("seeds", _REQUIRED)}
_SUMMARY = {"pretrain": ((str,), None), "cpt": ((str,), None), "long": ((str,), None)}
_TOP = {"backbone", "optimizer", "data", "stage", "eval", "method", "summary"}


@dataclasses.dataclass(frozen=True)
class Stage:
  name: str
  enabled: bool
  methods: tuple[str, ...] | None
  seq_len: int
  top_k: int
  rope_base: float
  batch: int
  grad_accum: int
  steps: int
  peak_lr: float
  warmup_fraction: float
  lr_schedule: str
  final_lr_ratio: float
  loss_chunk: int | None
  remat: str
  max_seconds: float | None
  log_every: int
  # A method whose run of the same seed sets this stage's wall time: the other methods train
  # for as many steps as fit in the time its steps took (same wall time, not same tokens).
  match_wall: str | None
  eval: dict  # suite -> lengths

  def runs_for(self, method: str) -> bool:
    return self.enabled and (self.methods is None or method in self.methods)


@dataclasses.dataclass(frozen=True)
class Run:
  method: str
  seed: int

  @property
  def name(self) -> str:
    return f"{self.method}-s{self.seed}"


@dataclasses.dataclass(frozen=True)
class Manifest:
  path: Path
  backbone: dict
  optimizer: dict
  data: dict
  stages: tuple[Stage, ...]
  eval: dict
  methods: tuple[tuple[str, tuple[int, ...]], ...]
  summary: dict

  @property
  def runs(self) -> list[Run]:
    """Seed 0 of every method in manifest order, then the next seed of each, and so on."""
    seeds = sorted({s for _, ss in self.methods for s in ss})
    return [Run(m, s) for s in seeds for m, ss in self.methods if s in ss]

  def run(self, name: str) -> Run:
    for r in self.runs:
      if r.name == name:
        return r
    raise ManifestError(f"--run {name}: not a run of {self.path} (runs: "
                        f"{', '.join(r.name for r in self.runs)})")

  def stages_of(self, method: str) -> list[tuple[int, Stage]]:
    return [(i, s) for i, s in enumerate(self.stages) if s.runs_for(method)]

  def fingerprint(self, method: str) -> str:
    """A hash of every setting a run of `method` depends on: the backbone, optimizer, data and
    evaluation, and the stages it trains (not the list of runs, the other methods' stages, or
    max_seconds and log_every, which change no result of a run that finished). A result counts
    for this manifest only with its method's fingerprint."""
    stages = []
    for _, stage in self.stages_of(method):
      fields = dataclasses.asdict(stage)
      for name in ("enabled", "methods", "max_seconds", "log_every"):
        fields.pop(name)
      if fields["match_wall"] == method:
        fields["match_wall"] = None  # the run that sets the time trains as it would alone
      stages.append(fields)
    settled = {"backbone": self.backbone, "optimizer": self.optimizer,
               "data": _data_settings(self.data), "eval": self.eval, "stages": stages}
    return hashlib.sha256(json.dumps(settled, sort_keys=True, default=list)
                          .encode()).hexdigest()[:12]

  def stage(self, name: str | None) -> Stage | None:
    return next((s for s in self.stages if s.name == name), None)

  def resolve(self, path: str | None) -> Path | None:
    """A data path of the manifest: relative ones are relative to the repository root."""
    return None if path is None else (REPO / path if not Path(path).is_absolute() else Path(path))


def load_manifest(path: str | Path) -> Manifest:
  """The manifest at `path`, checked: ManifestError (one line naming the field) otherwise."""
  path = Path(path)
  try:
    raw = tomllib.loads(path.read_text())
  except OSError as e:
    raise ManifestError(f"--manifest {path}: cannot read it: {e.strerror}") from None
  except tomllib.TOMLDecodeError as e:
    raise ManifestError(f"{path}: not TOML: {e}") from None
  where = str(path)
  unknown = sorted(set(raw) - _TOP)
  if unknown:
    raise ManifestError(f"{where}: unknown section {unknown[0]!r}: expected {sorted(_TOP)}")
  for name in ("backbone", "data", "stage", "method"):
    if name not in raw:
      raise ManifestError(f"{where}: the section [{name}] is missing")
  backbone = _table(raw["backbone"], _BACKBONE, f"{where}: backbone")
  optimizer = _table(raw.get("optimizer", {}), _OPTIMIZER, f"{where}: optimizer")
  data = _table(raw["data"], _DATA, f"{where}: data")
  ev = _table(raw.get("eval", {}), _EVAL, f"{where}: eval")
  summary = _table(raw.get("summary", {}), _SUMMARY, f"{where}: summary")
  if not isinstance(raw["stage"], list) or not raw["stage"]:
    raise ManifestError(f"{where}: [[stage]] must list at least one stage")
  stages = []
  for i, table in enumerate(raw["stage"]):
    fields = _table(table, _STAGE, f"{where}: stage[{i}]")
    fields["eval"] = _table(fields["eval"], _STAGE_EVAL, f"{where}: stage[{i}].eval")
    stages.append(Stage(**fields))
  names = [s.name for s in stages]
  for name in names:
    if names.count(name) > 1:
      raise ManifestError(f"{where}: stage name {name!r} is used twice")
  if not isinstance(raw["method"], list) or not raw["method"]:
    raise ManifestError(f"{where}: [[method]] must list at least one method")
  methods = []
  for i, table in enumerate(raw["method"]):
    fields = _table(table, _METHOD, f"{where}: method[{i}]")
    if not fields["seeds"]:
      raise ManifestError(f"{where}: method[{i}].seeds is empty: give at least one seed")
    if fields["name"] in [m for m, _ in methods]:
      raise ManifestError(f"{where}: method {fields['name']!r} is listed twice")
    methods.append((fields["name"], fields["seeds"]))
  manifest = Manifest(path=path, backbone=backbone, optimizer=optimizer, data=data,
                      stages=tuple(stages), eval=ev, methods=tuple(methods), summary=summary)
  _check(manifest)
  return manifest


def _data_settings(data: dict) -> dict:
  """The data fields that shape a result: the corpora and the mixture (not the folders they are
  kept in, nor where the tools and wheels are)."""
  return {k: v for k, v in data.items()
          if k not in ("text", "haystack", "tokenizer", "ruler_dir", "wheels")}


def _check(m: Manifest) -> None:
  """Every stage's config through `configs.validate` (for a dense and a sparse method), the
  evaluation lengths against the stage, the summary's stage names."""
  from pisa_jax.configs import validate
  from pisa_jax.models.config import SPARSE_ATTENTION_KINDS

  where = str(m.path)
  e = m.eval
  for name in ("batch_size", "ppl_samples", "ruler_samples", "mqar_samples", "selection_samples"):
    if e[name] < 1:
      raise ManifestError(f"{where}: eval.{name}={e[name]} must be >= 1")
  if not e["mqar_pairs"] or not e["selection_top_k"] or not e["selection_beam_factors"]:
    raise ManifestError(f"{where}: eval.mqar_pairs, eval.selection_top_k and "
                        f"eval.selection_beam_factors must each list at least one value")
  if any(not f >= 1 for f in e["selection_beam_factors"]):
    raise ManifestError(f"{where}: eval.selection_beam_factors={list(e['selection_beam_factors'])} "
                        f"must all be >= 1 (beam = factor x K)")
  known = [name for name, _ in m.methods]
  for i, stage in enumerate(m.stages):
    at = f"{where}: stage {stage.name!r}"
    for method in stage.methods or ():
      if method not in known:
        raise ManifestError(f"{at}: methods lists {method!r}, which is no [[method]] of the "
                            f"manifest ({', '.join(known)})")
    if stage.match_wall is not None and (stage.match_wall not in known or stage.methods
                                         and stage.match_wall not in stage.methods):
      raise ManifestError(f"{at}: match_wall={stage.match_wall!r} is no method of this stage "
                          f"({', '.join(stage.methods or known)})")
    if stage.max_seconds is not None and not stage.max_seconds > 0:
      raise ManifestError(f"{at}: max_seconds={stage.max_seconds} must be > 0")
    previous = [s for s in m.stages[:i] if s.enabled]
    for kind in ("dense", SPARSE_ATTENTION_KINDS[0]):
      config = stage_config(m, Run(kind, 0), i, init_from="checked" if previous else None,
                            devices=1)
      try:
        validate(config)
      except ValueError as err:
        raise ManifestError(f"{at}: {err}") from None
    for suite, lengths in stage.eval.items():
      if list(lengths) != sorted(set(lengths)):
        raise ManifestError(f"{at}: eval.{suite}={list(lengths)} must be increasing")
      if lengths and lengths[-1] > stage.seq_len:
        raise ManifestError(f"{at}: eval.{suite} length {lengths[-1]} exceeds the stage's "
                            f"seq_len={stage.seq_len} (the context the model trained at)")
    if stage.eval["selection"] and stage.eval["selection"][0] < m.backbone["block_size"]:
      raise ManifestError(f"{at}: eval.selection length {stage.eval['selection'][0]} is below "
                          f"backbone.block_size={m.backbone['block_size']}")
    if stage.eval["mqar"] and not [p for p in e["mqar_pairs"] if 4 * p <= stage.eval["mqar"][-1]]:
      raise ManifestError(f"{at}: no eval.mqar_pairs fits eval.mqar's longest length "
                          f"{stage.eval['mqar'][-1]} (4 tokens a pair)")
  for role, name in m.summary.items():
    if name is not None and m.stage(name) is None:
      raise ManifestError(f"{where}: summary.{role}={name!r} names no stage (stages: "
                          f"{', '.join(s.name for s in m.stages)})")


def stage_config(m: Manifest, run: Run, index: int, *, init_from: str | None, devices: int):
  """The trainer's Config of stage `index` of `run`: the backbone with the stage's K and RoPE
  base, the run's attention, the shared data and optimizer, the stage's schedule. Every method
  gets the same config but for model.attention; the data seed is the run's seed, offset per
  stage so that each stage draws its own windows."""
  from pisa_jax.configs import Config, DataConfig, ModelConfig, TrainConfig
  from pisa_jax.models.config import SPARSE_ATTENTION_KINDS

  stage = m.stages[index]
  if stage.batch % devices:
    raise ManifestError(f"{m.path}: stage {stage.name!r}: batch={stage.batch} must divide over "
                        f"the {devices} devices")
  backbone = dict(m.backbone)
  if run.method not in SPARSE_ATTENTION_KINDS:
    # The kernels' choice applies to the sparse kinds; dense attention is jax's own.
    backbone["attention_implementation"] = None
  model = ModelConfig(vocab_size=GPT2_VOCAB, attention=run.method, top_k=stage.top_k,
                      rope_base=stage.rope_base, remat=stage.remat, **backbone)
  d = m.data
  data = DataConfig(source="tokens", path=str(m.resolve(d["text"])), packing=True,
                    retrieval_fraction=d["retrieval_fraction"],
                    retrieval_path=str(m.resolve(d["haystack"])),
                    retrieval_min_length=d["retrieval_min_length"],
                    retrieval_answer_weight=d["retrieval_answer_weight"])
  train = TrainConfig(
      seq_len=stage.seq_len, per_device_batch=stage.batch // devices,
      grad_accum=stage.grad_accum, steps=stage.steps, peak_lr=stage.peak_lr,
      final_lr_ratio=stage.final_lr_ratio, lr_schedule=stage.lr_schedule, warmup_steps=0,
      warmup_fraction=stage.warmup_fraction, decay_steps=0, seed=run.seed + 1000 * index,
      checkpoint_every=stage.steps, keep_checkpoints=1, async_checkpointing=False,
      log_every=stage.log_every, eval_every=10 ** 9, eval_batches=0,
      loss_chunk=stage.loss_chunk, init_from=init_from, **m.optimizer)
  return Config(model=model, data=data, train=train)


# ----------------------------------------------------------------------------- status


def read_result(path: Path) -> dict | None:
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def status(m: Manifest, run: Run, dirs: list[Path]) -> tuple[str, Path | None]:
  """("done" | "stale" | "incomplete" | "pending" | "unavailable", the result file found)."""
  from pisa_jax.models.config import ATTENTION_KINDS

  found = []
  for folder in dirs:
    record = read_result(folder / f"{run.name}.json")
    if record is None:
      continue
    current = record.get("fingerprint") == m.fingerprint(run.method)
    if record.get("status") == "complete" and current:
      return "done", folder / f"{run.name}.json"
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
                record: Record, *, progress: bool, dirs: list[Path]) -> dict:
  """Trains one stage (or finds it trained in `workdir`) and returns its row."""
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
  else:
    t0 = time.perf_counter()
    trainer = build_trainer(config)
    compile_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    result = train(config, workdir, max_seconds=stage.max_seconds, progress=progress,
                   print_config=False, trainer=trainer)
    losses = [result.losses[s] for s in sorted(result.losses)]
    tail = losses[-max(1, len(losses) // 20):]
    timing = {"compile_seconds": round(compile_s, 1),
              "train_seconds": round(time.perf_counter() - t1, 1),
              "end_step": result.end_step, "truncated": result.end_step < config.train.steps,
              "final_loss": float(sum(tail) / len(tail)) if tail else None,
              "tokens_per_step": trainer.tokens_per_step,
              "mixture": _mixture(config, trainer.global_batch),
              "config": json.loads(config.to_json()), "matched_wall": matched}
    done_file.write_text(json.dumps(timing) + "\n")
    del trainer
  rows = _metrics(workdir)
  logged = [r for r in rows if "tokens_per_s" in r]
  steady = logged[1:] or logged
  tokens = timing["end_step"] * timing["tokens_per_step"]
  mixture = timing["mixture"]
  text_tokens = tokens * (1 - mixture["token_fraction"])
  row = {
      "stage": stage.name, "config": config.to_dict(), "params": count_params(config.model),
      "steps": timing["end_step"], "planned_steps": config.train.steps,
      "truncated": timing["truncated"], "matched_wall": timing.get("matched_wall"),
      "tokens": tokens, "tokens_per_step": timing["tokens_per_step"],
      "passes": {"text": text_tokens / record.record["data"]["text_train_tokens"],
                 # At most: a needle document's haystack is its length less its needles and
                 # question.
                 "haystack": tokens * mixture["token_fraction"]
                 / record.record["data"]["haystack_train_tokens"]},
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
  from pisa_jax.train.evaluation import mqar, needles, perplexity, selection
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
                                        **kw)
      part["records"] = [{k: r[k] for k in ("task", "family", "length", "index", "score",
                                            "depths", "new_tokens")}
                         | {"prediction": r["prediction"][:80]} for r in records]
    elif suite == "mqar":
      pairs = [p for p in e["mqar_pairs"] if 4 * p <= lengths[-1]]
      part = mqar.run_mqar(model, config, lengths=lengths, pairs=pairs,
                           samples=e["mqar_samples"], batch_size=e["batch_size"], **kw)
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
            dirs: list[Path] = ()) -> dict:
  """The whole pipeline of one run: every stage, trained then evaluated; returns the record."""
  preflight(m, run)
  record = Record(m, run, out)
  r = record.record
  for key, folder in (("text", m.data["text"]), ("haystack", m.data["haystack"])):
    meta = json.loads((m.resolve(folder) / "meta.json").read_text())
    r["data"][f"{key}_train_tokens"] = meta["train_tokens"]
    r["data"][f"{key}_val_tokens"] = meta["val_tokens"]
    r["data"][f"{key}_sources"] = meta["sources"]
  record.save()
  previous = None
  try:
    for index, stage in m.stages_of(run.method):
      folder = workdir / run.name / stage.name
      row = train_stage(m, run, index, folder, previous, record, progress=progress,
                        dirs=[*dirs, out])
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
      print(f"kept {folder}")
      continue
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
  return p


def main(argv: list[str] | None = None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  if (args.method is None) != (args.seed is None):
    parser.error("--method and --seed go together")
  try:
    m = load_manifest(args.manifest)
    out = args.out or args.results
    dirs = [args.results] + ([out] if out != args.results else [])
    if args.summarize:
      from benchmarks import _replication_report

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
      runs = [r for r in m.runs if status(m, r, dirs)[0] in ("pending", "stale", "incomplete")]
      for r in [r for r in runs if waits_for(m, r, dirs)]:
        print(f"{r.name} waits for {waits_for(m, r, dirs).name}: later")
        runs.remove(r)
      runs = runs[:args.next]
      if not runs:
        print("every run of the manifest is done (or waits for its attention kind)")
        return 0
    else:
      run = m.run(args.run) if args.run else m.run(Run(args.method, args.seed).name)
      state, path = status(m, run, dirs)
      if state == "done" and not args.force:
        print(f"{run.name}: done ({path}); --force runs it again")
        return 0
      if state == "unavailable":
        raise ManifestError(_unavailable(run))
      if (other := waits_for(m, run, dirs)) is not None:
        raise ManifestError(f"run {run.name} matches a stage's wall time to {other.name}, which "
                            f"is not done: run {other.name} first")
      runs = [run]
    set_environment(m)
    from pisa_jax.train import compilation_cache

    compilation_cache.enable_for(parser)
    for run in runs:
      run_one(m, run, out=out, workdir=args.workdir, progress=not args.no_progress, dirs=dirs)
    return 0
  except ManifestError as e:
    print(f"replication: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
