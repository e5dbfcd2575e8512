"""The vectorised puzzle-CSV reader and the HRM / TRM folder checks: speed-path results equal the per-row
parser's, and every kind of bad input gets an error naming the file, the line / row and the column."""

from __future__ import annotations

import json
import re
import tracemalloc

import numpy as np
import pytest

from loopformer.tasks.base import TaskDataError
from loopformer.tasks.formats import load_hrm_folder, save_hrm_folder
from loopformer.tasks.puzzle_csv import read_puzzle_csv
from loopformer.tasks.sudoku import SudokuTask

REAL_PUZZLES = (
    "5...27..9..41......1..5.3...92.6.8...5......66..7..29.8...7...2.......8...9..36..",
    ".....8..1.6.9..2...4.52.9..4..6......9..45..6....924..9......7........3.35.2..6..",
)
HEADER = "source,question,answer,rating\n"


@pytest.fixture(scope="module")
def task() -> SudokuTask:
    return SudokuTask(9)


@pytest.fixture(scope="module")
def real_rows(task) -> list[str]:
    """Real-format rows: the two real puzzles and relabelled copies of them, with ratings."""
    rng = np.random.default_rng(0)
    q, a = [], []
    for k in range(42):
        x = task.parse_grid(REAL_PUZZLES[k % 2])
        y = task.solve(x)[0]
        t = task.random_transform(rng) if k >= 2 else None
        q.append(x if t is None else task.apply_transform(x, t))
        a.append(y if t is None else task.apply_transform(y, t))
    return [
        f"puzzles{i % 3},{task.format_grid(x)},{task.format_grid(y)},{i * 7 % 50}"
        for i, (x, y) in enumerate(zip(q, a))
    ]


def write(tmp_path, body: str | bytes, name: str = "s.csv"):
    path = tmp_path / name
    if isinstance(body, str):
        path.write_text(body)
    else:
        path.write_bytes(body)
    return path


def test_fast_path_equals_per_row_parser(tmp_path, task, real_rows) -> None:
    # mixed rows: quoted source, '0' blanks, lower-case alphabet is not in 9x9, empty answer, empty rating, CRLF
    extra = [
        f'"quoted, source",{REAL_PUZZLES[1].replace(".", "0")},,',
        f"blank-rating,{real_rows[0].split(',')[1]},{real_rows[0].split(',')[2]},",
    ]
    text = HEADER + "\n".join(real_rows[:10]) + "\r\n\n" + "\n".join(extra + real_rows[10:]) + "\n"
    path = write(tmp_path, text)
    fast = task.load(path)
    slow = read_puzzle_csv(
        path, task._parse_csv_row, task.seq_len, {}
    )  # every row through the per-row parser
    assert np.array_equal(fast.inputs, slow.inputs) and np.array_equal(fast.labels, slow.labels)
    assert np.array_equal(fast.difficulty, slow.difficulty)
    assert fast.meta["source"] == slow.meta["source"] and fast.meta["source"][10] == "quoted, source"
    assert len(fast) == len(real_rows) + 2
    assert all(task.check(x, y) for x, y in zip(fast.inputs, fast.labels))
    assert fast.difficulty[11] == REAL_PUZZLES[0].count(".")  # empty rating -> blank count


def test_block_boundaries_do_not_matter(tmp_path, task, real_rows) -> None:
    from loopformer.tasks.puzzle_csv import sudoku_fast_rows

    path = write(tmp_path, HEADER + "\n".join(real_rows) + "\n")
    fast = sudoku_fast_rows(task.geometry.units, 9, task.symbols)
    whole = read_puzzle_csv(path, task._parse_csv_row, 81, {}, fast=fast)
    for chunk in (200, 333, 1000):
        seen: list[int] = []
        part = read_puzzle_csv(
            path, task._parse_csv_row, 81, {}, fast=fast, chunk_bytes=chunk, progress=seen.append
        )
        assert np.array_equal(part.inputs, whole.inputs) and part.meta["source"] == whole.meta["source"]
        assert sum(seen) == path.stat().st_size
    assert whole.difficulty.tolist() == [i * 7 % 50 for i in range(len(real_rows))]


@pytest.mark.parametrize("rating", ["nan", "inf", "-inf", "NaN", "1e999"])
def test_non_finite_rating_is_an_error(tmp_path, task, real_rows, rating) -> None:
    source, q, a, _ = real_rows[3].split(",")
    path = write(tmp_path, HEADER + real_rows[0] + f"\n{source},{q},{a},{rating}\n")
    with pytest.raises(
        TaskDataError, match=r"s\.csv: line 3: column 'rating': rating .* is not a finite number"
    ):
        task.load(path)


def test_truncated_last_line_is_an_error(tmp_path, task, real_rows) -> None:
    complete = HEADER + "\n".join(real_rows[:3]) + "\n"
    assert len(task.load(write(tmp_path, complete))) == 3
    cut = complete[:-2]  # "...,14\n" cut to "...,1": still a well-formed row
    with pytest.raises(TaskDataError, match=r"line 4: the file ends without a line break"):
        task.load(write(tmp_path, cut))


def test_file_without_newlines_is_rejected_in_bounded_memory(tmp_path, task) -> None:
    path = write(tmp_path, HEADER.encode() + b"x" * (48 << 20))  # 48 MiB, one line
    tracemalloc.start()
    try:
        with pytest.raises(TaskDataError) as info:
            task.load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 40 << 20, f"peak {peak / 2**20:.0f} MiB to reject a 48 MiB line"
    assert re.search(r"line 2: longer than \d+ bytes without a line break", str(info.value)), info.value


