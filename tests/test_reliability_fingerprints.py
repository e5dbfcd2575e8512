"""Fingerprints decide "same" (issue 35): a checkpoint records the rows it was trained and evaluated on, a
report records its task, task options and held-out set, and what claims to be the same is checked.

Cases: a resume after the training data file was regenerated continued on other data; ``compare`` put
reports of two held-out sets in one table without a word, dropped a sweep point without a report
silently, and never named the task; a sweep rerun with ``--max-steps`` kept the old reports while
``sweep.json`` claimed the new budgets; ``eval --variant eval.max_examples=4`` evaluated every example; a
generated training set and held-out set of one seed and one set of generator options (the same puzzles)
trained without a word. Only the CLI and files on disk are used.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from reliability_common import cli_text, fails_cleanly, tiny_recipe

from loopformer.cli import cli


def _ok(args: list[str]) -> str:
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, cli_text(result)[-600:]
    return cli_text(result)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(the recipe, a swept folder, its run)."""
    root = tmp_path_factory.mktemp("fingerprints")
    recipe = root / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(train={"steps": 1, "eval_every": 0})))
    _ok(["sweep", str(recipe), "loop_eval.max_steps=2,3", "-o", str(root / "s")])
    return recipe, root / "s", root / "s" / "run"


def test_a_resume_on_a_regenerated_data_file_is_refused(tmp_path) -> None:
    data = tmp_path / "train.csv"
    generate = ["data", "generate", "sudoku", "--size", "4", "--count", "16", "-o", str(data)]
    _ok([*generate, "--seed", "0"])
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(data={"train_path": str(data)}, train={"eval_every": 0})))
    run = tmp_path / "run"
    _ok(["train", str(recipe), "-o", str(run)])
    _ok([*generate, "--seed", "1", "--overwrite"])  # the file is regenerated in place: other puzzles
    fails_cleanly(
        CliRunner().invoke(cli, ["train", str(recipe), "-o", str(run), "--resume", "train.steps=3"]),
        "data.train",
        "--allow-config-change",
    )
    _ok(["train", str(recipe), "-o", str(run), "--resume", "train.steps=3", "--allow-config-change"])
    changes = [json.loads(line) for line in (run / "config_changes.jsonl").read_text().splitlines()]
    assert any("data.train (rows)" in c["changes"] for c in changes)


def test_compare_refuses_reports_of_different_held_out_sets_unless_allowed(setup, tmp_path) -> None:
    _, _, run = setup
    one, two = tmp_path / "one", tmp_path / "two"
    _ok(["eval", str(run), "--no-analyses", "-o", str(one)])
    _ok(["eval", str(run), "--no-analyses", "-o", str(two), "-s", "data.eval_seed=7"])
    fails_cleanly(
        CliRunner().invoke(cli, ["compare", str(one), str(two), "-o", str(tmp_path / "c")]), "held-out"
    )
    assert not (tmp_path / "c").exists()
    _ok(["compare", str(one), str(two), "-o", str(tmp_path / "c"), "--allow-different-heldout"])
    title = (tmp_path / "c" / "comparison.md").read_text().splitlines()[0]
    assert "NOT ONE HELD-OUT SET" in title, title


def test_compare_names_the_task_and_the_sweep_points_without_a_report(setup, tmp_path) -> None:
    _, sweep, _ = setup
    copy = tmp_path / "s"
    shutil.copytree(sweep, copy)
    shutil.rmtree(copy / "run" / "eval-max_steps=3")
    text = _ok(["compare", str(copy), "-o", str(tmp_path / "c")])
    assert "max_steps=3" in text and "no report" in text.lower(), text
    table = (tmp_path / "c" / "comparison.md").read_text()
    assert "sudoku" in table.splitlines()[0] and "max_steps=3" in table


def test_a_sweep_rerun_with_other_budgets_evaluates_again(setup, tmp_path) -> None:
    recipe, sweep, _ = setup
    copy = tmp_path / "s"
    shutil.copytree(sweep, copy)
    _ok(["sweep", str(recipe), "loop_eval.max_steps=2,3", "-o", str(copy), "--max-steps", "1,2"])
    recorded = json.loads((copy / "sweep.json").read_text())["max_steps"]
    for report in ("eval-max_steps=2", "eval-max_steps=3"):
        metrics = json.loads((copy / "run" / report / "metrics.json").read_text())
        budgets = [p["budget"] for curve in metrics.get("budget", {}).values() for p in curve["points"]]
        assert budgets == recorded == [1, 2], (report, budgets, recorded)


def test_eval_variant_honours_every_key_it_names(setup, tmp_path) -> None:
    _, _, run = setup
    out = tmp_path / "v"
    _ok(["eval", str(run), "--no-analyses", "-o", str(out), "--variant", "eval.max_examples=4"])
    counts = sorted(
        next(iter(json.loads((folder / "metrics.json").read_text())["results"].values()))["n"]
        for folder in (out / "variants").iterdir()
    )
    assert counts == [4, 6], counts  # the run's own loop on all 6 examples, the variant on 4
    fails_cleanly(
        CliRunner().invoke(
            cli, ["eval", str(run), "-o", str(tmp_path / "w"), "--variant", "eval.use_ema=false"]
        ),
        "eval.use_ema",
    )


def test_a_held_out_set_drawn_like_the_training_set_is_refused(setup, tmp_path) -> None:
    recipe = setup[0]
    fails_cleanly(
        CliRunner().invoke(cli, ["train", str(recipe), "-o", str(tmp_path / "r"), "data.eval_seed=0"]),
        "data.train_seed",
        "data.eval_seed",
    )
    assert not (tmp_path / "r").exists()
