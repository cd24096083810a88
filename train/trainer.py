"""Sharded training: mesh, state, the AOT-compiled step, checkpoints, logging and the loop.

The train state is a plain pytree `{"params", "opt_state", "step", "rng"}`: parameters as the NNX
model's pure dict, placed by the logical-axis table (`pisa_jax.models.sharding`). One step runs
`grad_accum` micro-batches under `lax.scan`, sums float32 gradients, divides by the number of
counted tokens, clips at global norm 1.0 and applies AdamW with the schedule's learning rate.

`train` checks what it can before it writes anything to the run folder: the data, the checkpoints
(checksums, and the model they were written for), and the compiled step's memory against the
device's. Its status lines go to the `pisa_jax.train.trainer` logger; `console_logging` prints them
above the progress bar.

In a multi-process run (after `jax.distributed.initialize`, which `pisa-train` calls through
`pisa_jax.train.distributed`) every process calls `train` with the same config: the mesh spans
all their devices, each process places its own rows of every batch, and process 0 alone writes
the run folder and prints; the processes agree on the config at the start and on every early stop.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm import tqdm

from pisa_jax.configs.base import Config, TrainConfig
from pisa_jax.models.decoder import Decoder, count_params, flops_per_token
from pisa_jax.models.sharding import batch_sharding, batch_ways, make_mesh, param_shardings
from pisa_jax.train import checkpoint as ckpt_lib
from pisa_jax.train import distributed
from pisa_jax.train.data import make_batches
from pisa_jax.train.loss import token_loss_sums
from pisa_jax.train import run_folder
from pisa_jax.train.run_folder import (InterruptedBeforeStart, RunFolderError,  # noqa: F401
                                       RunFolderInUseError, _truncate_metrics, check_workdir,
                                       console_logging)
from pisa_jax.train.memory import (PEAK_FLOPS, InsufficientMemoryError, _fmt_bytes,  # noqa: F401
                                   _memory_summary, check_memory, device_memory,
                                   memory_record, peak_flops, step_memory)
from pisa_jax.train.schedule import make_schedule

log = logging.getLogger(__name__)
# How long the other processes of a multi-process run wait for process 0 to seal the last
# checkpoint (sha256 of every file); a process that dies meanwhile is caught by the watchdog.
FINAL_SEAL_TIMEOUT_S = 3600


class NonFiniteLossError(RuntimeError):
  """The loss became NaN or inf; the run stopped without saving over the last good checkpoint."""


def build_optimizer(t: TrainConfig) -> optax.GradientTransformation:
  """Clip to global norm, Adam moments, decoupled weight decay on matrices; lr applied by the step.

  The learning rate is multiplied in the step from `state["step"]` rather than kept in an optax
  schedule state, so continued pretraining can restore Adam's moments and start a new schedule.
  Weight decay skips 1-D parameters (RMSNorm scales).
  """
  return optax.chain(
      optax.clip_by_global_norm(t.grad_clip),
      optax.scale_by_adam(b1=t.adam_b1, b2=t.adam_b2, eps=t.adam_eps),
      optax.add_decayed_weights(t.weight_decay, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
  )


def loss_sums(graphdef, params, inputs, targets, weights, *, chunk: int | None = None,
              segment_ids=None, positions=None):
  """Summed token NLL, summed weight and summed argmax hits, all float32.

  inputs, targets int32 `[B, T]`; weights float32 `[B, T]` (0 where the loss does not count).
  chunk: tokens per chunk of the output projection and its loss (`train.loss_chunk`; None or 0:
  all at once), see `pisa_jax.train.loss`. segment_ids, positions: int32 `[B, T]` of packed
  documents (`data.packing`), or None.
  """
  model = nnx.merge(graphdef, params)
  nll, weight, hits = token_loss_sums(
      model.hidden_states(inputs, segment_ids, positions), model.output_embedding(), targets,
      weights, vocab_size=model.cfg.vocab_size, chunk=chunk)
  return nll, (weight, hits)


def _fresh_params(cfg: Config) -> dict:
  """The model's parameters drawn from `train.seed`, as a pure dict."""
  model = Decoder(cfg.model, rngs=nnx.Rngs(params=jax.random.key(cfg.train.seed)))
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@dataclasses.dataclass
class Trainer:
  """Everything compiled for one config on one mesh."""

  config: Config
  mesh: Mesh
  graphdef: Any
  state_shardings: Any
  abstract_state: Any
  batch_shardings: dict
  eval_batch_shardings: dict
  train_step: Any
  eval_step: Any
  global_batch: int
  memory: dict

  @property
  def tokens_per_step(self) -> int:
    return self.global_batch * self.config.train.grad_accum * self.config.train.seq_len

  def init_state(self) -> dict:
    """Fresh parameters from `train.seed`, Adam state at zero, step 0, placed by the table.

    Parameters that fit twice in half of one device's memory are drawn op by op, unsharded, then
    placed: one jitted initialiser compiles a random draw per parameter (about a minute of a
    `small` training start on the H200, 9 s on a CPU), op by op each (shape, std) compiles once.
    Larger models take that initialiser, which draws each array sharded. Same bits (tested)."""
    with jax.set_mesh(self.mesh):
      if not self.draws_eagerly:
        return self._init_jitted(None)
      return self._init_jitted(jax.device_put(_fresh_params(self.config),
                                              self.state_shardings["params"]))

  @functools.cached_property
  def draws_eagerly(self) -> bool:
    size = sum(x.size * 4 for x in jax.tree.leaves(self.abstract_state["params"]))
    stats = jax.local_devices()[0].memory_stats()
    return stats is None or "bytes_limit" not in stats or 2 * size <= stats["bytes_limit"] // 2

  @functools.cached_property
  def _init_jitted(self):
    """The jitted fresh state around placed parameters, or drawing them too (given None)."""
    cfg = self.config

    def init(params):
      params = _fresh_params(cfg) if params is None else params
      return {"params": params, "opt_state": build_optimizer(cfg.train).init(params),
              "step": jnp.zeros((), jnp.int32),
              "rng": jax.random.key_data(jax.random.key(cfg.train.seed))}

    return jax.jit(init, out_shardings=self.state_shardings, donate_argnums=0)

  def place_batch(self, batch: dict[str, np.ndarray], shardings: dict) -> dict:
    """This process's rows `[..., B_local, T]` as global arrays `[..., global_batch, T]` (one
    process: the arrays as they are)."""

    def place(sharding, rows):
      if jax.process_count() == 1:
        return jax.make_array_from_process_local_data(sharding, rows)
      shape = rows.shape[:-2] + (self.global_batch, rows.shape[-1])
      return jax.make_array_from_process_local_data(sharding, rows, shape)

    return {k: place(shardings[k], v) for k, v in batch.items()}

  @functools.cached_property
  def _vote(self):
    """The largest of every process's stop code: one int32 per device, each process's own."""
    sharding = NamedSharding(self.mesh, P(self.mesh.axis_names))
    with jax.set_mesh(self.mesh):
      fn = jax.jit(jnp.max, out_shardings=NamedSharding(self.mesh, P()))
    return sharding, fn

  def vote(self, code: int) -> jax.Array:
    """Dispatches this process's stop code (`STOP_CODES`) and returns every process's largest,
    a replicated scalar that is ready once the steps dispatched before it are."""
    sharding, fn = self._vote
    local = np.full((jax.local_device_count(),), code, np.int32)
    return fn(jax.make_array_from_process_local_data(sharding, local, (self.mesh.devices.size,)))


