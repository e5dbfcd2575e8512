"""Issue 24, no input reaches "internal error": a reader that goes away (``loopformer recipes | head``),
an ``-o`` that names a file, a read-only or full output folder each end in one line (or, for the
broken pipe, quietly)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from reliability_common import fails_cleanly, tiny_recipe

from loopformer.cli import cli

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.mark.parametrize("args", [["recipes"], ["recipes", "--path"], ["models"]])
def test_a_reader_that_goes_away_is_no_internal_error(args) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "loopformer", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())  # fmt: skip
    proc.stdout.close()  # like `| head -0`: every write to stdout now fails with EPIPE
    err = proc.stderr.read()
    proc.wait(120)
    assert "internal error" not in err and "Traceback" not in err and "Exception ignored" not in err, err
    assert proc.returncode in (0, 1), err


def test_recipes_piped_into_head_prints_its_first_line() -> None:
    out = subprocess.run(f"{sys.executable} -m loopformer recipes | head -1", shell=True, capture_output=True,
                         text=True, env=_env(), timeout=120)  # fmt: skip
    assert len(out.stdout.splitlines()) == 1 and "internal error" not in out.stderr, out.stderr


@pytest.fixture
def recipe(tmp_path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(), sort_keys=False))
    return path


def test_train_and_eval_with_an_output_that_is_a_file(recipe, tmp_path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("keep me\n")
    fails_cleanly(
        CliRunner().invoke(cli, ["train", str(recipe), "-o", str(afile)]), "is a file, not a folder"
    )
    run = tmp_path / "run"
    assert CliRunner().invoke(cli, ["train", str(recipe), "-o", str(run)]).exit_code == 0
    result = CliRunner().invoke(cli, ["eval", str(run), "-o", str(afile), "-n", "2", "--no-analyses"])
    fails_cleanly(result, "is a file, not a folder")
    assert afile.read_text() == "keep me\n"


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS, errno.ENOSPC])
def test_train_into_a_read_only_or_full_folder_is_one_line(recipe, tmp_path, monkeypatch, code) -> None:
    # as root a chmod'ed folder stays writable, so the refusal the OS would give is simulated
    locked = tmp_path / "ro"
    locked.mkdir()

    def refusing(real):
        def call(path, *args, **kwargs):
            if str(path).startswith(str(locked)):
                raise OSError(code, os.strerror(code), str(path))
            return real(path, *args, **kwargs)

        return call

    fake_open, fake_mkdir = refusing(os.open), refusing(os.mkdir)
    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    fails_cleanly(
        CliRunner().invoke(cli, ["train", str(recipe), "-o", str(locked / "run")]), os.strerror(code)
    )
    fails_cleanly(CliRunner().invoke(cli, ["train", str(recipe), "-o", str(locked)]), os.strerror(code))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_train_into_a_chmod_read_only_folder_is_one_line(recipe, tmp_path) -> None:
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        fails_cleanly(CliRunner().invoke(cli, ["train", str(recipe), "-o", str(locked)]), "Permission denied")
    finally:
        locked.chmod(0o755)
