"""FPRM (arXiv 2606.18206): tied residual coefficients, the closed-form iteration, contraction, heads, sizes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor, nn

from loopformer.loop import LoopConfig
from loopformer.models.fprm import FPRM, FPRMConfig, paper_config, state_tracking_config, tied_coefficients

D, T, B = 16, 9, 3


class Constant(nn.Module):
    """A sub-layer that ignores its input and returns a fixed tensor u (broadcast to the input)."""

    def __init__(self, u: Tensor) -> None:
        super().__init__()
        self.u = u

    def forward(self, h: Tensor) -> Tensor:
        return self.u.expand_as(h)


def tiny(**kw: object) -> FPRM:
    cfg = FPRMConfig(vocab_size=7, seq_len=T, d_model=D, n_heads=2, **kw)  # type: ignore[arg-type]
    return FPRM(cfg).double()


def randomise_scalars(model: FPRM, gen: torch.Generator) -> None:
    with torch.no_grad():
        model.residual_logit_a1.copy_(torch.randn(D, generator=gen, dtype=torch.float64) * 2)
        model.residual_logit_a2.copy_(torch.randn(D, generator=gen, dtype=torch.float64) * 2)


def make_sublayers_constant(model: FPRM, u: Tensor) -> None:
    for block in model.layers:
        block.mix = Constant(u)
        block.mlp = Constant(u)


@pytest.mark.parametrize("n_sub", [1, 2, 4, 6, 8])
def test_tied_coefficients_match_systems_formulas(n_sub: int) -> None:
    gen = torch.Generator().manual_seed(n_sub)
    a1 = torch.rand(1000, generator=gen, dtype=torch.float64) * 0.98 + 0.01
    a2 = torch.rand(1000, generator=gen, dtype=torch.float64) * 0.98 + 0.01
    b1, b2 = tied_coefficients(a1, a2, n_sub)
    torch.testing.assert_close(b2, 1 - a2 * a1**n_sub, rtol=1e-13, atol=0)
    torch.testing.assert_close(b1, b2 * (1 - a1) / (1 - a1**n_sub), rtol=1e-12, atol=0)
    # finite and correct at the a1 -> 1 edge, where the naive quotient is 0/0
    b1_edge, b2_edge = tied_coefficients(
        torch.ones(1, dtype=torch.float64), torch.tensor([0.3], dtype=torch.float64), n_sub
    )
    torch.testing.assert_close(b2_edge, torch.tensor([0.7], dtype=torch.float64))
    torch.testing.assert_close(b1_edge, torch.tensor([0.7 / n_sub], dtype=torch.float64))


def test_model_scalars_use_the_tied_formulas_and_paper_init() -> None:
    model = tiny(n_layers=3)
    h = torch.zeros(B, T, D, dtype=torch.float64)
    a1, a2, b1, b2 = model.residual_scalars(h, h)
    torch.testing.assert_close(a1, torch.full((D,), 0.75, dtype=torch.float64))
    torch.testing.assert_close(a2, torch.full((D,), 0.25, dtype=torch.float64))
    torch.testing.assert_close(b2, 1 - 0.25 * 0.75**6 * torch.ones(D, dtype=torch.float64))
    torch.testing.assert_close(b1, b2 * 0.25 / (1 - 0.75**6))


@pytest.mark.parametrize("n_layers", [1, 2, 3])
@pytest.mark.parametrize("scalars", ["learned", "input"])
def test_one_iteration_with_constant_sublayers_is_the_closed_form(n_layers: int, scalars: str) -> None:
    """h' = rho h + (1 - rho)(a1^(2L) x + u), rho = a2 a1^(2L) (arXiv 2606.18206), per channel / per sample."""
    gen = torch.Generator().manual_seed(n_layers)
    model = tiny(n_layers=n_layers, scalars=scalars)
    randomise_scalars(model, gen)
    if scalars == "input":  # make the scalars really depend on the sample
        with torch.no_grad():
            model.scalar_net.weight.copy_(torch.randn(2 * D, D, generator=gen, dtype=torch.float64))
    u = torch.randn(1, T, D, generator=gen, dtype=torch.float64)
    make_sublayers_constant(model, u)
    x = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    h = 6 * torch.randn(B, T, D, generator=gen, dtype=torch.float64)

    out = model.step(h, x)

    p1, p2 = model.residual_logit_a1, model.residual_logit_a2
    if scalars == "input":
        d1, d2 = (x.mean(1, keepdim=True) @ model.scalar_net.weight.T).chunk(2, -1)
        p1, p2 = p1 + d1, p2 + d2
    a1, a2 = torch.sigmoid(p1.detach()), torch.sigmoid(p2.detach())
    power = a1 ** (2 * n_layers)
    rho = a2 * power
    expected = rho * h + (1 - rho) * (power * x + u)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    if scalars == "input":  # the per-sample scalars differ between samples
        assert not torch.allclose(a1[0], a1[1])


