"""A path is a path (issue 35): every folder a user types reaches the code as a path, never through the
YAML override parser.

``train -o`` was turned into an ``out_dir=`` override, so ``-o "exp #2"`` trained into ``./exp`` (a YAML
comment), ``-o 0001`` into ``./1``, ``-o 0x10`` into ``./16``, a newline became a space, and
``-o 2024-01-01`` / ``-o yes`` were type errors; ``sweep -o "s #1"`` trained its points into ``./s``.
An ``out_dir=`` override given by hand is a path too. Only the CLI and files on disk are used here, so
the tests run unchanged against the code from before (``tools/reliability_before_after.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from reliability_common import cli_text, tiny_recipe

from loopformer.cli import cli

NAMES = ["exp #2", "0001", "0x10", "2024-01-01", "yes", "two\nlines"]


@pytest.fixture
def recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(train={"eval_every": 0, "steps": 1})))
    return path


def _runs(root: Path) -> list[str]:
    """The folders below ``root`` that hold a training run's checkpoints."""
    return sorted(str(p.parent.relative_to(root)) for p in root.rglob("checkpoints"))


@pytest.mark.parametrize("name", NAMES, ids=["hash", "leading-zeros", "hex", "date", "yes", "newline"])
def test_train_out_is_the_folder_named_as_typed(recipe: Path, tmp_path: Path, name: str) -> None:
    result = CliRunner().invoke(cli, ["train", str(recipe), "-o", name])
    assert result.exit_code == 0, cli_text(result)[-400:]
    assert _runs(tmp_path) == [name], f"-o {name!r} trained into {_runs(tmp_path)}"


def test_an_out_dir_override_is_a_path_too(recipe: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["train", str(recipe), "out_dir=0001 #x"])
    assert result.exit_code == 0, cli_text(result)[-400:]
    assert _runs(tmp_path) == ["0001 #x"]


def test_sweep_out_is_the_folder_named_as_typed(recipe: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["sweep", str(recipe), "loop_eval.max_steps=2,3", "-o", "s #1"])
    assert result.exit_code == 0, cli_text(result)[-400:]
    assert _runs(tmp_path) == ["s #1/run"], _runs(tmp_path)
    assert (tmp_path / "s #1" / "compare" / "comparison.md").is_file()
