"""Anderson through the engine against an independent float64 textbook implementation.

The reference below keeps each sample's history as a Python list, solves the regularised
constrained least-squares problem ``min ||sum a_i g_i||^2 + lam s ||a||^2, sum a_i = 1`` with its
KKT system (``torch.linalg.solve`` on the (n+1) x (n+1) bordered matrix, one sample at a time), and
applies the safe_anderson restart rule by emptying the list: nothing of it is shared with
loopformer.loop.solvers (ring buffers, incremental Gram rows, batched solves, slot masks).
"""

from __future__ import annotations

import pytest
import torch
from loop_helpers import DT, sym_map

from loopformer.loop import LoopConfig, run_loop
from loopformer.loop.solvers import Anderson, _dots, exact


def _kkt_weights(g: torch.Tensor, reg: float) -> torch.Tensor:
    """Weights a [n] for one sample's residuals g [n, D]: the bordered (KKT) system of
    ``min a^T (G + reg * tr(G)/n I) a  s.t.  sum a = 1``."""
    n = g.shape[0]
    gram = g @ g.T
    gram = gram + reg * torch.trace(gram) / n * torch.eye(n, dtype=g.dtype)
    kkt = torch.zeros(n + 1, n + 1, dtype=g.dtype)
    kkt[:n, :n], kkt[:n, n], kkt[n, :n] = 2 * gram, 1.0, 1.0
    rhs = torch.zeros(n + 1, dtype=g.dtype)
    rhs[n] = 1.0
    return torch.linalg.solve(kkt, rhs)[:n]


def reference_anderson(f, z0, m, reg, beta, steps, restart=None, tol=None):
    """Per-sample textbook Anderson: (iterates per sample, halting step per sample, restarts per sample).

    ``restart``: a sample whose residual ||f(z) - z|| / ||f(z)|| exceeds restart x its best so far
    drops its history first. ``tol``: a sample stops after the first step with residual < tol (its
    iterate list ends there), as per-sample residual halting does.
    """
    out, halted, restarts = [], [], []
    for i in range(z0.shape[0]):
        restarts.append(0)
        z, xs, fs, best, its, stop = z0[i].clone(), [], [], float("inf"), [], steps
        for t in range(steps):
            fz = f(z.unsqueeze(0), i)[0]
            res = float((fz - z).norm() / (fz.norm() + 1e-8))
            if restart is not None and res > restart * best:
                xs, fs = [], []
                restarts[i] += 1
            best = min(best, res)
            xs, fs = [*xs, z][-m:], [*fs, fz][-m:]
            xst, fst = torch.stack(xs), torch.stack(fs)
            a = _kkt_weights(fst - xst, reg)
            z = a @ (beta * fst + (1 - beta) * xst)
            its.append(z)
            if tol is not None and res < tol:
                stop = t + 1
                break
        out.append(its)
        halted.append(stop)
    return out, halted, restarts


def _problem(d: int = 10, b: int = 3, seed: int = 0):
    w = sym_map(d, torch.linspace(-0.95, 0.95, d, dtype=DT), seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(b, d, generator=g, dtype=DT)
    scale = torch.tensor([0.5, 1.0, 1.6][:b], dtype=DT).view(b, 1)  # different contraction per sample

    def step(z, x, s):
        return torch.tanh(s * (z @ w.T) + x)

    def one(z, i):
        return step(z, x[i : i + 1], scale[i : i + 1])

    return step, one, x, scale


def _engine_iterates(step, x, scale, cfg):
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(x.shape[0])}

    def callback(t, z, idx):
        for row, i in enumerate(idx.tolist()):
            seen[i].append(z[row].clone())

    res = run_loop(step, torch.zeros_like(x), cfg, ctx=(x, scale), callback=callback)
    return res, seen


@pytest.mark.parametrize(("m", "beta", "reg"), [(3, 1.0, 1e-4), (4, 0.7, 1e-4), (5, 1.0, 1e-9)])
def test_engine_anderson_iterates_equal_the_textbook_float64_reference(
    m: int, beta: float, reg: float
) -> None:
    step, one, x, scale = _problem()
    steps = 3 * m + 2  # the ring wraps more than twice
    cfg = LoopConfig(
        solver="anderson",
        plugins={"anderson": {"m": m, "beta": beta, "reg": reg}},
        halting="fixed",
        max_steps=steps,
        trace=True,
    )
    _, seen = _engine_iterates(step, x, scale, cfg)
    ref, _, _ = reference_anderson(one, torch.zeros_like(x), m, reg, beta, steps)
    for i in range(x.shape[0]):
        assert len(seen[i]) == steps
        for t in range(steps):
            torch.testing.assert_close(seen[i][t], ref[i][t], rtol=0, atol=1e-11)


