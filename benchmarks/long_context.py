"""Does PISA train the `small` model at a million tokens of context on one GPU, and how fast?

The `small-1m` preset (`small`, ~105M parameters, batch 1, each block rematerialised, the loss over
chunks of tokens) at 64K, 128K, 256K, 512K and 1M tokens per step, with PISA attention and with
dense attention (cuDNN's, through `jax.nn.dot_product_attention`) under the same memory settings.
Dense runs at each length until it no longer fits or one step takes longer than
--dense-max-step-s; the longer lengths are then recorded as skipped. Each run is its own process,
so the allocator's peak is that run's. Rows: tokens/s (median step), MFU (the trainer's model
FLOPs: remat's recomputation and block selection are not counted), compile time, XLA's analysis of
the compiled step (temporaries and peak: arguments + outputs - aliased + temporaries), the
allocator's peak, and the remat policy and loss chunk. At the longest length the PISA run (or
--curve-attention's) then trains on for --curve-steps steps through the trainer
(`pisa_jax.train.train`) for a loss curve. Data: a `pisa-prepare-data` folder (--data) or, when
there is none, MQAR generated on the fly (the notes say which).

The goals it reports (rows with "goal"): PISA at 1M with the allocator's peak under 100 GiB;
PISA's tokens/s at 1M at least 60% of its own at 64K; PISA at 64K at least 3x dense's tokens/s.

  python -m benchmarks.long_context                         # one H200: the five lengths + curve
  python -m benchmarks.long_context --seq-lens 65536,131072 --curve-steps 0
  python -m benchmarks.long_context --set model.remat=dots --set train.loss_chunk=16384
  python -m benchmarks.long_context --resume benchmarks/results/long_context_training.json \
      --curve-only --curve-workdir runs/curve-1m --curve-steps 160 --curve-seconds 420
                                                            # the curve alone, resumable
  python -m benchmarks.long_context --replot benchmarks/results/long_context_training.json
  python -m benchmarks.long_context --dry-run --out /tmp/lc  # any CPU: tiny model, in-process
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NAME = "long_context_training"
DEFAULT_SEQ_LENS = [65_536, 131_072, 262_144, 524_288, 1_048_576]
GOAL_PEAK_GIB = 100.0
GOAL_SCALING = 0.6
GOAL_SPEEDUP = 3.0
# The worker's last line of output: "ROW {json}".
_ROW = "ROW "


def config_for(spec: dict):
  """The run's validated config: the preset at one attention and length, batch 1."""
  from pisa_jax.configs import apply_overrides, get_config, validate

  steps = max(spec["curve_steps"], spec["warmup"] + spec["steps"], 10)
  overrides = [
      f"model.attention={spec['attention']}", f"train.seq_len={spec['seq_len']}",
      "train.per_device_batch=1", "train.grad_accum=1",
      # The warm-up in steps, also for the presets that give it as a fraction (cpt-*).
      f"train.steps={steps}", "train.warmup_fraction=0",
      f"train.warmup_steps={max(1, steps // 10)}",
      f"train.decay_steps={steps // 5}", f"train.log_every={max(1, steps // 60)}",
      "train.eval_batches=0", f"train.eval_every={10 * steps}",
      f"train.checkpoint_every={10 * steps}", "train.async_checkpointing=false",
  ] + spec["data"] + spec["set"]
  config = apply_overrides(get_config(spec["preset"]), overrides)
  chunk = config.train.loss_chunk
  if chunk and spec["seq_len"] % chunk:
    # A length below the preset's chunk: one chunk of the whole sequence.
    config = apply_overrides(config, [f"train.loss_chunk={spec['seq_len']}"])
  return validate(config)


