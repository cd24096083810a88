"""How does training scale over the GPUs of one host? The `small` preset with PISA attention
over (data, fsdp) meshes, through the project's own sharding (jit + NamedSharding; no
communication code of ours).

One process, one mesh per layout over the first data * fsdp devices, the same global batch and
the same data order on every layout (the loader is deterministic in (seed, step)). For each layout
a row with:
  - tokens/s, tokens/s per GPU and scaling efficiency against the 1-device layout;
  - memory per device of the compiled train step (XLA's memory analysis: arguments, outputs,
    temporaries), and the allocator's peak on each device (since the process started, so it
    never drops below an earlier layout's: read it with that in mind);
  - the busy time per step and per GPU of the device kernels of a few profiled steps, by name:
    NCCL / collective kernels, copies, and the rest. Kernels that overlap are each counted in
    full, so compute + communication can exceed the step time;
  - the loss curve, and its largest difference from the 1-device curve at equal steps (the
    equivalence check: bf16 noise, not a different computation).
Checkpoint portability (rows with "restore"): a checkpoint written on the widest layout resumes on
1 device and the other way round, Orbax resharding on restore, and the resumed losses continue
the curve. The order is 1x1, the widest layout, the restores, then the other layouts; the result
is rewritten after each, so a run stopped early keeps what it finished.

  python -m benchmarks.multi_gpu --set data.source=tokens --set data.path=data/corpus
  python -m benchmarks.multi_gpu --layouts 1x1,2x1,1x2 --steps 40 --out /tmp/mg
  python -m benchmarks.multi_gpu --replot benchmarks/results/multi_gpu.json
  # a dry run on any CPU, on fake devices:
  XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
    python -m benchmarks.multi_gpu --preset tiny --seq-len 128 --steps 6 --profile-steps 2 --out /tmp/mg
"""

from __future__ import annotations

import os

# NVLink multicast (NVLS) can take a shared host's GPUs out of service: keep it off in NCCL,
# PyTorch and NVSHMEM whatever the caller's environment, before JAX or NCCL start.
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
  os.environ[_name] = _value

import collections  # noqa: E402
import json  # noqa: E402
import glob  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from benchmarks import _record  # noqa: E402
from pisa_jax.configs import apply_overrides, get_config  # noqa: E402
from pisa_jax.models.sharding import MESH_AXES  # noqa: E402
from pisa_jax.train.trainer import build_trainer, train  # noqa: E402

NAME = "multi_gpu"
# Kernel names of collectives (NCCL on the GPU; XLA's own names elsewhere).
_COMM = ("nccl", "all-reduce", "all_reduce", "allreduce", "all-gather", "all_gather", "allgather",
         "reduce-scatter", "reduce_scatter", "reducescatter", "collective-permute", "all-to-all",
         "sendrecv", "send_recv")


def parse_layout(text: str) -> tuple[int, int]:
  """"DxF" -> (data, fsdp) mesh shape."""
  try:
    data, fsdp = (int(x) for x in text.lower().split("x"))
  except ValueError:
    raise SystemExit(f"--layouts entry {text!r} must be DATAxFSDP, e.g. 2x1 or 1x4") from None
  if data < 1 or fsdp < 1:
    raise SystemExit(f"--layouts entry {text!r}: both axes must be >= 1")
  return data, fsdp


def make_mesh(data: int, fsdp: int):
  return jax.make_mesh((data, fsdp), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:data * fsdp])


def device_time_by_kind(trace_dir: str, steps: int) -> dict:
  """Device-side kernel time per step and per GPU (ms, the mean over the GPUs that ran kernels)
  from a jax.profiler trace: collectives, copies (the checkpoint's device-to-host transfers), and
  the rest. Only GPU planes count (on a CPU dry run the trace has none and this returns zeros);
  the profiler writes a plane for every visible GPU, so the idle ones of a layout smaller than
  the host are left out of the mean."""
  from jax._src.profiler import ProfileData
  total = collections.Counter()
  gpus = set()
  for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
    for plane in ProfileData.from_file(path).planes:
      if "/device:GPU" not in plane.name:
        continue
      for line in plane.lines:
        # The stream lines hold the kernels; XLA's op and module lines would count them twice.
        if "Stream" not in line.name:
          continue
        for ev in line.events:
          gpus.add(plane.name)
          name = ev.name.lower()
          kind = ("communication" if any(c in name for c in _COMM)
                  else "memcpy" if "memcpy" in name or "memset" in name else "compute")
          total[kind] += ev.duration_ns / 1e6
  per = steps * max(len(gpus), 1)
  return {k: round(total[k] / per, 3) for k in ("compute", "communication", "memcpy")}


def peak_memory_per_device(devices) -> list[float | None]:
  out = []
  for d in devices:
    stats = d.memory_stats() or {}
    out.append(round(stats["peak_bytes_in_use"] / 2**30, 3) if "peak_bytes_in_use" in stats
               else None)
  return out


