"""Packaging and command-line conventions: LICENSE, CITATION.cff, py.typed, classifiers, the torch range,
``loopformer recipes``, ``--print-config`` and ``-o`` meaning ``--out`` in every command."""

from __future__ import annotations

import re
from pathlib import Path

import click
import yaml
from click.testing import CliRunner

from loopformer.cli import cli
from loopformer.config import RECIPE_DIR, build_config

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_citation_and_metadata() -> None:
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["license"] == "MIT"
    ids = {r["identifiers"][0]["value"] for r in cff["references"]}
    assert ids == {
        f"arXiv:{i}" for i in ("2606.18206", "2605.12466", "2604.07822", "2510.04871", "2506.21734")
    }
    assert (ROOT / "loopformer" / "py.typed").is_file() and (ROOT / "CHANGELOG.md").is_file()
    project = _pyproject()["project"]
    assert "License :: OSI Approved :: MIT License" in project["classifiers"]
    assert "Typing :: Typed" in project["classifiers"]
    torch_req = next(d for d in project["dependencies"] if d.startswith("torch"))
    upper = re.search(r"<(\d+)\.(\d+)", torch_req)
    assert upper and (int(upper[1]), int(upper[2])) >= (2, 16), f"{torch_req} must admit torch 2.15"
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text()
    extras = _pyproject()["project"]["optional-dependencies"]
    assert any(d.startswith("huggingface_hub") for d in extras["hub"]) and extras["wandb"]
    assert "py.typed" in _pyproject()["tool"]["setuptools"]["package-data"]["loopformer"]


def test_recipes_lists_every_shipped_recipe() -> None:
    result = CliRunner().invoke(cli, ["recipes"])
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line for line in result.output.splitlines() if line.strip()}
    names = {p.stem for p in RECIPE_DIR.glob("*.yaml")}
    assert set(lines) == names and "sudoku4_fprm" in names
    first = next(
        line.lstrip("#").strip()
        for line in (RECIPE_DIR / "sudoku4_fprm.yaml").read_text().splitlines()
        if line.strip()
    )
    assert first in lines["sudoku4_fprm"]
    with_path = CliRunner().invoke(cli, ["recipes", "--path"]).output
    assert str(RECIPE_DIR) in with_path


def test_print_config_is_the_resolved_config(tmp_path) -> None:
    result = CliRunner().invoke(
        cli, ["train", "sudoku4_fprm", "train.steps=7", "--print-config", "-o", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    raw = yaml.safe_load(result.output)
    cfg = build_config(raw)
    assert cfg.train.steps == 7 and cfg.out_dir == str(tmp_path) and cfg.model.name == "fprm"
    assert not (tmp_path / "checkpoints").exists()  # nothing trained
    both = CliRunner().invoke(cli, ["run", "--print-config", "train.steps=5"])
    assert both.exit_code == 0 and both.output.count("steps: 5") >= 2 and "# the baseline" in both.output


def _commands(group: click.Group, prefix: str = ""):
    ctx = click.Context(group)  # list_commands / get_command: the top-level commands are loaded lazily
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        yield f"{prefix}{name}", command
        if isinstance(command, click.Group):
            yield from _commands(command, f"{prefix}{name} ")


def test_dash_o_means_out_everywhere() -> None:
    seen = 0
    for name, command in _commands(cli):
        for param in command.params:
            if "-o" in getattr(param, "opts", []):
                assert "--out" in param.opts, f"loopformer {name}: -o is {param.opts}"
                seen += 1
    assert seen >= 5
