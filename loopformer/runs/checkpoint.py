"""Checkpoints: a folder of safetensors + JSON, written atomically, loaded without pickle.

Layout of ``<run>/checkpoints/step_00001000/``:

- ``model.safetensors``  the weights (tied tensors stored once, aliases in the file's metadata);
- ``ema.safetensors``    the EMA weights, when the run keeps an EMA;
- ``config.json``        the resolved ``RunConfig`` plus ``family`` (model registry name), ``step`` and
  ``plugins`` (user modules defining its model / task / loop plug-ins: ``train.plugin_record``);
- ``state.safetensors`` + ``state.json``  everything else a bit-exact resume needs: optimiser
  state, data-stream and curriculum state, RNG states (torch / CUDA / numpy / python), the step,
  and the deep-supervision carry (slot examples, carried states, segment counts). Any nested
  structure of dicts, lists, numbers, strings and tensors is split by ``flatten_state`` into a
  JSON skeleton and a flat tensor table, and joined back by ``unflatten_state``.

A checkpoint is first written to a hidden temporary folder and then renamed into place; the
``latest`` pointer file (the folder's name) is replaced atomically (``loopformer.files``, which also
writes every file inside the folder); only the newest ``keep`` checkpoints are kept. The ``best`` pointer
(``loopformer.runs.best.write_best``: a JSON record naming the step folder of the best evaluation by
``train.keep_best``, its metric, value and step, replaced atomically) protects its folder: pruning never
removes it. Nothing is ever unpickled: safetensors and JSON only.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from loopformer.config import ConfigError, RunConfig, config_to_json, load_config_file
from loopformer.files import (
    WriteError,
    atomic_write_json,
    atomic_write_text,
    check_inside,
    fsync_dir,
    read_json,
)
from loopformer.numerics import check_weights_finite, nonfinite_names
from loopformer.plugins import check_recorded, reading_data
from loopformer.runs.best import best_checkpoint, find_best
from loopformer.runs.layout import (
    _STEP_DIR,
    BEST,
    LATEST,
    CheckpointError,
    check_weights,
    check_weights_subset,
    load_weights,
    save_tensors,
    save_weights,
    step_dirs,
    step_name,
)
from loopformer.runs.manifest import verify_checkpoint, write_manifest
from loopformer.runs.plugin_record import config_extras
from loopformer.runs.sharded import is_sharded, stored_weights
from loopformer.runs.state import flatten_state, unflatten_state

log = logging.getLogger("loopformer.train")




def model_family(model: nn.Module) -> str:
    """The registry name of ``model``'s class (``loopformer.models.registry.MODELS``) or its class name."""
    from loopformer.models.registry import MODELS

    cls = type(getattr(model, "_orig_mod", model))
    for klass in cls.__mro__:  # FSDP2's fully_shard swaps in a subclass ("FSDP<Model>")
        for name, spec in MODELS.items():
            module, class_name, _ = spec.split(":")
            if klass.__module__ == module and klass.__name__ == class_name:
                return name
    return next(k.__name__ for k in cls.__mro__ if not k.__name__.startswith("FSDP"))  # not FSDP2's "FSDP<Model>"




def save_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module | None,
    config: RunConfig,
    ema_state: dict[str, Tensor] | None = None,
    training_state: dict[str, Any] | None = None,
    keep: int = 0,
    weights: dict[str, Tensor] | None = None,
    within: str | Path | None = None,
    family: str | None = None,
) -> Path:
    """Write ``root/step_{step:08d}`` atomically, point ``root/latest`` at it, keep the newest ``keep``.

    ``weights``: the tensors to store instead of ``model.state_dict()`` (full tensors gathered
    from FSDP shards). ``model`` None: ``weights`` and ``family`` name what is stored. ``within``: the run folder nothing may leave through a symbolic link
    (default: the parent of a ``checkpoints`` root, else ``root``). A failed write (disk full)
    removes the partial folder and leaves the earlier checkpoints and ``latest`` as they were.
    """
    root = Path(root)
    within = (root.parent if root.name == "checkpoints" else root) if within is None else within
    check_inside(root / LATEST, within)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    name = step_name(step)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except OSError as err:
        raise WriteError(err.errno, err.strerror, str(tmp)) from None
    if model is not None:  # else weights and family name what is stored
        family, weights = model_family(model), getattr(model, "_orig_mod", model).state_dict() if weights is None else weights
    try:
        base = getattr(model, "_orig_mod", model)
        extra = config_extras(base, config, family, step) if model is not None else {"family": family, "step": step}
        _write_step_folder(tmp, step, family, config, ema_state, training_state, weights, extra)
    except WriteError as err:  # named by the checkpoint it was for, not the hidden temporary folder
        shutil.rmtree(tmp, ignore_errors=True)  # a failed write leaves no partial folder behind
        file = Path(str(err.filename)).name
        raise WriteError(err.errno, err.strerror, str(root / name / file)) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = root / name
    publish(root, tmp, final, keep, within)
    return final