def run_one(spec: dict) -> dict:
  """Compiles, checks the memory, times `steps` steps after `warmup`, then trains the loss curve
  when `curve_steps` is set. A run that cannot fit, or whose step exceeds `max_step_s`, returns
  a row saying so."""
  import jax

  from pisa_jax.models.decoder import flops_per_token
  from pisa_jax.train import trainer as trainer_lib
  from pisa_jax.train.data import make_batches

  config = config_for(spec)
  m, t = config.model, config.train
  row = dict(attention=m.attention, seq_len=t.seq_len, remat=m.remat, loss_chunk=t.loss_chunk)
  t0 = time.perf_counter()
  trainer = trainer_lib.build_trainer(config)
  row["compile_s"] = round(time.perf_counter() - t0, 1)
  memory = trainer_lib.memory_record(trainer)
  gib = 2**30
  row["compiled_temp_gib"] = round(memory.get("temp_size_in_bytes", 0) / gib, 3)
  row["compiled_peak_gib"] = (None if memory["peak_bytes"] is None
                              else round(memory["peak_bytes"] / gib, 3))
  try:
    trainer_lib.check_memory(trainer)
  except trainer_lib.InsufficientMemoryError as e:
    return {**row, "error": f"does not fit: {e}"}

  if spec.get("curve_only"):
    return {**row, **_curve(spec, config, trainer)}
  state = trainer.init_state()
  batches = make_batches(config, "train", global_batch=trainer.global_batch, accum=1)
  times = []
  for step in range(spec["warmup"] + spec["steps"]):
    batch = trainer.place_batch(batches.batch(step), trainer.batch_shardings)
    start = time.perf_counter()
    state, metrics = trainer.train_step(state, batch)
    loss = float(metrics["loss"])  # waits for the step
    times.append(time.perf_counter() - start)
    if times[-1] > spec["max_step_s"]:
      row["error"] = f"one step took {times[-1]:.3g} s, over the {spec['max_step_s']:g} s limit"
      break
  timed = times[spec["warmup"]:] or times
  step_s = statistics.median(timed)
  tok_s = trainer.tokens_per_step / step_s
  peak = spec["peak_tflops"] * 1e12 or trainer_lib.peak_flops(jax.devices()[0])
  stats = jax.local_devices()[0].memory_stats() or {}
  row.update(step_s=round(step_s, 4), tokens_per_s=round(tok_s, 1),
             mfu=round(flops_per_token(m, t.seq_len) * tok_s / peak, 4) if peak else None,
             allocator_peak_gib=(round(stats["peak_bytes_in_use"] / gib, 3)
                                 if "peak_bytes_in_use" in stats else None),
             timed_steps=len(timed), last_loss=round(loss, 4))
  del state, batch, metrics

  if spec["curve_steps"] and "error" not in row:
    row.update(_curve(spec, config, trainer))
  return row


def _curve(spec: dict, config, trainer) -> dict:
  """Trains the loss curve through the trainer. In `curve_workdir` (kept) it resumes from the
  folder's newest checkpoint and runs to `curve_steps` in all, stopping after `curve_seconds`
  (checkpointing first): a curve longer than one sitting is trained over several invocations.
  Otherwise it trains `curve_steps` steps in a temporary folder."""
  import jax

  from pisa_jax.train import trainer as trainer_lib

  keep = spec.get("curve_workdir")
  workdir = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="pisa_long_context_")) / "run"
  try:
    result = trainer_lib.train(
        config, workdir, run_steps=None if keep else spec["curve_steps"],
        max_seconds=spec.get("curve_seconds"), progress=False, quiet=True, print_config=False,
        trainer=trainer)
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    logged = [r for r in map(json.loads, lines) if "tokens_per_s" in r]
    out = dict(loss_curve=[[r["step"], round(r["loss"], 4)] for r in logged],
               curve_tokens_per_s=round(statistics.median(r["tokens_per_s"] for r in logged), 1),
               curve_steps_done=result.end_step, curve_steps_planned=config.train.steps)
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
      out["curve_allocator_peak_gib"] = round(stats["peak_bytes_in_use"] / 2**30, 3)
    return out
  finally:
    if not keep:
      shutil.rmtree(workdir.parent, ignore_errors=True)


def _in_subprocess(spec: dict, timeout: float) -> dict:
  """`run_one` in a fresh process: its allocator peak is its own, and an OOM ends only it."""
  cmd = [sys.executable, "-m", "benchmarks.long_context", "--worker", json.dumps(spec)]
  base = dict(attention=spec["attention"], seq_len=spec["seq_len"])
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          cwd=Path(__file__).resolve().parents[1])
  except subprocess.TimeoutExpired:
    return {**base, "error": f"no result within {timeout:.0f} s"}
  rows = [line for line in proc.stdout.splitlines() if line.startswith(_ROW)]
  if proc.returncode or not rows:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {**base, "error": f"exit {proc.returncode}: {tail[0][:400]}"}
  return json.loads(rows[-1][len(_ROW):])


