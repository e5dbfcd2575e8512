"""The Attractor language model's options (``loopformer.nn`` ReLU^2 MLP and qk-norm, the ``anderson_attractor``
solver, the optimiser's head group, config validation) against closed forms; the full model is checked
against the authors' code in tests/test_parity_attractor_lm.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loopformer.config import ConfigError, build_config
from loopformer.loop import LoopConfig, run_loop
from loopformer.models import build_model
from loopformer.nn import Attention, Block, ReLU2MLP
from loopformer.train.optim import build_optimizer, set_lr


def test_relu2_mlp_is_half_the_squared_relu() -> None:
    torch.manual_seed(0)
    mlp = ReLU2MLP(8, expansion=4.0).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    h = x @ mlp.up.weight.T
    expected = (0.5 * torch.clamp(h, min=0) ** 2) @ mlp.down.weight.T
    torch.testing.assert_close(mlp(x), expected, rtol=0, atol=1e-12)
    assert mlp.up.weight.shape == (32, 8) and mlp.up.bias is None
    with pytest.raises(ValueError, match="unknown MLP 'gelu'"):
        Block(8, 2, mlp="gelu")


def test_qk_norm_normalises_each_head_after_rope() -> None:
    torch.manual_seed(0)
    att = Attention(8, 2, causal=True, rope=True, qk_norm=True, rope_base=50000.0).double()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    qkv = att.qkv(x).view(2, 6, 3, 2, 4)
    q, k = att.rotary.rotate_qk(qkv)
    v = qkv[:, :, 2].transpose(1, 2)
    rms = lambda t: t / t.pow(2).mean(-1, keepdim=True).add(torch.finfo(t.dtype).eps).sqrt()  # noqa: E731
    y = F.scaled_dot_product_attention(rms(q), rms(k), v, is_causal=True)
    torch.testing.assert_close(att(x), att.proj(y.transpose(1, 2).reshape(2, 6, 8)), rtol=0, atol=1e-12)
    assert float(att.rotary.inv_freq[1]) == pytest.approx(50000.0 ** (-2 / 4))


@pytest.mark.parametrize("halting", ["residual", "batch_residual", "fixed"])
def test_anderson_attractor_returns_f_of_the_last_checked_iterate(halting: str) -> None:
    """The state returned for a stopping sample is f(z) of its last step, not the next mix (per-sample stops)."""
    torch.manual_seed(0)
    a = (
        torch.randn(4, 6, 6, dtype=torch.float64)
        * torch.tensor([0.1, 0.3, 0.5, 0.7]).view(4, 1, 1).double()
        / 3
    )
    b = torch.randn(4, 6, dtype=torch.float64)

    cfg = LoopConfig(solver="anderson_attractor", halting=halting, tol=1e-6, min_steps=3, max_steps=30,
                     plugins={"anderson": {"m": 3, "reg": 1e-4, "reg_relative": False}})  # fmt: skip
    inputs: list[torch.Tensor] = []
    idx_seen: list[torch.Tensor] = []

    def step(z: torch.Tensor, a_rows: torch.Tensor, b_rows: torch.Tensor) -> torch.Tensor:
        inputs.append(z.clone())
        return torch.einsum("bij,bj->bi", a_rows, z) + b_rows

    z0 = torch.zeros(4, 6, dtype=torch.float64)
    res = run_loop(step, z0, cfg, ctx=(a, b), callback=lambda t, z, i: idx_seen.append(i.clone()))
    steps = res.steps.tolist()
    for s in range(4):  # replay the sample's last checked iterate: inputs of its last step
        seen = [t for t, i in enumerate(idx_seen) if s in i.tolist()]
        last = inputs[seen[-1]][idx_seen[seen[-1]].tolist().index(s)]
        torch.testing.assert_close(res.state[s], a[s] @ last + b[s], rtol=0, atol=1e-12)
    if halting == "residual":
        assert len(set(steps)) > 1  # per sample: the contractive rows stop first
    elif halting == "batch_residual":
        assert len(set(steps)) == 1 and res.converged.all()
    else:
        assert steps == [30] * 4


def test_head_group_rate_and_weight_decay_survive_set_lr() -> None:
    model = build_model("attractor", vocab_size=8, seq_len=4, d_model=8, n_heads=2, n_backbone=1, n_layers=1)
    opt = build_optimizer(model, 1e-3, 0.2, decay_embeddings=False, head=(0.5, 0.1))
    set_lr(opt, 4e-3)
    by_name = {n: (g["lr"], g["weight_decay"]) for g in opt.param_groups for n in g["names"]}
    assert by_name["head_blocks.0.mix.qkv.weight"] == (2e-3, 0.1)
    assert by_name["head_blocks.0.norm1.weight"] == (2e-3, 0.0)
    assert by_name["gate_logit"] == (2e-3, 0.0)
    assert by_name["backbone.0.mix.qkv.weight"] == (4e-3, 0.2)
    assert by_name["embedding.tokens.weight"] == (4e-3, 0.0)
    fprm = build_model("fprm", vocab_size=8, seq_len=4, d_model=8, n_heads=2)
    with pytest.raises(ValueError, match="head_parameter_prefixes"):
        build_optimizer(fprm, 1e-3, 0.1, head=(0.5, None))


def test_new_keys_are_validated() -> None:
    base = ["model.name=attractor"]
    with pytest.raises(ConfigError, match="mlp='gelu'"):
        build_config({}, [*base, "model.mlp=gelu"])
    with pytest.raises(ConfigError, match="norm_eps"):
        build_config({}, [*base, "model.norm_eps=0"])
    with pytest.raises(ConfigError, match="init='xavier'"):
        build_config({}, [*base, "model.init=xavier"])
    with pytest.raises(ConfigError, match="qk_nrom"):
        build_config({}, [*base, "model.qk_nrom=true"])
    with pytest.raises(ConfigError, match="head_lr_scale"):
        build_config({}, [*base, "train.head_lr_scale=0"])
    with pytest.raises(ConfigError, match="head_weight_decay"):
        build_config({}, [*base, "train.head_weight_decay=-1"])
    cfg = build_config({}, [*base, "model.mlp=relu2", "model.qk_norm=true", "train.head_weight_decay=0.1"])
    assert cfg.model_config().mlp == "relu2" and cfg.train.head_weight_decay == 0.1


def test_trapezoid_schedule_is_the_references_get_lr() -> None:
    """recpre/schedulers/base.py LRScheduler.get_lr without warm-up: base until step > max - cool, then
    base * (max - step) / cool, floored at min_lr (here min_lr_ratio * lr)."""
    from loopformer.train.optim import lr_at

    total, lr = 100, 8e-3
    for step in (0, 49, 50, 51, 75, 99, 100):
        ref = lr if step <= total - 50 else max(lr * (total - step) / 50, 0.0)
        assert lr_at(step, lr, 0, total, "trapezoid", 0.0, 0.5) == pytest.approx(ref, abs=1e-15), step
    assert lr_at(99, lr, 0, total, "trapezoid", 0.1, 0.5) == pytest.approx(0.1 * lr)  # the floor
    assert lr_at(99, lr, 0, total, "trapezoid", 0.0, 0.0) == lr  # no cool-down: constant
    with pytest.raises(ConfigError, match="cooldown_fraction"):
        build_config({}, ["model.name=attractor", "train.cooldown_fraction=1.5"])
