"""Anderson (ring buffer, incremental Gram, safeguard), Broyden (tensor terms), per-sample
convergence of every solver, and the IFT backward at its defaults (float64 closed forms)."""

from __future__ import annotations

import pytest
import torch
from loop_helpers import DT, sym_map

from loopformer.loop import SOLVERS, LoopConfig, run_loop
from loopformer.loop.solvers import Anderson, anderson_weights


def linear(d: int, b: int, rho: float, seed: int = 0):
    """The benchmark's problem: symmetric W with spectrum in [-rho, rho] (one eigenvalue at rho)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=DT))
    eigs = (torch.rand(d, generator=g, dtype=DT) * 2 - 1) * rho
    eigs[0] = rho
    w = q @ torch.diag(eigs) @ q.T
    x = torch.randn(b, d, generator=g, dtype=DT)
    v = torch.randn(b, d, generator=g, dtype=DT)
    eye = torch.eye(d, dtype=DT)
    return w, x, v, torch.linalg.solve(eye - w, x.T).T, torch.linalg.solve((eye - w).T, v.T).T


def _reference_anderson(f, z, m: int, reg: float, beta: float, steps: int) -> list[torch.Tensor]:
    """The textbook list form: stack the last m iterates each step, solve the Gram system."""
    xs, fs, out = [], [], []
    for _ in range(steps):
        fz = f(z)
        xs, fs = [*xs, z][-m:], [*fs, fz][-m:]
        xst, fst = torch.stack(xs, 1), torch.stack(fs, 1)
        a = anderson_weights(fst - xst, reg)
        z = (a.unsqueeze(-1) * (beta * fst + (1 - beta) * xst)).sum(1)
        out.append(z)
    return out


@pytest.mark.parametrize("beta", [1.0, 0.7])
def test_ring_buffer_anderson_equals_the_stacked_history(beta: float) -> None:
    d, b, m = 10, 3, 4
    w = sym_map(d, torch.linspace(-0.9, 0.9, d, dtype=DT), 0)
    x = torch.randn(b, d, dtype=DT)

    def f(z):
        return torch.tanh(z @ w.T + x)

    ref = _reference_anderson(f, torch.zeros(b, d, dtype=DT), m, 1e-4, beta, 12)  # wraps the ring twice
    solver = Anderson(LoopConfig(plugins={"anderson": {"m": m, "beta": beta}}))
    z, state = torch.zeros(b, d, dtype=DT), solver.init(torch.zeros(b, d, dtype=DT))
    for t in range(12):
        z, state, _ = solver.update(z, f(z), None, state)
        torch.testing.assert_close(z, ref[t], rtol=0, atol=1e-12)
        gram = torch.bmm(state["g"], state["g"].transpose(1, 2))  # the incremental Gram is the full one
        torch.testing.assert_close(state["gram"], gram, rtol=1e-13, atol=1e-13)
    assert state["f"].shape == (b, m, d) and state["valid"] is None  # no restart: no slot masks


def test_safeguard_restarts_a_sample_whose_residual_rises() -> None:
    b, d = 2, 3
    cfg = LoopConfig(solver="anderson", plugins={"anderson": {"m": 4, "restart": 2.0}})
    solver = Anderson(cfg)
    assert solver.needs_residual  # the plain loop measures the residual for it
    z, state = torch.zeros(b, d, dtype=DT), solver.init(torch.zeros(b, d, dtype=DT))
    for res in ([1.0, 1.0], [0.5, 0.5], [0.4, 0.9]):
        fz = z + torch.randn(b, d, dtype=DT)
        z_next, state, _ = solver.update(z, fz, torch.tensor(res, dtype=DT), state)
        z = z_next
    # sample 1's residual rose to 1.8x its best (0.5) < 2: kept; now rise 3x for sample 0 only
    fz = z + torch.randn(b, d, dtype=DT)
    z_next, state, _ = solver.update(z, fz, torch.tensor([1.3, 0.4], dtype=DT), state)
    assert state["valid"].sum(1).tolist() == [1, 4]  # sample 0 kept only the new slot
    torch.testing.assert_close(z_next[0], fz[0], rtol=0, atol=0)  # ... and took a Picard step


@pytest.mark.parametrize("rho", [0.9, 0.99])
def test_quasi_newton_solvers_rank_by_map_evaluations_on_symmetric_maps(rho: float) -> None:
    """safe_anderson (m 20) needs fewer than anderson (m 5); broyden (conjugate gradient's iterates on a symmetric
    map, whatever its memory) fewer than both."""
    w, x, _, z_star, _ = linear(64, 4, rho)
    steps = {}
    for solver in ("anderson", "broyden", "safe_anderson"):
        cfg = LoopConfig(solver=solver, halting="residual", tol=1e-10, max_steps=5000)
        res = run_loop(lambda z, x: z @ w.T + x, torch.zeros_like(x), cfg, ctx=(x,))
        assert res.converged.all(), solver
        rel = (res.state - z_star).norm() / z_star.norm()
        assert rel < 1e-10 / (1 - rho) * 10, (solver, float(rel))
        steps[solver] = int(res.steps.max())
    assert steps["broyden"] < steps["safe_anderson"] < steps["anderson"], steps


def test_broyden_pairs_are_batch_first_and_bounded() -> None:
    w, x, _, z_star, _ = linear(32, 3, 0.9)
    cfg = LoopConfig(solver="broyden", plugins={"broyden": {"m": 64}}, halting="residual", tol=1e-12, max_steps=500)
    seen = []
    orig = SOLVERS.get("broyden").update

    def spy(self, z, fz, res, state):
        out = orig(self, z, fz, res, state)
        if "p" in out[1]:
            seen.append((out[1]["valid"].sum(1).tolist(), tuple(out[1]["p"].shape)))
        return out

    SOLVERS.get("broyden").update = spy
    try:
        res = run_loop(lambda z, x: z @ w.T + x, torch.zeros_like(x), cfg, ctx=(x,))
    finally:
        SOLVERS.get("broyden").update = orig
    torch.testing.assert_close(res.state, z_star, rtol=0, atol=1e-9)
    assert all(n == [i + 1] * len(n) for i, (n, _) in enumerate(seen))  # a pair per step after the first, no restart
    assert all(max(n) <= shape[1] <= 64 and shape[2] == 32 for n, shape in seen)  # grown on demand, at most m


@pytest.mark.parametrize("solver", ["picard", "damped", "anderson", "safe_anderson", "broyden"])
def test_every_solver_converges_per_sample_with_compaction(solver: str) -> None:
    """A batch of very different samples: each stops on its own, exactly as when solved alone."""
    d = 12
    w = sym_map(d, torch.linspace(-0.5, 0.5, d, dtype=DT), 1)
    x = torch.randn(4, d, dtype=DT)
    scale = torch.tensor([0.2, 0.6, 1.2, 1.9], dtype=DT).view(4, 1)  # contraction 0.1 .. 0.95

    def f(z, x, s):
        return torch.tanh(s * (z @ w.T) + x)

    cfg = LoopConfig(solver=solver, halting="residual", tol=1e-10, max_steps=3000)
    res = run_loop(f, torch.zeros_like(x), cfg, ctx=(x, scale))
    assert res.converged.all() and len(set(res.steps.tolist())) > 1, res.steps
    for i in range(4):
        one = run_loop(f, torch.zeros_like(x[i : i + 1]), cfg, ctx=(x[i : i + 1], scale[i : i + 1]))
        assert int(one.steps[0]) == int(res.steps[i])
        torch.testing.assert_close(one.state[0], res.state[i], rtol=0, atol=1e-12)


@pytest.mark.parametrize("rho", [0.9, 0.99])
def test_ift_at_default_settings_meets_1e6_relative_gradient_error(rho: float) -> None:
    """The benchmark's float64 linear problems: the default IFT backward (safe_anderson, tol auto = 1e-9
    in float64, at most 200 steps) gives d<v, z*>/dx = (I - W)^-T v to a relative error <= 1e-6."""
    w, x, v, _, grad_x = linear(128, 8, rho)
    x = x.clone().requires_grad_()
    cfg = LoopConfig(solver="safe_anderson", halting="residual", tol=1e-6, max_steps=5000, grad="ift")
    res = run_loop(lambda z, x: z @ w.T + x, torch.zeros_like(x), cfg, ctx=(x,))
    assert (res.stats["ift_steps"] == 0).all()  # filled by the backward
    (g,) = torch.autograd.grad((res.state * v).sum(), [x])
    err = float((g - grad_x).norm() / grad_x.norm())
    assert err <= 1e-6, err
    steps = res.stats["ift_steps"]
    assert (steps >= 1).all() and (steps < cfg.options_for("ift").max_steps).all()  # every sample converged on its own
    assert cfg.options_for("ift").tol == "auto" and cfg.options_for("ift").tolerance(torch.float64) == 1e-9
    assert (res.stats["ift_residual"] < 1e-9).all()


def test_ift_backward_options_cap_and_solver() -> None:
    w, x, v, _, grad_x = linear(32, 3, 0.99)
    x = x.clone().requires_grad_()
    errs = {}
    for label, opts in {
        "capped": {"max_steps": 3},
        "picard": {"solver": "picard", "max_steps": 5000},
        "anderson": {"solver": "anderson", "max_steps": 5000},
    }.items():
        cfg = LoopConfig(halting="residual", tol=1e-10, max_steps=5000, grad="ift", plugins={"ift": opts})
        res = run_loop(lambda z, x: z @ w.T + x, torch.zeros_like(x), cfg, ctx=(x,))
        (g,) = torch.autograd.grad((res.state * v).sum(), [x])
        errs[label] = float((g - grad_x).norm() / grad_x.norm())
        if label == "capped":
            assert res.stats["ift_steps"].tolist() == [3, 3, 3]
    assert errs["capped"] > 1e-2 and errs["picard"] < 1e-6 and errs["anderson"] < 1e-6, errs


@pytest.mark.parametrize("rho", [0.9, 0.99])
def test_ift_auto_tolerance_in_float32_stops_early_within_1e3_of_the_closed_form(rho: float) -> None:
    """``ift.tol: auto`` in float32 is 1e-5: every sample stops on its own, well inside the cap of 200 (a fixed
    1e-9, below float32's resolution, ran every float32 backward to the cap), and the gradient stays within
    1e-3 of the float64 closed form (I - W)^-T v."""
    w, x, v, _, grad_x = linear(128, 8, rho)
    w, v, x = w.float(), v.float(), x.float().clone().requires_grad_()
    cfg = LoopConfig(solver="safe_anderson", halting="residual", tol=1e-6, max_steps=5000, grad="ift")
    assert cfg.options_for("ift").tol == "auto" and cfg.options_for("ift").tolerance(torch.float32) == 1e-5
    res = run_loop(lambda z, x: z @ w.T + x, torch.zeros_like(x), cfg, ctx=(x,))
    (g,) = torch.autograd.grad((res.state * v).sum(), [x])
    err = float((g.double() - grad_x).norm() / grad_x.norm())
    assert err <= 1e-3, err
    steps = res.stats["ift_steps"]
    assert (res.stats["ift_residual"] < 1e-5).all() and not res.stats["ift_capped"].any()
    assert int(steps.max()) < cfg.options_for("ift").max_steps // 2, steps.tolist()


def test_ift_tolerance_option_is_a_number_or_auto() -> None:
    from loopformer.loop.grad import IFTOptions

    assert IFTOptions(tol=1e-7).tolerance(torch.float32) == 1e-7  # a number is used as given, in any dtype
    assert IFTOptions().tolerance(torch.bfloat16) == 1e-2
    for bad in (0, -1e-3, "1e-3x", True):
        with pytest.raises(ValueError, match=r"ift\.tol .*must be a number > 0 or 'auto'"):
            IFTOptions(tol=bad)
