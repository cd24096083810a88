"""Is PISA cheaper to train than dense attention at the paper's own settings, on one GPU?

Tokens/s and MFU of PISA and dense attention (cuDNN's, through `jax.nn.dot_product_attention`),
both in this one process, at the settings of the paper's training runs (Table 5, Appendix C.1):

  418m        pretraining                  4K tokens, K = 8,  batch 8
  cpt-418m    continued pretraining        16K tokens, K = 32, batch 2; 64K tokens, batch 1
  cpt-1.47b   continued pretraining        16K tokens, K = 32, batch 1 (as far as one GPU holds it)

Each run compiles the trainer's step (`pisa_jax.train`), checks its memory against the device's,
takes --warmup untimed steps and then --steps timed ones (the median counts), on one batch of the
data (a `pisa-prepare-data` folder at --data, else MQAR generated on the fly: the notes say
which). A run that does not fit, or fails (out of memory), is recorded with its error and the
rest run. Every row records the remat policy (`model.remat`) and the loss chunk
(`train.loss_chunk`) it ran with: the same for both sides of a setting.

MFU, counted the same way for both sides: model FLOPs per token (`decoder.flops_per_token`) x
tokens/s / the device's dense bf16 peak. Model FLOPs per token = 6 x (parameters - input
embedding) + 3 x 4 x HQ x D x (attended keys) per layer: dense causal attention attends
(T + 1) / 2 keys on average, PISA the keys of its K selected blocks, the current one up to the
query (`decoder.sparse_attended_keys`: 452.5 at 4K with K = 8, 1,892.5 at 16K with K = 32).
Not counted, on either side: remat's recomputation and PISA's block selection (the work a
side does beyond its model's math lowers its MFU rather than raising it).

The goals (rows with "goal"): PISA / dense tokens/s at least 1.1 at 4K, 1.5 at 16K, 4 at 64K.

  python -m benchmarks.paper_settings                     # one H200: every setting, ~8 minutes
  python -m benchmarks.paper_settings --only cpt-418m@65536,cpt-1.47b@16384 --append
                                                          # into the result in --out: its other
                                                          # settings' rows kept
  python -m benchmarks.paper_settings --only cpt-418m@16384 --remat full_save_attention
  python -m benchmarks.paper_settings --replot benchmarks/results/paper_settings.json
  python -m benchmarks.paper_settings --toy --out /tmp/ps   # any CPU: the tiny model, 2 steps
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from pathlib import Path

import jax

from benchmarks import _record

NAME = "paper_settings"
# PISA / dense tokens/s to reach, by context length.
GOALS = {4096: 1.1, 16384: 1.5, 65536: 4.0}


@dataclasses.dataclass(frozen=True)
class Setting:
  """One training setting: a preset at one context, its selection budget K, per-device batch,
  and the memory settings (remat policy, loss chunk: 0 for the whole sequence at once) both
  sides run it with."""

  preset: str
  seq_len: int
  top_k: int
  batch: int
  remat: str
  loss_chunk: int

  @property
  def key(self) -> str:
    return f"{self.preset}@{self.seq_len}"


# The paper's settings on one H200 (141 GB). 4K and 16K at 418m keep every activation ("none");
# 64K and the 1.47B model keep the block input, the indices and the attention residuals and run
# the loss over chunks (at 64K a [T, V] float32 logits array alone is 13 GB).
SETTINGS = (
    Setting("418m", 4096, 8, 8, "none", 0),
    Setting("cpt-418m", 16384, 32, 2, "none", 0),
    Setting("cpt-418m", 65536, 32, 1, "full_save_attention", 8192),
    Setting("cpt-1.47b", 16384, 32, 1, "full_save_attention", 8192),
)
# --toy: the tiny preset (1 layer) on any CPU, one setting.
TOY = (Setting("tiny", 128, 4, 2, "full_save_attention", 64),)


def config_for(args, setting: Setting, attention: str):
  """The run's validated config: the preset at the setting, with `--set` applied last."""
  from pisa_jax.configs import apply_overrides, get_config, validate

  steps = args.warmup + args.steps
  overrides = [
      f"model.attention={attention}", f"model.top_k={setting.top_k}",
      f"model.remat={args.remat or setting.remat}", f"train.seq_len={setting.seq_len}",
      f"train.per_device_batch={setting.batch}", "train.grad_accum=1",
      f"train.loss_chunk={setting.loss_chunk if args.loss_chunk is None else args.loss_chunk}",
      # Steps only shape the schedule; the warm-up in steps, also for the presets that give it as
      # a fraction (cpt-*).
      f"train.steps={steps + 10}", "train.warmup_fraction=0", "train.warmup_steps=1",
      "train.decay_steps=1", "train.eval_batches=0", "train.async_checkpointing=false",
  ] + args.data_overrides[setting.preset] + args.set
  return validate(apply_overrides(get_config(setting.preset), overrides))


