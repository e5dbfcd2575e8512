"""Parity fixtures for the Attractor paper's LM baselines (github jacobfa/Attractor, ``GPT`` and ``Parcae``).

Imports ``attractor/models/gpt/gpt.py`` (``GPT``) and ``config.py`` (``GPTConfig``) from a checkout of the
reference (``--ref``), builds a tiny model in float64 on CPU with the 140M config's architecture
(``configs/gpt/gpt-small-140m.py``: 6 ``TransformerPreNormBlock`` layers, RMSNorm eps 1e-5, ``BaseMLP`` +
``ReLU2``, qk-norm, no biases, tied embeddings, value embeddings on layers 1, 3, 5 with their ``ve_gate``,
``scaled-zero`` + orthogonal init) at d 32 (the gate reads 32 channels), perturbs every weight by
N(0, 0.05^2) so that no projection is zero, and writes ``tests/fixtures/parity/gpt_lm.safetensors`` +
``.json``: the weights (``weights.<reference key>``), an input batch and labels, the logits of
``forward(return_logits=True)`` (eval mode), the training loss of ``forward(labels=...)`` and every
parameter's gradient norm. ``parcae_lm`` does the same for ``attractor/models/parcae/parcae.py`` (``Parcae``)
with ``configs/parcae/parcae-small-140m.py``'s architecture (prelude 2, core 2, coda 2, ``prelude_norm``, the
diagonal injection, C, value embeddings on the effective layers 1, 3, 5) from a zero state (``state_init:
zero``) with ``num_steps_pair`` (2, 2): 2 loops without gradient, then 2 with (the random like-init state and
per-sequence loop counts of the 140M run are not reproducible across codes).

Substitutions (also in the fixture's JSON): ``Tensor.float()`` keeps float64 tensors (the reference upcasts
its RMSNorm, RoPE and logits to float32); attention is the reference's CPU path (causal SDPA); the non-fused
heads (``use_fused_head=False``; the fused one is Triton).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attractor_lm import COMMIT, float64_kept
from common import main

from loopformer.convert.fixtures import save_fixture

SUBSTITUTIONS = [
    "use_fused_head=False (the fused Triton head needs a GPU): the tied logits are x @ wte^T in both paths; the "
    "non-fused path's unused lm_head Linear is left out",
    "Tensor.float() keeps float64 tensors while the reference runs (RMSNorm, RoPE and the logits upcast to "
    "float32 in the reference; in float64 that would round)",
    "attention: the reference's CPU path (flash_attention._sdpa_attention, causal SDPA)",
]
TINY: dict[str, Any] = dict(
    name="gpt-parity-tiny",
    block_size=16,
    vocab_size=32,
    padding_multiple=8,
    n_embd=32,
    n_layer=6,
    num_attention_heads=2,
    num_key_value_heads=2,
    intermediate_size=128,
    bias=False,
    tie_embeddings=True,
    block_class_name="TransformerPreNormBlock",
    norm_class_name="RMSNorm",
    norm_eps=1e-5,
    mlp_class_name="BaseMLP",
    nonlin_name="ReLU2",
    qk_norm=True,
    logit_softcap=None,
    init_strategy="scaled-zero",
    init_orthogonal=True,
    use_fused_head=False,  # the fused (Triton) head needs a GPU; the tied logits are wte^T x either way
)
BATCH, SEQ, PERTURB = 3, 12, 0.05
# parcae-small-140m.py's architecture at the same tiny size; the initial state zero and the loop count fixed
# (num_steps_pair: 2 loops without gradient, then 2 with) so the fixture is deterministic
PARCAE: dict[str, Any] = {
    **{k: v for k, v in TINY.items() if k not in ("name", "n_layer")},
    "name": "parcae-parity-tiny",
    "prelude_norm": True,
    "injection_type": "diagonal",
    "state_init": "zero",
    "recurrent_embedding_dimension": 32,
    "recurrent_intermediation_embedding_dimension": 128,
    "n_layers_in_recurrent_block": 2,
    "n_layers_in_prelude": 2,
    "n_layers_in_coda": 2,
    "mean_recurrence": 4,
    "sampling_scheme": "poisson-truncated-full",
    "mean_backprop_depth": 2,
    "recurrent_iteration_method": "per-sequence",
}
STEPS = (2, 2)  # (without gradient, with gradient)


def _record(out_dir: Path, model: Any, cfg: dict[str, Any], name: str, source: str, **kw: Any) -> list[str]:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(PERTURB * torch.randn_like(p))
    # lm_head: GPT with use_fused_head=False has an unused, untied Linear (the tied logits read wte): left out
    tensors: dict[str, Tensor] = {
        f"weights.{k}": v.detach().clone()
        for k, v in model.state_dict().items()
        if k not in ("freqs_cis", "lm_head.weight")
    }
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, cfg["vocab_size"], (BATCH, SEQ), generator=g)
    labels = torch.randint(0, cfg["vocab_size"], (BATCH, SEQ), generator=g)
    tensors.update({"batch.input_ids": input_ids, "batch.labels": labels})
    with float64_kept():
        model.eval()
        with torch.no_grad():
            tensors["eval.logits"] = model(input_ids, return_logits=True, **kw)["logits"]
        model.train()
        out = model(input_ids, labels=labels, **kw)
        out["loss"].backward()
    tensors["train.loss"] = out["loss"].detach().reshape(1)
    for n, p in model.named_parameters():
        if p.grad is not None:
            tensors[f"grad_norm.{n}"] = torch.linalg.vector_norm(p.grad).reshape(1)
    meta = {
        "repository": "jacobfa/Attractor",
        "commit": COMMIT,
        "model": source,
        "config": {k: v for k, v in cfg.items() if k != "name"},
        "perturbation": PERTURB,
        "substitutions": SUBSTITUTIONS,
        "dtype": "float64",
        **({"num_steps_pair": list(STEPS)} if "num_steps_pair" in kw else {}),
    }
    save_fixture(out_dir, name, tensors, meta)
    return [f"{name}.safetensors", f"{name}.json"]


def build(ref_root: Path, out_dir: Path) -> list[str]:
    gpt_config = importlib.import_module("attractor.models.gpt.config")
    gpt = importlib.import_module("attractor.models.gpt.gpt")
    parcae_config = importlib.import_module("attractor.models.parcae.config")
    parcae = importlib.import_module("attractor.models.parcae.parcae")
    torch.manual_seed(0)
    model = gpt.GPT(gpt_config.GPTConfig(**TINY)).double()
    files = _record(out_dir, model, TINY, "gpt_lm", "attractor/models/gpt/gpt.py:GPT")
    torch.manual_seed(0)
    model = parcae.Parcae(parcae_config.ParcaeConfig(**PARCAE)).double()
    files += _record(
        out_dir,
        model,
        PARCAE,
        "parcae_lm",
        "attractor/models/parcae/parcae.py:Parcae",
        num_steps_pair=torch.tensor(STEPS),
    )
    return files


if __name__ == "__main__":
    main(build, __doc__.splitlines()[0])
