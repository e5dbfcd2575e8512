"""Evaluation metrics against hand computations, Spearman against an independent rank oracle,
the Jacobian spectral radius against matrices with known spectra (float64), and the logit lens
against direct readouts of states unrolled by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from loopformer.eval.analysis import (
    logit_lens,
    logit_margin,
    signal_propagation,
    spectral_radius,
    spectral_radius_at_fixed_point,
    token_rank,
    trace_loops,
)
from loopformer.eval.budget import budget_curve, easy_hard_steps, steps_vs_difficulty, with_budget
from loopformer.eval.evaluate import evaluate
from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel, ModelConfig
from loopformer.tasks.base import IGNORE_INDEX, Task, TokenDataset

V = 5  # vocabulary of the toy task


class ShiftTask(Task):
    """Answer: every token + 1 (mod V). The validator recomputes it from the inputs, ignoring labels."""

    name = "shift"
    vocab_size = V
    seq_len = 4

    def generate(self, n: int, seed: int, **difficulty: object) -> TokenDataset:
        rng = np.random.default_rng(seed)
        x = rng.integers(0, V, size=(n, self.seq_len))
        return TokenDataset(x, (x + 1) % V, x.sum(1).astype(float))

    def check(self, inputs: np.ndarray, prediction: np.ndarray) -> bool:
        return bool(np.all(np.asarray(prediction) == (np.asarray(inputs) + 1) % V))


class TableModel(LoopedModel):
    """The prediction is a fixed lookup table of the input token; the state counts loops."""

    def __init__(self, table: list[int]) -> None:
        super().__init__(ModelConfig(vocab_size=V, loop=LoopConfig(halting="fixed", max_steps=3)))
        self.register_buffer("table", torch.tensor(table))
        self.dummy = nn.Parameter(torch.zeros(()))

    def embed(self, inputs: Tensor, puzzle_ids: Tensor | None = None) -> tuple[Tensor, ...]:
        return (inputs,)

    def init_state(self, ctx: tuple[Tensor, ...], generator: torch.Generator | None = None) -> Tensor:
        return torch.zeros(ctx[0].shape[0], 1)

    def step(self, z: Tensor, *ctx: Tensor) -> Tensor:
        return z + 1

    def readout(self, z: Tensor, *ctx: Tensor) -> Tensor:
        return nn.functional.one_hot(self.table[ctx[0]], V).float()


class TinyLooped(LoopedModel):
    """A small nonlinear looped model: z <- tanh(z W + x U) with a linear head (float64)."""

    def __init__(self, d: int = 8, steps: int = 6, halting: str = "fixed") -> None:
        super().__init__(ModelConfig(vocab_size=V, d_model=d, loop=LoopConfig(halting=halting, max_steps=steps, tol=1e-4)))
        g = torch.Generator().manual_seed(3)
        self.emb = nn.Parameter(torch.randn(V, d, generator=g, dtype=torch.float64))
        self.w = nn.Parameter(0.6 * torch.randn(d, d, generator=g, dtype=torch.float64) / d**0.5)
        self.head = nn.Parameter(torch.randn(d, V, generator=g, dtype=torch.float64))

    def embed(self, inputs: Tensor, puzzle_ids: Tensor | None = None) -> tuple[Tensor, ...]:
        return (self.emb[inputs],)

    def init_state(self, ctx: tuple[Tensor, ...], generator: torch.Generator | None = None) -> Tensor:
        return torch.randn(ctx[0].shape, generator=generator, dtype=torch.float64, device=ctx[0].device)

    def step(self, z: Tensor, *ctx: Tensor) -> Tensor:
        return torch.tanh(z @ self.w + ctx[0])

    def readout(self, z: Tensor, *ctx: Tensor) -> Tensor:
        return z @ self.head


def _toy_dataset() -> TokenDataset:
    x = np.array([[0, 1, 2, 3], [4, 4, 0, 1], [2, 2, 2, 2], [3, 0, 1, 2], [1, 3, 4, 0]])
    y = (x + 1) % V
    y[1, 0] = IGNORE_INDEX  # no loss at this position
    y[3, 2] = 0  # a wrong label: exact counts it wrong, the validator does not care
    return TokenDataset(x, y, np.array([1.0, 2.0, 2.0, 3.0, 5.0]))


def test_evaluate_matches_hand_computation() -> None:
    table = [1, 2, 3, 4, 4]  # right for tokens 0..3; token 4 should map to 0
    model, task, ds = TableModel(table), ShiftTask(), _toy_dataset()
    res = evaluate(model, task, ds, batch_size=2)
    pred = np.asarray(table)[ds.inputs]
    mask = ds.labels != IGNORE_INDEX
    right = ((pred == ds.labels) & mask).sum(1)
    exact = right == mask.sum(1)
    valid = [task.check(ds.inputs[i], pred[i]) for i in range(len(ds))]
    # by hand: rows 0 and 2 are fully right; row 3 predicts the truth but has a wrong label; rows 1, 4 hold a 4
    assert list(exact) == [True, False, True, False, False]
    assert valid == [True, False, True, True, False]
    assert res.exact_accuracy == pytest.approx(2 / 5)
    assert res.valid_accuracy == pytest.approx(3 / 5)
    assert res.token_accuracy == pytest.approx(right.sum() / mask.sum())
    assert res.token_accuracy == pytest.approx(16 / 19)
    assert res.mean_steps == 3 and res.steps_histogram == {3: 5}
    assert [r.valid for r in res.records] == valid
    assert [r.difficulty for r in res.records] == list(ds.difficulty)
    json.dumps(res.to_dict(records=True))  # JSON-serialisable
    half = evaluate(model, task, ds, batch_size=2, max_batches=1)
    assert half.n == 2 and half.exact_accuracy == 0.5


def test_budget_curve_fixed_and_capped() -> None:
    model, task = TinyLooped(steps=10, halting="residual"), ShiftTask()
    ds = task.generate(12, seed=0)
    curve = budget_curve(model, task, ds, [1, 3, 2], mode="fixed")
    assert [p.budget for p in curve.points] == [1, 2, 3]
    assert [p.mean_steps for p in curve.points] == [1.0, 2.0, 3.0]
    for p in curve.points:
        direct = evaluate(model, task, ds, loop=LoopConfig(halting="fixed", max_steps=p.budget, tol=1e-4))
        assert p.token_accuracy == pytest.approx(direct.token_accuracy)
    capped = budget_curve(model, task, ds, [2, 50], mode="capped")
    assert capped.points[0].mean_steps <= 2
    free = evaluate(model, task, ds, loop=with_budget(model.config.loop, 50, "capped"))
    assert capped.points[1].mean_steps == pytest.approx(free.mean_steps)
    out = model(torch.as_tensor(ds.inputs), loop=with_budget(model.config.loop, 50, "capped"),
                generator=torch.Generator().manual_seed(0))
    assert free.steps.tolist() == out.loop.steps.tolist()
    assert with_budget(LoopConfig(min_steps=4, max_steps=8), 2, "capped").min_steps == 2
    with pytest.raises(ValueError, match="budget"):
        with_budget(LoopConfig(), 0)


def _spearman_by_ranks(a: np.ndarray, b: np.ndarray) -> float:
    def ranks(x: np.ndarray) -> np.ndarray:  # average ranks for ties
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for v in np.unique(x):
            r[x == v] = r[x == v].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / np.sqrt((ra**2).sum() * (rb**2).sum()))


def test_steps_vs_difficulty_spearman_and_buckets() -> None:
    rng = np.random.default_rng(0)
    d = rng.integers(1, 6, size=60).astype(float)
    s = d * 2 + rng.integers(0, 4, size=60)
    valid = rng.random(60) < 0.5
    stats = steps_vs_difficulty(d, s, valid)
    assert stats.spearman_rho == pytest.approx(_spearman_by_ranks(d, s), abs=1e-12)
    assert 0 <= stats.spearman_p < 1e-6
    assert [b.low for b in stats.buckets] == [1, 2, 3, 4, 5]
    for b in stats.buckets:
        m = d == b.low
        assert b.count == m.sum() and b.mean_steps == pytest.approx(s[m].mean())
        assert b.valid_accuracy == pytest.approx(valid[m].mean())
    many = steps_vs_difficulty(rng.random(100), rng.random(100), max_buckets=4)
    assert len(many.buckets) == 4 and sum(b.count for b in many.buckets) == 100
    flat = steps_vs_difficulty(d, np.ones(60))
    assert np.isnan(flat.spearman_rho)
    eh = easy_hard_steps(np.array([1, 1, 2, 3]), np.array([2, 4, 6, 8]))
    assert eh["easy_mean_steps"] == 3 and eh["hard_mean_steps"] == 7


def _matrix_with_spectrum(eigs: list[float], seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(len(eigs), len(eigs), generator=g, dtype=torch.float64) + 3 * torch.eye(len(eigs), dtype=torch.float64)
    return p @ torch.diag(torch.tensor(eigs, dtype=torch.float64)) @ torch.linalg.inv(p)


@pytest.mark.parametrize("method", ["jvp", "vjp"])
def test_spectral_radius_linear_oracle(method: str) -> None:
    a = _matrix_with_spectrum([0.9, -0.5, 0.3, 0.1, -0.05, 0.02], seed=1)  # non-normal, rho = 0.9
    scale = torch.tensor([1.0, 0.5, 1.5], dtype=torch.float64)
    x = torch.randn(3, 6, dtype=torch.float64)

    def f(z: Tensor) -> Tensor:
        return scale[:, None] * (z @ a.T) + x

    z = torch.randn(3, 6, dtype=torch.float64)
    rho = spectral_radius(f, z, iters=400, tol=1e-10, method=method, generator=torch.Generator().manual_seed(0))
    truth = scale * torch.linalg.eigvals(a).abs().max()
    torch.testing.assert_close(rho, truth, rtol=1e-6, atol=0)


def test_spectral_radius_complex_pair() -> None:
    # normal matrix: a rotation by 1 rad scaled by 0.8 in one plane, 0.4 elsewhere -> rho = 0.8
    g = torch.Generator().manual_seed(2)
    q, _ = torch.linalg.qr(torch.randn(5, 5, generator=g, dtype=torch.float64))
    block = torch.zeros(5, 5, dtype=torch.float64)
    c, s = np.cos(1.0), np.sin(1.0)
    block[:2, :2] = 0.8 * torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    block[2:, 2:] = 0.4 * torch.eye(3, dtype=torch.float64)
    a = q @ block @ q.T
    assert torch.linalg.eigvals(a).abs().max().item() == pytest.approx(0.8)
    rho = spectral_radius(lambda z: z @ a.T, torch.zeros(2, 5, dtype=torch.float64), iters=300, tol=1e-12)
    torch.testing.assert_close(rho, torch.full((2,), 0.8, dtype=torch.float64), rtol=1e-6, atol=0)


def test_spectral_radius_at_fixed_point_matches_jacobian() -> None:
    model = TinyLooped(steps=60, halting="residual")
    x = torch.tensor([[0, 1, 2, 3], [4, 3, 2, 1]])
    rho = spectral_radius_at_fixed_point(model, x, iters=300, tol=1e-10)
    # oracle: the full Jacobian at the final state of each sample, by autograd, float64
    out = model(x, generator=torch.Generator().manual_seed(0))
    ctx = model.embed(x)
    for i in range(2):
        zi = out.state[i : i + 1].detach()
        jac = torch.autograd.functional.jacobian(lambda z, i=i: model.step(z, ctx[0][i : i + 1]), zi)
        n = zi.numel()
        truth = torch.linalg.eigvals(jac.reshape(n, n)).abs().max()
        assert rho[i].item() == pytest.approx(truth.item(), rel=1e-4)


def test_logit_lens_equals_unrolled_readouts() -> None:
    model, task = TinyLooped(steps=4), ShiftTask()
    ds = task.generate(6, seed=1)
    x = torch.as_tensor(ds.inputs)
    seen: list[tuple[int, Tensor]] = []
    trace_loops(model, x, LoopConfig(halting="fixed", max_steps=5),
                lambda t, z, logits: seen.append((t, logits.clone())), generator=torch.Generator().manual_seed(0))
    ctx = model.embed(x)
    z = model.init_state(ctx, torch.Generator().manual_seed(0))
    manual = []
    for _ in range(5):
        z = model.step(z, *ctx)
        manual.append(model.readout(z, *ctx))
    assert [t for t, _ in seen] == [1, 2, 3, 4, 5]
    for (_, got), want in zip(seen, manual):
        torch.testing.assert_close(got, want.detach())
    curve = logit_lens(model, task, ds, loops=5, batch_size=4)
    labels = torch.as_tensor(ds.labels)
    for k, logits in enumerate(manual):
        pred = logits.argmax(-1)
        assert curve.token_accuracy[k] == pytest.approx((pred == labels).double().mean().item())
        assert curve.margin[k] == pytest.approx(logit_margin(logits.detach(), labels).mean().item())


def test_logit_lens_bridge_rank_and_margin_helpers() -> None:
    logits = torch.tensor([[[0.0, 3.0, 1.0, 2.0, -1.0]], [[5.0, 1.0, 4.0, 2.0, 3.0]]])
    labels = torch.tensor([[3], [0]])
    torch.testing.assert_close(logit_margin(logits, labels), torch.tensor([[-1.0], [1.0]]))
    ranks = token_rank(logits, torch.tensor([2, 2]), torch.tensor([0, 0]))
    assert ranks.tolist() == [2.0, 1.0]
    model, task = TinyLooped(steps=3), ShiftTask()
    ds = task.generate(4, seed=2)
    bridge = np.array([1, -1, 2, 0])
    curve = logit_lens(model, task, ds, loops=3, bridge_tokens=bridge, bridge_positions=1)
    ctx = model.embed(torch.as_tensor(ds.inputs))
    z = model.init_state(ctx, torch.Generator().manual_seed(0))
    for k in range(3):
        z = model.step(z, *ctx)
        logits = model.readout(z, *ctx).detach()
        rows = logits[[0, 2, 3]]
        r = token_rank(rows, torch.tensor([1, 2, 0]), torch.tensor([1, 1, 1]))
        assert curve.bridge_rank[k] == pytest.approx(r.mean().item())


def test_signal_propagation_norms() -> None:
    model = TinyLooped(steps=4)
    ds = ShiftTask().generate(5, seed=3)
    sig = signal_propagation(model, ds, loops=4)
    ctx = model.embed(torch.as_tensor(ds.inputs))
    z = model.init_state(ctx, torch.Generator().manual_seed(0))
    assert sig.state_rms0 == pytest.approx(z.pow(2).mean(dim=(1, 2)).sqrt().mean().item())
    for k in range(4):
        z_next = model.step(z, *ctx).detach()
        d = (z_next - z).flatten(1)
        assert sig.state_rms[k] == pytest.approx(z_next.pow(2).mean(dim=(1, 2)).sqrt().mean().item())
        assert sig.update_norm[k] == pytest.approx(d.norm(dim=1).mean().item())
        assert sig.relative_update[k] == pytest.approx((d.norm(dim=1) / z.flatten(1).norm(dim=1)).mean().item())
        z = z_next


@pytest.mark.parametrize("compaction", [True, False])
def test_trace_with_adaptive_halting_ends_at_each_samples_final_readout(compaction: bool) -> None:
    model, task = TinyLooped(steps=40, halting="residual"), ShiftTask()
    ds = task.generate(8, seed=4)
    x = torch.as_tensor(ds.inputs)
    loop = LoopConfig(halting="residual", max_steps=40, tol=1e-3, compaction=compaction)
    last: dict[str, Tensor] = {}
    _, final = trace_loops(model, x, loop, lambda t, z, logits: last.update(logits=logits.clone(), t=t),
                           generator=torch.Generator().manual_seed(0))
    out = model(x, loop=loop, generator=torch.Generator().manual_seed(0))
    assert len(set(out.loop.steps.tolist())) > 1  # samples really halted at different loops
    assert last["t"] == int(out.loop.steps.max())
    torch.testing.assert_close(last["logits"], out.logits.detach())
    torch.testing.assert_close(final, out.logits.detach())
