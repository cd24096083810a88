"""A run's config: model, data and training sections, their validation, and `--set` overrides.

Three frozen dataclasses, `ModelConfig` (defined beside the model, in `pisa_jax.models.config`),
`DataConfig` and `TrainConfig`, grouped in `Config`. A preset (see `pisa_jax.configs.presets`) is a
`Config`; the CLI applies `section.field=value` overrides to it and `validate` rejects an impossible
combination before anything is compiled, with an error that names the field. The attention fields
are checked by the same functions that check `pisa_jax.pisa_attention`'s arguments.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

from pisa_jax import _checks
from pisa_jax.models.config import (
    ATTENTION_KINDS,
    COMPUTE_DTYPES,
    PARAM_DTYPES,
    REMAT_POLICIES,
    SPARSE_ATTENTION_KINDS,
    ModelConfig,
    check_architecture,
)

DATA_SOURCES = ("mqar", "tokens")
LR_SCHEDULES = ("wsd_sqrt", "cosine", "constant")


# The shortest needle document (data.retrieval_min_length, and any evaluation of them).
MIN_NEEDLE_DOCUMENT = 128


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where batches come from: MQAR generated on the fly, or packed token files (uint16 / uint32)."""

  source: str = "tokens"
  # Folder holding train.bin / val.bin / meta.json written by `pisa-prepare-data`.
  path: str | None = None
  # MQAR (Zoology): number of key-value pairs per sequence; keys from [1, V/2), values [V/2, V).
  mqar_num_pairs: int = 16
  mqar_power_a: float = 0.01
  # Zoology's `random_non_queries`: positions outside the pairs and queries hold random tokens
  # (True) or token 0 (False, no distractors).
  mqar_random_filler: bool = True
  # Token files: cut attention (and the loss) at each <|endoftext|>, with RoPE positions restarting
  # per document (`pisa_jax.train.data` gives the rule). Sparse attention takes the documents as
  # `segment_ids` on both implementations, the jnp reference and the Pallas kernels.
  packing: bool = False
  # Long-context retrieval mixture (`pisa_jax.train.retrieval`): this share of the rows of every
  # training batch holds needle documents (keys and values planted in haystack text, a question,
  # its answer) instead of windows of data.path. The haystack is the train split of
  # retrieval_path, a pisa-prepare-data folder; documents are retrieval_min_length tokens to
  # retrieval_max_length (None: the row) long; the loss on answer tokens is weighted
  # retrieval_answer_weight. Needs packing. retrieval_templates: "fixed" (a few lists of
  # sentences) or "composed" (sentences built from parts: thousands of forms).
  # retrieval_text_share of the needle documents take their haystack from data.path's train
  # split instead: a small haystack corpus is otherwise read many times over.
  retrieval_fraction: float = 0.0
  retrieval_path: str | None = None
  retrieval_text_share: float = 0.0
  retrieval_min_length: int = 256
  retrieval_max_length: int | None = None
  retrieval_answer_weight: float = 1.0
  retrieval_templates: str = "fixed"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Optimiser, schedule, batch, mesh, checkpoints and logging (Table 5's training rows)."""

  seq_len: int = 4096
  per_device_batch: int = 8
  grad_accum: int = 2
  steps: int = 100_000
  peak_lr: float = 3e-4
  # Final learning rate of the decay, as a fraction of the peak (0.1: Table 5's sqrt decay).
  final_lr_ratio: float = 0.1
  lr_schedule: str = "wsd_sqrt"
  # Exactly one of warmup_steps / warmup_fraction is used: a fraction of `steps` when nonzero.
  warmup_steps: int = 1_000
  warmup_fraction: float = 0.0
  # wsd_sqrt: length of the final square-root decay; the plateau fills the rest.
  decay_steps: int = 9_000
  adam_b1: float = 0.9
  adam_b2: float = 0.95
  adam_eps: float = 1e-8
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  seed: int = 42
  # Mesh (data, fsdp): fsdp = -1 puts every local device on the fsdp axis.
  fsdp: int = -1
  # Context parallelism: each sequence is split over this many devices (a third mesh axis, "seq");
  # per_device_batch then counts the sequences of each group of that many devices.
  context_parallel: int = 1
  checkpoint_every: int = 1_000
  keep_checkpoints: int = 3
  async_checkpointing: bool = True
  log_every: int = 50
  eval_every: int = 1_000
  eval_batches: int = 8
  # Tokens per chunk of the output projection and loss (`pisa_jax.train.loss`): the [T, vocab]
  # logits are never held whole. Must divide seq_len; 0 or None computes all tokens at once.
  loss_chunk: int | None = None
  # Dense bf16 peak of one device for MFU; 0 means look it up from the device kind.
  peak_tflops_per_device: float = 0.0
  # Continued pretraining: a workdir whose latest checkpoint gives parameters and Adam moments
  # when this run's workdir has none; the step (and so the schedule) restarts at 0.
  init_from: str | None = None


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "Config":
    sections = {}
    for f in dataclasses.fields(cls):
      section_cls = _section_type(f.name)
      values = dict(d.get(f.name, {}))
      known = {g.name for g in dataclasses.fields(section_cls)}
      unknown = sorted(set(values) - known)
      if unknown:
        raise ValueError(f"unknown config field(s) {[f'{f.name}.{u}' for u in unknown]}")
      sections[f.name] = section_cls(**values)
    return cls(**sections)


def _section_type(name: str) -> type:
  return {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}[name]


def _parse_value(text: str, annotation: Any, field: str) -> Any:
  """Parses `text` as the type of a dataclass field (int, float, str, bool or `X | None`)."""
  origin = typing.get_origin(annotation)
  if origin in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if text.lower() in ("none", "null"):
      return None
    (annotation,) = args
  if annotation is bool:
    if text.lower() in ("true", "1", "yes"):
      return True
    if text.lower() in ("false", "0", "no"):
      return False
    raise ValueError(f"{field}={text!r} is not a boolean: expected true or false")
  if annotation is int:
    try:
      return int(text.replace("_", ""))
    except ValueError:
      raise ValueError(f"{field}={text!r} is not an integer") from None
  if annotation is float:
    try:
      return float(text)
    except ValueError:
      raise ValueError(f"{field}={text!r} is not a number") from None
  return text


def apply_overrides(config: Config, overrides: list[str]) -> Config:
  """Applies `section.field=value` strings, e.g. `model.attention=pisa`, `train.steps=100`."""
  for item in overrides:
    if "=" not in item:
      raise ValueError(f"override {item!r} must look like section.field=value")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or parts[0] not in ("model", "data", "train"):
      raise ValueError(
          f"override key {key!r} must be section.field with section one of model, data, train"
      )
    section_name, field = parts
    section = getattr(config, section_name)
    hints = typing.get_type_hints(type(section))
    if field not in hints:
      known = ", ".join(f.name for f in dataclasses.fields(section))
      raise ValueError(f"unknown config field {key!r}; {section_name} has: {known}")
    value = _parse_value(text.strip(), hints[field], key)
    config = dataclasses.replace(
        config, **{section_name: dataclasses.replace(section, **{field: value})}
    )
  return config


def validate(config: Config) -> Config:
  """Raises ValueError naming the field for any impossible value; returns the config unchanged."""
  m, d, t = config.model, config.data, config.train
  if m.attention not in ATTENTION_KINDS:
    raise ValueError(f"model.attention={m.attention!r} is unknown: expected one of {ATTENTION_KINDS}")
  for name in ("vocab_size", "vocab_pad_multiple", "num_layers", "d_model", "mlp_dim",
               "num_heads", "num_kv_heads", "head_dim"):
    if getattr(m, name) < 1:
      raise ValueError(f"model.{name}={getattr(m, name)} must be >= 1")
  if m.num_heads % m.num_kv_heads:
    raise ValueError(
        f"model.num_heads={m.num_heads} must be divisible by model.num_kv_heads={m.num_kv_heads} (GQA)"
    )
  # RoPE's rotated dims (rope_fraction of head_dim) must pair up: `check_architecture` below.
  if m.rope_base <= 1:
    raise ValueError(f"model.rope_base={m.rope_base} must be > 1")
  check_architecture(m)
  if m.param_dtype not in PARAM_DTYPES:
    raise ValueError(f"model.param_dtype={m.param_dtype!r} must be one of {PARAM_DTYPES}")
  if m.compute_dtype not in COMPUTE_DTYPES:
    raise ValueError(f"model.compute_dtype={m.compute_dtype!r} must be one of {COMPUTE_DTYPES}")
  if m.remat not in REMAT_POLICIES:
    raise ValueError(f"model.remat={m.remat!r} must be one of {REMAT_POLICIES}")
  if m.summary_dtype not in _checks.SUMMARY_DTYPES:  # a name: the config is JSON
    raise ValueError(f"model.summary_dtype={m.summary_dtype!r} must be one of "
                     f"{_checks.SUMMARY_DTYPES}")
  if m.summary_dtype != "float32" and m.attention not in SPARSE_ATTENTION_KINDS:
    raise ValueError(f"model.summary_dtype={m.summary_dtype!r} is the pyramid's, and "
                     f"model.attention={m.attention!r} has none: float32, or one of "
                     f"{SPARSE_ATTENTION_KINDS}")
  if m.attention in SPARSE_ATTENTION_KINDS:
    # The library's own argument checks (jax-free: a tool reports a bad field before importing
    # jax), naming the config fields.
    _checks.check_block_size(m.block_size, name="model.block_size")
    _checks.check_top_k(m.top_k, name="model.top_k")
    _checks.check_branching(m.branching, name="model.branching")
    _checks.check_beam(m.beam, m.top_k, m.attention, name="model.beam",
                           top_k_name="model.top_k", selector_name="model.attention")
    _checks.check_implementation(m.attention_implementation,
                                     name="model.attention_implementation")
    if m.block_size > t.seq_len:
      raise ValueError(
          f"model.block_size={m.block_size} must be <= train.seq_len={t.seq_len}"
      )
  elif m.attention == "nsa":
    _checks.check_nsa_options(
        compression=m.nsa_compression, block_length=m.nsa_block_length, stride=m.nsa_stride,
        select_block_size=m.nsa_select_block_size, top_n=m.nsa_top_n, window=m.nsa_window,
        names={f: "model.nsa_" + f for f in ("compression", "block_length", "stride",
                                             "select_block_size", "top_n", "window")})
    _checks.check_implementation(m.attention_implementation,
                                     name="model.attention_implementation")
    if t.context_parallel > 1:
      raise ValueError(f"model.attention='nsa' does not split the sequence over devices: set "
                       f"train.context_parallel=1 (got {t.context_parallel})")
  elif m.attention == "hils":
    for field in ("hils_chunk_size", "hils_top_k", "hils_window", "hils_landmark_rank"):
      _checks.check_block_size(getattr(m, field), name=f"model.{field}")
    _checks.check_implementation(m.attention_implementation,
                                 name="model.attention_implementation")
    if t.context_parallel > 1:
      raise ValueError(f"model.attention='hils' does not split the sequence over devices: set "
                       f"train.context_parallel=1 (got {t.context_parallel})")
  elif m.attention_implementation is not None:
    raise ValueError(
        f"model.attention_implementation={m.attention_implementation!r} applies to sparse attention "
        f"only; model.attention={m.attention!r} uses jax.nn.dot_product_attention"
    )
  if d.source not in DATA_SOURCES:
    raise ValueError(f"data.source={d.source!r} must be one of {DATA_SOURCES}")
  if d.packing and m.summary_dtype != "float32":
    raise ValueError(f"model.summary_dtype={m.summary_dtype!r} is not supported with "
                     "data.packing=true: packed documents' pyramids are float32")
  if d.packing and d.source != "tokens":
    raise ValueError(f"data.packing=true needs data.source='tokens' (documents closed by "
                     f"<|endoftext|>), got data.source={d.source!r}")
  if d.source == "tokens" and not d.path:
    raise ValueError("data.path must name a folder written by pisa-prepare-data when data.source='tokens'")
  _validate_retrieval(d, m, t)
  if d.source == "mqar":
    if m.vocab_size < 4 or m.vocab_size % 2:
      raise ValueError(f"model.vocab_size={m.vocab_size} must be even and >= 4 for MQAR")
    if d.mqar_num_pairs < 1 or d.mqar_num_pairs >= m.vocab_size // 2:
      raise ValueError(
          f"data.mqar_num_pairs={d.mqar_num_pairs} must be in [1, vocab_size/2 - 1]: keys are distinct"
      )
    if 4 * d.mqar_num_pairs > t.seq_len:
      raise ValueError(
          f"data.mqar_num_pairs={d.mqar_num_pairs} needs train.seq_len >= {4 * d.mqar_num_pairs}"
      )
    if t.seq_len % 2:
      raise ValueError(f"train.seq_len={t.seq_len} must be even for MQAR")
  for name in ("seq_len", "per_device_batch", "grad_accum", "steps", "checkpoint_every",
               "keep_checkpoints", "log_every", "eval_every"):
    if getattr(t, name) < 1:
      raise ValueError(f"train.{name}={getattr(t, name)} must be >= 1")
  if t.loss_chunk is not None and t.loss_chunk < 0:
    raise ValueError(f"train.loss_chunk={t.loss_chunk} must be None or 0 (no chunks), or >= 1 "
                     f"tokens per chunk")
  if t.loss_chunk and t.seq_len % t.loss_chunk:
    raise ValueError(f"train.loss_chunk={t.loss_chunk} must divide train.seq_len={t.seq_len}")
  _validate_context_parallel(d, t)
  if t.eval_batches < 0:
    raise ValueError(f"train.eval_batches={t.eval_batches} must be >= 0")
  if t.lr_schedule not in LR_SCHEDULES:
    raise ValueError(f"train.lr_schedule={t.lr_schedule!r} must be one of {LR_SCHEDULES}")
  if t.peak_lr <= 0:
    raise ValueError(f"train.peak_lr={t.peak_lr} must be > 0")
  if not 0 <= t.final_lr_ratio <= 1:
    raise ValueError(f"train.final_lr_ratio={t.final_lr_ratio} must be in [0, 1]")
  if t.warmup_steps < 0 or not 0 <= t.warmup_fraction < 1:
    raise ValueError(
        f"train.warmup_steps={t.warmup_steps} must be >= 0 and train.warmup_fraction="
        f"{t.warmup_fraction} in [0, 1)"
    )
  if t.warmup_steps and t.warmup_fraction:
    raise ValueError(
        f"set one of train.warmup_steps={t.warmup_steps} and train.warmup_fraction="
        f"{t.warmup_fraction}, the other to 0"
    )
  if t.lr_schedule == "wsd_sqrt" and warmup_steps(t) + t.decay_steps > t.steps:
    raise ValueError(
        f"train.warmup_steps ({warmup_steps(t)}) + train.decay_steps={t.decay_steps} must be "
        f"<= train.steps={t.steps}"
    )
  if t.lr_schedule == "cosine" and warmup_steps(t) >= t.steps:
    raise ValueError(f"the warm-up ({warmup_steps(t)} steps) must be shorter than train.steps={t.steps}")
  if t.decay_steps < 0:
    raise ValueError(f"train.decay_steps={t.decay_steps} must be >= 0")
  if t.fsdp == 0 or t.fsdp < -1:
    raise ValueError(f"train.fsdp={t.fsdp} must be -1 (all devices) or >= 1")
  if t.grad_clip <= 0:
    raise ValueError(f"train.grad_clip={t.grad_clip} must be > 0")
  return config


def _validate_retrieval(d: DataConfig, m: ModelConfig, t: TrainConfig) -> None:
  """The retrieval mixture's fields (`pisa_jax.train.retrieval`)."""
  if not 0 <= d.retrieval_fraction <= 1:
    raise ValueError(f"data.retrieval_fraction={d.retrieval_fraction} must be in [0, 1]")
  if d.retrieval_templates not in ("fixed", "composed"):
    raise ValueError(f"data.retrieval_templates={d.retrieval_templates!r}: expected 'fixed' or "
                     f"'composed'")
  if not 0 <= d.retrieval_text_share <= 1:
    raise ValueError(f"data.retrieval_text_share={d.retrieval_text_share} must be in [0, 1]: "
                     f"the share of needle documents whose haystack is data.path's text")
  if not d.retrieval_fraction:
    if d.retrieval_text_share:
      raise ValueError(f"data.retrieval_text_share={d.retrieval_text_share} needs "
                       f"data.retrieval_fraction > 0: it shares out the needle documents' "
                       f"haystacks, and without the mixture there are none")
    return
  if d.source != "tokens" or not d.packing:
    raise ValueError(f"data.retrieval_fraction={d.retrieval_fraction} needs data.source='tokens' "
                     f"and data.packing=true (needle documents are packed with segment_ids), got "
                     f"data.source={d.source!r}, data.packing={d.packing}")
  if not d.retrieval_path:
    raise ValueError("data.retrieval_path must name a pisa-prepare-data folder of haystack text "
                     "when data.retrieval_fraction > 0")
  if m.vocab_size < 50_257:
    raise ValueError(f"model.vocab_size={m.vocab_size} must be >= 50257 when "
                     f"data.retrieval_fraction > 0: needle documents are GPT-2 text")
  if not MIN_NEEDLE_DOCUMENT <= d.retrieval_min_length <= t.seq_len:
    raise ValueError(f"data.retrieval_min_length={d.retrieval_min_length} must be in "
                     f"[{MIN_NEEDLE_DOCUMENT}, train.seq_len={t.seq_len}]: a needle document "
                     f"needs room for its question")
  if d.retrieval_max_length is not None and not (
      2 * d.retrieval_min_length <= d.retrieval_max_length <= t.seq_len):
    raise ValueError(f"data.retrieval_max_length={d.retrieval_max_length} must be None or in "
                     f"[2 x data.retrieval_min_length = {2 * d.retrieval_min_length}, "
                     f"train.seq_len={t.seq_len}]: a row's last document may need to split")
  if not d.retrieval_answer_weight > 0:
    raise ValueError(f"data.retrieval_answer_weight={d.retrieval_answer_weight} must be > 0")


def _validate_context_parallel(d: DataConfig, t: TrainConfig) -> None:
  """train.context_parallel against the sequence, the loss chunks and packing (every sparse
  selector runs at a query offset on both implementations, "xla" and "pallas")."""
  cp = t.context_parallel
  if cp < 1:
    raise ValueError(f"train.context_parallel={cp} must be >= 1 (1: the sequence is not split)")
  if cp == 1:
    return
  if t.seq_len % cp:
    raise ValueError(f"train.context_parallel={cp} must divide train.seq_len={t.seq_len}: each "
                     f"device holds seq_len / context_parallel consecutive tokens")
  if t.loss_chunk and (t.seq_len // cp) % t.loss_chunk:
    raise ValueError(f"train.loss_chunk={t.loss_chunk} must divide train.seq_len / "
                     f"train.context_parallel = {t.seq_len // cp}: each device computes the loss "
                     f"of its own tokens")
  if d.packing:
    raise ValueError(f"data.packing=true is not supported with train.context_parallel={cp}: "
                     f"set train.context_parallel=1")


def warmup_steps(t: TrainConfig) -> int:
  """The warm-up length in steps: `warmup_fraction * steps` when set, else `warmup_steps`."""
  if t.warmup_fraction:
    return int(round(t.warmup_fraction * t.steps))
  return t.warmup_steps
