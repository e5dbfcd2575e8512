"""`loopformer data`: the exact generation commands write files that load back; show, stats, options."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from loopformer.cli import _attach_subcommands, cli
from loopformer.commands.data import split_options
from loopformer.tasks.formats import load_hrm_folder
from loopformer.tasks.maze import MazeTask
from loopformer.tasks.sudoku import SudokuTask

_attach_subcommands()


def run(args: list[str], cwd=None) -> str:
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_exact_sudoku_command(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    run(["data", "sudoku", "--size", "9", "--count", "200", "--seed", "0", "--out", "puzzles.csv"])
    lines = (tmp_path / "puzzles.csv").read_text().splitlines()
    assert lines[0] == "source,question,answer,rating" and len(lines) == 201
    source, question, answer, rating = lines[1].split(",")
    assert len(question) == 81 and "." in question and "." not in answer
    assert int(rating) == question.count(".")
    task = SudokuTask(9)
    ds = task.load(tmp_path / "puzzles.csv")
    assert len(ds) == 200 and len({r.tobytes() for r in ds.inputs}) == 200
    assert all(task.check(x, y) for x, y in zip(ds.inputs, ds.labels))
    assert all(task.count_solutions(x) == 1 for x in ds.inputs[:20])
    assert np.array_equal(ds.difficulty, (ds.inputs == 1).sum(1))


def test_exact_maze_command(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    run(["data", "maze", "--size", "15", "--count", "50", "--seed", "0", "--out", "mazes.csv"])
    task = MazeTask(15)
    ds = task.load(tmp_path / "mazes.csv")
    assert len(ds) == 50 and ds.inputs.shape[1] == 225
    assert all(task.check(x, y) for x, y in zip(ds.inputs, ds.labels))
    assert np.array_equal(ds.difficulty, [task.difficulty(x) for x in ds.inputs])


@pytest.mark.parametrize("size", [4, 6])
def test_other_box_shapes_and_explicit_generate(tmp_path, size: int) -> None:
    out = tmp_path / f"s{size}.csv"
    run(
        [
            "data",
            "generate",
            "sudoku",
            "--size",
            str(size),
            "--count",
            "10",
            "--out",
            str(out),
            "-t",
            "min_blanks=5",
        ]
    )
    ds = SudokuTask(size).load(out)
    assert ds.inputs.shape == (10, size * size) and (ds.difficulty >= 5).all()


def test_options_routing_and_errors(tmp_path) -> None:
    init_kw, gen_kw = split_options(SudokuTask, {"size": 4, "box": [2, 2], "max_blanks": 8})
    assert init_kw == {"size": 4, "box": [2, 2]} and gen_kw == {"max_blanks": 8}
    out = tmp_path / "x.csv"
    result = CliRunner().invoke(cli, ["data", "sudoku", "--count", "2", "--out", str(out), "-t", "bogus=1"])
    assert (
        result.exit_code != 0
        and "unknown option(s) ['bogus']" in result.output
        and "max_blanks" in result.output
    )
    result = CliRunner().invoke(cli, ["data", "sudokku", "--count", "2", "--out", str(out)])
    assert result.exit_code != 0 and "did you mean 'sudoku'" in result.output
    result = CliRunner().invoke(cli, ["data", "sudoku", "--count", "2", "--out", str(out), "-t", "novalue"])
    assert result.exit_code != 0 and "key=value" in result.output
    run(
        [
            "data",
            "sudoku",
            "--size",
            "6",
            "--count",
            "3",
            "--out",
            str(out),
            "-t",
            "box=[3,2]",
            "-t",
            "max_blanks=10",
        ]
    )
    ds = SudokuTask(6, box=(3, 2)).load(out)
    assert all(SudokuTask(6, box=(3, 2)).check(x, y) for x, y in zip(ds.inputs, ds.labels))
    assert not all(SudokuTask(6).check(x, y) for x, y in zip(ds.inputs, ds.labels))


def test_show_and_stats(tmp_path) -> None:
    out = tmp_path / "s4.csv"
    run(["data", "sudoku", "--size", "4", "--count", "12", "--out", str(out)])
    shown = run(["data", "show", "sudoku", str(out), "--index", "2", "--plain"])
    assert "example 2" in shown and "valid by task.check: True" in shown and "(" in shown
    stats = run(["data", "stats", "sudoku", str(out)])
    assert "12 examples" in stats and "difficulty histogram" in stats
    mazes = tmp_path / "m.csv"
    run(["data", "maze", "--size", "9", "--count", "5", "--out", str(mazes), "-t", "min_path=6"])
    assert "valid by task.check: True" in run(["data", "show", "maze", str(mazes), "-i", "4"])
    assert "5 examples" in run(["data", "stats", "maze", str(mazes)])
    bad = CliRunner().invoke(cli, ["data", "show", "maze", str(mazes), "--index", "9"])
    assert bad.exit_code != 0 and "out of range" in bad.output
    broken = tmp_path / "broken.csv"
    broken.write_text(out.read_text()[:-10])
    bad = CliRunner().invoke(cli, ["data", "stats", "sudoku", str(broken)])
    assert bad.exit_code != 0 and "line 13" in bad.output


def test_hrm_format_output(tmp_path) -> None:
    run(
        [
            "data",
            "maze",
            "--size",
            "7",
            "--count",
            "4",
            "--out",
            str(tmp_path / "hrm"),
            "--format",
            "hrm",
            "-t",
            "min_path=4",
        ]
    )
    ds = load_hrm_folder(tmp_path / "hrm", "train")
    task = MazeTask(7)
    assert len(ds) == 4 and all(task.check(x, y) for x, y in zip(ds.inputs, ds.labels))
    assert "4 examples" in run(["data", "stats", "maze", str(tmp_path / "hrm"), "-t", "size=7"])


def test_entry_point_subprocess(tmp_path) -> None:
    out = tmp_path / "p.csv"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loopformer",
            "data",
            "sudoku",
            "--size",
            "4",
            "--count",
            "3",
            "--seed",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(SudokuTask(4).load(out)) == 3
