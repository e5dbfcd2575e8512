"""HRM parity fixtures from a checkout of sapientinc/HRM.

    python tools/parity/hrm.py --ref /path/to/HRM [--out tests/fixtures/parity] [--check]

Builds a tiny ``HierarchicalReasoningModel_ACTV1`` (``models/hrm/hrm_act_v1.py``) on CPU in float64,
with a puzzle embedding of 20 values padded to two tokens of 16, wraps it in the reference's
``ACTLossHead`` (stablemax; HRM's Q-learning: a second no-grad forward gives the continue target) and
writes the ``hrm`` fixture; see ``recursive.py`` for what is stored and the substitutions (flash-attn ->
``F.scaled_dot_product_attention``, rms_norm in float64, AdamATan2 written out).
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
CONFIG = dict(
    batch_size=4,
    seq_len=16,
    vocab_size=6,
    num_puzzle_identifiers=3,
    H_cycles=2,
    L_cycles=3,
    H_layers=2,
    L_layers=1,
    hidden_size=16,
    expansion=4,
    num_heads=2,
    halt_max_steps=3,
    halt_exploration_prob=0.5,
    forward_dtype="float64",
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    pos_encodings="rope",
    puzzle_emb_ndim=20,
)


def build(root: Path, out: Path) -> list[str]:
    install_stubs()
    import models.layers as layers
    from models import losses
    from models.hrm import hrm_act_v1

    patch_rms_norm(layers, hrm_act_v1)
    torch.manual_seed(200)
    model = hrm_act_v1.HierarchicalReasoningModel_ACTV1(CONFIG)
    head = to_float64(losses.ACTLossHead(model, loss_type="stablemax_cross_entropy"))
    meta = {
        "repo": "sapientinc/HRM",
        "commit": git_commit(root),
        "system": "hrm",
        "model": "models/hrm/hrm_act_v1.py: HierarchicalReasoningModel_ACTV1",
        "model_name": "hrm.hrm_act_v1@HierarchicalReasoningModel_ACTV1",
    }
    return build_fixture(head, CONFIG, out, "hrm", meta, OPT)


if __name__ == "__main__":
    main(build, __doc__.splitlines()[0])
