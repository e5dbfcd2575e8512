"""``loopformer sweep`` and ``loopformer compare`` (issue 25): a tiny Sudoku FPRM swept over two
evaluation solvers and two learning rates, resumed, compared (table + PNG plots); ``eval --variant``;
provenance records and report titles naming the solver, halting rule, tolerance and cap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from PIL import Image

from loopformer.cli import cli
from loopformer.commands.sweep import grid_points, parse_grid, split_values

TINY = {
    "base": "sudoku4_fprm",
    "model": {"d_model": 16, "n_heads": 2, "n_layers": 1},
    "data": {"train_size": 16, "eval_size": 6, "train_generate": {"min_blanks": 4, "max_blanks": 8},
             "eval_generate": {"min_blanks": 4, "max_blanks": 8}},
    "train": {"steps": 3, "batch_size": 8, "max_segments": 2, "progress": False, "log_every": 1, "threads": 1,
              "eval_every": 0, "checkpoint_every": 0},
    "loop_train": {"max_steps": 2, "grad_steps": 2},
    "loop_eval": {"max_steps": 8},
    "eval": {"batch_size": 16},
    "device": "cpu",
}  # fmt: skip


def test_grid_parsing() -> None:
    assert split_values("a,[1,2],'x,y'") == ["a", "[1,2]", "'x,y'"]
    axes, fixed = parse_grid(["loop_eval.solver=damped,anderson", "train.lr=1e-3,3e-4", "train.betas=[0.9,0.95]",
                              "~model.conv"])  # fmt: skip
    assert axes == {"loop_eval.solver": ["damped", "anderson"], "train.lr": ["1e-3", "3e-4"]}
    assert fixed == ["train.betas=[0.9,0.95]", "~model.conv"]
    points = grid_points(axes, fixed)
    assert len(points) == 4 and len({p.name for p in points}) == 4
    # evaluation-only axes share their training run
    assert len({p.run for p in points}) == 2 and {p.report for p in points} == {
        "eval-solver=damped",
        "eval-solver=anderson",
    }
    assert all("loop_eval.solver" not in " ".join(p.train) for p in points)


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sweep")
    recipe = folder / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(TINY))
    out = folder / "grid"
    args = ["sweep", str(recipe), "loop_eval.solver=damped,anderson", "train.lr=1e-3,2e-3", "-o", str(out),
            "--max-steps", "1,2"]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    again = CliRunner().invoke(cli, args)  # resumable: nothing is trained or evaluated twice
    assert again.exit_code == 0, again.output
    assert again.output.count("finished earlier") == 4 and again.output.count("written earlier") == 4
    return out


def test_sweep_runs_the_grid_and_writes_the_comparison(swept: Path) -> None:
    runs = sorted(p.name for p in swept.iterdir() if (p / "summary.json").is_file())
    assert runs == ["lr=1e-3", "lr=2e-3"]  # two training runs; the solvers only change evaluation
    table = json.loads((swept / "compare" / "comparison.json").read_text())
    rows = {r["name"]: r for r in table["rows"]}
    assert set(rows) == {f"solver={s},lr={lr}" for s in ("damped", "anderson") for lr in ("1e-3", "2e-3")}
    for name, row in rows.items():
        solver = name.split(",")[0].split("=")[1]
        assert row["loop"].startswith(f"{solver} solver · residual halting tol 0.1 · cap 8"), row["loop"]
        assert 0 <= row["valid_accuracy"] <= 1 and 1 <= row["mean_loops"] <= 8
        assert row["parameters"] > 0 and row["test_time_compute"] == pytest.approx(row["mean_loops"] * 1)
        assert row["ms_per_example"] > 0
    markdown = (swept / "compare" / "comparison.md").read_text()
    assert (
        "| run | loop | valid |" in markdown
        and "![accuracy vs loop budget](plots/accuracy_vs_budget.png)" in markdown
    )
    for name in ("accuracy_vs_budget.png", "loops_vs_difficulty.png"):
        with Image.open(swept / "compare" / "plots" / name) as image:
            assert image.size[0] > 500 and image.size[1] > 300


def test_provenance_is_recorded_and_quoted(swept: Path) -> None:
    records = json.loads((swept / "lr=1e-3" / "provenance.json").read_text())["records"]
    assert len(records) == 1  # the second sweep trained nothing
    record = records[0]
    assert record["torch"] and record["python"] and record["threads"] == 1 and record["device"] == "cpu"
    assert record["step"] == 0 and not record["resumed"] and record["started"].endswith("Z")
    report = swept / "lr=1e-3" / "eval-solver=anderson"
    metrics = json.loads((report / "metrics.json").read_text())
    assert metrics["provenance"]["training"] == record
    text = (report / "report.md").read_text()
    assert f"torch {record['torch']}" in text.split("\n## ")[0]
    assert text.startswith("# fprm · anderson solver · residual halting tol 0.1 · cap 8: evaluation of")


def test_compare_command_and_a_baseline_line(swept: Path, tmp_path: Path) -> None:
    base_report = swept / "lr=1e-3" / "eval-solver=damped"
    baseline = tmp_path / "baseline"  # a model without a loop: drawn as a horizontal line
    baseline.mkdir()
    metrics = json.loads((base_report / "metrics.json").read_text())
    model = metrics["models"]["fprm"]
    metrics["models"] = {
        "transformer": {**model, "baseline": True, "loop": {**model["loop"], "max_steps": 1}}
    }
    metrics["results"] = {"transformer": metrics["results"]["fprm"]}
    (baseline / "metrics.json").write_text(json.dumps(metrics))
    out = tmp_path / "cmp"
    result = CliRunner().invoke(cli, ["compare", str(swept / "lr=1e-3"), str(base_report), str(baseline),
                                      "-o", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = json.loads((out / "comparison.json").read_text())["rows"]
    assert [r["baseline"] for r in rows] == [False, False, True]
    # a run folder stands for its newest report; a sweep's reports are named by their points
    assert [r["name"] for r in rows[:2]] == ["solver=anderson,lr=1e-3", "solver=damped,lr=1e-3"]
    assert (out / "plots" / "accuracy_vs_budget.png").is_file()
    refused = CliRunner().invoke(cli, ["compare", str(base_report), "-o", str(out)])
    assert refused.exit_code != 0 and "not empty" in refused.output  # output_folder rules


def test_eval_variants_compare_in_one_report(swept: Path, tmp_path: Path) -> None:
    out = tmp_path / "variants"
    result = CliRunner().invoke(cli, ["eval", str(swept / "lr=1e-3"), "--no-analyses", "-o", str(out),
                                      "--variant", "loop_eval.solver=anderson",
                                      "--variant", "loop_eval.halting=fixed loop_eval.max_steps=3"])  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = json.loads((out / "comparison.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["loop_eval", "solver=anderson", "halting=fixed,max_steps=3"]
    assert (
        rows[2]["loop"] == "damped solver · fixed halting (no tolerance) · cap 3"
        and rows[2]["mean_loops"] == 3
    )
    assert len(list((out / "variants").glob("*/report.md"))) == 3
    bad = CliRunner().invoke(cli, ["eval", str(swept / "lr=1e-3"), "--variant", "train.lr=1"])
    assert bad.exit_code != 0 and "loop_eval.* or eval.*" in bad.output