def read_metrics(workdir: Path) -> list[dict]:
  path = workdir / "metrics.jsonl"
  return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def measure(args, rec: _record.Recorder) -> None:
  n_dev = jax.device_count()
  layouts = [parse_layout(x) for x in args.layouts.split(",") if x]
  skipped = [f"{d}x{f}" for d, f in layouts if d * f > n_dev]
  if skipped:
    rec.note(f"layouts {skipped} need more than the {n_dev} devices present: skipped")
  layouts = [(d, f) for d, f in layouts if d * f <= n_dev]
  if (1, 1) not in layouts:
    layouts.insert(0, (1, 1))
  root = Path(args.workdir or tempfile.mkdtemp(prefix="multi_gpu_"))
  base = apply_overrides(get_config(args.preset), [
      f"model.attention={args.attention}", f"train.seq_len={args.seq_len}", "train.grad_accum=1",
      # No evaluation: the findings are train losses, throughput and restores.
      "train.eval_every=1000000", "train.eval_batches=0",
      f"train.checkpoint_every={args.steps}"] + args.overrides)

  def config_for(data, fsdp, *extra):
    return apply_overrides(base, [f"train.per_device_batch={args.global_batch // (data * fsdp)}",
                                  f"train.fsdp={fsdp}", *extra])

  def layout_rows():
    return {r["layout"]: r for r in rec.rows if "layout" in r}

  def save():
    """Scaling and loss differences against 1x1 for every layout so far, then the file."""
    rows = layout_rows()
    one = rows.get("1x1")
    for r in rows.values():
      if one and one["tokens_per_s"] and r["tokens_per_s"]:
        r["scaling_efficiency"] = round(r["tokens_per_s_per_device"] / one["tokens_per_s"], 3)
      common = set(r["losses"]) & set(one["losses"]) if one else set()
      r["max_loss_diff_vs_1x1"] = max((abs(r["losses"][s] - one["losses"][s]) for s in common),
                                      default=None)
    rec.save()

  # Portability: the widest layout's checkpoint resumes on 1 device, and 1 device's on the widest.
  # Among the widest, the one with the largest fsdp axis: its parameters are sharded, so the
  # restore really reshards them. 1x1 and the widest layout train first and the restores follow
  # at once, so that a run stopped early still has them.
  widest = max(layouts, key=lambda x: (x[0] * x[1], x[1]))
  layouts = [(1, 1)] + ([widest] if widest != (1, 1) else []) + [
      x for x in layouts if x not in ((1, 1), widest)]
  # One compiled trainer per layout, reused by its profiled steps and by the restores onto it:
  # compiling the `small` preset's step takes far longer than its training steps.
  trainers = {}

  def portability():
    for (src, dst) in ((widest, (1, 1)), ((1, 1), widest)):
      key = f"{src[0]}x{src[1]}->{dst[0]}x{dst[1]}"
      moved = root / f"moved_{key.replace('->', '_to_')}"
      shutil.copytree(root / f"{src[0]}x{src[1]}", moved, dirs_exist_ok=True)
      try:
        resumed = train(config_for(*dst), moved, mesh=make_mesh(*dst), run_steps=2, progress=False,
                        quiet=True, print_config=False, trainer=trainers[dst])
        row = {"restore": key, "ok": True, "start_step": resumed.start_step,
               "losses": {str(k): v for k, v in sorted(resumed.losses.items())}}
      except Exception as e:  # recorded: the finding is whether it restores
        row = {"restore": key, "ok": False, "error": repr(e)[:800]}
      print(f"== restore {key}: {row}", flush=True)
      rec.add(**row)

  try:
    for data, fsdp in layouts:
      name = f"{data}x{fsdp}"
      mesh = make_mesh(data, fsdp)
      workdir = root / name
      print(f"== {name}: {data * fsdp} device(s), per-device batch "
            f"{args.global_batch // (data * fsdp)}", flush=True)
      t0 = time.perf_counter()
      trainer = trainers[(data, fsdp)] = build_trainer(config_for(data, fsdp), mesh)
      compile_s = time.perf_counter() - t0
      t0 = time.perf_counter()
      result = train(config_for(data, fsdp), workdir, mesh=mesh, run_steps=args.steps,
                     progress=False, quiet=True, print_config=False, trainer=trainer)
      wall = time.perf_counter() - t0
      # Throughput from this run's intervals only (the profiled run below appends its own).
      logged = [r for r in read_metrics(workdir) if "tokens_per_s" in r and r["step"] <= args.steps]
      steady = logged[1:] or logged  # the first interval holds the warm-up
      tok_s = sum(r["tokens_per_s"] for r in steady) / len(steady) if steady else None
      # A few more steps under the profiler (resuming from the checkpoint just written), with the
      # evaluation that ends a run switched off so that only train steps, the restore's and the
      # checkpoint's copies are on the device.
      with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
          train(config_for(data, fsdp), workdir, mesh=mesh, run_steps=args.profile_steps,
                progress=False, quiet=True, print_config=False, trainer=trainer)
        breakdown = device_time_by_kind(trace_dir, args.profile_steps)
      rec.add(
          layout=name, data=data, fsdp=fsdp, devices=data * fsdp, compile_s=round(compile_s, 1),
          train_wall_s=round(wall, 1), tokens_per_s=tok_s,
          tokens_per_s_per_device=tok_s and tok_s / (data * fsdp),
          compiled_step_memory_gib_per_device={
              k.removesuffix("_size_in_bytes"): round(v / 2**30, 3)
              for k, v in (trainer.memory or {}).items()},
          allocator_peak_gib_per_device_since_start=peak_memory_per_device(mesh.devices.flat),
          device_busy_ms_per_step=breakdown,
          losses={str(k): v for k, v in sorted(result.losses.items())})
      save()
      print(f"   {tok_s or 0:,.0f} tok/s, device ms/step {breakdown}", flush=True)
      if (data, fsdp) == widest:
        portability()
  finally:
    if not args.workdir:
      shutil.rmtree(root, ignore_errors=True)


