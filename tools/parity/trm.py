"""TRM parity fixtures from a checkout of SamsungSAILMontreal/TinyRecursiveModels.

    python tools/parity/trm.py --ref /path/to/TinyRecursiveModels [--out tests/fixtures/parity] [--check]

Builds two tiny ``TinyRecursiveReasoningModel_ACTV1`` models on CPU in float64 (attention + RoPE with
puzzle-identifier tokens, and the MLP mixer ``mlp_t`` without positions), wraps them in the
reference's ``ACTLossHead`` (stablemax) and writes ``trm_attn*`` / ``trm_mlp*`` fixtures; see
``recursive.py`` for what is stored and the substitutions made.
"""

from __future__ import annotations

from pathlib import Path

import torch
from common import git_commit, main
from recursive import build_fixture, install_stubs, patch_rms_norm, to_float64

OPT = {
    "lr": 1e-3,
    "weight_decay": 0.1,
    "beta1": 0.9,
    "beta2": 0.95,
    "puzzle_emb_lr": 1e-2,
    "puzzle_emb_weight_decay": 0.1,
}

BASE = dict(
    batch_size=4,
    seq_len=16,
    vocab_size=6,
    num_puzzle_identifiers=3,
    H_cycles=3,
    L_cycles=2,
    H_layers=0,
    L_layers=2,
    hidden_size=16,
    expansion=4,
    num_heads=2,
    halt_max_steps=3,
    halt_exploration_prob=0.5,
    forward_dtype="float64",
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
CONFIGS = {
    "trm_attn": dict(BASE, pos_encodings="rope", puzzle_emb_ndim=16, puzzle_emb_len=4, mlp_t=False),
    "trm_mlp": dict(BASE, pos_encodings="none", puzzle_emb_ndim=16, puzzle_emb_len=2, mlp_t=True),
}


def build(root: Path, out: Path) -> list[str]:
    install_stubs()
    import models.layers as layers
    from models import losses
    from models.recursive_reasoning import trm

    patch_rms_norm(layers, trm)
    written = []
    for i, (name, cfg) in enumerate(CONFIGS.items()):
        torch.manual_seed(100 + i)
        model = trm.TinyRecursiveReasoningModel_ACTV1(cfg)
        head = to_float64(losses.ACTLossHead(model, loss_type="stablemax_cross_entropy"))
        meta = {
            "repo": "SamsungSAILMontreal/TinyRecursiveModels",
            "commit": git_commit(root),
            "model": "models/recursive_reasoning/trm.py: TinyRecursiveReasoningModel_ACTV1",
            "system": "trm",
            "model_name": "recursive_reasoning.trm@TinyRecursiveReasoningModel_ACTV1",
        }
        written += build_fixture(head, cfg, out, name, meta, OPT)
    return written


if __name__ == "__main__":
    main(build, __doc__.splitlines()[0])