def test_skip_path_is_a_contraction_with_factor_rho() -> None:
    gen = torch.Generator().manual_seed(3)
    model = tiny(n_layers=2)
    randomise_scalars(model, gen)
    u = torch.randn(1, T, D, generator=gen, dtype=torch.float64)
    make_sublayers_constant(model, u)
    x = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    h1 = 6 * torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    h2 = 6 * torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    a1, a2 = torch.sigmoid(model.residual_logit_a1.detach()), torch.sigmoid(model.residual_logit_a2.detach())
    rho = a2 * a1**4
    assert float(rho.max()) < 1
    diff = model.step(h1, x) - model.step(h2, x)
    torch.testing.assert_close(diff, rho * (h1 - h2), rtol=1e-10, atol=1e-12)
    # iterating converges to the fixed point a1^(2L) x + u from any start, at rate rho
    h = h1
    for _ in range(2000):
        h = model.step(h, x)
    torch.testing.assert_close(h, a1**4 * x + u, rtol=1e-8, atol=1e-8)


def test_real_body_stays_bounded_from_std6_start() -> None:
    """With real (random) sub-layers the iterates contract from the std-6 start and stay bounded."""
    model = tiny(n_layers=2)
    x = model.embed(torch.randint(0, 7, (B, T)))[0]
    h = model.init_state((x,), torch.Generator().manual_seed(0))
    start = h.pow(2).mean().sqrt()
    rms = []
    with torch.no_grad():
        for _ in range(300):
            h = model.step(h, x)
            rms.append(float(h.pow(2).mean().sqrt()))
    assert 4.5 < float(start) < 6.5  # truncated normal std 6 (cut at 2 std) has RMS ~5.3
    assert max(rms[50:]) < float(start) and max(rms[50:]) < 10


def test_init_state_is_truncated_normal_std6_and_reproducible() -> None:
    model = tiny()
    x = torch.zeros(64, T, D, dtype=torch.float64)
    z1 = model.init_state((x,), torch.Generator().manual_seed(1))
    z2 = model.init_state((x,), torch.Generator().manual_seed(1))
    assert torch.equal(z1, z2) and z1.shape == x.shape and z1.dtype == x.dtype
    assert float(z1.abs().max()) <= 12.0
    assert 5.0 < float(z1.std()) < 5.6  # std of N(0, 36) truncated at +-2 sigma = 6 * 0.880


@pytest.mark.parametrize("pool", ["mean", "first"])
def test_q_head_shape_and_init(pool: str) -> None:
    model = tiny(q_pool=pool)
    z = torch.randn(B, T, D, dtype=torch.float64)
    q = model.q_head(z, z)
    assert q.shape == (B,)
    torch.testing.assert_close(q, torch.full((B,), -5.0, dtype=torch.float64))  # zero weight, bias -5
    with torch.no_grad():
        model.q_linear.weight.normal_()
    h = model.output.norm(z)
    pooled = h.mean(1) if pool == "mean" else h[:, 0]
    torch.testing.assert_close(model.q_head(z, z), (pooled @ model.q_linear.weight.T).squeeze(-1) - 5)
    assert tiny(q_head=False).q_head(z, z) is None


def test_no_weight_decay_names_exist() -> None:
    model = tiny()
    names = dict(model.named_parameters())
    assert model.no_weight_decay() == {"residual_logit_a1", "residual_logit_a2"}
    for n in model.no_weight_decay():
        assert names[n].requires_grad and names[n].shape == (D,)
    fixed = tiny(scalars="fixed")
    assert fixed.no_weight_decay() == set()
    assert "residual_logit_a1" not in dict(fixed.named_parameters())
    assert "residual_logit_a1" in dict(fixed.named_buffers())


def test_causal_fprm_with_causal_conv_does_not_see_the_future() -> None:
    model = tiny(causal=True, rope=False, conv="causal1d")
    with torch.no_grad():
        model.conv.conv.weight.normal_()
    x = torch.randn(B, T, D, dtype=torch.float64)
    h = torch.randn(B, T, D, dtype=torch.float64)
    x2, h2 = x.clone(), h.clone()
    x2[:, 5:] += 1.0
    h2[:, 5:] -= 1.0
    out, out2 = model.step(h, x), model.step(h2, x2)
    torch.testing.assert_close(out[:, :5], out2[:, :5])
    assert not torch.allclose(out[:, 5:], out2[:, 5:])


