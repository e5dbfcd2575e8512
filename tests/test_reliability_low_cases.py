"""The review's low cases (issue 35), each a clear message or the right behaviour.

``--plan --gpu-memory 0``; ``loopformer.load(use_ema="no")`` (a string that reads as true); ``solve`` with a
float array beyond any integer (numpy's cast warned and wrapped); ``convert`` of a checkpoint holding NaN
(exit 0, a run folder eval refuses); ``push`` / ``consolidate`` while a training rotates the checkpoint
they read (a mix of two checkpoints, or an unexplained missing file); ``Spearman rho nan`` printed as a
result. The lock file naming pid 1 for ever, empty folders left after a failed write and errors naming the
hidden staging folder are in ``test_reliability_records.py`` and ``test_reliability_links.py``.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner
from reliability_common import PUZZLE, cli_text, fails_cleanly, make_sharded, newest_checkpoint, tiny_recipe

from loopformer.cli import cli

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "parity"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("low")
    recipe = root / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(train={"eval_every": 0})))
    result = CliRunner().invoke(cli, ["train", str(recipe), "-o", str(root / "run")])
    assert result.exit_code == 0, cli_text(result)[-400:]
    return recipe, root / "run"


def test_plan_with_no_gpu_memory_is_refused(trained) -> None:
    recipe, _ = trained
    fails_cleanly(
        CliRunner().invoke(cli, ["train", str(recipe), "--plan", "--gpu-memory", "0"]), "--gpu-memory"
    )


def test_load_use_ema_must_be_a_boolean(trained) -> None:
    import loopformer

    with pytest.raises(ValueError, match="use_ema"):
        loopformer.load(trained[1], device="cpu", use_ema="no")


def test_solve_with_a_float_array_beyond_any_integer_is_one_clear_error(trained) -> None:
    import loopformer
    from loopformer.tasks.base import TaskDataError

    run = loopformer.load(trained[1], device="cpu")
    tokens = loopformer.api.parse_puzzle(run.task, PUZZLE).astype(np.float64)
    tokens[0] = 2.0**70  # a whole number no int64 holds
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "invalid value encountered in cast" is no answer
        with pytest.raises(TaskDataError, match="beyond any vocabulary"):
            loopformer.solve(run, tokens)


def test_convert_of_a_nan_checkpoint_is_refused(tmp_path) -> None:
    ref = tmp_path / "ref"
    shutil.copytree(FIXTURES / "trm_attn", ref)
    state = torch.load(ref / "step_1", weights_only=True)
    key = next(k for k, v in state.items() if v.is_floating_point())
    state[key] = torch.full_like(state[key], float("nan"))
    torch.save(state, ref / "step_1")
    out = tmp_path / "out"
    fails_cleanly(
        CliRunner().invoke(cli, ["convert", "trm", str(ref / "step_1"), "-o", str(out)]), "NaN", key
    )
    assert not out.exists()


def _replace_checkpoint(folder: Path) -> None:
    """What a training re-saving (or rotating) ``folder`` does to it while another command reads it."""
    manifest = folder / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"format": 1', '"format": 1 '))


def test_push_never_mixes_two_checkpoints_of_a_rotation(trained, tmp_path, monkeypatch) -> None:
    import loopformer.runs.hub as hub

    run = tmp_path / "run"
    shutil.copytree(trained[1], run)
    real = hub.atomic_copy

    def copy_then_rotate(src, dst, root=None):  # the training re-saves the checkpoint after its first file
        out = real(src, dst, root)
        if Path(src).name == "model.safetensors":
            _replace_checkpoint(Path(src).parent)
        return out

    monkeypatch.setattr(hub, "atomic_copy", copy_then_rotate)
    out = tmp_path / "pushed"
    fails_cleanly(
        CliRunner().invoke(cli, ["push", str(run), "me/x", "--to-folder", str(out)]),
        "while it was being read",
    )
    assert not out.exists() or not any(out.iterdir())


def test_consolidate_never_mixes_two_checkpoints_of_a_rotation(trained, tmp_path, monkeypatch) -> None:
    import loopformer.runs.checkpoint as sharded

    step = make_sharded(trained[1], tmp_path / "sharded")
    real = sharded.read_full

    def read_then_rotate(folder):
        _replace_checkpoint(Path(folder))
        return real(folder)

    monkeypatch.setattr(sharded, "read_full", read_then_rotate)
    out = tmp_path / "full"
    fails_cleanly(
        CliRunner().invoke(cli, ["consolidate", str(step), "--out", str(out)]), "while it was being read"
    )
    assert not out.exists() or not any(out.rglob("model.safetensors"))


def test_an_undefined_rank_correlation_is_never_printed_as_a_result(trained, tmp_path) -> None:
    run = trained[1]
    args = ["eval", str(run), "--no-analyses", "-o", str(tmp_path / "r"), "-s", "loop_eval.max_steps=1"]
    result = CliRunner().invoke(cli, args)  # one loop for every example: no spread to rank
    text = " ".join(cli_text(result).split())
    assert result.exit_code == 0, text[-400:]
    assert "rho nan" not in text and "undefined" in text, text[-400:]
    assert newest_checkpoint(run).is_dir()
