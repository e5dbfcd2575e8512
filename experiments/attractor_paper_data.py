"""Prepare the paper-scale puzzle training files from a user's own downloads (HRM's dataset builders, arXiv 2506.21734).

The paper recipes (``recipes/paper_sudoku_extreme_*.yaml``, ``recipes/paper_maze_hard_*.yaml``) read
Sudoku-Extreme / Maze-Hard CSV files (``source,question,answer,rating``) through ``data.train_path`` /
``data.eval_path``. The trainer loads a file as it is: it has no option to subsample or augment, so the
standard "1k x 1000 augmentations" training set is written here, once, with the task's own validated
loader and augmentations:

- ``sudoku``: a seeded random subset of ``--subset`` rows of the full Sudoku-Extreme ``train.csv``
  (3.8M rows; read with the csv module, only the chosen rows are validated by ``SudokuTask.load``),
  then ``SudokuTask.augment_dataset`` (digit permutation, band / row and stack / column shuffles,
  transpose) with ``--augment`` copies of every puzzle, written by ``SudokuTask.save``;
- ``maze``: ``MazeTask.load`` (every row validated as a shortest path), plus ``--augment`` random dihedral
  copies of every maze (the same transform on question and answer), written by ``MazeTask.save``.

Usage:
    python experiments/attractor_paper_data.py sudoku --csv data/sudoku-extreme/train.csv \
        --out data/sudoku-extreme-1k-aug-1000.csv --subset 1000 --augment 1000 --seed 0
    python experiments/attractor_paper_data.py maze --csv data/maze-30x30-hard-1k/train.csv \
        --out data/maze-hard-train-aug8.csv --augment 7 --seed 0
"""

from __future__ import annotations

import argparse
import csv
import tempfile
from pathlib import Path

import numpy as np

from loopformer.tasks.base import TaskDataError, TokenDataset
from loopformer.tasks.maze import MazeTask
from loopformer.tasks.sudoku import SudokuTask


def sudoku_subset_augmented(csv_path: Path, out: Path, subset: int, augment: int, seed: int) -> TokenDataset:
    """``subset`` seeded rows of a Sudoku-Extreme CSV + ``augment`` augmented copies each, written to ``out``."""
    with open(csv_path, newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None:
            raise TaskDataError(f"{csv_path}: empty file")
        rows = list(reader)
    rows = [r for r in rows if r]
    if subset > len(rows):
        raise TaskDataError(f"{csv_path}: {len(rows)} rows, fewer than --subset {subset}")
    chosen = np.sort(np.random.default_rng(seed).choice(len(rows), size=subset, replace=False)) if subset else None
    picked = [rows[i] for i in chosen] if chosen is not None else rows
    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / "subset.csv"
        with open(part, "w", newline="") as fh:
            writer = csv.writer(fh, lineterminator="\n")
            writer.writerow(header)
            writer.writerows(picked)
        task = SudokuTask(**SudokuTask.infer_options(part))
        base = task.load(part)
    data = task.augment_dataset(base, augment, seed) if augment else base
    out.parent.mkdir(parents=True, exist_ok=True)
    task.save(data, out)
    return data


def maze_augmented(csv_path: Path, out: Path, augment: int, seed: int) -> TokenDataset:
    """A Maze-Hard CSV followed by ``augment`` random dihedral copies of every maze, written to ``out``."""
    task = MazeTask(**MazeTask.infer_options(csv_path))
    base = task.load(csv_path)
    rng = np.random.default_rng(seed)
    inputs, labels = [base.inputs], [base.labels]
    for _ in range(augment):
        transforms = rng.integers(8, size=len(base))
        inputs.append(np.stack([task.apply_transform(base.inputs[i], int(t)) for i, t in enumerate(transforms)]))
        labels.append(np.stack([task.apply_transform(base.labels[i], int(t)) for i, t in enumerate(transforms)]))
    meta = {k: v for k, v in base.meta.items() if k != "source"}
    data = TokenDataset(np.concatenate(inputs), np.concatenate(labels), np.tile(base.difficulty, augment + 1),
                        None, meta)
    out.parent.mkdir(parents=True, exist_ok=True)
    task.save(data, out)
    return data


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="task", required=True)
    s = sub.add_parser("sudoku", help="Sudoku-Extreme subset x augmentations")
    s.add_argument("--csv", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--subset", type=int, default=1000, help="rows to keep (0 = all)")
    s.add_argument("--augment", type=int, default=1000, help="augmented copies per puzzle")
    s.add_argument("--seed", type=int, default=0)
    m = sub.add_parser("maze", help="Maze-Hard + dihedral copies")
    m.add_argument("--csv", type=Path, required=True)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--augment", type=int, default=7, help="dihedral copies per maze")
    m.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.task == "sudoku":
        data = sudoku_subset_augmented(args.csv, args.out, args.subset, args.augment, args.seed)
    else:
        data = maze_augmented(args.csv, args.out, args.augment, args.seed)
    print(f"wrote {len(data)} rows to {args.out}")


if __name__ == "__main__":
    main()
