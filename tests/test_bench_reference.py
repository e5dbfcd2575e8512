"""The head-to-head benchmark harness (benchmarks/bench_reference.py): checkout discovery, the skip
message without a checkout, and (with checkouts, ``-m slow``) one quick pair per reference."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:  # benchmarks/ is a top-level package of the repository
    sys.path.insert(0, ROOT)

from benchmarks import bench_reference as br  # noqa: E402


def test_checkout_found_by_model_variable_or_folder(monkeypatch, tmp_path) -> None:
    for model in br.REFS:
        monkeypatch.delenv(f"LOOPFORMER_REF_{model.upper()}", raising=False)
    monkeypatch.delenv("LOOPFORMER_REFS", raising=False)
    assert br.find_reference("trm") is None
    (tmp_path / "TinyRecursiveModels").mkdir()
    monkeypatch.setenv("LOOPFORMER_REFS", str(tmp_path))
    assert br.find_reference("trm") == tmp_path / "TinyRecursiveModels"
    assert br.find_reference("hrm") is None
    monkeypatch.setenv("LOOPFORMER_REF_HRM", str(tmp_path / "missing"))
    assert br.find_reference("hrm") is None
    monkeypatch.setenv("LOOPFORMER_REF_HRM", str(tmp_path))
    assert br.find_reference("hrm") == tmp_path


def test_absent_checkout_is_skipped_with_a_message(monkeypatch) -> None:
    monkeypatch.delenv("LOOPFORMER_REF_TRM", raising=False)
    monkeypatch.delenv("LOOPFORMER_REFS", raising=False)
    (row,) = br.run_model("trm", quick=True)
    assert row.name == "vs_reference.trm" and row.value is None and row.met is None
    assert "LOOPFORMER_REF_TRM" in row.reason and "skipped" in row.reason
    assert row.details["commit"] == br.REFS["trm"]["commit"]


def test_bad_reference_folder_is_reported(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("LOOPFORMER_REF_TRM", str(tmp_path))  # no models/common.py there either
    with pytest.raises(RuntimeError, match="fprm pair failed.*models/common.py is missing"):
        br.run_model_at("fprm", tmp_path, quick=True)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["fprm", "trm", "hrm", "attractor"])
def test_quick_pair_runs_against_the_checkout(model: str) -> None:
    if br.find_reference(model) is None:
        pytest.skip(f"no {model} checkout (LOOPFORMER_REF_{model.upper()} / LOOPFORMER_REFS)")
    rows = br.run_model(model, quick=True)
    assert [r.name for r in rows] == [f"vs_reference.{model}", f"vs_reference.{model}_eval"]
    for r in rows:
        assert r.value is not None and 0.05 < r.value < 20, r
    params = rows[0].details["params"]
    assert abs(params["loopformer"] - params["reference"]) / params["reference"] < 0.01  # same matrices


def test_profile_step_reports_the_top_operators_per_step() -> None:
    a = torch.randn(64, 64)

    def step() -> None:
        (a @ a).relu_()

    prof = br.profile_step(step, steps=3, top=5)
    mm_ms, mm_calls = prof["top_ops_ms_calls"]["aten::mm"]
    assert mm_calls == 1.0 and 0 < mm_ms <= prof["total_ms"]
    assert prof["top_ops_ms_calls"]["aten::relu_"][1] == 1.0
