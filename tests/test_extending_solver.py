"""A solver defined outside the package: one class, registered, used by run_loop and by training.

The worked example of docs/extending.md (solver): over-relaxation
``z <- (1 - omega) z + omega f(z)`` with its own typed option ``omega``. On a float64 linear map
with eigenvalues in [-0.9, 0.5] the optimal omega = 2 / (2 - lo - hi) = 2 / 2.4 shrinks the
iteration's spectral radius from 0.9 (Picard) to 0.583, so it must reach the closed-form fixed
point in fewer iterations than Picard.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from extending_common import linear_problem, train_tiny_fprm

from loopformer.config import ConfigError, build_config
from loopformer.loop import SOLVERS, LoopConfig, Solver, run_loop


@dataclass(frozen=True)
class RelaxedOptions:
    omega: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.omega < 2:
            raise ValueError(f"relaxed.omega must be in (0, 2), got {self.omega!r}")


class Relaxed(Solver):
    """Over-relaxed fixed-point iteration (exactly replayable: a fixed lerp of z and f(z))."""

    name = "relaxed"
    Options = RelaxedOptions
    replayable = True
    adjoint_ok = True
    calls = 0

    def update(self, z, fz, res, state):
        type(self).calls += 1
        return torch.lerp(z, fz, self.opts.omega), state, {}

    def replay_step(self, z, fz, coeff):
        return torch.lerp(z, fz, self.opts.omega)


@pytest.fixture(autouse=True)
def registered():
    SOLVERS.register(Relaxed)
    yield
    SOLVERS.unregister("relaxed")


def _solve(solver: str, **kw):
    w, x, z_star = linear_problem()
    cfg = LoopConfig(solver=solver, halting="residual", tol=1e-12, max_steps=2000, **kw)
    res = run_loop(lambda z, x: z @ w.T + x, torch.zeros_like(x), cfg, ctx=(x,))
    return res, z_star


def test_the_new_solver_reaches_the_closed_form_fixed_point_faster_than_picard() -> None:
    omega = 2 / (2 - (-0.9) - 0.5)
    res, z_star = _solve("relaxed", plugins={"relaxed": {"omega": omega}})
    picard, _ = _solve("picard")
    assert res.converged.all() and picard.converged.all()
    torch.testing.assert_close(res.state, z_star, rtol=0, atol=1e-10)
    assert int(res.steps.max()) < 0.7 * int(picard.steps.max())  # radius 0.583 vs 0.9


def test_the_new_solver_is_a_valid_name_with_typed_options() -> None:
    assert "relaxed" in SOLVERS.names()
    cfg = LoopConfig(solver="relaxed", plugins={"relaxed": {"omega": 1.5}})
    assert cfg.options_for(Relaxed) == RelaxedOptions(omega=1.5)
    with pytest.raises(ValueError, match="omega must be in"):
        LoopConfig(solver="relaxed", plugins={"relaxed": {"omega": 2.5}})
    with pytest.raises(ValueError, match="'relaxed'"):  # the valid names come from the registry
        LoopConfig(solver="relaxd")
    with pytest.raises(ConfigError, match="omega must be in"):
        build_config(
            {}, ["model.name=fprm", "loop_eval.solver=relaxed", "loop_eval.plugins={relaxed: {omega: 3}}"]
        )
    # its table beside the other loop keys, as a built-in plug-in's (docs/extending.md)
    cfg = build_config({}, ["model.name=fprm", "loop_eval.solver=relaxed", "loop_eval.relaxed.omega=0.5"])
    assert cfg.loop_config(cfg.model_config().loop, "eval").options_for(Relaxed) == RelaxedOptions(omega=0.5)


def test_exact_truncated_replay_and_ift_use_the_new_solver() -> None:
    w, x, z_star = linear_problem()
    x = x.clone().requires_grad_()
    c = torch.randn_like(z_star)
    eye = torch.eye(w.shape[0], dtype=w.dtype)
    grad_ref = torch.linalg.solve((eye - w).T, c.T).T  # d<c, z*>/dx = (I - W)^-T c
    cfg = LoopConfig(
        solver="picard",
        halting="residual",
        tol=1e-13,
        max_steps=2000,
        grad="ift",
        plugins={"ift": {"solver": "relaxed", "tol": 1e-13, "max_steps": 2000}},
    )
    res = run_loop(lambda z, x: z @ w.T + x, torch.zeros_like(z_star), cfg, ctx=(x,))
    (gx,) = torch.autograd.grad((c * res.state).sum(), [x])
    torch.testing.assert_close(gx, grad_ref, rtol=0, atol=1e-9)
    # truncated: the replayed last step of a halting sample differentiates like one step of the map
    cfg = LoopConfig(
        solver="relaxed", halting="residual", tol=1e-12, max_steps=2000, grad="truncated", grad_steps=1
    )
    res = run_loop(lambda z, x: z @ w.T + x, torch.zeros_like(z_star), cfg, ctx=(x,))
    (gx,) = torch.autograd.grad((c * res.state).sum(), [x])
    torch.testing.assert_close(gx, c * RelaxedOptions().omega, rtol=0, atol=1e-12)


def test_training_runs_the_new_solver_from_the_config(tmp_path) -> None:
    Relaxed.calls = 0
    summary = train_tiny_fprm(
        tmp_path,
        "loop_train.solver=relaxed",
        "loop_eval.solver=relaxed",
        "loop_train.plugins={relaxed: {omega: 0.8}}",
        "loop_train.halting=fixed",
        "loop_train.max_steps=3",
        "loop_eval.max_steps=4",
    )
    assert Relaxed.calls >= 2 * 3  # two training steps of three iterations, plus evaluation
    assert "eval" in summary