def data_overrides(args, rec) -> list[str]:
  from pisa_jax.configs import get_config

  if args.data and (Path(args.data) / "meta.json").exists():
    return ["data.source=tokens", f"data.path={args.data}"]
  preset = get_config(args.preset)
  if preset.data.source == "mqar":
    return []
  where = f" at {args.data}" if args.data else " given"
  rec.note(f"no pisa-prepare-data folder{where}: trained on MQAR generated on the fly")
  # MQAR splits the vocabulary into keys and values: an even size (one more token leaves the
  # padded embedding, and so the model's compute, unchanged).
  vocab = preset.model.vocab_size + preset.model.vocab_size % 2
  return ["data.source=mqar", "data.mqar_num_pairs=64", f"model.vocab_size={vocab}"]


def goals(rows: list[dict], longest: int, shortest: int) -> list[dict]:
  """The three goal rows, each with its value (None where a run is missing) and whether it is met."""
  def find(attention, seq_len):
    return next((r for r in rows if r.get("attention") == attention and r.get("seq_len") == seq_len
                 and r.get("tokens_per_s") and "error" not in r), None)

  pisa_long, pisa_short = find("pisa", longest), find("pisa", shortest)
  dense_short = find("dense", shortest)
  peak = pisa_long and (pisa_long.get("allocator_peak_gib") or pisa_long.get("compiled_peak_gib"))
  scaling = pisa_long and pisa_short and pisa_long["tokens_per_s"] / pisa_short["tokens_per_s"]
  speedup = pisa_short and dense_short and pisa_short["tokens_per_s"] / dense_short["tokens_per_s"]
  out = [
      dict(goal=f"PISA peak memory at {longest} tokens (GiB)", value=peak, target=GOAL_PEAK_GIB,
           met=None if not peak else peak < GOAL_PEAK_GIB),
      dict(goal=f"PISA tokens/s at {longest} / at {shortest}", value=scaling, target=GOAL_SCALING,
           met=None if not scaling else scaling >= GOAL_SCALING),
      dict(goal=f"PISA / dense tokens/s at {shortest}", value=speedup, target=GOAL_SPEEDUP,
           met=None if not speedup else speedup >= GOAL_SPEEDUP),
  ]
  for g in out:
    g["value"] = None if g["value"] is None else round(g["value"], 3)
  return out


def measure(args, rec) -> None:
  if args.dry_run:
    rec.note("dry run: the tiny preset in one process (allocator peaks accumulate across runs)")
  spec = dict(preset=args.preset, steps=args.steps, warmup=args.warmup, set=args.set,
              data=data_overrides(args, rec), max_step_s=float("inf"), curve_steps=0,
              peak_tflops=args.peak_tflops)
  seq_lens = sorted(args.seq_lens)
  dense_stop = None
  done = set()
  if args.curve_only:
    return _continue_curve(args, rec, spec)
  if args.resume:
    # A ladder is long: keep the runs of an earlier result and measure only the missing ones.
    from benchmarks import _record

    earlier = _record.load(args.resume)
    # Runs that failed for a reason of their own (not dense's stop) are measured again.
    runs = [r for r in earlier["rows"] if "goal" not in r
            and ("tokens_per_s" in r or "skipped" in r or r["attention"] == "dense")]
    rec.note(f"{len(runs)} runs kept from {args.resume} (commit {earlier['commit']}, "
             f"{earlier['date']}); the rest measured here")
    for r in runs:
      rec.add(**r)
      done.add((r["attention"], r["seq_len"]))
      if r["attention"] == "dense" and ("error" in r or "skipped" in r):
        dense_stop = r.get("skipped") or f"dense at {r['seq_len']} tokens: {r['error'][:200]}"
    seq_lens = sorted(set(seq_lens) | {r["seq_len"] for r in runs})
  for seq_len in seq_lens:
    for attention in args.attention:
      if (attention, seq_len) in done:
        continue
      one = dict(spec, attention=attention, seq_len=seq_len)
      if attention == "dense":
        if dense_stop:
          rec.add(attention=attention, seq_len=seq_len, skipped=dense_stop)
          continue
        one["max_step_s"] = args.dense_max_step_s
      if attention == args.curve_attention and seq_len == seq_lens[-1]:
        one.update(curve_steps=args.curve_steps, curve_workdir=args.curve_workdir,
                   curve_seconds=args.curve_seconds)
      print(f"== {attention} at {seq_len} tokens", flush=True)
      row = run_one(one) if args.dry_run else _in_subprocess(one, args.run_timeout)
      if attention == "dense" and ("error" in row or not row.get("tokens_per_s")):
        dense_stop = f"dense at {seq_len} tokens: {row.get('error', 'no result')[:200]}"
      dense = next((r for r in rec.rows if r.get("seq_len") == seq_len
                    and r.get("attention") == "dense" and r.get("tokens_per_s")), None)
      if dense and attention != "dense" and row.get("tokens_per_s"):
        row["speedup_vs_dense"] = round(row["tokens_per_s"] / dense["tokens_per_s"], 3)
      rec.add(**row)
      print({k: v for k, v in row.items() if k != "loss_curve"}, flush=True)
  for g in goals(rec.rows, seq_lens[-1], seq_lens[0]):
    rec.add(**g)


