"""Sharded training: mesh, state, the AOT-compiled step, checkpoints, logging and the loop.

The train state is a plain pytree `{"params", "opt_state", "step", "rng"}`: parameters as the NNX
model's pure dict, placed by the logical-axis table (`pisa_jax.models.sharding`). One step runs
`grad_accum` micro-batches under `lax.scan`, sums float32 gradients, divides by the number of
counted tokens, clips at global norm 1.0 and applies AdamW with the schedule's learning rate.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
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
from pisa_jax.models.sharding import batch_sharding, make_mesh, param_shardings
from pisa_jax.train import checkpoint as ckpt_lib
from pisa_jax.train.data import make_batches
from pisa_jax.train.schedule import make_schedule

# Dense bf16 peak FLOP/s per device, for MFU; looked up by substring of `device.device_kind`.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12}


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


def loss_sums(graphdef, params, inputs, targets, weights):
  """Summed token NLL, summed weight and summed argmax hits, all float32.

  inputs, targets int32 `[B, T]`; weights float32 `[B, T]` (0 where the loss does not count).
  """
  model = nnx.merge(graphdef, params)
  logits = model(inputs)
  logz = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  nll = logz - target_logit
  hits = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  return jnp.sum(nll * weights), (jnp.sum(weights), jnp.sum(hits * weights))


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
    """Fresh parameters from `train.seed`, Adam state at zero, step 0, placed by the table."""
    cfg = self.config

    def init():
      key = jax.random.key(cfg.train.seed)
      model = Decoder(cfg.model, rngs=nnx.Rngs(params=key))
      params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
      return {
          "params": params,
          "opt_state": build_optimizer(cfg.train).init(params),
          "step": jnp.zeros((), jnp.int32),
          "rng": jax.random.key_data(key),
      }

    with jax.set_mesh(self.mesh):
      return jax.jit(init, out_shardings=self.state_shardings)()

  def place_batch(self, batch: dict[str, np.ndarray], shardings: dict) -> dict:
    return {k: jax.make_array_from_process_local_data(shardings[k], v) for k, v in batch.items()}


def _memory_summary(compiled) -> dict:
  analysis = compiled.memory_analysis()
  if analysis is None:
    return {}
  fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes", "generated_code_size_in_bytes")
  return {f: int(getattr(analysis, f)) for f in fields if hasattr(analysis, f)}


def build_trainer(config: Config, mesh: Mesh | None = None) -> Trainer:
  """Builds the mesh, shardings and the ahead-of-time compiled train and eval steps."""
  cfg, t = config, config.train
  mesh = make_mesh(t.fsdp) if mesh is None else mesh
  n_dev = mesh.devices.size
  global_batch = t.per_device_batch * n_dev

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
        lambda p, mb: loss_sums(graphdef, p, mb["inputs"], mb["targets"], mb["weights"]),
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
        graphdef, params, batch["inputs"], batch["targets"], batch["weights"]
    )
    return {"loss_sum": loss, "weight": weight, "hits": hits}

  a, s = t.grad_accum, t.seq_len
  batch_sh = {k: batch_sharding(mesh, 3, 1) for k in ("inputs", "targets", "weights")}
  eval_sh = {k: batch_sharding(mesh, 2, 0) for k in ("inputs", "targets", "weights")}
  abstract_batch = {
      "inputs": jax.ShapeDtypeStruct((a, global_batch, s), jnp.int32, sharding=batch_sh["inputs"]),
      "targets": jax.ShapeDtypeStruct((a, global_batch, s), jnp.int32, sharding=batch_sh["targets"]),
      "weights": jax.ShapeDtypeStruct((a, global_batch, s), jnp.float32, sharding=batch_sh["weights"]),
  }
  abstract_eval = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype, sharding=eval_sh[k])
                   for k, v in abstract_batch.items()}
  with jax.set_mesh(mesh):
    compiled_train = jax.jit(
        train_step, in_shardings=(state_shardings, batch_sh),
        out_shardings=(state_shardings, replicated), donate_argnums=0,
    ).lower(abstract_state, abstract_batch).compile()
    compiled_eval = jax.jit(
        eval_step, in_shardings=(p_shard, eval_sh), out_shardings=replicated,
    ).lower(abstract_state["params"], abstract_eval).compile()
  return Trainer(
      config=cfg, mesh=mesh, graphdef=graphdef, state_shardings=state_shardings,
      abstract_state=abstract_state, batch_shardings=batch_sh, eval_batch_shardings=eval_sh,
      train_step=compiled_train, eval_step=compiled_eval, global_batch=global_batch,
      memory=_memory_summary(compiled_train),
  )


def peak_flops(device) -> float | None:
  for name, flops in PEAK_FLOPS.items():
    if name in device.device_kind:
      return flops
  return None


def _fmt_bytes(n: int) -> str:
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclasses.dataclass
class TrainResult:
  """What a call to `train` did: per-step losses of this invocation, evals, and how it ended."""

  start_step: int
  end_step: int
  losses: dict[int, float]
  accuracies: dict[int, float]
  evals: list[dict]
  stopped_early: bool
  workdir: Path


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


class _Interrupt:
  """First Ctrl-C asks the loop to checkpoint and stop; a second one raises at once."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def __enter__(self):
    try:
      self._previous = signal.signal(signal.SIGINT, self._handle)
    except ValueError:  # not the main thread: Ctrl-C stays with whoever owns it
      self._previous = None
    return self

  def _handle(self, signum, frame):
    if self.requested:
      raise KeyboardInterrupt
    self.requested = True
    tqdm.write("Ctrl-C: finishing this step, saving a checkpoint and exiting (again to abort)")

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGINT, self._previous)


