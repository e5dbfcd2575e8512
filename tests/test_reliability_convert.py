"""Issue 24, ``loopformer convert``: the ``--set`` an error message suggests is what makes the conversion go
through (overrides are applied before the key mapping), a checkpoint without the reference's
configuration is refused unless ``--allow-defaults`` (the Attractor's ``config.json`` beside the file is
found), converted TRM / HRM runs carry the authors' sign-SGD puzzle-embedding optimiser, a float64
checkpoint keeps its float64 initial states, and ``-o`` names the output folder as in other commands.

Only the ``loopformer`` CLI, the parity fixtures and files on disk are used, so that
``tools/reliability_before_after.py`` runs these tests unchanged against the code from before this work."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from reliability_common import cli_text, fails_cleanly
from safetensors.torch import load_file

from loopformer.cli import cli

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "parity"


def _convert(*args: str):
    return CliRunner().invoke(cli, ["convert", *args])


def _checkpoint_alone(name: str, dest: Path, file: str = "step_1") -> Path:
    """A copy of the fixture's checkpoint in a folder with nothing beside it."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(FIXTURES / name / file, dest / file)
    return dest / file


def test_convert_without_a_reference_config_is_refused_unless_allow_defaults(tmp_path) -> None:
    ckpt = _checkpoint_alone("trm_attn", tmp_path / "ref")
    out = tmp_path / "run"
    fails_cleanly(
        _convert("trm", str(ckpt), "--out", str(out)), "--config", "--allow-defaults", "all_config.yaml"
    )
    assert not out.exists() or not any(out.iterdir())
    result = _convert(
        "trm", str(ckpt), "-o", str(out), "--allow-defaults", "--set", "model.seq_len=16"
    )  # -o too
    assert result.exit_code == 0, cli_text(result)
    assert "defaults" in result.output  # said, not silent


def test_convert_attractor_reads_the_config_beside_the_checkpoint_or_says_what_is_missing(tmp_path) -> None:
    result = _convert(
        "attractor", str(FIXTURES / "attractor_lm" / "model.pt"), "--out", str(tmp_path / "run")
    )
    assert result.exit_code == 0, cli_text(result)  # attractor_lm/config.json, found beside model.pt
    alone = _checkpoint_alone("attractor_lm", tmp_path / "ref", "model.pt")
    text = fails_cleanly(
        _convert("attractor", str(alone), "--out", str(tmp_path / "other")), "--config", "config.json"
    )
    assert "LayerNorm" not in text
    text = fails_cleanly(_convert("attractor", str(alone), "--out", str(tmp_path / "x"), "--allow-defaults"))
    # a setting refused is named as the reference's default, not the checkpoint's
    assert "without a reference configuration" in text and "--config" in text


def _suggestion(text: str) -> str:
    found = re.search(r"--set (\S+=\S+)", text)
    assert found, f"the error suggests no --set: {text}"
    return found.group(1)


@pytest.mark.parametrize("missing", ["seq_len", "data_paths"])
def test_the_set_an_error_suggests_makes_the_conversion_go_through(tmp_path, missing) -> None:
    ckpt = _checkpoint_alone("trm_attn", tmp_path / "ref")
    config = yaml.safe_load((FIXTURES / "trm_attn" / "all_config.yaml").read_text())
    if missing == "seq_len":
        del config["arch"]["seq_len"]
    else:
        config["data_paths"] = ["data/my-puzzles"]  # a name the converter cannot read a task from
    (ckpt.parent / "all_config.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    text = fails_cleanly(_convert("trm", str(ckpt), "--out", str(out)), "--set")
    fix = _suggestion(text).replace("=N", "=16").replace("=...", "=sudoku")
    result = _convert("trm", str(ckpt), "--out", str(out), "--set", fix, "--set", "data.options={size: 4}")
    assert result.exit_code == 0, cli_text(result)
    saved = yaml.safe_load((out / "config.yaml").read_text())
    key, value = fix.split("=", 1)
    section, name = key.split(".")
    assert str(saved[section][name]) == value


@pytest.mark.parametrize("system", ["trm", "hrm"])
def test_converted_trm_and_hrm_carry_the_sign_sgd_puzzle_embedding_optimiser(tmp_path, system) -> None:
    name = "trm_attn" if system == "trm" else "hrm"
    out = tmp_path / "run"
    result = _convert(system, str(FIXTURES / name / "step_1"), "--out", str(out))
    assert result.exit_code == 0, cli_text(result)
    train = yaml.safe_load((out / "config.yaml").read_text())["train"]
    ref = yaml.safe_load((FIXTURES / name / "all_config.yaml").read_text())
    assert train["puzzle_emb_optimizer"] == "sign_sgd"
    assert train["puzzle_emb_lr"] == ref["puzzle_emb_lr"]
    assert train["puzzle_emb_weight_decay"] == ref["puzzle_emb_weight_decay"]


def test_a_float64_checkpoint_keeps_float64_initial_states(tmp_path) -> None:
    state = torch.load(FIXTURES / "trm_attn" / "step_1", weights_only=True)
    assert state["model.inner.H_init"].dtype == torch.float64
    out = tmp_path / "run"
    result = _convert("trm", str(FIXTURES / "trm_attn" / "step_1"), "--out", str(out))
    assert result.exit_code == 0, cli_text(result)
    saved = load_file(str(out / "checkpoints" / "step_00000000" / "model.safetensors"))
    for mine, theirs in (("y_init", "H_init"), ("z_init", "L_init")):
        assert saved[mine].dtype == torch.float64, mine
        assert torch.equal(saved[mine], state[f"model.inner.{theirs}"]), mine  # not rounded to float32
    from loopformer.runs import load_run

    model = load_run(out).model
    assert model.y_init.dtype == torch.float64 and torch.equal(
        model.y_init.cpu(), state["model.inner.H_init"]
    )
