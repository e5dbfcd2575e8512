"""Issue 16's "Why" cases, each as a test through stable entry points only: the ``loopformer`` CLI
(click's CliRunner, or a subprocess where two processes are the point), files on disk and
``torch.optim.AdamW`` (to make a training step blow up). Nothing here imports what the reliability
work added, so ``tools/reliability_before_after.py`` runs this file unchanged against the code from
before that work: every test must fail there and pass now (docs/reliability.md, "Before and after")."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner
from reliability_common import (
    PUZZLE,
    break_weights,
    cli_text,
    fails_cleanly,
    newest_checkpoint,
    rewrite_manifest,
    tiny_recipe,
)

from loopformer.cli import cli


def _recipe(folder: Path, **sections: dict) -> Path:
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(**sections), sort_keys=False))
    return path


def _train(recipe: Path, out: Path, *overrides: str):
    return CliRunner().invoke(cli, ["train", str(recipe), f"out_dir={out}", *overrides])


def _trained(recipe: Path, out: Path, *overrides: str) -> Path:
    result = _train(recipe, out, *overrides)
    assert result.exit_code == 0, cli_text(result)
    return out


def _metric_steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if line]


def _error_line(text: str) -> str:
    """The line of a CLI output that carries the error (the last non-empty one otherwise), shortened."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    line = next((x for x in reversed(lines) if x.startswith("Error")), lines[-1] if lines else "")
    return line[:160]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _recipe(tmp_path_factory.mktemp("recipe"))


