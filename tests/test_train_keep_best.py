"""train.keep_best: the best checkpoint by an evaluation metric is kept, labelled, never pruned, resumed."""

from __future__ import annotations

import json

import pytest
import torch
from test_train_utils import TinyLooped, tiny_config, tiny_dataset

from loopformer.config import ConfigError, validate
from loopformer.runs import checkpoint_label
from loopformer.runs.checkpoint import (
    CheckpointError,
    find_best,
    load_checkpoint,
    read_best,
    resolve_checkpoint,
    step_dirs,
)
from loopformer.train import Trainer


def _trainer(cfg, seed: int = 0) -> Trainer:
    return Trainer(
        cfg, model=TinyLooped(seed=seed), train_data=tiny_dataset(64), eval_data=tiny_dataset(32, seed=1)
    )


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _logged(run_dir, key: str) -> dict[int, float]:
    return {m["step"]: m[key] for m in _metrics(run_dir) if key in m}


def _scripted(tr: Trainer, values: dict[int, float]) -> None:
    """Evaluations return ``values[step]`` (a fixed, non-monotone sequence) instead of scoring."""
    tr.evaluate = lambda: {"n": 32, "token_acc": values[tr.step], "exact_acc": 0.0}


def _first_argmax(logged: dict[int, float]) -> int:
    best = max(logged.values())
    return min(step for step, v in logged.items() if v == best)  # a tie keeps the earlier step


def test_best_is_the_argmax_of_the_logged_metric_and_its_weights_reproduce_it(tmp_path) -> None:
    cfg = tiny_config(tmp_path, "train.steps=24", "train.lr=0.05", "train.batch_size=16", "train.eval_every=3",
                      "train.keep_checkpoints=1", "train.keep_best=token_acc")  # fmt: skip
    tr = _trainer(cfg)
    summary = tr.fit()
    logged = _logged(tmp_path, "eval_token_acc")
    assert sorted(logged) == [3, 6, 9, 12, 15, 18, 21, 24]  # every periodic evaluation and the final one
    step = _first_argmax(logged)
    record = read_best(tmp_path / "checkpoints")
    assert record["step"] == step and record["checkpoint"] == f"step_{step:08d}"
    assert record["value"] == logged[step] and record["metric"] == "token_acc"
    assert summary["best"]["label"] == f"best (by eval_token_acc, step {step})"
    assert summary["best"]["checkpoint"] == str(tmp_path / "checkpoints" / f"step_{step:08d}")
    assert summary["eval_label"] == "final (step 24)"
    # every evaluation record names the best step so far
    best_steps = {m["step"]: m["best_step"] for m in _metrics(tmp_path) if "eval_token_acc" in m}
    assert best_steps == {s: _first_argmax({k: v for k, v in logged.items() if k <= s}) for s in logged}
    # the kept weights are the ones that scored it: re-evaluating them gives the logged value
    ckpt = load_checkpoint(tmp_path / "checkpoints" / "best", model=TinyLooped(seed=9))
    tr.model.load_state_dict(ckpt.model.state_dict())
    assert tr.score(tr.eval_data)["token_acc"] == pytest.approx(logged[step], abs=0)


def test_best_survives_pruning_and_is_labelled(tmp_path) -> None:
    values = {2: 0.2, 4: 0.5, 6: 0.4, 8: 0.5, 10: 0.3, 12: 0.1}  # best: step 4 (step 8 only ties it)
    cfg = tiny_config(tmp_path, "train.steps=12", "train.eval_every=2", "train.checkpoint_every=2",
                      "train.keep_checkpoints=1", "train.keep_best=token_acc")  # fmt: skip
    tr = _trainer(cfg)
    _scripted(tr, values)
    summary = tr.fit()
    root = tmp_path / "checkpoints"
    assert [p.name for p in step_dirs(root)] == ["step_00000004", "step_00000012"]  # keep 1 + the best
    assert summary["best"]["step"] == 4 and summary["best"]["value"] == 0.5
    assert resolve_checkpoint(root / "best") == root / "step_00000004"
    assert find_best(tmp_path) == (root / "step_00000004", read_best(root))
    assert checkpoint_label(root / "step_00000004", 4) == (
        "best (by eval_token_acc, step 4)",
        read_best(root),
    )
    assert checkpoint_label(root / "step_00000012", 12)[0] == "latest (step 12)"
    assert _logged(tmp_path, "best_step") == {2: 2, 4: 4, 6: 4, 8: 4, 10: 4, 12: 4}