def table(record: dict) -> str:
  rows = [r for r in record["rows"] if "layout" in r]
  cols = ["layout", "tokens/s", "per device", "scaling", "compiled temp GiB / device",
          "compute ms / step", "collectives ms / step", "max loss diff vs 1x1"]
  body = [[r["layout"], r["tokens_per_s"], r["tokens_per_s_per_device"],
           r.get("scaling_efficiency"), r["compiled_step_memory_gib_per_device"].get("temp"),
           r["device_busy_ms_per_step"]["compute"], r["device_busy_ms_per_step"]["communication"],
           r.get("max_loss_diff_vs_1x1")] for r in rows]
  restores = [r for r in record["rows"] if "restore" in r]
  text = _record.markdown(cols, body)
  if restores:
    text += "\n" + _record.markdown(
        ["restore", "ok", "start step", "losses"],
        [[r["restore"], r["ok"], r.get("start_step"), r.get("losses") or r.get("error")]
         for r in restores])
  return text


def plot(record: dict, path: Path) -> None:
  plt = _record.pyplot()
  s = record["settings"]
  rows = [r for r in record["rows"] if "layout" in r]
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  for r in rows:
    steps = sorted(int(x) for x in r["losses"])
    axes[0].plot(steps, [r["losses"][str(x)] for x in steps], label=r["layout"], lw=1)
  axes[0].set_xlabel("step")
  axes[0].set_ylabel("train loss")
  axes[0].legend(fontsize=8)
  axes[0].set_title(f"{s['preset']} / {s['attention']}, global batch {s['global_batch']} x "
                    f"{s['seq_len']}")
  axes[1].bar([r["layout"] for r in rows], [r["tokens_per_s_per_device"] or 0 for r in rows])
  axes[1].set_ylabel("tokens / s per device")
  axes[1].set_title(f"{record['device']}: scaling (DATAxFSDP)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def settings(args) -> dict:
  return dict(preset=args.preset, attention=args.attention, global_batch=args.global_batch,
              seq_len=args.seq_len, steps=args.steps, profile_steps=args.profile_steps,
              layouts=args.layouts, overrides=args.overrides)


def main(argv=None) -> dict:
  p = _record.parser(__doc__)
  p.add_argument("--preset", default="small")
  p.add_argument("--attention", default="pisa")
  p.add_argument("--layouts", default="1x1,2x1,1x2,4x1,1x4,2x2,8x1,1x8,2x4",
                 help="DATAxFSDP meshes; those needing more devices than present are skipped")
  p.add_argument("--global-batch", type=int, default=8, help="sequences per step, every layout")
  p.add_argument("--seq-len", type=int, default=4096)
  p.add_argument("--steps", type=int, default=60, help="steps per layout (same data order)")
  p.add_argument("--profile-steps", type=int, default=3)
  p.add_argument("--set", dest="overrides", action="append", default=[],
                 help="more config overrides, e.g. data.source=tokens data.path=data/corpus")
  p.add_argument("--workdir", default=None,
                 help="keep the run directories here (default: a temporary folder, removed)")
  args = p.parse_args(argv)
  if not args.replot:
    for d, f in (parse_layout(x) for x in args.layouts.split(",") if x):
      if d * f <= jax.device_count() and args.global_batch % (d * f):
        raise SystemExit(f"--global-batch={args.global_batch} must be divisible by every "
                         f"layout's device count, not by {d * f} ({d}x{f})")
  return _record.run(NAME, args, measure, settings, plot, table)


if __name__ == "__main__":
  main()
