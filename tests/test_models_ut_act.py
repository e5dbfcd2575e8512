"""Universal Transformer + per-token ACT: Graves weights on the model's own states (hand-built halting
probabilities), ponder-cost range and aux loss, gradient into the halting unit, bounded post-norm
states, the step counter / timestep signal, every gradient mode, training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_helpers import random_batch, train_losses

from loopformer.loop import LoopConfig
from loopformer.models import build_model
from loopformer.models.ut_act import UniversalTransformer, UTConfig, paper_config, sinusoid_signal

V, T, D = 7, 5, 16


def tiny(**kw: object) -> UTConfig:
    base = dict(vocab_size=V, seq_len=T, d_model=D, n_heads=2, expansion=2.0)
    base.update(kw)
    return UTConfig(**base)


def batch(B: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return random_batch(V, T, B, seed)


# per-token halting probabilities by step (rows: tokens, columns: steps 1..5), eps = 0.01, max 5:
P_TABLE = torch.tensor(
    [
        [0.5, 0.5, 0.5, 0.5, 0.5],  # N = 2, R = 0.5
        [0.3, 0.3, 0.3, 0.3, 0.3],  # N = 4, R = 0.1
        [0.995, 0.1, 0.1, 0.1, 0.1],  # N = 1, R = 1
        [0.1, 0.1, 0.1, 0.1, 0.1],  # never reaches 0.99: N = 5 (last step halts), R = 0.6
        [0.2, 0.795, 0.5, 0.5, 0.5],  # cumulative 0.995 >= 0.99 at step 2: N = 2, R = 0.8
    ],
    dtype=torch.float64,
)


def graves_weights(p: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Hand-computed Graves weights [tokens, steps] and ponder costs N + R per token."""
    n_tok, n_steps = p.shape
    w = torch.zeros_like(p)
    cost = torch.zeros(n_tok, dtype=p.dtype)
    for i in range(n_tok):
        total = 0.0
        for t in range(n_steps):
            if total + p[i, t] >= 1 - eps or t == n_steps - 1:
                w[i, t] = 1 - total
                cost[i] = (t + 1) + (1 - total)
                break
            w[i, t] = p[i, t]
            total += float(p[i, t])
    return w, cost


def test_graves_weights_on_model_states(monkeypatch: pytest.MonkeyPatch) -> None:
    model = UniversalTransformer(tiny()).double()
    loop = LoopConfig(halting="act", max_steps=5, plugins={"act": {"eps": 0.01}})

    def halt_prob(z: torch.Tensor, *ctx: torch.Tensor) -> torch.Tensor:
        step = z[..., -1].long()  # the counter channel: steps taken so far (1 after the first)
        return P_TABLE[torch.arange(T)[None, :], step - 1]

    monkeypatch.setattr(model, "halt_prob", halt_prob)
    inputs, _ = batch()
    out = model(inputs, loop=loop)

    w, cost = graves_weights(P_TABLE, 0.01)
    assert torch.allclose(w.sum(1), torch.ones(T, dtype=torch.float64))
    # reference: iterate the model's own step; a token that halted keeps its state (it stays visible
    # to the attention of the others), and the output is sum_t w_t z_t
    (x,) = model.embed(inputs)
    z = model.init_state((x,))
    halted_after = (w > 0).long().cumsum(1).argmax(1)  # index of each token's last weighted step
    mix = torch.zeros_like(z)
    for t in range(5):
        frozen = (torch.tensor([t > halted_after[i] for i in range(T)]))[None, :, None]
        z = torch.where(frozen, z, model.step(z, x))
        mix = mix + w[:, t][None, :, None] * z
    torch.testing.assert_close(out.state, mix, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.loop.ponder_cost, cost.mean().expand(3), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.aux_loss, 0.01 * cost.mean(), rtol=1e-12, atol=1e-12)
    # the expected step count is what the mixed counter channel reads
    expected_steps = (w * torch.arange(1, 6, dtype=torch.float64)).sum(1)
    torch.testing.assert_close(out.state[0, :, -1], expected_steps, rtol=1e-12, atol=1e-12)


def test_ponder_cost_range_and_aux_loss() -> None:
    model = UniversalTransformer(tiny())
    inputs, _ = batch(B=6)
    for bias in (-3.0, 0.0, 1.0, 4.0):
        with torch.no_grad():
            model.halt_unit.bias.fill_(bias)
            model.halt_unit.weight.normal_(0, 0.5)
        out = model(inputs)
        cost = out.loop.ponder_cost
        max_steps = model.config.loop.max_steps
        assert cost.shape == (6,)
        assert (cost >= 1).all() and (cost <= max_steps + 1).all(), cost
        torch.testing.assert_close(out.aux_loss, model.config.ponder_weight * cost.mean())
        assert (out.loop.steps >= 1).all() and (out.loop.steps <= max_steps).all()
    # a halting unit that always says ~1 halts every token after one step: cost = 1 + 1
    with torch.no_grad():
        model.halt_unit.weight.zero_()
        model.halt_unit.bias.fill_(20.0)
    out = model(inputs)
    torch.testing.assert_close(out.loop.ponder_cost, torch.full((6,), 2.0))
    assert (out.loop.steps == 1).all()


