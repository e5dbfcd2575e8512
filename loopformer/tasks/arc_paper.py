"""The ARC protocol of TRM and HRM: their training set, their canvas crop and their vote.

- ``load_subsets(source, subsets)``: TRM's ``dataset/build_arc_dataset.py`` reads
  ``{input_file_prefix}_{subset}_challenges.json`` (+ ``_solutions.json``) for each subset, e.g. the
  files of its ``kaggle/combined/`` folder with subsets ``training evaluation concept`` (ARC-AGI-1 +
  ConceptARC); HRM's reads folders (``ARC-AGI/data/{training,evaluation}``, ``ConceptARC/corpus``).
  A subset here is, in this order: a Kaggle file pair ``{source}_{subset}_challenges.json``, a
  folder ``{source}/{subset}``, or a folder path itself; folders are read recursively (ConceptARC
  keeps one sub-folder per concept). Task ids are made unique by the subset name when two training
  subsets share one; a task of the held-out subset that another subset holds too is refused. Both reference builders send the *demonstration* pairs of every task to training, the
  *test* pairs of the held-out subset (``evaluation``) to the test set and the test pairs of every
  other subset to training; ``ArcTask(subsets=..., test_subset=...)`` does the same.
- ``crop_grid(tokens)``: the evaluators' ``_crop`` (TRM ``evaluators/arc.py``, HRM ``arc_eval.ipynb``):
  the largest top-left rectangle of colour tokens (scanning rows, each row's run of colours capped by
  the previous rows'), so a prediction with junk beyond its EOS frame still yields a grid. An empty
  rectangle gives a 0 x 0 grid.
- ``rank_votes``: TRM's vote: distinct grids ranked by how many augmented versions predicted them,
  ties broken by the mean ``sigmoid(q_halt)`` of those versions (then by first appearance).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from loopformer.tasks.base import TaskDataError

MAX_GRID, COLOUR_OFFSET, NUM_COLOURS = 30, 2, 10


def crop_grid(tokens: np.ndarray) -> np.ndarray:
    """The evaluators' crop of a [900] canvas: the maximum-area top-left block of colour tokens."""
    canvas = np.asarray(tokens).reshape(MAX_GRID, MAX_GRID)
    colour = (canvas >= COLOUR_OFFSET) & (canvas < COLOUR_OFFSET + NUM_COLOURS)
    best, size, width = 0, (0, 0), MAX_GRID
    for r in range(MAX_GRID):
        run = np.flatnonzero(~colour[r, :width])
        width = int(run[0]) if run.size else width
        if (r + 1) * width > best:
            best, size = (r + 1) * width, (r + 1, width)
    return (canvas[: size[0], : size[1]] - COLOUR_OFFSET).astype(np.int64)


def rank_votes(
    predictions: Iterable[np.ndarray | None], q_values: Iterable[float] | None = None
) -> list[tuple[np.ndarray, int, float]]:
    """(grid, votes, mean q) for distinct grids, most votes first, then highest mean q, then first seen."""
    table: dict[tuple, list] = {}
    qs = iter(q_values) if q_values is not None else None
    for grid in predictions:
        q = float(next(qs)) if qs is not None else 0.0
        if grid is None:
            continue
        grid = np.asarray(grid)
        key = (grid.shape, grid.tobytes())
        if key in table:
            table[key][1] += 1
            table[key][2] += q
        else:
            table[key] = [grid, 1, q, len(table)]
    ranked = sorted(table.values(), key=lambda e: (-e[1], -(e[2] / e[1]), e[3]))
    return [(grid, n, total / n) for grid, n, total, _ in ranked]


def _subset_files(source: str, subset: str) -> tuple[str, list[tuple[str, dict, list | None]]]:
    challenges = Path(f"{source}_{subset}_challenges.json")
    if challenges.is_file():
        tasks = json.loads(challenges.read_text())
        sols_path = Path(f"{source}_{subset}_solutions.json")
        sols = json.loads(sols_path.read_text()) if sols_path.is_file() else {}
        if not isinstance(tasks, dict):
            raise TaskDataError(f"{challenges}: expected an object mapping task id -> task")
        return str(challenges), [(tid, tasks[tid], sols.get(tid)) for tid in sorted(tasks)]
    for folder in (Path(source) / subset, Path(subset)):
        if folder.is_dir():
            files = sorted(folder.rglob("*.json"))
            if not files:
                raise TaskDataError(f"{folder}: no ARC task files (*.json)")
            out = []
            for f in files:
                try:
                    out.append((f.stem, json.loads(f.read_text()), None))
                except json.JSONDecodeError as err:
                    raise TaskDataError(f"{f}: not valid JSON ({err})") from err
            return str(folder), out
    raise TaskDataError(
        f"ARC subset {subset!r}: neither {challenges} nor a folder {Path(source) / subset} or {subset} exists"
    )


def load_subsets(
    source: str, subsets: Sequence[str], test_subset: str | None = None
) -> list[tuple[str, str, dict, list | None]]:
    """(subset, task id, task JSON, solutions or None) for every task of every subset, ids made unique.
    A task of ``test_subset`` (the held-out one) whose id another subset holds too is refused: its test
    pairs would be trained on through the other copy and scored as held out."""
    rows: list[tuple[str, str, dict, list | None]] = []
    seen: set[str] = set()
    first: dict[str, str] = {}  # task id -> the subset that gave it first
    for subset in subsets:
        where, tasks = _subset_files(source, subset)
        if not tasks:
            raise TaskDataError(f"{where}: no tasks")
        for tid, task, sols in tasks:
            other = first.setdefault(tid, subset)
            if other != subset and test_subset in (subset, other):
                raise TaskDataError(
                    f"ARC task {tid} is in subset {other!r} and in subset {subset!r}; the held-out subset "
                    f"({test_subset!r}) must not share a task with a training subset (its test outputs would be "
                    f"trained on): remove one copy"
                )
            uid = tid if tid not in seen else f"{subset}/{tid}"
            seen.add(uid)
            rows.append((subset, uid, task, sols))
    return rows
