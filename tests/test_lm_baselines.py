"""The Attractor paper's LM layer options on the transformer and recurrent (Parcae) families.

github jacobfa/Attractor attractor/configs/gpt/gpt-small-140m.py and parcae/parcae-small-140m.py: ReLU^2 MLP,
qk-norm, RMSNorm eps, RoPE base, embedding / logit scale, scaled-zero + orthogonal init, and Parcae's
prelude norm, output projection C and initial decay sqrt(1/5)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from loopformer.models.recurrent import RecurrentConfig, RecurrentDepth
from loopformer.models.transformer import Transformer, TransformerConfig
from loopformer.nn import RMSNorm

LM = dict(vocab_size=64, seq_len=16, d_model=32, n_heads=2, causal=True, tie_embeddings=True)
OPTIONS = dict(mlp="relu2", qk_norm=True, norm_eps=1e-5, rope_base=50000.0, embed_scale=1.0)


def _parcae(**kw: object) -> RecurrentDepth:
    cfg = dict(
        LM,
        **OPTIONS,
        n_prelude=1,
        n_layers=1,
        n_coda=1,
        injection="parcae",
        weight_init="scaled_zero",
        prelude_norm=True,
        coda_proj=True,
        parcae_decay=math.sqrt(0.2),
        init="random",
        init_std=0.05,
    )
    cfg.update(kw)
    return RecurrentDepth(RecurrentConfig(**cfg))  # type: ignore[arg-type]


def _check_scaled_zero(blocks: torch.nn.ModuleList, d: int) -> None:
    std = math.sqrt(2.0 / (5.0 * d))
    for block in blocks:
        for lin in block.output_projections():
            assert torch.count_nonzero(lin.weight) == 0
        # q, k, v each orthogonal with gain std * sqrt(d): W W^T = std^2 d I
        for chunk in block.mix.qkv.weight.chunk(3, dim=0):
            gram = chunk @ chunk.T
            assert torch.allclose(gram, std**2 * d * torch.eye(d), atol=1e-5)
        assert block.mlp.up.weight.shape == (4 * d, d)  # ReLU^2: one input matrix, no gate


def test_transformer_layer_options() -> None:
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(**LM, **OPTIONS, n_layers=2, init="scaled_zero"))  # type: ignore[arg-type]
    _check_scaled_zero(model.layers, 32)
    assert model.embedding.scale == 1.0 and model.output.norm.eps == 1e-5
    block = model.layers[0]
    assert block.mix.qk_norm
    inv_freq = block.mix.rotary.inv_freq  # base^(-2i / head_dim), head_dim 16
    assert torch.allclose(inv_freq, 50000.0 ** (-torch.arange(0, 16, 2) / 16.0))
    std = math.sqrt(2.0 / (5.0 * 32))
    w = model.embedding.tokens.weight  # 64 x 32 orthogonal rows: W^T W = std^2 * 64 * I
    assert torch.allclose(w.T @ w, std**2 * 64 * torch.eye(32), atol=1e-5)
    x = torch.randint(0, 64, (2, 16))
    base = model(x).logits
    model.config.logit_scale = 2.5
    assert torch.allclose(model(x).logits, 2.5 * base)
    # scaled-zero: every block's output projection is 0, so the blocks start as the identity
    h = model.embedding(x)
    assert torch.allclose(base, model.output(h), atol=1e-6)


def test_transformer_defaults_unchanged() -> None:
    model = Transformer(TransformerConfig(**LM, n_layers=1))  # type: ignore[arg-type]
    block = model.layers[0]
    assert not block.mix.qk_norm and hasattr(block.mlp, "gate_up") and model.output.norm.eps == 1e-6
    assert model.embedding.scale == math.sqrt(32)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("mlp", "gelu"),
        ("init", "xavier"),
        ("norm_eps", 0.0),
        ("rope_base", -1.0),
        ("logit_scale", float("nan")),
        ("embed_scale", -1.0),
    ],
)
def test_transformer_bad_options_are_errors(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"TransformerConfig.{key}"):
        TransformerConfig(**{key: value})  # type: ignore[arg-type]


def test_parcae_layers() -> None:
    torch.manual_seed(0)
    model = _parcae()
    for blocks in (model.prelude, model.core, model.coda):
        _check_scaled_zero(blocks, 32)
    decay = torch.exp(-F.softplus(model.injection_dt) * torch.exp(model.injection_log_A))
    assert torch.allclose(decay, torch.full((32,), math.sqrt(0.2)), atol=1e-6)
    assert torch.equal(model.injection_B.weight, torch.eye(32))
    assert isinstance(model.prelude_out_norm, RMSNorm) and model.prelude_out_norm.eps == 1e-5
    c = model.coda_in.weight  # orthogonal, gain std * sqrt(d)
    assert torch.allclose(c @ c.T, (2.0 / 5.0) * torch.eye(32), atol=1e-5)
    assert {"injection_log_A", "injection_dt", "injection_B", "coda_in"} == model.no_weight_decay()
    # the prelude output is normalised (unit RMS with gain 1), and C is applied before the coda
    e = model.embed(torch.randint(0, 64, (2, 16)))[0]
    assert torch.allclose(e.pow(2).mean(-1), torch.ones(2, 16), atol=3e-3)  # eps 1e-5 vs ms ~ 0.0125
    z = torch.randn(2, 16, 32)
    with torch.no_grad():
        model.coda_in.weight.zero_()
    zero_state = model.output(torch.zeros(2, 16, 32))  # coda blocks are the identity at init (outputs 0)
    assert torch.allclose(model.readout(z, e), zero_state, atol=1e-6)


def test_parcae_defaults_unchanged() -> None:
    model = RecurrentDepth(RecurrentConfig(**LM, n_layers=1, injection="parcae"))  # type: ignore[arg-type]
    assert torch.equal(model.injection_dt, torch.zeros(32))  # decay 0.5: dt = 0 exactly
    assert model.prelude_out_norm is None and model.coda_in is None
    assert model.no_weight_decay() == {"injection_log_A", "injection_dt"}
    names = {n for n, _ in model.named_parameters()}
    assert not any(n.startswith(("coda_in", "prelude_out_norm")) for n in names)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"weight_init": "orthogonal"}, "weight_init"),
        ({"parcae_decay": 1.0}, "parcae_decay"),
        ({"block": "gpt2", "qk_norm": True}, "qk_norm"),
        ({"block": "gpt2", "coda_proj": True}, "coda_proj"),
        ({"mlp": "geglu"}, "RecurrentConfig.mlp"),
    ],
)
def test_recurrent_bad_options_are_errors(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RecurrentConfig(**kw)


@pytest.mark.parametrize("recipe", ["transformer", "parcae"])
def test_paper_recipe_optimiser_groups(recipe: str) -> None:
    """MuonAdamW's groups as the reference's ``get_muon_param_groups`` forms them: Muon on the blocks' 2-D
    matrices; AdamW with weight decay 0 on the tied embedding, the norms and Parcae's A_log, dt, B, C."""
    import re
    from pathlib import Path

    from loopformer.config import load_config
    from loopformer.models.registry import build_model
    from loopformer.train.setup import make_optimizer

    root = Path(__file__).resolve().parent.parent
    cfg = load_config(
        root / "recipes" / f"paper_lm_{recipe}_140m.yaml", ["model.d_model=32", "model.n_heads=2"]
    )
    model = build_model(cfg.model.name, config=cfg.model_config(vocab_size=256, seq_len=64, causal=True))
    opt = make_optimizer(model, cfg.train)
    muon = {n for g in opt.param_groups if g["kind"] == "muon" for n in g["names"]}
    block_matrix = re.compile(
        r"^(layers|prelude|core|coda)\.\d+\.(mix\.qkv|mix\.proj|mix\.ve_gate|mlp\.up|mlp\.down)\.weight$"
    )
    names = {n for n, _ in model.named_parameters()}
    assert muon == {n for n in names if block_matrix.match(n)}
    adamw = [g for g in opt.param_groups if g["kind"] == "adamw"]
    assert all(g["weight_decay"] == 0.0 for g in adamw)
    assert {n for g in adamw for n in g["names"]} == names - muon
    muon_group = next(g for g in opt.param_groups if g["kind"] == "muon")
    assert muon_group["weight_decay"] == 0.2 and muon_group["lr"] == 8e-3
    if recipe == "parcae":
        assert {"injection_B.weight", "coda_in.weight", "injection_dt", "injection_log_A"} <= names - muon