def build_trainer(config: Config, mesh: Mesh | None = None) -> Trainer:
  """Builds the mesh, shardings and the ahead-of-time compiled train and eval steps."""
  cfg, t = config, config.train
  mesh = make_mesh(t.fsdp, t.context_parallel) if mesh is None else mesh
  # Under context parallelism a group of train.context_parallel devices shares each sequence.
  global_batch = t.per_device_batch * batch_ways(mesh, t.context_parallel)

  abstract_model = nnx.eval_shape(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)))
  graphdef, abstract_params_state = nnx.split(abstract_model, nnx.Param)
  p_shard = param_shardings(abstract_params_state, mesh)
  optimizer = build_optimizer(t)
  abstract_params = jax.tree.map(
      lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(abstract_params_state)
  )
  replicated = NamedSharding(mesh, P())
  abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
  opt_shard = optax.tree_map_params(
      optimizer, lambda _, s: s, abstract_opt, p_shard,
      transform_non_params=lambda _: replicated, is_leaf=lambda x: isinstance(x, NamedSharding),
  )
  state_shardings = {"params": p_shard, "opt_state": opt_shard, "step": replicated, "rng": replicated}
  abstract_state = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      {"params": abstract_params, "opt_state": abstract_opt,
       "step": jax.ShapeDtypeStruct((), jnp.int32), "rng": jax.ShapeDtypeStruct((2,), jnp.uint32)},
      state_shardings,
  )
  schedule = make_schedule(t)

  def train_step(state, batch):
    params = state["params"]
    grad_fn = jax.value_and_grad(
        lambda p, mb: loss_sums(graphdef, p, mb["inputs"], mb["targets"], mb["weights"],
                                chunk=t.loss_chunk, segment_ids=mb.get("segment_ids"),
                                positions=mb.get("positions")),
        has_aux=True,
    )

    def micro(carry, mb):
      grads, loss, weight, hits = carry
      (l, (w, h)), g = grad_fn(params, mb)
      grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
      return (grads, loss + l, weight + w, hits + h), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    zero = jnp.zeros((), jnp.float32)
    (grads, loss, weight, hits), _ = jax.lax.scan(micro, (zeros, zero, zero, zero), batch)
    # Mean over every counted token of the global batch and all micro-batches.
    denom = jnp.maximum(weight, 1.0)
    grads = jax.tree.map(lambda g: g / denom, grads)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state["opt_state"], params)
    lr = schedule(state["step"])
    params = jax.tree.map(lambda p, u: (p - lr * u).astype(p.dtype), params, updates)
    new_state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1,
                 "rng": state["rng"]}
    # The new parameters' norm: a finite loss can still be followed by a non-finite update, and a
    # checkpoint of such a state must never be written.
    metrics = {"loss": loss / denom, "accuracy": hits / denom, "grad_norm": grad_norm, "lr": lr,
               "param_norm": optax.tree.norm(params)}
    return new_state, metrics

  def eval_step(params, batch):
    loss, (weight, hits) = loss_sums(
        graphdef, params, batch["inputs"], batch["targets"], batch["weights"], chunk=t.loss_chunk,
        segment_ids=batch.get("segment_ids"), positions=batch.get("positions"),
    )
    return {"loss_sum": loss, "weight": weight, "hits": hits}

  a, s = t.grad_accum, t.seq_len
  # The arrays of a batch (`pisa_jax.train.data`): packed documents add their ids and positions.
  dtypes = {"inputs": jnp.int32, "targets": jnp.int32, "weights": jnp.float32}
  if cfg.data.packing:
    dtypes.update(segment_ids=jnp.int32, positions=jnp.int32)
  batch_sh = {k: batch_sharding(mesh, 3, 1) for k in dtypes}
  eval_sh = {k: batch_sharding(mesh, 2, 0) for k in dtypes}
  abstract_batch = {k: jax.ShapeDtypeStruct((a, global_batch, s), dtype, sharding=batch_sh[k])
                    for k, dtype in dtypes.items()}
  abstract_eval = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype, sharding=eval_sh[k])
                   for k, v in abstract_batch.items()}
  with jax.set_mesh(mesh):
    compiled_train = jax.jit(
        train_step, in_shardings=(state_shardings, batch_sh),
        out_shardings=(state_shardings, replicated), donate_argnums=0,
    ).lower(abstract_state, abstract_batch).compile()

  def compile_eval():
    with jax.set_mesh(mesh):
      return jax.jit(eval_step, in_shardings=(p_shard, eval_sh), out_shardings=replicated,
                     ).lower(abstract_state["params"], abstract_eval).compile()

  return Trainer(
      config=cfg, mesh=mesh, graphdef=graphdef, state_shardings=state_shardings,
      abstract_state=abstract_state, batch_shardings=batch_sh, eval_batch_shardings=eval_sh,
      train_step=compiled_train, eval_step=_CompiledOnFirstCall(compile_eval),
      global_batch=global_batch,
      memory=_memory_summary(compiled_train),
  )


