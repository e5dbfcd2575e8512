"""ARC-AGI augmentation (dihedral transform x colour permutation), voting and pass@k scoring.

Part of :mod:`loopformer.tasks.arc` (which re-exports every public name here); its module
docstring states the scoring convention.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from loopformer.tasks.arc_format import NUM_COLOURS
from loopformer.tasks.arc_paper import rank_votes
from loopformer.tasks.base import TaskDataError

# ----------------------------------------------------------------------------- augmentation

DIHEDRAL_NAMES = (
    "identity",
    "rot90",
    "rot180",
    "rot270",
    "transpose",
    "flip_lr",
    "flip_ud",
    "anti_transpose",
)
_DIHEDRAL_INVERSE = (0, 3, 2, 1, 4, 5, 6, 7)


def dihedral(grid: np.ndarray, k: int) -> np.ndarray:
    """The k-th of the 8 symmetries of the square (see DIHEDRAL_NAMES; rotations are counter-clockwise)."""
    grid = np.asarray(grid)
    if k == 0:
        return grid.copy()
    if k in (1, 2, 3):
        return np.rot90(grid, k).copy()
    if k == 4:
        return grid.T.copy()
    if k == 5:
        return grid[:, ::-1].copy()
    if k == 6:
        return grid[::-1, :].copy()
    if k == 7:
        return np.rot90(grid, 2).T.copy()
    raise TaskDataError(f"dihedral transform index must be 0..7, got {k}")


def inverse_dihedral(grid: np.ndarray, k: int) -> np.ndarray:
    return dihedral(grid, _DIHEDRAL_INVERSE[k])


@dataclass(frozen=True)
class Augmentation:
    """A dihedral transform and a colour permutation ``colours`` (old colour c -> colours[c], colours[0] = 0)."""

    dihedral: int = 0
    colours: tuple[int, ...] = tuple(range(NUM_COLOURS))

    def __post_init__(self) -> None:
        if not 0 <= self.dihedral < 8:
            raise TaskDataError(f"dihedral index must be 0..7, got {self.dihedral}")
        if sorted(self.colours) != list(range(NUM_COLOURS)) or self.colours[0] != 0:
            raise TaskDataError(f"colours {self.colours} must permute 0..9 with 0 fixed")

    @classmethod
    def random(cls, rng: np.random.Generator) -> Augmentation:
        return cls(int(rng.integers(8)), (0, *(int(c) for c in rng.permutation(np.arange(1, NUM_COLOURS)))))

    def apply(self, grid: np.ndarray) -> np.ndarray:
        return dihedral(np.asarray(self.colours)[np.asarray(grid)], self.dihedral)

    def invert(self, grid: np.ndarray) -> np.ndarray:
        return np.argsort(self.colours)[inverse_dihedral(grid, self.dihedral)]


# ----------------------------------------------------------------------------- voting and scoring


def vote(predictions: Iterable[np.ndarray | None]) -> list[tuple[np.ndarray, int]]:
    """Distinct grids with their vote counts, most votes first (ties: first seen); None entries are dropped."""
    return [(grid, n) for grid, n, _ in rank_votes(predictions)]


def pass_at_k(attempts: Sequence[np.ndarray], target: np.ndarray, k: int = 2) -> bool:
    """True when one of the first k attempts equals the target grid exactly (shape and colours)."""
    return any(np.array_equal(np.asarray(a), np.asarray(target)) for a in list(attempts)[:k])


def score(
    attempts: dict[str, list[list[np.ndarray]]], solutions: dict[str, list[np.ndarray]], k: int = 2
) -> dict[str, float]:
    """Score ranked attempts per task and test output (see the module docstring for the convention).

    ``attempts[task][j]`` is the ranked list of grids for test output j (missing tasks or outputs
    count as unsolved). Returns ``score`` (mean over tasks of the fraction of test outputs solved),
    ``all_solved`` (fraction of tasks with every test output solved), ``outputs_solved``,
    ``outputs`` and ``tasks``.
    """
    task_scores, all_solved, solved_outputs, outputs = [], 0, 0, 0
    for task_id, targets in solutions.items():
        guesses = attempts.get(task_id, [])
        solved = [
            pass_at_k(guesses[j] if j < len(guesses) else [], target, k) for j, target in enumerate(targets)
        ]
        task_scores.append(sum(solved) / len(solved))
        all_solved += all(solved)
        solved_outputs += sum(solved)
        outputs += len(solved)
    tasks = len(task_scores)
    return {
        "score": float(np.mean(task_scores)) if tasks else 0.0,
        "all_solved": all_solved / tasks if tasks else 0.0,
        "outputs_solved": float(solved_outputs),
        "outputs": float(outputs),
        "tasks": float(tasks),
    }


# ----------------------------------------------------------------------------- the task


def _canonical_key(grid: np.ndarray) -> tuple:
    """A key equal for all augmentations of a grid: colours relabelled by first appearance, min over the 8 symmetries."""
    best = None
    for k in range(8):
        g = dihedral(grid, k)
        flat = g.reshape(-1)
        _, first = np.unique(flat, return_index=True)
        order = flat[np.sort(first)]
        relabel = np.zeros(NUM_COLOURS, dtype=np.int64)
        nonzero = order[order != 0]
        relabel[nonzero] = np.arange(1, len(nonzero) + 1)
        key = (g.shape, relabel[g].astype(np.uint8).tobytes())
        if best is None or key < best:
            best = key
    return best


def _colour_map_consistent(src: np.ndarray, dst: np.ndarray) -> bool:
    """Whether src -> dst (elementwise) is a partial bijection of colours fixing 0 (extends to a permutation)."""
    pairs = np.unique(src.astype(np.int64) * NUM_COLOURS + dst.astype(np.int64))
    a, b = pairs // NUM_COLOURS, pairs % NUM_COLOURS
    return (
        len(np.unique(a)) == len(pairs)
        and len(np.unique(b)) == len(pairs)
        and bool(np.all((a == 0) == (b == 0)))
    )