def test_value_embedding_attention_against_a_closed_form() -> None:
    """``v + 2 sigmoid(ve_gate(x[..., :c])) ve`` per head, then causal softmax attention (float64)."""
    from loopformer.nn import Attention

    torch.manual_seed(0)
    d, h, B, T = 16, 2, 2, 5
    attn = Attention(d, h, causal=True, rope=False).double()
    attn.ve_gate = torch.nn.Linear(8, h, bias=False).double()
    x, ve = torch.randn(B, T, d, dtype=torch.float64), torch.randn(B, T, d, dtype=torch.float64)
    q, k, v = (x @ attn.qkv.weight.T).split(d, dim=-1)
    gate = 2 * torch.sigmoid(x[..., :8] @ attn.ve_gate.weight.T)  # [B, T, h]
    v = v + (ve.view(B, T, h, d // h) * gate[..., None]).view(B, T, d)
    heads = [slice(i * (d // h), (i + 1) * (d // h)) for i in range(h)]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    out = []
    for s in heads:
        scores = (q[..., s] @ k[..., s].transpose(-1, -2)) / math.sqrt(d // h)
        out.append(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v[..., s])
    expected = torch.cat(out, dim=-1) @ attn.proj.weight.T
    assert torch.allclose(attn(x, ve), expected, atol=1e-12)
    with pytest.raises(ValueError, match="ve_gate"):
        Attention(d, h).double()(x, ve)


def test_value_embedding_layers() -> None:
    """The reference's has_ve: layers 1, 3, 5 of 6 (GPT) and the effective layers 1, 3, 5 of Parcae's
    prelude + core + coda; the core's and coda's tables reach step / readout through the context."""
    torch.manual_seed(0)
    gpt = Transformer(TransformerConfig(**LM, n_layers=6, value_embeddings=True))  # type: ignore[arg-type]
    assert list(gpt.value_embeds.keys()) == ["1", "3", "5"]
    assert [layer.mix.ve_gate is not None for layer in gpt.layers] == [False, True] * 3
    x = torch.randint(0, 64, (2, 16))
    ctx = gpt.embed(x)
    assert len(ctx) == 4 and torch.equal(ctx[2], gpt.value_embeds["3"](x))
    with torch.no_grad():
        base = gpt.step(ctx[0], *ctx)
        assert not torch.allclose(gpt.step(ctx[0], ctx[0], ctx[1], torch.zeros_like(ctx[2]), ctx[3]), base)
    model = _parcae(n_prelude=2, n_layers=2, n_coda=2, value_embeddings=True, weight_init="default")
    assert [len(t) for t in (model.ve_prelude, model.ve_core, model.ve_coda)] == [1, 1, 1]
    for blocks in (model.prelude, model.core, model.coda):
        assert [b.mix.ve_gate is not None for b in blocks] == [False, True]
    ctx = model.embed(x)
    assert len(ctx) == 3  # e, the core's, the coda's
    z = torch.randn(2, 16, 32)
    with torch.no_grad():
        assert not torch.allclose(
            model.step(z, ctx[0], torch.zeros_like(ctx[1]), ctx[2]), model.step(z, *ctx)
        )
        assert not torch.allclose(
            model.readout(z, ctx[0], ctx[1], torch.zeros_like(ctx[2])), model.readout(z, *ctx)
        )
    with pytest.raises(ValueError, match="value embeddings"):
        model.readout(z)
    assert model(x).logits.shape == (2, 16, 64)
    with pytest.raises(ValueError, match="value_embeddings"):
        RecurrentConfig(block="gpt2", value_embeddings=True)
