"""Issue 24, every folder-writing command follows the run-folder rules: ``push --to-folder``, ``eval -o``,
``convert --out`` and ``data prepare -o`` refuse a folder that holds something unless ``--overwrite``,
build the new content aside and swap it in whole (a failure leaves the old content untouched), never
replace a training run, and nothing (``train -o`` included) writes inside another run's folder."""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner
from reliability_common import cli_text, fails_cleanly, tiny_recipe

from loopformer.cli import cli
from loopformer.runs.folder import LOCK_NAME, STAGING_PREFIX, RunFolderError, staged_output


def _files(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_staged_output_refuses_then_replaces_whole_and_a_failure_changes_nothing(tmp_path) -> None:
    out = tmp_path / "out"
    with staged_output(out, "prepare", overwrite=False) as tmp:
        (tmp / "train").mkdir()
        (tmp / "train" / "dataset.json").write_text("{}")
        (tmp / "old-only.txt").write_text("v1")
        assert not (out / "train").exists()  # nothing visible before the block ends
    before = _files(out)
    assert set(before) == {"train/dataset.json", "old-only.txt"}
    with pytest.raises(RunFolderError, match=r"is not empty \(old-only.txt, train\).*--overwrite"):
        with staged_output(out, "prepare", overwrite=False):
            pass
    with pytest.raises(RuntimeError, match="killed half-way"):
        with staged_output(out, "prepare", overwrite=True) as tmp:
            (tmp / "train").mkdir()
            raise RuntimeError("killed half-way")
    assert _files(out) == before and not list(out.glob(f"{STAGING_PREFIX}*"))
    (out / f"{STAGING_PREFIX}prepare-dead").mkdir()  # what a SIGKILLed command leaves
    with staged_output(out, "prepare", overwrite=True) as tmp:
        (tmp / "train").mkdir()
        (tmp / "train" / "dataset.json").write_text('{"new": 1}')
    assert _files(out) == {"train/dataset.json": b'{"new": 1}'}  # the new dataset, whole; the old one removed
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]  # no staging / replaced folder left beside it
    assert not (out / LOCK_NAME).exists() and not list(out.glob(f"{STAGING_PREFIX}*"))


def test_staged_output_never_replaces_a_training_run_nor_writes_in_its_checkpoints(tmp_path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunFolderError, match="holds a training run"):
        with staged_output(run, "push", overwrite=True, option="--to-folder"):
            pass
    with pytest.raises(RunFolderError, match="inside the checkpoints of the run"):
        with staged_output(run / "checkpoints" / "step_00000002" / "report", "eval", overwrite=True):
            pass
    (tmp_path / "afile").write_text("x")
    with pytest.raises(RunFolderError, match="is a file, not a folder"):
        with staged_output(tmp_path / "afile", "convert", overwrite=True):
            pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("outputs")
    recipe = folder / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(), sort_keys=False))
    run = folder / "run"
    result = CliRunner().invoke(cli, ["train", str(recipe), f"out_dir={run}"])
    assert result.exit_code == 0, cli_text(result)
    return recipe, run


def test_push_to_a_folder_twice_needs_overwrite(tiny, tmp_path) -> None:
    _, run = tiny
    dest = tmp_path / "staged"
    first = CliRunner().invoke(cli, ["push", str(run), "me/x", "--to-folder", str(dest)])
    assert first.exit_code == 0, cli_text(first)
    before = _files(dest)
    assert "model.safetensors" in before and "README.md" in before
    fails_cleanly(
        CliRunner().invoke(cli, ["push", str(run), "me/x", "--to-folder", str(dest)]), "is not empty"
    )
    assert _files(dest) == before
    again = CliRunner().invoke(cli, ["push", str(run), "me/x", "--to-folder", str(dest), "--overwrite"])
    assert again.exit_code == 0, cli_text(again)
    assert _files(dest) == before
    fails_cleanly(
        CliRunner().invoke(cli, ["push", str(run), "me/x", "--to-folder", str(run), "--overwrite"]),
        "holds a training run",
    )


def test_eval_out_into_a_run_or_its_checkpoints_is_refused(tiny) -> None:
    _, run = tiny
    step = sorted((run / "checkpoints").glob("step_*"))[-1]
    before = _files(run)
    for out in (run, step, step / "report"):
        result = CliRunner().invoke(
            cli, ["eval", str(run), "-n", "2", "--no-analyses", "-o", str(out), "--overwrite"]
        )
        fails_cleanly(result, str(out))
    assert _files(run) == before


def test_train_out_inside_another_run_is_refused(tiny) -> None:
    recipe, run = tiny
    step = sorted((run / "checkpoints").glob("step_*"))[-1]
    before = _files(run)
    for out in (step, run / "nested"):
        fails_cleanly(
            CliRunner().invoke(cli, ["train", str(recipe), "-o", str(out)]),
            "inside the folder of another run",
        )
    assert _files(run) == before and not (run / "nested").exists()


def test_a_folder_holding_a_run_below_it_is_never_written_whole(tiny, tmp_path, monkeypatch) -> None:
    """``train -o`` a parent of a run (``-o .`` in a folder of runs) is refused, and ``--overwrite``
    of ``eval -o`` / ``compare -o`` / ... never removes a run lying deeper in the folder."""
    import shutil

    recipe, run = tiny
    parent = tmp_path / "project"
    shutil.copytree(run, parent / "runs" / "r1")
    before = _files(parent)
    fails_cleanly(CliRunner().invoke(cli, ["train", str(recipe), "-o", str(parent)]), "holds another run's folder")
    monkeypatch.chdir(parent)
    fails_cleanly(CliRunner().invoke(cli, ["train", str(recipe), "-o", "."]), "holds another run's folder")
    with pytest.raises(RunFolderError, match="holds the training run"):
        with staged_output(parent, "compare", overwrite=True):
            pass
    fails_cleanly(
        CliRunner().invoke(cli, ["eval", str(run), "-o", str(parent), "--overwrite", "--examples", "2"]),
        "holds the training run",
    )
    assert _files(parent) == before


