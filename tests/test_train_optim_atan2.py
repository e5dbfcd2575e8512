"""AdamATan2 and the sign-SGD puzzle-embedding optimiser (TRM / HRM) against their closed forms,
and TRM's truncated-normal initialiser against its analytic standard deviation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from loopformer.models.trm import TRM, TRMConfig, trunc_normal_init_
from loopformer.train.optim import AdamATan2, build_optimizer, set_lr


def closed_form_atan2(p0, grads, lr, wd, b1, b2):
    """The adam-atan2 update written out with numpy, step by step."""
    p, m, v = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)
    for t, g in enumerate(grads, start=1):
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr / (1 - b1**t) * np.arctan2(m, np.sqrt(v) / math.sqrt(1 - b2**t))
    return p


def test_adam_atan2_matches_closed_form_float64() -> None:
    rng = np.random.default_rng(0)
    p0 = rng.normal(size=(5, 3))
    grads = [rng.normal(scale=10.0 ** rng.integers(-4, 2), size=(5, 3)) for _ in range(6)]
    w = nn.Parameter(torch.tensor(p0))
    opt = AdamATan2([w], lr=3e-2, betas=(0.9, 0.95), weight_decay=0.5)
    for g in grads:
        w.grad = torch.tensor(g)
        opt.step()
    np.testing.assert_allclose(
        w.detach().numpy(), closed_form_atan2(p0, grads, 3e-2, 0.5, 0.9, 0.95), rtol=0, atol=1e-12
    )


def test_adam_atan2_update_is_bounded_and_scale_invariant() -> None:
    # |atan2| < pi/2, and the update does not change when the gradient is scaled
    outs = []
    for scale in (1e-6, 1.0, 1e6):
        w = nn.Parameter(torch.ones(4, dtype=torch.float64))
        opt = AdamATan2([w], lr=0.1, betas=(0.9, 0.95), weight_decay=0.0)
        w.grad = scale * torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=torch.float64)
        opt.step()
        outs.append(w.detach().clone())
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=0, atol=1e-12)
    assert (outs[0] - 1).abs().max() <= 0.1 / (1 - 0.9) * math.pi / 2
    assert outs[0][3] == 1.0  # zero gradient, no decay: unchanged


def test_sign_sgd_rows_only_decay_used_rows_and_follow_lr_scale() -> None:
    cfg = TRMConfig(
        vocab_size=5,
        seq_len=4,
        d_model=8,
        n_heads=2,
        n_layers=1,
        n_inner=1,
        num_puzzle_ids=4,
        puzzle_emb_len=1,
        puzzle_emb_dim=8,
    )
    model = TRM(cfg).double()
    with torch.no_grad():
        model.embedding.puzzle_emb.weight.normal_()
    before = model.embedding.puzzle_emb.weight.detach().clone()
    opt = build_optimizer(model, 1e-3, 0.1, kind="adam_atan2", decay_all=True, puzzle_emb=(1e-2, 0.5))
    groups = {bool(g["sign_sgd"]): g for g in opt.param_groups}
    assert groups[True]["names"] == ["embedding.puzzle_emb.weight"] and groups[True][
        "lr_scale"
    ] == pytest.approx(10)
    assert "q_proj.bias" in groups[False]["names"]  # decay_all: biases are decayed too (TRM / HRM)
    ids = torch.tensor([1, 1, 3])
    out = model(torch.randint(0, 5, (3, 4)), puzzle_ids=ids)
    out.logits.sum().backward()
    g = model.embedding.puzzle_emb.weight.grad.clone()
    set_lr(opt, 2e-3)  # the scheduled rate; the puzzle group runs at 10x
    opt.step()
    after = model.embedding.puzzle_emb.weight.detach()
    lr = 2e-2
    for row in range(4):
        if row in (1, 3):
            expect = before[row] * (1 - lr * 0.5) - lr * g[row].sign()
        else:
            expect = before[row]
        torch.testing.assert_close(after[row], expect, rtol=0, atol=1e-15)


def test_sign_sgd_needs_a_puzzle_table() -> None:
    model = TRM(TRMConfig(vocab_size=5, seq_len=4, d_model=8, n_heads=2, n_layers=1, n_inner=1))
    with pytest.raises(ValueError, match="no puzzle embedding"):
        build_optimizer(model, 1e-3, 0.1, puzzle_emb=(1e-2, 0.1))  # AdamW + sign-SGD (FPRM)
    with pytest.raises(ValueError, match="no puzzle embedding"):
        build_optimizer(model, 1e-3, 0.1, kind="adam_atan2", puzzle_emb=(1e-2, 0.1))


def test_flax_truncated_normal_has_the_requested_std() -> None:
    torch.manual_seed(0)
    x = trunc_normal_init_(torch.empty(400_000, dtype=torch.float64), std=0.5)
    assert abs(float(x.std()) - 0.5) < 0.003  # the std of the truncated law is the one asked for
    sigma = 0.5 / math.sqrt(0.7737413)  # Var of N(0,1) cut at +-2 is 0.77374
    assert float(x.abs().max()) <= 2 * sigma + 1e-12
    torch_std = float(nn.init.trunc_normal_(torch.empty(400_000), std=0.5, a=-1, b=1).std())
    assert torch_std < 0.45  # PyTorch's version falls short of the requested std