def run_one(args, setting: Setting, attention: str) -> dict:
  """Compiles, checks the memory, times the steps. Raises on a failure the caller records."""
  from pisa_jax.models.decoder import flops_per_token
  from pisa_jax.train import trainer as trainer_lib
  from pisa_jax.train.data import make_batches

  config = config_for(args, setting, attention)
  m, t = config.model, config.train
  row = dict(case=f"{setting.key}:{attention}", setting=setting.key, preset=setting.preset,
             attention=attention, seq_len=t.seq_len,
             top_k=None if attention == "dense" else m.top_k, batch=t.per_device_batch,
             remat=m.remat, loss_chunk=t.loss_chunk)
  t0 = time.perf_counter()
  trainer = trainer_lib.build_trainer(config)
  row["compile_s"] = round(time.perf_counter() - t0, 1)
  memory = trainer_lib.memory_record(trainer)
  gib = 2**30
  row["compiled_temp_gib"] = round(memory.get("temp_size_in_bytes", 0) / gib, 2)
  row["compiled_peak_gib"] = (None if memory["peak_bytes"] is None
                              else round(memory["peak_bytes"] / gib, 2))
  try:
    trainer_lib.check_memory(trainer)
  except trainer_lib.InsufficientMemoryError as e:
    return {**row, "error": f"does not fit: {str(e)[:300]}"}
  state = trainer.init_state()
  batches = make_batches(config, "train", global_batch=trainer.global_batch, accum=1)
  batch = trainer.place_batch(batches.batch(0), trainer.batch_shardings)
  times = []
  for _ in range(args.warmup + args.steps):
    start = time.perf_counter()
    state, metrics = trainer.train_step(state, batch)
    loss = float(metrics["loss"])  # waits for the step
    times.append(time.perf_counter() - start)
  step_s = statistics.median(times[args.warmup:])
  tokens_per_s = trainer.tokens_per_step / step_s
  flops = flops_per_token(m, t.seq_len)
  peak = args.peak_tflops * 1e12 or trainer_lib.peak_flops(jax.devices()[0])
  del state, batch, metrics
  return {**row, "tokens_per_step": trainer.tokens_per_step, "step_s": round(step_s, 4),
          "tokens_per_s": round(tokens_per_s, 1),
          "model_flops_per_token": round(flops),
          "mfu": round(flops * tokens_per_s / peak, 4) if peak else None,
          "timed_steps": args.steps, "last_loss": round(loss, 4)}


def goal_row(setting: Setting, rows: list[dict]) -> dict | None:
  """PISA / dense tokens/s of a setting against its context's goal (None: no goal there)."""
  target = GOALS.get(setting.seq_len)
  if target is None:
    return None
  tok = {r["attention"]: r.get("tokens_per_s") for r in rows if r.get("setting") == setting.key}
  value = (round(tok["pisa"] / tok["dense"], 3) if tok.get("pisa") and tok.get("dense")
           else None)
  return dict(goal=f"PISA / dense tokens/s, {setting.key}", case=f"{setting.key}:goal",
              setting=setting.key, value=value,
              target=target, met=None if value is None else value >= target)


