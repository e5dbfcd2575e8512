"""The ``loopformer`` command line: models table, solve / eval on a tiny checkpoint trained here through
the harness, one-line errors, and ``loopformer run`` (fast: a few steps; slow: the full default)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from loopformer.cli import cli
from loopformer.config import build_config
from loopformer.eval.evaluate import evaluate
from loopformer.tasks.sudoku import SudokuTask

TINY = {
    "model": {"name": "fprm", "d_model": 16, "n_heads": 2, "n_layers": 1, "conv": "grid2d"},
    "data": {"task": "sudoku", "options": {"size": 4}, "train_generate": {"min_blanks": 4, "max_blanks": 8},
             "eval_generate": {"min_blanks": 4, "max_blanks": 8}, "train_size": 24, "eval_size": 10},
    "train": {"mode": "deep_supervision", "steps": 3, "batch_size": 8, "max_segments": 2, "progress": False,
              "ema": 0.9, "log_every": 1},
    "loop_train": {"max_steps": 3, "grad": "truncated", "grad_steps": 2},
    "loop_eval": {"max_steps": 5},
    "eval": {"batch_size": 16},
}
PUZZLE = "1.3.....2...4.2."  # a 4x4 puzzle


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loopformer.train.trainer import Trainer

    out = tmp_path_factory.mktemp("tiny_run")
    cfg = build_config({**TINY, "out_dir": str(out)})
    Trainer(cfg).fit()
    return out


@pytest.fixture(scope="module")
def tiny_recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import yaml

    path = tmp_path_factory.mktemp("recipes") / "tiny.yaml"
    path.write_text(yaml.safe_dump({**TINY, "run": {"budgets": [1, 2], "lens_loops": 3, "signal_loops": 3,
                                                     "analysis_examples": 6}}))
    return path


def _one_line_error(result) -> str:
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    return lines[0]


def test_models_table_counts_paper_and_cpu_sizes() -> None:
    from loopformer.models import MODELS, build_model
    from loopformer.models.fprm import paper_config

    result = CliRunner().invoke(cli, ["models", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(result.output)}
    assert set(rows) == set(MODELS)
    fprm = build_model("fprm", config=paper_config())
    assert rows["fprm"]["paper"] == sum(p.numel() for p in fprm.parameters() if p.requires_grad or True) - sum(
        p.numel() for n, p in fprm.named_parameters() if "puzzle_emb" in n
    )
    assert rows["transformer"]["cpu"] == build_model("transformer").num_parameters()
    table = CliRunner().invoke(cli, ["models"])
    assert table.exit_code == 0 and "fprm" in table.output and "6.83M" in table.output


def test_solve_json_on_a_trained_checkpoint(tiny_run: Path) -> None:
    result = CliRunner().invoke(cli, ["solve", "sudoku", PUZZLE, "--checkpoint", str(tiny_run), "--json"])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    task = SudokuTask(size=4)
    tokens = task.parse_grid(PUZZLE)
    solution = np.asarray(record["solution_tokens"])
    if isinstance(record["solution"], str):  # the grid text, when every token is a digit or a blank
        assert np.array_equal(task.parse_grid(record["solution"]), solution)
    assert record["valid"] == task.check(tokens, solution)  # the validator's verdict, recomputed here
    assert 1 <= record["steps"] <= 5 and len(record["trajectory"]) == record["steps"]
    assert record["trajectory"][-1] == record["solution"]
    text = CliRunner().invoke(cli, ["solve", "sudoku", PUZZLE, "-c", str(tiny_run)])
    assert text.exit_code == 0, text.output
    assert "loop 1" in text.output and ("VALID" in text.output)
    # the plain-text marks are explained (issue 25)
    assert "(x): filled in by the model; !x!: breaks a rule" in " ".join(text.output.split())


def test_ctrl_c_says_what_it_interrupted(monkeypatch: pytest.MonkeyPatch) -> None:
    from loopformer.commands import models as models_cmd

    def interrupted() -> list:
        raise KeyboardInterrupt

    monkeypatch.setattr(models_cmd, "model_rows", interrupted)
    result = CliRunner().invoke(cli, ["models"])
    assert result.exit_code == 130 and "Aborted!" not in result.output
    assert "interrupted (Ctrl-C): loopformer models stopped" in result.output
    from loopformer.commands.common import interrupted_message

    assert "train.resume=true" in interrupted_message("train")


def test_eval_writes_report_matching_evaluate(tiny_run: Path, tmp_path: Path) -> None:
    from loopformer.runs import eval_dataset, load_run

    out = tmp_path / "ev"
    result = CliRunner().invoke(cli, ["eval", str(tiny_run), "--max-steps", "1,3", "--out", str(out),
                                      "--lens-loops", "2"])
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert (out / "report.md").is_file() and (out / "plots" / "logit_lens.png").is_file()
    run = load_run(tiny_run)
    direct = evaluate(run.model, run.task, eval_dataset(run.task, run.config), loop=run.loop_eval)
    (label,) = metrics["results"]
    assert metrics["results"][label]["valid_accuracy"] == pytest.approx(direct.valid_accuracy)
    assert metrics["results"][label]["token_accuracy"] == pytest.approx(direct.token_accuracy)
    assert [p["budget"] for p in metrics["budget"][label]["points"]] == [1, 3]
    assert len(metrics["logit_lens"]["loops"]) == 2


def test_errors_are_one_line(tiny_run: Path, tmp_path: Path, tiny_recipe: Path) -> None:
    runner = CliRunner()
    line = _one_line_error(runner.invoke(cli, ["eval", str(tmp_path / "missing")]))
    assert "does not exist" in line
    line = _one_line_error(runner.invoke(cli, ["train", str(tiny_recipe), "train.lrr=1e-3"]))
    assert "train.lrr" in line and "train.lr" in line
    line = _one_line_error(runner.invoke(cli, ["train", "no_such_recipe_xyz"]))
    assert "no recipe" in line
    line = _one_line_error(runner.invoke(cli, ["solve", "maze", PUZZLE, "-c", str(tiny_run)]))
    assert "sudoku" in line and "maze" in line
    line = _one_line_error(runner.invoke(cli, ["solve", "sudoku", "12", "-c", str(tiny_run)]))
    assert "characters" in line
    line = _one_line_error(runner.invoke(cli, ["eval", str(tiny_run), "--set", "model.d_model=8"]))
    assert "data.*" in line
    # a corrupt checkpoint: truncate the weights file of a copy
    import shutil

    from loopformer.runs.checkpoint import resolve_checkpoint

    bad = tmp_path / "bad"
    shutil.copytree(resolve_checkpoint(tiny_run), bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    line = _one_line_error(runner.invoke(cli, ["eval", str(bad)]))
    assert "corrupt" in line
    # --debug shows the real exception instead
    debug = runner.invoke(cli, ["--debug", "eval", str(tmp_path / "missing")])
    assert debug.exit_code != 0 and debug.exception is not None and type(debug.exception).__name__ == "CheckpointError"


def test_run_fast_with_overrides(tiny_recipe: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["run", "--recipe", str(tiny_recipe), "--out", str(out), "train.steps=2",
                                      "run.spectral=false"])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    for key in ("heldout_accuracy", "baseline_accuracy", "baseline", "task", "mean_steps_by_difficulty", "checkpoint"):
        assert key in summary, key
    assert summary["baseline_model"] == "transformer"
    assert Path(summary["checkpoint"], "model.safetensors").is_file()
    metrics = json.loads((out / "metrics.json").read_text())
    assert summary["heldout_accuracy"] == metrics["results"]["fprm"]["valid_accuracy"]
    # the baseline has equal shared sizes and was trained for the same steps
    base_cfg = json.loads((out / "baseline" / "config.json").read_text())
    assert base_cfg["model"]["d_model"] == TINY["model"]["d_model"] and base_cfg["train"]["steps"] == 2
    assert (out / "report.md").is_file() and "held-out accuracy" in result.output


@pytest.mark.slow
@pytest.mark.timeout(900)  # the issue allows 15 minutes; about 2.5 minutes on an idle 2-core machine
def test_default_run_beats_baseline(tmp_path: Path) -> None:
    """The full `loopformer run` (default recipe): under 15 minutes, FPRM >= baseline + 10 points."""
    t0 = time.perf_counter()
    result = CliRunner().invoke(cli, ["run", "--out", str(tmp_path / "default")])
    elapsed = time.perf_counter() - t0
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "default" / "summary.json").read_text())
    assert elapsed < 15 * 60, elapsed
    assert summary["heldout_accuracy"] >= summary["baseline_accuracy"] + 0.10, summary
    assert np.isfinite(summary["heldout_accuracy"])


def test_default_recipe_is_found_from_any_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from loopformer.commands.run import build_run_configs
    from loopformer.config import find_recipe

    monkeypatch.chdir(tmp_path)
    path = find_recipe("default")
    assert path.name == "default.yaml" and path.is_file()
    main, base, section, description = build_run_configs("default", ("train.steps=7", "baseline.train.lr=0.01"),
                                                         tmp_path / "out")
    assert main.model.name == "fprm" and base.model.name == "transformer"
    assert main.train.steps == base.train.steps == 7 and base.train.lr == 0.01 != main.train.lr
    assert base.train.mode == "simple" and base.loop_train.changes == {} and description
    for key in ("d_model", "n_heads", "n_layers"):
        assert base.model.fields[key] == main.model.fields[key]


def test_run_evaluates_with_the_configured_segments(tiny_recipe: Path, tmp_path: Path) -> None:
    """``loopformer run`` passes eval.segments (and the run's seed) to its evaluation, like ``loopformer eval``."""
    from loopformer.runs import eval_dataset, load_run

    out = tmp_path / "run"
    result = CliRunner().invoke(cli, ["run", "--recipe", str(tiny_recipe), "--out", str(out), "train.steps=2",
                                      "run.spectral=false", "eval.segments=3", "seed=5"])
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.json").read_text())["results"]["fprm"]
    run = load_run(json.loads((out / "summary.json").read_text())["checkpoint"])
    dataset = eval_dataset(run.task, run.config)
    by_hand = {s: evaluate(run.model, run.task, dataset, loop=run.loop_eval, batch_size=16, seed=5, segments=s)
               for s in (1, 3)}
    assert metrics["token_accuracy"] == pytest.approx(by_hand[3].token_accuracy)
    assert metrics["mean_steps"] == pytest.approx(by_hand[3].mean_steps)
    assert by_hand[3].mean_steps != pytest.approx(by_hand[1].mean_steps)  # the check can fail


def test_train_prints_whole_plain_lines_in_a_log(tiny_recipe: Path, tmp_path: Path) -> None:
    """Not a terminal (a log file, a pipe): progress as plain lines, result lines never wrapped at 80 columns."""
    out = tmp_path / ("a_run_folder_whose_path_is_longer_than_eighty_columns_" * 2)
    result = CliRunner().invoke(cli, ["train", str(tiny_recipe), "train.steps=2", "train.progress=true",
                                      "-o", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(line.startswith("step 2/2  loss ") for line in lines), result.output
    assert any(line.startswith("held-out, ") and "mean steps" in line for line in lines), result.output
    assert any(line.startswith("checkpoint: ") and str(out) in line for line in lines), result.output
    assert "\x1b[" not in result.output  # no terminal styling in a log