def _continue_curve(args, rec, spec: dict) -> None:
  """--curve-only: every row of --resume kept, the curve (trained in --curve-workdir, resumed
  from its checkpoint) attached to the kept row of the curve's attention at the longest length."""
  from benchmarks import _record

  earlier = _record.load(args.resume)
  rows = [r for r in earlier["rows"] if "goal" not in r]
  seq_len = max(r["seq_len"] for r in rows)
  target = next((r for r in rows if r["attention"] == args.curve_attention
                 and r["seq_len"] == seq_len and r.get("tokens_per_s")), None)
  if target is None:
    raise SystemExit(f"--curve-only: {args.resume} has no measured {args.curve_attention} run at "
                     f"{seq_len} tokens to attach the curve to")
  rec.note(f"{len(rows)} runs kept from {args.resume} (commit {earlier['commit']}, "
           f"{earlier['date']}); the loss curve trained here in {args.curve_workdir}, on "
           f"{' '.join(spec['data']) or 'the preset data'}")
  for note in earlier.get("notes", []):
    rec.note(f"kept: {note}")
  one = dict(spec, attention=args.curve_attention, seq_len=seq_len, curve_only=True,
             curve_steps=args.curve_steps, curve_workdir=args.curve_workdir,
             curve_seconds=args.curve_seconds)
  print(f"== loss curve: {args.curve_attention} at {seq_len} tokens", flush=True)
  row = run_one(one) if args.dry_run else _in_subprocess(one, args.run_timeout)
  if "error" in row:
    raise SystemExit(f"--curve-only: {row['error']}")
  for r in rows:
    rec.add(**({**r, **{k: v for k, v in row.items() if k.startswith(("loss_curve", "curve_"))}}
               if r is target else r))
  print({k: v for k, v in row.items() if k != "loss_curve"}, flush=True)
  for g in goals(rec.rows, seq_len, min(r["seq_len"] for r in rows)):
    rec.add(**g)


def table(record: dict) -> str:
  from benchmarks import _record

  cols = ["attention", "tokens", "tokens/s", "x dense", "MFU", "step s", "compiled temp GiB",
          "compiled peak GiB", "allocator peak GiB", "remat", "loss chunk", "note"]
  runs = [r for r in record["rows"] if "goal" not in r]
  body = [[r["attention"], r["seq_len"], r.get("tokens_per_s"), r.get("speedup_vs_dense"),
           r.get("mfu"), r.get("step_s"), r.get("compiled_temp_gib"), r.get("compiled_peak_gib"),
           r.get("allocator_peak_gib"), r.get("remat"), r.get("loss_chunk"),
           (r.get("error") or r.get("skipped") or "")[:80]] for r in runs]
  return _record.with_goals(record, _record.markdown(cols, body))


