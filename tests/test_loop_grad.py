"""Gradient-mode oracles (float64): closed-form implicit gradients, hand-unrolled autograd, memory."""

import pytest
import torch
from loop_helpers import DT, sym_map
from torch.autograd.graph import saved_tensors_hooks

from loopformer.loop import LoopConfig, run_loop

D, B = 6, 3


def problem(rho: float = 0.9, seed: int = 0):
    g = torch.Generator().manual_seed(seed + 7)
    eigs = torch.linspace(-rho, rho, D, dtype=DT)
    w = sym_map(D, eigs, seed).requires_grad_()
    x = torch.randn(B, D, generator=g, dtype=DT).requires_grad_()
    c = torch.randn(B, D, generator=g, dtype=DT)
    return w, x, c


def lin(z, x, w):
    return z @ w.T + x


def closed_form(w, x, c):
    """z* = (I - W)^-1 x; u = (I - W)^-T c; dL/dx = u; dL/dW = sum_b u_b z*_b^T."""
    eye = torch.eye(D, dtype=DT)
    wd = w.detach()
    z = torch.linalg.solve(eye - wd, x.detach().T).T
    u = torch.linalg.solve((eye - wd).T, c.T).T
    return z, u, u.T @ z


def engine_grads(cfg, w, x, c, z0=None, step=lin):
    z0 = torch.zeros(B, D, dtype=DT) if z0 is None else z0
    res = run_loop(lambda z, x: step(z, x, w), z0, cfg, ctx=(x,))
    inputs = [w, x] + ([z0] if z0.requires_grad else [])
    grads = torch.autograd.grad((c * res.state).sum(), inputs, allow_unused=True)
    return res, grads


@pytest.mark.parametrize("ift_solver", ["picard", "anderson"])
def test_ift_matches_closed_form(ift_solver):
    w, x, c = problem()
    cfg = LoopConfig(solver="anderson", halting="residual", tol=1e-13, max_steps=2000, grad="ift",
                     plugins={"ift": {"solver": ift_solver, "tol": 1e-12, "max_steps": 2000}})
    res, (gw, gx) = engine_grads(cfg, w, x, c)
    z, u, gw_ref = closed_form(w, x, c)
    torch.testing.assert_close(res.state, z, rtol=0, atol=1e-10)
    torch.testing.assert_close(gx, u, rtol=0, atol=1e-6)
    torch.testing.assert_close(gw, gw_ref, rtol=0, atol=1e-6)


def test_neumann_error_falls_monotonically():
    w, x, c = problem()
    _, u, gw_ref = closed_form(w, x, c)
    errs_x, errs_w = [], []
    for k in [0, 1, 2, 4, 8, 16, 32, 64]:
        cfg = LoopConfig(solver="anderson", halting="residual", tol=1e-13, max_steps=2000, grad="neumann", grad_steps=k)
        _, (gw, gx) = engine_grads(cfg, w, x, c)
        errs_x.append(float((gx - u).norm()))
        errs_w.append(float((gw - gw_ref).norm()))
    assert all(a > b for a, b in zip(errs_x, errs_x[1:])), errs_x
    assert all(a > b for a, b in zip(errs_w, errs_w[1:])), errs_w
    assert errs_x[-1] < 1e-2 * errs_x[0]


def test_onestep_equals_neumann_zero_and_closed_form():
    w, x, c = problem()
    base = dict(solver="anderson", halting="residual", tol=1e-13, max_steps=2000)
    res1, g1 = engine_grads(LoopConfig(grad="onestep", **base), w, x, c)
    res2, g2 = engine_grads(LoopConfig(grad="neumann", grad_steps=0, **base), w, x, c)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    z = res1.state.detach()
    torch.testing.assert_close(g1[1], c, rtol=0, atol=1e-12)  # u = v
    torch.testing.assert_close(g1[0], c.T @ z, rtol=0, atol=1e-12)


def test_neumann_clip_matches_formula():
    """Attractor's onestep: u = v + clip(J^T v) with ||clip(J^T v)|| <= clip * ||v|| per sample."""
    w, x, c = problem()
    clip = 0.1
    cfg = LoopConfig(solver="anderson", halting="residual", tol=1e-13, max_steps=2000, grad="neumann",
                     grad_steps=1, plugins={"neumann": {"clip": clip}})
    res, (gw, gx) = engine_grads(cfg, w, x, c)
    jt = c @ w.detach()  # J^T v per sample (rows): W^T c_b
    scale = (clip * c.norm(dim=1) / jt.norm(dim=1)).clamp(max=1.0)
    u = c + jt * scale[:, None]
    torch.testing.assert_close(gx, u, rtol=0, atol=1e-12)
    torch.testing.assert_close(gw, u.T @ res.state.detach(), rtol=0, atol=1e-12)


def tanh_step(z, x, w):
    return torch.tanh(z @ w.T + x)


def unrolled(step, z0, x, w, n: int, k: int | None, etas=None):
    """Hand-built reference: n steps, autograd only through the last k (all if k is None)."""
    z = z0
    for i in range(n):
        if k is not None and i == n - k and i > 0:
            z = z.detach()
        f = step(z, x, w)
        z = f if etas is None else etas[i] * f + (1 - etas[i]) * z
    return z


