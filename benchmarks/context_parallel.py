"""Context parallelism: one sequence split over the GPUs of a host (`train.context_parallel`).

The `small-1m` preset (`small` at 2^20 tokens, remat "full", the loss in chunks) with PISA, in
three runs by default, each with every device of the run on the "seq" axis:
  - 1 device at L tokens (the baseline),
  - 2 devices at 2L tokens (weak scaling: the same tokens per device; goal >= 90% efficiency),
  - 2 devices at L tokens (strong scaling: the same sequence on twice the devices; goal >= 1.7x).
For each run a row with tokens/s and tokens/s per device, the compiled step's memory per device
(XLA's memory analysis) and the allocator's peak per device (since the process started: it never
drops below an earlier run's), and the device busy time per step by kind from a profile of a few
steps (collectives, copies, the rest; GPU planes only, zeros on a CPU). The steps run on random
tokens: no corpus is needed, and the throughput does not depend on the data.

Load balance under contiguous shards (rows with "shard"): one layer's PISA attention, forward and
backward, for the queries of each shard of the longest run's sequence (`pisa_attention_at` at that
shard's offset, against all keys; as many shards as that run's devices, at least 2) on one device. Equal times mean that a contiguous layout is
balanced, so no zig-zag layout is needed.

Every run uses one attention implementation (`--implementation`: "pallas", the kernels at each
shard's query offset, the default on a GPU; "xla", the jnp reference, the default elsewhere), so
the 1-device baseline runs the same code as the sharded runs.

  python -m benchmarks.context_parallel                      # 2 GPUs: L = 2^20
  python -m benchmarks.context_parallel --runs 1:1048576,2:2097152,2:1048576,4:4194304
  python -m benchmarks.context_parallel --replot benchmarks/results/context_parallel.json
  # a dry run (tiny model and sequences) on whatever devices exist, e.g. 2 fake CPU devices:
  XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
    python -m benchmarks.context_parallel --dry-run --out /tmp/cp
"""

from __future__ import annotations

import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _record
from benchmarks.multi_gpu import device_time_by_kind, peak_memory_per_device
from pisa_jax.configs import apply_overrides, get_config, validate
from pisa_jax.context_parallel import pisa_attention_at
from pisa_jax.models.decoder import compute_dtype
from pisa_jax.models.sharding import MESH_AXES, SEQ_AXIS
from pisa_jax.train.trainer import build_trainer

NAME = "context_parallel"
WEAK_GOAL, STRONG_GOAL = 0.9, 1.7


def parse_runs(text: str) -> list[tuple[int, int]]:
  """"1:1048576,2:2097152" -> [(devices, seq_len), ...]."""
  runs = []
  for item in filter(None, text.split(",")):
    try:
      devices, seq_len = (int(x) for x in item.split(":"))
    except ValueError:
      raise SystemExit(f"--runs entry {item!r} must be DEVICES:TOKENS, e.g. 2:2097152") from None
    if devices < 1 or seq_len < 1 or seq_len % devices:
      raise SystemExit(f"--runs entry {item!r}: DEVICES must be >= 1 and divide TOKENS")
    runs.append((devices, seq_len))
  return runs


def make_mesh(devices: int):
  """All `devices` on the sequence axis ((data, fsdp) of one device each)."""
  if devices == 1:
    return jax.make_mesh((1, 1), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:1])
  return jax.make_mesh((1, 1, devices), MESH_AXES + (SEQ_AXIS,),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3,
                       devices=jax.devices()[:devices])


def config_for(args, devices: int, seq_len: int):
  loss_chunk = min(args.loss_chunk, seq_len // devices)
  return validate(apply_overrides(get_config(args.preset), [
      "model.attention=pisa", f"model.attention_implementation={args.implementation}",
      f"train.seq_len={seq_len}", "train.per_device_batch=1", "train.grad_accum=1",
      f"train.context_parallel={devices}", "train.fsdp=1", f"train.loss_chunk={loss_chunk}",
      # The batches are made here: the loader is never asked for the preset's corpus.
      "data.source=tokens", "data.path=unused"] + args.overrides))


def random_batch(cfg, seq_len: int) -> dict:
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.model.vocab_size, (1, 1, seq_len + 1), dtype=np.int32)
  return {"inputs": tokens[..., :-1], "targets": tokens[..., 1:],
          "weights": np.ones((1, 1, seq_len), np.float32)}


