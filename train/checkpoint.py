"""Orbax checkpoints of the train state, with the config they were made with.

Each checkpoint `<dir>/<step>/` holds `state` (parameters, Adam state, step, RNG key) and `meta`
(JSON: the config, the data-loader position, the format). Orbax writes into a temporary folder and
renames it only when every file is written, so a checkpoint cut short by a crash never looks
complete and `latest_step()` skips it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from pisa_jax.configs.base import Config
from pisa_jax.models.config import ModelConfig

FORMAT = "pisa-jax-train-state-v1"
# Model fields that fix parameter shapes and dtypes: a checkpoint restores only into the same ones.
SHAPE_FIELDS = ("vocab_size", "vocab_pad_multiple", "num_layers", "d_model", "mlp_dim",
                "num_heads", "num_kv_heads", "head_dim", "param_dtype")


class IncompatibleCheckpointError(ValueError):
  """The checkpoint was made for another model shape or by another program."""


def _pure(state: Any) -> Any:
  """Orbax stores dict keys as strings; the NNX layer list uses ints. Keys become strings here."""
  if isinstance(state, dict):
    return {str(k): _pure(v) for k, v in state.items()}
  return state


def _unpure(restored: Any, like: Any) -> Any:
  if isinstance(like, dict):
    return {k: _unpure(restored[str(k)], v) for k, v in like.items()}
  return restored


class Checkpointer:
  """A CheckpointManager over `directory`: async saves, keep the last `keep`."""

  def __init__(self, directory: str | Path, *, keep: int, use_async: bool = True):
    self.directory = Path(directory).absolute()
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=use_async, create=True
        ),
    )
    self._last_saved: int | None = None

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: dict, config: Config, *, force: bool = False) -> None:
    if step == self._last_saved or step == self.latest_step():
      return
    meta = {"format": FORMAT, "step": step, "data_position": step, "config": config.to_dict()}
    self.manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(_pure(state)), meta=ocp.args.JsonSave(meta)),
        force=force,
    )
    self._last_saved = step

  def read_meta(self, step: int) -> dict:
    try:
      out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises several types for a missing / foreign item
      raise IncompatibleCheckpointError(
          f"{self.directory}/{step} is not a pisa-jax checkpoint (no readable meta): {e}"
      ) from None
    meta = out["meta"]
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
      raise IncompatibleCheckpointError(
          f"{self.directory}/{step} has format {meta.get('format') if isinstance(meta, dict) else None!r}, "
          f"expected {FORMAT!r}"
      )
    return meta

  def restore(self, step: int, abstract_state: Any, config: Config) -> dict:
    """Restores step `step` onto `abstract_state`'s shardings after checking model compatibility."""
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
          f"{self.directory}/{step} does not restore into this model's state: {e}"
      ) from None
    state = _unpure(out["state"], abstract_state)
    if int(state["step"]) != step:
      raise IncompatibleCheckpointError(
          f"{self.directory}/{step} holds state step {int(state['step'])}"
      )
    return state

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def check_compatible(saved_model: dict, model: ModelConfig, *, where: str) -> None:
  """Raises IncompatibleCheckpointError naming every shape field that differs."""
  now = dataclasses.asdict(model)
  diffs = [f"model.{f}: checkpoint {saved_model.get(f)!r}, now {now[f]!r}"
           for f in SHAPE_FIELDS if saved_model.get(f) != now[f]]
  if diffs:
    raise IncompatibleCheckpointError(
        f"{where} was written for a different model ({'; '.join(diffs)}): use a new --workdir, "
        f"or --set the fields back"
    )


def init_from(workdir: str | Path, abstract_state: Any, config: Config) -> dict:
  """Parameters and Adam moments from `workdir`'s latest checkpoint, with step reset to 0."""
  directory = Path(workdir) / "checkpoints"
  source = Checkpointer(directory, keep=1, use_async=False)
  try:
    step = source.latest_step()
    if step is None:
      raise FileNotFoundError(f"train.init_from={str(workdir)!r} has no complete checkpoint in {directory}")
    state = source.restore(step, abstract_state, config)
  finally:
    source.close()
  state["step"] = jax.device_put(jax.numpy.zeros((), jax.numpy.int32), abstract_state["step"].sharding)
  return state
