"""A checkpoint on disk, at the level of names and tensor files (what every other storage module builds on).

- names: a checkpoint folder is ``step_00001000`` (``step_name``, ``step_dirs``) under ``<run>/checkpoints/``,
  beside the ``latest`` pointer (a file naming the newest folder) and the ``best`` record (``train.keep_best``);
- ``CheckpointError``: a missing, corrupt or mismatched checkpoint, the message naming the file or parameter;
- safetensors files, written atomically (``loopformer.files``) and read without pickle: ``save_weights``
  stores tensors that share storage (tied weights) once, with aliases in the file's metadata;
  ``load_weights`` restores them;
- loading a stored tensor into a model's must not change its values: ``check_weights`` /
  ``check_weights_subset`` (names, shapes) and ``dtype_problem`` (a float64 tensor in a float32 model would be
  rounded silently by ``load_state_dict``; an integer tensor where the model has a float one is no checkpoint
  of that model).
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from loopformer.files import WriteError, atomic_path

LATEST = "latest"


BEST = "best"


_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A missing, corrupt or mismatched checkpoint; the message names the file or parameter."""


def save_weights(
    tensors: dict[str, Tensor],
    path: str | Path,
    metadata: dict[str, str] | None = None,
    root: str | Path | None = None,
) -> None:
    """safetensors file of ``tensors``, written atomically (``loopformer.files``; ``root``: the folder it
    must stay inside); tensors sharing storage (tied weights) are stored once."""
    unique: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in tensors.items():
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())) if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        unique[name] = t.detach().to("cpu", copy=True).contiguous()
    meta = dict(metadata or {})
    meta["aliases"] = json.dumps(aliases)
    save_tensors(unique, Path(path), meta, root)


def save_tensors(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str] | None, root: Any) -> None:
    with atomic_path(path, root) as tmp:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except SafetensorError as err:  # safetensors reports a failed write (disk full) as its own error
            code = re.search(r"os error (\d+)", str(err))
            number = int(code.group(1)) if code else errno.EIO
            raise WriteError(number, os.strerror(number) if code else str(err), str(path)) from None


def load_weights(path: str | Path) -> dict[str, Tensor]:
    """Tensors of a safetensors file (aliases restored); CheckpointError naming a bad file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} does not exist")
    try:
        from safetensors import safe_open

        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"checkpoint file {path} is corrupt or truncated: {err}") from None
    try:
        aliases = json.loads(meta.get("aliases", "{}"))
        for alias, target in aliases.items():
            tensors[str(alias)] = tensors[target]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"checkpoint file {path} has corrupt alias metadata") from None
    return tensors


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_problem(name: str, stored: Tensor, target: Tensor) -> str | None:
    """Why loading ``stored`` into ``target`` would change its values, or None: an integer or boolean
    tensor for a floating one (or back), or a float rounded to a narrower one (a float64 tensor in a
    float32 model). Widening (bf16 -> float32) is exact and allowed."""
    if stored.dtype == target.dtype:
        return None
    if stored.is_floating_point() != target.is_floating_point() or stored.is_complex() != target.is_complex():
        return f"parameter {name!r} is {_name(stored.dtype)} in the checkpoint but {_name(target.dtype)} in the model"
    if stored.is_floating_point() and torch.finfo(stored.dtype).bits > torch.finfo(target.dtype).bits:
        return (
            f"parameter {name!r} is {_name(stored.dtype)} in the checkpoint but the model is "
            f"{_name(target.dtype)} (as the checkpoint's other tensors): loading would round it; store every "
            "floating tensor in one dtype"
        )
    return None


def check_weights(weights: dict[str, Tensor], model: nn.Module, source: str) -> None:
    """Names and shapes of ``weights`` against ``model.state_dict()``; CheckpointError on mismatch."""
    expected = {k: v for k, v in model.state_dict().items()}
    missing = [k for k in expected if k not in weights]
    unexpected = [k for k in weights if k not in expected]
    if missing or unexpected:
        raise CheckpointError(
            f"{source} does not match {type(model).__name__}: missing parameters {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    for name, t in weights.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{source}: parameter {name!r} has shape {tuple(t.shape)} in the checkpoint "
                f"but {tuple(expected[name].shape)} in the model"
            )
        if (problem := dtype_problem(name, t, expected[name])) is not None:
            raise CheckpointError(f"{source}: {problem}")


def check_weights_subset(weights: dict[str, Tensor], model: nn.Module, source: str) -> None:
    """EMA tables hold parameters only: every entry must be a parameter of matching shape."""
    params = dict(model.named_parameters())
    for name, t in weights.items():
        if name not in params:
            raise CheckpointError(f"{source}: {name!r} is not a parameter of {type(model).__name__}")
        if tuple(t.shape) != tuple(params[name].shape):
            raise CheckpointError(
                f"{source}: parameter {name!r} has shape {tuple(t.shape)} in the checkpoint "
                f"but {tuple(params[name].shape)} in the model"
            )
        if (problem := dtype_problem(name, t, params[name])) is not None:
            raise CheckpointError(f"{source}: {problem}")


def load_weights_into(model: nn.Module, path: str | Path) -> None:
    weights = load_weights(path)
    check_weights(weights, model, str(path))
    model.load_state_dict(weights, strict=True)


def step_name(step: int) -> str:
    """The checkpoint folder name of ``step``: ``step_00001000``."""
    return f"step_{step:08d}"


def step_dirs(root: str | Path) -> list[Path]:
    """Checkpoint folders under ``root`` sorted by step (oldest first)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]