def plot(record: dict, path) -> None:
  from benchmarks import _record

  plt = _record.pyplot()
  runs = [r for r in record["rows"] if "goal" not in r]
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
  for attention, color in (("pisa", "tab:blue"), ("dense", "tab:gray")):
    ok = [r for r in runs if r["attention"] == attention and r.get("tokens_per_s")]
    if ok:
      axes[0].plot([r["seq_len"] for r in ok], [r["tokens_per_s"] for r in ok], "o-", color=color,
                   label=attention)
      peak = [(r["seq_len"], r.get("allocator_peak_gib") or r.get("compiled_peak_gib"))
              for r in ok]
      axes[1].plot(*zip(*peak), "o-", color=color, label=f"{attention}, peak")
      axes[1].plot([r["seq_len"] for r in ok], [r.get("compiled_temp_gib") for r in ok], "x--",
                   color=color, label=f"{attention}, compiled temporaries")
  for ax in axes[:2]:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens of context (batch 1)")
    ax.legend(fontsize=8)
  axes[0].set_ylabel("tokens / s")
  axes[0].set_title(f"throughput, {record['device']}", fontsize=10)
  axes[1].axhline(GOAL_PEAK_GIB, color="tab:red", lw=0.8, ls=":")
  axes[1].set_ylabel("GiB")
  axes[1].set_title("memory per step", fontsize=10)
  curve = next((r for r in runs if r.get("loss_curve")), None)
  if curve:
    steps, loss = zip(*curve["loss_curve"])
    axes[2].plot([s * curve["seq_len"] / 1e6 for s in steps], loss, lw=1)
    axes[2].set_title(f"{curve['attention']} at {curve['seq_len']} tokens, steps 1-{steps[-1]}",
                      fontsize=10)
  axes[2].set_xlabel("training tokens (M)")
  axes[2].set_ylabel("train loss")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def settings(args) -> dict:
  return dict(preset=args.preset, attention=args.attention, seq_lens=args.seq_lens,
              steps=args.steps, warmup=args.warmup, curve_steps=args.curve_steps,
              curve_attention=args.curve_attention, curve_workdir=args.curve_workdir,
              curve_seconds=args.curve_seconds, curve_only=args.curve_only,
              dense_max_step_s=args.dense_max_step_s, data=args.data, overrides=args.set,
              dry_run=args.dry_run, resume=args.resume and str(args.resume))


def _csv(kind):
  return lambda s: [kind(x) for x in s.split(",") if x]


def main(argv=None) -> dict:
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["--worker"]:
    print(_ROW + json.dumps(run_one(json.loads(argv[1]))), flush=True)
    return {}
  from benchmarks import _record

  p = _record.parser(__doc__)
  p.add_argument("--preset", default="small-1m")
  p.add_argument("--attention", type=_csv(str), default=["pisa", "dense"],
                 help="comma-separated; PISA first at each length")
  p.add_argument("--seq-lens", type=_csv(int), default=DEFAULT_SEQ_LENS)
  p.add_argument("--steps", type=int, default=8, help="timed steps per run")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
  p.add_argument("--curve-steps", type=int, default=300,
                 help="the longest length's run trains on for this many steps: the loss curve")
  p.add_argument("--curve-attention", default="pisa", help="the attention of the loss curve")
  p.add_argument("--curve-workdir", default=None,
                 help="train the curve in this run folder, kept: resumed from its checkpoint "
                      "when it has one, so a curve can span several invocations")
  p.add_argument("--curve-seconds", type=float, default=None,
                 help="stop the curve after this much training time (checkpointing first)")
  p.add_argument("--curve-only", action="store_true",
                 help="with --resume and --curve-workdir: keep every earlier run and only train "
                      "(or continue) the loss curve")
  p.add_argument("--dense-max-step-s", type=float, default=60.0,
                 help="dense stops at the first length whose step takes longer")
  p.add_argument("--run-timeout", type=float, default=3600.0, help="seconds per run's process")
  p.add_argument("--peak-tflops", type=float, default=0.0,
                 help="dense bf16 peak per device for MFU; 0 looks it up from the device kind")
  p.add_argument("--data", default="data/corpus", help="a pisa-prepare-data folder")
  p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                 help="more config overrides, as pisa-train takes them")
  p.add_argument("--resume", metavar="JSON", type=Path,
                 help="keep the runs of this earlier result and measure only the missing ones")
  p.add_argument("--dry-run", action="store_true",
                 help="the tiny preset with 1 layer at 128 and 256 tokens in this process, 2 "
                      "steps each, a 4-step curve: checks the script on any CPU")
  args = p.parse_args(argv)
  if args.curve_only and not (args.resume and args.curve_workdir):
    p.error("--curve-only needs --resume (the runs to keep) and --curve-workdir (the curve's run)")
  if args.dry_run:
    args.preset = "tiny"
    # The tiny preset's vocabulary cannot read a GPT-2 corpus: MQAR unless --data is given.
    if "--data" not in argv:
      args.data = None
    args.set = ["model.num_layers=1", "model.remat=full", "train.loss_chunk=32"] + args.set
    if args.seq_lens == DEFAULT_SEQ_LENS:
      args.seq_lens = [128, 256]
    args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    if not args.curve_only:
      args.curve_steps = min(args.curve_steps, 4)
  return _record.run(NAME, args, measure, settings, plot, table)


if __name__ == "__main__":
  main()
