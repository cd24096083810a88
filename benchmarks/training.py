"""How fast does a model train with PISA attention against dense attention, as context grows?

The `small` preset (~105M parameters) trained by the project's trainer (`pisa_jax.train`) for a
fixed wall time per run, once per (attention, context length), with the same tokens per step in
every run (batch = tokens per step / context). Dense attention is cuDNN's through
`jax.nn.dot_product_attention` on a GPU; PISA runs the Pallas selection and attention kernels.
Data: a `pisa-prepare-data` folder (--data, default data/corpus) or, when there is none, MQAR
generated on the fly (the result's notes say which). Rows: tokens/s (mean over the logged
intervals after the first, which holds the warm-up), MFU (the trainer's: attention counted over
the attended keys only), compile time, the compiled step's memory, steps and the loss curve.
The plot shows loss against training tokens and tokens/s per run.

  python -m benchmarks.training                                  # dense and PISA at 4K and 16K
  python -m benchmarks.training --seq-lens 16384,65536 --tokens-per-step 65536 --seconds 120
  python -m benchmarks.training --replot benchmarks/results/training.json
  python -m benchmarks.training --preset tiny --seq-lens 128 --tokens-per-step 1024 \\
      --seconds 5 --out /tmp/t                                     # any CPU

--kernels profiles instead of training: per run (attention, context, `model.remat` policy) the
GPU kernels of one training step, from a jax.profiler trace of --kernel-steps steps after two
warm-up steps: each kernel's launches and device ms per step, and the step's device ms by group
(PISA's selection, its attention forward, its attention backward, cuDNN's attention, the rest).
--without-indices adds, for each PISA run under a remat policy, the same policy with the selected
indices left out of what it keeps: its backward selects again (what keeping them saves).
Result: training_kernels.json + .png.

  python -m benchmarks.training --kernels --preset cpt-418m --seq-lens 16384 \\
      --remat full,full_save_attention --without-indices
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from pathlib import Path
from unittest import mock

import jax
import numpy as np

from benchmarks import _record, timing
from pisa_jax.configs import apply_overrides, get_config, validate

NAME = "training"
KERNELS_NAME = "training_kernels"
# Kernel groups of a step, by the names the kernels launch under (Pallas kernels are named after
# their pallas_call; cuDNN's fused attention kernels carry "sdpa" or "flash").
KERNEL_GROUPS = (
    ("selection", lambda n: n.startswith(("pisa_pool", "pisa_select"))),
    ("attention fwd", lambda n: n.startswith("pisa_sparse_attention_fwd")),
    ("attention bwd", lambda n: n.startswith(("pisa_sparse_attention_dq",
                                              "pisa_sparse_attention_dkv"))),
    ("cudnn attention", lambda n: any(s in n.lower() for s in ("sdpa", "flash", "cudnn"))),
)


def config_for(args, attention: str, seq_len: int, remat: str | None = None):
  batch = max(1, args.tokens_per_step // (seq_len * jax.device_count()))
  overrides = [
      f"model.attention={attention}", f"train.seq_len={seq_len}",
      f"train.per_device_batch={batch}", "train.grad_accum=1",
      # The run ends on --seconds; steps only shape the schedule (a warm-up in steps, also for
      # the presets that give it as a fraction).
      "train.steps=2000", "train.warmup_fraction=0", "train.warmup_steps=50",
      "train.decay_steps=200", "train.log_every=5",
      "train.eval_every=1000000", "train.eval_batches=0", "train.checkpoint_every=1000000",
      "train.async_checkpointing=false",
  ] + ([f"model.remat={remat}"] if remat else []) + args.data_overrides + args.set
  config = apply_overrides(get_config(args.preset), overrides)
  chunk = config.train.loss_chunk
  if chunk and seq_len % chunk:
    # A context below the preset's loss chunk: one chunk of the whole sequence.
    config = apply_overrides(config, [f"train.loss_chunk={seq_len}"])
  return validate(config)


def data_overrides(args, rec: _record.Recorder) -> list[str]:
  if args.data and (Path(args.data) / "meta.json").exists():
    return ["data.source=tokens", f"data.path={args.data}"]
  rec.note(f"no pisa-prepare-data folder at {args.data}: trained on MQAR generated on the fly")
  preset = get_config(args.preset)
  if preset.data.source == "mqar":
    return []
  # MQAR splits the vocabulary into keys and values, so it needs an even size; one more token
  # leaves the padded embedding, and so the model's compute, unchanged.
  vocab = preset.model.vocab_size + preset.model.vocab_size % 2
  return ["data.source=mqar", "data.mqar_num_pairs=64", f"model.vocab_size={vocab}"]


def run_one(args, attention: str, seq_len: int, workdir: Path) -> dict:
  from pisa_jax.train.trainer import build_trainer, train
  config = config_for(args, attention, seq_len)
  t0 = time.perf_counter()
  trainer = build_trainer(config)
  compile_s = time.perf_counter() - t0
  result = train(config, workdir, max_seconds=args.seconds, progress=False, quiet=True,
                 print_config=False, trainer=trainer)
  rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x.strip()]
  logged = [r for r in rows if "tokens_per_s" in r]
  steady = logged[1:] or logged
  mfu = [r["mfu"] for r in steady if r.get("mfu") is not None]
  memory = {k.removesuffix("_size_in_bytes"): round(v / 2**30, 2)
            for k, v in (trainer.memory or {}).items()}
  return dict(
      attention=attention, seq_len=seq_len, global_batch=trainer.global_batch,
      tokens_per_step=trainer.tokens_per_step, compile_s=round(compile_s, 1),
      steps=result.end_step - result.start_step,
      tokens_per_s=(round(float(np.mean([r["tokens_per_s"] for r in steady])), 1) if steady
                    else None),
      mfu=round(float(np.mean(mfu)), 4) if mfu else None,
      compiled_step_gib=memory, final_loss=logged[-1]["loss"] if logged else None,
      loss_curve=[[r["step"], round(r["loss"], 4)] for r in logged])


def measure_training(args, rec: _record.Recorder) -> None:
  args.data_overrides = data_overrides(args, rec)
  keep = Path(args.keep_runs) if args.keep_runs else None
  root = keep or Path(tempfile.mkdtemp(prefix="pisa_training_"))
  if keep:
    keep.mkdir(parents=True, exist_ok=True)
    taken = sorted(x.name for x in keep.iterdir())
    if taken:
      raise SystemExit(f"--keep-runs {keep} must be empty or new: it holds {taken[:5]}")
  try:
    for seq_len in args.seq_lens:
      for attention in args.attention:
        workdir = root / f"{attention}-{seq_len}"
        print(f"== {attention} at {seq_len} tokens, {args.seconds:.0f} s", flush=True)
        try:
          row = run_one(args, attention, seq_len, workdir)
        except Exception as e:  # e.g. out of memory at long context: recorded, the rest run
          row = dict(attention=attention, seq_len=seq_len,
                     error=f"{type(e).__name__}: {str(e)[:400]}")
        dense = next((r for r in rec.rows if r["seq_len"] == seq_len
                      and r["attention"] == "dense" and r.get("tokens_per_s")), None)
        if dense and row.get("tokens_per_s") and attention != "dense":
          row["speedup_vs_dense"] = round(row["tokens_per_s"] / dense["tokens_per_s"], 3)
        if keep:
          row["workdir"] = str(workdir)
        rec.add(**row)
        print({k: v for k, v in row.items() if k != "loss_curve"}, flush=True)
        if not keep:
          shutil.rmtree(workdir, ignore_errors=True)
  finally:
    if not keep:
      shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def _indices_not_kept(remat: str):
  """Inside: the named policy as it is, except that it does not keep the selected block indices
  (a model traced here selects again in its backward pass)."""
  from pisa_jax.checkpoint_names import BLOCK_INDICES
  from pisa_jax.models import decoder

  policy = decoder.REMAT_POLICIES[remat]

  def without_indices(prim, *avals, **params):
    # checkpoint_name's primitive carries the name as its "name" parameter.
    return params.get("name") != BLOCK_INDICES and policy(prim, *avals, **params)

  with mock.patch.dict(decoder.REMAT_POLICIES, {remat: without_indices}):
    yield


def step_kernels(trainer, config, steps: int) -> dict:
  """The GPU kernels of one training step of `trainer`, from a profile of `steps` steps after two
  warm-up steps on one batch: launches_per_step, device_ms per step, per-kernel rows (name,
  launches and ms per step, XLA's numbered kernels folded by name) and ms per KERNEL_GROUPS
  group. Empty on a CPU backend."""
  from pisa_jax.train.data import make_batches

  batch = make_batches(config, "train", global_batch=trainer.global_batch, accum=1).batch(0)
  batch = trainer.place_batch(batch, trainer.batch_shardings)
  state = [trainer.init_state()]
  for _ in range(2):
    state[0], metrics = trainer.train_step(state[0], batch)
  jax.block_until_ready(metrics)

  def run():
    for _ in range(steps):
      state[0], out = trainer.train_step(state[0], batch)
    jax.block_until_ready(out)

  return summarise_kernels(timing.gpu_kernel_events(run), steps)


def summarise_kernels(events: list[tuple[str, int]], steps: int) -> dict:
  """`step_kernels`' record from the (name, duration ns) events of `steps` steps (empty for
  none)."""
  if not events:
    return {}
  launches, device_ms = timing.per_call(events, steps)
  every = len(events)
  ms = timing.kernel_totals(events, steps, top=every)
  # The same fold with 1 ms a launch: launches per step of each folded name.
  count = timing.kernel_totals([(name, 1e6) for name, _ in events], steps, top=every)
  groups = {group: 0.0 for group, _ in KERNEL_GROUPS} | {"other": 0.0}
  for name, v in ms.items():
    group = next((g for g, member in KERNEL_GROUPS if member(name)), "other")
    groups[group] += v
  return dict(launches_per_step=round(launches, 1), device_ms=round(device_ms, 3),
              groups_ms={g: round(v, 3) for g, v in groups.items()},
              kernels=[dict(name=name, launches_per_step=round(count[name], 2), ms_per_step=v)
                       for name, v in ms.items()])


def profile_one(args, attention: str, seq_len: int, remat: str, indices_kept: bool) -> dict:
  from pisa_jax.train.trainer import build_trainer

  config = config_for(args, attention, seq_len, remat)
  with contextlib.nullcontext() if indices_kept else _indices_not_kept(config.model.remat):
    trainer = build_trainer(config)
  row = dict(attention=attention, seq_len=seq_len, remat=config.model.remat,
             indices_kept=indices_kept, loss_chunk=config.train.loss_chunk,
             top_k=None if attention == "dense" else config.model.top_k,
             tokens_per_step=trainer.tokens_per_step, steps_profiled=args.kernel_steps)
  return {**row, **step_kernels(trainer, config, args.kernel_steps)}


def measure_kernels(args, rec: _record.Recorder) -> None:
  args.data_overrides = data_overrides(args, rec)
  for seq_len in args.seq_lens:
    for attention in args.attention:
      for remat in args.remat:
        remat = config_for(args, attention, seq_len, remat).model.remat  # None: the preset's
        runs = [True] + ([False] if args.without_indices and attention != "dense"
                         and remat != "none" else [])
        for indices_kept in runs:
          what = "" if indices_kept else ", indices not kept"
          print(f"== {attention} at {seq_len} tokens, remat {remat}{what}", flush=True)
          try:
            row = profile_one(args, attention, seq_len, remat, indices_kept)
          except Exception as e:  # e.g. out of memory: recorded, the rest run
            row = dict(attention=attention, seq_len=seq_len, remat=remat,
                       indices_kept=indices_kept, error=f"{type(e).__name__}: {str(e)[:400]}")
          if "error" not in row and "device_ms" not in row:
            row["error"] = "no GPU kernels in the trace (a CPU backend)"
          rec.add(**row)
          print({k: v for k, v in row.items() if k != "kernels"}, flush=True)


def _run_label(r: dict) -> str:
  kept = "" if r.get("indices_kept", True) else ", no indices"
  return f"{r['attention']} {r['seq_len']}, {r['remat']}{kept}"


def kernels_table(record: dict, top: int = 8) -> str:
  groups = [g for g, _ in KERNEL_GROUPS] + ["other"]
  cols = ["run", "launches/step", "device ms/step"] + [f"{g} ms" for g in groups]
  body = [[_run_label(r), r.get("launches_per_step"), r.get("device_ms")]
          + ([(r.get("groups_ms") or {}).get(g) for g in groups] if "error" not in r
             else [r["error"][:80]] + [None] * (len(groups) - 1))
          for r in record["rows"]]
  text = _record.markdown(cols, body)
  lines = [[_run_label(r), k["name"], k["launches_per_step"], k["ms_per_step"]]
           for r in record["rows"] for k in (r.get("kernels") or [])[:top]]
  if lines:
    text += "\n\n" + _record.markdown(["run", f"kernel (top {top} by ms)", "launches/step",
                                        "ms/step"], lines)
  return text


def kernels_plot(record: dict, path) -> None:
  plt = _record.pyplot()
  rows = [r for r in record["rows"] if r.get("groups_ms")]
  fig, ax = plt.subplots(figsize=(10, 1.2 + 0.5 * max(1, len(rows))))
  left = np.zeros(len(rows))
  for group in [g for g, _ in KERNEL_GROUPS] + ["other"]:
    values = np.array([r["groups_ms"][group] for r in rows])
    ax.barh([_run_label(r) for r in rows], values, left=left, label=group)
    left += values
  ax.invert_yaxis()
  ax.set_xlabel("device ms per training step")
  ax.set_title(f"kernels of a training step, {record['device']}", fontsize=10)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def table(record: dict) -> str:
  if record.get("benchmark") == KERNELS_NAME:
    return kernels_table(record)
  cols = ["attention", "context", "tokens/step", "tokens/s", "x dense", "MFU", "steps",
          "compiled temp GiB", "last loss"]
  body = [[r["attention"], r["seq_len"], r.get("tokens_per_step"), r.get("tokens_per_s"),
           r.get("speedup_vs_dense"), r.get("mfu"), r.get("steps"),
           (r.get("compiled_step_gib") or {}).get("temp"), r.get("final_loss") or r.get("error")]
          for r in record["rows"]]
  return _record.markdown(cols, body)


def plot(record: dict, path) -> None:
  if record.get("benchmark") == KERNELS_NAME:
    return kernels_plot(record, path)
  plt = _record.pyplot()
  rows = [r for r in record["rows"] if r.get("tokens_per_s")]
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  for r in rows:
    steps, loss = zip(*r["loss_curve"]) if r["loss_curve"] else ((), ())
    axes[0].plot([s * r["tokens_per_step"] / 1e6 for s in steps], loss, lw=1,
                 label=f"{r['attention']}, {r['seq_len']}")
  axes[0].set_xlabel("training tokens (M)")
  axes[0].set_ylabel("train loss")
  axes[0].set_title(f"{record['settings']['preset']} preset, {record['settings']['seconds']:.0f} s "
                    f"per run", fontsize=10)
  axes[0].legend(fontsize=8)
  names = [f"{r['attention']}\n{r['seq_len']}" for r in rows]
  axes[1].bar(names, [r["tokens_per_s"] for r in rows],
              color=["tab:gray" if r["attention"] == "dense" else "tab:blue" for r in rows])
  for i, r in enumerate(rows):
    if r.get("speedup_vs_dense"):
      axes[1].annotate(f"{r['speedup_vs_dense']:.2f}x dense", (i, r["tokens_per_s"]),
                       textcoords="offset points", xytext=(0, 3), fontsize=8, ha="center")
  axes[1].set_ylabel("tokens / s")
  axes[1].set_title(f"throughput, {record['device']}", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def settings(args) -> dict:
  if args.kernels:
    return dict(preset=args.preset, attention=args.attention, seq_lens=args.seq_lens,
                tokens_per_step=args.tokens_per_step, remat=args.remat,
                kernel_steps=args.kernel_steps, without_indices=args.without_indices,
                data=args.data, overrides=args.set)
  return dict(preset=args.preset, attention=args.attention, seq_lens=args.seq_lens,
              tokens_per_step=args.tokens_per_step, seconds=args.seconds, data=args.data,
              overrides=args.set, keep_runs=args.keep_runs)


def measure(args, rec: _record.Recorder) -> None:
  if args.kernels:
    measure_kernels(args, rec)
  else:
    measure_training(args, rec)


def result_name(args) -> str:
  """training.json, or training_kernels.json for --kernels; --replot keeps its JSON's name."""
  if args.replot:
    name = _record.load(args.replot)["benchmark"]
    if name not in (NAME, KERNELS_NAME):
      raise SystemExit(f"--replot {args.replot} holds a {name!r} result, not a training one")
    return name
  return KERNELS_NAME if args.kernels else NAME


