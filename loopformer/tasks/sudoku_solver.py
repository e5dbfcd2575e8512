"""Exact Sudoku solver and unique-solution generator for any box shape (bitmask candidates, compiled).

Solver: bitmask candidates, constraint propagation (naked + hidden singles), then depth-first search on
the cell with fewest candidates (MRV).  ``backtracks`` counts branches that propagation refuted: 0 for
puzzles that singles alone solve; a "rating"-like difficulty in the spirit of Sudoku-Extreme's.

Generator: a random full grid (randomised search on the empty grid), then clues removed in random order
while the solution stays unique.  Uniqueness after removing clue v at cell c is tested by asking the
solver for any solution with c != v (one existence search instead of counting to two); a clue whose
peers already exclude every other digit is removed without search.

The hot loops are Numba kernels (``loopformer.tasks._sudoku_kernels``, compiled on first use and cached)
that draw from CPython's ``random.Random`` stream exactly, so a seed gives the same puzzles, solutions
and backtrack counts as the earlier pure-Python implementation (checked in tests/test_sudoku_solver.py).
"""

from __future__ import annotations

import functools
import random
from types import ModuleType

import numpy as np

SYMBOLS = "123456789ABCDEFG"


class SudokuGeometry:
    """Cells, units (rows, columns, boxes) and peers of a size x size grid with box_r x box_c boxes."""

    def __init__(self, size: int, box: tuple[int, int]) -> None:
        box_r, box_c = box
        if box_r * box_c != size or box_r < 1 or box_c < 1:
            raise ValueError(f"box {box} does not tile a {size}x{size} grid (need rows * cols == {size})")
        if size > len(SYMBOLS):
            raise ValueError(f"size {size} > {len(SYMBOLS)} is not supported (symbols {SYMBOLS})")
        self.size = size
        self.box = (box_r, box_c)
        self.cells = size * size
        self.full = (1 << size) - 1
        rows = [tuple(r * size + c for c in range(size)) for r in range(size)]
        cols = [tuple(r * size + c for r in range(size)) for c in range(size)]
        boxes = []
        for br in range(0, size, box_r):
            for bc in range(0, size, box_c):
                boxes.append(tuple((br + i) * size + bc + j for i in range(box_r) for j in range(box_c)))
        self.rows, self.cols, self.boxes = rows, cols, boxes
        self.units: list[tuple[int, ...]] = rows + cols + boxes
        peers: list[set[int]] = [set() for _ in range(self.cells)]
        for unit in self.units:
            for cell in unit:
                peers[cell].update(unit)
        self.peers: list[tuple[int, ...]] = [tuple(sorted(p - {cell})) for cell, p in enumerate(peers)]
        self.cell_units: list[tuple[int, int, int]] = [
            (cell // size, size + cell % size, 2 * size + self.box_of(cell)) for cell in range(self.cells)
        ]
        # the same tables as arrays for the kernels (every cell has the same number of peers)
        self.peer_array = np.asarray(self.peers, dtype=np.int64)
        self.unit_array = np.asarray(self.units, dtype=np.int64)
        self.cell_unit_array = np.asarray(self.cell_units, dtype=np.int64)

    def box_of(self, cell: int) -> int:
        r, c = divmod(cell, self.size)
        return (r // self.box[0]) * (self.size // self.box[1]) + c // self.box[1]


@functools.lru_cache(maxsize=16)
def geometry(size: int, box: tuple[int, int]) -> SudokuGeometry:
    return SudokuGeometry(size, box)


def _kernels() -> ModuleType:
    """The Numba kernels, imported (and compiled or loaded from cache) on first use."""
    from loopformer.tasks import _sudoku_kernels

    return _sudoku_kernels


_NO_RNG = np.zeros(625, dtype=np.int64)


def search(
    geo: SudokuGeometry, digits: list[int] | np.ndarray, limit: int
) -> tuple[list[int] | None, int, int]:
    """(first solution's digits or None, solutions found up to ``limit``, backtracks) for ``digits``
    (0 = blank).  Contradictory givens: (None, 0, 0)."""
    k = _kernels()
    given = np.asarray(digits, dtype=np.int64)
    cand = np.empty(geo.cells, dtype=np.int64)
    if not k.initial_candidates(geo.peer_array, geo.unit_array, geo.full, given, cand):
        return None, 0, 0
    masks = np.zeros(geo.cells, dtype=np.int64)
    found, backtracks = k.search(geo.peer_array, geo.unit_array, geo.full, cand, limit, masks, _NO_RNG, False)
    if not found:
        return None, 0, backtracks
    out = np.empty(geo.cells, dtype=np.int64)
    k.masks_to_digits(masks, out)
    return out.tolist(), found, backtracks


def mt_state(seed: int) -> np.ndarray:
    """CPython's Mersenne Twister state of ``random.Random(seed)``: 624 words and the position."""
    state = random.Random(seed).getstate()[1]
    return np.asarray(state, dtype=np.int64)


def generate_one(geo: SudokuGeometry, seed: int, target_blanks: int) -> tuple[list[int], list[int], int]:
    """One unique-solution puzzle: (givens digits, solution digits, blanks); blanks may fall short of target."""
    givens = np.empty(geo.cells, dtype=np.int64)
    solution = np.empty(geo.cells, dtype=np.int64)
    blanks = _kernels().generate_one(
        geo.peer_array,
        geo.unit_array,
        geo.cell_unit_array,
        geo.full,
        mt_state(seed),
        int(target_blanks),
        givens,
        solution,
    )
    return givens.tolist(), solution.tolist(), int(blanks)


def generate_worker(
    args: tuple[int, tuple[int, int], int, int, int, int],
) -> tuple[list[int], list[int], int, int]:
    """(givens, solution, blanks, backtracks) of one puzzle meeting the blank / backtrack floors."""
    size, box, sub_seed, min_blanks, max_blanks, min_backtracks = args
    geo = geometry(size, box)
    rng = random.Random(sub_seed)
    for _attempt in range(200):
        target = rng.randint(min_blanks, max_blanks)
        givens, solution, blanks = generate_one(geo, rng.getrandbits(63), target)
        if blanks < min_blanks:
            continue
        _, _, backtracks = search(geo, givens, 2)
        if backtracks < min_backtracks:
            continue
        return givens, solution, blanks, backtracks
    raise ValueError(
        f"could not reach min_blanks={min_blanks} / min_backtracks={min_backtracks} on a {size}x{size} "
        "sudoku in 200 attempts; lower the requirement"
    )


def warm_up() -> None:
    """Compile (or load) the kernels in this process, e.g. before forking a worker pool."""
    generate_worker((4, (2, 2), 0, 0, 16, 0))
