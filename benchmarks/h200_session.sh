#!/usr/bin/env bash
# One H200 call for the training-side figures (see WORKSPACE.md, "Running on the H200"):
#   1. issue 5: the small preset, dense vs PISA at 4K and 16K (benchmarks/train_h200.sh);
#   2. issue 7: selection quality vs beam on a dense model trained here, and selection time vs beam
#      (benchmarks/selection_recall.py).
# The device returns at most 8 files, so the figures are copied to $OUT's top level and every log
# is packed into $OUT/logs.tgz.
#   carry: [".whl", "data/corpus"]   (data/corpus from `pisa-prepare-data`, never committed)
#   command: source benchmarks/device_setup.sh || exit 1; bash benchmarks/h200_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
final=${OUT:?OUT must be set}
work=/tmp/h200_session
rm -rf "$work"; mkdir -p "$work"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$work/gpu.txt" 2>&1
if [ "${SKIP_TRAIN:-0}" != 1 ]; then
  OUT=$work TRAIN_SECONDS=${TRAIN_SECONDS:-25} bash benchmarks/train_h200.sh 2>&1 | tee "$work/train_h200.log"
  cp "$work/train_h200/summary.json" "$final/train_h200.json" 2>/dev/null
  cp "$work/train_h200/loss_curves.png" "$final/train_h200.png" 2>/dev/null
fi
if [ "${SKIP_RECALL:-0}" != 1 ]; then
  python3 benchmarks/selection_recall.py --data data/corpus --workdir "$work/recall_run" \
    --out "$work/recall" --train-seconds "${RECALL_SECONDS:-90}" 2>&1 | tee "$work/recall.log"
  cp "$work/recall/selection_recall.json" "$work/recall/selection_recall.png" "$final/" 2>/dev/null
fi
find "$work" -name checkpoints -type d -prune -exec rm -rf {} +
tar czf "$final/logs.tgz" -C "$work" .
ls -la "$final"
