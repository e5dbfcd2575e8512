"""Broyden against float64 oracles on contractive linear maps f(z) = z W^T + x (W symmetric, spectrum in
[-rho, rho], one eigenvalue at rho: the problems of benchmarks/bench_solvers.py) with the known fixed point
z* = (I - W)^-1 x.

- The closed form: textbook conjugate gradient on (I - W) z = x. The multisecant Broyden with a conjugated
  basis makes, in exact arithmetic, CG's iterates each followed by one Picard step, for any memory m >= 3.
- TorchDEQ 0.1.0's Broyden (memory = the iteration cap): its map evaluations and its distance to z* at equal
  evaluations, on a seed the benchmark does not use (47: hidden from the tuning on seeds 0-7), recorded below and
  re-measured when torchdeq is installed. Before issue 47 loopformer's rank-one Broyden (memory 16) needed up to
  1.12x TorchDEQ's evaluations on the benchmark's seeds (rho 0.99, tol 1e-6) and was ten times further from z*
  at equal evaluations.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from loopformer.loop import LoopConfig, run_loop
from loopformer.loop.solvers import Broyden

DT = torch.float64
# TorchDEQ's Broyden on seed 0 (benchmarks/results.json, solvers.linear_rho0.9 / 0.99): forward map evaluations
TORCHDEQ_FORWARD_EVALS = {0.9: 37, 0.99: 101}
HIDDEN_SEED = 47
# (rho, tol): TorchDEQ's forward map evaluations K on HIDDEN_SEED (d 128, batch 8, relative residual), and its
# distance ||z - z*|| / ||z*|| after exactly K evaluations (broyden_solver, max_iter K - 1, tol 0)
TORCHDEQ_HIDDEN = {
    (0.9, 1e-3): (19, 1.46e-3),
    (0.9, 1e-6): (36, 2.29e-6),
    (0.99, 1e-3): (41, 3.03e-2),
    (0.99, 1e-6): (117, 6.12e-6),
}


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


def conjugate_gradient(a: torch.Tensor, rhs: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Hestenes-Stiefel CG iterates x_0 = 0, x_1, ..., x_steps for a symmetric positive definite a."""
    x, r = torch.zeros_like(rhs), rhs.clone()
    p, out = r.clone(), [torch.zeros_like(rhs)]
    for _ in range(steps):
        ap = a @ p
        alpha = (r @ r) / (p @ ap)
        x, r_next = x + alpha * p, r - alpha * ap
        p, r = r_next + (r_next @ r_next) / (r @ r) * p, r_next
        out.append(x)
    return out


def inverse_jacobian(state: dict) -> torch.Tensor:
    """The dense estimate H = -I + (P + Q)^T (P Q^T)^-1 P [B, D, D] from the pairs each sample keeps (the full
    Galerkin matrix, not the solver's triangular one)."""
    p, q, valid = state["p"], state["q"], state["valid"]
    eye = torch.eye(p.shape[2], dtype=p.dtype)
    out = []
    for i in range(p.shape[0]):
        pv, qv = p[i, valid[i]], q[i, valid[i]]
        out.append(-eye + (pv + qv).T @ torch.linalg.solve(pv @ qv.T, pv))
    return torch.stack(out)


def map_evals(w: torch.Tensor, x: torch.Tensor, cfg: LoopConfig) -> tuple[float, torch.Tensor, object]:
    rows = [0]

    def step(z: torch.Tensor, x_: torch.Tensor) -> torch.Tensor:
        rows[0] += z.shape[0]
        return z @ w.T + x_

    res = run_loop(step, torch.zeros_like(x), cfg, ctx=(x,))
    return rows[0] / x.shape[0], res.state, res


@pytest.mark.parametrize("rho", [0.9, 0.99])
def test_broyden_reaches_the_oracle_in_no_more_map_evaluations_than_torchdeq(rho: float) -> None:
    w, x, z_star = linear_problem(128, 8, rho)
    tol = 1e-6
    cfg = LoopConfig(solver="broyden", halting="residual", tol=tol, residual_norm="rel_l2", max_steps=5000)
    per_sample, state, res = map_evals(w, x, cfg)
    assert res.converged.all()
    assert float(res.residuals.nan_to_num(1.0).amin(0).max()) < tol  # every sample's last residual
    # a residual below tol bounds the error by tol / (1 - rho) relative to ||f(z)||
    assert (state - z_star).norm() / z_star.norm() < 2 * tol / (1 - rho)
    assert per_sample == pytest.approx(float(res.steps.double().mean()))  # one map call per step
    assert per_sample <= TORCHDEQ_FORWARD_EVALS[rho], per_sample


