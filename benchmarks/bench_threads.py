"""CPU threads for the CPU recipes (issue 25): seconds per training step at 1 thread vs 2 threads.

The same short training (``loopformer train RECIPE train.steps=N``, no periodic evaluation) of the default
job (``default``: FPRM on 4x4 Sudoku) and of ``sudoku4_trm`` runs in-process at ``train.threads=1`` and
``train.threads=2``, interleaved (the order rotates every round, as ``benchmarks.common.side_by_side``
does; rounds stop once ``BUDGET_S`` is spent). Seconds per step come from the run's own ``metrics.jsonl``
clock between the second step and the last (the first step's one-off set-up and the final evaluation left out). The figure is the median over
rounds of (s/step at 2 threads) / (s/step at 1 thread): above 1, two threads are slower. The load average
is recorded with each row: the figure depends on how busy the machine is (a loaded 2-core machine was
where issue 25 saw 3x-10x). Rows end in ``.idle`` (1-minute load below ``IDLE_LOAD`` per CPU when the
benchmark starts) or ``.loaded``, and a rerun replaces only the rows of its own state, so both stay in results.json.

    python -m benchmarks --only threads
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import Result

RECIPES = ("default", "sudoku4_trm")
# rows are named by the machine's state (``.idle`` / ``.loaded``) and a rerun replaces only its own
MERGE_BY_NAME = True
IDLE_LOAD = 0.5  # 1-minute load average per logical CPU below which, at the start, the machine is "idle"
THREADS = (1, 2)


def seconds_per_step(
    recipe: str, threads: int, steps: int, folder: Path, extra: tuple[str, ...] = ()
) -> float:
    """Median seconds per optimiser step (steps 2..N) of ``recipe`` trained at ``threads`` CPU threads."""
    from loopformer.config import build_config, read_recipe
    from loopformer.train import Trainer

    out = folder / f"{recipe}-{threads}-{len(list(folder.iterdir()))}"
    raw = read_recipe(_recipe_path(recipe))
    raw.pop("run", None)  # the `loopformer run` section of the default job: the looped model's training only
    cfg = build_config(
        raw,
        [f"out_dir={out}", "device=cpu", f"train.steps={steps}", f"train.threads={threads}",
         "train.eval_every=0", "train.log_every=1", "train.progress=false", "train.checkpoint_every=0",
         "data.eval_size=8", *extra],
    )  # fmt: skip
    Trainer(cfg).fit()
    times = [json.loads(line)["time"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if line.strip() and "time" in json.loads(line)]  # fmt: skip
    deltas = [b - a for a, b in zip(times[1:], times[2:])]
    return statistics.median(deltas)


def _recipe_path(name: str) -> Path:
    from loopformer.config import find_recipe

    return find_recipe(name)


QUICK = ("train.batch_size=4", "data.train_size=16")  # the smoke test's size: tensors too small to thread
BUDGET_S = 1200  # no new round of a recipe starts after this many seconds (at least one round always runs)


def run(quick: bool) -> list[Result]:
    # 8 steps: on a loaded 2-core machine one two-thread step took ~60 s (one thread: ~1.5 s)
    steps, rounds = (4, 1) if quick else (8, 3)
    load_before = os.getloadavg()
    threads_before = torch.get_num_threads()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for recipe in RECIPES:
            per: dict[int, list[float]] = {t: [] for t in THREADS}
            started = time.perf_counter()
            for r in range(rounds):
                if r and time.perf_counter() - started > BUDGET_S / len(RECIPES):
                    break
                order = THREADS[r % 2 :] + THREADS[: r % 2]
                for t in order:
                    # quick (the smoke test): the machinery only, both sides at 1 thread; on a loaded machine
                    # a 2-thread run took minutes even at the smoke test's size
                    threads = 1 if quick else t
                    per[t].append(seconds_per_step(recipe, threads, steps, folder, QUICK if quick else ()))
            ratio = statistics.median(b / a for a, b in zip(per[1], per[2]))
            cpus = os.cpu_count() or 1
            idle = load_before[0] < IDLE_LOAD * cpus  # before only: the benchmark's own threads load it after
            state = "idle" if idle else "loaded"
            results.append(
                Result(
                    "threads",
                    f"threads.{recipe}.s_per_step_2_over_1.{state}",
                    ratio,
                    "x",
                    None,
                    None,
                    f"s/step at 2 threads / at 1 thread (above 1: two threads slower); {state} machine "
                    f"(1-minute load {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after, {cpus} CPUs)",
                    {
                        "what": f"{steps}-step training of recipe {recipe!r}, s/step from its metrics.jsonl clock",
                        "s_per_step": {str(t): [round(x, 4) for x in v] for t, v in per.items()},
                        "median_s_per_step": {str(t): round(statistics.median(v), 4) for t, v in per.items()},
                        "rounds": len(per[1]),
                        "load_average_before": [round(x, 2) for x in load_before],
                        "load_average_after": [round(x, 2) for x in os.getloadavg()],
                        "logical_cpus": os.cpu_count(),
                    },
                )
            )
    torch.set_num_threads(threads_before)
    return results