def test_data_generate_follows_the_run_folder_rules(tiny, tmp_path, monkeypatch) -> None:
    """``data generate`` never writes into a run's folder (its ``metrics.jsonl`` was replaced by a CSV
    before), refuses an existing file or HRM split unless ``--overwrite``, and builds an HRM split
    aside: a failure half-way leaves the old split whole."""
    _, run = tiny
    before = _files(run)
    gen = ["data", "generate", "sudoku", "--size", "4", "--count", "5"]
    for out in ("metrics.jsonl", "checkpoints/x.csv", "notes/x.csv"):
        fails_cleanly(CliRunner().invoke(cli, [*gen, "-o", str(run / out)]), "never writes into a run's folder")
    fails_cleanly(CliRunner().invoke(cli, [*gen, "--format", "hrm", "-o", str(run)]), "never writes into a run")
    assert _files(run) == before
    csv = tmp_path / "d.csv"
    assert CliRunner().invoke(cli, [*gen, "-o", str(csv)]).exit_code == 0
    fails_cleanly(CliRunner().invoke(cli, [*gen, "--seed", "1", "-o", str(csv)]), "--overwrite")
    hrm = tmp_path / "hrm"
    assert CliRunner().invoke(cli, [*gen, "--format", "hrm", "-o", str(hrm)]).exit_code == 0
    assert CliRunner().invoke(cli, [*gen, "--format", "hrm", "-o", str(hrm), "--split", "test"]).exit_code == 0
    old = _files(hrm)
    fails_cleanly(CliRunner().invoke(cli, [*gen, "--format", "hrm", "-o", str(hrm)]), "--overwrite")
    import loopformer.tasks.formats as formats

    real, calls = formats.save_npy, []

    def full_disk(path, array, root=None):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device", str(path))
        return real(path, array, root)

    monkeypatch.setattr(formats, "save_npy", full_disk)
    fails_cleanly(CliRunner().invoke(cli, [*gen, "--seed", "2", "--format", "hrm", "-o", str(hrm), "--overwrite"]),
                  "No space left on device")  # fmt: skip
    assert _files(hrm) == old and sorted(p.name for p in hrm.iterdir()) == ["identifiers.json", "test", "train"]
    monkeypatch.setattr(formats, "save_npy", real)
    result = CliRunner().invoke(cli, [*gen, "--seed", "2", "--format", "hrm", "-o", str(hrm), "--overwrite"])
    assert result.exit_code == 0, cli_text(result)
    new = _files(hrm)
    assert new["train/all__inputs.npy"] != old["train/all__inputs.npy"] and new["test/dataset.json"] == old["test/dataset.json"]


def test_sweep_refuses_a_folder_that_is_not_its_own_before_writing(tiny, tmp_path) -> None:
    """``sweep -o`` a run folder wrote ``sweep.json`` into it before failing; now a run, a folder inside
    one, a folder holding something else and another sweep's folder are refused with nothing written."""
    recipe, run = tiny
    before = _files(run)
    grid = ["sweep", str(recipe), "train.steps=1", "loop_eval.max_steps=2,3"]
    for out in (run, run / "plots"):
        fails_cleanly(CliRunner().invoke(cli, [*grid, "-o", str(out)]), "a sweep writes a folder of its own")
    assert _files(run) == before and not (run / "plots").exists()
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    fails_cleanly(CliRunner().invoke(cli, [*grid, "-o", str(data)]), "holds no earlier sweep")
    other = tmp_path / "other"
    other.mkdir()
    (other / "sweep.json").write_text('{"recipe": "x", "axes": {"train.lr": [1]}, "fixed": {}}')
    fails_cleanly(CliRunner().invoke(cli, [*grid, "-o", str(other)]), "holds another sweep")
    assert sorted(p.name for p in other.iterdir()) == ["sweep.json"] and sorted(data.iterdir()) == [data / "train"]


def test_run_out_refuses_a_run_folder_a_folder_inside_one_or_a_foreign_folder(tiny, tmp_path) -> None:
    """``loopformer run -o RUN/sub`` created ``sub`` inside the run before its training was refused, and
    ``run -o`` a folder holding a dataset or another run wrote its report among them; now each is refused
    before anything is created."""
    import shutil

    recipe, run = tiny
    before = _files(run)
    for out in (run / "sub", run):
        fails_cleanly(CliRunner().invoke(cli, ["run", "-r", str(recipe), "-o", str(out), "--overwrite"]),
                      "is or lies in the training run")  # fmt: skip
    assert _files(run) == before and not (run / "sub").exists()
    project = tmp_path / "project"
    shutil.copytree(run, project / "runs" / "r1")
    fails_cleanly(CliRunner().invoke(cli, ["run", "-r", str(recipe), "-o", str(project)]), "holds the training run")
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    fails_cleanly(CliRunner().invoke(cli, ["run", "-r", str(recipe), "-o", str(data)]), "holds no earlier")
    assert sorted(p.name for p in project.iterdir()) == ["runs"] and sorted(p.name for p in data.iterdir()) == ["train"]
