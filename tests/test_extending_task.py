"""A task defined outside the package, with its own validator, registered, trained and evaluated
through the command line (the worked example of docs/extending.md, "a task").

The task: every input token ``x`` in ``[0, K)`` must be answered by its successor ``(x + 1) mod K``
at the same position. ``check`` judges a prediction from the input alone (it never reads a label),
``difficulty`` counts the wrap-arounds (tokens ``K - 1``), ``parse_grid`` / ``format_grid`` give
``loopformer solve`` a text notation. Nothing in the package is edited: ``register_task`` makes
``data.task=successor_test`` a valid recipe key for ``loopformer data``, ``train``, ``eval`` and ``solve``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from loopformer.cli import cli
from loopformer.tasks.base import Task, TaskDataError, TokenDataset
from loopformer.tasks.registry import TASKS, register_task

K, T = 6, 8


class SuccessorTask(Task):
    name = "successor_test"
    vocab_size = K
    seq_len = T

    def generate(self, n: int, seed: int, **difficulty: Any) -> TokenDataset:
        if difficulty:
            raise TypeError(f"successor_test takes no generation options, got {sorted(difficulty)}")
        x = np.random.default_rng(seed).integers(0, K, size=(n, T))
        return TokenDataset(x, (x + 1) % K, (x == K - 1).sum(1), meta={"task": self.name})

    def check(self, inputs: np.ndarray, prediction: np.ndarray) -> bool:
        return bool(np.array_equal(np.asarray(prediction), (np.asarray(inputs) + 1) % K))

    def difficulty(self, inputs: np.ndarray) -> float:
        return float((np.asarray(inputs) == K - 1).sum())

    def parse_grid(self, text: str, what: str = "puzzle") -> np.ndarray:
        if len(text) != T or not set(text) <= set("012345"):
            raise TaskDataError(f"a successor_test {what} is {T} digits 0-{K - 1}, got {text!r}")
        return np.asarray([int(c) for c in text], dtype=np.int64)

    def format_grid(self, tokens: np.ndarray) -> str:
        return "".join(str(int(t)) for t in tokens)


RECIPE = {
    "model": {"name": "recurrent", "d_model": 32, "n_heads": 2, "n_layers": 1},
    "data": {"task": "successor_test", "train_size": 512, "eval_size": 64},
    "train": {
        "steps": 80,
        "batch_size": 32,
        "lr": 0.01,
        "warmup_steps": 5,
        "progress": False,
        "log_every": 20,
        "threads": 1,
        "loop_sampler": "fixed",
        "loop_sampler_options": {"n": 2},
    },
    "loop_train": {"max_steps": 2},
    "loop_eval": {"max_steps": 2},
    "eval": {"batch_size": 64},
    "device": "cpu",
}


@pytest.fixture(autouse=True, scope="module")
def registered() -> Iterator[None]:
    """Register the task for this module's tests (undone afterwards: other tests see the built-ins)."""
    register_task("successor_test", SuccessorTask)
    yield
    TASKS.pop("successor_test")


@pytest.fixture(scope="module")
def trained(registered: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("successor")
    (root / "recipe.yaml").write_text(yaml.safe_dump(RECIPE))
    result = CliRunner().invoke(cli, ["train", str(root / "recipe.yaml"), f"out_dir={root / 'run'}"])
    assert result.exit_code == 0, result.output
    assert "held-out, final (step 80): valid accuracy" in " ".join(result.output.split())
    return root / "run"


def test_the_validator_is_independent_of_the_labels() -> None:
    task = SuccessorTask()
    data = task.generate(16, seed=3)
    assert all(task.check(x, y) for x, y in zip(data.inputs, data.labels))
    wrong = data.labels.copy()
    wrong[:, 0] = (wrong[:, 0] + 1) % K
    assert not any(task.check(x, y) for x, y in zip(data.inputs, wrong))
    assert TASKS["successor_test"].endswith(":SuccessorTask")


def test_registered_task_trains_and_evaluates_through_the_cli(trained: Path, tmp_path: Path) -> None:
    summary = json.loads((trained / "summary.json").read_text())
    # chance for one exact row is (1/6)^8 (about 6e-7): the validator must accept most held-out answers
    assert summary["eval"]["valid_acc"] > 0.9 and summary["eval"]["n"] == 64
    out = tmp_path / "report"
    result = CliRunner().invoke(cli, ["eval", str(trained), "--no-analyses", "-o", str(out)])
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert "recurrent" in json.dumps(metrics) and "valid_accuracy" in json.dumps(metrics)
    assert summary["eval"]["valid_acc"] == pytest.approx(_valid_accuracy(metrics))


def test_solve_and_data_commands_use_the_tasks_notation(trained: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["solve", "successor_test", "01234501", "-c", str(trained), "--json"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.output)
    assert answer["solution"] == "12345012" and answer["valid"] is True
    # no file format of its own: `loopformer data` says so and writes an HRM folder instead
    result = CliRunner().invoke(
        cli, ["data", "successor_test", "--count", "5", "--out", str(tmp_path / "d.csv")]
    )
    assert result.exit_code != 0 and "use --format hrm" in result.output
    result = CliRunner().invoke(
        cli, ["data", "successor_test", "--count", "5", "--format", "hrm", "--out", str(tmp_path / "hrm")]
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "hrm" / "train" / "dataset.json").is_file()


def _valid_accuracy(metrics: dict) -> float:
    """The main model's valid accuracy from ``loopformer eval``'s metrics.json."""
    results = metrics["results"]
    entry = results[next(iter(results))] if isinstance(results, dict) else results[0]
    return float(entry["valid_accuracy"])
