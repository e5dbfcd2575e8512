"""Data that cannot be scored is not scored (issue 35).

Cases: an ARC test pair without an output became a held-out row whose labels are all ignored, which exact
accuracy counted as solved (nothing to get wrong); an ARC task in the held-out subset and in a training
subset was trained on and scored as held out; ``data prepare --from DIR`` without a test split exited 0
suggesting ``data.eval_path=OUT``, which fails later, and ``data prepare`` of ARC folders wrote the test
pairs without an output as rows of all-zero labels. Only the CLI, ``loopformer.config``,
``loopformer.runs.eval_dataset``, the task classes and files on disk are used.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from reliability_common import cli_text

from loopformer.cli import cli

GRID = [[1, 2], [3, 4]]


def _arc_task(path: Path, test_outputs: list[bool]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tests = [{"input": GRID, "output": GRID} if known else {"input": GRID} for known in test_outputs]
    path.write_text(json.dumps({"train": [{"input": GRID, "output": GRID}], "test": tests}))


def _arc_recipe(tmp_path: Path, source: Path) -> Path:
    recipe = tmp_path / "arc.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"name": "fprm", "d_model": 16, "n_heads": 2, "n_layers": 1},
        "data": {"task": "arc", "options": {"source": str(source), "translate": False},
                 "train_generate": {"part": "train"}, "eval_generate": {"part": "test"},
                 "train_size": 0, "eval_size": 0},
        "train": {"mode": "simple", "steps": 1, "batch_size": 2, "progress": False, "threads": 1, "eval_every": 0},
        "loop_train": {"max_steps": 2}, "loop_eval": {"max_steps": 2}, "eval": {"batch_size": 4}, "device": "cpu",
    }))  # fmt: skip
    return recipe


def test_held_out_rows_without_labels_are_left_out_and_counted(tmp_path) -> None:
    from loopformer.config import load_config
    from loopformer.runs import eval_dataset
    from loopformer.tasks.registry import get_task

    for i in range(2):  # each task: one test pair with its output, one without
        _arc_task(tmp_path / "arc" / f"t{i}.json", [True, False])
    recipe = _arc_recipe(tmp_path, tmp_path / "arc")
    cfg = load_config(recipe)
    held_out = eval_dataset(get_task(cfg.data.task, **cfg.data.options), cfg)
    assert len(held_out) == 2 and bool((held_out.labels != -100).any(axis=1).all())
    run, report = tmp_path / "run", tmp_path / "report"
    assert CliRunner().invoke(cli, ["train", str(recipe), "-o", str(run)]).exit_code == 0
    result = CliRunner().invoke(cli, ["eval", str(run), "--no-analyses", "-o", str(report)])
    assert result.exit_code == 0, cli_text(result)[-600:]
    metrics = json.loads((report / "metrics.json").read_text())
    assert next(iter(metrics["results"].values()))["n"] == 2
    assert "2 rows without labels left out" in (report / "report.md").read_text()


def test_an_arc_task_in_the_held_out_subset_and_a_training_subset_is_refused(tmp_path) -> None:
    from loopformer.tasks.arc import ArcTask
    from loopformer.tasks.base import TaskDataError

    for subset in ("training", "evaluation"):
        _arc_task(tmp_path / "arc" / subset / "same_id.json", [True])
    _arc_task(tmp_path / "arc" / "training" / "other.json", [True])
    with pytest.raises(TaskDataError, match="same_id.*training.*evaluation"):
        ArcTask(source=str(tmp_path / "arc"), subsets=["training", "evaluation"], test_subset="evaluation")


def test_data_prepare_without_a_test_split_says_how_to_evaluate(tmp_path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    gen = CliRunner().invoke(cli, ["data", "generate", "sudoku", "--size", "9", "--count", "4", "-o",
                                   str(source / "train.csv")])  # fmt: skip
    assert gen.exit_code == 0, cli_text(gen)
    out = tmp_path / "prepared"
    result = CliRunner().invoke(cli, ["data", "prepare", "sudoku-extreme", "-o", str(out), "--from", str(source),
                                      "--augment", "1", "--subset", "0"])  # fmt: skip
    text = " ".join(cli_text(result).split())
    assert result.exit_code in (0, 1) and "Traceback" not in text and "internal error" not in text, text
    assert not (out / "test").exists()
    assert "no test split" in text.lower() and "data.eval_path" in text, text
    assert f"data.eval_path={out} " not in text + " "  # never the evaluation path that cannot work


def test_data_prepare_of_arc_leaves_out_test_pairs_without_an_output(tmp_path) -> None:
    _arc_task(tmp_path / "arc" / "training" / "a.json", [True])
    _arc_task(tmp_path / "arc" / "evaluation" / "b.json", [True, False])
    out = tmp_path / "prepared"
    result = CliRunner().invoke(cli, ["data", "prepare", "arc-agi-1", "-o", str(out), "--from", str(tmp_path / "arc"),
                                      "--augment", "0"])  # fmt: skip
    assert result.exit_code == 0, cli_text(result)[-600:]
    labels = np.load(out / "test" / "all__labels.npy")
    assert len(labels) == 1 and (labels != 0).any()  # the pair with its output; none of all-zero labels
    assert json.loads((out / "prepare.json").read_text())["pairs_without_output"] == {"test": 1}
