"""The manifest of `benchmarks.replication`: its TOML layout, checks with one-line errors naming
the field, the runs it lists, and the trainer's config of each (run, stage).

  [backbone]   ModelConfig fields shared by every run (not attention, top_k, rope_base, remat)
  [optimizer]  AdamW and clipping (TrainConfig fields)
  [data]       text and haystack folders (and the corpora that make them), the retrieval mixture,
               where the tokenizer, RULER's essays and the wheels a bare machine needs are kept
  [[stage]]    name, seq_len, top_k, rope_base, batch, steps, the schedule, max_seconds, its
               methods (default all), match_wall, and [stage.eval] lengths per suite
  [eval]       sample counts, batch size, seed, selection settings
  [[method]]   name and seeds, in the order runs are taken
  [summary]    which stages give Tables 2 and 7 (pretrain), 3 and 6 (cpt), and the long table
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MANIFEST = Path(__file__).resolve().parent / "replication.toml"
GPT2_VOCAB = 50_257
EVAL_SUITES = ("ppl", "ruler", "mqar", "induction", "selection", "mixture")


class ManifestError(ValueError):
  """A manifest or run that cannot be used; the message is one line naming the field."""


_REQUIRED = object()
_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
          "ints": "a list of positive integers", "seeds": "a list of integers >= 0",
          "floats": "a list of numbers", "strs": "a list of strings", "table": "a table"}


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
    "retrieval_templates": (str, "fixed"), "retrieval_text_share": (float, 0.0),
}
# Data fields added after results were made: at their default (_DATA's), the behaviour before.
_ADDED_DATA_FIELDS = ("retrieval_text_share",)
_STAGE = {
    "name": (str, _REQUIRED), "enabled": (bool, True), "methods": (("strs",), None),
    "seq_len": (int, _REQUIRED), "top_k": (int, _REQUIRED), "rope_base": (float, _REQUIRED),
    "batch": (int, _REQUIRED), "grad_accum": (int, 1), "steps": (int, _REQUIRED),
    "peak_lr": (float, _REQUIRED), "warmup_fraction": (float, 0.1),
    "lr_schedule": (str, "cosine"), "final_lr_ratio": (float, 0.1),
    "loss_chunk": ((int,), None), "remat": (str, "none"), "max_seconds": ((float,), None),
    "log_every": (int, 10), "match_wall": ((str,), None), "eval": ("table", {}),
    "retrieval_max_length": ((int,), None),
}
_STAGE_EVAL = {name: ("ints", ()) for name in EVAL_SUITES}
_EVAL = {
    "seed": (int, 0), "batch_size": (int, 8), "ppl_samples": (int, 8), "ruler_samples": (int, 4),
    "mqar_samples": (int, 16), "mqar_pairs": ("ints", (16, 64)), "selection_samples": (int, 2),
    "mixture_samples": (int, 16), "induction_samples": (int, 16),
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
  # The longest needle document of this stage's mixture (None: the row).
  retrieval_max_length: int | None = None

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
  """The data fields that shape a result: the corpora, the mixture and the version of the code
  that makes its needle documents (not the folders they are kept in, nor where the tools and
  wheels are)."""
  from pisa_jax.train.retrieval import NEEDLE_GENERATOR

  out = {k: v for k, v in data.items()
         if k not in ("text", "haystack", "tokenizer", "ruler_dir", "wheels")}
  # A setting added later counts only away from its default, the behaviour before it existed.
  for name in _ADDED_DATA_FIELDS:
    if out.get(name) == _DATA[name][1]:
      out.pop(name)
  # The needle documents change with the code that makes them, not only with these settings.
  return out | {"needle_generator": NEEDLE_GENERATOR}


def _check(m: Manifest) -> None:
  """Every stage's config through `configs.validate` (for a dense and a sparse method), the
  evaluation lengths against the stage, the summary's stage names."""
  from pisa_jax.configs import validate
  from pisa_jax.configs.base import MIN_NEEDLE_DOCUMENT
  from pisa_jax.models.config import SPARSE_ATTENTION_KINDS

  where = str(m.path)
  e = m.eval
  for name in ("batch_size", "ppl_samples", "ruler_samples", "mqar_samples", "selection_samples",
               "mixture_samples", "induction_samples"):
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
    if stage.eval["mixture"] and stage.eval["mixture"][0] < MIN_NEEDLE_DOCUMENT:
      raise ManifestError(f"{at}: eval.mixture length {stage.eval['mixture'][0]} must be >= "
                          f"{MIN_NEEDLE_DOCUMENT}, the shortest needle document "
                          f"(data.retrieval_min_length's floor)")
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
                    retrieval_max_length=stage.retrieval_max_length,
                    retrieval_answer_weight=d["retrieval_answer_weight"],
                    retrieval_templates=d["retrieval_templates"],
                    retrieval_text_share=d["retrieval_text_share"])
  train = TrainConfig(
      seq_len=stage.seq_len, per_device_batch=stage.batch // devices,
      grad_accum=stage.grad_accum, steps=stage.steps, peak_lr=stage.peak_lr,
      final_lr_ratio=stage.final_lr_ratio, lr_schedule=stage.lr_schedule, warmup_steps=0,
      warmup_fraction=stage.warmup_fraction, decay_steps=0, seed=run.seed + 1000 * index,
      checkpoint_every=stage.steps, keep_checkpoints=1, async_checkpointing=False,
      log_every=stage.log_every, eval_every=10 ** 9, eval_batches=0,
      loss_chunk=stage.loss_chunk, init_from=init_from, **m.optimizer)
  return Config(model=model, data=data, train=train)