@pytest.mark.parametrize("compaction", [True, False])
@pytest.mark.parametrize("n,k", [(10, 3), (10, 1), (5, 5), (4, 9)])
def test_truncated_fixed_equals_last_k_unrolled(n, k, compaction):
    w, x, c = problem()
    z0 = (0.3 * torch.randn(B, D, dtype=DT)).requires_grad_()
    cfg = LoopConfig(halting="fixed", max_steps=n, grad="truncated", grad_steps=k, compaction=compaction)
    res, grads = engine_grads(cfg, w, x, c, z0=z0, step=tanh_step)
    ref = unrolled(tanh_step, z0, x, w, n, k)
    torch.testing.assert_close(res.state, ref, rtol=0, atol=0)
    ref_grads = torch.autograd.grad((c * ref).sum(), [w, x, z0], allow_unused=True)
    for a, b in zip(grads, ref_grads):
        if b is None:
            assert a is None or torch.count_nonzero(a) == 0
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-14)


@pytest.mark.parametrize("compaction", [True, False])
@pytest.mark.parametrize("k", [1, 3, 50])
def test_truncated_adaptive_replays_last_k_steps(k, compaction):
    """Residual halting: each sample's own last k steps are differentiable (ring-buffer replay)."""
    w, x, c = problem()
    x = (x.detach() * torch.tensor([[0.2], [1.0], [3.0]], dtype=DT)).requires_grad_()
    z0 = torch.zeros(B, D, dtype=DT, requires_grad=True)
    cfg = LoopConfig(halting="residual", tol=1e-6, max_steps=200, grad="truncated", grad_steps=k, compaction=compaction)
    res, grads = engine_grads(cfg, w, x, c, z0=z0, step=tanh_step)
    assert len(set(res.steps.tolist())) > 1, res.steps  # samples halt at different steps
    refs = [unrolled(tanh_step, z0[i : i + 1], x[i : i + 1], w, int(res.steps[i]), k) for i in range(B)]
    ref = torch.cat(refs)
    torch.testing.assert_close(res.state, ref, rtol=0, atol=1e-15)
    ref_grads = torch.autograd.grad((c * ref).sum(), [w, x, z0], allow_unused=True)
    for a, b in zip(grads, ref_grads):
        if b is None:
            assert a is None or torch.count_nonzero(a) == 0
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


def reference_damped_etas(step, z0, n, tol, gamma=0.9, patience=5):
    """FPRM Algorithm 1 for one sample, returning the eta used at each step (independent)."""
    eta, best, p, etas, y = 1.0, float("inf"), patience, [], z0.detach()
    for _ in range(n):
        z = step(y)
        r = float((z - y).norm() / (z.norm() + 1e-8))
        etas.append(eta)
        y = eta * z + (1 - eta) * y
        if r < best:
            best, p = r, patience
        else:
            p -= 1
        if p <= 0 and r >= tol:
            eta, p = eta * gamma, patience
    return etas


@pytest.mark.parametrize("halting", ["fixed", "residual"])
def test_truncated_damped_includes_damping(halting):
    eigs = torch.tensor([-1.5, 0.5, 0.3, -0.2, 0.1, 0.4], dtype=DT)
    w = sym_map(D, eigs, 3).requires_grad_()
    x = torch.randn(B, D, dtype=DT, requires_grad=True)
    c = torch.randn(B, D, dtype=DT)
    n, k = 60, 4
    z0 = torch.zeros(B, D, dtype=DT)
    cfg = LoopConfig(solver="damped", halting=halting, tol=1e-5, max_steps=n, grad="truncated", grad_steps=k)
    res, grads = engine_grads(cfg, w, x, c, z0=z0, step=lin)
    refs = []
    for i in range(B):
        ni = int(res.steps[i])
        etas = reference_damped_etas(lambda y, i=i: lin(y, x[i : i + 1].detach(), w.detach()), z0[i : i + 1], ni, 1e-5)
        assert min(etas) < 1.0  # damping actually kicked in
        refs.append(unrolled(lin, z0[i : i + 1], x[i : i + 1], w, ni, k, etas=etas))
    ref = torch.cat(refs)
    torch.testing.assert_close(res.state, ref, rtol=0, atol=1e-13)
    ref_grads = torch.autograd.grad((c * ref).sum(), [w, x])
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("halting", ["fixed", "residual"])
@pytest.mark.parametrize("compaction", [True, False])
def test_bptt_equals_full_unroll(halting, compaction):
    w, x, c = problem()
    x = (x.detach() * torch.tensor([[0.2], [1.0], [3.0]], dtype=DT)).requires_grad_()
    z0 = (0.1 * torch.randn(B, D, dtype=DT)).requires_grad_()
    cfg = LoopConfig(halting=halting, tol=1e-5, max_steps=40, grad="bptt", compaction=compaction)
    res, grads = engine_grads(cfg, w, x, c, z0=z0, step=tanh_step)
    ref = torch.cat([unrolled(tanh_step, z0[i : i + 1], x[i : i + 1], w, int(res.steps[i]), None) for i in range(B)])
    torch.testing.assert_close(res.state, ref, rtol=0, atol=1e-15)
    ref_grads = torch.autograd.grad((c * ref).sum(), [w, x, z0])
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