def test_gradient_reaches_halting_unit() -> None:
    model = UniversalTransformer(tiny())
    inputs, labels = batch()
    out = model(inputs)
    assert out.loop.steps.max() > 1  # mixture over several steps, so the weights matter
    F.cross_entropy(out.logits.reshape(-1, V), labels.reshape(-1)).backward()
    assert model.halt_unit.weight.grad.abs().sum() > 0  # through the halting weights of the state mixture
    model.zero_grad()
    out = model(inputs)
    out.aux_loss.backward()  # through the remainder R of the ponder cost
    assert model.halt_unit.bias.grad.abs() > 0


def test_post_norm_states_bounded() -> None:
    model = UniversalTransformer(tiny())
    with torch.no_grad():
        model.tokens.weight.mul_(1000.0)  # huge inputs
        model.halt_unit.bias.fill_(-5.0)  # run to max_steps
    inputs, _ = batch()
    out = model(inputs)
    h = out.state[..., :-1]
    rms = h.pow(2).mean(-1).sqrt()
    assert (rms <= 1 + 1e-4).all(), rms.max()  # unit-gain RMSNorm output, mixed convexly
    assert torch.isfinite(out.logits).all()


def test_step_counter_and_timestep_signal() -> None:
    model = UniversalTransformer(tiny()).double()
    inputs, _ = batch()
    (x,) = model.embed(inputs)
    z0 = model.init_state((x,))
    assert z0.shape == (3, T, D + 1) and (z0[..., -1] == 0).all()
    out = model(inputs, loop=LoopConfig(halting="fixed", max_steps=4))
    assert (out.state[..., -1] == 4).all()
    # the step map sees the step number: same hidden state, different counter -> different output
    later = z0.clone()
    later[..., -1] = 3
    assert not torch.allclose(model.step(z0, x)[..., :-1], model.step(later, x)[..., :-1])
    # hand check of the timestep + position signal for the first step (rope off)
    sig = sinusoid_signal(torch.ones(3, T, dtype=torch.float64), D) + sinusoid_signal(
        torch.arange(T, dtype=torch.float64), D
    )
    h = x + sig
    for block in model.blocks:
        h = block(h)
    torch.testing.assert_close(model.step(z0, x)[..., :-1], h, rtol=0, atol=1e-12)
    # the counter carries no gradient
    z = z0.detach().clone().requires_grad_(True)
    model.step(z, x)[..., :-1].sum().backward()
    assert (z.grad[..., -1] == 0).all()


@pytest.mark.parametrize("grad", ["bptt", "truncated", "onestep", "neumann", "ift"])
def test_every_grad_mode_with_fixed_halting(grad: str) -> None:
    model = UniversalTransformer(tiny(rope=True))
    inputs, labels = batch()
    out = model(inputs, loop=LoopConfig(halting="fixed", max_steps=3, grad=grad, grad_steps=2))
    assert out.aux_loss is None  # no ponder cost without ACT
    F.cross_entropy(out.logits.reshape(-1, V), labels.reshape(-1)).backward()
    grads = [p.grad for p in model.blocks.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0


@pytest.mark.parametrize("causal", [False, True])
def test_training_reduces_loss(causal: bool) -> None:
    torch.manual_seed(0)
    model = build_model("ut_act", config=tiny(causal=causal, d_model=32, n_heads=4))
    inputs, labels = batch(B=4)
    losses = train_losses(model, inputs, labels, steps=10, aux_loss=True)
    assert losses[-1] < 0.8 * losses[0], losses


def test_causal_model_is_causal() -> None:
    model = UniversalTransformer(tiny(causal=True)).double()
    inputs, _ = batch()
    changed = inputs.clone()
    changed[:, -1] = (changed[:, -1] + 1) % V
    # fixed halting: per-token ACT would let a later token's halting change when a sample stops
    loop = LoopConfig(halting="fixed", max_steps=3)
    a, b = model(inputs, loop=loop).logits, model(changed, loop=loop).logits
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_paper_config_and_bad_config() -> None:
    n = UniversalTransformer(paper_config()).num_parameters()
    print(f"UT paper-width size: {n / 1e6:.2f}M")
    assert 2e6 < n < 5e6
    with pytest.raises(ValueError, match="puzzle"):
        UniversalTransformer(tiny(num_puzzle_ids=3, puzzle_emb_len=1))
