"""Issue 24, resume is safe: another run's checkpoint never continues under this run's step names (a
branch into an empty folder records where it came from), a resume whose only checkpoint is corrupt
stops with an error naming the file, and a resume whose config changes the training stream is refused
unless ``--allow-config-change``, which records the change.

Only the ``loopformer`` CLI and files on disk are used, so that ``tools/reliability_before_after.py``
runs these tests unchanged against the code from before this work."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner
from reliability_common import cli_text, fails_cleanly, newest_checkpoint, tiny_recipe

from loopformer.cli import cli


def _files(folder) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".loopformer.lock"
    }


def _train(recipe, run, *args: str):
    return CliRunner().invoke(cli, ["train", str(recipe), f"out_dir={run}", *args])


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("resume") / "recipe.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(), sort_keys=False))
    return path


@pytest.fixture(scope="module")
def trained(recipe, tmp_path_factory: pytest.TempPathFactory):
    """A finished 2-step run (its one checkpoint: step 2), copied by the tests that change it."""
    run = tmp_path_factory.mktemp("trained") / "run"
    result = _train(recipe, run)
    assert result.exit_code == 0, cli_text(result)
    return run


def _copy(run, dest):
    import shutil

    shutil.copytree(run, dest)
    return dest


def test_resume_from_another_runs_checkpoint_into_this_run_is_refused(recipe, trained, tmp_path) -> None:
    other = _copy(trained, tmp_path / "other")
    mine = _copy(trained, tmp_path / "mine")
    before, before_other = _files(mine), _files(other)
    step = newest_checkpoint(other)
    result = _train(recipe, mine, f"train.resume={step}", "train.steps=4")
    fails_cleanly(result, str(step), "another run", "train.resume=true")
    assert _files(mine) == before and _files(other) == before_other  # nothing written anywhere


def test_resume_from_another_runs_checkpoint_into_a_new_folder_records_its_origin(
    recipe, trained, tmp_path
) -> None:
    other = _copy(trained, tmp_path / "other")
    before_other = _files(other)
    branch = tmp_path / "branch"
    step = newest_checkpoint(other)
    result = _train(recipe, branch, f"train.resume={step}", "train.steps=4")
    assert result.exit_code == 0, cli_text(result)
    origin = json.loads((branch / "origin.json").read_text())
    assert origin["checkpoint"] == str(step.resolve()) and origin["step"] == 2
    assert origin["run"] == str(other.resolve())
    assert [p.name for p in sorted((branch / "checkpoints").glob("step_*"))] == ["step_00000004"]
    assert _files(other) == before_other


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_resume_whose_only_checkpoint_is_corrupt_stops_naming_it(recipe, trained, tmp_path, how) -> None:
    run = _copy(trained, tmp_path / "run")
    weights = newest_checkpoint(run) / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if how == "truncated" else b"\0" * len(data))
    before = _files(run)
    result = _train(recipe, run, "--resume", "train.steps=4")
    fails_cleanly(result, str(weights), "no usable checkpoint")
    assert _files(run) == before  # not restarted from scratch: the metrics and checkpoint are as they were


@pytest.mark.parametrize(
    "change",
    ["seed=7", "data.train_size=24", "data.train_seed=3", "train.lr=0.01", "train.batch_size=4",
     "model.d_model=32", "data.train_generate={min_blanks: 5, max_blanks: 8}", "train.mode=simple"],
)  # fmt: skip
def test_resume_with_a_config_that_changes_the_stream_is_refused(recipe, trained, tmp_path, change) -> None:
    run = _copy(trained, tmp_path / "run")
    before = _files(run)
    result = _train(recipe, run, "--resume", "train.steps=4", change)
    key = change.split("=", 1)[0]
    text = fails_cleanly(result, "--allow-config-change")
    assert key.split("{")[0] in text or key in text, text
    assert _files(run) == before


def test_allow_config_change_resumes_and_records_the_change(recipe, trained, tmp_path) -> None:
    run = _copy(trained, tmp_path / "run")
    result = _train(
        recipe, run, "--resume", "train.steps=4", "seed=7", "train.lr=0.002", "--allow-config-change"
    )
    assert result.exit_code == 0, cli_text(result)
    lines = (run / "config_changes.jsonl").read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["step"] == 2 and record["checkpoint"].endswith("step_00000002")
    assert record["changes"] == {"seed": {"old": 0, "new": 7}, "train.lr": {"old": 0.001, "new": 0.002}}
    assert (run / "checkpoints" / "step_00000004").is_dir()
    again = _train(recipe, run, "--resume", "train.steps=6", "seed=7", "train.lr=0.002")
    assert again.exit_code == 0, cli_text(again)  # the step-4 checkpoint carries the new config


def test_resume_with_only_cadence_and_length_changes_needs_no_flag(recipe, trained, tmp_path) -> None:
    run = _copy(trained, tmp_path / "run")
    changes = ["train.steps=4", "train.log_every=2", "train.eval_every=1", "train.keep_checkpoints=5",
               "train.threads=1", "train.checkpoint_every=1", "eval.batch_size=8"]  # fmt: skip
    result = _train(recipe, run, "--resume", *changes)
    assert result.exit_code == 0, cli_text(result)
    assert not (run / "config_changes.jsonl").exists()


def test_what_a_checkpoint_records_beside_the_config_is_no_config_change() -> None:
    """config.json also holds family, step and the plug-in modules that define the model (a plug-in run's
    checkpoint lists them); none of them is a config key, so none blocks a resume of that run."""
    from loopformer.config import RunConfig, config_to_json
    from loopformer.runs.folder import config_changes

    config = RunConfig()
    saved = {**json.loads(config_to_json(config)), "family": "fprm", "step": 2, "plugins": ["my_plugins"]}
    assert config_changes(saved, config) == {}
    changed = {**saved, "seed": 7}
    assert set(config_changes(changed, config)) == {"seed"}
