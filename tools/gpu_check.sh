#!/usr/bin/env bash
# GPU check: the CUDA test suite (which holds the FPRM reference parity on CUDA,
# tests/test_cuda_train.py::test_fprm_reference_parity_on_cuda) and the GPU benchmark, in one go.
#
#   bash tools/gpu_check.sh [LOG_DIR]        (default LOG_DIR: runs/gpu_check/<UTC time>)
#
# Budget: under 8 minutes on one H200 (pytest -m cuda ~5 min with compilation, benchmarks/gpu.py with
# 10 timed steps ~1 min). Each part's output goes to LOG_DIR/<part>.log and a summary line per part to
# LOG_DIR/summary.txt; the exit status is the number of failed parts (0: all passed).
# Without CUDA (no nvidia-smi, or torch.cuda.is_available() false) it prints one line and exits 2
# before anything runs.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: no CUDA device (nvidia-smi not found); nothing was run" >&2
    exit 2
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    echo "gpu_check: no CUDA device (torch.cuda.is_available() is false for $PY); nothing was run" >&2
    exit 2
fi

LOG_DIR="${1:-runs/gpu_check/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$LOG_DIR"
failed=0
part() {  # part NAME TIMEOUT_S COMMAND...
    local name="$1" limit="$2"; shift 2
    local start=$SECONDS rc
    timeout "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1
    rc=$?
    local line="$name: exit $rc in $((SECONDS - start)) s ($LOG_DIR/$name.log)"
    echo "$line" | tee -a "$LOG_DIR/summary.txt"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$LOG_DIR/device.txt" 2>&1
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" >>"$LOG_DIR/device.txt" 2>&1
part cuda_suite 330 "$PY" -m pytest -m cuda -q -p no:cacheprovider tests/test_cuda_models.py tests/test_cuda_train.py
part benchmark 120 "$PY" benchmarks/gpu.py --steps 10 --warmup 3 --out "$LOG_DIR/gpu.json"
cat "$LOG_DIR/device.txt"
exit "$failed"
