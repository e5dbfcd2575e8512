"""The front door is true (issue 34): the README and docs/results.md headline what the default job gives
(the numbers of its recorded run, docs/figures/default_run/), and the README's ``solve`` example is a
held-out puzzle of the default job that its model solves (slow: trains the default model).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from loopformer.cli import cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RESULTS = (ROOT / "docs" / "results.md").read_text()
RECORD = json.loads((ROOT / "docs" / "figures" / "default_run" / "summary.json").read_text())


def readme_puzzle() -> str:
    found = re.findall(r'loopformer solve sudoku "([^"]+)"', README)
    assert found and len(set(found)) == 1, found  # one example puzzle, used everywhere in the README
    return found[0]


def test_the_readme_and_results_headline_the_recorded_default_job() -> None:
    fprm, base = f"{100 * RECORD['heldout_accuracy']:.1f}%", f"{100 * RECORD['baseline_accuracy']:.1f}%"
    minutes, seconds = divmod(round(RECORD["wall_time"]), 60)
    default = RESULTS.split("## The default job")[1].split("\n## ")[0]
    assert f"**{fprm}**" in default and f"| {base} |" in default and f"{minutes} min {seconds} s" in default
    quick = README.split("## Quick start")[1].split("\n## ")[0]
    assert fprm in quick and base in quick and f"{minutes} min {seconds} s" in quick and "load" in quick
    first = (ROOT / "recipes" / "default.yaml").read_text().splitlines()[0]
    assert fprm in first and base in first and RECORD["overrides"] == []
    header = " ".join(line[1:].strip() for line in (ROOT / "recipes" / "default.yaml").read_text().splitlines()
                      if line.startswith("#"))  # the recipe's whole text quotes the same run  # fmt: skip
    assert f"FPRM {fprm}" in header and f"transformer {base}" in header and f"{minutes} min {seconds} s" in header


def test_the_readme_quick_check_names_test_files_that_exist() -> None:
    command = re.search(r'python -m pytest -q -m "not slow[^"]*" ([^\n]+)', README)
    assert command, "the README's quick subset of the tests"
    for pattern in command.group(1).split():
        assert list(ROOT.glob(pattern)), pattern


def test_the_readme_solve_example_is_a_held_out_puzzle_of_the_default_job(tmp_path: Path) -> None:
    from loopformer.commands.run import build_run_configs
    from loopformer.runs import run_task, task_dataset

    main, _, _, _ = build_run_configs("default", (), tmp_path)
    task = run_task(main.data)
    held_out = task_dataset(task, main.data, "eval")
    tokens = task.parse_grid(readme_puzzle())
    assert any(np.array_equal(tokens, row) for row in held_out.inputs)
    assert task.count_solutions(tokens) == 1


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_readme_solve_example_is_solved_by_a_trained_default_model(tmp_path: Path) -> None:
    """Trains the default job's looped model as `loopformer run` does (one thread, its 1200 steps: 7.6 min of
    the measured run at load 7.3; far longer on a busier machine), then solves the README's puzzle with it.
    LOOPFORMER_DEFAULT_MODEL=<job>/model uses a model `loopformer run` trained instead, after checking that
    its configuration is the default recipe's."""
    import os

    from loopformer.commands.run import build_run_configs
    from loopformer.config import to_dict
    from loopformer.runs import load_run

    out = (
        Path(os.environ.get("LOOPFORMER_DEFAULT_MODEL", ""))
        if os.environ.get("LOOPFORMER_DEFAULT_MODEL")
        else None
    )
    if out is None:
        out = tmp_path / "model"
        result = CliRunner().invoke(cli, ["train", "default", "-o", str(out), "train.progress=false"])
        assert result.exit_code == 0, result.output
    main, _, _, _ = build_run_configs("default", (), tmp_path / "job")
    trained = load_run(out, device="cpu").config
    for section in ("data", "train", "loop_train", "loop_eval", "seed"):
        assert to_dict(trained)[section] == to_dict(main)[section], section  # the default recipe's model
    solved = CliRunner().invoke(cli, ["solve", "sudoku", readme_puzzle(), "-c", str(out), "--json"])
    assert solved.exit_code == 0, solved.output
    record = json.loads(solved.output)
    assert record["valid"] is True, record


def test_every_readme_python_snippet_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ```python block of the README, executed unchanged; ``runs/<run>`` is a tiny 4x4 Sudoku run
    trained here (a run folder of that very name, so the text needs no substitution)."""
    from loopformer.config import build_config
    from loopformer.train.trainer import Trainer

    snippets = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert len(snippets) >= 2, "the README's Python examples"
    monkeypatch.chdir(tmp_path)
    Trainer(build_config({
        "model": {"name": "fprm", "d_model": 16, "n_heads": 2, "n_layers": 1, "conv": "grid2d"},
        "data": {"task": "sudoku", "options": {"size": 4}, "train_size": 16, "eval_size": 4},
        "train": {"mode": "simple", "steps": 1, "batch_size": 8, "progress": False, "threads": 1},
        "loop_eval": {"max_steps": 4}, "out_dir": "runs/<run>",
    })).fit()  # fmt: skip
    for i, code in enumerate(snippets):
        scope: dict = {}
        exec(compile(code, f"README.md python snippet {i + 1}", "exec"), scope)
        if "sol" in scope:  # the solve example: an answer of the puzzle's size, one entry per loop
            assert len(scope["sol"].trajectory) >= 1 and scope["sol"].steps >= 1
        if "same" in scope:  # the save_pretrained example: the weights came back
            assert all(torch.equal(a, b) for a, b in zip(scope["model"].parameters(), scope["same"].parameters()))
        if "out" in scope:  # the loop-engine example: logits of its 16 cells
            assert tuple(scope["out"].logits.shape[:2]) == (1, 16)
