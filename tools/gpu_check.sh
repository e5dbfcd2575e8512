#!/usr/bin/env bash
# GPU check: does loopformer run, compile and train fast on this GPU? (issue 33)
#
#   bash tools/gpu_check.sh [--full] [LOG_DIR]     (default LOG_DIR: runs/gpu_check/<UTC time>)
#   bash tools/gpu_check.sh --help
#
# What it runs, in order, each part under its own time limit (budget: 8 minutes on a cold machine for the
# default check; the parts' limits add up to 480 s):
#   device      nvidia-smi and the torch / CUDA versions                                          (10 s)
#   models      the CUDA model suite's smoke: one case per model family (forward + backward on CUDA
#               against the CPU in float32, under bf16 autocast, with the looped body compiled)  (110 s)
#   train       one compile smoke per model family and training mode: a few trainer steps on CUDA
#               against the CPU, then bf16 with the whole training step compiled (the compiled
#               run for one training mode per family; all of them with --full)                 (200 s)
#   cli         loopformer eval / solve / run with --device cuda, the FPRM reference parity      (40 s)
#   benchmark   benchmarks/gpu.py: the real Trainer step of paper_sudoku_extreme_fprm with the
#               whole step compiled, bf16: the compile time (printed when the first step ends),
#               50 timed steps' tokens/s and MFU, peak memory beside --plan's estimate; each
#               phase printed as it ends, its JSON within --max-seconds 110 (three recipes and
#               300 timed steps each with --full)                                              (120 s)
# --full runs the whole CUDA grid (every family x solver x halting rule x gradient mode, every family x
# training mode compiled) and the benchmark's three recipes: about 30-40 minutes.
#
# Written as it goes: LOG_DIR/<part>.log (each test's start and end time-stamped: tools/pytest_timestamps.py),
# LOG_DIR/tests.jsonl (one line per finished test), LOG_DIR/summary.json (every part's start, end, seconds and
# exit status, rewritten after each part: a time limit still leaves a summary of how far it got), gpu.json
# (the benchmark). The exit status is the number of failed parts (0: all passed).
# Without CUDA (no nvidia-smi, or torch.cuda.is_available() false) it prints one line and exits 2 before
# anything runs.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"

full=0
LOG_DIR=""
for arg in "$@"; do
    case "$arg" in
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        --full) full=1 ;;
        *) LOG_DIR="$arg" ;;
    esac
done

if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: no CUDA device (nvidia-smi not found); nothing was run" >&2
    exit 2
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    echo "gpu_check: no CUDA device (torch.cuda.is_available() is false for $PY); nothing was run" >&2
    exit 2
fi

LOG_DIR="${LOG_DIR:-runs/gpu_check/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$LOG_DIR"
export GPU_CHECK_TESTS="$LOG_DIR/tests.jsonl"
export LOOPFORMER_GPU_CHECK=$([ "$full" -eq 1 ] && echo full || echo smoke)
failed=0
parts=""
stamp() { date -u +%Y-%m-%dT%H:%M:%SZ; }
part() {  # part NAME TIMEOUT_S COMMAND...
    local name="$1" limit="$2"; shift 2
    local start=$SECONDS began rc
    began=$(stamp)
    echo "[$began] start $name (limit $limit s)" | tee -a "$LOG_DIR/summary.txt"
    timeout "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1
    rc=$?
    local ended seconds=$((SECONDS - start))
    ended=$(stamp)
    echo "[$ended] end $name: exit $rc in $seconds s ($LOG_DIR/$name.log)$([ "$rc" -eq 124 ] && echo ' TIME LIMIT')" \
        | tee -a "$LOG_DIR/summary.txt"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
    parts="$parts${parts:+,}{\"part\": \"$name\", \"start\": \"$began\", \"end\": \"$ended\", \"seconds\": $seconds, \"limit\": $limit, \"exit\": $rc}"
    printf '{"mode": "%s", "log_dir": "%s", "failed": %d, "parts": [%s]}\n' \
        "$LOOPFORMER_GPU_CHECK" "$LOG_DIR" "$failed" "$parts" >"$LOG_DIR/summary.json"
}
PYTEST=("$PY" -m pytest -m cuda -q -s -p no:cacheprovider -p tools.pytest_timestamps)

if [ "$full" -eq 1 ]; then
    models=(tests/test_cuda_models.py); lim_models=1200; lim_train=1200; lim_cli=60; lim_bench=600
    bench=(--steps 300)
else
    models=(tests/test_cuda_models.py -k smoke); lim_models=110; lim_train=200; lim_cli=40; lim_bench=120
    bench=(--steps 50 --recipes paper_sudoku_extreme_fprm)
fi
part device 10 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; \
    $PY -c \"import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)\""
part models "$lim_models" "${PYTEST[@]}" "${models[@]}"
part train "$lim_train" "${PYTEST[@]}" tests/test_cuda_train.py -k test_trainer_steps_on_cuda_match_cpu
part cli "$lim_cli" "${PYTEST[@]}" tests/test_cuda_train.py -k "not test_trainer_steps_on_cuda_match_cpu"
# its own budget 10 s under the part's limit: the JSON of what it measured is printed even if a compile runs long
part benchmark "$lim_bench" "$PY" benchmarks/gpu.py "${bench[@]}" --warmup 5 --max-seconds $((lim_bench - 10)) \
    --out "$LOG_DIR/gpu.json"
cat "$LOG_DIR/device.log" 2>/dev/null
exit "$failed"
