"""Orbax checkpoints of the train state, with the config they were made with and their checksums.

Each checkpoint `<dir>/<step>/` holds `state` (parameters, Adam state, step, RNG key), `meta`
(JSON: the config, the data-loader position, the format) and `checksums.json`. Orbax writes into a
temporary folder and renames it only when every file is written, so a checkpoint cut short by a
crash never looks complete. Once Orbax has finished, the sha256 of every file of the step folder is
written to `checksums.json` (the checkpoint is then "sealed"); a restore first checks every file
against it, so a truncated, missing or bit-flipped file, or a checkpoint whose run died before it
was sealed, is found before anything is read, and the run falls back to the newest one that checks.

Several processes (`pisa_jax.train.distributed`): every process saves and restores its shards of
the global arrays through Orbax, which needs one filesystem that every process sees at the same
path (NFS, Lustre, GCS...). Process 0 seals a checkpoint once Orbax has finalized it, which is
after every process's files are written; to resume, process 0 alone verifies the checksums and
reads the meta (reading every file once, not once per process) and hands the step it chose, or
its error, to the others. A checkpoint restores under any process count and mesh: Orbax reads
each array's slices for the shardings asked for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from pisa_jax.configs.base import Config
from pisa_jax.models.config import SPARSE_ATTENTION_KINDS, ModelConfig
from pisa_jax.train import distributed

FORMAT = "pisa-jax-train-state-v1"
MANIFEST = "checksums.json"
MANIFEST_FORMAT = "pisa-jax-checksums-v1"
# Model fields that fix parameter shapes and dtypes: a checkpoint restores only into the same ones.
SHAPE_FIELDS = ("vocab_size", "vocab_pad_multiple", "num_layers", "d_model", "mlp_dim",
                "num_heads", "num_kv_heads", "head_dim", "param_dtype", "tie_embeddings",
                "qkv_bias", "out_bias", "qk_norm")
# Model fields that decide which keys each query attends to. A checkpoint restores into other
# values (the parameters have the same shapes), but the run then continues a different model:
# `train` refuses that unless asked to.
ATTENTION_FIELDS = ("attention", "block_size", "top_k", "branching", "beam")
# The kinds with parameters of their own (NSA's gates and compression MLPs, HiLS's landmark
# projection): their shape fields, and the fields that decide what each query attends to.
KIND_SHAPE_FIELDS = {"nsa": ("nsa_compression", "nsa_block_length"),
                     "hils": ("hils_landmark_rank",)}
KIND_ATTENTION_FIELDS = {
    "nsa": ("nsa_compression", "nsa_block_length", "nsa_stride", "nsa_select_block_size",
            "nsa_top_n", "nsa_window"),
    "hils": ("hils_chunk_size", "hils_top_k", "hils_window", "hils_landmark_rank"),
}


class IncompatibleCheckpointError(ValueError):
  """The checkpoint was made for another model shape or by another program."""


class CorruptCheckpointError(ValueError):
  """No checkpoint of a run folder passes its checksums (or the one asked for does not).

  `skipped`: (step, what is wrong) of each checkpoint that failed, newest first.
  """

  def __init__(self, message: str, skipped: tuple[tuple[int, str], ...] = ()):
    super().__init__(message)
    self.skipped = tuple(skipped)


def _pure(state: Any) -> Any:
  """Orbax stores dict keys as strings; the NNX layer list uses ints. Keys become strings here."""
  if isinstance(state, dict):
    return {str(k): _pure(v) for k, v in state.items()}
  return state


def _unpure(restored: Any, like: Any) -> Any:
  if isinstance(like, dict):
    return {k: _unpure(restored[str(k)], v) for k, v in like.items()}
  return restored


def _sha256(path: Path) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(1 << 22):
      digest.update(chunk)
  return digest.hexdigest()


def _files(step_dir: Path) -> list[str]:
  return sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*")
                if p.is_file() and p.name != MANIFEST)


def write_manifest(step_dir: Path) -> None:
  """Writes `checksums.json`: size and sha256 of every file of the step folder (atomically)."""
  files = {rel: {"bytes": (step_dir / rel).stat().st_size, "sha256": _sha256(step_dir / rel)}
           for rel in _files(step_dir)}
  tmp = step_dir / (MANIFEST + ".tmp")
  with open(tmp, "w") as f:
    json.dump({"format": MANIFEST_FORMAT, "files": files}, f, indent=1, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, step_dir / MANIFEST)


def verify(step_dir: Path) -> str | None:
  """None when every file of the checkpoint matches its manifest, else what is wrong, in words."""
  try:
    manifest = json.loads((step_dir / MANIFEST).read_text())
  except FileNotFoundError:
    return f"it has no {MANIFEST}: the run stopped before the checkpoint was sealed"
  except (OSError, ValueError):
    return f"its {MANIFEST} is unreadable"
  if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
    return f"its {MANIFEST} has an unknown format"
  for rel, want in sorted(manifest["files"].items()):
    path = step_dir / rel
    if not path.is_file():
      return f"{rel} is missing"
    size = path.stat().st_size
    if size < want["bytes"]:
      return f"{rel} is truncated ({size} of {want['bytes']} bytes)"
    if size != want["bytes"]:
      return f"{rel} has {size} bytes, {want['bytes']} were written"
    if _sha256(path) != want["sha256"]:
      return f"{rel} does not match its checksum"
  return None


class Checkpointer:
  """A CheckpointManager over `directory`: async saves, keep the last `keep`, sealed by checksums.

  With `read_only=True` nothing is created or written: it lists, verifies and restores. Every
  process of a multi-process run creates it and takes part in its saves and restores, except
  with `this_process_only=True` (a reader of this process alone, for metadata).
  """

  def __init__(self, directory: str | Path, *, keep: int = 1, use_async: bool = True,
               read_only: bool = False, this_process_only: bool = False):
    self.directory = Path(directory).absolute()
    self.use_async = use_async
    alone = {jax.process_index()} if this_process_only and jax.process_count() > 1 else None
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=use_async, create=not read_only,
            # A temporary folder left by a save that a kill cut short.
            cleanup_tmp_directories=not read_only,
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                primary_host=jax.process_index() if alone else 0, active_processes=alone),
        ),
    )
    self._last_saved: int | None = None
    self._sealer: threading.Thread | None = None
    self._seal_error: BaseException | None = None

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: dict, config: Config, *, force: bool = False) -> None:
    if step == self._last_saved or step in self.all_steps():
      return
    self._join_sealer()
    meta = {"format": FORMAT, "step": step, "data_position": step, "config": config.to_dict()}
    self.manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(_pure(state)), meta=ocp.args.JsonSave(meta)),
        force=force,
    )
    self._last_saved = step
    if self.use_async:
      # Sealed as soon as Orbax has finished, not at the next save: a crash in between would
      # otherwise cost a whole checkpoint interval.
      self._sealer = threading.Thread(target=self._seal, args=(step,), daemon=True,
                                      name=f"seal-checkpoint-{step}")
      self._sealer.start()
    else:
      self._seal(step)
      self._raise_seal_error()

  def _seal(self, step: int) -> None:
    try:
      # On process 0 this returns once Orbax has finalized the step, after every process wrote.
      self.manager.wait_until_finished()
      if jax.process_index() == 0:
        write_manifest(self.directory / str(step))
    except BaseException as e:  # re-raised in the main thread by _join_sealer
      self._seal_error = e

  def _join_sealer(self) -> None:
    if self._sealer is not None:
      self._sealer.join()
      self._sealer = None
    self._raise_seal_error()

  def _raise_seal_error(self) -> None:
    if self._seal_error is not None:
      e, self._seal_error = self._seal_error, None
      raise e

  def verify(self, step: int) -> str | None:
    """None when checkpoint `step` passes its checksums, else the reason it does not."""
    return verify(self.directory / str(step))

  def read_meta(self, step: int) -> dict:
    try:
      out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises several types for a missing / foreign item
      raise IncompatibleCheckpointError(
          f"{self.directory}/{step} is not a pisa-jax checkpoint (no readable meta): "
          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
      ) from None
    meta = out["meta"]
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
      raise IncompatibleCheckpointError(
          f"{self.directory}/{step} has format {meta.get('format') if isinstance(meta, dict) else None!r}, "
          f"expected {FORMAT!r}"
      )
    return meta

  def restore(self, step: int, abstract_state: Any, config: Config, *,
              verified: bool = False) -> dict:
    """Restores step `step` onto `abstract_state`'s shardings after checking model compatibility.

    verified: the caller has just checked the checksums (`verify`); otherwise they are checked here.
    """
    if not verified and (reason := self.verify(step)) is not None:
      raise CorruptCheckpointError(f"{self.directory}/{step} cannot be restored: {reason}")
    meta = self.read_meta(step)
    check_compatible(meta["config"]["model"], config.model, where=f"{self.directory}/{step}")
    if meta["data_position"] != step:
      raise IncompatibleCheckpointError(
          f"{self.directory}/{step}: data position {meta['data_position']} != step {step}"
      )
    try:
      out = self.manager.restore(
          step, args=ocp.args.Composite(state=ocp.args.StandardRestore(_pure(abstract_state)))
      )
    except Exception as e:
      raise IncompatibleCheckpointError(
          f"{self.directory}/{step} does not restore into this model's state: "
          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
      ) from None
    state = _unpure(out["state"], abstract_state)
    if int(state["step"]) != step:
      raise IncompatibleCheckpointError(
          f"{self.directory}/{step} holds state step {int(state['step'])}"
      )
    return state

  def wait(self) -> None:
    self._join_sealer()
    self.manager.wait_until_finished()

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self.manager.close()


@dataclasses.dataclass(frozen=True)
class ResumePoint:
  """The newest checkpoint of a run folder that passes its checksums, and those skipped above it."""

  step: int
  meta: dict
  skipped: tuple[tuple[int, str], ...]


def find_resume_point(directory: str | Path, model: ModelConfig, *,
                      allow_attention_change: bool = False) -> ResumePoint | None:
  """Checks a run's checkpoints without writing anything: None when it has none.

  Walks from the newest checkpoint down to the first that passes its checksums; checks that one
  against `model` (shapes always, attention fields unless `allow_attention_change`). Raises
  CorruptCheckpointError when checkpoints exist but none passes, IncompatibleCheckpointError when
  the newest good one was written for another model. In a multi-process run process 0 checks
  and every process returns (or raises) its answer.
  """
  directory = Path(directory).absolute()
  if jax.process_count() == 1:
    return _find_resume_point(directory, model, allow_attention_change)

  def checked() -> dict | None:
    try:
      point = _find_resume_point(directory, model, allow_attention_change)
    except (CorruptCheckpointError, IncompatibleCheckpointError) as e:
      return {"error": type(e).__name__, "message": str(e),
              "skipped": list(getattr(e, "skipped", ()))}
    return None if point is None else dataclasses.asdict(point)

  found = distributed.share_from_primary("resume point", checked)
  if found is None:
    return None
  if "error" in found:
    if found["error"] == CorruptCheckpointError.__name__:
      raise CorruptCheckpointError(found["message"],
                                   skipped=tuple(tuple(s) for s in found["skipped"]))
    raise IncompatibleCheckpointError(found["message"])
  return ResumePoint(step=found["step"], meta=found["meta"],
                     skipped=tuple(tuple(s) for s in found["skipped"]))


def _find_resume_point(directory: Path, model: ModelConfig,
                       allow_attention_change: bool) -> ResumePoint | None:
  if not directory.is_dir():
    return None
  reader = Checkpointer(directory, read_only=True, this_process_only=True)
  try:
    skipped = []
    for step in reversed(reader.all_steps()):
      reason = reader.verify(step)
      if reason is None:
        meta = reader.read_meta(step)
        where = f"{directory}/{step}"
        check_compatible(meta["config"]["model"], model, where=where)
        if not allow_attention_change:
          check_same_attention(meta["config"]["model"], model, where=where)
        return ResumePoint(step=step, meta=meta, skipped=tuple(skipped))
      skipped.append((step, reason))
  finally:
    reader.close()
  if skipped:
    listed = "; ".join(f"{step}: {reason}" for step, reason in skipped)
    raise CorruptCheckpointError(
        f"no checkpoint in {directory} passes its checksums ({listed}): delete {directory} to "
        f"start over, or use a new --workdir", skipped=tuple(skipped)
    )
  return None


def set_aside(directory: str | Path, steps: list[int], into: str | Path) -> list[Path]:
  """Moves the step folders `steps` of `directory` into `into` (nothing is deleted)."""
  moved = []
  for step in steps:
    target = Path(into) / str(step)
    n = 1
    while target.exists():
      n += 1
      target = Path(into) / f"{step}-{n}"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(Path(directory) / str(step)), target)
    moved.append(target)
  return moved


def check_compatible(saved_model: dict, model: ModelConfig, *, where: str) -> None:
  """Raises IncompatibleCheckpointError naming every shape field that differs."""
  now = dataclasses.asdict(model)
  # A checkpoint written before a field existed has that field's default.
  saved = {**dataclasses.asdict(ModelConfig()), **saved_model}
  diffs = [f"model.{f}: checkpoint {saved.get(f)!r}, now {now[f]!r}"
           for f in SHAPE_FIELDS if saved.get(f) != now[f]]
  saved_kind, kind = saved.get("attention"), model.attention
  if saved_kind != kind and (saved_kind in KIND_SHAPE_FIELDS or kind in KIND_SHAPE_FIELDS):
    # One side has parameters the other lacks: no restore can map one onto the other.
    diffs.append(f"model.attention: checkpoint {saved_kind!r}, now {kind!r} (the parameters of "
                 f"{saved_kind if saved_kind in KIND_SHAPE_FIELDS else kind!r} attention differ)")
  elif kind in KIND_SHAPE_FIELDS:
    diffs += [f"model.{f}: checkpoint {saved.get(f)!r}, now {now[f]!r}"
              for f in KIND_SHAPE_FIELDS[kind] if saved.get(f) != now[f]]
  if diffs:
    raise IncompatibleCheckpointError(
        f"{where} was written for a different model ({'; '.join(diffs)}): use a new --workdir, "
        f"or --set the fields back"
    )


def attention_changes(saved_model: dict, model: ModelConfig) -> list[str]:
  """The attention fields that differ, as `model.field: checkpoint X, now Y`."""
  now = dataclasses.asdict(model)
  both_sparse = (saved_model.get("attention") in SPARSE_ATTENTION_KINDS
                 and model.attention in SPARSE_ATTENTION_KINDS)
  # A dense model has no blocks: its block_size, top_k, ... mean nothing.
  fields = ATTENTION_FIELDS if both_sparse else ("attention",)
  if saved_model.get("attention") == model.attention:
    fields += KIND_ATTENTION_FIELDS.get(model.attention, ())
  return [f"model.{f}: checkpoint {saved_model.get(f)!r}, now {now[f]!r}"
          for f in fields if saved_model.get(f) != now[f]]


def check_same_attention(saved_model: dict, model: ModelConfig, *, where: str) -> None:
  """Raises IncompatibleCheckpointError when the run would continue under another attention."""
  diffs = attention_changes(saved_model, model)
  if diffs:
    raise IncompatibleCheckpointError(
        f"{where} was trained with other attention ({'; '.join(diffs)}): resuming would continue "
        f"those weights under the new attention; pass --allow-attention-change to do that on "
        f"purpose, use a new --workdir, or --set the fields back"
    )


def init_from(workdir: str | Path, abstract_state: Any, config: Config) -> tuple[dict, ResumePoint]:
  """Parameters and Adam moments from `workdir`'s newest good checkpoint, with step reset to 0.

  Returns the state and the checkpoint it came from (with any newer ones skipped as corrupt).
  """
  directory = Path(workdir) / "checkpoints"
  # Continued pretraining may change the attention (e.g. dense -> PISA): only shapes must match.
  point = find_resume_point(directory, config.model, allow_attention_change=True)
  if point is None:
    raise FileNotFoundError(f"train.init_from={str(workdir)!r} has no complete checkpoint in {directory}")
  source = Checkpointer(directory, read_only=True)
  try:
    state = source.restore(point.step, abstract_state, config, verified=True)
  finally:
    source.close()
  state["step"] = jax.device_put(jax.numpy.zeros((), jax.numpy.int32), abstract_state["step"].sharding)
  return state, point
