"""The 9x9 CPU recipe (``sudoku9_fprm``) at tiny size, and the hidden-difficulty check: a model trained on
generated 9x9 puzzles, given the two real Sudoku-Extreme rows, reports valid / invalid (the validator's
verdict, recomputed here) and its loop steps without error."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from loopformer.cli import cli
from loopformer.config import build_config, read_recipe
from loopformer.tasks.sudoku import SudokuTask

EXTREME = [  # sapientinc/sudoku-extreme test rows (also in tests/test_tasks_sudoku.py)
    "5...27..9..41......1..5.3...92.6.8...5......66..7..29.8...7...2.......8...9..36..",
    ".....8..1.6.9..2...4.52.9..4..6......9..45..6....924..9......7........3.35.2..6..",
]
TINY = ["model.d_model=16", "model.n_heads=2", "model.n_layers=1", "data.train_size=32", "data.eval_size=8",
        "train.steps=3", "train.batch_size=8", "train.max_segments=2", "train.progress=false",
        "train.eval_every=0", "train.checkpoint_every=0", "data.curriculum.check_every=2",
        "loop_eval.max_steps=6", "eval.batch_size=8"]


@pytest.fixture(scope="module")
def run9(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loopformer.train.trainer import Trainer

    out = tmp_path_factory.mktemp("sudoku9")
    raw = read_recipe("sudoku9_fprm")
    raw.pop("run", None)  # the `loopformer run` table (inherited from the default recipe)
    cfg = build_config(raw, [*TINY, f"out_dir={out}"])
    assert cfg.data.options == {"size": 9} and cfg.data.curriculum.enabled
    assert cfg.model.fields.get("mixer") == "mlp"
    summary = Trainer(cfg).fit()
    assert summary["eval"]["n"] == 8
    return out


@pytest.mark.parametrize("row", EXTREME)
def test_sudoku_extreme_rows_report_valid_and_steps(run9: Path, row: str) -> None:
    result = CliRunner().invoke(cli, ["solve", "sudoku", row, "-c", str(run9), "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output.strip().splitlines()[-1])
    task = SudokuTask(9)
    solution = np.asarray(record["solution_tokens"])
    assert solution.shape == (81,)
    assert record["valid"] == task.check(task.parse_grid(row), solution)
    assert 1 <= record["steps"] <= 6 and len(record["trajectory"]) == record["steps"]
