"""Plots and reports: every figure is a real PNG, report.md tables and metrics.json carry the numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from loopformer.eval import plots
from loopformer.eval.analysis import LoopCurve, SignalCurve
from loopformer.eval.budget import BudgetCurve, BudgetPoint, steps_vs_difficulty
from loopformer.eval.evaluate import EvalResult, ExampleRecord
from loopformer.eval.report import to_jsonable, write_report

PNG = b"\x89PNG\r\n\x1a\n"


def _result() -> EvalResult:
    rng = np.random.default_rng(0)
    records = [
        ExampleRecord(i, float(d), int(d // 2 + rng.integers(0, 3)), bool(i % 3), bool(i % 2), bool(i % 2), 0.5)
        for i, d in enumerate(rng.integers(4, 12, size=40))
    ]
    return EvalResult("sudoku", 40, 0.5, 0.75, 0.5, float(np.mean([r.steps for r in records])),
                      {3: 10, 4: 30}, 0.66, {"halting": "residual"}, records)


def test_plots_and_report(tmp_path: Path) -> None:
    res = _result()
    curve = BudgetCurve("capped", [BudgetPoint(b, min(1.0, 0.1 * b), 0.1 * b, 0.5, float(b), 0.5) for b in (1, 2, 4)])
    lens = LoopCurve([1, 2, 3], [0.2, 0.5, 0.6], [0.0, 0.1, 0.2], [0.0, 0.1, 0.25], [-1.0, 0.5, 1.5],
                     [3.0, 1.0, 0.0], [0.0, 0.5, 1.0], train_depth=2)
    sig = SignalCurve([1, 2, 3], [1.0, 0.9, 0.9], [3.0, 1.0, 0.1], [1.0, 0.2, 0.01], 6.0)
    paths = {
        "budget": plots.save_figure(plots.plot_budget_curve({"fprm": curve}), tmp_path / "p" / "budget.png"),
        "hist": plots.save_figure(plots.plot_steps_histogram(res), tmp_path / "p" / "hist.png"),
        "scatter": plots.save_figure(plots.plot_steps_vs_difficulty(res), tmp_path / "p" / "scatter.png"),
        "lens": plots.save_figure(plots.plot_loop_accuracy(lens), tmp_path / "p" / "lens.png"),
        "over": plots.save_figure(plots.plot_overthinking(lens), tmp_path / "p" / "over.png"),
        "bridge": plots.save_figure(plots.plot_bridge_rank(lens), tmp_path / "p" / "bridge.png"),
        "norms": plots.save_figure(plots.plot_state_norms(sig), tmp_path / "p" / "norms.png"),
    }
    for p in paths.values():
        assert p.read_bytes()[:8] == PNG
    stats = steps_vs_difficulty(res.difficulty, res.steps, res.valid)
    report, metrics = write_report(tmp_path, "t", {"fprm": res}, budget={"fprm": curve}, difficulty={"fprm": stats},
                                   lens=lens, signal=sig, spectral={"mean": 0.9}, plots=paths)
    text = report.read_text()
    assert "| fprm | 40 | 50.0% | 50.0% | 75.0% |" in text
    assert "![lens](p/lens.png)" in text
    assert f"Spearman rho = {stats.spearman_rho:.3f}" in text
    data = json.loads(metrics.read_text())
    assert data["results"]["fprm"]["valid_accuracy"] == 0.5
    assert data["logit_lens"]["bridge_rank"] == [3.0, 1.0, 0.0]
    assert data["budget"]["fprm"]["points"][2]["budget"] == 4


def test_to_jsonable_handles_numpy_and_nan() -> None:
    out = to_jsonable({"a": np.float32(1.5), "b": np.arange(3), "c": math.nan, "d": (1, np.int64(2))})
    assert out == {"a": 1.5, "b": [0, 1, 2], "c": None, "d": [1, 2]}
    json.dumps(out)
