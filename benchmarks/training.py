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
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks import _record
from pisa_jax.configs import apply_overrides, get_config, validate

NAME = "training"


def config_for(args, attention: str, seq_len: int):
  batch = max(1, args.tokens_per_step // (seq_len * jax.device_count()))
  overrides = [
      f"model.attention={attention}", f"train.seq_len={seq_len}",
      f"train.per_device_batch={batch}", "train.grad_accum=1",
      # The run ends on --seconds; steps only shape the schedule.
      "train.steps=2000", "train.warmup_steps=50", "train.decay_steps=200", "train.log_every=5",
      "train.eval_every=1000000", "train.eval_batches=0", "train.checkpoint_every=1000000",
      "train.async_checkpointing=false",
  ] + args.data_overrides + args.set
  return validate(apply_overrides(get_config(args.preset), overrides))


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
      tokens_per_s=round(float(np.mean([r["tokens_per_s"] for r in steady])), 1) if steady else None,
      mfu=round(float(np.mean(mfu)), 4) if mfu else None,
      compiled_step_gib=memory, final_loss=logged[-1]["loss"] if logged else None,
      loss_curve=[[r["step"], round(r["loss"], 4)] for r in logged])


def measure(args, rec: _record.Recorder) -> None:
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


def table(record: dict) -> str:
  cols = ["attention", "context", "tokens/step", "tokens/s", "x dense", "MFU", "steps",
          "compiled temp GiB", "last loss"]
  body = [[r["attention"], r["seq_len"], r.get("tokens_per_step"), r.get("tokens_per_s"),
           r.get("speedup_vs_dense"), r.get("mfu"), r.get("steps"),
           (r.get("compiled_step_gib") or {}).get("temp"), r.get("final_loss") or r.get("error")]
          for r in record["rows"]]
  return _record.markdown(cols, body)


def plot(record: dict, path) -> None:
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
  return dict(preset=args.preset, attention=args.attention, seq_lens=args.seq_lens,
              tokens_per_step=args.tokens_per_step, seconds=args.seconds, data=args.data,
              overrides=args.set, keep_runs=args.keep_runs)


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
  args = p.parse_args(argv)
  return _record.run(NAME, args, measure, settings, plot, table)


if __name__ == "__main__":
  main()