def publish(root: Path, tmp: Path, final: Path, keep: int, within: str | Path | None = None) -> None:
    """Rename the complete folder ``tmp`` to ``final``, point ``root/latest`` at it, keep the newest ``keep``."""
    within = (root.parent if root.name == "checkpoints" else root) if within is None else within
    if final.exists():  # re-saving a step (after a resume): one exchange, the step folder never missing
        from loopformer.runs.outputs import exchange_folders

        if exchange_folders(tmp, final):
            shutil.rmtree(tmp, ignore_errors=True)  # it holds the old folder now
        else:  # no exchange on this OS / file system: two renames
            trash = root / f".tmp-{final.name}-old-{os.getpid()}"
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    atomic_write_text(root / LATEST, final.name + "\n", root=within)
    fsync_dir(root)
    if keep > 0:
        best = best_checkpoint(root)  # the best evaluation's folder (train.keep_best) is never pruned
        for old in step_dirs(root)[:-keep]:
            if old != final and old != best:
                shutil.rmtree(old, ignore_errors=True)


def _write_step_folder(
    tmp: Path,
    step: int,
    family: str,
    config: RunConfig,
    ema_state: dict[str, Tensor] | None,
    training_state: dict[str, Any] | None,
    weights: dict[str, Tensor],
    extra: dict[str, Any],
) -> None:
    save_weights(weights, tmp / "model.safetensors", {"family": family, "step": str(step)}, tmp)
    if ema_state is not None:
        save_weights(ema_state, tmp / "ema.safetensors", {"family": family, "step": str(step)}, tmp)
    # extra: family, step and the user modules a fresh process must import (loopformer.runs.plugin_record)
    atomic_write_text(tmp / "config.json", config_to_json(config, **extra), root=tmp)
    skeleton, tensors = flatten_state({"step": step, **(training_state or {})})
    save_tensors(tensors, tmp / "state.safetensors", None, tmp)
    atomic_write_json(tmp / "state.json", skeleton, root=tmp)
    write_manifest(tmp)  # sizes + SHA-256 of every file, fsynced: a resume verifies before it trusts
    fsync_dir(tmp)


def _pointer_target(root: Path) -> Path | None:
    """The step folder ``root/latest`` names: a plain ``step_N`` name inside ``root`` only (an
    absolute path, ``..`` or anything else is ignored with a warning, never followed)."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        name = None
    if name is None or not _STEP_DIR.match(name):
        log.warning("%s does not hold a step_N folder name; ignoring it", pointer)
        return None
    target = root / name
    return target if target.is_dir() else None


def latest_checkpoint(root: str | Path) -> Path | None:
    """The folder ``root/latest`` points to (or the newest step folder), None when there is none."""
    root = Path(root)
    target = _pointer_target(root)
    if target is not None:
        return target
    dirs = step_dirs(root)
    return dirs[-1] if dirs else None


def candidate_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint folders under ``root``, newest first (the ``latest`` pointer's target leads)."""
    root = Path(root)
    dirs = step_dirs(root)[::-1]
    target = _pointer_target(root)
    if target is not None and target in dirs:
        dirs.remove(target)
        dirs.insert(0, target)
    return dirs


def latest_good_checkpoint(root: str | Path) -> tuple[Path | None, list[str]]:
    """(the newest checkpoint under ``root`` that verifies and holds finite weights, the reasons the
    newer ones were skipped: "step_N: why")."""
    skipped = []
    for folder in candidate_checkpoints(root):
        why = verify_checkpoint(folder) or _nonfinite_reason(folder)
        if why is None:
            return folder, skipped
        named = folder / why.split(" ", 1)[0]  # the file the reason is about, when it names one
        skipped.append(f"{named if named.is_file() else folder}: {why}")
    return None, skipped


def _nonfinite_reason(folder: Path) -> str | None:
    if is_sharded(folder):  # each rank checked its own shards before writing (resume.save)
        return None
    try:
        bad = nonfinite_names(load_weights(folder / "model.safetensors"))
    except CheckpointError as err:
        return str(err)
    return f"non-finite weights ({bad[0]!r})" if bad else None



def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from: the folder itself, a ``checkpoints/`` root, a run folder, or a
    ``loopformer run`` folder (its looped model lives in ``model/``, the baseline in ``baseline/``)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_file() and path.name == BEST:  # checkpoints/best: the folder it points to
        return find_best(path)[0]
    if (path / "model.safetensors").is_file() or is_sharded(path):
        return path
    for root in (path, path / "checkpoints", path / "model" / "checkpoints"):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise CheckpointError(f"{path} holds no checkpoint (no model.safetensors, no step_* folders)")


@dataclass
class Checkpoint:
    """A loaded checkpoint: the model (with the chosen weights), its config and metadata."""

    path: Path
    step: int
    family: str
    config: RunConfig
    model: nn.Module
    ema_state: dict[str, Tensor] | None
    weights: str  # "model" or "ema": which weights ``model`` holds