class _CompiledOnFirstCall:
  """A step compiled when first called: a run with train.eval_batches=0 never pays its compile."""

  def __init__(self, compile_fn):
    self._compile, self._compiled = compile_fn, None

  def __call__(self, *args):
    if self._compiled is None:
      self._compiled = self._compile()
    return self._compiled(*args)


@dataclasses.dataclass
class TrainResult:
  """What a call to `train` did: per-step losses of this invocation, evals, and how it ended.

  stop_reason: None when train.steps were reached, else what stopped the run first (a checkpoint
  saved): "run_steps", "max_seconds", "SIGINT" (Ctrl-C) or "SIGTERM"."""

  start_step: int
  end_step: int
  losses: dict[int, float]
  accuracies: dict[int, float]
  evals: list[dict]
  stopped_early: bool
  workdir: Path
  # The run folder's checkpoint had already reached train.steps: nothing was trained.
  already_complete: bool = False
  stop_reason: str | None = None


def evaluate(trainer: Trainer, params, batches, num_batches: int) -> dict:
  """Mean held-out loss and accuracy over `num_batches` fixed validation batches."""
  loss = weight = hits = 0.0
  for i in range(num_batches):
    b = batches.batch(i)
    b = {k: v[0] for k, v in b.items()}
    out = trainer.eval_step(params, trainer.place_batch(b, trainer.eval_batch_shardings))
    loss += float(out["loss_sum"])
    weight += float(out["weight"])
    hits += float(out["hits"])
  weight = max(weight, 1.0)
  return {"eval_loss": loss / weight, "eval_accuracy": hits / weight}


