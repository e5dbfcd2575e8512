"""Attractor (arXiv 2605.12466): the map f(y, c) = c + Delta(y + c), gates, injection forms, the
DEQ-style ablation and the equilibrium the engine finds."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from loopformer.models.attractor import Attractor, AttractorConfig, paper_config, puzzle_head_config

D, T, B, V = 16, 8, 3, 9


def tiny(**kw: object) -> Attractor:
    cfg = AttractorConfig(vocab_size=V, seq_len=T, d_model=D, n_heads=2, **kw)  # type: ignore[arg-type]
    return Attractor(cfg).double()


def head_reference(model: Attractor, u: Tensor) -> Tensor:
    """H(u) written out independently: pre-norm sub-layers with per-channel gates."""
    g = model.config.gamma_max * torch.sigmoid(model.gate_logit)
    for i, block in enumerate(model.head_blocks):
        u = u + g[i, 0] * block.mix(block.norm1(u))
        u = u + g[i, 1] * block.mlp(block.norm2(u))
    return u


def randomise_gates(model: Attractor, seed: int = 0) -> None:
    with torch.no_grad():
        model.gate_logit.copy_(
            torch.randn(model.gate_logit.shape, generator=torch.Generator().manual_seed(seed))
        )


def test_gates_start_at_layer_scale_init_and_stay_below_gamma_max() -> None:
    model = tiny(layer_scale_init=0.6, gamma_max=2.0, n_layers=3)
    torch.testing.assert_close(model.gammas(), torch.full((3, 2, D), 0.6, dtype=torch.float64))
    with torch.no_grad():
        model.gate_logit.fill_(50.0)
    assert float(model.gammas().detach().max()) <= 2.0
    assert model.no_weight_decay() == {"gate_logit"} and "gate_logit" in dict(model.named_parameters())


@pytest.mark.parametrize("n_layers", [1, 2])
def test_map_is_c_plus_delta_of_y_plus_c(n_layers: int) -> None:
    model = tiny(n_layers=n_layers)
    randomise_gates(model)
    gen = torch.Generator().manual_seed(1)
    y = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    c = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    u = y + c
    torch.testing.assert_close(model.delta(u), head_reference(model, u) - u, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(model.step(y, c), head_reference(model, y + c) - y, rtol=1e-10, atol=1e-12)


def test_concat_injection_starts_additive_and_can_learn_a_mix() -> None:
    add, cat = tiny(), tiny(injection="concat")
    cat.load_state_dict({**add.state_dict(), "injection_proj.weight": cat.injection_proj.weight}, strict=True)
    gen = torch.Generator().manual_seed(2)
    y, c = (torch.randn(B, T, D, generator=gen, dtype=torch.float64) for _ in range(2))
    torch.testing.assert_close(cat.step(y, c), add.step(y, c))
    with torch.no_grad():
        cat.injection_proj.weight.normal_()
    W = cat.injection_proj.weight
    torch.testing.assert_close(cat.step(y, c), c + cat.delta(torch.cat([y, c], -1) @ W.T))


def test_proposal_is_the_initial_iterate_and_the_injection() -> None:
    model = tiny(n_backbone=2)
    inputs = torch.randint(0, V, (B, T))
    (c,) = model.embed(inputs)
    e = model.embedding(inputs)
    for block in model.backbone:
        e = block(e)
    torch.testing.assert_close(c, e)
    assert model.init_state((c,)) is c


def test_deq_ablation_injects_the_embedding_and_starts_from_zero() -> None:
    model = tiny(proposal=False, n_backbone=2)
    assert len(model.backbone) == 0 and not any("backbone" in n for n, _ in model.named_parameters())
    inputs = torch.randint(0, V, (B, T))
    (c,) = model.embed(inputs)
    torch.testing.assert_close(c, model.embedding(inputs))
    assert torch.equal(model.init_state((c,)), torch.zeros_like(c))


def test_engine_finds_the_equilibrium_and_the_gap_measures_y0() -> None:
    model = tiny(layer_scale_init=0.3)
    inputs = torch.randint(0, V, (B, T))
    loop = dataclasses.replace(model.config.loop, tol=1e-9, max_steps=100, min_steps=1, grad="onestep")
    with torch.no_grad():
        out = model(inputs, loop=loop)
        (c,) = model.embed(inputs)
        y = out.state
        fy = model.step(y, c)
    assert out.loop.converged.all(), out.loop.residuals[-1]
    rel = (fy - y).flatten(1).norm(dim=1) / y.flatten(1).norm(dim=1)
    assert float(rel.max()) < 1e-7
    torch.testing.assert_close(out.logits, model.readout(y, c))
    # tied readout: RMSNorm then the token embedding matrix
    torch.testing.assert_close(out.logits, model.output.norm(y) @ model.embedding.tokens.weight.T)
    gap = model.internalization_gap(inputs)
    expected = (model.step(c, c) - c).flatten(1).norm(dim=1) / model.step(c, c).flatten(1).norm(dim=1)
    assert gap.shape == (B,)
    torch.testing.assert_close(gap, expected.detach())
    assert float(gap.min()) > 1e-3  # at init the proposal is not yet the equilibrium


def test_default_loop_is_the_papers() -> None:
    loop = AttractorConfig().loop
    assert (loop.solver, loop.options_for("anderson").m, loop.halting, loop.tol) == ("anderson", 5, "residual", 3e-4)
    assert (loop.residual_norm, loop.min_steps, loop.max_steps) == ("rel_l2", 4, 12)
    assert (loop.grad, loop.grad_steps) == ("neumann", 1)
    assert AttractorConfig().tie_embeddings


def test_bad_config_raises() -> None:
    with pytest.raises(ValueError, match="injection"):
        tiny(injection="mul")
    with pytest.raises(ValueError, match="layer_scale_init"):
        tiny(layer_scale_init=1.5)  # above gamma_max (1.0); equal is allowed (clamped, as the reference)


def test_paper_sizes() -> None:
    with torch.device("meta"):
        n = Attractor(puzzle_head_config()).num_parameters()
        lm = Attractor(paper_config()).num_parameters()  # the authors' 140M LM (attractor-small-140m.py)
    assert abs(n - 27e6) / 27e6 < 0.15, n
    assert lm == 134_237_184
