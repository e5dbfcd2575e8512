"""Parity with the Attractor paper's LM baselines (github jacobfa/Attractor ``attractor/models/gpt/gpt.py``,
``attractor/models/parcae/parcae.py``).

Fixtures ``tests/fixtures/parity/gpt_lm`` and ``parcae_lm`` (``tools/parity/lm_baselines.py``): tiny float64
models with the 140M configs' architectures (ReLU^2 MLP, qk-norm, RMSNorm eps 1e-5, tied embeddings, value
embeddings; Parcae's prelude norm, diagonal injection, C; 2 loops without and 2 with gradient from a zero state),
weights perturbed from their init. The weights are mapped into loopformer's ``transformer`` / ``recurrent``
(``value_embeddings: true``) and the logits, the loss and every gradient norm must match."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from loopformer.convert.attractor_lm import BLOCK_KEYS
from loopformer.convert.fixtures import load_fixture
from loopformer.loop import LoopConfig
from loopformer.models.recurrent import RecurrentConfig, RecurrentDepth
from loopformer.models.transformer import Transformer, TransformerConfig

Sources = dict[str, list[str]]


class _Map:
    """Our state dict from the fixture's ``weights.*`` with the reference names of every entry."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights, self.state, self.sources = weights, {}, {}  # type: ignore[var-annotated]

    def put(self, ours: str, *theirs: str) -> None:
        self.state[ours] = torch.cat([self.weights[f"weights.{t}"] for t in theirs], dim=0)
        self.sources[ours] = list(theirs)

    def block(self, src: str, dst: str) -> bool:
        """One ``TransformerPreNormBlock``; True when it has a value-embedding gate."""
        for ref_key, ours in BLOCK_KEYS.items():
            self.put(f"{dst}.{ours}", f"{src}.{ref_key}")
        self.put(f"{dst}.mix.qkv.weight", *(f"{src}.attn.c_{x}.weight" for x in "qkv"))
        if f"weights.{src}.attn.ve_gate.weight" not in self.weights:
            return False
        self.put(f"{dst}.mix.ve_gate.weight", f"{src}.attn.ve_gate.weight")
        return True

    def load(self, model: torch.nn.Module) -> Sources:
        used = {f"weights.{t}" for ts in self.sources.values() for t in ts}
        assert used == {k for k in self.weights if k.startswith("weights.")}, (
            "every reference weight is mapped"
        )
        missing = model.load_state_dict(self.state, strict=False).missing_keys
        assert missing == ["output.head.weight"]  # tied to embedding.tokens.weight
        return self.sources


def _check(model: torch.nn.Module, sources: Sources, tensors: dict[str, torch.Tensor], **kw: object) -> None:
    x, y = tensors["batch.input_ids"], tensors["batch.labels"]
    model.eval()
    with torch.no_grad():
        logits = model(x, **kw).logits
    # position 0 agrees to 1e-16; later positions to ~1e-7: the reference's RoPE table is float32
    # (freqs_cis), loopformer's is in the model dtype (as in the Attractor LM parity test)
    assert (logits - tensors["eval.logits"]).abs().max() < 1e-6
    model.train()
    logits = model(x, **kw).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    assert math.isclose(loss.item(), tensors["train.loss"].item(), rel_tol=1e-7)
    loss.backward()
    for ours, p in model.named_parameters():
        if ours == "output.head.weight":
            continue
        ref = math.sqrt(sum(tensors[f"grad_norm.{t}"].item() ** 2 for t in sources[ours]))
        assert math.isclose(p.grad.norm().item(), ref, rel_tol=1e-5), ours


def _layer_options(c: dict) -> dict:
    return dict(
        vocab_size=c["vocab_size"], seq_len=c["block_size"], d_model=c["n_embd"], n_heads=c["num_attention_heads"],
        expansion=c["intermediate_size"] / c["n_embd"], causal=True, tie_embeddings=True, mlp="relu2",
        qk_norm=True, norm_eps=c["norm_eps"], rope_base=50000.0, embed_scale=1.0, value_embeddings=True,
    )  # fmt: skip


def test_gpt_logits_loss_and_gradients_match_the_reference() -> None:
    tensors, meta = load_fixture("gpt_lm")
    c = meta["config"]
    model = Transformer(
        TransformerConfig(**_layer_options(c), n_layers=c["n_layer"], init="scaled_zero")
    ).double()
    km = _Map(tensors)
    km.put("embedding.tokens.weight", "transformer.wte.weight")
    km.put("output.norm.weight", "transformer.ln_f.weight")
    for i in range(c["n_layer"]):
        if km.block(f"transformer.h.{i}", f"layers.{i}"):
            km.put(f"value_embeds.{i}.weight", f"value_embeds.{i}.weight")
    _check(model, km.load(model), tensors)


def test_parcae_logits_loss_and_gradients_match_the_reference() -> None:
    tensors, meta = load_fixture("parcae_lm")
    c = meta["config"]
    n_p, n_c, n_d = c["n_layers_in_prelude"], c["n_layers_in_recurrent_block"], c["n_layers_in_coda"]
    cfg = RecurrentConfig(
        **_layer_options(c), n_prelude=n_p, n_layers=n_c, n_coda=n_d, injection="parcae", init="zeros",
        weight_init="scaled_zero", prelude_norm=True, coda_proj=True,
    )  # fmt: skip
    model = RecurrentDepth(cfg).double()
    km = _Map(tensors)
    km.put("embedding.tokens.weight", "transformer.wte.weight")
    km.put("output.norm.weight", "transformer.ln_f.weight")
    km.put("prelude_out_norm.weight", "transformer.ln_prelude.weight")
    km.put("coda_in.weight", "transformer.C.weight")
    km.put("injection_log_A", "transformer.adapter.A_log")
    km.put("injection_dt", "transformer.adapter.dt_bias")
    km.put("injection_B.weight", "transformer.adapter.B")
    effective = 0  # the reference numbers its value_embeds over prelude + core + coda
    for part, ours, n in (("prelude", "prelude", n_p), ("core_block", "core", n_c), ("coda", "coda", n_d)):
        for i in range(n):
            if km.block(f"transformer.{part}.{i}", f"{ours}.{i}"):
                table = "ve_core" if ours == "core" else f"ve_{ours}"
                km.put(f"{table}.{i}.weight", f"value_embeds.{effective}.weight")
            effective += 1
    no_grad, with_grad = meta["num_steps_pair"]
    loop = LoopConfig(solver="picard", halting="fixed", max_steps=no_grad + with_grad, grad="truncated",
                      grad_steps=with_grad)  # fmt: skip
    _check(model, km.load(model), tensors, loop=loop)