def test_per_sample_halting_with_compaction_stops_where_the_reference_does() -> None:
    step, one, x, scale = _problem()
    tol = 1e-9
    cfg = LoopConfig(solver="anderson", plugins={"anderson": {"m": 4}}, halting="residual", tol=tol, max_steps=400)
    res, seen = _engine_iterates(step, x, scale, cfg)
    ref, halted, _ = reference_anderson(one, torch.zeros_like(x), 4, 1e-4, 1.0, 400, tol=tol)
    assert res.steps.tolist() == halted and len(set(halted)) > 1  # samples stop at different steps
    for i in range(x.shape[0]):
        assert len(seen[i]) == halted[i]
        torch.testing.assert_close(torch.stack(seen[i]), torch.stack(ref[i]), rtol=0, atol=1e-10)
        torch.testing.assert_close(res.state[i], ref[i][-1], rtol=0, atol=1e-10)


def test_safe_anderson_restarts_like_the_reference() -> None:
    """A map whose residual jumps (a shifted target at step 6) triggers the tenfold-rise restart."""
    step0, _, x, scale = _problem()
    calls = {"n": 0}

    def step(z, x, s):  # the engine calls it once per iteration on the active rows
        calls["n"] += 1
        return step0(z, x + (3.0 if calls["n"] > 6 else 0.0), s)

    ref_calls = {}

    def one(z, i):
        ref_calls[i] = ref_calls.get(i, 0) + 1
        return step0(z, x[i : i + 1] + (3.0 if ref_calls[i] > 6 else 0.0), scale[i : i + 1])

    cfg = LoopConfig(solver="safe_anderson", halting="fixed", max_steps=14, trace=True)
    opts = cfg.options_for("safe_anderson")
    _, seen = _engine_iterates(step, x, scale, cfg)
    ref, _, restarts = reference_anderson(
        one, torch.zeros_like(x), opts.m, opts.reg, opts.beta, 14, restart=opts.restart
    )
    assert all(r >= 1 for r in restarts), restarts  # the safeguard fired for every sample
    for i in range(x.shape[0]):
        torch.testing.assert_close(torch.stack(seen[i]), torch.stack(ref[i]), rtol=0, atol=1e-9)


@pytest.mark.parametrize("solver", ["anderson", "safe_anderson"])
def test_linear_fixed_point_matches_the_closed_form(solver: str) -> None:
    d, b = 48, 4
    w = sym_map(d, torch.linspace(-0.99, 0.99, d, dtype=DT), 3)
    x = torch.randn(b, d, generator=torch.Generator().manual_seed(4), dtype=DT)
    z_star = torch.linalg.solve(torch.eye(d, dtype=DT) - w, x.T).T
    cfg = LoopConfig(solver=solver, halting="residual", tol=1e-12, residual_norm="rel_l2", max_steps=3000)
    res = run_loop(lambda z, x: z @ w.T + x, torch.zeros_like(x), cfg, ctx=(x,))
    assert res.converged.all()
    rel = (res.state - z_star).norm(dim=1) / z_star.norm(dim=1)
    assert float(rel.max()) < 1e-12 / (1 - 0.99) * 10


def test_row_vector_dots_equal_the_matrix_vector_product() -> None:
    g = torch.Generator().manual_seed(0)
    terms, y = torch.randn(5, 7, 33, generator=g, dtype=DT), torch.randn(5, 33, generator=g, dtype=DT)
    expect = torch.einsum("bnd,bd->bn", terms, y)
    torch.testing.assert_close(_dots(terms, y), expect, rtol=1e-14, atol=1e-14)
    strided = torch.randn(5, 4, 33, generator=g, dtype=DT)[:, 1]  # a ring slot: a strided view
    torch.testing.assert_close(_dots(terms, strided), torch.einsum("bnd,bd->bn", terms, strided))


def test_solver_arithmetic_leaves_autocast_and_is_free_outside_it() -> None:
    z = torch.zeros(2, 3)
    with exact(z):
        assert not torch.is_autocast_enabled("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with exact(z):
            assert not torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu")
        # an Anderson step inside a bf16 region: float32 buffers, the same next iterate as outside it
        solver = Anderson(LoopConfig(plugins={"anderson": {"m": 3}}))
        zb = torch.randn(2, 3).to(torch.bfloat16)
        fb = torch.randn(2, 3).to(torch.bfloat16)
        state = solver.init(zb)
        out, state, _ = solver.update(zb, fb, None, state)
        out2, state2, _ = solver.update(out, (out * 0.5 + fb).to(torch.bfloat16), None, state)
    assert state2["g"].dtype == torch.float32 and out2.dtype == torch.bfloat16
    ref = Anderson(LoopConfig(plugins={"anderson": {"m": 3}}))
    s = ref.init(zb)
    o, s, _ = ref.update(zb, fb, None, s)
    o2, _, _ = ref.update(o, (o * 0.5 + fb).to(torch.bfloat16), None, s)
    torch.testing.assert_close(out2, o2, rtol=0, atol=0)