def measure_run(args, devices: int, seq_len: int) -> dict:
  cfg = config_for(args, devices, seq_len)
  mesh = make_mesh(devices)
  t0 = time.perf_counter()
  trainer = build_trainer(cfg, mesh)
  compile_s = time.perf_counter() - t0
  state = trainer.init_state()
  batch = trainer.place_batch(random_batch(cfg, seq_len), trainer.batch_shardings)
  state, metrics = trainer.train_step(state, batch)  # warm-up
  jax.block_until_ready(metrics)
  t0 = time.perf_counter()
  for _ in range(args.steps):
    state, metrics = trainer.train_step(state, batch)
  jax.block_until_ready(metrics)
  step_s = (time.perf_counter() - t0) / args.steps
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      for _ in range(args.profile_steps):
        state, metrics = trainer.train_step(state, batch)
      jax.block_until_ready(metrics)
    busy = device_time_by_kind(trace_dir, args.profile_steps)
  tok_s = seq_len / step_s
  return dict(
      run=f"{devices}x{seq_len}", devices=devices, seq_len=seq_len, context_parallel=devices,
      compile_s=round(compile_s, 1), step_ms=round(1e3 * step_s, 2), tokens_per_s=tok_s,
      tokens_per_s_per_device=tok_s / devices, loss=float(metrics["loss"]),
      compiled_step_memory_gib_per_device={
          k.removesuffix("_size_in_bytes"): round(v / 2**30, 3)
          for k, v in (trainer.memory or {}).items()},
      allocator_peak_gib_per_device_since_start=peak_memory_per_device(mesh.devices.flat),
      device_busy_ms_per_step=busy)


def measure_balance(args, shards: int, seq_len: int) -> list[dict]:
  """One layer's PISA attention (forward + backward) for each contiguous shard's queries."""
  m = config_for(args, 1, seq_len).model
  dtype = compute_dtype(m)
  keys = jax.random.split(jax.random.key(0), 4)
  tl = seq_len // shards
  q = jax.random.normal(keys[0], (1, tl, m.num_heads, m.head_dim), dtype)
  k = jax.random.normal(keys[1], (1, seq_len, m.num_kv_heads, m.head_dim), dtype)
  v = jax.random.normal(keys[2], (1, seq_len, m.num_kv_heads, m.head_dim), dtype)

  def loss(q, k, v, offset):
    out = pisa_attention_at(q, k, v, offset, block_size=m.block_size, top_k=m.top_k,
                            branching=m.branching, beam=m.beam,
                            implementation=m.attention_implementation)
    return jnp.sum(out.astype(jnp.float32))

  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  rows = []
  for shard in range(shards):
    offset = jnp.int32(shard * tl)
    jax.block_until_ready(step(q, k, v, offset))
    times = []
    for _ in range(args.balance_reps):
      t0 = time.perf_counter()
      jax.block_until_ready(step(q, k, v, offset))
      times.append(time.perf_counter() - t0)
    rows.append(dict(shard=shard, shards=shards, seq_len=seq_len, query_offset=shard * tl,
                     ms=round(1e3 * float(np.median(times)), 3)))
  fastest = min(r["ms"] for r in rows)
  for r in rows:
    r["vs_fastest"] = round(r["ms"] / fastest, 3)
  return rows


def measure(args, rec: _record.Recorder) -> None:
  runs = parse_runs(args.runs)
  n_dev = jax.device_count()
  skipped = [f"{d}x{t}" for d, t in runs if d > n_dev]
  if skipped:
    rec.note(f"runs {skipped} need more than the {n_dev} devices present: skipped")
  runs = [(d, t) for d, t in runs if d <= n_dev]
  if jax.default_backend() != "gpu":
    rec.note("not a GPU: the profile has no device planes, collective times read 0")
  for devices, seq_len in runs:
    print(f"== {devices} device(s), {seq_len} tokens", flush=True)
    row = rec.add(**measure_run(args, devices, seq_len))
    print(f"   {row['tokens_per_s']:,.0f} tok/s ({row['tokens_per_s_per_device']:,.0f} per "
          f"device), device ms/step {row['device_busy_ms_per_step']}", flush=True)
    scaling(rec)
  if args.balance_reps and runs:
    # On one device whatever the run's count: shards of the longest run's sequence, as many as
    # its devices (at least 2, so that a 1-device host still measures the layout).
    devices, seq_len = max(runs, key=lambda r: (r[1], r[0]))
    shards = max(devices, 2)
    print(f"== balance: {shards} shards of {seq_len} tokens", flush=True)
    for row in measure_balance(args, shards, seq_len):
      rec.add(**row)