def read_checkpoint_config(path: str | Path, check: bool = False) -> tuple[RunConfig, str, int]:
    """(RunConfig, family, step) from a checkpoint's ``config.json``. The plug-in modules it records must
    already be imported by the user (``loopformer.plugins.check_recorded``): nothing a checkpoint names is
    imported, and a ``module:Class`` name in it resolves only against imported modules."""
    folder = resolve_checkpoint(path)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"checkpoint {folder} has no config.json")
    raw = read_json(cfg_path, CheckpointError)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path} does not hold a config object")
    step = raw.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{cfg_path}: 'step' must be a non-negative integer")
    plugins = raw.get("plugins", [])
    if not isinstance(plugins, list) or not all(isinstance(m, str) for m in plugins):
        raise CheckpointError(f"{cfg_path}: 'plugins' must be a list of module names")
    where = f"checkpoint {cfg_path}"
    with reading_data(where):
        check_recorded(plugins, where)
        try:
            config = load_config_file(cfg_path, check=check)
        except ConfigError as err:
            raise CheckpointError(f"{cfg_path}: {err}") from None
    return config, str(raw.get("family", "")), step


def verified(folder: Path) -> Path:
    """``folder`` after checking it against its manifest; CheckpointError naming what is wrong."""
    why = verify_checkpoint(folder)
    if why is not None:
        name = why.split(" ", 1)[0]
        where = folder / name if (folder / name).exists() else folder
        raise CheckpointError(f"checkpoint file {where} is corrupt or truncated: {why}")
    return folder


def load_checkpoint(
    path: str | Path,
    model: nn.Module | None = None,
    use_ema: bool = False,
    device: torch.device | str = "cpu",
) -> Checkpoint:
    """Load a checkpoint (folder, ``checkpoints/`` root or run folder).

    ``model``: load into this model (its family and every parameter shape must match); None
    builds the model from the checkpoint's config. ``use_ema``: load the EMA weights when the
    checkpoint has them. Raises CheckpointError naming the file or parameter at fault.
    """
    folder = verified(resolve_checkpoint(path))
    config, family, step = read_checkpoint_config(folder)
    if model is None:
        model = build_stored_model(folder, family, config)
    else:
        given = model_family(model)
        if family and given != family:
            raise CheckpointError(
                f"checkpoint {folder} holds a {family!r} model, but the given model is {given!r}"
            )
    ema_state, weights = load_stored_weights(folder, model, use_ema, device)
    return Checkpoint(folder, step, family, config, model, ema_state, weights)


def build_stored_model(folder: Path, family: str, config: RunConfig) -> nn.Module:
    """The model a checkpoint's config describes, untrained (its family must be registered)."""
    from loopformer.models.registry import build_model, known_model

    if not known_model(family):
        raise CheckpointError(
            f"checkpoint {folder} holds a {family!r} model, which is not in the model registry; "
            "pass the model to load into"
        )
    return build_model(config.model.name, config=config.model_config())


def load_stored_weights(
    folder: Path, model: nn.Module, use_ema: bool, device: torch.device | str
) -> tuple[dict[str, Tensor] | None, str]:
    """Load a verified checkpoint folder's weights into ``model`` (moved to ``device``; float64 kept for a
    float64 checkpoint), the EMA weights when ``use_ema`` and the checkpoint keeps them; returns (the EMA
    table or None, which weights the model holds: "model" | "ema")."""
    weights_file, ema_state = stored_weights(folder)  # a full or a sharded checkpoint
    floats = [t.dtype for t in weights_file.values() if t.is_floating_point()]
    if floats and all(d == torch.float64 for d in floats):
        model.to(torch.float64)  # a float64 checkpoint (a converted one) is not rounded on load
    model.to(device)
    check_weights(weights_file, model, str(folder))
    model.load_state_dict(weights_file, strict=True)
    if ema_state is not None:
        check_weights_subset(ema_state, model, f"{folder} (EMA weights)")
    weights = "model"
    if use_ema and ema_state is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in ema_state:
                    p.copy_(ema_state[name].to(p.device))
        weights = "ema"
    check_weights_finite(model.state_dict(), f"checkpoint {folder} ({weights} weights)")
    return ema_state, weights


def load_training_state(path: str | Path) -> dict[str, Any]:
    """The nested training state saved by ``save_checkpoint`` (tensors on CPU)."""
    folder = verified(resolve_checkpoint(path))
    json_path, tensor_path = folder / "state.json", folder / "state.safetensors"
    if not json_path.is_file():
        raise CheckpointError(f"checkpoint {folder} has no state.json (not a training checkpoint?)")
    from loopformer.runs.records import check_state

    skeleton = check_state(read_json(json_path, CheckpointError), json_path)
    tensors = load_weights(tensor_path) if tensor_path.is_file() else {}
    try:
        return unflatten_state(skeleton, tensors)
    except KeyError as err:
        raise CheckpointError(f"{json_path} names the tensor {err.args[0]!r}, which {tensor_path} does not hold") from None
    except TypeError as err:
        raise CheckpointError(f"{json_path} does not match {tensor_path} ({type(err).__name__})") from None