def test_non_utf8_is_an_error_naming_the_line(tmp_path, task, real_rows) -> None:
    source, q, a, r = real_rows[1].split(",")
    body = (HEADER + real_rows[0] + "\n").encode() + b"caf\xe9," + f"{q},{a},{r}\n".encode()
    with pytest.raises(TaskDataError, match=r"s\.csv: line 3: byte 4 \(0xe9\) is not UTF-8"):
        task.load(write(tmp_path, body))
    with pytest.raises(TaskDataError, match=r"line 1: byte 2 is not UTF-8"):
        task.load(write(tmp_path, b"s\xffource,question,answer,rating\n"))


def test_bad_rows_found_by_the_fast_check_get_the_parser_message(tmp_path, task, real_rows) -> None:
    source, q, a, r = real_rows[5].split(",")
    wrong = a[:40] + a[41] + a[40] + a[42:]  # two answer cells swapped: rule broken
    cases = {
        f"{source},{q},{wrong},{r}": "line 3: answer inconsistent with question",
        f"{source},{q},{a[:80]},{r}": "line 3: answer has 80 characters",
        f"{source},{q[:80]}x,{a},{r}": "line 3: question has bad character 'x'",
        f"{source},{q},{a},{r},extra": "line 3: 5 fields, expected 4",
        f"{source},{q},{a},-3x": "line 3: column 'rating': rating '-3x' is not a number",
    }
    for row, message in cases.items():
        with pytest.raises(TaskDataError, match=message):
            task.load(write(tmp_path, HEADER + real_rows[0] + "\n" + row + "\n"))


# ------------------------------------------------------------------------------------- numpy folders


def _folder(tmp_path, task, real_rows):
    path = write(tmp_path, HEADER + "\n".join(real_rows) + "\n")
    ds = task.load(path)
    save_hrm_folder(ds, tmp_path / "prep", "train", vocab_size=task.vocab_size)
    return tmp_path / "prep", tmp_path / "prep" / "train"


def test_float_inputs_are_an_error_not_truncated(tmp_path, task, real_rows) -> None:
    root, folder = _folder(tmp_path, task, real_rows)
    np.save(folder / "all__inputs.npy", np.load(folder / "all__inputs.npy").astype(np.float32) + 0.5)
    with pytest.raises(
        TaskDataError, match=r"all__inputs\.npy: dtype float32: token arrays must hold integers"
    ):
        load_hrm_folder(root, "train")


def test_token_and_agreement_errors_name_row_and_column(tmp_path, task, real_rows) -> None:
    root, folder = _folder(tmp_path, task, real_rows)
    labels = np.load(folder / "all__labels.npy")
    bad = labels.copy()
    bad[7, 13] = 11
    np.save(folder / "all__labels.npy", bad)
    with pytest.raises(
        TaskDataError,
        match=r"all__labels\.npy: tokens outside \[0, vocab_size=11\): first at row 7, column 13",
    ):
        load_hrm_folder(root, "train")
    swapped = labels.copy()
    swapped[4, [0, 1]] = swapped[4, [1, 0]]
    np.save(folder / "all__labels.npy", swapped)
    assert len(load_hrm_folder(root, "train")) == len(real_rows)  # without a task: structure only
    with pytest.raises(
        TaskDataError, match=r"train: row 4: the label does not agree with the input \(incomplete"
    ):
        load_hrm_folder(root, "train", task=task)
    np.save(folder / "all__labels.npy", labels)
    difficulty = np.load(folder / "all__difficulty.npy")
    difficulty[2] = np.inf
    np.save(folder / "all__difficulty.npy", difficulty)
    with pytest.raises(TaskDataError, match=r"all__difficulty\.npy: row 2: difficulty is infinite"):
        load_hrm_folder(root, "train")
    difficulty[2] = np.nan
    np.save(folder / "all__difficulty.npy", difficulty)
    with pytest.raises(TaskDataError, match=r"row 2: difficulty is NaN but the row has a label"):
        load_hrm_folder(root, "train")


def test_folder_opens_memory_mapped_and_round_trips(tmp_path, task, real_rows) -> None:
    root, folder = _folder(tmp_path, task, real_rows)
    back = load_hrm_folder(root, "train", task=task)
    direct = task.load(tmp_path / "s.csv")
    assert np.array_equal(back.inputs, direct.inputs) and np.array_equal(back.labels, direct.labels)
    (folder / "all__difficulty.npy").unlink()  # HRM's own folders have none: blanks, computed vectorised
    assert back.difficulty.shape == (len(real_rows),)
    again = load_hrm_folder(root, "train", task=task)
    assert again.difficulty.tolist() == [float((x == 1).sum()) for x in direct.inputs]
    meta = json.loads((folder / "dataset.json").read_text())
    assert meta["vocab_size"] == 11 and meta["seq_len"] == 81


def test_maze_folder_agreement(tmp_path) -> None:
    from loopformer.tasks.maze import MazeTask

    task = MazeTask(7)
    ds = task.generate(5, seed=0)
    save_hrm_folder(ds, tmp_path, "train", vocab_size=task.vocab_size)
    assert len(load_hrm_folder(tmp_path, "train", task=task)) == 5
    labels = np.load(tmp_path / "train" / "all__labels.npy")
    wall = int(np.flatnonzero(ds.inputs[3] == 1)[0])
    labels[3, wall] = 5  # a path cell on a wall
    np.save(tmp_path / "train" / "all__labels.npy", labels)
    with pytest.raises(TaskDataError, match=r"row 3: the label does not agree with the input \(walls"):
        load_hrm_folder(tmp_path, "train", task=task)
