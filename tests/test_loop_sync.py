"""The deferred halting path (``LoopConfig.sync_every``): halting decided on the device, the host reading
once every k iterations (or never), gives the per-step path's results exactly, and reads the host that often."""

import pytest
import torch

from loopformer.devices import HostReads
from loopformer.loop import LoopConfig, run_loop

DT = torch.float64


def nonlinear(z, x, w):
    return torch.tanh(z @ w.T + x) * 0.9 + 0.1 * z


def _problem(b: int = 6, t: int = 3, d: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(d, d, generator=g, dtype=DT) / d**0.5).requires_grad_()
    scale = torch.linspace(0.1, 3.0, b, dtype=DT)[:, None, None]
    x = (torch.randn(b, t, d, generator=g, dtype=DT) * scale).requires_grad_()
    return w, x, torch.zeros(b, t, d, dtype=DT)


def _run(cfg: LoopConfig, w, x, z0, **kw):
    res = run_loop(lambda z, x: nonlinear(z, x, w), z0, cfg, ctx=(x,), **kw)
    grads = torch.autograd.grad(res.state.pow(2).sum(), [w, x]) if res.state.requires_grad else None
    return res, grads


def _same(a, b, ga, gb) -> None:
    """``a`` (deferred) equals ``b`` (per step); with sync_every=0 a's traces run to max_steps, NaN after
    the rows the per-step path ran."""
    n = b.residuals.shape[0]
    assert torch.isnan(a.residuals[n:]).all() and torch.isnan(a.state_norms[n:]).all()
    a.residuals, a.state_norms = a.residuals[:n], a.state_norms[:n]
    assert a.steps.tolist() == b.steps.tolist()
    assert a.converged.tolist() == b.converged.tolist()
    torch.testing.assert_close(a.state, b.state, rtol=0, atol=1e-12)
    torch.testing.assert_close(a.residuals, b.residuals, rtol=1e-9, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(a.state_norms, b.state_norms, rtol=1e-9, atol=1e-12, equal_nan=True)
    assert a.stats.keys() == b.stats.keys()
    for k in a.stats:
        torch.testing.assert_close(a.stats[k], b.stats[k], rtol=0, atol=1e-12, equal_nan=True)
    if ga is not None:
        for u, v in zip(ga, gb):
            torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("solver", ["picard", "damped", "anderson", "broyden"])
@pytest.mark.parametrize("halting", ["residual", "batch_residual", "fixed"])
@pytest.mark.parametrize("compaction", [True, False])
def test_deferred_equals_per_step(solver, halting, compaction):
    w, x, z0 = _problem()
    base = dict(
        solver=solver,
        halting=halting,
        tol=1e-6,
        max_steps=60,
        min_steps=2,
        compaction=compaction,
        grad="bptt",
    )
    ref, gref = _run(LoopConfig(**base, sync_every=1), w, x, z0)
    if halting == "residual":
        assert len(set(ref.steps.tolist())) > 1, ref.steps  # the rows halt at different steps
    for every in (0, 3, 7):
        out, g = _run(LoopConfig(**base, sync_every=every), w, x, z0)
        _same(out, ref, g, gref)


@pytest.mark.parametrize("grad", ["truncated", "onestep", "ift"])
def test_deferred_equals_per_step_other_gradients(grad):
    w, x, z0 = _problem()
    base = dict(solver="damped", halting="fixed" if grad == "truncated" else "residual", tol=1e-6,
                max_steps=40, grad=grad, grad_steps=3)  # fmt: skip
    ref, gref = _run(LoopConfig(**base, sync_every=1), w, x, z0)
    out, g = _run(LoopConfig(**base, sync_every=0), w, x, z0)
    _same(out, ref, g, gref)


def test_deferred_act_and_kl_entropy():
    w, x, z0 = _problem()
    halt = torch.nn.Linear(8, 1, dtype=DT)

    def halt_fn(z, x):
        return torch.sigmoid(halt(z).squeeze(-1) - 1.0)

    for every in (0, 2):
        cfg = dict(solver="picard", halting="act", max_steps=12, grad="bptt")
        ref, gref = _run(LoopConfig(**cfg, sync_every=1), w, x, z0, halt_fn=halt_fn)
        out, g = _run(LoopConfig(**cfg, sync_every=every), w, x, z0, halt_fn=halt_fn)
        _same(out, ref, g, gref)
        torch.testing.assert_close(out.ponder_cost, ref.ponder_cost, rtol=0, atol=1e-12)
    head = torch.randn(8, 5, dtype=DT)
    cfg = dict(solver="picard", halting="kl_entropy", max_steps=30,
               plugins={"kl_entropy": {"kl_threshold": 1e-4, "entropy_threshold": 10.0}})
    ref, _ = _run(LoopConfig(**cfg, sync_every=1), w, x, z0, readout=lambda z, x: z @ head)
    out, _ = _run(LoopConfig(**cfg, sync_every=4), w, x, z0, readout=lambda z, x: z @ head)
    _same(out, ref, None, None)


def test_deferred_divergence_keeps_the_last_finite_iterate():
    def blows_up(z, rate):
        return z * rate

    z0 = torch.ones(3, 4, dtype=DT)
    rate = torch.tensor([0.5, 50.0, 1e300], dtype=DT)[:, None]
    cfg = dict(halting="residual", tol=1e-3, max_steps=30, diverge_threshold=1e4)
    ref = run_loop(blows_up, z0, LoopConfig(**cfg, sync_every=1), ctx=(rate,))
    for every in (0, 5):
        out = run_loop(blows_up, z0, LoopConfig(**cfg, sync_every=every), ctx=(rate,))
        _same(out, ref, None, None)
    assert not ref.converged[1:].any() and torch.isfinite(ref.state).all()


@pytest.mark.parametrize("every, reads", [(0, 0), (5, 4)])
def test_deferred_reads_the_host_once_every_k_iterations(every, reads):
    w, x, z0 = _problem()
    cfg = LoopConfig(solver="damped", halting="residual", tol=1e-30, max_steps=16, sync_every=every)
    with torch.no_grad(), HostReads() as counter:
        out = run_loop(lambda z, x: nonlinear(z, x, w), z0, cfg, ctx=(x,))
    assert out.steps.tolist() == [16] * 6
    assert counter.total == reads, counter.counts  # checks after iterations 5, 10, 15 and the last
    with torch.no_grad(), HostReads() as per_step:
        run_loop(
            lambda z, x: nonlinear(z, x, w), z0, LoopConfig(**{**cfg.__dict__, "sync_every": 1}), ctx=(x,)
        )
    assert per_step.total >= 16  # the per-step path asks after every iteration