@dataclasses.dataclass
class _Start:
  """What the set-up found: the compiled trainer, the state to start from and where it came from."""

  trainer: Trainer
  state: dict
  point: ckpt_lib.ResumePoint | None
  train_batches: Any
  val_batches: Any
  # The fields that differ from the restored checkpoint's config: {"section.field": (old, new)}.
  changes: dict


def train(config: Config, workdir: str | Path, *, run_steps: int | None = None,
          max_seconds: float | None = None,
          progress: bool = True, mesh: Mesh | None = None, quiet: bool = False,
          print_config: bool = True, trainer: Trainer | None = None,
          allow_attention_change: bool = False, command: list[str] | None = None) -> TrainResult:
  """Trains `config` in `workdir`, resuming from its newest checkpoint that passes its checksums.

  run_steps: stop after this many steps of this invocation (checkpointing first), as Ctrl-C does.
  max_seconds: likewise, once this much wall time has passed in the loop (compilation excluded).
  allow_attention_change: resume a checkpoint trained with other attention fields (attention,
    block_size, top_k, branching, beam), which is refused otherwise.
  command: the command line recorded with a resume's changed fields (default `sys.argv`).

  `workdir` is new, empty or a run folder (`pisa_jax.train.run_folder`), else refused untouched;
  its lock is held for the whole call (a second call on it is refused). A resume logs each field
  that differs from the checkpoint's config (old -> new) and appends them to config_history.jsonl
  (config.json keeps the first config). Beside the lock, nothing is written until the run is sure
  to start: the data, the checkpoints (checksums, model), the compiled step and its memory are
  checked first; a folder this call created is removed if the set-up fails. Status lines go to
  the `pisa_jax.train` loggers (see `console_logging`).
  """
  cfg, t = config, config.train
  if run_steps is not None and run_steps < 1:
    raise ValueError(f"run_steps={run_steps} must be >= 1")
  if max_seconds is not None and not max_seconds > 0:
    raise ValueError(f"max_seconds={max_seconds} must be > 0")
  if trainer is not None and trainer.config != cfg:
    raise ValueError("trainer was built for a different config than config: build it with "
                     "build_trainer(config) or pass trainer=None")
  workdir = Path(workdir)
  command = list(sys.argv if command is None else command)
  # In a multi-process run every process must run the same thing; process 0 alone locks, marks
  # and writes the run folder, and prints.
  distributed.agree("train", {"config": cfg.to_dict(), "workdir": str(workdir.absolute()),
                              "run_steps": run_steps, "max_seconds": max_seconds,
                              "allow_attention_change": allow_attention_change})
  primary = jax.process_index() == 0
  if primary:
    check_workdir(workdir)
    run_folder.inspect_run_folder(workdir)  # a foreign folder is refused before anything is written
  # Warnings as ever on process 0 (quiet or not); nothing at all from the others.
  warn = log.warning if primary else (lambda *a: None)
  quiet, progress = quiet or not primary, progress and primary
  if not quiet:
    console_logging()
  say = (lambda *a: None) if quiet else log.info
  checkpoint_dir = (workdir / "checkpoints").absolute()

  created = run_folder.first_missing(workdir) if primary else None  # removed if set-up fails
  held = run_folder.lock(workdir, command) if primary else None
  try:
    try:
      if primary:
        kind = run_folder.inspect_run_folder(workdir)  # again, now that no other run can change it
        if held.notice:
          warn(held.notice)
      begin = _set_up(cfg, checkpoint_dir, mesh=mesh, trainer=trainer, say=say, warn=warn,
                      print_config=print_config, allow_attention_change=allow_attention_change)
      if isinstance(begin, TrainResult):
        return dataclasses.replace(begin, workdir=workdir)
      # The run starts: from here on the run folder is written.
      start, dropped = int(begin.state["step"]), 0
      if primary:
        workdir.mkdir(parents=True, exist_ok=True)
        if kind != "run":
          run_folder.mark(workdir, say if kind == "unmarked run" else None)
        if begin.point is not None and begin.point.skipped:
          skipped = [step for step, _ in begin.point.skipped]
          moved = ckpt_lib.set_aside(checkpoint_dir, skipped, workdir / "skipped_checkpoints")
          warn("; ".join(
              f"skipped checkpoint {checkpoint_dir}/{step} ({reason}): moved it to {target}"
              for (step, reason), target in zip(begin.point.skipped, moved)))
        if begin.point is None or not (workdir / "config.json").exists():
          (workdir / "config.json").write_text(cfg.to_json() + "\n")
        if begin.changes:
          run_folder.append_history(workdir, step=start, changes=begin.changes, command=command)
        memory = json.dumps(memory_record(begin.trainer), indent=1)
        (workdir / "memory.json").write_text(memory + "\n")
        dropped = _truncate_metrics(workdir / "metrics.jsonl", start)
      # Every process opens the checkpoints once process 0 has set the skipped ones aside.
      distributed.barrier("run folder ready")
      checkpoints = ckpt_lib.Checkpointer(checkpoint_dir, keep=t.keep_checkpoints,
                                          use_async=t.async_checkpointing)
    except BaseException as e:
      if created is not None:
        shutil.rmtree(created, ignore_errors=True)
      if held is not None:
        held.release(remove=held.created)
      if isinstance(e, KeyboardInterrupt):
        raise InterruptedBeforeStart(
            f"interrupted before training started: nothing was written to {workdir}") from None
      raise
    if begin.point is not None:
      say(f"resumed from {checkpoint_dir}/{begin.point.step} (step {start} of {t.steps})")
    if dropped:
      say(f"dropped {dropped} rows past step {start} from metrics.jsonl: those steps run again")
    result = _loop(cfg, workdir, begin, checkpoints, run_steps=run_steps,
                   max_seconds=max_seconds, progress=progress, say=say, primary=primary)
    # Process 0 may still be sealing the last checkpoint (its checksums): the others wait for it
    # here, as long as it takes, rather than in jax's shutdown, which has a timeout.
    distributed.barrier("trained", timeout_s=FINAL_SEAL_TIMEOUT_S)
    return result
  finally:
    if held is not None:
      held.release()


