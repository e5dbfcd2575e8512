"""Issue 16, numerical faults and solve: a model with NaN or diverged weights is never scored (eval and
solve exit non-zero with a clear message), ``solve`` reports contradictory / unsolvable givens with the
task's exact solver, and ``solve --json`` always has the same keys."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from reliability_common import PUZZLE, break_weights, fails_cleanly, hold_lock, tiny_recipe

from loopformer.cli import cli
from loopformer.commands.solve import SOLVE_JSON_KEYS
from loopformer.config import build_config


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loopformer.train.trainer import Trainer

    out = tmp_path_factory.mktemp("tiny_run")
    Trainer(build_config({**tiny_recipe(), "out_dir": str(out)})).fit()
    return out


# eval of NaN / diverged weights: tests/test_reliability_cases.py::test_eval_refuses_broken_weights
@pytest.mark.parametrize("how", ["nan", "diverged"])
def test_solve_refuses_broken_weights_with_one_json_schema(tiny_run, tmp_path, how) -> None:
    # NaN weights are refused when the checkpoint loads, diverged ones when their logits are not finite
    run = break_weights(tiny_run, tmp_path / how, how)
    runner = CliRunner()
    fails_cleanly(runner.invoke(cli, ["solve", "sudoku", PUZZLE, "-c", str(run)]), "NaN or infinite")
    result = runner.invoke(cli, ["solve", "sudoku", PUZZLE, "-c", str(run), "--json"])
    assert result.exit_code == 1
    record = json.loads(result.output.strip().splitlines()[0])
    assert tuple(record) == SOLVE_JSON_KEYS and record["schema"] == "loopformer.solve/1"
    assert record["solution"] is None and "NaN or infinite" in record["error"] and record["valid"] is False


@pytest.mark.parametrize(
    ("puzzle", "status", "detail"),
    [
        ("11..............", "contradictory", "digit 1 appears twice in row 1"),
        ("1....1..........", "contradictory", "digit 1 appears twice in box 1"),
        ("1...............", "not unique", "more than one solution"),
    ],
)
def test_solve_reports_bad_givens_with_the_exact_solver(tiny_run, puzzle, status, detail) -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["solve", "sudoku", puzzle, "-c", str(tiny_run), "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)
    assert tuple(record) == SOLVE_JSON_KEYS and record["schema"] == "loopformer.solve/1"
    assert record["givens"]["status"] == status and detail in record["givens"]["detail"]
    text = runner.invoke(cli, ["solve", "sudoku", puzzle, "-c", str(tiny_run)])
    assert text.exit_code == 0 and status in text.output and detail in text.output


def test_unsolvable_sudoku_without_duplicates_is_reported(tiny_run) -> None:
    # no digit repeats, yet cell (1,4) has no candidate left: row 1 holds 1 2 3, column 4 holds 4
    puzzle = "123............4"
    record = json.loads(
        CliRunner().invoke(cli, ["solve", "sudoku", puzzle, "-c", str(tiny_run), "--json"]).output
    )
    assert record["givens"]["status"] == "unsolvable"


def test_solve_json_schema_is_stable_for_a_good_puzzle(tiny_run) -> None:
    result = CliRunner().invoke(cli, ["solve", "sudoku", PUZZLE, "-c", str(tiny_run), "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)
    assert tuple(record) == SOLVE_JSON_KEYS
    assert record["givens"] == {"status": "solvable", "detail": None} and record["error"] is None
    assert isinstance(record["solution"], str | None) and record["steps"] >= 1
    assert len(record["solution_tokens"]) == 16 and len(record["trajectory"]) == record["steps"]


def test_eval_is_kept_out_of_a_run_folder_in_use(tiny_run, tmp_path) -> None:
    run = tmp_path / "busy"
    shutil.copytree(tiny_run, run)
    proc = hold_lock(run)
    try:
        result = CliRunner().invoke(cli, ["eval", str(run), "--no-analyses", "-n", "2"])
        fails_cleanly(result, f"in use by process {proc.pid}")
    finally:
        proc.kill()
        proc.wait()
