"""``train.dropout_schedule: first_epoch``: dropout only in the first epoch of the run and of each curriculum
stage, as the Loop, Think & Generalize scripts leave it (``train_model`` calls ``model.train()`` once per
stage, ``evaluate_model_test`` after every epoch calls ``model.eval()`` and nothing switches back)."""

from __future__ import annotations

import math

import pytest
import torch
from test_train_utils import tiny_config, tiny_dataset

from loopformer.train import Trainer

GPT2 = (
    "model.name=recurrent",
    "model.block=gpt2",
    "model.d_model=16",
    "model.n_heads=2",
    "model.n_layers=1",
    "model.vocab_size=8",
    "model.dropout=0.1",
    "model.embed_dropout=0.1",
    "train.loop_sampler=fixed",
    "train.grad_clip=0",
)


def _training_modes(tmp_path, steps: int, *overrides: str) -> tuple[Trainer, list[tuple[int, bool]]]:
    """(step, every module's .training) of each training forward (evaluations run without grad)."""
    cfg = tiny_config(tmp_path, *GPT2, f"train.steps={steps}", *overrides)
    tr = Trainer(cfg, train_data=tiny_dataset(32), eval_data=tiny_dataset(8, seed=1))
    drops = [m for m in tr.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert len(drops) >= 2 and any(getattr(m, "dropout", 0) for m in tr.model.modules())
    seen: list[tuple[int, bool]] = []

    def hook(module, args) -> None:
        if torch.is_grad_enabled():
            states = {m.training for m in tr.model.modules()}
            assert len(states) == 1, "the whole model is in one mode"
            seen.append((tr.step, states.pop()))

    tr.model.register_forward_pre_hook(hook)
    tr.fit()
    return tr, seen


def test_first_epoch_without_curriculum(tmp_path) -> None:
    _, seen = _training_modes(tmp_path, 10, "train.dropout_schedule=first_epoch")
    # 32 rows, batch 8: the reference's DataLoader gives 4 batches per epoch; dropout in those only
    assert seen == [(s, s < 4) for s in range(10)]


def test_always_keeps_dropout_on(tmp_path) -> None:
    _, seen = _training_modes(tmp_path, 6)
    assert seen == [(s, True) for s in range(6)]


def test_first_epoch_restarts_at_every_curriculum_stage(tmp_path) -> None:
    data = tiny_dataset(32)
    tr, seen = _training_modes(
        tmp_path, 16, "train.dropout_schedule=first_epoch", "data.curriculum.enabled=true",
        "data.curriculum.start=1", "data.curriculum.step=1", "data.curriculum.threshold=0.0",
        "data.curriculum.check_every=5", "data.curriculum.source=train",
    )  # fmt: skip
    # written out: a stage's data is the rows of difficulty <= level, one epoch = ceil(rows / 8) batches;
    # threshold 0 passes every check (after steps 5, 10, 15) until level 4
    expected, level, start = [], 1.0, 0
    for s in range(16):
        rows = int((data.difficulty <= level).sum())
        expected.append((s, s - start < math.ceil(rows / 8)))
        if (s + 1) % 5 == 0 and level < 4:
            level, start = level + 1, s + 1
    assert seen == expected
    assert any(on for _, on in expected) and not all(on for _, on in expected)
    assert tr.curriculum.level == 4


def test_dropout_schedule_is_checked(tmp_path) -> None:
    from loopformer.config import ConfigError

    with pytest.raises(ConfigError, match="dropout_schedule"):
        tiny_config(tmp_path, "train.dropout_schedule=first")


def _trained_params(tmp_path, *overrides: str) -> dict[str, torch.Tensor]:
    cfg = tiny_config(tmp_path, *GPT2, "train.steps=10", "train.eval_every=0", *overrides)
    tr = Trainer(cfg, train_data=tiny_dataset(32), eval_data=tiny_dataset(8, seed=1))
    tr.fit()
    return {k: v.detach().clone() for k, v in tr.model.state_dict().items()}


def test_schedule_changes_training_only_through_dropout(tmp_path) -> None:
    """Without dropout the schedule is a no-op (the model has no other train / eval difference: the loop's
    sampler and gradient mode follow the config, never ``module.training``); with dropout it is not."""
    off = ("model.dropout=0.0", "model.embed_dropout=0.0")
    a = _trained_params(tmp_path / "a", *off)
    b = _trained_params(tmp_path / "b", *off, "train.dropout_schedule=first_epoch")
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = _trained_params(tmp_path / "c")
    d = _trained_params(tmp_path / "d", "train.dropout_schedule=first_epoch")
    assert not all(torch.equal(c[k], d[k]) for k in c)


@pytest.mark.parametrize("recipe", ["ltg_grok_r1", "ltg_grok_r2"])
def test_cpu_grokking_recipes_have_no_dropout(recipe: str) -> None:
    """docs/results.md (LTG item 4) keeps the grokking verdict without a rerun under the reference's dropout
    schedule because these recipes train without dropout, so the schedule cannot change their run."""
    import dataclasses

    from loopformer.config import build_config, read_recipe
    from loopformer.models.recurrent import RecurrentConfig

    spec = build_config(read_recipe(recipe)).model
    assert spec.name == "recurrent"
    defaults = {f.name: f.default for f in dataclasses.fields(RecurrentConfig)}
    for key in ("dropout", "embed_dropout"):
        assert spec.fields.get(key, defaults[key]) == 0.0, key
