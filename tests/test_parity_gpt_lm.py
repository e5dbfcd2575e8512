"""Parity with the Attractor paper's GPT baseline (github jacobfa/Attractor ``attractor/models/gpt/gpt.py``).

Fixture ``tests/fixtures/parity/gpt_lm`` (``tools/parity/lm_baselines.py``): a tiny float64 ``GPT`` with the
``gpt-small-140m`` architecture (ReLU^2 MLP, qk-norm, RMSNorm eps 1e-5, tied embeddings, value embeddings on
layers 1, 3, 5), weights perturbed from its init. Its weights are mapped into loopformer's ``transformer``
(``value_embeddings: true``) and the logits, the loss and every gradient norm must match."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from loopformer.convert.attractor_lm import BLOCK_KEYS
from loopformer.convert.fixtures import load_fixture
from loopformer.models.transformer import Transformer, TransformerConfig


def _model(meta: dict, weights: dict[str, torch.Tensor]) -> tuple[Transformer, dict[str, list[str]]]:
    """loopformer's transformer with the fixture's weights; ``sources``: our name -> the reference's names."""
    c = meta["config"]
    cfg = TransformerConfig(
        vocab_size=c["vocab_size"], seq_len=c["block_size"], d_model=c["n_embd"], n_heads=c["num_attention_heads"],
        n_layers=c["n_layer"], expansion=c["intermediate_size"] / c["n_embd"], causal=True, tie_embeddings=True,
        mlp="relu2", qk_norm=True, norm_eps=c["norm_eps"], rope_base=50000.0, embed_scale=1.0,
        init="scaled_zero", value_embeddings=True,
    )  # fmt: skip
    model = Transformer(cfg).double()
    state: dict[str, torch.Tensor] = {}
    sources: dict[str, list[str]] = {}

    def put(ours: str, *theirs: str) -> None:
        state[ours] = torch.cat([weights[f"weights.{t}"] for t in theirs], dim=0)
        sources[ours] = list(theirs)

    put("embedding.tokens.weight", "transformer.wte.weight")
    put("output.norm.weight", "transformer.ln_f.weight")
    for i in range(c["n_layer"]):
        src = f"transformer.h.{i}"
        for ref_key, ours in BLOCK_KEYS.items():
            put(f"layers.{i}.{ours}", f"{src}.{ref_key}")
        put(f"layers.{i}.mix.qkv.weight", *(f"{src}.attn.c_{x}.weight" for x in "qkv"))
        if f"weights.{src}.attn.ve_gate.weight" in weights:
            put(f"layers.{i}.mix.ve_gate.weight", f"{src}.attn.ve_gate.weight")
            put(f"value_embeds.{i}.weight", f"value_embeds.{i}.weight")
    used = {f"weights.{t}" for ts in sources.values() for t in ts}
    assert used == {k for k in weights if k.startswith("weights.")}, "every reference weight is mapped"
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert missing == ["output.head.weight"]  # tied to embedding.tokens.weight
    return model, sources


def test_gpt_logits_loss_and_gradients_match_the_reference() -> None:
    tensors, meta = load_fixture("gpt_lm")
    model, sources = _model(meta, tensors)
    x, y = tensors["batch.input_ids"], tensors["batch.labels"]
    model.eval()
    with torch.no_grad():
        logits = model(x).logits
    # position 0 agrees to 1e-16; later positions to ~1e-7: the reference's RoPE table is float32
    # (freqs_cis), loopformer's is in the model dtype (as in the Attractor LM parity test)
    assert (logits - tensors["eval.logits"]).abs().max() < 1e-6
    model.train()
    logits = model(x).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    assert math.isclose(loss.item(), tensors["train.loss"].item(), rel_tol=1e-7)
    loss.backward()
    for ours, p in model.named_parameters():
        ref = math.sqrt(sum(tensors[f"grad_norm.{t}"].item() ** 2 for t in sources[ours]))
        assert math.isclose(p.grad.norm().item(), ref, rel_tol=1e-5), ours
