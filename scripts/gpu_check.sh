#!/usr/bin/env bash
# The GPU check: one command that checks and measures everything on a machine with a GPU, in at most
# 6 minutes, with no network. It uses the python3 already there (numpy, cupy, torch with CUDA,
# pytest, hypothesis) and the project from this checkout (PYTHONPATH, no install), and writes one log:
#   1. the test suite's cuda cases (the `device` fixture's cuda parameter, tests/functional/cuda/test_kernels_cuda.py,
#      tests/runtime/test_cuda_graphs.py: 20 replayed steps equal 20 eager ones, ...),
#   2. parity of a float32 training step of Seq2SeqTransformer on cuda with torch on CUDA,
#   3. ms/step of the base and paper configurations: ours eager, ours as a CUDA graph, torch CUDA eager,
#   4. attention forward + backward at T = 1024, 4096, 16384 (benchmarks/attention.py --device cuda),
#   5. the reversal demo on cuda (default preset: time and held-out exact match).
# Each piece has a time cap inside one overall budget; a piece that is missing, fails or runs out of
# time is reported and the next one runs. The exit status is 0 only when every piece passed.
#
# Usage: bash scripts/gpu_check.sh [--dry-run] [OUTDIR]
#   OUTDIR (default runs/gpu_check) receives gpu_check.log and the demo's run directory.
#   --dry-run prints the plan (each command with its cap) and checks that its scripts exist and
#   parse their options, without a GPU; the test suite runs it (tests/scripts/test_gpu_scripts.py).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUTDIR=${1:-runs/gpu_check}
BUDGET=${GPU_CHECK_BUDGET:-350}          # seconds for everything (6 minutes minus a margin)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_check.log"
: > "$LOG"
START=$SECONDS
FAILED=()

log() { tee -a "$LOG"; }

# run NAME CAP COMMAND...: one piece, capped at min(CAP, what is left of the budget)
run() {
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET - (SECONDS - START)))
  local limit=$((cap < left ? cap : left))
  echo "== $name (cap ${limit}s): $*" | log
  if [ "$DRY" = 1 ]; then return 0; fi
  if [ "$limit" -lt 5 ]; then
    echo "-- $name: SKIPPED, the time budget is spent" | log
    FAILED+=("$name (no time left)")
    return 0
  fi
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | log
  local status=${PIPESTATUS[0]}
  if [ "$status" = 124 ] || [ "$status" = 137 ]; then
    echo "-- $name: TIMED OUT after ${limit}s" | log
    FAILED+=("$name (timed out)")
  elif [ "$status" != 0 ]; then
    echo "-- $name: FAILED (exit $status) after $((SECONDS - t0))s" | log
    FAILED+=("$name")
  else
    echo "-- $name: ok in $((SECONDS - t0))s" | log
  fi
}

# needs FILE...: the pieces' scripts exist (a helper's piece may not have landed yet)
needs() {
  for f in "$@"; do
    if [ ! -f "$f" ]; then echo "-- missing: $f" | log; FAILED+=("missing $f"); return 1; fi
  done
}

echo "== gpu_check $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(date -u +%Y-%m-%dT%H:%M:%SZ)" | log
if [ "$DRY" = 1 ]; then
  echo "-- dry run: the plan, and each script's options parsed" | log
  for script in scripts/gpu_parity.py benchmarks/train_step.py benchmarks/attention.py demos/reverse.py; do
    if needs "$script"; then
      $PY "$script" --help > /dev/null 2>&1 && echo "-- $script: parses its options" | log \
        || { echo "-- $script: --help FAILED" | log; FAILED+=("$script --help"); }
    fi
  done
  for option in "benchmarks/attention.py --device" "benchmarks/train_step.py --no-graphed" "demos/reverse.py --device"; do
    set -- $option
    $PY "$1" --help 2>/dev/null | grep -q -- "$2" && echo "-- $1 has $2" | log || echo "-- $1 lacks $2 (that piece would fail)" | log
  done
else
  run environment 30 $PY - <<'PY'
import cupy, numpy, torch
print("numpy", numpy.__version__, "cupy", cupy.__version__, "torch", torch.__version__,
      "GPUs", cupy.cuda.runtime.getDeviceCount(), "torch.cuda", torch.cuda.is_available())
print(cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
PY
  if [ ${#FAILED[@]} -gt 0 ]; then
    echo "gpu_check: no usable GPU stack (cupy, torch with CUDA): nothing else to run" | log
    echo "gpu_check status: 1 (failed: ${FAILED[*]})" | log
    exit 1
  fi
fi

run "1. test suite: cuda cases" 130 $PY -m pytest -q -p no:cacheprovider -k cuda tests
needs scripts/gpu_parity.py && run "2. training-step parity with torch CUDA (float32)" 35 $PY scripts/gpu_parity.py
for config in base paper; do
  needs benchmarks/train_step.py && run "3. ms/step $config: ours eager, ours graphed, torch CUDA eager" 40 \
    $PY benchmarks/train_step.py --config "$config" --device cuda --steps 10 --no-memory
done
needs benchmarks/attention.py && run "4. attention at T = 1024, 4096, 16384: flash vs torch SDPA" 50 \
  $PY benchmarks/attention.py --device cuda --lengths 1024 4096 16384 --impls ours-flash torch --repeats 3 --timeout 20
needs demos/reverse.py && run "5. reversal demo on cuda (default preset)" 45 \
  $PY demos/reverse.py --device cuda --out "$OUTDIR/reverse" --no-plots --quiet

echo "== elapsed $((SECONDS - START))s of a ${BUDGET}s budget" | log
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "gpu_check status: 1 (failed: ${FAILED[*]})" | log
  exit 1
fi
echo "gpu_check status: 0$([ "$DRY" = 1 ] && echo ' (dry run)')" | log
