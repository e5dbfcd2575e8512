"""Issue 16, numerical faults and solve: a model with NaN or diverged weights is never scored (eval and
solve exit non-zero with a clear message), ``solve`` reports contradictory / unsolvable givens with the
task's exact solver, and ``solve --json`` always has the same keys."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from loopformer.cli import cli
from loopformer.commands.solve import SOLVE_JSON_KEYS
from loopformer.config import build_config
from loopformer.train.checkpoint import resolve_checkpoint, save_weights
from loopformer.train.manifest import write_manifest

TINY = {
    "model": {"name": "fprm", "d_model": 16, "n_heads": 2, "n_layers": 1, "conv": "grid2d"},
    "data": {
        "task": "sudoku",
        "options": {"size": 4},
        "train_generate": {"min_blanks": 4, "max_blanks": 8},
        "eval_generate": {"min_blanks": 4, "max_blanks": 8},
        "train_size": 16,
        "eval_size": 6,
    },
    "train": {
        "mode": "deep_supervision",
        "steps": 2,
        "batch_size": 8,
        "max_segments": 2,
        "progress": False,
        "ema": 0.9,
        "log_every": 1,
    },
    "loop_train": {"max_steps": 2},
    "loop_eval": {"max_steps": 3},
    "eval": {"batch_size": 16},
}
PUZZLE = ".2.34....4.2..3."  # a 4x4 puzzle with one solution


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loopformer.train.trainer import Trainer

    out = tmp_path_factory.mktemp("tiny_run")
    Trainer(build_config({**TINY, "out_dir": str(out)})).fit()
    return out


def _broken_copy(run: Path, dest: Path, how: str) -> Path:
    shutil.copytree(run, dest)
    folder = resolve_checkpoint(dest)
    for name in ("model.safetensors", "ema.safetensors"):
        tensors = load_file(str(folder / name))
        key = next(k for k, v in tensors.items() if v.is_floating_point() and v.dim() == 2)
        if how == "nan":
            tensors[key] = torch.full_like(tensors[key], float("nan"))
        else:  # diverged: finite, astronomically large weights
            tensors = {k: v * 1e30 if v.is_floating_point() else v for k, v in tensors.items()}
        save_weights(tensors, folder / name)
    write_manifest(folder)  # a consistent checkpoint whose values are broken
    return dest


def _fails_cleanly(result, *needles: str) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and "internal error" not in result.output
    for needle in needles:
        assert needle in result.output, result.output
    return result.output


def test_eval_and_solve_refuse_nan_weights(tiny_run, tmp_path) -> None:
    run = _broken_copy(tiny_run, tmp_path / "nan", "nan")
    runner = CliRunner()
    _fails_cleanly(runner.invoke(cli, ["eval", str(run), "--no-analyses", "-n", "4"]), "NaN or infinite")
    assert not list(run.glob("eval-*/report.md"))  # no report of a broken model
    result = runner.invoke(cli, ["solve", "sudoku", PUZZLE, "-c", str(run)])
    _fails_cleanly(result, "NaN or infinite")


def test_eval_and_solve_refuse_diverged_weights(tiny_run, tmp_path) -> None:
    run = _broken_copy(tiny_run, tmp_path / "big", "diverged")
    runner = CliRunner()
    out = _fails_cleanly(
        runner.invoke(cli, ["eval", str(run), "--no-analyses", "-n", "4"]), "NaN or infinite"
    )
    assert "0.0%" not in out
    result = runner.invoke(cli, ["solve", "sudoku", PUZZLE, "-c", str(run), "--json"])
    assert result.exit_code == 1
    record = json.loads(result.output.strip().splitlines()[0])
    assert tuple(record) == SOLVE_JSON_KEYS
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
    import subprocess
    import sys

    run = tmp_path / "busy"
    shutil.copytree(tiny_run, run)
    code = (
        "import time; from loopformer.train.run_folder import RunLock; "
        f"RunLock({str(run)!r}, 'train').acquire(); print('locked', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        result = CliRunner().invoke(cli, ["eval", str(run), "--no-analyses", "-n", "2"])
        _fails_cleanly(result, f"in use by process {proc.pid}")
    finally:
        proc.kill()
        proc.wait()