def test_grid_conv_starts_as_identity_and_mixes_grid_neighbours() -> None:
    model = tiny(conv="grid2d", grid=(3, 3))
    h = torch.randn(B, T, D, dtype=torch.float64)
    torch.testing.assert_close(model.apply_conv(h), h)  # zero kernel: the identity
    with torch.no_grad():
        model.conv.conv.weight.zero_()
        model.conv.conv.weight[:, 0, 1, 2] = 1.0  # right neighbour tap
    out = model.apply_conv(h)
    grid = h.view(B, 3, 3, D)
    shifted = torch.zeros_like(grid)
    shifted[:, :, :2] = grid[:, :, 1:]
    torch.testing.assert_close(out, h + shifted.view(B, T, D))


def test_bad_config_raises_clear_errors() -> None:
    with pytest.raises(ValueError, match="grid"):
        tiny(conv="grid2d")
    with pytest.raises(ValueError, match="scalars"):
        tiny(scalars="magic")
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        tiny(a1_init=1.0)


def test_default_loop_is_the_papers() -> None:
    loop = FPRMConfig().loop
    damped = loop.options_for("damped")
    assert (loop.solver, damped.gamma, damped.patience) == ("damped", 0.9, 5)
    assert (loop.halting, loop.tol, loop.residual_norm, loop.max_steps) == ("residual", 0.1, "rel_sup", 16)
    assert (loop.grad, loop.grad_steps) == ("truncated", 6)
    st = state_tracking_config()
    assert st.causal and not st.rope and st.conv == "causal1d" and st.loop.grad_steps == 4
    assert FPRMConfig().loop is not FPRMConfig().loop  # no shared mutable default


def test_paper_size_parameter_count_is_about_7m() -> None:
    n = FPRM(paper_config()).num_parameters()
    assert abs(n - 7e6) / 7e6 < 0.15, n


def test_forward_runs_the_engine_and_halts_on_a_converged_map() -> None:
    """With constant sub-layers the map is an exact contraction: residual halting must fire early."""
    model = tiny(n_layers=1)
    make_sublayers_constant(model, torch.zeros(1, T, D, dtype=torch.float64))
    loop = dataclasses.replace(model.config.loop, max_steps=200, tol=1e-6, grad="bptt")
    out = model(torch.randint(0, 7, (B, T)), loop=loop, generator=torch.Generator().manual_seed(0))
    assert isinstance(loop, LoopConfig)
    assert out.loop.converged.all() and (out.loop.steps < 200).all()
    x = model.embed(torch.zeros(1, 1, dtype=torch.long))  # smoke: embed works on a single token
    assert x[0].shape == (1, 1, D)


@pytest.mark.parametrize("mixer", ["attention", "mlp"])
def test_puzzle_embedding_prefix_is_dropped_from_logits_and_counts(mixer: str) -> None:
    model = tiny(num_puzzle_ids=5, puzzle_emb_len=2, conv="grid2d", grid=(3, 3), mixer=mixer, q_pool="first")
    inputs = torch.randint(0, 7, (B, T))
    ids = torch.tensor([0, 3, 4])
    (x,) = model.embed(inputs, ids)
    assert x.shape == (B, T + 2, D)
    torch.testing.assert_close(x[:, :2], torch.zeros(B, 2, D, dtype=torch.float64))  # zero-initialised table
    with torch.no_grad():
        model.embedding.puzzle_emb.weight.normal_()
        model.conv.conv.weight.normal_()
    loop = dataclasses.replace(model.config.loop, max_steps=3, grad="bptt")
    out = model(inputs, loop=loop, puzzle_ids=ids)
    assert out.logits.shape == (B, T, 7) and out.state.shape == (B, T + 2, D) and out.q_logits.shape == (B,)
    out.logits.sum().backward()
    assert model.embedding.puzzle_emb.weight.grad[ids].abs().sum() > 0
    table = model.embedding.puzzle_emb.weight.numel()
    assert model.num_parameters() == sum(p.numel() for p in model.parameters()) - table
    h = torch.randn(B, T + 2, D, dtype=torch.float64)
    torch.testing.assert_close(model.apply_conv(h)[:, :2], h[:, :2])  # the prefix is not convolved
    with pytest.raises(ValueError, match="puzzle_ids"):
        model.embed(inputs)


# -- options reproducing the authors' code (nilskiKonjIzDunava/fprm; docs/fidelity.md, FPRM) ---------


