"""The two versions of FPRM's damped solver (github nilskiKonjIzDunava/fprm,
``models/fixed_point_reasoning/model_utils.py`` ``FixedPointOptimizer.step``): at 68e118cd a residual below the
best so far resets the patience (``residues < best_residues``); at 9e0ebf35 it must be below the best minus 0.01
(``residues < best_residues - 1e-2``). ``damped.min_improvement`` is that margin (0: the newer version).

Oracle: the reference's step written out in float64 over a batch of per-sample linear maps."""

from __future__ import annotations

import pytest
import torch

from loopformer.loop import LoopConfig, run_loop

GAMMA, PATIENCE, TOL, STEPS = 0.5, 2, 1e-9, 40


def _map(z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Per sample ``z <- a z + 1``: a close to 1 drifts slowly toward its fixed point 1 / (1 - a)."""
    return a[:, None, None] * z + 1.0


def _reference(z: torch.Tensor, a: torch.Tensor, margin: float) -> tuple[torch.Tensor, torch.Tensor]:
    """FixedPointOptimizer.step for STEPS steps (no halting): (final iterate, final step size)."""
    b = z.shape[0]
    eta, best = torch.ones(b, dtype=z.dtype), torch.full((b,), torch.inf, dtype=z.dtype)
    patience = torch.full((b,), float(PATIENCE), dtype=z.dtype)
    for _ in range(STEPS):
        fz = _map(z, a)
        res = ((z - fz).abs().amax(-1) / (fz.abs().amax(-1) + 1e-8)).amax(-1)
        z = fz * eta[:, None, None] + z * (1 - eta[:, None, None])
        improved = res < best - margin
        best = torch.where(improved, res, best)
        patience = torch.where(improved, float(PATIENCE), patience - 1)
        adapt = (patience <= 0) & (res >= TOL)
        patience = torch.where(adapt, float(PATIENCE), patience)
        eta = eta * torch.where(adapt, GAMMA, 1.0)
    return z, eta


@pytest.mark.parametrize("margin", [0.0, 0.01])
def test_the_damped_solver_with_either_improvement_rule_is_the_reference(margin: float) -> None:
    a = torch.tensor([0.97, 0.99, 0.5], dtype=torch.float64)  # slow, slower, fast
    z0 = torch.zeros(3, 2, 4, dtype=torch.float64)
    expected, eta = _reference(z0, a, margin)
    cfg = LoopConfig(solver="damped", halting="fixed", max_steps=STEPS, tol=TOL, residual_norm="rel_sup",
                     plugins={"damped": {"gamma": GAMMA, "patience": PATIENCE, "min_step": 1e-12, "min_improvement": margin}})  # fmt: skip
    out = run_loop(_map, z0, cfg, ctx=(a,))
    torch.testing.assert_close(out.state, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.stats["eta"], eta, rtol=0, atol=0)


def test_the_margin_changes_the_solve() -> None:
    a = torch.tensor([0.97, 0.99], dtype=torch.float64)
    z0 = torch.zeros(2, 2, 4, dtype=torch.float64)
    newer, older = _reference(z0, a, 0.0), _reference(z0, a, 0.01)
    assert (newer[1] == 1).all() and (older[1] < 1).all()  # slow drift: only the 0.01 rule decays the step
    assert not torch.allclose(newer[0], older[0])
