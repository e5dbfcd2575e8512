"""Halting oracles: hand-built maps whose samples halt at known steps; KL+entropy; Graves ACT; divergence."""

import math

import numpy as np
import pytest
import torch
from scipy.stats import entropy as scipy_entropy

from loopformer.loop import LoopConfig, run_loop

DT = torch.float64


def countdown(z, dec):
    """State [B, 2] = (counter, 1): the counter falls by dec per step to 0, then the map is at rest."""
    return torch.stack([(z[:, 0] - dec).clamp(min=0), z[:, 1]], dim=1)


@pytest.mark.parametrize("compaction", [True, False])
@pytest.mark.parametrize("min_steps", [0, 6])
def test_residual_halting_per_sample_known_steps(compaction, min_steps):
    c0 = torch.tensor([3.0, 0.0, 8.0, 2.0], dtype=DT)
    dec = torch.tensor([1.0, 1.0, 2.0, 0.5], dtype=DT)
    z0 = torch.stack([c0, torch.ones(4, dtype=DT)], dim=1)
    cfg = LoopConfig(halting="residual", tol=1e-9, max_steps=20, min_steps=min_steps, compaction=compaction)
    res = run_loop(countdown, z0, cfg, ctx=(dec,))
    expected = torch.ceil(c0 / dec).long() + 1  # the first step that sees the counter at 0
    expected = expected.clamp(min=min_steps)
    assert res.steps.tolist() == expected.tolist()
    assert res.converged.all()
    assert (res.state[:, 0] == 0).all()
    t = torch.arange(res.residuals.shape[0])[:, None]
    ran = t < res.steps[None, :]
    assert torch.isfinite(res.residuals[ran]).all() and torch.isnan(res.residuals[~ran]).all()
    assert torch.isfinite(res.state_norms[ran]).all() and torch.isnan(res.state_norms[~ran]).all()
    assert res.residuals.shape[0] == int(expected.max())
    # state norms: RMS of the state after each step
    b = 2
    for step in range(int(res.steps[b])):
        cnt = max(0.0, 8.0 - 2.0 * (step + 1))
        assert math.isclose(float(res.state_norms[step, b]), math.sqrt((cnt**2 + 1) / 2), rel_tol=1e-12)


def test_fixed_halting_runs_exactly_max_steps():
    z0 = torch.stack([torch.tensor([3.0, 0.0], dtype=DT), torch.ones(2, dtype=DT)], dim=1)
    for halting in ("fixed", "never"):
        res = run_loop(countdown, z0, LoopConfig(halting=halting, max_steps=7), ctx=(torch.ones(2, dtype=DT),))
        assert res.steps.tolist() == [7, 7]
        assert res.residuals.shape == (7, 2) and torch.isfinite(res.residuals).all()
        assert res.converged.all()  # residual 0 at the last step


def nonlinear(z, x, w):
    return torch.tanh(z @ w.T + x) * 0.9 + 0.1 * z