def main(argv=None) -> dict:
  p = _record.parser(__doc__)
  p.add_argument("--preset", default="small")
  p.add_argument("--attention", type=lambda s: [x for x in s.split(",") if x],
                 default=["dense", "pisa"], help="comma-separated, e.g. dense,pisa")
  p.add_argument("--seq-lens", type=lambda s: [int(x) for x in s.split(",") if x],
                 default=[4096, 16384])
  p.add_argument("--tokens-per-step", type=int, default=32768,
                 help="global tokens per step in every run (batch = this / context)")
  p.add_argument("--seconds", type=float, default=60.0, help="training wall time per run")
  p.add_argument("--data", default="data/corpus", help="a pisa-prepare-data folder")
  p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                 help="more config overrides, as pisa-train takes them")
  p.add_argument("--keep-runs", metavar="DIR", default=None,
                 help="keep each run's folder (checkpoint and metrics) as DIR/<attention>-<context>, "
                      "for `pisa-eval --workdir`; DIR must be empty or new")
  p.add_argument("--kernels", action="store_true",
                 help="profile the kernels of a training step per run instead of training "
                      "(training_kernels.json)")
  p.add_argument("--remat", type=lambda s: [x for x in s.split(",") if x], default=[None],
                 help="--kernels: comma-separated model.remat policies, one run each (default: "
                      "the preset's)")
  p.add_argument("--kernel-steps", type=int, default=2, help="--kernels: steps profiled per run")
  p.add_argument("--without-indices", action="store_true",
                 help="--kernels: also each PISA run's policy without the selected indices kept")
  args = p.parse_args(argv)
  if not args.kernels and (args.remat != [None] or args.without_indices):
    p.error("--remat and --without-indices go with --kernels (else set model.remat with --set)")
  return _record.run(result_name(args), args, measure, settings, plot, table)


if __name__ == "__main__":
  main()