@pytest.mark.parametrize("m", [3, 16])
def test_broyden_iterates_are_conjugate_gradient_then_a_picard_step(m: int) -> None:
    """Iterate t is f(x_{t-1}), x_j conjugate gradient's j-th iterate on (I - W) z = x, to rounding: 40 steps,
    past the memory of m pairs (the oldest are dropped) and past rho 0.99's slow Picard convergence."""
    d, b, steps = 64, 3, 40
    w, x, z_star = linear_problem(d, b, 0.99, seed=HIDDEN_SEED)
    solver = Broyden(LoopConfig(solver="broyden", plugins={"broyden": {"m": m}}))
    z = torch.zeros_like(x)
    state, iterates = solver.init(z), []
    for _ in range(steps):
        z, state, _ = solver.update(z, z @ w.T + x, None, state)
        iterates.append(z)
    assert int(state["valid"].sum(1).max()) == m and state["p"].shape[1] == m  # bounded memory, all in use
    for i in range(b):
        cg = conjugate_gradient(torch.eye(d, dtype=DT) - w, x[i], steps - 1)
        for t in range(steps):
            err = (iterates[t][i] - (cg[t] @ w.T + x[i])).norm() / z_star[i].norm()
            assert err < 1e-11, (i, t, float(err))
    assert (iterates[-1] - z_star).norm() / z_star.norm() < 1e-6  # CG's convergence, not Picard's (0.99^40)


@pytest.mark.parametrize(("rho", "tol"), sorted(TORCHDEQ_HIDDEN))
def test_broyden_evaluations_and_distance_at_equal_evaluations_on_a_hidden_seed(rho: float, tol: float) -> None:
    """On a seed the benchmark never ran: no more forward map evaluations than TorchDEQ's Broyden, and after
    exactly TorchDEQ's count K no further from the closed-form fixed point than TorchDEQ after K."""
    k, tdq_distance = TORCHDEQ_HIDDEN[(rho, tol)]
    w, x, z_star = linear_problem(128, 8, rho, seed=HIDDEN_SEED)
    if importlib.util.find_spec("torchdeq") is not None:  # the recorded numbers are TorchDEQ's
        from torchdeq.solver.broyden import broyden_solver

        f = lambda z: z @ w.T + x  # noqa: E731
        _, _, info = broyden_solver(f, torch.zeros_like(x), max_iter=5000, tol=tol, stop_mode="rel")
        assert int(info["nstep"].max()) + 1 == k  # its steps after the first evaluation
        z_k, _, _ = broyden_solver(f, torch.zeros_like(x), max_iter=k - 1, tol=0.0, stop_mode="rel")
        assert float((z_k - z_star).norm() / z_star.norm()) == pytest.approx(tdq_distance, rel=0.01)
    cfg = LoopConfig(solver="broyden", halting="residual", tol=tol, residual_norm="rel_l2", max_steps=5000)
    per_sample, _, res = map_evals(w, x, cfg)
    assert res.converged.all() and per_sample <= k, (per_sample, k)
    evals, z_k, _ = map_evals(w, x, LoopConfig(solver="broyden", halting="fixed", max_steps=k))
    assert evals == k
    distance = float((z_k - z_star).norm() / z_star.norm())
    assert distance <= tdq_distance, (distance, tdq_distance)


@pytest.mark.parametrize("nonlinear", [False, True])
def test_secant_equations_hold_after_every_update(nonlinear: bool) -> None:
    """After every update the estimate maps the last raw dg to the last dz (H dg = dz) and each kept pair's q_i to
    p_i, also when a full memory (m 3) drops its oldest pair and when a nonlinear map restarts a sample's memory."""
    w, x, _ = linear_problem(16, 4, 0.9, seed=4)
    scale = torch.tensor([[0.5], [1.5], [2.5], [3.5]], dtype=DT)  # tanh(s W z + x): s > 1 is not a contraction
    solver = Broyden(LoopConfig(solver="broyden", plugins={"broyden": {"m": 3}}))
    z, state = torch.zeros_like(x), solver.init(x)
    kept = []
    for t in range(14):
        fz = torch.tanh(scale * (z @ w.T) + x) if nonlinear else z @ w.T + x
        z_next, new_state, _ = solver.update(z, fz, None, state)
        if t >= 1:
            dz, dg = new_state["z_prev"] - state["z_prev"], new_state["g_prev"] - state["g_prev"]
            h = inverse_jacobian(new_state)
            torch.testing.assert_close(torch.einsum("bij,bj->bi", h, dg), dz, rtol=1e-9, atol=1e-12)
            qp = torch.einsum("bij,bkj->bki", h, new_state["q"])
            valid = new_state["valid"].unsqueeze(-1)
            torch.testing.assert_close(qp * valid, new_state["p"] * valid, rtol=1e-8, atol=1e-10)
            kept.append(new_state["valid"].sum(1))
        z, state = z_next, new_state
    kept = torch.stack(kept)  # [steps, B]
    assert int(kept.max()) == 3 and torch.isfinite(z).all()
    dropped = (kept[1:] < kept[:-1]).any()
    assert bool(dropped) == nonlinear, kept.T  # a restart (fewer pairs than the step before) only when nonlinear
