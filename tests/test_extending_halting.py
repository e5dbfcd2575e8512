"""A halting rule defined outside the package: one class, registered, used by run_loop and training.

The worked example of docs/extending.md (halting rule): stop a sample
once its step ||z_{t+1} - z_t|| has fallen to ``drop`` times its first step (per-sample state:
the first step). On the map f(z) = a_i z + x_i with Picard, z_{t+1} - z_t = a_i^t (z_1 - z_0), so
sample i stops after exactly t_i + 1 iterations with t_i = ceil(log(drop) / log|a_i|).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from extending_common import DT, train_tiny_fprm

from loopformer.loop import HALTINGS, Halting, LoopConfig, make_sampler, run_loop
from loopformer.train.modes import SimpleMode


@dataclass(frozen=True)
class StepDropOptions:
    drop: float = 1e-3


class StepDrop(Halting):
    name = "step_drop"
    Options = StepDropOptions
    every_step = True  # keeps per-sample state: runs after every iteration
    stats = ("step_ratio",)
    calls = 0

    def init(self, z0, ctx):
        return {
            "first": torch.full((z0.shape[0],), float("nan"), dtype=torch.float64, device=z0.device),
            "ratio": torch.ones(z0.shape[0], dtype=torch.float64, device=z0.device),
        }

    def check(self, t, z, z_next, res, state, ctx):
        type(self).calls += 1
        step = torch.linalg.vector_norm((z_next - z).detach().reshape(z.shape[0], -1).double(), dim=1)
        first = step if t == 0 else state["first"]
        ratio = step / first.clamp_min(1e-300)
        done = ratio <= self.opts.drop
        return z_next, done, done, {"first": first, "ratio": ratio}

    def sample_stats(self, state):
        return {"step_ratio": state["ratio"]}


@pytest.fixture(autouse=True)
def registered():
    HALTINGS.register(StepDrop)
    yield
    HALTINGS.unregister("step_drop")


@pytest.mark.parametrize("compaction", [True, False])
def test_the_new_rule_stops_each_sample_at_the_closed_form_step(compaction: bool) -> None:
    a = torch.tensor([0.5, 0.8, 0.9, -0.7], dtype=DT)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(0), dtype=DT)
    drop = 1e-3
    cfg = LoopConfig(
        halting="step_drop", max_steps=200, compaction=compaction, plugins={"step_drop": {"drop": drop}}
    )
    res = run_loop(lambda z, x, a: a[:, None] * z + x, torch.zeros_like(x), cfg, ctx=(x, a))
    expected = [math.ceil(math.log(drop) / math.log(abs(float(ai)))) + 1 for ai in a]
    assert res.steps.tolist() == expected == [11, 32, 67, 21]
    assert res.converged.all()
    ratio = res.stats["step_ratio"]
    assert (ratio <= drop).all() and (ratio > drop * a.abs()).all()  # the first step at or below drop
    z_star = x / (1 - a[:, None])  # z_T - z* = a^T (z_0 - z*) with |a|^T <= drop |a| at the stop
    assert ((res.state - z_star).abs() <= drop * a.abs()[:, None] * z_star.abs() * (1 + 1e-9)).all()


def test_training_and_evaluation_run_the_new_rule_from_the_config(tmp_path) -> None:
    StepDrop.calls = 0
    summary = train_tiny_fprm(
        tmp_path,
        "loop_train.halting=step_drop",
        "loop_eval.halting=step_drop",
        "loop_train.max_steps=3",
        "loop_eval.max_steps=4",
        "loop_eval.plugins={step_drop: {drop: 0.5}}",
    )
    assert StepDrop.calls >= 2  # training steps and evaluation went through the rule
    assert "eval" in summary


class LearnedStepDrop(StepDrop):
    name = "learned_step_drop"
    learned = True  # declares itself part of what training learns: simple mode keeps it


@pytest.mark.parametrize(("rule", "kept"), [("step_drop", False), ("learned_step_drop", True), ("act", True)])
def test_simple_mode_keeps_only_learned_rules_under_a_sampled_loop_count(rule: str, kept: bool) -> None:
    # simple mode draws R and replaces the halting rule by ``fixed`` unless the rule declares
    # ``learned`` (ACT does): the trainer asks the plug-in, it never tests a rule's name
    HALTINGS.register(LearnedStepDrop)
    try:
        loop_train = LoopConfig(halting=rule, max_steps=9, min_steps=0 if rule == "act" else 5)
        config = SimpleNamespace(train=SimpleNamespace(carry_solver_state=False))
        trainer = SimpleNamespace(config=config, loop_train=loop_train, sampler=make_sampler("fixed", n=3))
        loop, R = SimpleMode(trainer).loop_for(step=7)
        assert HALTINGS.get(rule).learned is kept
    finally:
        HALTINGS.unregister("learned_step_drop")
    assert R == 3 and loop.max_steps == 3 and loop.min_steps == min(loop_train.min_steps, 3)
    assert loop.halting == (rule if kept else "fixed")