def train(config: Config, workdir: str | Path, *, run_steps: int | None = None,
          max_seconds: float | None = None,
          progress: bool = True, mesh: Mesh | None = None, quiet: bool = False,
          print_config: bool = True, trainer: Trainer | None = None) -> TrainResult:
  """Trains `config` in `workdir`, resuming from its latest complete checkpoint.

  run_steps: stop after this many steps of this invocation (checkpointing first), as Ctrl-C does.
  max_seconds: likewise, once this much wall time has passed in the loop (compilation excluded).
  """
  cfg, t = config, config.train
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  say = (lambda *a: None) if quiet else tqdm.write
  if print_config:
    say("resolved config:\n" + cfg.to_json())
  (workdir / "config.json").write_text(cfg.to_json() + "\n")

  if trainer is not None and trainer.config != cfg:
    raise ValueError("trainer was built for a different config than config: build it with "
                     "build_trainer(config) or pass trainer=None")
  trainer = build_trainer(cfg, mesh) if trainer is None else trainer
  n_dev = trainer.mesh.devices.size
  say(f"mesh {dict(trainer.mesh.shape)} on {n_dev} x {jax.devices()[0].device_kind}; "
      f"{count_params(cfg.model) / 1e6:.1f}M parameters; global batch {trainer.global_batch} x "
      f"{t.grad_accum} accumulation x {t.seq_len} tokens")
  if trainer.memory:
    say("compiled train step memory: " + ", ".join(
        f"{k.removesuffix('_size_in_bytes')} {_fmt_bytes(v)}" for k, v in trainer.memory.items()))

  checkpoints = ckpt_lib.Checkpointer(workdir / "checkpoints", keep=t.keep_checkpoints,
                                      use_async=t.async_checkpointing)
  pi, pc = jax.process_index(), jax.process_count()
  train_batches = make_batches(cfg, "train", global_batch=trainer.global_batch,
                               accum=t.grad_accum, process_index=pi, process_count=pc)
  val_batches = make_batches(cfg, "val", global_batch=trainer.global_batch, accum=1,
                             process_index=pi, process_count=pc)

  latest = checkpoints.latest_step()
  if latest is not None:
    state = checkpoints.restore(latest, trainer.abstract_state, cfg)
    say(f"resumed from {checkpoints.directory}/{latest}")
  elif t.init_from:
    state = ckpt_lib.init_from(t.init_from, trainer.abstract_state, cfg)
    say(f"initialised parameters and Adam moments from {t.init_from}; step reset to 0")
  else:
    state = trainer.init_state()
  start = int(state["step"])

  flops_tok = flops_per_token(cfg.model, t.seq_len)
  peak = t.peak_tflops_per_device * 1e12 or peak_flops(jax.devices()[0])
  metrics_file = open(workdir / "metrics.jsonl", "a")
  tb = _tensorboard(workdir)
  losses: dict[int, float] = {}
  accuracies: dict[int, float] = {}
  evals: list[dict] = []
  window: list[dict] = []
  t_window = time.perf_counter()
  stop_at = t.steps if run_steps is None else min(t.steps, start + run_steps)

  def record(step: int, m: dict) -> None:
    """Fetches step `step`'s metrics (one step behind the dispatch) and checks the loss."""
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
    e = evaluate(trainer, state["params"], val_batches, t.eval_batches)
    e["step"] = step
    evals.append(e)
    metrics_file.write(json.dumps(e) + "\n")
    metrics_file.flush()
    if tb is not None:
      tb.add_scalar("eval/loss", e["eval_loss"], step)
    say(f"step {step:>7d} | eval loss {e['eval_loss']:.4f} | eval accuracy {e['eval_accuracy']:.3f}")

  def save(step: int, force: bool = False) -> None:
    checkpoints.save(step, state, cfg, force=force)

  stopped_early = False
  t_loop = time.perf_counter()
  bar = tqdm(total=t.steps, initial=start, disable=not progress, desc="train", unit="step",
             dynamic_ncols=True)
  pending = None
  try:
    with _Interrupt() as interrupt:
      step = start
      while step < stop_at:
        batch = trainer.place_batch(train_batches.batch(step), trainer.batch_shardings)
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
        if done or ckpt or ev or interrupt.requested or out_of_time or step == stop_at:
          record(*pending)
          pending = None
          bar.set_postfix(loss=f"{losses[step - 1]:.4f}")
        if done:
          log_interval(step)
        if ev:
          run_eval(step)
        if ckpt:
          save(step)
        if interrupt.requested or out_of_time:
          stopped_early = True
          break
      if step == stop_at and stop_at < t.steps:
        stopped_early = True
      if stopped_early:
        log_interval(step)
        if not evals or evals[-1]["step"] != step:
          run_eval(step)
        save(step, force=True)
        say(f"stopped at step {step}; checkpoint saved to {checkpoints.directory}/{step}; run the "
            f"same command again to resume")
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
      metrics_file.write(json.dumps({"step": step, "peak_bytes_in_use": stats["peak_bytes_in_use"]}) + "\n")
      say(f"peak device memory {_fmt_bytes(stats['peak_bytes_in_use'])}")
  finally:
    bar.close()
    checkpoints.close()
    metrics_file.close()
    if tb is not None:
      tb.close()
  return TrainResult(start_step=start, end_step=step, losses=losses, accuracies=accuracies,
                     evals=evals, stopped_early=stopped_early, workdir=workdir)


def _tensorboard(workdir: Path):
  """A tensorboardX writer when tensorboardX is installed; TensorBoard is optional."""
  import importlib.util

  if importlib.util.find_spec("tensorboardX") is None:
    return None
  from tensorboardX import SummaryWriter

  return SummaryWriter(str(workdir / "tensorboard"))