def _set_up(cfg: Config, checkpoint_dir: Path, *, mesh, trainer, say, warn, print_config: bool,
            allow_attention_change: bool) -> _Start | TrainResult:
  """Checks the data and checkpoints, compiles, checks the memory and restores: writes nothing."""
  t = cfg.train
  mesh = trainer.mesh if trainer is not None else (
      make_mesh(t.fsdp, t.context_parallel) if mesh is None else mesh)
  global_batch = t.per_device_batch * batch_ways(mesh, t.context_parallel)
  # The data first: a missing or unprepared corpus fails before anything compiles.
  pi, pc = jax.process_index(), jax.process_count()
  workdir = checkpoint_dir.parent
  train_batches = make_batches(cfg, "train", global_batch=global_batch, accum=t.grad_accum,
                               process_index=pi, process_count=pc, workdir=workdir)
  # No evaluation, no validation windows: a run longer than the validation split still trains.
  val_batches = None if t.eval_batches == 0 else make_batches(
      cfg, "val", global_batch=global_batch, accum=1, process_index=pi, process_count=pc,
      workdir=workdir)

  point = ckpt_lib.find_resume_point(checkpoint_dir, cfg.model,
                                     allow_attention_change=allow_attention_change)
  if point is not None and point.step >= t.steps:
    say(f"the run is complete: checkpoint {checkpoint_dir}/{point.step} is step {point.step} of "
        f"train.steps={t.steps}; --set train.steps to more to train further, or use a new --workdir")
    return TrainResult(start_step=point.step, end_step=point.step, losses={}, accuracies={},
                       evals=[], stopped_early=False, workdir=checkpoint_dir.parent,
                       already_complete=True)
  if print_config:
    say("resolved config:\n" + cfg.to_json())
  changed = {} if point is None else run_folder.config_changes(point.meta["config"], cfg)
  if changed:
    warn(f"resuming checkpoint {point.step} with changed fields (config.json keeps the "
                f"original; {run_folder.HISTORY} records the changes):\n"
                + run_folder.describe_changes(changed))
  if point is not None and allow_attention_change:
    changes = ckpt_lib.attention_changes(point.meta["config"]["model"], cfg.model)
    if changes:
      warn(f"continuing checkpoint {point.step} under other attention "
                  f"({'; '.join(changes)}), as --allow-attention-change asks")

  trainer = build_trainer(cfg, mesh) if trainer is None else trainer
  say(f"mesh {dict(trainer.mesh.shape)} on {trainer.mesh.devices.size} x "
      f"{jax.devices()[0].device_kind}; {count_params(cfg.model) / 1e6:.1f}M parameters; global "
      f"batch {trainer.global_batch} x {t.grad_accum} accumulation x {t.seq_len} tokens")
  say(check_memory(trainer))

  if point is not None:
    reader = ckpt_lib.Checkpointer(checkpoint_dir, read_only=True)
    try:
      state = reader.restore(point.step, trainer.abstract_state, cfg, verified=True)
    finally:
      reader.close()
  elif t.init_from:
    state, source = ckpt_lib.init_from(t.init_from, trainer.abstract_state, cfg)
    for step, reason in source.skipped:
      warn(f"train.init_from: skipped checkpoint {step} ({reason})")
    say(f"initialised parameters and Adam moments from {t.init_from} (checkpoint {source.step}); "
        f"step reset to 0")
  else:
    state = trainer.init_state()
  return _Start(trainer=trainer, state=state, point=point, train_batches=train_batches,
                val_batches=val_batches, changes=changed)


