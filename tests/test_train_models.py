"""The trainer with the real model families (tiny sizes): every loss term and halting rule is exercised."""

from __future__ import annotations

import math

import pytest
import torch
from test_train_utils import SEQ, VOCAB, TinyLooped, tiny_config, tiny_dataset

from loopformer.train import Trainer

SMALL = ("model.d_model=16", "model.n_heads=2", "model.n_layers=1")


@pytest.mark.parametrize(
    ("family", "overrides", "expect"),
    [
        ("fprm", ("train.mode=deep_supervision", "train.max_segments=2", "train.halt_on_converged=true",
                  "train.loss=stablemax", "loop_train.max_steps=3", "loop_train.grad_steps=3", "train.ema=0.9"), "q_loss"),
        ("trm", ("train.mode=deep_supervision", "train.max_segments=2", "train.halt_on_q=true", "model.n_inner=2",
                 "eval.segments=2"), "q_loss"),
        ("recurrent", ("train.loop_sampler=poisson", "train.loop_sampler_options={mean: 3, low: 1, high: 4}"), "loops"),
        ("ut_act", ("loop_train.max_steps=4",), "ponder"),
        ("hrm", ("train.mode=deep_supervision", "train.max_segments=2", "train.halt_on_q=true"), "q_loss"),
        ("attractor", ("loop_train.max_steps=5",), "converged"),
        ("transformer", (), "loops"),
    ],
)
def test_each_family_trains_a_few_steps(tmp_path, family: str, overrides: tuple, expect: str) -> None:
    cfg = tiny_config(tmp_path, f"model.name={family}", *SMALL, "train.steps=2", "model.vocab_size=8", *overrides)
    tr = Trainer(cfg, train_data=tiny_dataset(32), eval_data=tiny_dataset(16, seed=1))
    summary = tr.fit()
    # the recipe's vocab_size wins over the task's (sudoku: 11); seq_len comes from the data
    assert tr.model.config.vocab_size == VOCAB and tr.model.config.seq_len == SEQ
    assert cfg.model.fields["seq_len"] == SEQ and cfg.model.fields["causal"] is False  # the dump is resolved
    m = summary["train"]
    assert math.isfinite(m["loss"]) and expect in m
    assert summary["eval"]["n"] == 16


def test_jacobian_regulariser_adds_a_positive_term(tmp_path) -> None:
    cfg = tiny_config(tmp_path, "train.jacobian_weight=0.5", "train.steps=2")
    tr = Trainer(cfg, model=TinyLooped(), train_data=tiny_dataset(32), eval_data=None)
    m = tr.train_step()
    assert m["jacobian"] > 0
    assert m["loss"] == pytest.approx(m["task_loss"] + 0.5 * m["q_loss"] + 0.5 * m["jacobian"], rel=1e-5)


def test_tensorboard_flag_is_optional(tmp_path) -> None:
    cfg = tiny_config(tmp_path, "train.tensorboard=true", "train.steps=1")
    Trainer(cfg, model=TinyLooped(), train_data=tiny_dataset(16), eval_data=None).fit()
    assert (tmp_path / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_compiled_step_gives_the_same_losses(tmp_path) -> None:
    losses = []
    for flag in ("false", "true"):
        cfg = tiny_config(tmp_path / flag, f"compile={flag}", "train.steps=2")
        losses.append(Trainer(cfg, model=TinyLooped(), train_data=tiny_dataset(32), eval_data=None).fit()["train"]["loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert torch.compile is not None


@pytest.mark.parametrize("family", ["fprm", "trm"])
def test_real_model_deep_supervision_resume_is_bit_exact(tmp_path, family: str) -> None:
    common = (f"model.name={family}", *SMALL, "model.vocab_size=8", "train.mode=deep_supervision",
              "train.max_segments=2", "train.steps=4", "train.ema=0.9", "train.loss=stablemax",
              "train.halt_on_q=true", "train.halt_exploration=0.5", "data.eval_size=0")
    full = Trainer(tiny_config(tmp_path / "full", *common), train_data=tiny_dataset(32), eval_data=None)
    full.fit()
    first = Trainer(tiny_config(tmp_path / "part", *common, "train.steps=2"), train_data=tiny_dataset(32), eval_data=None)
    first.fit()  # a run that stopped at step 2 (lr schedule is constant after warm-up, so steps=2 is a clean cut)
    torch.manual_seed(99)  # the resumed trainer's fresh model starts from other weights
    resumed = Trainer(tiny_config(tmp_path / "part", *common, "train.resume=true"), train_data=tiny_dataset(32),
                      eval_data=None)
    assert resumed.step == 2
    resumed.fit()
    for (name, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name
