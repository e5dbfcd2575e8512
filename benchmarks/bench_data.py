"""Data loading speed: parsing + validating a Sudoku-Extreme CSV, and opening a prepared cache.

The CSV has the real format (``source,question,answer,rating``, 81-character grids, '.' blanks,
integer tdoku ratings): its rows are the two real Sudoku-Extreme puzzles quoted in HRM's data
description, solved, then relabelled by random validity-preserving transforms
(``loopformer.tasks.prepare.sudoku_augment``) into ``rows`` distinct rows, written once under
``benchmarks/.cache/``.  Figures (targets from issue 13):

* ``data.csv_parse_rate``: rows/s of ``SudokuTask.load`` (bytes -> tokens -> every row validated), target
  >= 200,000 rows/s at 1M rows; the per-row path (Python's csv module and the task's row parser, as the
  reader runs for rows the vectorised path does not take) is timed on a 20,000-row slice beside it;
* ``data.cache_open_s``: seconds for ``load_hrm_folder`` to open the prepared HRM / TRM folder of the same
  rows (memory-mapped .npy, structure and vocabulary checked), target < 2 s.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Result

CACHE = Path(__file__).resolve().parent / ".cache" / "data"
REAL_PUZZLES = (
    "5...27..9..41......1..5.3...92.6.8...5......66..7..29.8...7...2.......8...9..36..",
    ".....8..1.6.9..2...4.52.9..4..6......9..45..6....924..9......7........3.35.2..6..",
)
SOURCES = ("puzzles0_kaggle", "puzzles1_unbiased", "puzzles2_17_clue", "puzzles7_serg_benchmark")


def write_real_format_csv(path: Path, rows: int, seed: int = 0) -> Path:
    """``rows`` distinct real-format Sudoku-Extreme rows (see the module docstring)."""
    from loopformer.tasks.prepare import sudoku_augment
    from loopformer.tasks.sudoku import SudokuTask

    task = SudokuTask(9)
    qs = np.stack([task.parse_grid(p) for p in REAL_PUZZLES])
    answers = np.stack([task.solve(q)[0] for q in qs])
    rng = np.random.default_rng(seed)
    chars = np.frombuffer(b"..123456789", dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        fh.write(b"source,question,answer,rating\n")
        for start in range(0, rows, 100_000):
            n = min(100_000, rows - start)
            pick = rng.integers(len(qs), size=n)
            q, a = sudoku_augment(qs[pick], answers[pick], (3, 3), rng)
            q_text, a_text = chars[q], chars[a]
            ratings = rng.integers(0, 300, size=n)
            sources = rng.integers(len(SOURCES), size=n)
            fh.write(b"".join(
                b"%s,%s,%s,%d\n" % (SOURCES[s].encode(), q_text[i].tobytes(), a_text[i].tobytes(), ratings[i])
                for i, s in enumerate(sources)
            ))  # fmt: skip
    tmp.replace(path)
    return path


def _time(fn, repeat: int) -> tuple[float, object, float]:
    """(best wall seconds, result, CPU seconds of that run)."""
    best, out, cpu = float("inf"), None, float("nan")
    for _ in range(repeat):
        start, cpu0 = time.perf_counter(), time.process_time()
        out = fn()
        wall = time.perf_counter() - start
        if wall < best:
            best, cpu = wall, time.process_time() - cpu0
    return best, out, cpu


def run(quick: bool) -> list[Result]:
    from loopformer.tasks.formats import load_hrm_folder, save_hrm_folder
    from loopformer.tasks.puzzle_csv import read_puzzle_csv
    from loopformer.tasks.sudoku import SudokuTask

    rows = 20_000 if quick else 1_000_000
    csv_path = CACHE / f"sudoku_extreme_format_{rows}.csv"
    if not csv_path.is_file():
        write_real_format_csv(csv_path, rows)
    task = SudokuTask(9)
    load_avg = [round(os.getloadavg()[0], 2)]
    seconds, ds, cpu_s = _time(lambda: task.load(csv_path), 1 if quick else 2)
    load_avg.append(round(os.getloadavg()[0], 2))
    assert len(ds) == rows  # type: ignore[arg-type]
    slice_rows = min(rows, 20_000)
    slice_path = CACHE / f"sudoku_extreme_format_slice_{slice_rows}.csv"
    with open(csv_path, "rb") as src, open(slice_path, "wb") as dst:
        dst.writelines(src.readline() for _ in range(slice_rows + 1))
    slow_s, _, _ = _time(lambda: read_puzzle_csv(slice_path, task._parse_csv_row, task.seq_len, {}), 1)
    rate = rows / seconds
    folder = CACHE / f"prepared_{rows}"
    if not (folder / "train" / "dataset.json").is_file():
        save_hrm_folder(ds, folder, "train", vocab_size=task.vocab_size)  # type: ignore[arg-type]
    del ds
    open_s, opened, open_cpu = _time(lambda: load_hrm_folder(folder, "train", task=task), 3)
    assert len(opened) == rows  # type: ignore[arg-type]
    load_avg.append(round(os.getloadavg()[0], 2))
    size_mb = round(csv_path.stat().st_size / 2**20, 1)
    return [
        Result("data", "data.csv_parse_rate", rate, "rows/s", ">= 200000", (rate >= 200_000) if not quick else None,
               "" if quick or rate >= 200_000 else (
                   f"below target in wall time at load average {load_avg[-1]} on {os.cpu_count()} cores; "
                   f"{rows / cpu_s:,.0f} rows per CPU-second"),
               {"rows": rows, "file_MiB": size_mb, "seconds": round(seconds, 3), "cpu_seconds": round(cpu_s, 3),
                "rows_per_cpu_second": round(rows / cpu_s, 1),
                "per_row_path_rows_per_s": round(slice_rows / slow_s, 1),
                "speedup_vs_per_row_path": round(rate / (slice_rows / slow_s), 1),
                "load_average_1min": load_avg, "what": "SudokuTask.load: parse + validate every row, best of runs"}),
        Result("data", "data.cache_open_s", open_s, "s", "< 2", (open_s < 2) if not quick else None,
               "" if quick or open_s < 2 else (
                   f"above target in wall time at load average {load_avg[-1]}; {open_cpu:.2f} CPU-seconds"),
               {"rows": rows, "cpu_seconds": round(open_cpu, 3), "what": "load_hrm_folder(prepared folder, task=sudoku): mmap + checks + int64 arrays",
                "load_average_1min": load_avg}),
    ]  # fmt: skip