def data_overrides(args, rec, settings) -> dict[str, list[str]]:
  """Per preset: the --data folder's tokens, or MQAR when there is none (noted)."""
  from pisa_jax.configs import get_config

  out = {}
  for preset in sorted({s.preset for s in settings}):
    base = get_config(preset)
    if args.data and (Path(args.data) / "meta.json").exists():
      out[preset] = ["data.source=tokens", f"data.path={args.data}"]
    elif base.data.source == "mqar":
      out[preset] = []
    else:
      # MQAR splits the vocabulary into keys and values: an even size (one more token leaves
      # the padded embedding, and so the model's compute, unchanged).
      vocab = base.model.vocab_size + base.model.vocab_size % 2
      out[preset] = ["data.source=mqar", "data.mqar_num_pairs=64", f"model.vocab_size={vocab}"]
  if any("data.source=mqar" in v for v in out.values()):
    rec.note(f"no pisa-prepare-data folder at {args.data}: MQAR batches generated on the fly "
             "(throughput does not depend on the tokens)")
  return out


def measure(args, rec) -> None:
  settings = TOY if args.toy else SETTINGS
  if args.only:
    known = {s.key for s in settings}
    unknown = sorted(set(args.only) - known)
    if unknown:
      raise SystemExit(f"--only {','.join(unknown)}: expected some of {sorted(known)}")
    settings = [s for s in settings if s.key in args.only]
  args.data_overrides = data_overrides(args, rec, settings)
  rec.note("MFU = decoder.flops_per_token x tokens/s / dense bf16 peak, both sides: 6 x "
           "(parameters - input embedding) + 12 x HQ x D x attended keys per layer and token, "
           "attended = (T + 1) / 2 for dense causal, for PISA the mean over queries of its K "
           "blocks' keys up to the query (decoder.sparse_attended_keys); remat recomputation "
           "and block selection not counted")
  for setting in settings:
    for attention in args.attention:
      print(f"== {attention}, {setting.key}", flush=True)
      try:
        row = run_one(args, setting, attention)
      except Exception as e:  # out of memory at run time, a failed compile: recorded
        # What it ran with, --set included (a config that does not validate: the setting's).
        try:
          config = config_for(args, setting, attention)
          remat, loss_chunk = config.model.remat, config.train.loss_chunk
        except Exception:
          remat, loss_chunk = setting.remat, setting.loss_chunk
        row = dict(case=f"{setting.key}:{attention}", setting=setting.key, preset=setting.preset,
                   attention=attention, seq_len=setting.seq_len, remat=remat,
                   loss_chunk=loss_chunk, error=f"{type(e).__name__}: {str(e)[:400]}")
      # Free this run's state and compiled step before the next model is built.
      gc.collect()
      rec.add(**row)
      print(row, flush=True)
    goal = goal_row(setting, rec.rows)
    if goal:
      rec.add(**goal)


def table(record: dict) -> str:
  cols = ["setting", "attention", "K", "batch", "remat", "loss chunk", "tokens/s", "MFU",
          "step s", "compile s", "compiled peak GiB", "error"]
  runs = [r for r in record["rows"] if "goal" not in r]
  body = [[r["setting"], r["attention"], r.get("top_k"), r.get("batch"), r.get("remat"),
           r.get("loss_chunk"), r.get("tokens_per_s"), r.get("mfu"), r.get("step_s"),
           r.get("compile_s"), r.get("compiled_peak_gib"), (r.get("error") or "")[:80]]
          for r in runs]
  return _record.with_goals(record, _record.markdown(cols, body))


