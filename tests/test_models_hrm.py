"""HRM: the step map against the hand-written H/L schedule, the one-step gradient (only the last L
and the last H call recorded) against a float64 reference with explicit no-grad calls and by hooks,
the paper parameter count, the Q head, training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_helpers import random_batch, train_losses

from loopformer.loop import LoopConfig
from loopformer.models import build_model
from loopformer.models.hrm import HRM, HRMConfig, paper_config

V, T, D = 7, 6, 32


def tiny(**kw: object) -> HRMConfig:
    base = dict(vocab_size=V, seq_len=T, d_model=D, n_heads=4, n_layers=2, l_cycles=2, expansion=2.0)
    base.update(kw)
    return HRMConfig(**base)


def batch(B: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return random_batch(V, T, B, seed)


def run(module: torch.nn.Module, h: torch.Tensor, injection: torch.Tensor) -> torch.Tensor:
    h = h + injection
    for layer in module.layers:
        h = layer(h)
    return h


def test_step_equals_hand_written_schedule() -> None:
    model = HRM(tiny(l_cycles=3)).double()
    inputs, _ = batch()
    (x,) = model.embed(inputs)
    z0 = torch.randn(3, 2, T, D, dtype=torch.float64)
    with torch.no_grad():
        out = model.step(z0, x)
    zh, zl = z0[:, 0], z0[:, 1]
    for _ in range(3):
        zl = run(model.L, zl, zh + x)  # zL = L(zL + zH + x), l_cycles times
    zh = run(model.H, zh, zl)  # zH = H(zH + zL)
    torch.testing.assert_close(out[:, 0], zh, rtol=0, atol=1e-12)
    torch.testing.assert_close(out[:, 1], zl, rtol=0, atol=1e-12)
    # recording autograd does not change the values
    torch.testing.assert_close(model.step(z0, x), out, rtol=0, atol=0)


def test_only_last_l_and_last_h_call_are_recorded() -> None:
    model = HRM(tiny())
    calls: dict[str, list[bool]] = {"H": [], "L": []}
    for name in calls:
        getattr(model, name).register_forward_hook(
            lambda mod, args, out, name=name: calls[name].append(out.requires_grad)
        )
    inputs, _ = batch()
    model(inputs)  # default loop: 2 H cycles x 2 L cycles, truncated grad_steps 1
    assert calls["L"] == [False, False, False, True]
    assert calls["H"] == [False, True]
    # without the one-step gradient and with full bptt every call is recorded
    calls["H"].clear()
    calls["L"].clear()
    full = HRM(tiny(one_step_grad=False))
    full.load_state_dict(model.state_dict())
    for name in calls:
        getattr(full, name).register_forward_hook(
            lambda mod, args, out, name=name: calls[name].append(out.requires_grad)
        )
    full(inputs, loop=LoopConfig(halting="fixed", max_steps=2, grad="bptt"))
    assert calls["L"] == [True] * 4 and calls["H"] == [True] * 2


def _grads(model: HRM) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _loss(logits: torch.Tensor, q: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1)) + 0.3 * q.sum()


def test_one_step_gradient_equals_detached_reference() -> None:
    model = HRM(tiny()).double()
    with torch.no_grad():
        model.q_proj.weight.normal_(0, 0.1)
    inputs, labels = batch()
    out = model(inputs)
    _loss(out.logits, out.q_logits, labels).backward()
    got = _grads(model)

    # reference: HRM's schedule written out; every call but the last L and the last H without grad
    model.zero_grad()
    (x,) = model.embed(inputs)
    z0 = model.init_state((x,))
    zh, zl = z0[:, 0], z0[:, 1]
    with torch.no_grad():
        for h_step in range(2):
            for l_step in range(2):
                if not (h_step == 1 and l_step == 1):
                    zl = run(model.L, zl, zh + x)
            if h_step == 0:
                zh = run(model.H, zh, zl)
    zl = run(model.L, zl, zh + x)
    zh = run(model.H, zh, zl)
    z = torch.stack((zh, zl), dim=1)
    _loss(model.readout(z, x), model.q_head(z, x), labels).backward()
    ref = _grads(model)

    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12, msg=name)
    torch.testing.assert_close(out.state, z.detach(), rtol=1e-12, atol=1e-12)

    # recording the first L call as well changes the gradient (so the check can fail)
    model.zero_grad()
    model.config.one_step_grad = False
    out = model(inputs)
    _loss(out.logits, out.q_logits, labels).backward()
    model.config.one_step_grad = True
    assert not torch.allclose(_grads(model)["L.layers.0.mlp.down.weight"], ref["L.layers.0.mlp.down.weight"])


def test_q_head_is_halt_minus_continue() -> None:
    model = HRM(tiny())
    with torch.no_grad():
        model.q_proj.weight.normal_()
    inputs, _ = batch()
    out = model(inputs)
    q = model.q_values(out.state)
    assert q.shape == (3, 2)
    torch.testing.assert_close(out.q_logits, q[:, 0] - q[:, 1])
    fresh = HRM(tiny())(inputs)  # zero weights, bias -5: both logits -5 at init
    torch.testing.assert_close(fresh.q_logits, torch.zeros(3))
    assert HRM(tiny(q_head=False))(inputs).q_logits is None


def test_paper_parameter_count() -> None:
    n = HRM(paper_config()).num_parameters()
    print(f"HRM paper size: {n / 1e6:.2f}M")
    assert abs(n - 27e6) <= 0.15 * 27e6, n


def test_puzzle_embedding_tokens() -> None:
    model = HRM(tiny(num_puzzle_ids=4, puzzle_emb_len=1))
    inputs, labels = batch()
    out = model(inputs, puzzle_ids=torch.tensor([1, 2, 3]))
    assert out.logits.shape == (3, T, V) and out.state.shape == (3, 2, T + 1, D)
    F.cross_entropy(out.logits.reshape(-1, V), labels.reshape(-1)).backward()
    assert model.embedding.puzzle_emb.weight.grad[1:].abs().sum() > 0
    assert model.num_parameters() == sum(p.numel() for p in model.parameters()) - 4 * D


@pytest.mark.parametrize("causal", [False, True])
def test_training_reduces_loss(causal: bool) -> None:
    torch.manual_seed(0)
    model = build_model("hrm", config=tiny(causal=causal))
    inputs, labels = batch(B=4)
    losses = train_losses(model, inputs, labels, steps=8)
    assert losses[-1] < 0.8 * losses[0], losses


def test_bad_config_raises() -> None:
    with pytest.raises(ValueError, match="l_cycles"):
        HRM(tiny(l_cycles=0))
    with pytest.raises(ValueError, match="n_layers"):
        HRM(tiny(n_layers=0))
