"""Resume and branch (issue 35).

Cases: a branch (``train.resume=<another run's checkpoint>`` into a new folder) killed before its first
checkpoint restarted from step 0 on ``--resume`` while its ``origin.json`` still named the branch point;
resuming a copy of a run made with hard links (``cp -al``) appended to the original's files (its
``config_changes.jsonl``; its lock file was written in place); a malformed ``provenance.json`` was
replaced on resume by a history of one record, and a branch's history started from nothing. Only the CLI
and files on disk are used.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
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


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the recipe, a run of 4 steps with checkpoints at steps 2 and 4)."""
    root = tmp_path_factory.mktemp("branch")
    recipe = root / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(train={"steps": 4, "checkpoint_every": 2, "eval_every": 0})))
    _ok(["train", str(recipe), "-o", str(root / "a")])
    return recipe, root / "a"


def test_a_branch_killed_before_its_first_checkpoint_resumes_from_its_origin(origin, tmp_path) -> None:
    recipe, a = origin
    step2 = a / "checkpoints" / "step_00000002"
    b = tmp_path / "b"
    _ok(["train", str(recipe), "-o", str(b), f"train.resume={step2}"])
    assert json.loads((b / "origin.json").read_text())["step"] == 2
    shutil.rmtree(b / "checkpoints")  # as if killed after some steps, before its first checkpoint
    text = _ok(["train", str(recipe), "-o", str(b), "--resume"])
    assert "step 2" in text and "from step 0" not in text, text[-400:]
    assert _steps(b)[0] == 3, _steps(b)  # it went on from the branch point, not from step 0
    os.replace(step2, tmp_path / "moved")  # the branch point gone: refused, naming origin.json
    shutil.rmtree(b / "checkpoints")
    try:
        fails_cleanly(
            CliRunner().invoke(cli, ["train", str(recipe), "-o", str(b), "--resume"]), "origin.json"
        )
    finally:
        os.replace(tmp_path / "moved", step2)


def test_resuming_a_hard_linked_copy_never_changes_the_originals_files(origin, tmp_path) -> None:
    recipe, a = origin
    run = tmp_path / "run"
    shutil.copytree(a, run)
    _ok(
        [
            "train",
            str(recipe),
            "-o",
            str(run),
            "--resume",
            "train.steps=5",
            "train.lr=0.002",
            "--allow-config-change",
        ]
    )
    (run / ".loopformer.lock").write_text(json.dumps({"pid": 999_999, "host": socket.gethostname()}))  # stale
    copy = tmp_path / "copy"
    shutil.copytree(run, copy, copy_function=os.link)  # cp -al: every file shared with the original
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    _ok(
        [
            "train",
            str(recipe),
            "-o",
            str(copy),
            "--resume",
            "train.steps=6",
            "train.lr=0.003",
            "--allow-config-change",
        ]
    )
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert len((copy / "config_changes.jsonl").read_text().splitlines()) == 2  # the copy got its own record


def test_provenance_history_is_kept_on_resume_and_a_branch_starts_with_its_origins(origin, tmp_path) -> None:
    recipe, a = origin
    b = tmp_path / "b"
    _ok(["train", str(recipe), "-o", str(b), f"train.resume={a / 'checkpoints' / 'step_00000002'}"])
    records = json.loads((b / "provenance.json").read_text())["records"]
    assert records[0]["step"] == 0 and records[-1]["step"] == 2 and len(records) == 2, records
    (b / "provenance.json").write_text('{"records": [{"step": "two"}]}')
    fails_cleanly(CliRunner().invoke(cli, ["train", str(recipe), "-o", str(b), "--resume", "train.steps=5"]),
                  "provenance.json", "records[0].step")  # fmt: skip
