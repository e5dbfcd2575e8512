"""Recurrent-depth transformer (arXiv 2604.07822; TRM arXiv 2510.04871, HRM arXiv 2506.21734): injections, initial states, Parcae's contraction,
no positional encoding, the logit lens and causality."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from loopformer.models.recurrent import RecurrentConfig, RecurrentDepth, paper_config

D, T, B, V = 16, 8, 3, 9


def tiny(**kw: object) -> RecurrentDepth:
    cfg = RecurrentConfig(vocab_size=V, seq_len=T, d_model=D, n_heads=2, **kw)  # type: ignore[arg-type]
    return RecurrentDepth(cfg).double()


def core(model: RecurrentDepth, h: Tensor) -> Tensor:
    for block in model.core:
        h = block(h)
    return h


def rand(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_injection_forms() -> None:
    h, e = rand(B, T, D, seed=1), rand(B, T, D, seed=2)
    none = tiny(injection="none")
    torch.testing.assert_close(none.step(h, e), core(none, h))
    add = tiny(injection="add")
    torch.testing.assert_close(add.step(h, e), core(add, h + e))
    cat = tiny(injection="concat")
    torch.testing.assert_close(cat.step(h, e), core(cat, h + e))  # W = [I, I] at init
    with torch.no_grad():
        cat.injection_proj.weight.normal_()
    torch.testing.assert_close(cat.step(h, e), core(cat, torch.cat([h, e], -1) @ cat.injection_proj.weight.T))
    par = tiny(injection="parcae")
    # at init: A = 0, dt = 0 -> decay exp(-ln 2) = 0.5, input gain ln 2, B = I
    torch.testing.assert_close(par.step(h, e), core(par, 0.5 * h + math.log(2) * e))


def test_parcae_injection_is_contractive_for_any_parameters() -> None:
    par = tiny(injection="parcae")
    with torch.no_grad():
        par.injection_log_A.copy_(rand(D, seed=3) * 3)
        par.injection_dt.copy_(rand(D, seed=4) * 3)
        par.injection_B.weight.copy_(rand(D, D, seed=5))
    e = rand(B, T, D, seed=6)
    h1, h2 = rand(B, T, D, seed=7), rand(B, T, D, seed=8)
    dt = F.softplus(par.injection_dt)
    decay = torch.exp(-dt * torch.exp(par.injection_log_A)).detach()
    assert float(decay.max()) < 1 and float(decay.min()) > 0
    diff = par.inject(h1, e) - par.inject(h2, e)
    torch.testing.assert_close(diff, decay * (h1 - h2))
    torch.testing.assert_close(par.inject(torch.zeros_like(e), e), dt * (e @ par.injection_B.weight.T))
    assert par.no_weight_decay() == {"injection_log_A", "injection_dt"}


@pytest.mark.parametrize(
    ("injection", "init", "expected"),
    [("add", "auto", "embed"), ("none", "auto", "embed"), ("concat", "auto", "random"),
     ("parcae", "auto", "zeros"), ("add", "random", "random"), ("concat", "zeros", "zeros")],
)
def test_initial_state(injection: str, init: str, expected: str) -> None:
    model = tiny(injection=injection, init=init, init_std=2.0)
    e = rand(64, T, D, seed=9)
    z = model.init_state((e,), torch.Generator().manual_seed(0))
    if expected == "embed":
        assert z is e
    elif expected == "zeros":
        assert torch.equal(z, torch.zeros_like(e))
    else:
        assert torch.equal(z, model.init_state((e,), torch.Generator().manual_seed(0)))
        assert 1.9 < float(z.std()) < 2.1 and z.dtype == e.dtype


def test_prelude_coda_and_logit_lens_match_separate_shorter_runs() -> None:
    """Reading state t through coda + norm + head (the logit lens) equals a run stopped after t loops."""
    model = tiny(n_prelude=1, n_coda=1)
    inputs = torch.randint(0, V, (B, T))
    seen: dict[int, Tensor] = {}
    ctx = model.embed(inputs)

    def lens(t: int, z: Tensor, active: Tensor) -> None:
        seen[t] = model.readout(z, *(c.index_select(0, active) for c in ctx))

    with torch.no_grad():
        model(inputs, loop=dataclasses.replace(model.config.loop, max_steps=5), callback=lens)
        for t in (1, 3, 5):
            out = model(inputs, loop=dataclasses.replace(model.config.loop, max_steps=t))
            torch.testing.assert_close(seen[t], out.logits)
        e = model.embedding(inputs)
        e = model.prelude[0](e)
        h = e
        for _ in range(3):
            h = core(model, h + e)
        ref = model.output.head(model.output.norm(model.coda[0](h)))
        torch.testing.assert_close(seen[3], ref)
    assert not torch.allclose(seen[1], seen[5])


def test_no_positional_encoding_means_permutation_equivariance() -> None:
    model = tiny(rope=False, injection="add")
    inputs = torch.randint(0, V, (B, T))
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(inputs).logits
        out_p = model(inputs[:, perm]).logits
    torch.testing.assert_close(out_p, out[:, perm])
    with torch.no_grad():  # with RoPE the same permutation changes the answer
        roped = tiny(rope=True)
        assert not torch.allclose(roped(inputs[:, perm]).logits, roped(inputs).logits[:, perm])


def test_causal_model_does_not_see_the_future() -> None:
    model = tiny(causal=True, rope=False, tie_embeddings=True, n_prelude=1, n_coda=1)
    inputs = torch.randint(0, V, (B, T))
    changed = inputs.clone()
    changed[:, 5:] = (changed[:, 5:] + 1) % V
    with torch.no_grad():
        a, b = model(inputs).logits, model(changed).logits
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])
    assert model.output.head.weight is model.embedding.tokens.weight


def test_output_projections_are_scaled_near_zero_at_init() -> None:
    torch.manual_seed(0)
    small = tiny(out_init_scale=0.1)
    torch.manual_seed(0)
    full = tiny(out_init_scale=1.0)
    for bs, bf in zip(small.core, full.core):
        torch.testing.assert_close(bs.mlp.down.weight, 0.1 * bf.mlp.down.weight)
        torch.testing.assert_close(bs.mix.proj.weight, 0.1 * bf.mix.proj.weight)
        torch.testing.assert_close(bs.mix.qkv.weight, bf.mix.qkv.weight)


def test_bad_config_raises() -> None:
    with pytest.raises(ValueError, match="injection"):
        tiny(injection="gru")
    with pytest.raises(ValueError, match="init"):
        tiny(init="ones")


def test_paper_config_is_ltg() -> None:
    cfg = paper_config()
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.tie_embeddings, cfg.rope) == (4, 768, 12, True, False)
    n = RecurrentDepth(cfg).num_parameters()
    # 4 GPT-2-sized layers (7.08M each with SwiGLU x4) + embeddings: about 28.5M
    assert 27e6 < n < 30e6, n
    loop = RecurrentConfig().loop
    assert (loop.solver, loop.halting, loop.max_steps, loop.grad) == ("picard", "fixed", 4, "bptt")


@pytest.mark.parametrize("norm", ["post", "sandwich"])
def test_huginn_style_norm_placements_run(norm: str) -> None:
    model = tiny(norm=norm, injection="concat", n_prelude=1, n_coda=1)
    assert all(hasattr(b, "out_norm1") == (norm == "sandwich") for b in model.core)
    out = model(torch.randint(0, V, (B, T)), generator=torch.Generator().manual_seed(0))
    assert out.logits.shape == (B, T, V) and torch.isfinite(out.logits).all()
    assert torch.equal(out.loop.steps, torch.full((B,), 4))