def scaling(rec: _record.Recorder) -> None:
  """Weak- and strong-scaling figures of each multi-device run against the 1-device run at the
  same tokens per device (weak) or the same sequence (strong)."""
  runs = [r for r in rec.rows if "run" in r]
  base = {r["seq_len"]: r for r in runs if r["devices"] == 1}
  for r in runs:
    if r["devices"] == 1:
      continue
    weak = base.get(r["seq_len"] // r["devices"])
    strong = base.get(r["seq_len"])
    if weak:
      r["weak_scaling_efficiency"] = round(r["tokens_per_s_per_device"] / weak["tokens_per_s"], 3)
      r["weak_goal_met"] = r["weak_scaling_efficiency"] >= WEAK_GOAL
    if strong:
      r["strong_scaling_speedup"] = round(r["tokens_per_s"] / strong["tokens_per_s"], 3)
      r["strong_goal_met"] = r["strong_scaling_speedup"] >= STRONG_GOAL * r["devices"] / 2
  rec.save()


def table(record: dict) -> str:
  runs = [r for r in record["rows"] if "run" in r]
  text = _record.markdown(
      ["run", "tokens/s", "per device", "weak eff.", "strong x", "compiled GiB / device",
       "peak GiB / device", "collectives ms / step", "compute ms / step"],
      [[r["run"], r["tokens_per_s"], r["tokens_per_s_per_device"],
        r.get("weak_scaling_efficiency"), r.get("strong_scaling_speedup"),
        sum(v for k, v in r["compiled_step_memory_gib_per_device"].items()
            if k in ("argument", "output", "temp")) or None,
        max((p for p in r["allocator_peak_gib_per_device_since_start"] if p is not None),
            default=None),
        r["device_busy_ms_per_step"]["communication"], r["device_busy_ms_per_step"]["compute"]]
       for r in runs])
  balance = [r for r in record["rows"] if "shard" in r]
  if balance:
    text += "\n" + _record.markdown(
        ["shard", "of", "tokens", "query offset", "ms (fwd+bwd, one layer)", "vs fastest"],
        [[r["shard"], r["shards"], r["seq_len"], r["query_offset"], r["ms"], r["vs_fastest"]]
         for r in balance])
  return text


def plot(record: dict, path) -> None:
  plt = _record.pyplot()
  runs = [r for r in record["rows"] if "run" in r]
  balance = [r for r in record["rows"] if "shard" in r]
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
  names = [r["run"] for r in runs]
  axes[0].bar(names, [r["tokens_per_s_per_device"] for r in runs])
  axes[0].set_ylabel("tokens / s per device")
  axes[0].set_title(f"{record['device']}: DEVICESxTOKENS")
  busy = [r["device_busy_ms_per_step"] for r in runs]
  axes[1].bar(names, [b["compute"] for b in busy], label="compute")
  axes[1].bar(names, [b["communication"] for b in busy], bottom=[b["compute"] for b in busy],
              label="collectives")
  axes[1].set_ylabel("device busy ms / step / device")
  axes[1].legend(fontsize=8)
  axes[1].set_title("time by kind")
  if balance:
    axes[2].bar([str(r["shard"]) for r in balance], [r["ms"] for r in balance])
    axes[2].set_xlabel(f"shard (of {balance[0]['shards']}, {balance[0]['seq_len']} tokens)")
    axes[2].set_ylabel("one layer's PISA fwd+bwd, ms")
  axes[2].set_title("contiguous shards: load balance")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def settings(args) -> dict:
  return dict(preset=args.preset, runs=args.runs, steps=args.steps,
              profile_steps=args.profile_steps, loss_chunk=args.loss_chunk,
              implementation=args.implementation, balance_reps=args.balance_reps,
              dry_run=args.dry_run, overrides=args.overrides,
              goals={"weak_scaling_efficiency": WEAK_GOAL, "strong_scaling_speedup": STRONG_GOAL})


def main(argv=None) -> dict:
  p = _record.parser(__doc__)
  p.add_argument("--preset", default="small-1m")
  p.add_argument("--seq-len", type=int, default=1 << 20,
                 help="L of the default runs 1:L, 2:2L, 2:L")
  p.add_argument("--runs", default=None, help="DEVICES:TOKENS,...; default from --seq-len")
  p.add_argument("--steps", type=int, default=5, help="timed steps per run (after one warm-up)")
  p.add_argument("--profile-steps", type=int, default=2)
  p.add_argument("--loss-chunk", type=int, default=8192,
                 help="train.loss_chunk (capped at the tokens per device)")
  p.add_argument("--implementation", default=None, choices=("xla", "pallas"),
                 help="default: pallas on a GPU, xla elsewhere")
  p.add_argument("--balance-reps", type=int, default=3,
                 help="timed repetitions per shard of the balance measurement (0: none)")
  p.add_argument("--set", dest="overrides", action="append", default=[],
                 help="more config overrides, e.g. model.remat=dots")
  p.add_argument("--dry-run", action="store_true",
                 help="the tiny preset at 128 tokens, 1 step: checks the script on any devices")
  args = p.parse_args(argv)
  if args.implementation is None:
    args.implementation = "pallas" if jax.default_backend() == "gpu" else "xla"
  if args.dry_run:
    args.preset, args.seq_len, args.steps, args.profile_steps = "tiny", 128, 1, 1
    args.loss_chunk, args.balance_reps = 32, 1
  if args.runs is None:
    args.runs = f"1:{args.seq_len},2:{2 * args.seq_len},2:{args.seq_len}"
  parse_runs(args.runs)
  return _record.run(NAME, args, measure, settings, plot, table)


if __name__ == "__main__":
  main()