def test_truncated_k_ge_steps_equals_bptt():
    w, x, c = problem()
    z0 = (0.1 * torch.randn(B, D, dtype=DT)).requires_grad_()
    g_b = engine_grads(LoopConfig(max_steps=7, grad="bptt"), w, x, c, z0=z0, step=tanh_step)[1]
    g_t = engine_grads(LoopConfig(max_steps=7, grad="truncated", grad_steps=7), w, x, c, z0=z0, step=tanh_step)[1]
    for a, b in zip(g_b, g_t):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("solver", ["picard", "damped", "anderson", "broyden"])
@pytest.mark.parametrize("grad", ["bptt", "truncated", "onestep", "neumann", "ift"])
def test_gradient_path_even_when_converged_at_start(solver, grad):
    """z0 already the fixed point: the state must still carry a gradient through step (TorchDEQ issue 8)."""
    w, x, c = problem()
    z_star, u, _ = closed_form(w, x, c)
    cfg = LoopConfig(solver=solver, halting="residual", tol=1e-6, max_steps=50, grad=grad, grad_steps=1)
    res = run_loop(lambda z, x: lin(z, x, w), z_star.clone(), cfg, ctx=(x,))
    assert (res.steps == 1).all() and res.converged.all()
    assert res.state.requires_grad
    gw, gx = torch.autograd.grad((c * res.state).sum(), [w, x])
    assert torch.count_nonzero(gx) > 0 and torch.count_nonzero(gw) > 0


@pytest.mark.parametrize("grad", ["bptt", "truncated", "onestep", "neumann", "ift"])
def test_no_grad_context_runs_without_graph(grad):
    w, x, _ = problem()
    with torch.no_grad():
        res = run_loop(lambda z, x: lin(z, x, w), torch.zeros(B, D, dtype=DT), LoopConfig(grad=grad, max_steps=5), ctx=(x,))
    assert not res.state.requires_grad


@pytest.mark.parametrize("solver", ["anderson", "broyden"])
def test_truncated_quasi_newton_is_straight_through_picard(solver):
    """anderson / broyden truncated: value = solver output, gradient = k Picard steps from it."""
    w, x, c = problem()
    cfg = LoopConfig(solver=solver, halting="residual", tol=1e-12, max_steps=500, grad="truncated", grad_steps=2)
    res, (gw, gx) = engine_grads(cfg, w, x, c, step=tanh_step)
    zs = res.state.detach()
    ref = tanh_step(tanh_step(zs, x, w), x, w)
    torch.testing.assert_close(res.state, zs, rtol=0, atol=0)
    rgw, rgx = torch.autograd.grad((c * ref).sum(), [w, x])
    torch.testing.assert_close(gw, rgw, rtol=0, atol=1e-13)
    torch.testing.assert_close(gx, rgx, rtol=0, atol=1e-13)


def saved_bytes(cfg: LoopConfig, n: int) -> int:
    torch.manual_seed(0)
    d = 32
    w = (torch.randn(d, d) * 0.5 / d**0.5).requires_grad_()
    x = torch.randn(4, d, requires_grad=True)
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    cfg.max_steps = n
    if cfg.halting == "residual":  # never converges, never diverges: every sample runs to the cap

        def step(z, x):
            return z + torch.tanh(z @ w.T + x)
    else:

        def step(z, x):
            return torch.tanh(z @ w.T + x)

    with saved_tensors_hooks(pack, lambda t: t):
        res = run_loop(step, torch.zeros(4, d), cfg, ctx=(x,))
        assert (res.steps == n).all()
    res.state.sum().backward()
    return total


@pytest.mark.parametrize(
    "cfg",
    [
        dict(grad="truncated", grad_steps=2),
        dict(grad="truncated", grad_steps=2, halting="residual", tol=1e-9),  # replay path
        dict(grad="truncated", grad_steps=2, solver="anderson"),
        dict(grad="onestep"),
        dict(grad="neumann", grad_steps=3),
        dict(grad="ift", solver="anderson"),
    ],
    ids=["truncated", "truncated-adaptive", "truncated-anderson", "onestep", "neumann", "ift"],
)
def test_memory_flat_in_steps(cfg):
    sizes = [saved_bytes(LoopConfig(**cfg), n) for n in (4, 16, 64)]
    assert sizes[0] > 0
    assert sizes[0] == sizes[1] == sizes[2], sizes


def test_memory_linear_for_bptt():
    sizes = [saved_bytes(LoopConfig(grad="bptt"), n) for n in (4, 16, 64)]
    per_step = (sizes[2] - sizes[1]) / 48
    assert per_step > 0
    assert abs((sizes[1] - sizes[0]) / 12 - per_step) < 1e-9 * per_step + 1, sizes
    assert sizes[2] > 10 * sizes[0]
