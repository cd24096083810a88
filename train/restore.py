"""Restore a `pisa-train` run's newest verified checkpoint as a model, for inference and evaluation.

  config, model, step = restore_model("runs/small")

`read_run_config` checks that a folder is a run without importing jax: the tools call it on
their --workdir before anything else is loaded.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from pisa_jax.configs.base import Config


class NoCheckpointError(FileNotFoundError):
  """The folder is not a pisa-train run, or holds no checkpoint; the message names `workdir`."""


def _hint(workdir: Path) -> str:
  return f"train one first (pisa-train --workdir {workdir})"


class SummaryDtypeError(ValueError):
  """A summary_dtype that the run's model cannot take."""


def with_summary_dtype(config: Config, summary_dtype: str) -> Config:
  """config with model.summary_dtype replaced; SummaryDtypeError naming it where nothing reads
  it."""
  from pisa_jax import _checks
  from pisa_jax.models.config import SPARSE_ATTENTION_KINDS

  try:
    _checks.summary_dtype_name(summary_dtype)
  except ValueError as e:
    raise SummaryDtypeError(str(e)) from None
  if config.model.attention not in SPARSE_ATTENTION_KINDS:
    raise SummaryDtypeError(f"summary_dtype={summary_dtype!r}: the run's model.attention="
                            f"{config.model.attention!r} has no PISA pyramid")
  return dataclasses.replace(
      config, model=dataclasses.replace(config.model, summary_dtype=summary_dtype))


def read_run_config(workdir: str | Path) -> Config:
  """The `Config` of the run folder `workdir` as its config.json records it (jax is not
  imported). Raises NoCheckpointError (its message starts with "workdir") when `workdir` is not
  a run folder."""
  workdir = Path(workdir)
  if not workdir.is_dir():
    what = "is not a folder" if workdir.exists() else "does not exist"
    raise NoCheckpointError(f"workdir: {workdir} {what}: give a pisa-train run folder, or "
                            f"{_hint(workdir)}")
  try:
    return Config.from_dict(json.loads((workdir / "config.json").read_text()))
  except FileNotFoundError:
    raise NoCheckpointError(f"workdir: {workdir} has no config.json and no checkpoint: it is not a "
                            f"pisa-train run folder; {_hint(workdir)}") from None
  except (ValueError, TypeError, AttributeError) as e:
    raise NoCheckpointError(f"workdir: {workdir}/config.json is unreadable ({e})") from None


def restore_model(workdir: str | Path, *, summary_dtype: str | None = None):
  """(config, model, step): the newest checkpoint of the run `workdir` that passes its checksums,
  as a `pisa_jax.models.Decoder` with the config it was trained with.

  summary_dtype: the PISA pyramid's dtype for this model ("float32" or "bfloat16"; an inference
  choice, the parameters are the same), None the run's. ValueError naming it for a run without
  a pyramid (dense, NSA, HiLS).

  Raises NoCheckpointError (its message starts with "workdir") when `workdir` is not a run
  folder or holds no checkpoint, and the checkpoint module's
  CorruptCheckpointError / IncompatibleCheckpointError when none can be restored (nothing in
  `workdir` is changed either way).
  """
  import jax
  from flax import nnx
  from jax.sharding import SingleDeviceSharding

  from pisa_jax.models.decoder import Decoder
  from pisa_jax.train import checkpoint as ckpt_lib
  from pisa_jax.train.trainer import build_optimizer

  workdir = Path(workdir)
  directory = (workdir / "checkpoints").absolute()
  saved = read_run_config(workdir)
  # The attention of the newest checkpoint may differ from config.json's: the shapes may not.
  try:
    point = ckpt_lib.find_resume_point(directory, saved.model, allow_attention_change=True)
  except ckpt_lib.CorruptCheckpointError as e:
    # What a reader can do differs from what the trainer can: nothing here may be deleted.
    listed = "; ".join(f"{step}: {reason}" for step, reason in e.skipped)
    raise ckpt_lib.CorruptCheckpointError(
        f"no checkpoint in {directory} passes its checksums ({listed}); nothing was read or "
        f"changed. If pisa-train is still writing this run, wait for its next checkpoint; "
        f"otherwise the files changed after they were saved: copy the run's checkpoints again "
        f"from where it was trained or backed up", skipped=e.skipped) from None
  if point is None:
    raise NoCheckpointError(f"workdir: {directory} holds no checkpoint; {_hint(workdir)}")
  config = Config.from_dict(point.meta["config"])
  if summary_dtype is not None:
    config = with_summary_dtype(config, summary_dtype)

  abstract = nnx.eval_shape(lambda: Decoder(config.model, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(abstract, nnx.Param)
  shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(params))
  optimizer = jax.eval_shape(build_optimizer(config.train).init, shapes)
  device, host = jax.devices()[0], jax.devices("cpu")[0]

  def placed(tree, where):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                       sharding=SingleDeviceSharding(where)), tree)

  # The train state's layout (`trainer.build_trainer`): the Adam moments are restored too, as
  # the checkpoint holds them, but into host memory, where they cost the device nothing.
  abstract_state = {
      "params": placed(shapes, device), "opt_state": placed(optimizer, host),
      "step": placed(jax.ShapeDtypeStruct((), jax.numpy.int32), host),
      "rng": placed(jax.ShapeDtypeStruct((2,), jax.numpy.uint32), host),
  }
  reader = ckpt_lib.Checkpointer(directory, read_only=True)
  try:
    state = reader.restore(point.step, abstract_state, config, verified=True)
  finally:
    reader.close()
  nnx.replace_by_pure_dict(params, state["params"])
  return config, nnx.merge(graphdef, params), point.step
