"""What the issue-16 reliability tests share: the tiny Sudoku recipe, breaking a checkpoint's weights on
disk, and checks of a CLI result.

Only stable entry points are used here (``loopformer.config``, the ``loopformer`` CLI, safetensors files
on disk), so that ``tests/test_reliability_cases.py`` runs unchanged against the code from before the
reliability work (``tools/reliability_before_after.py``).
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

# A 4x4 Sudoku FPRM small enough that a training step takes milliseconds.
TINY_RECIPE: dict[str, Any] = {
    "model": {"name": "fprm", "d_model": 16, "n_heads": 2, "n_layers": 1, "conv": "grid2d"},
    "data": {
        "task": "sudoku",
        "options": {"size": 4},
        "train_generate": {"min_blanks": 4, "max_blanks": 8},
        "eval_generate": {"min_blanks": 4, "max_blanks": 8},
        "train_size": 16,
        "eval_size": 6,
    },
    "train": {
        "mode": "deep_supervision",
        "steps": 2,
        "batch_size": 8,
        "max_segments": 2,
        "progress": False,
        "ema": 0.9,
        "log_every": 1,
        "threads": 1,
    },
    "loop_train": {"max_steps": 2},
    "loop_eval": {"max_steps": 3},
    "eval": {"batch_size": 16},
    "device": "cpu",
}
PUZZLE = ".2.34....4.2..3."  # a 4x4 puzzle with exactly one solution


def tiny_recipe(**sections: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of TINY_RECIPE with the given sections updated key by key."""
    recipe = copy.deepcopy(TINY_RECIPE)
    for name, values in sections.items():
        recipe.setdefault(name, {}).update(values)
    return recipe


def newest_checkpoint(run: Path) -> Path:
    """The newest ``checkpoints/step_*`` folder of ``run`` (read from the folder names, not a pointer)."""
    steps = sorted((run / "checkpoints").glob("step_*"))
    assert steps, f"{run} holds no checkpoint"
    return steps[-1]


def rewrite_manifest(folder: Path) -> None:
    """Make the checkpoint consistent again after editing its files: where checkpoints carry a manifest
    (size + SHA-256, added by the reliability work), write it anew; code without manifests needs nothing."""
    try:
        from loopformer.runs.checkpoint import write_manifest
    except ImportError:  # code from before checkpoint manifests
        return
    write_manifest(folder)


def break_weights(run: Path, dest: Path, how: str) -> Path:
    """A copy of ``run`` whose newest checkpoint holds NaN (``how="nan"``) or finite but astronomically
    large (``"diverged"``) weights, model and EMA, in an otherwise consistent checkpoint."""
    shutil.copytree(run, dest)
    folder = newest_checkpoint(dest)
    for name in ("model.safetensors", "ema.safetensors"):
        if not (folder / name).is_file():
            continue
        tensors = load_file(str(folder / name))
        with safe_open(str(folder / name), framework="pt") as handle:
            metadata = handle.metadata()  # tied-weight aliases, kept as they were
        key = next(k for k, v in tensors.items() if v.is_floating_point() and v.dim() == 2)
        if how == "nan":
            tensors[key] = torch.full_like(tensors[key], float("nan"))
        else:
            tensors = {k: v * 1e30 if v.is_floating_point() else v for k, v in tensors.items()}
        save_file(tensors, str(folder / name), metadata=metadata)
    rewrite_manifest(folder)
    return dest


def hold_lock(folder: Path, purpose: str = "train", seconds: float = 60.0) -> subprocess.Popen:
    """Another process holding ``folder``'s run lock (``RunLock(folder, purpose)``) for ``seconds``;
    returned once it holds it. The caller kills it."""
    code = (
        "import time; from loopformer.runs.folder import RunLock; "
        f"RunLock({str(folder)!r}, {purpose!r}).acquire(); print('locked', flush=True); time.sleep({seconds})"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    if proc.stdout is None or proc.stdout.readline().strip() != "locked":
        proc.kill()
        proc.wait()
        raise AssertionError(f"the lock holder for {folder} did not take the lock")
    return proc


def cli_text(result: Any) -> str:
    """Everything a CliRunner result says: its output and an exception click did not turn into one."""
    extra = (
        "" if result.exception is None or isinstance(result.exception, SystemExit) else repr(result.exception)
    )
    return result.output + extra


def fails_cleanly(result: Any, *needles: str) -> str:
    """Assert a CLI result is a clear error: exit status 1, no traceback, every needle in the message."""
    text = cli_text(result)
    assert result.exit_code == 1, f"exit {result.exit_code}, expected a clear error: {text.strip()[-300:]}"
    assert "Traceback" not in text and "internal error" not in text, text
    for needle in needles:
        assert needle in text, f"{needle!r} not in the message: {text.strip()[-300:]}"
    return text


def train_tiny(folder: Path, recipe: Path, *overrides: str) -> Path:
    """A tiny run trained through the CLI into ``folder`` (``recipe``: a YAML file); asserts it finished."""
    from click.testing import CliRunner

    from loopformer.cli import cli

    result = CliRunner().invoke(cli, ["train", str(recipe), "-o", str(folder), *overrides])
    assert result.exit_code == 0, cli_text(result)[-600:]
    return folder


def make_sharded(run: Path, dest: Path, aliases: dict[str, str] | None = None) -> Path:
    """``dest/checkpoints/step_N``: ``run``'s newest checkpoint written again as a one-process sharded
    checkpoint (``loopformer.runs.checkpoint.save_sharded``); ``aliases`` are added to its ``state.json``
    ``sharded.aliases`` (the manifest rewritten to match)."""
    import json
    import warnings

    from loopformer.runs.checkpoint import load_checkpoint, save_sharded

    ck = load_checkpoint(newest_checkpoint(run))
    optimizer = torch.optim.AdamW(ck.model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "torch.distributed is disabled ... a single process"
        folder = save_sharded(dest / "checkpoints", ck.step, ck.model, optimizer, ck.config,
                              ck.ema_state, {"stream": {}, "rng": {}}, 0, True)  # fmt: skip
    if aliases:
        state = json.loads((folder / "state.json").read_text())
        state["sharded"]["aliases"].update(aliases)
        (folder / "state.json").write_text(json.dumps(state))
        rewrite_manifest(folder)
    return folder
