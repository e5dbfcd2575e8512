"""Issue 16 fuzz suite (hypothesis, derandomised): random bytes, truncations and mutations of valid
recipes, overrides, config.json, CSV, ARC / Kaggle JSON, numpy folders and checkpoint folders through
the loaders and the ``loopformer`` CLI. Only success or the project's own errors with a message are
allowed (tests/reliability_harness.py; its ``--write`` mode produces docs/reliability.md's table)."""

from __future__ import annotations

import pytest
from reliability_harness import Tally, fuzz_kinds

# crash types allowed for now (none: every crash the suite found is fixed)
KNOWN_FORMATS_CRASHES: dict[str, tuple[str, ...]] = {}
MINIMUM = {
    "recipe": 300,
    "overrides": 400,
    "config_json": 250,
    "csv": 300,
    "arc": 300,
    "kaggle": 250,
    "numpy_folder": 120,
    "checkpoint": 200,
    "cli": 180,
}


@pytest.fixture(scope="module")
def kinds(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return fuzz_kinds(tmp_path_factory.mktemp("fuzz"))


@pytest.mark.parametrize("kind", sorted(MINIMUM))
def test_fuzzed_inputs_give_success_or_a_clear_error(kinds, kind: str) -> None:
    tally = Tally()
    kinds[kind](tally)
    tried = sum(sum(c.values()) for c in tally.counts.values())
    assert tried >= MINIMUM[kind]
    unexpected = [
        c
        for c in tally.crashes
        if not any(c.startswith(f"{k}: {e}") for k, errs in KNOWN_FORMATS_CRASHES.items() for e in errs)
    ]
    assert not unexpected, "\n".join(unexpected)
    assert sum(c["clear error"] for c in tally.counts.values()) > 0  # the mutations do reach the checks
