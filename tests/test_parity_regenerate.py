"""The fixture scripts regenerate the committed fixtures byte for byte (needs the reference checkouts:
set LOOPFORMER_REF_TRM / LOOPFORMER_REF_HRM / LOOPFORMER_REF_LTG / LOOPFORMER_REF_ATTRACTOR to their
paths; skipped otherwise; the LTG script also needs transformers 4.x importable, e.g. on PYTHONPATH)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "env"),
    [
        ("trm.py", "LOOPFORMER_REF_TRM"),
        ("hrm.py", "LOOPFORMER_REF_HRM"),
        ("ltg.py", "LOOPFORMER_REF_LTG"),
        ("attractor_lm.py", "LOOPFORMER_REF_ATTRACTOR"),
        ("lm_baselines.py", "LOOPFORMER_REF_ATTRACTOR"),
        ("export_authors.py", "LOOPFORMER_REF_TRM"),  # export_trm, export_trm_puzzle
        ("export_authors.py", "LOOPFORMER_REF_HRM"),  # export_hrm
    ],
)
def test_parity_fixture_scripts_regenerate_bit_identically(script: str, env: str) -> None:
    ref = os.environ.get(env)
    if not ref:
        pytest.skip(f"{env} is not set (path of the reference checkout)")
    res = subprocess.run(
        [sys.executable, script, "--ref", ref, "--check"],
        cwd=ROOT / "tools" / "parity",
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "regenerate bit-identically" in res.stdout
