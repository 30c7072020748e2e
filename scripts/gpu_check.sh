#!/usr/bin/env bash
# The GPU check: one command, about 12 minutes on one GPU, no network needed.
# Uses the python3 already there (numpy, cupy, torch with CUDA, pytest, hypothesis) and the
# project from this checkout (PYTHONPATH, no install). It
#   1. runs the test suite's cuda cases (the `device` fixture's cuda parameter),
#   2. compares a float32 training step of Seq2SeqTransformer on cuda with torch on CUDA,
#   3. prints ms/step ours vs torch CUDA for the base and paper configurations,
#   4. times attention forward + backward, flash vs torch SDPA, T = 1,024 ... 65,536 (and causal).
# Usage: bash scripts/gpu_check.sh [OUTDIR]   (logs also go to OUTDIR when given)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUTDIR=${1:-}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
log() { if [ -n "$OUTDIR" ]; then mkdir -p "$OUTDIR"; tee -a "$OUTDIR/$1"; else cat; fi; }
status=0

echo "== environment" | log gpu_check.log
$PY - <<'PY' 2>&1 | log gpu_check.log || exit 1
import cupy, numpy, torch
print("numpy", numpy.__version__, "cupy", cupy.__version__, "torch", torch.__version__,
      "GPUs", cupy.cuda.runtime.getDeviceCount(), "torch.cuda", torch.cuda.is_available())
print(cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
PY

echo "== 1. test suite on cuda" | log gpu_check.log
timeout 420 $PY -m pytest -q -p no:cacheprovider -k cuda tests 2>&1 | log gpu_check.log || status=1

echo "== 2. training-step parity with torch CUDA (float32)" | log gpu_check.log
timeout 120 $PY scripts/gpu_parity.py 2>&1 | log gpu_check.log || status=1

echo "== 3. ms/step ours vs torch CUDA" | log gpu_check.log
for config in base paper; do
  timeout 150 $PY benchmarks/train_step.py --config "$config" --device cuda --steps 10 --no-memory 2>&1 \
    | log gpu_check.log || status=1
done
echo "== 4. attention forward+backward: flash vs torch SDPA, then naive and memory-efficient" | log gpu_check.log
for causal in "" "--causal"; do
  timeout 400 $PY benchmarks/attention.py --device cuda --impls ours-flash torch --timeout 150 $causal 2>&1 \
    | log gpu_check.log || status=1
done
timeout 200 $PY benchmarks/attention.py --device cuda --lengths 1024 4096 --impls ours-naive ours-memory-efficient \
  --timeout 90 2>&1 | log gpu_check.log || status=1
echo "gpu_check status: $status" | log gpu_check.log
exit $status