def test_replace_conv_equals_residual_conv_with_the_identity_tap_moved_into_the_kernel() -> None:
    for conv, grid, centre in (("causal1d", None, (-1,)), ("grid2d", (3, 3), (1, 1))):
        res = tiny(conv=conv, grid=grid, num_puzzle_ids=2, puzzle_emb_len=1)
        rep = tiny(conv=conv, grid=grid, num_puzzle_ids=2, puzzle_emb_len=1, conv_form="replace")
        assert rep.conv.conv.weight.abs().sum() > 0  # PyTorch's default init, not zeros
        with torch.no_grad():
            res.conv.conv.weight.copy_(rep.conv.conv.weight)
            res.conv.conv.weight[(slice(None), 0, *centre)] -= 1.0
        h = torch.randn(B, T + 1, D, dtype=torch.float64)
        torch.testing.assert_close(res.apply_conv(h), rep.apply_conv(h))
        torch.testing.assert_close(rep.apply_conv(h)[:, :1], h[:, :1])  # the prefix passes unchanged


def test_state_norm_output_and_raw_heads() -> None:
    model = tiny(state_norm="output", head_norm=False, norm_gain=False, norm_eps=1e-5, q_pool="first")
    (x,) = model.embed(torch.randint(0, 7, (B, T)))
    h = model.step(torch.randn(B, T, D, dtype=torch.float64), x)
    torch.testing.assert_close(h.pow(2).mean(-1), torch.ones(B, T, dtype=torch.float64), rtol=1e-3, atol=0)
    z = torch.randn(B, T, D, dtype=torch.float64)
    torch.testing.assert_close(model.readout(z), model.output.head(z))
    torch.testing.assert_close(model.q_head(z), model.q_linear(z[:, 0]).squeeze(-1))
    assert all(m.weight is None and m.eps == 1e-5 for m in model.modules() if type(m).__name__ == "RMSNorm")
    assert not any("norm" in n for n, _ in model.named_parameters())


def test_padded_puzzle_table_mlp_width_guarded_b1_and_lecun_init() -> None:
    model = tiny(
        num_puzzle_ids=3, puzzle_emb_len=2, puzzle_emb_dim=D, mlp_multiple=256, tied_eps=1e-5, init="lecun"
    )
    assert model.embedding.puzzle_emb.weight.shape == (3, D)
    with torch.no_grad():
        model.embedding.puzzle_emb.weight.normal_()
    inputs = torch.randint(0, 7, (B, T))
    (x,) = model.embed(inputs, torch.tensor([2, 0, 1]))
    torch.testing.assert_close(x[:, 0], model.embedding.puzzle_emb.weight[[2, 0, 1]] * D**0.5)
    torch.testing.assert_close(x[:, 1], torch.zeros(B, D, dtype=torch.float64))  # the zero padding
    torch.testing.assert_close(
        model.embed(inputs)[0][:, 0], (model.embedding.puzzle_emb.weight[0] * D**0.5).expand(B, D)
    )
    assert model.layers[0].mlp.down.in_features == 256  # round(4 * 16 * 2/3) = 43 -> 256
    a1, a2 = torch.tensor([0.75], dtype=torch.float64), torch.tensor([0.25], dtype=torch.float64)
    b1, b2 = tied_coefficients(a1, a2, 4, eps=1e-5)
    torch.testing.assert_close(b1, b2 * 0.25 / (1 - 0.75**4 + 1e-5), rtol=1e-14, atol=0)
    big = FPRM(FPRMConfig(vocab_size=7, seq_len=T, d_model=256, n_heads=2, init="lecun", init_std=6.0))
    w = big.layers[0].mlp.gate_up.weight
    assert abs(float(w.std()) * 256**0.5 - 1.0) < 0.03  # the truncated law's std is 1/sqrt(fan_in)
    z = big.init_state(big.embed(torch.zeros(64, T, dtype=torch.long)), torch.Generator().manual_seed(0))
    assert abs(float(z.std()) - 6.0) < 0.1 and float(z.abs().max()) <= 2 * 6.0 / 0.8796 + 1e-9


def test_decay_vectors_puts_the_q_bias_in_the_decayed_group() -> None:
    from loopformer.train.optim import parameter_groups

    for flag, expect in ((False, False), (True, True)):
        groups = parameter_groups(tiny(decay_vectors=flag, norm_gain=False), 0.1)
        decayed = next(g["names"] for g in groups if g["weight_decay"] > 0)
        assert ("q_linear.bias" in decayed) is expect
        assert "residual_logit_a1" not in decayed
