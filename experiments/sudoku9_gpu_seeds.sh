#!/usr/bin/env bash
# The 9x9 FPRM vs TRM head-to-head's seeds on one GPU (issue 32; docs/results.md, "9x9 Sudoku on a CPU").
#
#   bash experiments/sudoku9_gpu_seeds.sh [SEEDS] [RUNS] [DEADLINE_S]      (defaults: 2,3  runs/sudoku9  0 = none)
#
# Trains fprm_authors and trm_authors for every seed in SEEDS to their 60-minute budgets (the step counts of
# experiments/sudoku9_cpu.py's probe: FPRM 754 / 1,508 / 3,016 steps, TRM 402 / 804 / 1,608; budgets are step
# counts, so a GPU run spends the same training FLOPs as the CPU runs), one process per run, all on one GPU, and
# scores each checkpoint as it appears (`--phase eval --device cuda --watch`), one scoring process per seed.
# Everything runs in float32 with TF32 off (matrix products and cuDNN convolutions), as the CPU seeds ran:
# `bf16=false`, and PyTorch's cuDNN TF32 default switched off before the trainer starts.
#
# The training code is the pinned commit the CPU seeds were trained with (01ade7d), unpacked beside the repo
# once on a clone:  mkdir -p .h2h/pinned && git archive 01ade7d loopformer experiments | tar -x -C .h2h/pinned
# (PINNED=DIR points elsewhere). Scoring uses this checkout (experiments/sudoku9_h2h.py), as for the CPU seeds.
# DEADLINE_S > 0: each training gets SIGTERM at DEADLINE_S seconds (the trainer checkpoints and exits; a rerun
# continues it bit-identically, `--resume`) and scoring stops watching 60 s later. Logs: RUNS/seed<N>/<model>.log.
# MODELS=a,b picks the models (default fprm_authors,trm_authors); MODELS=fprm_authors_jac trains and scores FPRM
# with loopformer's contraction term (issue 32, item 5) on the given seeds, e.g. `MODELS=fprm_authors_jac bash
# experiments/sudoku9_gpu_seeds.sh 1`. DEVICE=cpu runs the same on the CPU (with QUICK=1: a dry run at tiny
# size; give RUNS a probe.json made with --phase probe --quick first). Measured (2026-12-04, one H200, four runs
# sharing it, float32): 0.088 s per TRM step and 0.106 s per FPRM step; scoring one checkpoint took 48 s (FPRM)
# and 12-19 s (TRM).
set -uo pipefail
cd "$(dirname "$0")/.."
seeds="${1:-2,3}"
runs="${2:-runs/sudoku9}"
deadline="${3:-0}"
device="${DEVICE:-cuda}"
pinned="${PINNED:-.h2h/pinned}"
models="${MODELS:-fprm_authors,trm_authors}"
PY="${PYTHON:-python3}"
quick=()
[ "${QUICK:-0}" = 1 ] && quick=(--quick)
if [ ! -f "$pinned/experiments/sudoku9_cpu.py" ]; then
    echo "sudoku9_gpu_seeds: no pinned training code in $pinned (see the header: git archive 01ade7d ...)" >&2
    exit 2
fi
mkdir -p "$runs"
runs="$(cd "$runs" && pwd)"
repo="$(pwd)"
# the pinned experiment script run as __main__ after switching TF32 off (it never touches these flags), with the
# config builder its fprm_common.make_config calls given device=$device last (make_config forces device=cpu after
# the overrides; the last value of a key wins)
strict='import os, runpy, sys, torch
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
sys.path.insert(0, "experiments")
import fprm_common
build = fprm_common.build_config
fprm_common.build_config = lambda raw, overrides: build(raw, [*overrides, "device=" + os.environ["H2H_DEVICE"]])
sys.argv = ["experiments/sudoku9_cpu.py", *sys.argv[1:]]
runpy.run_path("experiments/sudoku9_cpu.py", run_name="__main__")'
limit=()
[ "$deadline" -gt 0 ] && limit=(timeout -s TERM -k 60 "$deadline")
trainers=()
for s in ${seeds//,/ }; do
    for m in ${models//,/ }; do
        mkdir -p "$runs/seed$s"
        (
            cd "$pinned" && H2H_DEVICE="$device" PYTHONPATH="$PWD" OMP_NUM_THREADS=1 "${limit[@]}" "$PY" -c "$strict" --phase train \
                --only "$m" --seeds "$s" --runs "$runs" --resume "${quick[@]}" \
                --set bf16=false
        ) >"$runs/seed$s/$m.log" 2>&1 &
        trainers+=($!)
    done
done
watch=$(( deadline > 0 ? deadline + 60 : 86400 ))
scorers=()
for s in ${seeds//,/ }; do
    PYTHONPATH="$repo" OMP_NUM_THREADS=1 "$PY" experiments/sudoku9_cpu.py --phase eval --seeds "$s" \
        --only "$models" \
        --device "$device" --watch "$watch" --runs "$runs" --out "$runs/assembled-seed$s" "${quick[@]}" \
        >"$runs/seed$s/eval.log" 2>&1 &
    scorers+=($!)
done
failed=0
for p in "${trainers[@]}" "${scorers[@]}"; do
    wait "$p" || failed=$((failed + 1))
done
for s in ${seeds//,/ }; do tail -n 3 "$runs/seed$s"/*.log; done
exit "$failed"