def _loop(cfg: Config, workdir: Path, begin: _Start, checkpoints: ckpt_lib.Checkpointer, *,
          run_steps, max_seconds, progress, say, primary: bool = True) -> TrainResult:
  """The training loop, from the set-up's state to `train.steps` or an early stop; only the
  `primary` process writes metrics and TensorBoard (every process computes them)."""
  t, trainer, state = cfg.train, begin.trainer, begin.state
  start = int(state["step"])
  n_dev = trainer.mesh.devices.size
  flops_tok = flops_per_token(cfg.model, t.seq_len)
  peak = t.peak_tflops_per_device * 1e12 or peak_flops(jax.devices()[0])
  metrics_file = open(workdir / "metrics.jsonl" if primary else os.devnull, "a")
  tb = _tensorboard(workdir) if primary else None
  losses: dict[int, float] = {}
  accuracies: dict[int, float] = {}
  evals: list[dict] = []
  window: list[dict] = []
  t_window = time.perf_counter()
  stop_at = t.steps if run_steps is None else min(t.steps, start + run_steps)
  # The progress bar shows an exponential moving average of the per-step loss (loss_ema); the
  # status lines and metrics.jsonl give the mean loss of each logging interval (loss).
  ema = None

  def record(step: int, m: dict) -> None:
    """Fetches step `step`'s metrics (one step behind the dispatch) and checks the loss."""
    nonlocal ema
    m = {k: float(v) for k, v in m.items()}
    if not (math.isfinite(m["loss"]) and math.isfinite(m["param_norm"])):
      checkpoints.wait()
      last = checkpoints.latest_step()
      raise NonFiniteLossError(
          f"loss is {m['loss']} at step {step} (lr {m['lr']:.3g}, grad norm {m['grad_norm']:.3g}, "
          f"updated parameter norm {m['param_norm']:.3g}): "
          f"stopped without saving; the last good checkpoint is "
          f"{'step ' + str(last) if last is not None else 'none'} in {checkpoints.directory}. "
          f"Lower train.peak_lr or check the data before resuming."
      )
    losses[step] = m["loss"]
    accuracies[step] = m["accuracy"]
    ema = m["loss"] if ema is None else 0.9 * ema + 0.1 * m["loss"]
    window.append(m)

  def log_interval(step: int) -> None:
    nonlocal window, t_window
    if not window:
      return
    dt = time.perf_counter() - t_window
    tok_s = len(window) * trainer.tokens_per_step / dt
    mfu = flops_tok * tok_s / (peak * n_dev) if peak else None
    row = {"step": step, "loss": float(np.mean([w["loss"] for w in window])),
           "accuracy": float(np.mean([w["accuracy"] for w in window])),
           "lr": window[-1]["lr"], "grad_norm": float(np.mean([w["grad_norm"] for w in window])),
           "tokens_per_s": tok_s, "mfu": mfu, "time": time.time()}
    metrics_file.write(json.dumps(row) + "\n")
    metrics_file.flush()
    if tb is not None:
      for k in ("loss", "accuracy", "lr", "grad_norm", "tokens_per_s"):
        tb.add_scalar(f"train/{k}", row[k], step)
    say(f"step {step:>7d} | loss {row['loss']:.4f} | lr {row['lr']:.3e} | grad norm "
        f"{row['grad_norm']:.3f} | {tok_s:,.0f} tok/s | MFU "
        f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'}")
    window, t_window = [], time.perf_counter()

  def run_eval(step: int) -> None:
    if t.eval_batches == 0:
      return
    e = evaluate(trainer, state["params"], begin.val_batches, t.eval_batches)
    e["step"] = step
    evals.append(e)
    metrics_file.write(json.dumps(e) + "\n")
    metrics_file.flush()
    if tb is not None:
      tb.add_scalar("eval/loss", e["eval_loss"], step)
    say(f"step {step:>7d} | eval loss {e['eval_loss']:.4f} | eval accuracy {e['eval_accuracy']:.3f}")

  def save(step: int, force: bool = False) -> None:
    checkpoints.save(step, state, cfg, force=force)

  stop_reason, stop = None, 0
  agreement = _StopAgreement(trainer)
  t_loop = time.perf_counter()
  bar = tqdm(total=t.steps, initial=start, disable=not progress, desc="train", unit="step",
             dynamic_ncols=True)
  pending = None
  step = start
  # Ctrl-C and SIGTERM are caught until the last checkpoint is written: a second exits at once.
  with run_folder.StopRequest() as interrupt:
    try:
      while step < stop_at:
        batch = trainer.place_batch(begin.train_batches.batch(step), trainer.batch_shardings)
        state, metrics = trainer.train_step(state, batch)
        if pending is not None:
          record(*pending)
        pending = (step, metrics)
        step += 1
        bar.update(1)
        done = step % t.log_every == 0 or step == t.steps
        ckpt = step % t.checkpoint_every == 0 or step == t.steps
        ev = step % t.eval_every == 0 or step == t.steps
        out_of_time = max_seconds is not None and time.perf_counter() - t_loop > max_seconds
        stop = agreement(interrupt, out_of_time)
        if done or ckpt or ev or stop or step == stop_at:
          record(*pending)
          pending = None
          bar.set_postfix(loss_ema=f"{ema:.4f}")
        if done:
          log_interval(step)
        if ev:
          run_eval(step)
        if ckpt:
          save(step)
        if stop:
          break
      if step < t.steps:
        stop_reason = STOP_REASONS[stop] if stop else "run_steps"
        log_interval(step)
        if not evals or evals[-1]["step"] != step:
          run_eval(step)
        save(step, force=True)
        say(f"stopped at step {step} of {t.steps}; checkpoint saved to "
            f"{checkpoints.directory}/{step}")
      stats = jax.local_devices()[0].memory_stats() or {}
      if "peak_bytes_in_use" in stats:
        metrics_file.write(
            json.dumps({"step": step, "peak_bytes_in_use": stats["peak_bytes_in_use"]}) + "\n")
        say(f"peak device memory {_fmt_bytes(stats['peak_bytes_in_use'])}")
    finally:
      bar.close()
      try:
        checkpoints.close()
      finally:
        metrics_file.close()
        if tb is not None:
          tb.close()
  return TrainResult(start_step=start, end_step=step, losses=losses, accuracies=accuracies,
                     evals=evals, stopped_early=stop_reason is not None, workdir=workdir,
                     stop_reason=stop_reason)


# What stops a run before train.steps, as the codes the processes agree on (the largest wins).
STOP_REASONS = {1: "max_seconds", 2: "SIGINT", 3: "SIGTERM"}


class _StopAgreement:
  """Whether the loop stops after the step just dispatched, the same answer on every process.

  One process: at once, from its own signal or clock. Several: each dispatches its stop code
  with its step (`Trainer.vote`) and reads everyone's code of the step before, which is ready
  when that step is (the loop fetches its metrics anyway): all processes stop after the same
  step, one step after the first request, with the same reason.
  """

  def __init__(self, trainer: Trainer):
    self.trainer = trainer
    self.multi_process = jax.process_count() > 1
    self.pending = None

  def __call__(self, interrupt: run_folder.StopRequest, out_of_time: bool) -> int:
    codes = {name: code for code, name in STOP_REASONS.items()}
    local = (codes[interrupt.signal.name] if interrupt.requested else
             codes["max_seconds"] if out_of_time else 0)
    if not self.multi_process:
      return local
    previous, self.pending = self.pending, self.trainer.vote(local)
    return 0 if previous is None else int(previous)


def _tensorboard(workdir: Path):
  """A tensorboardX writer when tensorboardX is installed; TensorBoard is optional."""
  import importlib.util

  if importlib.util.find_spec("tensorboardX") is None:
    return None
  from tensorboardX import SummaryWriter

  return SummaryWriter(str(workdir / "tensorboard"))
