"""``LOOPFORMER_INFERENCE_ROWS=sudoku4 python -m benchmarks --only inference`` (benchmarks/bench_inference.py):
the 4x4 row alone, the 9x9 rows of the results file kept by the merge; any other selection is refused."""

from __future__ import annotations

import pytest

from benchmarks import bench_inference
from benchmarks.__main__ import merge


def test_a_bad_row_selection_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(bench_inference.ROWS_ENV, "sudoku9")
    with pytest.raises(ValueError, match="the only row selection is 'sudoku4'"):
        bench_inference.run(quick=True)


def test_the_4x4_row_alone_keeps_the_9x9_rows() -> None:
    assert bench_inference.MERGE_BY_NAME
    old = [{"benchmark": "inference", "name": f"inference.fprm_vs_reference.seed{s}", "value": s} for s in (0, 2)]
    old.append({"benchmark": "inference", "name": "inference.fprm_vs_reference_sudoku4", "value": 0.7})
    new = [{"benchmark": "inference", "name": "inference.fprm_vs_reference_sudoku4", "value": 0.6}]
    merged = merge(old, new, ["inference"], frozenset({"inference"}))
    assert {r["name"]: r["value"] for r in merged} == {
        "inference.fprm_vs_reference.seed0": 0,
        "inference.fprm_vs_reference.seed2": 2,
        "inference.fprm_vs_reference_sudoku4": 0.6,
    }
