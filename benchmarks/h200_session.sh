#!/usr/bin/env bash
# One H200 call for the figures of several issues, each stage under its own time limit so that a
# slow stage cannot starve the others (see WORKSPACE.md, "Running on the H200"). Every stage is
# opt-in: it runs only when its limit in seconds is set and not 0 (a forgotten default once spent
# ten minutes of a session's thirty on stages nobody asked for).
#   1. issue 3: selection kernels vs fla (benchmarks/bench_selection.py)      SELECTION_S
#   2. issue 7: quality vs beam on a dense model trained here, time vs beam  RECALL_S
#   -  per-kernel device time from a profiler trace (profile_kernels.py)  PROFILE_S
#   -  Nsight Compute counters of chosen kernels (NCU_CASES, NCU_KERNELS)  NCU_S
#   3. issue 4: attention kernels vs fla, cuDNN dense, XLA; whole layer      ATTENTION_S
#   4. issue 5: the small preset, dense vs PISA at 4K and 16K                TRAIN_S
#   5. issue 6: multi-GPU scaling, equivalence, checkpoint portability        MULTI_S
# The device returns at most 8 files, so the figures are copied to $OUT's top level and every log
# is packed into $OUT/logs.tgz.
#   carry: [".whl", "data/corpus"]   (data/corpus from `pisa-prepare-data`, never committed)
#   command: source benchmarks/device_setup.sh || exit 1; bash benchmarks/h200_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
final=${OUT:?OUT must be set}
work=/tmp/h200_session
rm -rf "$work"; mkdir -p "$work/selection"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$work/gpu.txt" 2>&1
export PYTHONWARNINGS="ignore::DeprecationWarning"
if [ "${SELECTION_S:-0}" != 0 ]; then
  timeout -k 10 "$SELECTION_S" python3 benchmarks/bench_selection.py --out "$work/selection" \
    ${SELECTION_ARGS:-} > "$work/selection.log" 2>&1
  echo "selection benchmark rc=$?"; tail -n 25 "$work/selection.log"
  cp "$work/selection/selection.json" "$work/selection/selection.png" "$final/" 2>/dev/null
fi
if [ "${PROFILE_S:-0}" != 0 ]; then
  timeout -k 10 "$PROFILE_S" python3 benchmarks/profile_kernels.py --out "$final" ${PROFILE_ARGS:-} \
    > "$work/profile.log" 2>&1
  echo "profile rc=$?"; grep -E "^==|Stream" "$work/profile.log" | cut -c1-700 | head -n 40
fi
if [ "${NCU_S:-0}" != 0 ]; then
  # Nsight Compute's counters (the Firecracker H200 reads them) for the first launch of each
  # kernel whose name matches NCU_KERNELS, in the profile_kernels.py cases NCU_CASES; clocks left
  # alone (METHOD.md).
  ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
  timeout -k 10 "$NCU_S" "$ncu_bin" --clock-control none --target-processes all \
    -k "regex:${NCU_KERNELS:-pisa_select}" --launch-count "${NCU_LAUNCHES:-3}" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    python3 benchmarks/profile_kernels.py --no-trace --calls 0 \
    --cases "${NCU_CASES:-sel.K8.d64.N131072}" > "$work/ncu.log" 2>&1
  echo "ncu rc=$?"
  grep -E "pisa_|bsa_|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Warp Cycles Per Issued|Issued Ipc|Memory Throughput|DRAM Throughput|L2 Hit|Compute \(SM\)|Stall|==ERR|==WARN" \
    "$work/ncu.log" | cut -c1-200 | head -n 120
fi
if [ "${ATTENTION_S:-0}" != 0 ]; then
  mkdir -p "$work/attention"
  OUT="$work/attention" timeout -k 10 "$ATTENTION_S" python3 benchmarks/bench_attention.py \
    --mode bench ${ATTENTION_ARGS:-} > "$work/attention.log" 2>&1
  echo "attention benchmark rc=$?"; grep -E "\||error|skipped" "$work/attention.log" | tail -n 30
  cp "$work/attention/attention.json" "$work/attention/attention.png" "$final/" 2>/dev/null
fi
if [ "${RECALL_S:-0}" != 0 ]; then
  timeout -k 10 "$RECALL_S" python3 benchmarks/selection_recall.py --data data/corpus \
    --workdir "$work/recall_run" --out "$work/recall" --train-seconds "${RECALL_TRAIN_S:-50}" \
    > "$work/recall.log" 2>&1
  echo "recall rc=$?"; grep -vE "^\s|^\{|^\}" "$work/recall.log" | tail -n 45
  cp "$work/recall/selection_recall.json" "$work/recall/selection_recall.png" "$final/" 2>/dev/null
fi
if [ "${TRAIN_S:-0}" != 0 ]; then
  OUT=$work TRAIN_SECONDS=${TRAIN_SECONDS:-15} timeout -k 10 "$TRAIN_S" \
    bash benchmarks/train_h200.sh > "$work/train_h200.log" 2>&1
  echo "train rc=$?"; tail -n 30 "$work/train_h200.log"
  [ -f "$work/train_h200/summary.json" ] || bash benchmarks/train_h200.sh plot "$work/train_h200" >/dev/null 2>&1
  cp "$work/train_h200/summary.json" "$final/train_h200.json" 2>/dev/null
  cp "$work/train_h200/loss_curves.png" "$final/train_h200.png" 2>/dev/null
fi
if [ "${MULTI_S:-0}" != 0 ]; then
  # Issue 6 on a multi-GPU kind (dry run on 1 GPU: only the 1x1 layout runs): scaling, memory,
  # compute / communication per step, equivalence with 1 device, checkpoint portability.
  data_sets=()
  [ -f data/corpus/meta.json ] && data_sets=(--set data.source=tokens --set data.path=data/corpus)
  timeout -k 10 "$MULTI_S" python3 benchmarks/multi_gpu.py --out "$work/multi_gpu" \
    --workdir "$work/multi_gpu_runs" "${data_sets[@]}" ${MULTI_ARGS:-} > "$work/multi_gpu.log" 2>&1
  echo "multi_gpu rc=$?"; tail -n 40 "$work/multi_gpu.log"
  cp "$work/multi_gpu/multi_gpu.json" "$work/multi_gpu/multi_gpu.png" "$final/" 2>/dev/null
fi
find "$work" -name checkpoints -type d -prune -exec rm -rf {} +
tar czf "$final/logs.tgz" -C "$work" .
ls -la "$final"
