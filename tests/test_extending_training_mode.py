"""A training mode defined outside the package, registered and selected by ``train.mode``.

The worked example of docs/extending.md ("a training mode"): a depth
curriculum that runs ``1 + step // 2`` loops at step ``step`` (capped at ``loop_train.max_steps``)
on a fresh batch, and carries the deepest loop it has reached, so a resumed run continues the
count. The test checks that the trainer called the mode's hook with the segment count the mode
asked for on every step, that it learns, and that its carried state survives a resume.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_train_utils import TinyLooped, tiny_config, tiny_dataset

from loopformer.config import ConfigError
from loopformer.models.base import ModelOutput
from loopformer.train import Trainer
from loopformer.train.modes import TRAINING_MODES, SegmentBatch, TrainingMode, register_training_mode


class DepthCurriculum(TrainingMode):
    """``1 + step // 2`` fixed loops per step (capped at ``loop_train.max_steps``)."""

    name = "depth_curriculum_test"

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer)
        self.deepest = 0
        self.calls: list[tuple[int, int, int]] = []  # (step, loops asked for, loops the engine ran)

    def loops(self, step: int) -> int:
        return min(1 + step // 2, self.trainer.loop_train.max_steps)

    def batch(self, step: int) -> SegmentBatch:
        b = self.trainer.next_batch()
        loop = dataclasses.replace(
            self.trainer.loop_train, max_steps=self.loops(step), halting="fixed", min_steps=0
        )
        return SegmentBatch(b.inputs, b.labels, b.puzzle_ids, None, loop, {"loops": self.loops(step)})

    def after_step(self, batch: SegmentBatch, out: ModelOutput, step: int) -> dict[str, Any]:
        ran = int(out.loop.steps.max())
        self.calls.append((step, batch.loop.max_steps, ran))
        self.deepest = max(self.deepest, ran)
        return {"deepest": self.deepest}

    def state_dict(self) -> Any:
        return {"deepest": self.deepest}

    def load_state_dict(self, saved: Any, folder: Path) -> None:
        self.deepest = int(saved["deepest"])


@pytest.fixture(autouse=True, scope="module")
def registered() -> Iterator[None]:
    """``register_training_mode`` (usually a class decorator), undone after this module's tests so
    that other tests see the built-in registry."""
    register_training_mode(DepthCurriculum)
    yield
    TRAINING_MODES.pop(DepthCurriculum.name)


def _trainer(tmp_path: Path, *overrides: str) -> Trainer:
    cfg = tiny_config(tmp_path, "train.mode=depth_curriculum_test", "loop_train.max_steps=4", *overrides)
    return Trainer(
        cfg, model=TinyLooped(seed=0), train_data=tiny_dataset(64), eval_data=tiny_dataset(32, seed=1)
    )


def test_registered_mode_is_selected_by_config_and_its_hook_sees_each_segment_count(tmp_path) -> None:
    assert TRAINING_MODES["depth_curriculum_test"] is DepthCurriculum
    tr = _trainer(tmp_path, "train.steps=30", "train.lr=0.03", "train.batch_size=32")
    assert isinstance(tr.mode, DepthCurriculum)
    summary = tr.fit()
    expected = [(s, min(1 + s // 2, 4), min(1 + s // 2, 4)) for s in range(30)]
    assert tr.mode.calls == expected  # the engine ran exactly the loops the mode asked for
    assert summary["train"]["deepest"] == 4 and summary["train"]["loops"] == 4
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first, last = [m for m in lines if "loss" in m][0], [m for m in lines if "loss" in m][-1]
    assert last["task_loss"] < first["task_loss"] - 0.5  # it trains
    assert summary["eval"]["n"] == 32 and summary["eval"]["token_acc"] > 0.5


def test_the_mode_state_is_checkpointed_and_restored(tmp_path) -> None:
    _trainer(tmp_path, "train.steps=5").fit()  # deepest loop reached in steps 0..4: 1 + 4 // 2 = 3
    resumed = _trainer(tmp_path, "train.steps=7", "train.resume=true")
    assert resumed.step == 5 and resumed.mode.deepest == 3
    resumed.fit()
    assert resumed.mode.calls == [(5, 3, 3), (6, 4, 4)] and resumed.mode.deepest == 4


def test_an_unknown_mode_names_the_registered_ones(tmp_path) -> None:
    # the recipe key is checked against the registry when the config is read ...
    with pytest.raises(
        ConfigError,
        match=r"train.mode: 'deep_supervison' is not one of \['simple', 'deep_supervision', "
        r"'depth_curriculum_test'\]; did you mean 'deep_supervision'",
    ):
        _trainer(tmp_path, "train.mode=deep_supervison")
    # ... and a config changed in code meets the same registry in the trainer
    cfg = tiny_config(tmp_path)
    cfg.train.mode = "depth_curiculum_test"
    with pytest.raises(
        ConfigError,
        match=r"unknown training mode 'depth_curiculum_test'.*did you mean 'depth_curriculum_test'",
    ):
        Trainer(cfg, model=TinyLooped(seed=0), train_data=tiny_dataset(8))
