"""Issue 24, one validation path: ``eval``, ``solve``, ``run`` and ``push`` check their overrides and options
exactly as ``train`` does (``loopformer.config.checks`` runs ``train``'s ``validate`` on a trained run's
config): negative counts, zero segments, a task other than the model's, sizes that cannot fit in memory,
each one line naming the key or option, before any weights are read or folders written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from reliability_common import PUZZLE, fails_cleanly, newest_checkpoint, rewrite_manifest, tiny_recipe

from loopformer.cli import cli
from loopformer.config import build_config

HUGE = "1000000000000"  # rows / batch entries: far more than any machine's memory


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a tiny trained run, its recipe file)."""
    from loopformer.train.trainer import Trainer

    root = tmp_path_factory.mktemp("validated")
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(), sort_keys=False))
    Trainer(build_config({**tiny_recipe(), "out_dir": str(root / "run")})).fit()
    return root / "run", recipe


@pytest.fixture
def no_weights_read(monkeypatch):
    """Fail the test if a checkpoint's weights are read: the checks must come first."""
    import loopformer.runs.load

    def refuse(*args, **kwargs):
        raise AssertionError("weights were read before the overrides were checked")

    monkeypatch.setattr(loopformer.runs.load, "load_stored_weights", refuse)


# (command arguments after the run / recipe, what the one-line message must name)
EVAL_CASES = [
    (["-s", "eval.segments=0"], "eval.segments must be >= 1"),
    (["-s", "eval.batch_size=-1"], "eval.batch_size must be >= 1"),
    (["-s", "data.eval_size=-3"], "data.eval_size must be >= 0"),
    (["-s", "data.task=maze"], "data.task='maze': the model was trained on task 'sudoku'"),
    (["-s", f"eval.batch_size={HUGE}"], f"eval.batch_size={HUGE}"),
    (["-s", f"data.eval_size={HUGE}"], f"data.eval_size={HUGE}"),
    (["-s", "data.options={size: 9}"], "data.options"),
    (["-s", "loop_eval.max_steps=0"], "max_steps must be an integer >= 1"),
    (["-s", "train.lr=1"], "'train.lr=1': evaluation can only change"),
    (["-s", "data.eval_generate={bogus: 1}"], "data.eval_generate.bogus"),
    (["-t", "bogus=1"], "data.eval_generate.bogus"),
    (["-n", "-5"], "--examples must be an integer >= 0"),
    (["--lens-loops", "-1"], "--lens-loops must be an integer >= 0"),
]


@pytest.mark.parametrize(("args", "needle"), EVAL_CASES, ids=[" ".join(a) for a, _ in EVAL_CASES])
def test_eval_checks_overrides_and_options_before_reading_weights(
    trained, no_weights_read, args, needle
) -> None:
    run, _ = trained
    before = sorted(p.name for p in run.iterdir())
    fails_cleanly(CliRunner().invoke(cli, ["eval", str(run), "--no-analyses", *args]), needle)
    assert sorted(p.name for p in run.iterdir()) == before  # no report folder, nothing written


SOLVE_CASES = [
    (["maze", PUZZLE], "task 'maze': the model was trained on task 'sudoku'"),
    (["sudokoo", PUZZLE], "no known task"),
    (["sudoku", PUZZLE, "--max-steps", "0"], "--max-steps must be an integer >= 1"),
    (["sudoku", PUZZLE, "--max-steps", "-4"], "--max-steps must be an integer >= 1"),
    (["sudoku", PUZZLE, "--puzzle-id", "-1"], "--puzzle-id must be an integer >= 0"),
]


@pytest.mark.parametrize(
    ("args", "needle"), SOLVE_CASES, ids=[" ".join(a[2:] or a[:1]) for a, _ in SOLVE_CASES]
)
def test_solve_checks_its_task_and_options_before_reading_weights(
    trained, no_weights_read, args, needle
) -> None:
    run, _ = trained
    fails_cleanly(CliRunner().invoke(cli, ["solve", *args, "-c", str(run)]), needle)


# overrides refused by train and by run (the looped model and its baseline are built with train's checks)
TRAIN_CASES = [
    ("eval.segments=0", "eval.segments must be >= 1"),
    ("train.steps=-1", "train.steps must be >= 1"),
    ("train.max_segments=0", "train.max_segments must be >= 1"),
    ("data.task=nope", "data.task: unknown task 'nope'"),
    (f"train.batch_size={HUGE}", f"train.batch_size={HUGE}"),
    (f"data.train_size={HUGE}", f"data.train_size={HUGE}"),
    ("model.d_model=1048576", "model.d_model=1048576"),
]
RUN_ONLY = [
    ("run.budgets=[4, 0]", "run.budgets[1] must be an integer >= 1"),
    ("run.lens_loops=-1", "run.lens_loops must be an integer >= 0"),
    ("run.signal_loops=-2", "run.signal_loops must be an integer >= 0"),
    ("run.analysis_examples=0", "run.analysis_examples must be an integer >= 1"),
    ("baseline.train.steps=-1", "train.steps must be >= 1"),
    ("baseline.data.options={size: 9}", "the baseline is evaluated on the looped model's task 'sudoku'"),
]