def test_min_mode_and_an_eval_step_without_a_periodic_checkpoint(tmp_path) -> None:
    values = {
        3: 0.6,
        6: 0.2,
        9: 0.4,
        10: 0.9,
    }  # minimised: step 6; no checkpoint_every, so step 6 is saved for it
    cfg = tiny_config(tmp_path, "train.steps=10", "train.eval_every=3", "train.keep_checkpoints=1",
                      "train.keep_best=token_acc", "train.keep_best_mode=min")  # fmt: skip
    tr = _trainer(cfg)
    _scripted(tr, values)
    tr.fit()
    root = tmp_path / "checkpoints"
    assert [p.name for p in step_dirs(root)] == ["step_00000006", "step_00000010"]
    assert read_best(root)["step"] == 6 and read_best(root)["mode"] == "min"


def _run_with_kill(tr: Trainer, kill_at: int) -> None:
    original = tr.train_step

    def killing() -> dict:
        if tr.step == kill_at:
            raise KeyboardInterrupt("simulated kill")
        return original()

    tr.train_step = killing
    with pytest.raises(KeyboardInterrupt):
        tr.fit()


def test_resume_keeps_the_best(tmp_path) -> None:
    values = {2: 0.2, 4: 0.7, 6: 0.3, 8: 0.5, 10: 0.6, 12: 0.1}  # best: step 4, before the kill
    common = ("train.steps=12", "train.eval_every=2", "train.checkpoint_every=3", "train.keep_checkpoints=1",
              "train.keep_best=token_acc")  # fmt: skip
    killed = _trainer(tiny_config(tmp_path, *common))
    _scripted(killed, values)
    _run_with_kill(killed, kill_at=7)  # checkpoints at 2 (best), 3, 4 (best), 6; dies at step 7
    resumed = _trainer(tiny_config(tmp_path, *common, "train.resume=true"), seed=5)
    assert resumed.step == 6 and resumed.best.step == 4 and resumed.best.value == 0.7
    _scripted(resumed, values)
    summary = resumed.fit()
    # a tracker that had restarted would take step 8 (0.5) as the best
    assert summary["best"]["step"] == 4 and read_best(tmp_path / "checkpoints")["step"] == 4
    assert (tmp_path / "checkpoints" / "step_00000004").is_dir()


def test_resume_after_the_final_evaluation_took_the_best(tmp_path) -> None:
    """The final evaluation runs after the final checkpoint: the pointer is newer than that state."""
    values = {2: 0.2, 4: 0.3, 6: 0.9}
    common = ("train.eval_every=2", "train.keep_best=token_acc", "train.keep_checkpoints=1")
    tr = _trainer(tiny_config(tmp_path, "train.steps=6", *common))
    _scripted(tr, values)
    tr.fit()
    assert read_best(tmp_path / "checkpoints")["step"] == 6
    longer = _trainer(tiny_config(tmp_path, "train.steps=8", *common, "train.resume=true"))
    assert longer.step == 6 and longer.best.step == 6 and longer.best.value == 0.9


def test_keep_best_errors_name_the_metric(tmp_path) -> None:
    with pytest.raises(ConfigError, match="without its log prefix: 'exact_acc'"):
        validate(tiny_config(tmp_path, "train.keep_best=eval_exact_acc"))
    tr = _trainer(tiny_config(tmp_path, "train.steps=2", "train.keep_best=accuracy"))
    with pytest.raises(ValueError, match="'accuracy' is not an evaluation metric of this run .*token_acc"):
        tr.fit()
    with pytest.raises(CheckpointError, match="keeps no best checkpoint"):
        find_best(tmp_path)


def test_without_keep_best_nothing_changes(tmp_path) -> None:
    cfg = tiny_config(tmp_path, "train.steps=4", "train.eval_every=2", "train.keep_checkpoints=1")
    summary = _trainer(cfg).fit()
    assert summary["best"] is None and not (tmp_path / "checkpoints" / "best").exists()
    assert "best_step" not in json.dumps(_metrics(tmp_path))
    assert [p.name for p in step_dirs(tmp_path / "checkpoints")] == ["step_00000004"]
    assert torch.is_tensor(load_checkpoint(tmp_path, model=TinyLooped()).model.w.weight)
