"""Generation speed of the grid puzzles: Sudoku (unique solutions) and mazes.

    python -m benchmarks --only generation     # the results.json row (10,000 9x9 Sudokus)
    python benchmarks/bench_generation.py [--sudoku-count 10000] [--maze-count 1000] [--out FILE.json]

Targets: 10,000 unique 9x9 Sudokus in at most 30 s on the 2-core development machine (issue 15; the
compiled bitmask solver of loopformer/tasks/sudoku_solver.py), 1,000 30x30 mazes in under a minute.  Every Sudoku counted here is a genuinely new puzzle (a fresh
random full grid, clues removed while the solution stays unique), verified distinct; no augmentation
is used.  Wall time depends on what else runs on the machine, so the CPU seconds of the generating
processes (and the load average) are reported too.  Prints one JSON object and writes it to --out (default benchmarks/generation.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from loopformer.tasks.maze import MazeTask
from loopformer.tasks.sudoku import SudokuTask

SUDOKU_TARGET_S = 30.0


def bench_sudoku(count: int, size: int, workers: int, verify: int) -> dict:
    task = SudokuTask(size)
    cpu0 = os.times()
    start = time.perf_counter()
    ds = task.generate(count, seed=0, workers=workers)
    seconds = time.perf_counter() - start
    cpu1 = os.times()
    # CPU seconds of this process and its (joined) pool workers: the contention-free cost
    cpu = sum(cpu1[i] - cpu0[i] for i in range(4))
    distinct = len({row.tobytes() for row in ds.inputs})
    sample = range(min(verify, count))
    unique = sum(task.count_solutions(ds.inputs[i], 2) == 1 for i in sample)
    valid = sum(task.check(ds.inputs[i], ds.labels[i]) for i in sample)
    backtracks = np.asarray(ds.meta["backtracks"])
    return {
        "task": f"sudoku{size}",
        "count": count,
        "workers": workers,
        "seconds": round(seconds, 2),
        "per_second": round(count / seconds, 1),
        "cpu_seconds": round(cpu, 2),
        "cpu_ms_per_puzzle": round(1000 * cpu / count, 2),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "distinct_fraction": distinct / count,
        "verified_unique": f"{unique}/{len(sample)}",
        "verified_valid": f"{valid}/{len(sample)}",
        "blanks_mean": round(float(ds.difficulty.mean()), 2),
        "blanks_min": int(ds.difficulty.min()),
        "blanks_max": int(ds.difficulty.max()),
        "backtracks_mean": round(float(backtracks.mean()), 2),
        "backtracks_max": int(backtracks.max()),
        "share_needing_search": round(float((backtracks > 0).mean()), 3),
    }


def bench_maze(count: int, size: int) -> dict:
    task = MazeTask(size)
    cpu0 = time.process_time()
    start = time.perf_counter()
    ds = task.generate(count, seed=0)
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    valid = sum(task.check(x, y) for x, y in zip(ds.inputs, ds.labels))
    return {
        "task": f"maze{size}",
        "count": count,
        "seconds": round(seconds, 2),
        "per_second": round(count / seconds, 1),
        "cpu_seconds": round(cpu, 2),
        "distinct_fraction": len({row.tobytes() for row in ds.inputs}) / count,
        "verified_valid": f"{valid}/{count}",
        "path_length_mean": round(float(ds.difficulty.mean()), 1),
        "path_length_min": int(ds.difficulty.min()),
        "path_length_max": int(ds.difficulty.max()),
    }


def run(quick: bool = False) -> list:
    """The ``python -m benchmarks`` row: wall seconds for 10,000 unique 9x9 Sudokus (200 when quick).

    The kernels are compiled (or loaded from Numba's cache) before the clock starts; the compile time
    is in the details."""
    from benchmarks.common import Result  # here: the file also runs as a plain script
    from loopformer.tasks.sudoku_solver import warm_up

    start = time.perf_counter()
    warm_up()
    compile_s = time.perf_counter() - start
    count = 200 if quick else 10000
    stats = bench_sudoku(count, 9, os.cpu_count() or 1, 100 if quick else 1000)
    ok = stats["verified_unique"].split("/")[0] == stats["verified_unique"].split("/")[1]
    ok = ok and stats["distinct_fraction"] == 1.0
    met = None if quick else bool(ok and stats["seconds"] <= SUDOKU_TARGET_S)
    reason = f"{count} puzzles, {stats['workers']} worker processes, {stats['cpu_ms_per_puzzle']} CPU ms each"
    if not ok:
        reason = f"puzzles not all distinct / unique: {stats['verified_unique']}"
    return [
        Result(
            benchmark="generation",
            name="generation.sudoku9",
            value=stats["seconds"],
            unit="s",
            target=None if quick else f"<= {SUDOKU_TARGET_S:g} s for 10,000 unique 9x9",
            met=met,
            reason=reason,
            details=dict(stats, compile_or_cache_load_s=round(compile_s, 2)),
        )
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sudoku-count", type=int, default=10000)
    parser.add_argument("--sudoku-size", type=int, default=9)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--verify", type=int, default=1000, help="Sudokus re-checked for uniqueness.")
    parser.add_argument("--maze-count", type=int, default=1000)
    parser.add_argument("--maze-size", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("generation.json"))
    args = parser.parse_args()
    results = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "processor": platform.processor(),
        },
        "maze": bench_maze(args.maze_count, args.maze_size),
        "sudoku": bench_sudoku(args.sudoku_count, args.sudoku_size, args.workers, args.verify),
    }
    text = json.dumps(results, indent=2)
    print(text)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