@pytest.mark.parametrize(
    ("override", "needle"), TRAIN_CASES + RUN_ONLY, ids=[o for o, _ in TRAIN_CASES + RUN_ONLY]
)
def test_run_checks_overrides_before_claiming_a_folder(
    trained, tmp_path, monkeypatch, override, needle
) -> None:
    _, recipe = trained
    monkeypatch.chdir(tmp_path)  # `run` without -o would create runs/<timestamp> here
    extra = ["model.n_heads=1"] if override.startswith("model.d_model") else []
    fails_cleanly(CliRunner().invoke(cli, ["run", "-r", str(recipe), override, *extra]), needle)
    assert not (tmp_path / "runs").exists()
    fails_cleanly(CliRunner().invoke(cli, ["run", "-r", str(recipe), "-o", "out", override, *extra]), needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("override", "needle"), TRAIN_CASES, ids=[o for o, _ in TRAIN_CASES])
def test_train_refuses_the_same_overrides(trained, tmp_path, override, needle) -> None:
    _, recipe = trained
    extra = ["model.n_heads=1"] if override.startswith("model.d_model") else []
    fails_cleanly(
        CliRunner().invoke(cli, ["train", str(recipe), "-o", str(tmp_path / "r"), override, *extra]), needle
    )
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("override", ["eval.segments=0", "eval.batch_size=0", "data.eval_size=-3",
                                      "eval.max_examples=-1", "data.eval_generate={bogus: 1}"])  # fmt: skip
def test_eval_and_train_give_the_same_message(trained, tmp_path, override) -> None:
    run, recipe = trained
    by_train = CliRunner().invoke(cli, ["train", str(recipe), "-o", str(tmp_path / "r"), override])
    by_eval = CliRunner().invoke(cli, ["eval", str(run), "-s", override, "--no-analyses"])
    assert fails_cleanly(by_train).strip() == fails_cleanly(by_eval).strip()


def _tampered(run: Path, dest: Path, change) -> Path:
    """A copy of ``run`` whose newest checkpoint's config.json went through ``change`` (manifest rewritten)."""
    shutil.copytree(run, dest)
    folder = newest_checkpoint(dest)
    path = folder / "config.json"
    path.write_text(change(path.read_text()))
    rewrite_manifest(folder)
    return dest


def _segments_zero(text: str) -> str:
    data = json.loads(text)
    data["eval"]["segments"] = 0
    return json.dumps(data)


def test_push_checks_the_run_config_and_its_repo_id_before_writing(trained, tmp_path) -> None:
    run, _ = trained
    dest = tmp_path / "pushed"
    fails_cleanly(
        CliRunner().invoke(cli, ["push", str(run), "no-slash", "--to-folder", str(dest)]), "owner/name"
    )
    bad = _tampered(run, tmp_path / "bad", _segments_zero)
    fails_cleanly(
        CliRunner().invoke(cli, ["push", str(bad), "me/x", "--to-folder", str(dest)]), "eval.segments"
    )
    broken = _tampered(run, tmp_path / "broken", lambda text: text[: len(text) // 2])
    fails_cleanly(
        CliRunner().invoke(cli, ["push", str(broken), "me/x", "--to-folder", str(dest)]), "config.json"
    )
    assert not dest.exists()
    # eval and solve read the same stored config through the same check
    fails_cleanly(CliRunner().invoke(cli, ["eval", str(bad), "--no-analyses"]), "eval.segments must be >= 1")
    fails_cleanly(
        CliRunner().invoke(cli, ["solve", "sudoku", PUZZLE, "-c", str(bad)]), "eval.segments must be >= 1"
    )
    ok = CliRunner().invoke(cli, ["push", str(run), "me/x", "--to-folder", str(dest)])
    assert ok.exit_code == 0, ok.output


def test_a_valid_eval_override_still_evaluates(trained, tmp_path) -> None:
    run, _ = trained
    result = CliRunner().invoke(cli, ["eval", str(run), "-s", "eval.batch_size=4", "-n", "3", "--no-analyses",
                                      "-o", str(tmp_path / "report")])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (tmp_path / "report" / "metrics.json").is_file() or any((tmp_path / "report").iterdir())


def test_solve_refuses_a_loop_count_whose_trajectory_cannot_fit(trained) -> None:
    run, _ = trained
    result = CliRunner().invoke(cli, ["solve", "sudoku", PUZZLE, "-c", str(run), "--max-steps", HUGE])
    fails_cleanly(result, f"--max-steps {HUGE}", "keeping every loop's answer")
