"""Maze task: labels are shortest paths (independent BFS), check() rejects every kind of wrong path."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loopformer.tasks.base import TaskDataError
from loopformer.tasks.maze import MazeTask


def oracle_shortest(grid_chars: list[str]) -> int:
    """Independent BFS over a list of row strings; moves from S to G, -1 if unreachable."""
    rows, cols = len(grid_chars), len(grid_chars[0])
    start = next((r, c) for r in range(rows) for c in range(cols) if grid_chars[r][c] == "S")
    seen = {start: 0}
    todo = deque([start])
    while todo:
        r, c = todo.popleft()
        if grid_chars[r][c] == "G":
            return seen[(r, c)]
        for dr, dc in ((0, 1), (1, 0), (0, -1), (-1, 0)):
            nr, nc = r + dr, c + dc
            if 0 <= nr < rows and 0 <= nc < cols and grid_chars[nr][nc] != "#" and (nr, nc) not in seen:
                seen[(nr, nc)] = seen[(r, c)] + 1
                todo.append((nr, nc))
    return -1


def rows_of(task: MazeTask, tokens: np.ndarray) -> list[str]:
    text = task.format_grid(tokens)
    return [text[i : i + task.size] for i in range(0, len(text), task.size)]


def oracle_path_ok(question: list[str], answer: list[str]) -> bool:
    """The 'o' cells plus S, G are a chain of 4-neighbours from S to G of the oracle's length."""
    cells = {(r, c) for r, row in enumerate(answer) for c, ch in enumerate(row) if ch in "oSG"}
    start = next(p for p in cells if answer[p[0]][p[1]] == "S")
    order, cur, prev = [start], start, None
    while answer[cur[0]][cur[1]] != "G":
        nxt = [
            (cur[0] + dr, cur[1] + dc)
            for dr, dc in ((0, 1), (1, 0), (0, -1), (-1, 0))
            if (cur[0] + dr, cur[1] + dc) in cells and (cur[0] + dr, cur[1] + dc) != prev
        ]
        if len(nxt) != 1:
            return False
        prev, cur = cur, nxt[0]
        order.append(cur)
    same_elsewhere = all(
        question[r][c] == answer[r][c] or (question[r][c] == " " and answer[r][c] == "o")
        for r in range(len(question))
        for c in range(len(question[0]))
    )
    return len(order) == len(cells) and len(order) - 1 == oracle_shortest(question) and same_elsewhere


@pytest.mark.parametrize("size,min_path", [(15, 20), (30, 112), (10, 8)])
def test_generated_labels_are_shortest_paths(size: int, min_path: int) -> None:
    task = MazeTask(size)
    ds = task.generate(8, seed=0, min_path=min_path)
    assert ds.inputs.shape == (8, size * size) and task.vocab_size == 6
    for x, y, d in zip(ds.inputs, ds.labels, ds.difficulty):
        q, a = rows_of(task, x), rows_of(task, y)
        assert "o" not in "".join(q) and "".join(q).count("S") == 1 and "".join(q).count("G") == 1
        assert d == oracle_shortest(q) >= min_path
        assert d == task.difficulty(x)
        assert oracle_path_ok(q, a)
        assert task.check(x, y)
        assert set(np.unique(x)) <= {1, 2, 3, 4}
    assert np.array_equal(task.generate(8, seed=0, min_path=min_path).inputs, ds.inputs)


def test_default_min_path_matches_maze_hard() -> None:
    ds = MazeTask(30).generate(3, seed=1)
    assert (ds.difficulty > 110).all()


# a hand-made 5x5 field: S top-left, G top-right
OPEN_FIELD = ["S   G", "     ", "     ", "     ", "     "]


def tokens(task: MazeTask, rows: list[str]) -> np.ndarray:
    return task.parse_grid("".join(rows))


def test_check_accepts_any_shortest_path_and_rejects_bad_ones() -> None:
    task = MazeTask(5)
    x = tokens(task, OPEN_FIELD)
    straight = tokens(task, ["SoooG", "     ", "     ", "     ", "     "])
    assert task.check(x, straight)
    # another shortest path does not exist here; a detour is valid but not shortest
    detour = tokens(task, ["S   G", "ooooo", "     ", "     ", "     "])
    assert oracle_shortest(OPEN_FIELD) == 4
    assert not task.check(x, detour)
    broken = tokens(task, ["So oG", "     ", "     ", "     ", "     "])
    assert not task.check(x, broken)
    branch = tokens(task, ["SoooG", "  o  ", "     ", "     ", "     "])
    assert not task.check(x, branch)
    stray_cycle = tokens(task, ["SoooG", "     ", "   oo", "   oo", "     "])
    assert not task.check(x, stray_cycle)
    moved_goal = tokens(task, ["Sooo ", "    G", "     ", "     ", "     "])
    assert not task.check(x, moved_goal)


