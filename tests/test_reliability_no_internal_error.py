"""Issue 24, no input reaches "internal error": an offline ``data prepare`` (the hub download fails) says to
use ``--from LOCAL_PATH``; an ``-o`` / ``--out`` / ``--to-folder`` naming a file, and a read-only or full
output folder (EACCES, EROFS, ENOSPC), give one line naming the path for ``run``, ``eval -o``,
``push --to-folder`` and ``data prepare -o``."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from reliability_common import fails_cleanly, tiny_recipe

from loopformer.cli import cli
from loopformer.config import build_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from loopformer.train.trainer import Trainer

    root = tmp_path_factory.mktemp("no_internal")
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(), sort_keys=False))
    Trainer(build_config({**tiny_recipe(), "out_dir": str(root / "run")})).fit()
    return root / "run", recipe


def _sudoku_csvs(folder: Path) -> Path:
    from loopformer.tasks.sudoku import SudokuTask

    task = SudokuTask(4)
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(("train", "test")):
        task.save(task.generate(6, seed=i, min_blanks=2, max_blanks=4), folder / f"{name}.csv")
    return folder


@pytest.mark.parametrize("error", ["LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectionError"])
def test_offline_data_prepare_suggests_from_local_path(tmp_path, monkeypatch, error) -> None:
    huggingface_hub = pytest.importorskip("huggingface_hub")
    import huggingface_hub.errors as hub_errors

    kind = getattr(hub_errors, error, ConnectionError)

    def offline(*args, **kwargs):
        raise kind("Cannot reach https://huggingface.co: offline\nsecond line")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    out = tmp_path / "out"
    text = fails_cleanly(CliRunner().invoke(cli, ["data", "prepare", "sudoku-extreme", "-o", str(out)]),
                         "--from LOCAL_PATH", "loopformer data prepare sudoku-extreme", "train.csv")  # fmt: skip
    assert len(text.strip().splitlines()) == 1
    assert not any(p for p in out.glob("*") if not p.name.startswith("."))  # no dataset left behind


def test_an_output_option_naming_a_file_is_one_line(trained, tmp_path) -> None:
    run, recipe = trained
    afile = tmp_path / "afile"
    afile.write_text("keep me\n")
    src = _sudoku_csvs(tmp_path / "csv")
    for args in (["run", "-r", str(recipe), "-o", str(afile)],
                 ["push", str(run), "me/x", "--to-folder", str(afile)],
                 ["data", "prepare", "sudoku-extreme", "--from", str(src), "-o", str(afile)]):  # fmt: skip
        fails_cleanly(CliRunner().invoke(cli, args), str(afile), "is a file, not a folder")
    for args in (["eval", str(run), "-n", "2", "--no-analyses", "-o", str(afile / "sub")],
                 ["push", str(run), "me/x", "--to-folder", str(afile / "sub")]):  # fmt: skip
        fails_cleanly(CliRunner().invoke(cli, args), str(afile))
    assert afile.read_text() == "keep me\n"


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS, errno.ENOSPC])
@pytest.mark.parametrize("command", ["eval", "push", "prepare"])
def test_a_read_only_or_full_output_folder_is_one_line(trained, tmp_path, monkeypatch, code, command) -> None:
    run, _ = trained
    src = _sudoku_csvs(tmp_path / "csv")
    locked = tmp_path / "ro"
    locked.mkdir()

    def refusing(real):  # as root a chmod'ed folder stays writable: the OS's refusal is simulated
        def call(path, *args, **kwargs):
            if str(path).startswith(str(locked)):
                raise OSError(code, os.strerror(code), str(path))
            return real(path, *args, **kwargs)

        return call

    monkeypatch.setattr(os, "open", refusing(os.open))
    monkeypatch.setattr(os, "mkdir", refusing(os.mkdir))
    args = {
        "eval": ["eval", str(run), "-n", "2", "--no-analyses", "-o", str(locked / "report")],
        "push": ["push", str(run), "me/x", "--to-folder", str(locked / "pushed")],
        "prepare": ["data", "prepare", "sudoku-extreme", "--from", str(src), "-o", str(locked / "ds")],
    }[command]
    text = fails_cleanly(CliRunner().invoke(cli, args), os.strerror(code), str(locked))
    # the error is one line; informational log records before it (eval's "CPU threads: ...") are not errors
    errors = [line for line in text.strip().splitlines() if not line.startswith("INFO ")]
    assert len(errors) == 1, text
