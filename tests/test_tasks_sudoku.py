"""Sudoku task: solver vs brute force, unique generation, augmentations, CSV, the two real puzzles."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loopformer.tasks.base import TaskDataError
from loopformer.tasks.sudoku import SudokuTask

REAL_PUZZLES = [
    "5...27..9..41......1..5.3...92.6.8...5......66..7..29.8...7...2.......8...9..36..",
    ".....8..1.6.9..2...4.52.9..4..6......9..45..6....924..9......7........3.35.2..6..",
]


def valid_solution(size: int, box: tuple[int, int], puzzle: np.ndarray, grid: np.ndarray) -> bool:
    """Independent oracle: every row / column / box holds each digit once and the givens are kept."""
    g = np.asarray(grid).reshape(size, size) - 1
    p = np.asarray(puzzle).reshape(size, size) - 1
    digits = set(range(1, size + 1))
    rows = all(set(g[r].tolist()) == digits for r in range(size))
    cols = all(set(g[:, c].tolist()) == digits for c in range(size))
    boxes = all(
        set(g[r : r + box[0], c : c + box[1]].reshape(-1).tolist()) == digits
        for r in range(0, size, box[0])
        for c in range(0, size, box[1])
    )
    givens = bool(((p == 0) | (p == g)).all())
    return rows and cols and boxes and givens


def all_4x4_grids() -> list[np.ndarray]:
    """Every valid 4x4 Sudoku (288), by brute force over row permutations."""
    perms = list(itertools.permutations(range(1, 5)))
    grids = []
    for rows in itertools.product(perms, repeat=4):
        g = np.asarray(rows)
        if all(len(set(g[:, c])) == 4 for c in range(4)) and all(
            len(set(g[r : r + 2, c : c + 2].reshape(-1))) == 4 for r in (0, 2) for c in (0, 2)
        ):
            grids.append(g.reshape(-1) + 1)
    return grids


ALL_4X4 = all_4x4_grids()


def test_brute_force_oracle_has_288_grids() -> None:
    assert len(ALL_4X4) == 288


@settings(max_examples=60, deadline=None)
@given(grid_index=st.integers(0, 287), mask_seed=st.integers(0, 10**6), blanks=st.integers(0, 16))
def test_count_solutions_matches_brute_force_4x4(grid_index: int, mask_seed: int, blanks: int) -> None:
    task = SudokuTask(4)
    puzzle = ALL_4X4[grid_index].copy()
    rng = np.random.default_rng(mask_seed)
    puzzle[rng.choice(16, size=blanks, replace=False)] = 1
    givens = puzzle >= 2
    brute = sum(bool((g[givens] == puzzle[givens]).all()) for g in ALL_4X4)
    assert task.count_solutions(puzzle, limit=1000) == brute
    assert task.count_solutions(puzzle, limit=2) == min(brute, 2)
    solution, _ = task.solve(puzzle)
    assert solution is not None and valid_solution(4, (2, 2), puzzle, solution)


def test_contradictory_and_unsolvable_grids() -> None:
    task = SudokuTask(4)
    dup = task.parse_grid("11.." + "." * 12)
    assert task.count_solutions(dup) == 0 and task.solve(dup)[0] is None
    assert "twice in row 1" in task.find_conflict(dup)
    # no duplicate, but cell (0,3) has no candidate: its row holds 1, 2 and its column 4, 3
    stuck = task.parse_grid("12.." + "...4" + "...3" + "....")
    assert task.find_conflict(stuck) is None
    assert task.count_solutions(stuck) == 0


@pytest.mark.parametrize("size,box", [(4, (2, 2)), (6, (2, 3)), (9, (3, 3))])
def test_generated_puzzles_unique_and_checked(size: int, box: tuple[int, int]) -> None:
    task = SudokuTask(size)
    assert task.box == box and task.vocab_size == size + 2 and task.seq_len == size * size
    ds = task.generate(12, seed=3, workers=1)
    assert ds.inputs.shape == (12, size * size)
    assert len({row.tobytes() for row in ds.inputs}) == 12  # distinct puzzles
    for x, y, d in zip(ds.inputs, ds.labels, ds.difficulty):
        assert task.count_solutions(x, limit=2) == 1
        assert valid_solution(size, box, x, y)
        assert task.check(x, y)
        solution, _ = task.solve(x)
        assert np.array_equal(solution, y)
        assert d == (x == 1).sum() == task.difficulty(x)
        assert set(np.unique(x)) <= set(range(1, size + 2))
    assert len(ds.meta["backtracks"]) == 12
    again = task.generate(12, seed=3, workers=1)
    assert np.array_equal(again.inputs, ds.inputs)
    other = task.generate(12, seed=4, workers=1)
    assert not np.array_equal(other.inputs, ds.inputs)


def test_blank_range_is_respected_and_workers_do_not_change_output() -> None:
    task = SudokuTask(9)
    ds = task.generate(6, seed=1, min_blanks=30, max_blanks=35, workers=1)
    assert ((ds.difficulty >= 30) & (ds.difficulty <= 35)).all()
    pooled = task.generate(6, seed=1, min_blanks=30, max_blanks=35, workers=2)
    assert np.array_equal(pooled.inputs, ds.inputs)
    with pytest.raises(ValueError):
        task.generate(2, seed=0, min_blanks=50, max_blanks=40)


def test_sixteen_by_sixteen_and_custom_box() -> None:
    task = SudokuTask(16)
    ds = task.generate(1, seed=0, min_blanks=60, max_blanks=80, workers=1)
    assert task.count_solutions(ds.inputs[0]) == 1 and valid_solution(16, (4, 4), ds.inputs[0], ds.labels[0])
    text = task.format_grid(ds.labels[0])
    assert set(text) == set("123456789ABCDEFG")
    assert np.array_equal(task.parse_grid(text.lower()), ds.labels[0])
    tall = SudokuTask(6, box=(3, 2))
    ds6 = tall.generate(3, seed=0, workers=1)
    assert all(valid_solution(6, (3, 2), x, y) for x, y in zip(ds6.inputs, ds6.labels))
    with pytest.raises(ValueError):
        SudokuTask(6, box=(2, 2))


def test_check_is_independent_of_labels() -> None:
    task = SudokuTask(9)
    ds = task.generate(1, seed=5, workers=1)
    x, y = ds.inputs[0], ds.labels[0]
    assert task.check(x, y)
    blank = int(np.flatnonzero(x == 1)[0])
    given_cell = int(np.flatnonzero(x >= 2)[0])
    unfinished = y.copy()
    unfinished[blank] = 1
    assert not task.check(x, unfinished)
    # swap two digits everywhere: still a valid grid, but it contradicts the givens
    swapped = y.copy()
    a, b = int(y[given_cell]), (int(y[given_cell]) - 2 + 1) % 9 + 2
    swapped[y == a], swapped[y == b] = b, a
    assert valid_solution(9, (3, 3), np.ones(81, dtype=int), swapped)
    assert not task.check(x, swapped)
    # a grid valid for the givens but not a sudoku (duplicate in a row)
    broken = y.copy()
    broken[blank] = y[blank] % 9 + 2
    assert not task.check(x, broken)
    assert not task.check(x, y[:-1])
    out_of_range = y.copy()
    out_of_range[blank] = 11
    assert not task.check(x, out_of_range)


@settings(max_examples=40, deadline=None)
@given(size=st.sampled_from([4, 6, 9, 16]), seed=st.integers(0, 2**31 - 1))
def test_augmentations_keep_validity_and_invert_exactly(size: int, seed: int) -> None:
    task = SudokuTask(size)
    # a valid grid without search: the shifted pattern grid
    r, c = np.meshgrid(range(size), range(size), indexing="ij")
    br, bc = task.box
    solution = ((r * bc + r // br + c) % size + 2).reshape(-1)
    assert valid_solution(size, task.box, np.ones(size * size, dtype=int), solution)
    rng = np.random.default_rng(seed)
    puzzle = solution.copy()
    puzzle[rng.random(size * size) < 0.5] = 1
    aug_puzzle, t = task.augment(puzzle, rng)
    aug_solution = task.apply_transform(solution, t)
    assert task.check(aug_puzzle, aug_solution)
    assert ((aug_puzzle == 1).sum()) == (puzzle == 1).sum()
    assert np.array_equal(task.invert(aug_puzzle, t), puzzle)
    assert np.array_equal(task.invert(aug_solution, t), solution)
    if task.box[0] != task.box[1]:
        assert not t.transpose
    grid2d = task.apply_transform(solution.reshape(size, size), t)
    assert grid2d.shape == (size, size)


def test_transpose_happens_for_square_boxes() -> None:
    task = SudokuTask(9)
    rng = np.random.default_rng(0)
    assert any(task.random_transform(rng).transpose for _ in range(20))


def test_augment_dataset_multiplies_and_stays_valid() -> None:
    task = SudokuTask(4)
    base = task.generate(3, seed=0, workers=1)
    big = task.augment_dataset(base, copies=2, seed=0)
    assert len(big) == 9 and big.meta["augmented_from"] == [0, 1, 2] * 3
    assert all(task.check(x, y) and task.count_solutions(x) == 1 for x, y in zip(big.inputs, big.labels))


@pytest.mark.parametrize("text", REAL_PUZZLES)
def test_real_sudoku_extreme_puzzles(text: str) -> None:
    task = SudokuTask(9)
    puzzle = task.parse_grid(text)
    assert task.format_grid(puzzle) == text
    assert task.count_solutions(puzzle, limit=2) == 1
    solution, backtracks = task.solve(puzzle)
    assert solution is not None and valid_solution(9, (3, 3), puzzle, solution)
    assert task.check(puzzle, solution)
    assert backtracks > 0 and task.backtracks(puzzle) >= backtracks  # extreme: singles are not enough
    picture = task.render(puzzle, solution)
    assert picture.count("\n") == 12  # 9 rows + 4 borders
    first_row = picture.splitlines()[1]
    assert first_row.count("(") == (puzzle[:9] == 1).sum()  # filled cells marked, givens plain
    assert "[cyan]" in task.render(puzzle, solution, markup=True)


def test_easy_puzzle_needs_no_backtracking() -> None:
    task = SudokuTask(9)
    ds = task.generate(1, seed=0, min_blanks=20, max_blanks=20, workers=1)
    assert task.solve(ds.inputs[0])[1] == 0


def test_render_flags_bad_cells() -> None:
    task = SudokuTask(4)
    puzzle = task.parse_grid("1...............")
    wrong = task.parse_grid("2111111111111111")
    wrong[1:] = np.where(puzzle[1:] == 1, 1, wrong[1:])
    assert "!2!" in task.render(puzzle, wrong)


# ---------------------------------------------------------------------------------------------- CSV


def test_csv_round_trip_and_columns(tmp_path) -> None:
    task = SudokuTask(6)
    ds = task.generate(5, seed=2, workers=1)
    path = tmp_path / "s.csv"
    task.save(ds, path)
    lines = path.read_text().splitlines()
    assert lines[0] == "source,question,answer,rating"
    q = lines[1].split(",")[1]
    assert len(q) == 36 and "." in q
    back = task.load(path)
    assert np.array_equal(back.inputs, ds.inputs) and np.array_equal(back.labels, ds.labels)
    assert np.array_equal(back.difficulty, ds.difficulty)


def test_csv_reads_real_rows_zero_blanks_and_empty_answers(tmp_path) -> None:
    task = SudokuTask(9)
    solution, _ = task.solve(task.parse_grid(REAL_PUZZLES[0]))
    path = tmp_path / "real.csv"
    path.write_text(
        "source,question,answer,rating\n"
        f"puzzles0,{REAL_PUZZLES[0]},{task.format_grid(solution)},18\n"
        f"puzzles1,{REAL_PUZZLES[1].replace('.', '0')},,\n"
    )
    ds = task.load(path)
    assert len(ds) == 2 and ds.difficulty[0] == 18
    assert ds.difficulty[1] == REAL_PUZZLES[1].count(".")
    assert all(task.check(x, y) for x, y in zip(ds.inputs, ds.labels))
    assert ds.meta["source"] == ["puzzles0", "puzzles1"]


def _bad_csv(tmp_path, body: str) -> str:
    path = tmp_path / "bad.csv"
    path.write_text("source,question,answer,rating\n" + body)
    return str(path)


def test_csv_errors_name_row_and_problem(tmp_path) -> None:
    task = SudokuTask(4)
    good_q, good_a = "1...3......4...3", "1432324123144123"
    ok = f"x,{good_q},{good_a},12\n"
    cases = {
        "line 3: question has 15 characters": ok + f"x,{good_q[:-1]},{good_a},12\n",
        "bad character 'x'": ok + f"x,{good_q[:-1]}x,{good_a},12\n",
        "line 2: contradictory clues: digit 1 appears twice in row 1": f"x,11{'.' * 14},{good_a},1\n",
        "answer inconsistent with question": ok + f"x,{good_q},{good_a[::-1]},12\n",
        "answer changes the given at row 1, column 1": f"x,{good_q},2{good_a[1:]},12\n",
        "rating 'hard' is not a number": f"x,{good_q},{good_a},hard\n",
        "line 3: 2 fields, expected 4": ok + f"x,{good_q}",  # truncated in the middle of a row
        "line 3: question has 7 characters": ok + f"x,{good_q[:7]},,",
    }
    for expected, body in cases.items():
        with pytest.raises(TaskDataError, match=expected.replace("(", r"\(")):
            task.load(_bad_csv(tmp_path, body))
    with pytest.raises(TaskDataError, match="empty file"):
        (tmp_path / "empty.csv").write_text("")
        task.load(tmp_path / "empty.csv")
    with pytest.raises(TaskDataError, match="lacks column"):
        (tmp_path / "nohead.csv").write_text("a,b\n1,2\n")
        task.load(tmp_path / "nohead.csv")
    with pytest.raises(TaskDataError, match="does not exist"):
        task.load(tmp_path / "missing.csv")
