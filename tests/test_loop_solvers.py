"""Solver oracles (float64): closed-form fixed points of controlled linear maps z -> W z + x."""

import math

import pytest
import torch
from loop_helpers import DT, sym_map

from loopformer.loop import LoopConfig, run_loop
from loopformer.loop.norms import residual_into


def contractive(d: int, rho: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 100)
    eigs = (torch.rand(d, generator=g, dtype=DT) * 2 - 1) * rho
    eigs[0] = rho
    return sym_map(d, eigs, seed)


def fixed_point(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(w.shape[0], dtype=DT)
    return torch.linalg.solve(eye - w, x.T).T


def linear_step(w):
    return lambda z, x: z @ w.T + x


@pytest.mark.parametrize("solver", ["picard", "damped", "anderson", "broyden"])
@pytest.mark.parametrize("rho", [0.9, 0.99])
def test_solvers_reach_closed_form_fixed_point(solver, rho):
    d, b, tol = 16, 4, 1e-9
    w = contractive(d, rho)
    x = torch.randn(b, d, dtype=DT) * torch.tensor([[0.1], [1.0], [3.0], [10.0]], dtype=DT)
    cfg = LoopConfig(solver=solver, halting="residual", tol=tol, max_steps=6000, plugins={"broyden": {"m": 32}})
    res = run_loop(linear_step(w), torch.zeros(b, d, dtype=DT), cfg, ctx=(x,))
    z_star = fixed_point(w, x)
    assert res.converged.all(), res.steps
    # ||z - z*|| <= ||(I - W)^-1|| ||f(z) - z|| (one step from the returned iterate) for normal W
    err = torch.linalg.vector_norm(res.state - z_star, dim=1)
    bound = 3 * tol * torch.linalg.vector_norm(z_star, dim=1) / (1 - rho)
    assert (err <= bound).all(), (err, bound)
    assert res.residuals.shape == (int(res.steps.max()), b)
    last = res.residuals[res.steps - 1, torch.arange(b)]
    assert (last < tol).all()


def test_anderson_needs_fewer_iterations_than_picard():
    d, b, tol = 32, 2, 1e-6
    w = contractive(d, 0.99, seed=3)
    x = torch.randn(b, d, dtype=DT)
    counts = {}
    for solver in ("picard", "anderson"):
        cfg = LoopConfig(solver=solver, halting="residual", tol=tol, max_steps=5000)
        res = run_loop(linear_step(w), torch.zeros(b, d, dtype=DT), cfg, ctx=(x,))
        assert res.converged.all()
        counts[solver] = int(res.steps.max())
    cfg = LoopConfig(solver="anderson", plugins={"anderson": {"reg_relative": False}}, halting="residual", tol=tol, max_steps=5000)
    counts["anderson_absolute_reg"] = int(run_loop(linear_step(w), torch.zeros(b, d, dtype=DT), cfg, ctx=(x,)).steps.max())
    print(f"rho 0.99 tol 1e-6 iterations: {counts}")
    assert counts["anderson"] * 2 < counts["picard"], counts
    assert counts["anderson"] < counts["anderson_absolute_reg"], counts


def test_anderson_per_sample_equals_single_sample_runs():
    """Per-sample least squares: a batch (with halting + compaction) equals each sample alone."""
    d = 12
    w = contractive(d, 0.95, seed=5)
    x = torch.randn(3, d, dtype=DT) * torch.tensor([[0.01], [1.0], [100.0]], dtype=DT)
    z0 = torch.randn(3, d, dtype=DT)
    cfg = LoopConfig(solver="anderson", halting="residual", tol=1e-8, max_steps=500)
    res = run_loop(linear_step(w), z0, cfg, ctx=(x,))
    for i in range(3):
        one = run_loop(linear_step(w), z0[i : i + 1], cfg, ctx=(x[i : i + 1],))
        assert int(one.steps[0]) == int(res.steps[i])
        torch.testing.assert_close(one.state[0], res.state[i], rtol=1e-10, atol=1e-12)


def test_picard_oscillates_damped_converges():
    """Eigenvalue -1.5 (real part < 1, modulus > 1): Picard fails, FPRM damping converges."""
    d, b = 8, 2
    eigs = torch.tensor([-1.5, 0.5, 0.3, -0.2, 0.1, 0.0, 0.4, -0.4], dtype=DT)
    w = sym_map(d, eigs, seed=1)
    x = torch.randn(b, d, dtype=DT)
    z0 = torch.zeros(b, d, dtype=DT)
    picard = run_loop(linear_step(w), z0, LoopConfig(solver="picard", halting="residual", tol=1e-6, max_steps=300), ctx=(x,))
    assert not picard.converged.any()
    assert (picard.steps == 300).all()
    cfg = LoopConfig(solver="damped", halting="residual", tol=1e-6, max_steps=3000, plugins={"damped": {"gamma": 0.9, "patience": 5}})
    damped = run_loop(linear_step(w), z0, cfg, ctx=(x,))
    assert damped.converged.all(), damped.steps
    torch.testing.assert_close(damped.state, fixed_point(w, x), rtol=0, atol=1e-4)


def test_damped_stall_halts_not_converged():
    """eta < damped.min_step stops the sample, converged=False (FPRM Algorithm 1)."""
    d = 4
    w = sym_map(d, torch.tensor([-3.0, 0.1, 0.2, 0.3], dtype=DT))
    x = torch.randn(1, d, dtype=DT)
    cfg = LoopConfig(solver="damped", halting="residual", tol=1e-12, max_steps=10000,
                     plugins={"damped": {"gamma": 0.5, "patience": 2, "min_step": 0.3}})
    res = run_loop(linear_step(w), torch.zeros(1, d, dtype=DT), cfg, ctx=(x,))
    assert not res.converged.any()
    assert int(res.steps[0]) < 10000


def reference_damped(f, y: torch.Tensor, tol: float, gamma: float, patience: int, min_step: float, cap: int):
    """Independent scalar implementation of FPRM Algorithm 1 for one sample."""
    eta, best, p = 1.0, math.inf, patience
    for t in range(cap):
        z = f(y)
        r = float(torch.linalg.vector_norm(z - y) / (torch.linalg.vector_norm(z) + 1e-8))
        y = eta * z + (1 - eta) * y
        if r < best:
            best, p = r, patience
        else:
            p -= 1
        if p <= 0 and r >= tol:
            eta *= gamma
            p = patience
        if r < tol or eta < min_step:
            return y, t + 1
    return y, cap


def test_damped_matches_reference_algorithm():
    d = 6
    w = sym_map(d, torch.tensor([-1.4, 0.6, 0.3, -0.2, 0.1, 0.5], dtype=DT), seed=2)
    x = torch.randn(3, d, dtype=DT) * torch.tensor([[0.5], [1.0], [2.0]], dtype=DT)
    cfg = LoopConfig(solver="damped", halting="residual", tol=1e-7, max_steps=2000)
    res = run_loop(linear_step(w), torch.zeros(3, d, dtype=DT), cfg, ctx=(x,))
    for i in range(3):
        y, n = reference_damped(lambda y, i=i: y @ w.T + x[i], torch.zeros(d, dtype=DT), 1e-7, 0.9, 5, 1e-3, 2000)
        assert n == int(res.steps[i])
        torch.testing.assert_close(res.state[i], y, rtol=1e-12, atol=1e-12)


def test_broyden_memory_is_bounded():
    d = 16
    w = contractive(d, 0.9, seed=4)
    x = torch.randn(2, d, dtype=DT)
    seen = []
    from loopformer.loop import solvers

    orig = solvers.Broyden.update

    def spy(self, z, fz, res, state):
        out = orig(self, z, fz, res, state)
        seen.append(int(out[1]["valid"].sum(1).max()) if "valid" in out[1] else 0)
        return out

    solvers.Broyden.update = spy
    try:
        res = run_loop(linear_step(w), torch.zeros(2, d, dtype=DT),
                       LoopConfig(solver="broyden", plugins={"broyden": {"m": 3}}, halting="residual", tol=1e-9, max_steps=2000), ctx=(x,))
    finally:
        solvers.Broyden.update = orig
    assert res.converged.all()
    assert max(seen) == 3
    torch.testing.assert_close(res.state, fixed_point(w, x), rtol=0, atol=1e-6)


def test_residual_norms_match_definitions():
    z = torch.randn(3, 5, 4, dtype=DT)
    fz = z + 0.1 * torch.randn(3, 5, 4, dtype=DT)
    r = torch.empty(3, dtype=DT)
    rms = residual_into(z.reshape(3, -1), fz.reshape(3, -1), "rel_l2", 4, r) / math.sqrt(5 * 4)
    for b in range(3):
        assert math.isclose(float(r[b]), float((fz[b] - z[b]).norm() / (fz[b].norm() + 1e-8)), rel_tol=1e-12)
        assert math.isclose(float(rms[b]), float(fz[b].pow(2).mean().sqrt()), rel_tol=1e-12)
    residual_into(z.reshape(3, -1), fz.reshape(3, -1), "rel_sup", 4, r)
    for b in range(3):
        per_token = [float((fz[b, t] - z[b, t]).abs().max() / (fz[b, t].abs().max() + 1e-8)) for t in range(5)]
        assert math.isclose(float(r[b]), max(per_token), rel_tol=1e-12)


def test_rel_sup_halting_on_4d_state():
    """[B, 2, T, d] states work: tokens are all middle dims, channels the last."""
    d = 4
    w = contractive(d, 0.5)
    x = torch.randn(2, 2, 3, d, dtype=DT)
    cfg = LoopConfig(halting="residual", residual_norm="rel_sup", tol=1e-10, max_steps=200)
    res = run_loop(lambda z, x: z @ w.T + x, torch.zeros_like(x), cfg, ctx=(x,))
    assert res.converged.all()
    torch.testing.assert_close(res.state, fixed_point(w, x.reshape(-1, d)).reshape(x.shape), rtol=0, atol=1e-8)