@pytest.fixture(scope="module")
def tiny_run(recipe: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _trained(recipe, tmp_path_factory.mktemp("runs") / "run")


# ------------------------------------------------------------------------------------------ run folders
def test_fresh_train_into_a_run_folder_deletes_nothing(recipe, tmp_path, monkeypatch) -> None:
    """Why 1: a fresh train into an existing run folder deleted its checkpoints and metrics at start-up;
    killed before its first save, nothing was left."""
    run = _trained(recipe, tmp_path / "run", "train.steps=4", "train.checkpoint_every=2")
    before = _files(run / "checkpoints") | {"metrics.jsonl": (run / "metrics.jsonl").read_bytes()}

    def killed(self, *args, **kwargs):  # the new run dies at its first optimiser step
        raise KeyboardInterrupt("killed before the first checkpoint")

    monkeypatch.setattr(torch.optim.AdamW, "step", killed)
    result = _train(recipe, run, "train.steps=4", "train.checkpoint_every=2")
    after = _files(run / "checkpoints") if (run / "checkpoints").is_dir() else {}
    after["metrics.jsonl"] = (
        (run / "metrics.jsonl").read_bytes() if (run / "metrics.jsonl").is_file() else b""
    )
    lost = sorted(k for k in before if after.get(k) != before[k])
    assert not lost, f"the fresh run destroyed {lost} (exit {result.exit_code})"
    assert "train.resume=true" in result.output and "--overwrite" in result.output, result.output


_HOLDER = """
import os, sys, time
import torch
hold, started = sys.argv[1], sys.argv[2]
backward = torch.Tensor.backward
def waiting_backward(self, *args, **kwargs):
    open(started, "w").close()
    while os.path.exists(hold):
        time.sleep(0.02)
    return backward(self, *args, **kwargs)
torch.Tensor.backward = waiting_backward
from loopformer.cli import cli
cli(sys.argv[3:])
"""


def test_two_trainings_into_one_folder_at_once(recipe, tmp_path) -> None:
    """Why 2: two trainings into the same folder at once deleted each other's checkpoints, one crashed
    and metrics.jsonl ended interleaved with duplicate steps."""
    run, hold, started = tmp_path / "run", tmp_path / "hold", tmp_path / "started"
    hold.touch()
    args = ["train", str(recipe), f"out_dir={run}", "train.steps=4", "train.checkpoint_every=1"]
    first = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(hold), str(started), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not started.exists():  # the first run is inside its first step
            assert first.poll() is None, first.communicate()[0]
            assert time.monotonic() < deadline, "the first training never started"
            time.sleep(0.05)
        second = CliRunner().invoke(cli, args)
    finally:
        hold.unlink()
        out, _ = first.communicate(timeout=300)
    assert second.exit_code != 0, "the second training into a folder in use was not refused (exit 0)"
    assert f"process {first.pid}" in second.output, second.output
    assert first.returncode == 0, out
    assert _metric_steps(run) == [1, 2, 3, 4]


def test_resume_falls_back_past_a_corrupt_latest_checkpoint(recipe, tmp_path) -> None:
    """Why 3: resume from a corrupt latest checkpoint stopped with an error."""
    run = _trained(recipe, tmp_path / "run", "train.steps=4", "train.checkpoint_every=2")
    weights = run / "checkpoints" / "step_00000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a torn write
    result = _train(recipe, run, "train.steps=6", "train.checkpoint_every=2", "train.resume=true")
    assert result.exit_code == 0, f"resume stopped with an error: {_error_line(cli_text(result))}"
    assert (run / "checkpoints" / "step_00000006").is_dir()
    assert _metric_steps(run) == [1, 2, 3, 4, 5, 6]


# ------------------------------------------------------------------------------------ numerical faults
@pytest.mark.parametrize("how", ["nan", "diverged"])
def test_eval_refuses_broken_weights(tiny_run, tmp_path, how) -> None:
    """Why 4: evaluating a model with NaN or diverged weights exited 0 with "0%" and a report."""
    run = break_weights(tiny_run, tmp_path / how, how)
    result = CliRunner().invoke(cli, ["eval", str(run), "--no-analyses", "-n", "4"])
    written = sorted(str(p.relative_to(run)) for p in run.glob("eval-*/*"))
    assert result.exit_code != 0, f"eval of {how} weights exited 0 and wrote {written}"
    fails_cleanly(result, "NaN or infinite")
    assert not written


def test_solve_json_refuses_nan_weights(tiny_run, tmp_path) -> None:
    """Why 4: ``solve --json`` of a NaN model returned a row of padding tokens."""
    run = break_weights(tiny_run, tmp_path / "nan", "nan")
    result = CliRunner().invoke(cli, ["solve", "sudoku", PUZZLE, "-c", str(run), "--json"])
    assert result.exit_code != 0, f"solve --json of NaN weights exited 0: {result.output.strip()[:200]}"
    record = json.loads(result.output.strip().splitlines()[0])
    assert record["solution"] is None and "NaN or infinite" in record["error"]


def _diverging_run(recipe: Path, run: Path, monkeypatch: pytest.MonkeyPatch):
    """8 steps, a checkpoint every 2; the 4th optimiser step leaves NaN weights behind (its loss was finite)."""
    step = torch.optim.AdamW.step
    calls = []

    def blow_up(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 4:
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        p.fill_(float("nan"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", blow_up)
    return _train(recipe, run, "train.steps=8", "train.checkpoint_every=2", "train.keep_checkpoints=5")


def test_divergence_never_names_a_nan_checkpoint_good(recipe, tmp_path, monkeypatch) -> None:
    """Why 4: after divergence the message could name a NaN checkpoint as the last good one."""
    result = _diverging_run(recipe, tmp_path / "run", monkeypatch)
    text = cli_text(result)
    assert result.exit_code != 0 and "diverged" in text, text
    good = text.split("last good checkpoint", 1)[-1]
    assert "step_00000004" not in good, "the error calls step_00000004 (NaN weights) the last good checkpoint"
    assert "step_00000002" in good, text


def test_divergence_leaves_one_metrics_record_per_step(recipe, tmp_path, monkeypatch) -> None:
    """Why 4: after divergence metrics.jsonl held two records for one step."""
    run = tmp_path / "run"
    result = _diverging_run(recipe, run, monkeypatch)
    assert result.exit_code != 0
    steps = _metric_steps(run)
    assert len(steps) == len(set(steps)), f"metrics.jsonl steps {steps}"


# ---------------------------------------------------------------------------------- paths and contents
def test_latest_pointer_with_an_absolute_path_keeps_eval_in_its_folder(recipe, tiny_run, tmp_path) -> None:
    """Why 5: a ``checkpoints/latest`` holding an absolute path sent eval's report into another run."""
    other = tmp_path / "other"
    shutil.copytree(tiny_run, other / "run")
    mine = _trained(recipe, tmp_path / "mine", "train.steps=1")
    (mine / "checkpoints" / "latest").write_text(str(newest_checkpoint(other / "run")))
    result = CliRunner().invoke(cli, ["eval", str(mine), "--no-analyses", "-n", "2"])
    leaked = sorted(p.name for p in (other / "run").glob("eval-*"))
    assert not leaked, f"eval of {mine.name} wrote its report into another run folder: {leaked}"
    assert result.exit_code == 0, cli_text(result)
    assert list(mine.glob("eval-*/report.md"))


def test_a_config_data_path_is_never_echoed(tiny_run, tmp_path) -> None:
    """Why 5: a ``config.json`` data path was read and its first line echoed in an error message."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0:secret-token-xyz:/root:/bin/bash\n")
    folder = newest_checkpoint(run)
    config = json.loads((folder / "config.json").read_text())
    config["data"]["eval_path"] = str(secret)
    (folder / "config.json").write_text(json.dumps(config))
    rewrite_manifest(folder)
    result = CliRunner().invoke(cli, ["eval", str(run), "--no-analyses", "-n", "2"])
    assert "secret-token-xyz" not in cli_text(result), "the error quotes the file's first line"
    assert result.exit_code == 1


# ------------------------------------------------------------------------------------- HRM numpy folders
def _hrm_folder(tmp_path: Path, how: str) -> Path:
    """A 4x4 Sudoku numpy folder (HRM's format, written by ``loopformer data``'s writer) broken as ``how``."""
    from loopformer.tasks.formats import save_hrm_folder
    from loopformer.tasks.sudoku import SudokuTask

    task = SudokuTask(4)
    root = tmp_path / "hrm"
    save_hrm_folder(
        task.generate(16, 0, min_blanks=4, max_blanks=8), root, "train", vocab_size=task.vocab_size
    )
    folder = root / "train"
    inputs, labels = np.load(folder / "all__inputs.npy"), np.load(folder / "all__labels.npy")
    meta = json.loads((folder / "dataset.json").read_text())
    if how in ("input token", "label token"):  # in the folder's vocabulary (a larger task's), not the task's
        (folder / "dataset.json").write_text(json.dumps({**meta, "vocab_size": 11}))
        (inputs if how == "input token" else labels)[5, 3] = task.vocab_size + 2
    elif how == "sequence length":
        inputs, labels = np.pad(inputs, ((0, 0), (0, 4))), np.pad(labels, ((0, 0), (0, 4)))
        (folder / "dataset.json").write_text(json.dumps({**meta, "seq_len": 20}))
    elif how == "NaN input":
        inputs = inputs.astype(np.float32)
        inputs[5, 3] = np.nan
    elif how == "float input":
        inputs = inputs.astype(np.float32) + 0.5
    np.save(folder / "all__inputs.npy", inputs)
    np.save(folder / "all__labels.npy", labels)
    return root


@pytest.mark.parametrize(
    ("how", "needle"),
    [
        ("input token", "all__inputs.npy: tokens outside [0, vocab_size=6)"),
        ("label token", "all__labels.npy: tokens outside [0, vocab_size=6)"),
        ("sequence length", "expects 16"),
        ("NaN input", "all__inputs.npy"),
        ("float input", "all__inputs.npy"),
    ],
    ids=["input-token", "label-token", "sequence-length", "nan-input", "float-input"],
)
def test_a_bad_numpy_folder_is_refused_before_training(recipe, tmp_path, how, needle) -> None:
    """Why 6: HRM/TRM numpy folders were not checked against the task (an internal IndexError mid-training,
    or a 3-step run exiting 0; float inputs silently truncated)."""
    root = _hrm_folder(tmp_path, how)
    result = _train(recipe, tmp_path / "run", f"data.train_path={root}", "train.steps=3")
    text = cli_text(result)
    assert result.exit_code != 0, f"a numpy folder with a bad {how} trained and exited 0"
    assert needle in text, f"the error does not name the problem ({needle!r}): {_error_line(text)}"
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "training started on the bad folder"


# ---------------------------------------------------------------------------------------------- solve
@pytest.mark.parametrize(
    ("puzzle", "status"),
    [("11..............", "contradictory"), ("123............4", "unsolvable")],
    ids=["contradictory", "unsolvable"],
)
def test_solve_says_when_givens_contradict_each_other(tiny_run, puzzle, status) -> None:
    """Why 9: solve never said that a puzzle's givens contradict each other (it printed INVALID)."""
    result = CliRunner().invoke(cli, ["solve", "sudoku", puzzle, "-c", str(tiny_run)])
    assert status in result.output, f"solve did not say {status!r}: {_error_line(result.output)}"


@pytest.fixture(autouse=True)
def _own_cwd(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # nothing a command writes by default lands in the repository
    monkeypatch.delenv("LOOPFORMER_DEBUG", raising=False)
