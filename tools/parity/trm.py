"""TRM parity fixtures from a checkout of SamsungSAILMontreal/TinyRecursiveModels.

    python tools/parity/trm.py --ref /path/to/TinyRecursiveModels [--out tests/fixtures/parity] [--check]

Builds two tiny ``TinyRecursiveReasoningModel_ACTV1`` models on CPU in float64 (attention + RoPE with
puzzle-identifier tokens, and the MLP mixer ``mlp_t`` without positions), wraps them in the
reference's ``ACTLossHead`` (stablemax) and writes ``trm_attn*`` / ``trm_mlp*`` fixtures; see
``recursive.py`` for what is stored and the substitutions made.
"""

from __future__ import annotations

from pathlib import Path

from common import main
from recursive import TINY, build_reference_fixtures

BASE = dict(TINY, H_cycles=3, L_cycles=2, H_layers=0, L_layers=2)
CONFIGS = {
    "trm_attn": dict(BASE, pos_encodings="rope", puzzle_emb_ndim=16, puzzle_emb_len=4, mlp_t=False),
    "trm_mlp": dict(BASE, pos_encodings="none", puzzle_emb_ndim=16, puzzle_emb_len=2, mlp_t=True),
}


def build(root: Path, out: Path) -> list[str]:
    return build_reference_fixtures(
        root,
        out,
        "SamsungSAILMontreal/TinyRecursiveModels",
        "trm",
        "recursive_reasoning.trm",
        "TinyRecursiveReasoningModel_ACTV1",
        {name: (100 + i, cfg) for i, (name, cfg) in enumerate(CONFIGS.items())},
    )


if __name__ == "__main__":
    main(build, __doc__.splitlines()[0])
