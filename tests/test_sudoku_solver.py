"""The compiled Sudoku kernels against the pure-Python solver / generator they replaced (tests/
sudoku_reference.py), against an independent brute-force count, and against CPython's ``random``: same
solutions, solution counts, backtrack counts and, for every seed, the same generated puzzles."""

from __future__ import annotations

import random

import numpy as np
import pytest
import sudoku_reference as ref
from hypothesis import given, settings
from hypothesis import strategies as st

from loopformer.tasks import _sudoku_kernels as kernels
from loopformer.tasks import sudoku_solver as solver
from loopformer.tasks.sudoku import SudokuTask

SHAPES = [(4, (2, 2)), (6, (2, 3)), (6, (3, 2)), (9, (3, 3))]


def reference_search(geo: solver.SudokuGeometry, digits: list[int], limit: int):
    cand = ref._initial_candidates(geo, digits)
    if cand is None:
        return None, 0, 0
    search = ref._Search(geo, limit)
    search.run(cand)
    first = ref._masks_to_digits(search.solutions[0]) if search.solutions else None
    return first, len(search.solutions), search.backtracks


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), n=st.integers(2, 81))
def test_shuffle_draws_cpython_random_stream(seed: int, n: int) -> None:
    state = solver.mt_state(seed)
    got = np.arange(n)
    expected = list(range(n))
    rng = random.Random(seed)
    for _ in range(3):  # several shuffles: the state carries over (and past a twist for large n)
        kernels._shuffle(state, got, n)
        rng.shuffle(expected)
        assert got.tolist() == expected


def test_shuffle_crosses_the_twist_boundary() -> None:
    state = solver.mt_state(7)
    rng = random.Random(7)
    words = [kernels._mt_uint32(state) for _ in range(2000)]
    assert words == [rng.getrandbits(32) for _ in range(2000)]


@settings(max_examples=150, deadline=None)
@given(
    shape=st.sampled_from(SHAPES),
    grid_seed=st.integers(0, 10**9),
    mask_seed=st.integers(0, 10**9),
    blank_percent=st.integers(0, 100),
    corrupt=st.integers(0, 3),
)
def test_search_matches_reference_solver(shape, grid_seed, mask_seed, blank_percent, corrupt) -> None:
    size, box = shape
    geo = solver.geometry(size, box)
    _, solution, _ = ref._generate_one(geo, grid_seed, 0)
    rng = np.random.default_rng(mask_seed)
    digits = list(solution)
    for cell in rng.choice(geo.cells, size=blank_percent * geo.cells // 100, replace=False):
        digits[int(cell)] = 0
    for _ in range(corrupt):  # wrong givens: unsolvable or contradictory puzzles, and other solutions
        digits[int(rng.integers(geo.cells))] = int(rng.integers(1, size + 1))
    for limit in (1, 2, 5):
        assert solver.search(geo, digits, limit) == reference_search(geo, digits, limit)


@pytest.mark.parametrize("shape", SHAPES + [(8, (2, 4))])
def test_generator_reproduces_reference_puzzles(shape) -> None:
    size, box = shape
    cells = size * size
    for seed in range(40 if size == 9 else 80):
        args = (size, box, seed, cells // 2, cells, 0)
        assert solver.generate_worker(args) == ref._generate_worker(args)


def test_generator_reproduces_reference_with_backtrack_floor() -> None:
    for seed in range(10):
        args = (9, (3, 3), seed, 50, 81, 3)
        out = solver.generate_worker(args)
        assert out == ref._generate_worker(args) and out[3] >= 3


def test_count_matches_exhaustive_enumeration_6x6() -> None:
    """Independent oracle: count completions of a 6x6 puzzle by trying every digit cell by cell."""
    task = SudokuTask(6)
    geo = task.geometry
    solution = ref._generate_one(geo, 3, 0)[1]

    def completions(grid: list[int], cell: int = 0) -> int:
        if cell == geo.cells:
            return 1
        if grid[cell]:
            return completions(grid, cell + 1)
        total = 0
        for d in range(1, 7):
            if all(grid[p] != d for p in geo.peers[cell]):
                grid[cell] = d
                total += completions(grid, cell + 1)
        grid[cell] = 0
        return total

    rng = random.Random(0)
    for blanks in (10, 16, 20, 24):
        digits = list(solution)
        for cell in rng.sample(range(geo.cells), blanks):
            digits[cell] = 0
        assert solver.search(geo, digits, 10**6)[1] == completions(list(digits))


def test_all_4x4_grids_counted() -> None:
    geo = solver.geometry(4, (2, 2))
    assert solver.search(geo, [0] * 16, 1000)[1] == 288  # every valid 4x4 grid (see test_tasks_sudoku)
