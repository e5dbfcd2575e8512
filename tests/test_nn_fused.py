"""The fused hot paths (issue 15) against plain, unfused float64 formulations: rotary embeddings by one
complex multiplication, the channels-last grid convolution, FPRM's addcmul residual scaling. Values
and gradients must agree to float64 round-off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loopformer.models.fprm import FPRM, FPRMConfig
from loopformer.nn import Attention, DepthwiseConv2d, Rotary

DT = torch.float64


def rotate_reference(
    x: torch.Tensor, base: float = 10000.0, table: torch.dtype = torch.float32
) -> torch.Tensor:
    """RoFormer's rotation of interleaved pairs, written out: x [..., T, Dh].  The frequencies are
    rounded to float32 as loopformer (and the RoPE codes it follows) builds them; the angles are
    computed in ``table`` precision (float64 once the module is moved to float64)."""
    T, Dh = x.shape[-2:]
    inv_freq = (1.0 / (base ** (torch.arange(0, Dh, 2, dtype=torch.float32) / Dh))).to(table)
    angle = torch.outer(torch.arange(T, dtype=table), inv_freq)
    angle = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    cos, sin = angle
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


def attention_reference(att: Attention, x: torch.Tensor) -> torch.Tensor:
    B, T, D = x.shape
    qkv = (x @ att.qkv.weight.T).view(B, T, 3, att.n_heads, att.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    if att.rotary is not None:
        q, k = rotate_reference(q, table=DT), rotate_reference(k, table=DT)
    scores = (q @ k.transpose(-1, -2)) / att.head_dim**0.5
    if att.causal:
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = scores.softmax(-1) @ v
    return y.transpose(1, 2).reshape(B, T, D) @ att.proj.weight.T


@pytest.mark.parametrize("shape", [(2, 3, 9, 16), (1, 81, 64)])
def test_rotary_matches_written_out_rotation(shape) -> None:
    x = torch.randn(shape, dtype=DT)
    rot = Rotary(shape[-1])
    torch.testing.assert_close(rot(x), rotate_reference(x), rtol=1e-12, atol=1e-12)


def test_rotate_qk_complex_and_real_paths_agree() -> None:
    rot = Rotary(8)
    qkv = torch.randn(2, 7, 3, 4, 8, dtype=DT)
    q, k = rot.rotate_qk(qkv)  # contiguous float64: the complex path
    q_real, k_real = rot.rotate_qk(qkv.transpose(0, 1).contiguous().transpose(0, 1))  # strided: real path
    for got, idx in ((q, 0), (k, 1), (q_real, 0), (k_real, 1)):
        torch.testing.assert_close(
            got, rotate_reference(qkv[:, :, idx].transpose(1, 2)), rtol=1e-12, atol=1e-12
        )


def test_rotary_bf16_uses_real_form() -> None:
    rot = Rotary(8)
    x = torch.randn(2, 5, 8)
    out = rot(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), rotate_reference(x.double()).float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("causal,rope", [(False, True), (True, True), (False, False)])
def test_attention_value_and_gradients_match_reference(causal: bool, rope: bool) -> None:
    torch.manual_seed(0)
    att = Attention(32, 4, causal=causal, rope=rope).to(DT)
    x = torch.randn(3, 11, 32, dtype=DT, requires_grad=True)
    out = att(x)
    ref = attention_reference(att, x)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, att.qkv.weight, att.proj.weight], g)
    want = torch.autograd.grad(ref, [x, att.qkv.weight, att.proj.weight], g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("prefix", [0, 3])
def test_grid_conv_matches_transposed_conv(prefix: int) -> None:
    torch.manual_seed(0)
    conv = DepthwiseConv2d(6, (4, 5)).to(DT)
    torch.nn.init.normal_(conv.conv.weight)
    x = torch.randn(2, prefix + 20, 6, dtype=DT, requires_grad=True)
    out = conv(x)
    grid = x[:, prefix:].transpose(1, 2).reshape(2, 6, 4, 5)
    ref = F.conv2d(grid, conv.conv.weight, padding=1, groups=6).reshape(2, 6, 20).transpose(1, 2)
    torch.testing.assert_close(out[:, prefix:], ref, rtol=1e-12, atol=1e-12)
    assert out[:, :prefix].abs().max() == 0 if prefix else True
    g = torch.randn_like(ref)
    (gx,) = torch.autograd.grad(out[:, prefix:], x, g)
    (gx_ref,) = torch.autograd.grad(ref, x, g)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-12, atol=1e-12)


def fprm_step_unfused(model: FPRM, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """FPRM's step with the residual scaling spelt ``a * h + b * u`` (three kernels each)."""
    h = model.apply_conv(z)
    a1, a2, b1, b2 = model.residual_scalars(h, x)
    h = a2 * h + b2 * x
    for block in model.layers:
        h = block(h, residual=lambda h_, u: a1 * h_ + b1 * u)
    return h


@pytest.mark.parametrize("norm,scalars", [("pre", "learned"), ("post", "state"), ("peri", "input")])
def test_fprm_step_matches_unfused_step(norm: str, scalars: str) -> None:
    torch.manual_seed(0)
    cfg = FPRMConfig(
        vocab_size=11,
        seq_len=16,
        d_model=32,
        n_heads=4,
        grid=(4, 4),
        conv="grid2d",
        norm=norm,
        scalars=scalars,
    )
    model = FPRM(cfg).to(DT)
    for p in model.parameters():  # move off the zero / symmetric inits so every path carries signal
        p.data.add_(0.1 * torch.randn_like(p))
    inputs = torch.randint(0, 11, (3, 16))
    (x,) = model.embed(inputs)
    z = torch.randn(3, 16, 32, dtype=DT, requires_grad=True)
    out, ref = model.step(z, x), fprm_step_unfused(model, z, x)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    unused = ("output.", "q_linear.")  # the readout and Q-head are not part of the step
    params = [z] + [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith(unused)]
    g = torch.randn_like(out)
    for a, b in zip(
        torch.autograd.grad(out, params, g, retain_graph=True), torch.autograd.grad(ref, params, g)
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
