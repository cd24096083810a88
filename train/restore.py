"""Restore a `pisa-train` run's newest verified checkpoint as a model, for inference and evaluation.

  config, model, step = restore_model("runs/small")
"""

from __future__ import annotations

import json
from pathlib import Path


class NoCheckpointError(FileNotFoundError):
  """The folder is not a pisa-train run, or holds no checkpoint; the message names `workdir`."""


def restore_model(workdir: str | Path):
  """(config, model, step): the newest checkpoint of the run `workdir` that passes its checksums,
  as a `pisa_jax.models.Decoder` with the config it was trained with.

  Raises NoCheckpointError (its message starts with "workdir") when `workdir` is not a run
  folder or holds no checkpoint, and the checkpoint module's
  CorruptCheckpointError / IncompatibleCheckpointError when none can be restored.
  """
  import jax
  from flax import nnx
  from jax.sharding import SingleDeviceSharding

  from pisa_jax.configs.base import Config
  from pisa_jax.models.decoder import Decoder
  from pisa_jax.train import checkpoint as ckpt_lib
  from pisa_jax.train.trainer import build_optimizer

  workdir = Path(workdir)
  directory = (workdir / "checkpoints").absolute()
  hint = f"train one first (pisa-train --workdir {workdir})"
  try:
    saved = Config.from_dict(json.loads((workdir / "config.json").read_text()))
  except FileNotFoundError:
    raise NoCheckpointError(f"workdir: {workdir} has no config.json and no checkpoint: it is not a "
                            f"pisa-train run folder; {hint}") from None
  except ValueError as e:
    raise NoCheckpointError(f"workdir: {workdir}/config.json is unreadable ({e})") from None
  # The attention of the newest checkpoint may differ from config.json's: the shapes may not.
  point = ckpt_lib.find_resume_point(directory, saved.model, allow_attention_change=True)
  if point is None:
    raise NoCheckpointError(f"workdir: {directory} holds no checkpoint; {hint}")
  config = Config.from_dict(point.meta["config"])

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
