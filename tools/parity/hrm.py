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

from common import main
from recursive import TINY, build_reference_fixtures

CONFIG = dict(TINY, H_cycles=2, L_cycles=3, H_layers=2, L_layers=1, pos_encodings="rope", puzzle_emb_ndim=20)


def build(root: Path, out: Path) -> list[str]:
    return build_reference_fixtures(
        root,
        out,
        "sapientinc/HRM",
        "hrm",
        "hrm.hrm_act_v1",
        "HierarchicalReasoningModel_ACTV1",
        {"hrm": (200, CONFIG)},
    )


if __name__ == "__main__":
    main(build, __doc__.splitlines()[0])