def plot(record: dict, path) -> None:
  plt = _record.pyplot()
  runs = [r for r in record["rows"] if "goal" not in r]
  keys = list(dict.fromkeys(r["setting"] for r in runs))
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  width = 0.38
  for i, (attention, color) in enumerate((("pisa", "tab:blue"), ("dense", "tab:gray"))):
    by_key = {r["setting"]: r for r in runs if r["attention"] == attention}
    xs = [j + (i - 0.5) * width for j in range(len(keys))]
    for ax, field in ((axes[0], "tokens_per_s"), (axes[1], "mfu")):
      ax.bar(xs, [(by_key.get(k) or {}).get(field) or 0 for k in keys], width, color=color,
             label=attention)
  goals = {g["setting"]: g for g in record["rows"] if "goal" in g}
  for j, key in enumerate(keys):
    g = goals.get(key)
    if g and g["value"] is not None:
      top = max((r.get("tokens_per_s") or 0) for r in runs if r["setting"] == key)
      axes[0].annotate(f"{g['value']:.2f}x (goal {g['target']:g})", (j, top),
                       textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
  for ax, label in ((axes[0], "tokens / s"), (axes[1], "MFU (model FLOPs, same count)")):
    ax.set_xticks(range(len(keys)), [k.replace("@", "\n") for k in keys], fontsize=8)
    ax.set_ylabel(label)
    ax.legend(fontsize=8)
  axes[0].set_title(f"the paper's settings, {record['device']}", fontsize=10)
  remats = sorted({f"{r['setting']}: {r.get('remat')}, chunk {r.get('loss_chunk')}"
                   for r in runs})
  axes[1].set_title("; ".join(remats), fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def settings(args) -> dict:
  chosen = TOY if args.toy else SETTINGS
  return dict(settings=[dataclasses.asdict(s) for s in chosen], only=args.only,
              attention=args.attention, remat=args.remat, loss_chunk=args.loss_chunk,
              steps=args.steps, warmup=args.warmup, data=args.data, overrides=args.set,
              toy=args.toy)


def _csv(s: str) -> list[str]:
  return [x for x in s.split(",") if x]


def main(argv=None) -> dict:
  p = _record.parser(__doc__, append=True)
  p.add_argument("--only", type=_csv, default=None,
                 help="comma-separated settings, e.g. cpt-418m@16384 (default: all)")
  p.add_argument("--attention", type=_csv, default=["pisa", "dense"],
                 help="comma-separated; PISA first in each setting")
  p.add_argument("--remat", default=None,
                 help="one model.remat policy for every run (default: each setting's)")
  p.add_argument("--loss-chunk", type=int, default=None,
                 help="one train.loss_chunk for every run (default: each setting's)")
  p.add_argument("--steps", type=int, default=3, help="timed steps per run (the median counts)")
  p.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
  p.add_argument("--peak-tflops", type=float, default=0.0,
                 help="dense bf16 peak per device for MFU; 0 looks it up from the device kind")
  p.add_argument("--data", default="data/corpus", help="a pisa-prepare-data folder")
  p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                 help="more config overrides for every run, as pisa-train takes them")
  p.add_argument("--toy", action="store_true",
                 help="the tiny preset with 1 layer, one setting, 1 + 1 steps: checks the script "
                      "on any CPU")
  args = p.parse_args(argv)
  if args.toy:
    args.set = ["model.num_layers=1"] + args.set
    args.steps, args.warmup = min(args.steps, 1), min(args.warmup, 1)
  if args.steps < 1 or args.warmup < 0:
    p.error(f"--steps={args.steps} must be >= 1 and --warmup={args.warmup} >= 0")
  # Rows are named SETTING:ATTENTION and SETTING:goal (the goal is worked out again from the
  # rows a setting has after this call).
  measured = [f"{s.key}:{name}" for s in (TOY if args.toy else SETTINGS)
              if args.only is None or s.key in args.only for name in [*args.attention, "goal"]]
  measure_into = _record.appending(NAME, args, measure, measured)
  return _record.run(NAME, args, measure_into, settings, plot, table)


if __name__ == "__main__":
  main()
