"""Broyden against a float64 oracle: contractive linear maps f(z) = z W^T + x with the known fixed point
z* = (I - W)^-1 x, spectral radius 0.9 / 0.99, tolerance 1e-6 (the problems of benchmarks/bench_solvers.py).

The map-evaluation bounds are TorchDEQ 0.1.0's Broyden on the same problems (benchmarks/results.json,
``solvers.linear_rho0.9`` / ``solvers.linear_rho0.99``): 38 and 102 map evaluations per sample, of
which one is the recomputed step of the implicit gradient, so its forward solve takes 37 and 101.
Before the clean restart loopformer's Broyden (memory 16) needed 43.6 and 202.1 here.
"""

from __future__ import annotations

import pytest
import torch

from loopformer.loop import LoopConfig, run_loop
from loopformer.loop.solvers import Broyden, _hv

DT = torch.float64
TORCHDEQ_FORWARD_EVALS = {0.9: 37, 0.99: 101}


def linear_problem(
    d: int, b: int, rho: float, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W = Q diag(eigs) Q^T with spectral radius exactly rho (as the benchmark builds it), x and z*."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=DT))
    eigs = (torch.rand(d, generator=g, dtype=DT) * 2 - 1) * rho
    eigs[0] = rho
    w = q @ torch.diag(eigs) @ q.T
    x = torch.randn(b, d, generator=g, dtype=DT)
    z_star = torch.linalg.solve(torch.eye(d, dtype=DT) - w, x.T).T
    return w, x, z_star


@pytest.mark.parametrize("rho", [0.9, 0.99])
def test_broyden_reaches_the_oracle_in_no_more_map_evaluations_than_torchdeq(rho: float) -> None:
    w, x, z_star = linear_problem(128, 8, rho)
    rows = [0]

    def step(z: torch.Tensor, x_: torch.Tensor) -> torch.Tensor:
        rows[0] += z.shape[0]
        return z @ w.T + x_

    tol = 1e-6
    cfg = LoopConfig(solver="broyden", halting="residual", tol=tol, residual_norm="rel_l2", max_steps=5000)
    res = run_loop(step, torch.zeros_like(x), cfg, ctx=(x,))
    assert res.converged.all()
    assert float(res.residuals.nan_to_num(1.0).amin(0).max()) < tol  # every sample's last residual
    # a residual below tol bounds the error by tol / (1 - rho) relative to ||f(z)||
    assert (res.state - z_star).norm() / z_star.norm() < 2 * tol / (1 - rho)
    per_sample = rows[0] / x.shape[0]
    assert per_sample == pytest.approx(float(res.steps.double().mean()))  # one map call per step
    assert per_sample <= TORCHDEQ_FORWARD_EVALS[rho], per_sample


def test_restart_keeps_the_secant_condition() -> None:
    """After every update, the newest inverse-Jacobian estimate maps the last dg to the last dx, also
    on the steps where a full memory (m 3) restarts from -I."""
    w, x, _ = linear_problem(16, 2, 0.9, seed=3)
    cfg = LoopConfig(solver="broyden", plugins={"broyden": {"m": 3}}, max_steps=20)
    solver = Broyden(cfg)
    z, state = torch.zeros_like(x), solver.init(x)
    restarts = 0
    for t in range(12):
        fz = z @ w.T + x
        z_next, new_state, _ = solver.update(z, fz, None, state)
        if t >= 1:
            dx, dg = new_state["z_prev"] - state["z_prev"], new_state["g_prev"] - state["g_prev"]
            u, v = new_state["u"], new_state["v"]
            restarts += len(u) == 1 and t > 1
            torch.testing.assert_close(_hv(u.active, v.active, dg), dx, rtol=1e-9, atol=1e-12)
        z, state = z_next, new_state
    assert restarts >= 2  # the memory of 3 terms filled and restarted
