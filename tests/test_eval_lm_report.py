"""Language models in ``loopformer eval`` and ``compare`` (issue 34): a text run's report with bits per
byte at each loop budget (log2 plot), the logit lens scored as a language model, ``--variant``, and
``compare`` reading LM reports; plus the presentation of reports and comparisons (rows counted in the
title, "one pass", no plot over a single value, console rounding as report.md's).

Oracles: each budget point and each logit-lens loop equals an independent ``evaluate_lm`` at that
exact loop count; the lens at loop t equals the budget curve's fixed point t.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from test_train_gaps import TEXT_RUN

from loopformer.cli import cli
from loopformer.config import build_config
from loopformer.eval.analysis import logit_lens
from loopformer.eval.budget import budget_curve, with_budget
from loopformer.eval.compare import Entry, comparison_title
from loopformer.eval.evaluate import EvalResult, ExampleRecord, evaluate_lm
from loopformer.eval.report import describe_loop
from loopformer.runs import eval_dataset, load_run
from loopformer.train import Trainer

LOOPED_TEXT = {**TEXT_RUN, "model": {"name": "recurrent", "d_model": 16, "n_heads": 2, "n_layers": 1}}


@pytest.fixture(scope="module")
def looped_text_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("looped_text")
    Trainer(build_config({**LOOPED_TEXT, "out_dir": str(out / "run")})).fit()
    return out / "run"


def test_eval_of_a_text_run_writes_bits_per_byte_vs_budget(looped_text_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "ev"
    result = CliRunner().invoke(cli, ["eval", str(looped_text_run), "--max-steps", "1,2,4,8", "-o", str(out)])
    assert result.exit_code == 0, result.output
    text = (out / "report.md").read_text()
    assert "## Bits per byte vs loop budget: recurrent (capped)" in text
    assert "![bits per byte vs loop budget](plots/bpb_vs_budget.png)" in text
    assert (out / "plots" / "bpb_vs_budget.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "plots" / "logit_lens.png").is_file() and (out / "plots" / "state_norms.png").is_file()
    metrics = json.loads((out / "metrics.json").read_text())
    assert (
        metrics["kind"] == "lm"
        and metrics["bits_per_byte"] == metrics["results"]["recurrent"]["bits_per_byte"]
    )
    points = metrics["budget"]["recurrent"]["points"]
    # budget 8 is above the evaluation loop's cap (4): the capped table stops at the cap and says so
    assert [p["budget"] for p in points] == [1, 2, 4]
    assert "Step budgets 8 exceed the evaluation loop's cap (4 steps)" in text
    run = load_run(looped_text_run, use_ema=False)  # oracle: evaluate_lm at each budget, on its own
    data = eval_dataset(run.task, run.config)
    for p in points:
        want = evaluate_lm(run.model, run.task, data, loop=with_budget(run.loop_eval, p["budget"], "capped"),
                           batch_size=run.config.eval.batch_size, seed=run.config.seed)  # fmt: skip
        assert p["bits_per_byte"] == pytest.approx(want.bits_per_byte, rel=1e-6)
        assert f"| {p['budget']} | {want.bits_per_byte:.4f} |" in text
    assert "bits per byte vs loop budget (capped): 1: " in result.output


def test_lm_logit_lens_equals_evaluate_lm_at_each_fixed_loop_count(looped_text_run: Path) -> None:
    run = load_run(looped_text_run, use_ema=False)
    data = eval_dataset(run.task, run.config)
    lens = logit_lens(run.model, run.task, data, 5, loop=run.loop_eval, batch_size=5)
    curve = budget_curve(
        run.model, run.task, data, [1, 3, 5], mode="fixed", loop=run.loop_eval, batch_size=7
    )
    for point in curve.points:
        direct = evaluate_lm(
            run.model, run.task, data, loop=with_budget(run.loop_eval, point.budget, "fixed")
        )
        assert lens.bits_per_byte[point.budget - 1] == pytest.approx(direct.bits_per_byte, rel=1e-6)
        assert lens.token_accuracy[point.budget - 1] == pytest.approx(direct.token_accuracy)
        assert point.bits_per_byte == pytest.approx(direct.bits_per_byte, rel=1e-6)
    assert lens.bits_per_byte[2] == pytest.approx(lens.loss[2] / math.log(2))


def test_eval_variants_and_compare_read_lm_reports(looped_text_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "variants"
    result = CliRunner().invoke(cli, ["eval", str(looped_text_run), "--no-analyses", "-o", str(out),
                                      "--variant", "loop_eval.max_steps=2"])  # fmt: skip
    assert result.exit_code == 0, result.output
    table = json.loads((out / "comparison.json").read_text())
    assert [r["name"] for r in table["rows"]] == ["loop_eval", "max_steps=2"]
    assert all(r["bits_per_byte"] > 0 and r["valid_accuracy"] is None for r in table["rows"])
    markdown = (out / "comparison.md").read_text()
    assert "| run | loop | bits per byte | loss |" in markdown and "bpb_vs_budget.png" in markdown
    cmp = tmp_path / "cmp"
    result = CliRunner().invoke(cli, ["compare", str(out / "variants" / "00-loop_eval"),
                                      str(out / "variants" / "01-max_steps=2"), "-o", str(cmp)])  # fmt: skip
    assert result.exit_code == 0, result.output
    title = json.loads((cmp / "comparison.json").read_text())["title"]
    # the rows counted (issue 34) and what they were evaluated on (issue 35's held-out line)
    assert title.startswith("comparison of 2 language models · evaluated on text (seq_len=16), 12 held-out rows ")
    assert (cmp / "plots" / "bpb_vs_budget.png").is_file()


def test_compare_refuses_to_mix_lm_and_validator_reports(looped_text_run: Path, tmp_path: Path) -> None:
    lm = tmp_path / "lm"
    assert (
        CliRunner().invoke(cli, ["eval", str(looped_text_run), "--no-analyses", "-o", str(lm)]).exit_code == 0
    )
    other = tmp_path / "acc"
    other.mkdir()
    metrics = {"results": {"fprm": {"n": 4, "valid_accuracy": 0.5, "exact_accuracy": 0.5, "mean_steps": 3.0}}}
    (other / "metrics.json").write_text(json.dumps(metrics))
    result = CliRunner().invoke(cli, ["compare", str(lm), str(other), "-o", str(tmp_path / "cmp")])
    assert result.exit_code != 0
    assert "cannot compare language-model reports (bits per byte" in result.output
    refused = CliRunner().invoke(
        cli, ["eval", str(looped_text_run), "--auto-solver", "-o", str(tmp_path / "a")]
    )
    assert refused.exit_code != 0 and "--auto-solver needs a task scored by accuracy" in refused.output


def _entry(name: str, source: str, max_steps: int = 8) -> Entry:
    return Entry(name, Path(source), {"valid_accuracy": 0.5, "mean_steps": 2.0},
                 {"loop": {"solver": "picard", "halting": "fixed", "max_steps": max_steps}})  # fmt: skip


def test_comparison_title_counts_rows_and_a_loop_free_model_is_one_pass() -> None:
    rows = [_entry("a: fprm", "a"), _entry("a: transformer", "a", 1), _entry("b", "b"), _entry("c", "c")]
    assert comparison_title(rows, 3) == "comparison of 4 evaluations from 3 reports"
    assert comparison_title(rows[2:], 2) == "comparison of 2 evaluations"
    assert rows[1].row()["loop"] == "one pass" and rows[1].baseline
    assert describe_loop({"solver": "picard", "halting": "fixed", "max_steps": 1}) == "one pass"
    assert describe_loop({"solver": "damped", "halting": "residual", "tol": 0.1, "max_steps": 2}) == (
        "damped solver · residual halting tol 0.1 · cap 2"
    )


def _result(difficulty: list[float], steps: list[int], converged: float = 0.997) -> EvalResult:
    records = [
        ExampleRecord(i, d, s, True, True, True, 1.0) for i, (d, s) in enumerate(zip(difficulty, steps))
    ]
    hist: dict[int, int] = {}
    for s in steps:
        hist[s] = hist.get(s, 0) + 1
    return EvalResult(
        "sudoku", len(steps), 1.0, 1.0, 1.0, float(np.mean(steps)), hist, converged, {}, records
    )


def test_no_plot_over_a_single_value_and_the_report_says_why(tmp_path: Path) -> None:
    from loopformer.eval.budget import steps_vs_difficulty
    from loopformer.eval.report import accuracy_table, write_report
    from loopformer.eval.suite import no_difficulty_plot_reason, no_histogram_reason

    one_difficulty = _result([4.0] * 5, [1, 2, 3, 2, 1])
    assert no_histogram_reason(one_difficulty) is None
    assert "every held-out example has difficulty 4" in no_difficulty_plot_reason(one_difficulty)
    fixed = _result([1.0, 2.0, 3.0], [8, 8, 8])
    assert "every held-out example took 8 loop steps" in no_histogram_reason(fixed)
    assert "every example took 8 loop steps" in no_difficulty_plot_reason(fixed)
    stats = steps_vs_difficulty(one_difficulty.difficulty, one_difficulty.steps)
    assert math.isnan(stats.spearman_rho)
    report, _ = write_report(tmp_path, "t", {"m": one_difficulty}, difficulty={"m": stats},
                             skipped=[no_difficulty_plot_reason(one_difficulty)])  # fmt: skip
    text = report.read_text()
    assert (
        "nan" not in text.lower() and "No rank correlation: the examples have one difficulty value." in text
    )
    assert "No steps-vs-difficulty plot" in text.split("## Plots")[1]
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(accuracy_table({"m": one_difficulty}))  # converged 99.7%, as report.md rounds it
    assert "99.7%" in console.export_text() and "100%" not in console.export_text()


def test_an_eval_of_a_run_jobs_model_draws_that_jobs_baseline(tmp_path: Path) -> None:
    from loopformer.eval.suite import run_job_references

    job = tmp_path / "job"
    (job / "model" / "checkpoints" / "step_00000010").mkdir(parents=True)
    (job / "summary.json").write_text(
        json.dumps({"baseline_model": "transformer", "baseline_accuracy": 0.07})
    )
    ckpt = job / "model" / "checkpoints" / "step_00000010"
    assert run_job_references(ckpt, same_heldout=True) == {
        "baseline (transformer) of this run job, one pass": 0.07
    }
    assert run_job_references(ckpt, same_heldout=False) == {}  # another held-out set: not comparable
    assert run_job_references(tmp_path / "elsewhere", same_heldout=True) == {}
    (job / "summary.json").write_text(json.dumps({"results": {"recurrent": {"bits_per_byte": 2.0},
                                                              "baseline (transformer)": {"bits_per_byte": 2.5}}}))  # fmt: skip
    assert run_job_references(job / "model", same_heldout=True) == {
        "baseline (transformer) of this run job": 2.5
    }
