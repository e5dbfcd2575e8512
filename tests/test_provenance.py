"""Provenance records (issue 25): a fresh run writes one record to ``provenance.json``, a resume appends
one (the first is kept), and ``record_for_step`` finds the record that trained a given step; the record
holds the commit and dirty flag of the git checkout the running code lives in (issue 45)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from reliability_common import tiny_recipe

from loopformer.config import build_config
from loopformer.runs.folder import PACKAGE, describe, git_state, read_records, record_for_step
from loopformer.train.trainer import Trainer


def test_a_resume_appends_a_provenance_record(tmp_path: Path) -> None:
    run = tmp_path / "run"
    Trainer(build_config({**tiny_recipe(), "out_dir": str(run)})).fit()
    first = read_records(run)
    assert len(first) == 1 and first[0]["step"] == 0 and first[0]["resumed"] is False
    assert first[0]["threads"] == 1 and first[0]["device"] == "cpu" and first[0]["torch"]
    resumed = tiny_recipe(train={"steps": 3, "resume": True})
    Trainer(build_config({**resumed, "out_dir": str(run)})).fit()
    records = read_records(run)
    assert len(records) == 2 and records[0] == first[0]  # appended, the first one kept as it was
    assert records[1]["step"] == 2 and records[1]["resumed"] is True
    assert record_for_step(run, 2) == records[0] and record_for_step(run, 3) == records[1]
    line = describe(records[1])
    assert f"torch {records[1]['torch']}" in line and "threads 1" in line and "device cpu" in line


def _git(folder: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_state_is_the_repository_that_tracks_the_source(tmp_path: Path) -> None:
    """The repository is found as git finds it, walking up from the package folder; a source the repository
    does not track (an installed copy in a virtual environment inside a project) or no repository: None."""
    repo = tmp_path / "repo"
    package = repo / "src" / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("x = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    state = git_state(package)
    assert state == {"commit": _git(repo, "rev-parse", "HEAD"), "dirty": False}
    assert re.fullmatch(r"[0-9a-f]{40}", state["commit"])
    (package / "__init__.py").write_text("x = 2\n")  # an uncommitted change to a tracked file
    assert git_state(package) == {"commit": state["commit"], "dirty": True}
    untracked = repo / ".venv" / "site-packages" / "pkg"
    untracked.mkdir(parents=True)
    (untracked / "__init__.py").write_text("")
    assert git_state(untracked) is None
    plain = tmp_path / "plain" / "pkg"
    plain.mkdir(parents=True)
    (plain / "__init__.py").write_text("")
    assert git_state(plain) is None


def _checkout_of_the_source() -> bool:
    """Whether the running loopformer lies in a git work tree that tracks it (a clone or a worktree)."""
    if shutil.which("git") is None:
        return False
    try:
        _git(PACKAGE, "ls-files", "--error-unmatch", "__init__.py")
    except subprocess.CalledProcessError:
        return False
    return True


@pytest.mark.skipif(not _checkout_of_the_source(), reason="loopformer does not run from a git checkout here")
def test_a_run_trained_from_a_git_checkout_records_its_commit_and_dirty_flag(tmp_path: Path) -> None:
    """Issue 45: the record named the package folder's parent as the clone, so every run recorded
    ``"git": null``; it is the commit of the repository the running code lives in."""
    run = tmp_path / "run"
    Trainer(build_config({**tiny_recipe(), "out_dir": str(run)})).fit()
    git = read_records(run)[0]["git"]
    assert git is not None and re.fullmatch(r"[0-9a-f]{40}", git["commit"])
    assert git["commit"] == _git(PACKAGE, "rev-parse", "HEAD")
    assert git["dirty"] is bool(_git(PACKAGE, "status", "--porcelain", "--untracked-files=no"))
    assert f"commit {git['commit'][:10]}" in describe(read_records(run)[0])