def test_check_rejects_paths_through_walls_and_changed_walls() -> None:
    task = MazeTask(5)
    walled = ["S # G", "     ", "     ", "#    ", "     "]
    x = tokens(task, walled)
    assert oracle_shortest(walled) == 6
    through_wall = tokens(task, ["SoooG", "     ", "     ", "#    ", "     "])
    assert not task.check(x, through_wall)
    around = tokens(task, ["S # G", "ooooo", "     ", "#    ", "     "])
    assert task.check(x, around)
    wall_removed = tokens(task, ["S # G", "ooooo", "     ", "     ", "     "])
    assert not task.check(x, wall_removed)
    wall_added = tokens(task, ["S # G", "ooooo", "  #  ", "#    ", "     "])
    assert not task.check(x, wall_added)
    # two alternative shortest paths (around the wall through either row 1 variant) both accepted
    other = tokens(task, ["So#oG", " ooo ", "     ", "#    ", "     "])
    assert task.check(x, other) and oracle_path_ok(walled, rows_of(task, other))
    assert not task.check(x, around[:-1])


def test_generated_label_mutations_are_rejected() -> None:
    task = MazeTask(15)
    ds = task.generate(4, seed=3, min_path=20)
    rng = np.random.default_rng(0)
    for x, y in zip(ds.inputs, ds.labels):
        path = np.flatnonzero(y == 5)
        gap = y.copy()
        gap[rng.choice(path)] = 2
        assert not task.check(x, gap)
        walls = np.flatnonzero(x == 1)
        dug = y.copy()
        dug[rng.choice(walls)] = 2
        assert not task.check(x, dug)
        painted = y.copy()
        painted[rng.choice(walls)] = 5
        assert not task.check(x, painted)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), transform=st.integers(0, 7))
def test_dihedral_augmentation_valid_and_invertible(seed: int, transform: int) -> None:
    task = MazeTask(9)
    ds = task.generate(1, seed=seed, min_path=6)
    x, y = ds.inputs[0], ds.labels[0]
    tx, ty = task.apply_transform(x, transform), task.apply_transform(y, transform)
    assert task.check(tx, ty) and task.difficulty(tx) == ds.difficulty[0]
    assert np.array_equal(task.invert(tx, transform), x) and np.array_equal(task.invert(ty, transform), y)
    rx, t = task.augment(x, np.random.default_rng(seed))
    assert np.array_equal(task.invert(rx, t), x)
    transformed = {task.apply_transform(x, k).tobytes() for k in range(8)}
    assert len(transformed) >= 2


def test_render_shows_grid_and_path() -> None:
    task = MazeTask(5)
    x = tokens(task, OPEN_FIELD)
    y = tokens(task, ["SoooG", "     ", "     ", "     ", "     "])
    framed = task.render(x, y).splitlines()
    assert framed[1] == "|SoooG|" and framed[0] == framed[-1] == "+" + "-" * task.size + "+"
    assert "[cyan]o[/cyan]" in task.render(x, y, markup=True)


# ---------------------------------------------------------------------------------------------- CSV


def test_csv_round_trip(tmp_path) -> None:
    task = MazeTask(12)
    ds = task.generate(5, seed=0, min_path=10)
    path = tmp_path / "m.csv"
    task.save(ds, path)
    header, first = path.read_text().splitlines()[:2]
    assert header == "source,question,answer,rating"
    assert first.endswith("," + str(int(ds.difficulty[0])))
    back = task.load(path)
    assert np.array_equal(back.inputs, ds.inputs) and np.array_equal(back.labels, ds.labels)
    assert np.array_equal(back.difficulty, ds.difficulty)
    assert MazeTask.infer_options(path) == {"size": 12}


def test_csv_errors_name_row_and_problem(tmp_path) -> None:
    task = MazeTask(5)
    q, a = "".join(OPEN_FIELD), "SoooG" + " " * 20
    ok = f"m,{q},{a},4\n"
    cases = {
        "line 3: question has 24 characters": ok + f"m,{q[:-1]},{a},4\n",
        "line 2: question has bad character 'x'": f"m,x{q[1:]},{a},4\n",
        "line 2: question has bad character 'o'": f"m,{a},{a},4\n",
        "2 'S' and 1 'G'": f"m,S{q[1:-1]}S,{a},4\n",
        "answer inconsistent": f"m,{q},S   Gooooo{' ' * 15},4\n",
        "line 3: 2 fields, expected 4": ok + f"m,{q}",
        "rating 'x' is not a number": f"m,{q},{a},x\n",
    }
    for expected, body in cases.items():
        path = tmp_path / "bad.csv"
        path.write_text("source,question,answer,rating\n" + body)
        with pytest.raises(TaskDataError, match=expected):
            task.load(path)
    walled_in = "S#   ##   " + " " * 14 + "G"
    path = tmp_path / "unreachable.csv"
    path.write_text(f"source,question,answer,rating\nm,{walled_in},{walled_in},1\n")
    with pytest.raises(TaskDataError, match="unreachable"):
        task.load(path)
