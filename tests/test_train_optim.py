"""Optimiser groups, learning-rate schedule, clipping and EMA against closed forms."""

from __future__ import annotations

import math

import pytest
import torch
from test_train_utils import TinyLooped

from loopformer.models.registry import build_model
from loopformer.train.optim import EMA, build_optimizer, clip_grad_norm, lr_at, parameter_groups


def _names(groups: list[dict], wd: float) -> set[str]:
    return {n for g in groups if g["weight_decay"] == wd for n in g["names"]}


def test_no_decay_on_vectors_norms_listed_gates_and_optionally_embeddings() -> None:
    model = TinyLooped()
    groups = parameter_groups(model, 0.1)
    decayed, plain = _names(groups, 0.1), _names(groups, 0.0)
    assert decayed == {"emb.weight", "w.weight", "u.weight", "out.weight", "q.weight"}
    assert plain == {"w.bias", "norm.weight", "norm.bias", "gate", "out.bias", "q.bias"}
    assert "emb.weight" in _names(parameter_groups(model, 0.1, decay_embeddings=False), 0.0)


def test_models_without_no_weight_decay_and_real_fprm_scalars() -> None:
    plain = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    groups = parameter_groups(plain, 0.5)
    assert _names(groups, 0.5) == {"0.weight"} and _names(groups, 0.0) == {"0.bias", "1.weight", "1.bias"}
    fprm = build_model("fprm", vocab_size=6, seq_len=4, d_model=16, n_heads=2)
    nodecay = _names(parameter_groups(fprm, 0.1), 0.0)
    assert set(fprm.no_weight_decay()) <= nodecay
    opt = build_optimizer(fprm, lr=1e-3, weight_decay=0.1)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(fprm.parameters()))


def test_warmup_then_constant_or_cosine() -> None:
    assert [lr_at(s, 1.0, 4, 20) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_at(4, 1.0, 4, 20, "cosine") == pytest.approx(1.0)
    assert lr_at(12, 1.0, 4, 20, "cosine") == pytest.approx(0.5)
    assert lr_at(20, 1.0, 4, 20, "cosine", min_lr_ratio=0.1) == pytest.approx(0.1)
    assert lr_at(8, 2.0, 0, 16, "cosine") == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    with pytest.raises(ValueError, match="unknown schedule"):
        lr_at(10, 1.0, 0, 20, "linear")


def test_clipping_returns_the_pre_clip_global_norm() -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert clip_grad_norm([a, b], 1.0) == pytest.approx(5.0)
    assert torch.allclose(torch.cat([a.grad, b.grad]).norm(), torch.tensor(1.0))


def test_ema_matches_the_closed_form_and_applied_restores_weights() -> None:
    model = torch.nn.Linear(2, 2)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ema = EMA(model, 0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    for _ in range(5):
        ema.update(model)
    for name, p in model.named_parameters():
        # s_k = p + 0.9^k (s_0 - p), s_0 - p = -1
        assert torch.allclose(ema.shadow[name], p.detach() - 0.9**5, atol=1e-6)
        assert torch.allclose(ema.shadow[name], start[name] + 1 - 0.9**5, atol=1e-6)
    current = model.weight.detach().clone()
    with ema.applied(model):
        assert torch.equal(model.weight, ema.shadow["weight"])
    assert torch.equal(model.weight, current)
    other = EMA(model, 0.9)
    other.load_state_dict(ema.state_dict())
    assert torch.equal(other.shadow["bias"], ema.shadow["bias"])
    with pytest.raises(ValueError, match="decay must be in"):
        EMA(model, 1.0)


def test_ema_warmup_uses_min_of_decay_and_step_ratio() -> None:
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    ema = EMA(model, 0.999, warmup=True)
    assert ema.decay_at(0) == pytest.approx(0.1) and ema.decay_at(10**6) == 0.999
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema.update(model, step=0)  # s = 0.1 * 0 + 0.9 * 1
    assert float(ema.shadow["weight"]) == pytest.approx(0.9)
    ema.update(model, step=1)  # d = 2 / 11
    assert float(ema.shadow["weight"]) == pytest.approx(1 - 0.1 * 2 / 11)