@pytest.mark.parametrize("solver", ["picard", "damped", "anderson", "broyden"])
@pytest.mark.parametrize("norm", ["rel_l2", "rel_sup"])
def test_compaction_equals_masking(solver, norm):
    torch.manual_seed(1)
    b, t, d = 5, 3, 8
    w = (torch.randn(d, d, dtype=DT) / d**0.5).requires_grad_()
    x = (torch.randn(b, t, d, dtype=DT) * torch.linspace(0.1, 3.0, b, dtype=DT)[:, None, None]).requires_grad_()
    z0 = torch.zeros(b, t, d, dtype=DT)
    out = {}
    for compaction in (True, False):
        cfg = LoopConfig(solver=solver, halting="residual", residual_norm=norm, tol=1e-7, max_steps=300,
                         compaction=compaction, grad="bptt")
        res = run_loop(lambda z, x: nonlinear(z, x, w), z0, cfg, ctx=(x,))
        grads = torch.autograd.grad(res.state.pow(2).sum(), [w, x])
        out[compaction] = (res, grads)
    (a, ga), (m, gm) = out[True], out[False]
    assert len(set(a.steps.tolist())) > 1, a.steps
    assert a.steps.tolist() == m.steps.tolist()
    assert a.converged.tolist() == m.converged.tolist()
    torch.testing.assert_close(a.state, m.state, rtol=0, atol=1e-12)
    # a residual is a norm of f(z) - z, so it inherits the state's 1e-12 (Broyden's batched low-rank update
    # rounds differently over 5 rows than over the active ones: ~1e-13 on residuals near tol)
    torch.testing.assert_close(a.residuals, m.residuals, rtol=1e-9, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(a.state_norms, m.state_norms, rtol=1e-12, atol=0, equal_nan=True)
    for g1, g2 in zip(ga, gm):
        torch.testing.assert_close(g1, g2, rtol=1e-9, atol=1e-12)


def test_callback_sees_active_samples():
    c0 = torch.tensor([1.0, 4.0, 2.0], dtype=DT)
    z0 = torch.stack([c0, torch.ones(3, dtype=DT)], dim=1)
    seen = []
    run_loop(countdown, z0, LoopConfig(halting="residual", tol=1e-9, max_steps=10), ctx=(torch.ones(3, dtype=DT),),
             callback=lambda t, z, idx: seen.append((t, idx.tolist(), z[:, 0].tolist())))
    assert [s[0] for s in seen] == [1, 2, 3, 4, 5]
    assert seen[0] == (1, [0, 1, 2], [0.0, 3.0, 1.0])
    assert seen[2][1] == [1, 2] and seen[3][1] == [1] and seen[4][1] == [1]


# ---- LTG KL + entropy --------------------------------------------------------------------------

def counter(z, table):
    return z + 1


def table_readout(z, table):
    """logits = table[b, counter_b] (table is batch-first ctx [B, S, ..., V])."""
    i = z[:, 0].long()
    return table[torch.arange(z.shape[0]), i]


def softmax_np(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def expected_kl_entropy(table: np.ndarray, max_steps: int, kl_thr: float, h_thr: float, reduce: str):
    """Independent oracle (scipy): first t >= 1 with KL(p_t || p_{t-1}) < kl_thr and H(p_t) < h_thr."""
    red = np.max if reduce == "max" else np.mean
    out = []
    for b in range(table.shape[0]):
        n, conv = max_steps, False
        for t in range(1, max_steps + 1):
            p, q = softmax_np(table[b, t]), softmax_np(table[b, t - 1])
            p2, q2 = p.reshape(-1, p.shape[-1]), q.reshape(-1, q.shape[-1])
            kl = red([scipy_entropy(pi, qi) for pi, qi in zip(p2, q2)])
            h = red([scipy_entropy(pi) for pi in p2])
            if kl < kl_thr and h < h_thr:
                n, conv = t, True
                break
        out.append((n, conv))
    return out


def build_tables(positions: int | None):
    v, s = 32, 12
    shape = (s, v) if positions is None else (s, positions, v)
    rng = np.random.default_rng(0)
    tabs = []
    sharp = np.zeros(shape)
    sharp[..., 3] = 12.0
    tabs.append(sharp)  # confident and stable from the start: halts at t = 1
    moving = np.zeros(shape)
    for t, k in enumerate([0, 1, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3]):
        moving[t, ..., k] = 12.0
    tabs.append(moving)  # argmax settles at step 3: KL(p_4 || p_3) = 0 -> halts at t = 4
    tabs.append(np.zeros(shape))  # uniform over 32: H = ln 32 > 3 never halts
    sharpen = np.zeros(shape)
    for t in range(s):
        sharpen[t, ..., 5] = 1.5 * t
    tabs.append(sharpen)  # entropy and KL fall gradually
    noisy = sharpen + rng.normal(0, 0.05, size=shape)
    if positions is not None:
        noisy[:, 0] = np.zeros((s, v))  # one unsettled position blocks a max-reduced halt
    tabs.append(noisy)
    return np.stack(tabs)


@pytest.mark.parametrize("positions", [None, 3])
@pytest.mark.parametrize("reduce", ["max", "mean"])
@pytest.mark.parametrize("compaction", [True, False])
def test_kl_entropy_halts_where_expected(positions, reduce, compaction):
    table = build_tables(positions)
    max_steps = 10
    cfg = LoopConfig(halting="kl_entropy", plugins={"kl_entropy": {"kl_threshold": 1e-3, "entropy_threshold": 3.0, "reduce": reduce}},
                     max_steps=max_steps, compaction=compaction)
    b = table.shape[0]
    res = run_loop(counter, torch.zeros(b, 1, dtype=DT), cfg, ctx=(torch.tensor(table),), readout=table_readout)
    expected = expected_kl_entropy(table, max_steps, 1e-3, 3.0, reduce)
    assert res.steps.tolist() == [n for n, _ in expected]
    assert res.converged.tolist() == [c for _, c in expected]
    if positions is None:
        assert res.steps.tolist()[:3] == [1, 4, max_steps]
    assert len(set(res.steps.tolist())) >= 3
    torch.testing.assert_close(res.logits, table_readout(res.state, torch.tensor(table)))


def test_kl_direction_is_p_t_against_p_prev():
    """KL(p_t || p_{t-1}) is asymmetric: a table where only the reverse direction is below threshold."""
    v = 4
    a = np.log(np.array([0.97, 0.01, 0.01, 0.01]))
    bb = np.log(np.array([0.999, 0.0003, 0.0003, 0.0004]))
    # choose the two orders so KL(p1||p0) and KL(p0||p1) fall on opposite sides of a threshold
    kl_fwd = scipy_entropy(softmax_np(bb), softmax_np(a))
    kl_rev = scipy_entropy(softmax_np(a), softmax_np(bb))
    thr = (kl_fwd + kl_rev) / 2
    table = np.stack([np.stack([a, bb, bb, bb])])  # p0 = a, p1 = bb
    cfg = LoopConfig(halting="kl_entropy", plugins={"kl_entropy": {"kl_threshold": thr, "entropy_threshold": 3.0}}, max_steps=3)
    res = run_loop(counter, torch.zeros(1, 1, dtype=DT), cfg, ctx=(torch.tensor(table),), readout=table_readout)
    expected_first = 1 if kl_fwd < thr else 2
    assert v == 4 and kl_fwd != kl_rev
    assert int(res.steps[0]) == expected_first


# ---- Graves ACT -------------------------------------------------------------------------------

def act_step(z, probs):
    """State [..., 2] = (counter, counter^2)."""
    c = z[..., 0] + 1
    return torch.stack([c, c * c], dim=-1)


def act_reference(h_seq: list[float], max_steps: int, eps: float):
    """Independent Graves ACT for one unit: N, R, weights, output of states (t, t^2)."""
    cum, weights = 0.0, []
    for t in range(1, max_steps + 1):
        h = h_seq[t - 1]
        if cum + h >= 1 - eps or t == max_steps:
            weights.append(1 - cum)
            return t, 1 - cum, weights, cum + h >= 1 - eps
        weights.append(h)
        cum += h
    raise AssertionError


@pytest.mark.parametrize("compaction", [True, False])
def test_act_per_sample(compaction):
    table = torch.tensor([
        [0.3, 0.3, 0.5, 0.5, 0.5, 0.5],  # cum 0.3, 0.6, 1.1 -> N = 3, R = 0.4
        [0.1, 0.1, 0.1, 0.1, 0.1, 0.1],  # never reaches: the last step (5) halts with R = 0.6
        [0.995, 0.2, 0.2, 0.2, 0.2, 0.2],  # N = 1, R = 1
        [0.5, 0.49, 0.3, 0.3, 0.3, 0.3],  # cum 0.99 >= 1 - eps at step 2: N = 2, R = 0.5
    ], dtype=DT)
    scale = torch.ones((), dtype=DT, requires_grad=True)

    def halt_fn(z, tab):
        return tab[torch.arange(z.shape[0]), z[:, 0].long() - 1] * scale

    max_steps = 5
    res = run_loop(act_step, torch.zeros(4, 2, dtype=DT), LoopConfig(halting="act", max_steps=max_steps, compaction=compaction),
                   ctx=(table,), halt_fn=halt_fn)
    for b in range(4):
        n, r, w, conv = act_reference(table[b].tolist(), max_steps, 0.01)
        assert int(res.steps[b]) == n and bool(res.converged[b]) == conv
        assert math.isclose(sum(w), 1.0, rel_tol=0, abs_tol=1e-12)
        out = [sum(wi * t for wi, t in zip(w, range(1, n + 1))), sum(wi * t * t for wi, t in zip(w, range(1, n + 1)))]
        torch.testing.assert_close(res.state[b], torch.tensor(out, dtype=DT), rtol=1e-12, atol=1e-12)
        assert math.isclose(float(res.ponder_cost[b].detach()), n + r, rel_tol=1e-12)
    assert res.steps.tolist() == [3, 5, 1, 2]
    assert res.converged.tolist() == [True, False, True, True]
    # ponder cost is differentiable through the remainder: d(N + R)/d scale = -sum_{t<N} h_t
    (g,) = torch.autograd.grad(res.ponder_cost.sum(), [scale])
    expected = -sum(float(table[b, : n - 1].sum()) for b, n in enumerate([3, 5, 1, 2]))
    assert math.isclose(float(g), expected, rel_tol=1e-12)


@pytest.mark.parametrize("compaction", [True, False])
def test_act_per_token(compaction):
    """UT-style per-token halting: tokens halt separately, halted tokens are frozen."""
    b, t, max_steps = 2, 3, 4
    g = torch.Generator().manual_seed(0)
    table = torch.rand(b, t, max_steps, generator=g, dtype=DT) * 0.6  # h for a token's k-th own step
    table[0, 0, 0] = 0.999  # token halts at step 1
    table[1, :, :] = 0.05  # sample 1 never reaches: all tokens halt at the cap

    def halt_fn(z, tab):
        k = z[..., 0].long() - 1  # the token's own step count (frozen tokens keep theirs)
        return torch.gather(tab, 2, k.clamp(max=max_steps - 1).unsqueeze(-1)).squeeze(-1)

    res = run_loop(act_step, torch.zeros(b, t, 2, dtype=DT), LoopConfig(halting="act", max_steps=max_steps, compaction=compaction),
                   ctx=(table,), halt_fn=halt_fn)
    ponder = []
    for i in range(b):
        ns, costs = [], []
        for j in range(t):
            n, r, w, _ = act_reference(table[i, j].tolist(), max_steps, 0.01)
            out = [sum(wk * k for wk, k in zip(w, range(1, n + 1))), sum(wk * k * k for wk, k in zip(w, range(1, n + 1)))]
            torch.testing.assert_close(res.state[i, j], torch.tensor(out, dtype=DT), rtol=1e-12, atol=1e-12)
            ns.append(n)
            costs.append(n + r)
        assert int(res.steps[i]) == max(ns)
        ponder.append(sum(costs) / t)
    torch.testing.assert_close(res.ponder_cost, torch.tensor(ponder, dtype=DT))
    assert not bool(res.converged[1])


# ---- divergence --------------------------------------------------------------------------------

def cubic(z, x, s):
    """s = 0: contraction to 2x. s = 1: z + x + z^2, no real fixed point for x > 0: blows up to inf."""
    return 0.5 * z + x + s[:, None] * (0.5 * z + z**2)


@pytest.mark.parametrize("compaction", [True, False])
@pytest.mark.parametrize("solver", ["picard", "anderson", "damped"])
def test_divergent_sample_does_not_poison_others(compaction, solver):
    s = torch.tensor([0.0, 1.0, 0.0], dtype=DT)
    x = torch.tensor([[1.0], [1.0], [2.0]], dtype=DT).requires_grad_()
    z0 = torch.full((3, 1), 1.5, dtype=DT)
    cfg = LoopConfig(solver=solver, halting="residual", tol=1e-10, max_steps=200, compaction=compaction)
    res = run_loop(cubic, z0, cfg, ctx=(x, s))
    assert torch.isfinite(res.state).all()
    assert res.converged.tolist() == [True, False, True]
    if solver == "picard":
        assert int(res.steps[1]) < 20
        assert not torch.isfinite(res.residuals[int(res.steps[1]), 1])  # the step that overflowed
    torch.testing.assert_close(res.state[[0, 2]], 2 * x.detach()[[0, 2]], rtol=0, atol=1e-8)
    (gx,) = torch.autograd.grad(res.state[[0, 2]].sum(), [x])
    # rows of the converged samples are exact; (a diverged row's own gradient may be 0 * inf = NaN:
    # batched autograd shares the step that overflowed)
    torch.testing.assert_close(gx[[0, 2]], torch.full((2, 1), 2.0, dtype=DT), rtol=0, atol=1e-6)


def test_all_samples_diverge_returns_unconverged():
    s = torch.ones(2, dtype=DT)
    x = torch.ones(2, 1, dtype=DT)
    res = run_loop(cubic, torch.full((2, 1), 1.5, dtype=DT), LoopConfig(halting="residual", max_steps=50), ctx=(x, s))
    assert not res.converged.any()
    assert torch.isfinite(res.state).all()


def test_diverge_threshold_stops_sample():
    x = torch.ones(2, 1, dtype=DT)
    s = torch.zeros(2, dtype=DT)
    cfg = LoopConfig(halting="fixed", max_steps=10, diverge_threshold=0.4)
    res = run_loop(cubic, torch.tensor([[1.5], [-30.0]], dtype=DT), cfg, ctx=(x, s))
    assert int(res.steps[0]) == 10 and int(res.steps[1]) < 10
    assert not res.converged[1]


@pytest.mark.parametrize("compaction", [True, False])
def test_without_the_divergence_stop_every_sample_runs_its_steps(compaction):
    """stop_diverged=False: the FPRM / TRM references' training segments, n steps with no divergence test; the
    blowing-up sample iterates to the cap (its state non-finite, as the reference's), the others are as before."""
    s = torch.tensor([0.0, 1.0], dtype=DT)
    x = torch.ones(2, 1, dtype=DT)
    z0 = torch.full((2, 1), 1.5, dtype=DT)
    written = z0.clone()
    for _ in range(12):
        written = cubic(written, x, s)
    cfg = LoopConfig(
        halting="fixed", max_steps=12, diverge_threshold=1.0, stop_diverged=False, compaction=compaction
    )
    res = run_loop(cubic, z0, cfg, ctx=(x, s))
    assert res.steps.tolist() == [12, 12] and not torch.isfinite(res.state[1]).all()
    torch.testing.assert_close(res.state, written, rtol=0, atol=0, equal_nan=True)
    default = LoopConfig(halting="fixed", max_steps=12, diverge_threshold=1.0)
    stopped = run_loop(cubic, z0, default, ctx=(x, s))
    assert int(stopped.steps[1]) < 12 and torch.isfinite(stopped.state).all()  # the default stops it
    with pytest.raises(ValueError, match="stop_diverged"):
        LoopConfig(stop_diverged="no")


# ---- configuration errors ---------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(solver="newton"), "solver"),
        (dict(halting="sometimes"), "halting"),
        (dict(grad="magic"), "grad"),
        (dict(tol=0.0), "tol"),
        (dict(tol=-1.0), "tol"),
        (dict(max_steps=0), "max_steps"),
        (dict(grad_steps=-1), "grad_steps"),
        (dict(min_steps=5, max_steps=3), "min_steps"),
        (dict(residual_norm="l1"), "residual_norm"),
        (dict(plugins={"damped": {"gamma": 1.5}}), "damped.gamma"),
        (dict(grad="truncated", grad_steps=0), "grad_steps"),
        (dict(halting="act", solver="anderson"), "act"),
        (dict(halting="act", grad="ift"), "act"),
        (dict(plugins={"ift": {"solver": "broyden"}}), "ift.solver"),
        (dict(plugins={"kl_entropy": {"reduce": "median"}}), "kl_entropy.reduce"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LoopConfig(**kwargs)


def test_unknown_solver_message_lists_choices():
    with pytest.raises(ValueError, match="'picard', 'damped', 'anderson', 'broyden'"):
        LoopConfig(solver="newton")


def test_run_loop_input_errors():
    z0 = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="readout"):
        run_loop(lambda z: z, z0, LoopConfig(halting="kl_entropy"))
    with pytest.raises(ValueError, match="halt_fn"):
        run_loop(lambda z: z, z0, LoopConfig(halting="act"))
    with pytest.raises(ValueError, match="batch-first"):
        run_loop(lambda z, c: z, z0, LoopConfig(), ctx=(torch.zeros(3, 3),))
    with pytest.raises(ValueError, match="shaped like z"):
        run_loop(lambda z: z[:, :2], z0, LoopConfig())
    with pytest.raises(ValueError, match="LoopConfig"):
        run_loop(lambda z: z, z0, {"solver": "picard"})
    with pytest.raises(ValueError, match=r"\[B\] or \[B, T\]"):
        run_loop(lambda z: z, z0, LoopConfig(halting="act"), halt_fn=lambda z: torch.full((2, 5), 0.5))


@pytest.mark.parametrize("solver", ["picard", "anderson"])
def test_trace_off_fast_path_same_state(solver):
    """trace=False with fixed halting is a plain loop (no residuals, no syncs) with the same result."""
    torch.manual_seed(2)
    w = torch.randn(4, 4, dtype=DT) / 4
    x = torch.randn(3, 2, 4, dtype=DT, requires_grad=True)
    outs = []
    for trace in (True, False):
        res = run_loop(lambda z, x: nonlinear(z, x, w), torch.zeros(3, 2, 4, dtype=DT),
                       LoopConfig(solver=solver, max_steps=9, trace=trace), ctx=(x,))
        outs.append((res, torch.autograd.grad(res.state.sum(), [x])[0]))
    (a, ga), (b, gb) = outs
    torch.testing.assert_close(a.state, b.state, rtol=0, atol=0)
    torch.testing.assert_close(ga, gb, rtol=0, atol=0)
    assert b.steps.tolist() == [9, 9, 9] and b.residuals.shape == (0, 3) and a.residuals.shape == (9, 3)
