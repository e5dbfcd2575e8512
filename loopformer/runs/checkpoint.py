"""Checkpoints, one owner: writing, verifying and reading them, the best one, and sharded ones.

A checkpoint is the folder ``<run>/checkpoints/step_00001000/`` (``step_name``, ``step_dirs``), beside the
``latest`` pointer (a file naming the newest folder) and the ``best`` record (``train.keep_best``). It holds
safetensors and JSON only; nothing is ever unpickled:

- ``model.safetensors``  the weights (tensors sharing storage, tied weights, stored once, with aliases in the
  file's metadata: ``save_weights`` / ``load_weights``);
- ``ema.safetensors``    the EMA weights, when the run keeps an EMA;
- ``config.json``        the resolved ``RunConfig`` plus ``family`` (the model registry's name), ``step`` and
  ``plugins`` (the user modules defining its model / task / loop plug-ins / training mode, ``plugin_modules``:
  ``read_checkpoint_config`` requires them imported, so a fresh process rebuilds a plug-in model after
  ``--import``, ``loopformer.plugins``);
- ``state.safetensors`` + ``state.json``  the training state a bit-exact resume needs, as the trainer hands it
  over (its ``state_dict()``: optimiser, data stream, curriculum, the mode's carry, RNG states, the step, the
  elapsed time, the metrics since the last log, the best so far, the data fingerprints). Any nested structure
  of dicts, lists, numbers, strings and tensors is split by ``flatten_state`` into a JSON skeleton and a flat
  tensor table, and joined back by ``unflatten_state``; the skeleton is checked against ``StateRecord``;
- ``manifest.json``      written last: the size and SHA-256 of every file (``{"format": 1, "files": {name:
  {"size", "sha256"}}}``). ``verify_checkpoint`` says why a folder is unusable (never quoting a file it
  could not parse) or None: the manifest parses, names only plain file names inside the folder, and every
  file it lists has that size and hash (a folder without a manifest, from before manifests, verifies when
  its JSON files parse). Nothing in a checkpoint is used before it verifies.

Writing (``save_checkpoint``): the folder is built as a hidden temporary folder, every file through
``loopformer.files`` (atomic, fsynced), then renamed into place (re-saving a step exchanges the two folders in
one step); ``latest`` is replaced atomically and only the newest ``keep`` checkpoints are kept, never the
best one. A failed write (disk full) removes the partial folder and leaves the earlier checkpoints and
``latest`` as they were. After a divergence ``quarantine_after`` renames the checkpoints written from the
failed step on.

Reading: loading a stored tensor into a model must not change its values (``check_weights``: names, shapes,
and ``dtype_problem``: a float64 tensor in a float32 model would be rounded silently by
``load_state_dict``; an integer tensor where the model has a float one is no checkpoint of that model).

The best checkpoint (``train.keep_best``): the FPRM authors save the EMA weights at every evaluation
(``checkpoint_every_eval: true`` in nilskiKonjIzDunava/fprm ``config/cfg_pretrain_*.yaml``) and publish the one
with the best test metric (their model card: "best test metric"); their code picks nothing itself. Here
``BestTracker.consider`` compares each evaluation the trainer runs with the best so far; a strictly better
value (NaN never is) makes the trainer checkpoint that step and point ``checkpoints/best`` at it
(``BestTracker.mark``: a JSON record of the folder, metric, value, step and max / min, replaced atomically). The
record travels in every checkpoint's training state, so a resumed run keeps comparing against the same best.

Sharded checkpoints (``train.strategy=fsdp``; ``train.checkpoint_format`` "auto" or "sharded"): no gathering
of full tensors on rank 0. ``save_sharded`` takes the model's and the optimiser's state dicts from
``torch.distributed.checkpoint.state_dict.get_state_dict`` (DTensor shards, keyed by parameter name) plus the
EMA, and ``dcp.save``s them with DCP's safetensors storage (``HuggingFaceStorageWriter(save_distributed=True)``):
rank ``r`` writes ``shard-0000{r+1}-model-00001-of-00001.safetensors`` holding its pieces, each file's header
recording every piece's offsets in the full tensor. No pickle (DCP's default ``.metadata`` file is one; this
format has none). Keys in the shards: ``model.<name>``, ``ema.<name>``, ``optim.<name>.<key>``; a tied weight is
stored once (``sharded.aliases`` in ``state.json``, which also holds the optimiser's non-tensor part,
``optimizer_layout: "dcp"`` and the world size). Rank 0 creates ``.tmp-step_N-sharded`` (a name every rank
knows), every rank writes its shard into it through ``loopformer.files.atomic_path``, rank 0 adds the rest and
the manifest and renames the folder into place; a write that fails on any rank fails ``dcp.save`` on every
rank and leaves no folder. ``load_sharded`` restores a live model / optimiser / EMA on any world size (one
process included); ``read_full`` rebuilds the full tensors in one process (``eval``, ``push``) and
``consolidate`` writes them as a full checkpoint (optimiser layout ``fsdp_full``). Needs
``torch.distributed.checkpoint.hf_storage`` (torch >= 2.9).

The JSON records read back here (``config.json``'s own fields, ``state.json``, ``checkpoints/best``) are
dataclasses (``StoredConfig``, ``StateRecord``, ``BestRecord``) checked by the configuration's strict loader
(``loopformer.config.strict.check_record`` / ``read_record``, which also read the run folder's records and the
reports'), so a malformed or crafted file is one line naming the file and the field, never a bare key name or an
internal error.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import sys
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as tdist
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import Tensor, nn

from loopformer.config import ConfigError, RunConfig, config_to_json, load_config_file
from loopformer.config.strict import Record, check_record, read_record
from loopformer.files import (
    Count,
    JSONNumber,
    JSONStr,
    WriteError,
    atomic_path,
    atomic_write_json,
    atomic_write_text,
    check_inside,
    exchange_folders,
    fsync_dir,
    read_json,
    regular_file,
)
from loopformer.numerics import check_weights_finite, nonfinite_names
from loopformer.plugins import check_recorded, reading_data

log = logging.getLogger("loopformer.train")

LATEST = "latest"
BEST = "best"
MANIFEST = "manifest.json"
REQUIRED = ("model.safetensors", "config.json")
STEP_DIR = re.compile(r"^step_(\d+)$")
SHARD_PREFIX = "shard-"
SHARD_SUFFIX = ".safetensors"
SHARDED_LAYOUT = "dcp"  # the optimizer_layout of a sharded checkpoint


class CheckpointError(RuntimeError):
    """A missing, corrupt or mismatched checkpoint; the message names the file or parameter."""


def step_name(step: int) -> str:
    """The checkpoint folder name of ``step``: ``step_00001000``."""
    return f"step_{step:08d}"


def step_dirs(root: str | Path) -> list[Path]:
    """Checkpoint folders under ``root`` sorted by step (oldest first)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


# --------------------------------------------------------------------------------------------
# The records run storage reads back: dataclasses checked by the configuration's strict loader
# (loopformer.config.strict: Record, check_record, read_record)
# --------------------------------------------------------------------------------------------
@dataclass
class BestRecord(Record):
    """``checkpoints/best``: the step folder of the best evaluation by ``train.keep_best``."""

    checkpoint: JSONStr
    metric: JSONStr
    value: JSONNumber
    step: Count
    mode: Literal["max", "min"] = "max"

    def __post_init__(self) -> None:
        if STEP_DIR.match(self.checkpoint) is None:
            raise ValueError(f"checkpoint: expected a step_N folder name, got {self.checkpoint!r}")


@dataclass
class _MeterState(Record):
    sums: dict[str, JSONNumber]
    counts: dict[str, Count]
    host: dict


@dataclass
class _ShardState(Record):
    world_size: Count = 1
    aliases: dict[str, JSONStr] = field(default_factory=dict)
    ema: bool = False


@dataclass
class StateRecord(Record):
    """A checkpoint's ``state.json``: the skeleton of the training state (tensors are ``{"__tensor__": key}``)."""

    step: Count
    stream: dict = field(default_factory=dict)
    rng: dict = field(default_factory=dict)
    optimizer: dict = field(default_factory=dict)
    optimizer_layout: JSONStr = "torch"
    curriculum: dict | None = None
    carry: dict | list | None = None
    elapsed: JSONNumber | None = None
    best: dict | None = None
    data: dict | None = None
    meter: _MeterState | None = None  # the metrics summed since the last logged record
    sharded: _ShardState | None = None


@dataclass
class StoredConfig(Record):
    """A checkpoint's ``config.json``: what is recorded beside the resolved ``RunConfig`` (whose sections the
    configuration's loader reads itself)."""

    family: JSONStr = ""
    step: Count = 0
    plugins: list[JSONStr] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Tensor files
# --------------------------------------------------------------------------------------------
def save_weights(
    tensors: dict[str, Tensor],
    path: str | Path,
    metadata: dict[str, str] | None = None,
    root: str | Path | None = None,
) -> None:
    """safetensors file of ``tensors``, written atomically (``loopformer.files``; ``root``: the folder it
    must stay inside); tensors sharing storage (tied weights) are stored once."""
    stored, aliases = tied(tensors.items())
    meta = dict(metadata or {})
    meta["aliases"] = json.dumps(aliases)
    save_tensors({n: t.detach().to("cpu", copy=True).contiguous() for n, t in stored.items()}, Path(path), meta, root)


def tied(items: Iterable[tuple[str, Tensor]]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """(the tensors of ``items`` to store, aliases: name -> the stored name it shares storage with): a tied weight
    (the same memory, dtype, shape and strides; a DTensor's by its local shard) is stored once."""
    stored: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in items:
        local = t.to_local() if hasattr(t, "to_local") else t
        key = (local.device, local.data_ptr(), t.dtype, tuple(t.shape), tuple(local.stride()))
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        if t.numel():
            seen[key] = name
        stored[name] = t
    return stored, aliases


def save_tensors(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str] | None, root: Any) -> None:
    """``tensors`` as the safetensors file ``path``, atomically; a failed write is a ``WriteError``."""
    with atomic_path(path, root) as tmp:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except SafetensorError as err:  # safetensors reports a failed write (disk full) as its own error
            code = re.search(r"os error (\d+)", str(err))
            number = int(code.group(1)) if code else errno.EIO
            raise WriteError(number, os.strerror(number) if code else str(err), str(path)) from None


def load_weights(path: str | Path, model: nn.Module | None = None, subset: bool = False) -> dict[str, Tensor]:
    """Tensors of a safetensors file (aliases restored); CheckpointError naming a bad file. An alias only adds a
    name for a stored tensor (a tied weight): one naming a stored tensor, or a tensor the file does not hold, is
    refused. ``model``: the names and shapes the file's header declares (safetensors checks them against the
    bytes it holds) are checked against ``model`` (``check_weights``; ``subset``: an EMA table) before any
    tensor is read; their dtypes once read (a float64 file makes a float64 model: ``load_stored_weights``)."""
    from safetensors import safe_open

    path = regular_file(path, CheckpointError, "checkpoint file")
    try:
        with safe_open(str(path), framework="pt") as handle:
            names = list(handle.keys())
            try:
                aliases = json.loads((handle.metadata() or {}).get("aliases", "{}"))
            except (ValueError, RecursionError):
                aliases = None
            check_aliases(aliases, names, f"checkpoint file {path}", "the file")
            if model is not None:
                shapes = {n: torch.empty(handle.get_slice(n).get_shape(), device="meta") for n in names}
                shapes.update({alias: shapes[target] for alias, target in aliases.items()})
                check_weights(shapes, model, str(path), subset, dtypes=False)
            tensors = {n: handle.get_tensor(n) for n in names}
    except CheckpointError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"checkpoint file {path} is corrupt or truncated: {err}") from None
    return {**tensors, **{alias: tensors[target] for alias, target in aliases.items()}}


def check_aliases(aliases: Any, stored: Collection[str], where: str, holder: str) -> None:
    """``aliases`` (the aliases metadata of a safetensors file or of a sharded checkpoint's ``state.json``: alias
    -> the stored tensor it names) only add names for tied weights stored once: an alias that is a stored tensor
    itself, or names one ``holder`` does not hold (``stored``), is refused naming ``where``."""
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        raise CheckpointError(f"{where} has corrupt alias metadata")
    for alias, target in aliases.items():
        if alias in stored or target not in stored:
            why = "is a stored tensor itself" if alias in stored else f"names {target!r}, which {holder} does not hold"
            raise CheckpointError(f"{where}: the alias {alias!r} {why}; an alias only names a tied weight stored "
                                  "once (a crafted or damaged file)")  # fmt: skip


def check_storage(state: dict[str, Tensor], source: str) -> None:
    """Every tensor of ``state`` (``torch.load``-ed, memory-mapped: not read yet) holds the bytes its shape
    needs in its own storage; a view that does not (``zeros(1).expand(10**5, 10**6)``: 400 GB from 4 bytes,
    stride 0) is refused naming the key before any operation materialises it."""
    for name, t in state.items():
        have = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
        if t.numel() * t.element_size() > have:
            raise CheckpointError(
                f"{source}: tensor {name!r} of shape {tuple(t.shape)} needs {t.numel() * t.element_size():,} bytes "
                f"but its storage holds {max(have, 0):,} (a strided or expanded view, stride {tuple(t.stride())}); "
                f"refusing to materialise it: save the tensor itself (.contiguous())"
            )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_problem(name: str, stored: Tensor, target: Tensor) -> str | None:
    """Why loading ``stored`` into ``target`` would change its values, or None: an integer or boolean
    tensor for a floating one (or back), or a float rounded to a narrower one (a float64 tensor in a
    float32 model). Widening (bf16 -> float32) is exact and allowed."""
    if stored.dtype == target.dtype:
        return None
    if stored.is_floating_point() != target.is_floating_point() or stored.is_complex() != target.is_complex():
        return (
            f"parameter {name!r} is {_dtype_name(stored.dtype)} in the checkpoint but "
            f"{_dtype_name(target.dtype)} in the model"
        )
    if stored.is_floating_point() and torch.finfo(stored.dtype).bits > torch.finfo(target.dtype).bits:
        return (
            f"parameter {name!r} is {_dtype_name(stored.dtype)} in the checkpoint but the model is "
            f"{_dtype_name(target.dtype)} (as the checkpoint's other tensors): loading would round it; store "
            "every floating tensor in one dtype"
        )
    return None


def check_weights(weights: dict[str, Tensor], model: nn.Module, source: str, subset: bool = False,
                  dtypes: bool = True) -> None:  # fmt: skip
    """Names, shapes and (``dtypes``) dtypes of ``weights`` against ``model.state_dict()``; CheckpointError on
    mismatch. ``subset``: an EMA table, which holds parameters only (every entry must be a parameter)."""
    expected = dict(model.named_parameters()) if subset else dict(model.state_dict())
    missing = [] if subset else [k for k in expected if k not in weights]
    unexpected = [k for k in weights if k not in expected]
    if subset and unexpected:
        raise CheckpointError(f"{source}: {unexpected[0]!r} is not a parameter of {type(model).__name__}")
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
        if dtypes and (problem := dtype_problem(name, t, expected[name])) is not None:
            raise CheckpointError(f"{source}: {problem}")


# --------------------------------------------------------------------------------------------
# Training state: nested state <-> (JSON skeleton, tensor table); RNG states
# --------------------------------------------------------------------------------------------
def flatten_state(obj: Any, tensors: dict[str, Tensor] | None = None, prefix: str = "s") -> tuple[Any, dict]:
    """Replace every tensor in ``obj`` by ``{"__tensor__": key}``; returns (skeleton, tensors)."""
    tensors = {} if tensors is None else tensors
    if isinstance(obj, Tensor):
        tensors[prefix] = obj.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": prefix}, tensors
    if isinstance(obj, np.ndarray):
        tensors[prefix] = torch.from_numpy(np.ascontiguousarray(obj).copy())
        return {"__ndarray__": prefix}, tensors
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: flatten_state(v, tensors, f"{prefix}.{k}")[0] for k, v in obj.items()}, tensors
        if all(isinstance(k, int) and not isinstance(k, bool) for k in obj):
            items = {str(k): flatten_state(v, tensors, f"{prefix}.{k}")[0] for k, v in obj.items()}
            return {"__intdict__": items}, tensors
        raise TypeError(f"cannot checkpoint a dict with keys {list(obj)[:5]} at {prefix}")
    if isinstance(obj, list | tuple):
        items = [flatten_state(v, tensors, f"{prefix}.{i}")[0] for i, v in enumerate(obj)]
        return (items if isinstance(obj, list) else {"__tuple__": items}), tensors
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj, tensors
    if isinstance(obj, np.integer | np.floating | np.bool_):
        return obj.item(), tensors
    raise TypeError(f"cannot checkpoint a {type(obj).__name__} at {prefix} (tensors, numbers, strings only)")


def unflatten_state(skeleton: Any, tensors: dict[str, Tensor]) -> Any:
    """Inverse of ``flatten_state``."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {"__tensor__"}:
            return tensors[skeleton["__tensor__"]]
        if set(skeleton) == {"__ndarray__"}:
            return tensors[skeleton["__ndarray__"]].numpy()
        if set(skeleton) == {"__intdict__"}:
            return {int(k): unflatten_state(v, tensors) for k, v in skeleton["__intdict__"].items()}
        if set(skeleton) == {"__tuple__"}:
            return tuple(unflatten_state(v, tensors) for v in skeleton["__tuple__"])
        return {k: unflatten_state(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten_state(v, tensors) for v in skeleton]
    return skeleton


def rng_state() -> dict[str, Any]:
    """torch (CPU and every CUDA device), numpy and python RNG states as tensors / lists."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(state["torch"].to(torch.uint8))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.to(torch.uint8) for t in state["cuda"]])


# --------------------------------------------------------------------------------------------
# The manifest
# --------------------------------------------------------------------------------------------
def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path) -> None:
    """``folder/manifest.json`` for every regular file in ``folder`` (fsynced before it is written)."""
    files = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != MANIFEST:
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
            files[path.name] = {"size": path.stat().st_size, "sha256": file_digest(path)}
    atomic_write_json(folder / MANIFEST, {"format": 1, "files": files}, root=folder, indent=1)


def _json_ok(path: Path) -> str | None:
    try:
        read_json(path)
    except ValueError as err:
        return f"{path.name} is not valid UTF-8 JSON ({str(err).removeprefix(str(path)).lstrip(': ')})"
    return None


def verify_checkpoint(folder: Path, hashes: bool = True) -> str | None:
    """Why ``folder`` is not a usable checkpoint (None when it verifies); see the module docstring."""
    if not folder.is_dir():
        return "not a folder"
    for name in REQUIRED:
        if name == "model.safetensors" and any(folder.glob(f"{SHARD_PREFIX}*{SHARD_SUFFIX}")):
            continue  # a sharded checkpoint: its weights are in the shards
        if not (folder / name).is_file():
            return f"{name} is missing"
    manifest = folder / MANIFEST
    if not (manifest.exists() or manifest.is_symlink()):
        for name in ("config.json", "state.json"):
            if (folder / name).is_file() and (why := _json_ok(folder / name)):
                return why
        return None
    try:
        files = read_json(manifest)["files"]
        entries = [(str(name), int(spec["size"]), str(spec["sha256"])) for name, spec in files.items()]
    except ValueError as err:  # unreadable, not JSON, nested too deeply (loopformer.files.read_json)
        return f"{MANIFEST} is corrupt ({str(err).removeprefix(str(manifest)).lstrip(': ')})"
    except (KeyError, TypeError, AttributeError) as err:
        return f"{MANIFEST} is corrupt ({type(err).__name__})"
    for name, size, digest in entries:
        if Path(name).name != name or name in ("", ".", ".."):
            return f"{MANIFEST} names {name!r}, which is not a file inside the checkpoint"
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{name} has {actual} bytes, the manifest says {size} (truncated or replaced)"
        if hashes and file_digest(path) != digest:
            return f"{name} does not match its SHA-256 in the manifest (corrupt)"
    return None


def verified(folder: Path, require_manifest: bool = False) -> Path:
    """``folder`` after checking it against its manifest; CheckpointError naming what is wrong. A folder without
    a manifest (written before manifests, or its manifest removed) cannot be verified: a warning says so, or a
    CheckpointError when ``require_manifest`` (``--verify``)."""
    why = verify_checkpoint(folder)
    if why is not None:
        name = why.split(" ", 1)[0]
        where = folder / name if (folder / name).exists() else folder
        raise CheckpointError(f"checkpoint file {where} is corrupt or truncated: {why}")
    if not ((folder / MANIFEST).exists() or (folder / MANIFEST).is_symlink()):
        if require_manifest:
            raise CheckpointError(f"checkpoint {folder} has no {MANIFEST}, so its files cannot be verified "
                                  "(--verify / verify=True refuses it)")  # fmt: skip
        log.warning("checkpoint %s has no %s: its files are UNVERIFIED (written before manifests, or the manifest "
                    "was removed); --verify refuses such a checkpoint", folder, MANIFEST)  # fmt: skip
    return folder


def manifest_bytes(folder: Path) -> bytes | None:
    """The manifest of ``folder`` as it is now (None without one): what ``unchanged_since`` compares."""
    try:
        return (folder / MANIFEST).read_bytes()
    except OSError:
        return None


def unchanged_since(folder: Path, manifest: bytes | None) -> None:
    """CheckpointError when ``folder`` was removed or replaced since its manifest read ``manifest`` (a training
    in that run rotating its checkpoints while another command reads one)."""
    if not folder.is_dir() or manifest_bytes(folder) != manifest:
        raise CheckpointError(
            f"checkpoint {folder} was removed or replaced while it was being read (a training in that run "
            f"rotates its checkpoints: train.keep_checkpoints); run the command again, or name a checkpoint "
            f"that is kept (checkpoints/best)"
        )


# --------------------------------------------------------------------------------------------
# What a checkpoint's config.json records beside the config
# --------------------------------------------------------------------------------------------
def _base(model: nn.Module) -> nn.Module:
    """The model itself under a ``torch.compile`` wrapper (``_orig_mod``)."""
    return getattr(model, "_orig_mod", model)


def model_family(model: nn.Module) -> str:
    """The registry name of ``model``'s class (``loopformer.models.registry.MODELS``) or its class name."""
    from loopformer.models.registry import MODELS

    cls = type(_base(model))
    for klass in cls.__mro__:  # FSDP2's fully_shard swaps in a subclass ("FSDP<Model>")
        for name, spec in MODELS.items():
            module, class_name, _ = spec.split(":")
            if klass.__module__ == module and klass.__name__ == class_name:
                return name
    return next(k.__name__ for k in cls.__mro__ if not k.__name__.startswith("FSDP"))


def plugin_modules(model: nn.Module, config: RunConfig) -> list[str]:
    """The modules outside loopformer that define ``model``'s class, the run's task and the loop plug-ins
    (solver, halting rule, gradient mode) and training mode its config names: what a checkpoint records so
    that loading it in a fresh process imports them (``loopformer.plugins``)."""
    from loopformer.config import to_dict
    from loopformer.loop import GRADS, HALTINGS, SOLVERS
    from loopformer.plugins import external_modules
    from loopformer.tasks.registry import task_class

    base = _base(model)
    # FSDP2's fully_shard swaps in a subclass defined by torch: the first class that is not torch's
    classes: list[Any] = [next(k for k in type(base).__mro__ if not k.__module__.startswith("torch"))]
    classes.append(type(getattr(base, "config", None)))
    try:
        classes.append(task_class(config.data.task))
    except (KeyError, ImportError):  # a run trained on data given in code: no task to record
        pass
    loops = [to_dict(getattr(base.config, "loop", None) or {})] if hasattr(base, "config") else []
    raw = to_dict(config)
    loops += [raw.get(key) or {} for key in ("loop_train", "loop_eval", "loop_periodic")]
    for loop in loops:
        if not isinstance(loop, dict):
            continue
        for key, registry in (("solver", SOLVERS), ("halting", HALTINGS), ("grad", GRADS)):
            name = loop.get(key)
            if isinstance(name, str) and name in registry:
                classes.append(registry.get(name))
    modes = sys.modules.get("loopformer.train.modes")  # not imported: no training mode to record
    if modes is not None:
        classes.append(modes.TRAINING_MODES.get(config.train.mode))
    return external_modules(classes)


def _config_extras(model: nn.Module | None, config: RunConfig, family: str, step: int) -> dict[str, Any]:
    """The family, the step and (when there are any) the user modules a fresh process must import."""
    modules = plugin_modules(model, config) if model is not None else []
    return {"family": family, "step": step, **({"plugins": modules} if modules else {})}


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------
def _run_root(root: Path) -> Path:
    """The run folder a ``checkpoints`` root belongs to (nothing may leave it through a link)."""
    return root.parent if root.name == "checkpoints" else root


def _fresh_tmp(root: Path, tmp: Path) -> None:
    """Create the empty temporary folder ``tmp`` under ``root``, clearing what killed writes left."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except OSError as err:
        raise WriteError(err.errno, err.strerror, str(tmp)) from None


def _write_rest(tmp: Path, config: RunConfig, extras: dict[str, Any], state: dict[str, Any]) -> None:
    """``config.json``, the training state and, last, the manifest of the folder ``tmp``."""
    atomic_write_text(tmp / "config.json", config_to_json(config, **extras), root=tmp)
    skeleton, tensors = flatten_state(state)
    save_tensors(tensors, tmp / "state.safetensors", None, tmp)
    atomic_write_json(tmp / "state.json", skeleton, root=tmp)
    write_manifest(tmp)  # sizes + SHA-256 of every file, fsynced: a resume verifies before it trusts
    fsync_dir(tmp)


def save_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module | None,
    config: RunConfig,
    ema_state: dict[str, Tensor] | None = None,
    training_state: dict[str, Any] | None = None,
    keep: int = 0,
    weights: dict[str, Tensor] | None = None,
    family: str | None = None,
) -> Path:
    """Write ``root/step_{step:08d}`` atomically, point ``root/latest`` at it, keep the newest ``keep``.

    ``training_state``: what a resume restores (the trainer's ``state_dict()``). ``weights``: the tensors to
    store instead of ``model.state_dict()`` (full tensors gathered from FSDP shards). ``model`` None:
    ``weights`` and ``family`` name what is stored. Nothing leaves the run folder (the parent of a ``checkpoints``
    root, else ``root``) through a symbolic link.
    """
    root = Path(root)
    within = _run_root(root)
    check_inside(root / LATEST, within)
    name = step_name(step)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    _fresh_tmp(root, tmp)
    if model is not None:
        family = model_family(model)
        weights = _base(model).state_dict() if weights is None else weights
    try:
        meta = {"family": family, "step": str(step)}
        save_weights(weights, tmp / "model.safetensors", meta, tmp)
        if ema_state is not None:
            save_weights(ema_state, tmp / "ema.safetensors", meta, tmp)
        _write_rest(tmp, config, _config_extras(model, config, family, step), {"step": step, **(training_state or {})})
    except WriteError as err:  # named by the checkpoint it was for, not the hidden temporary folder
        shutil.rmtree(tmp, ignore_errors=True)  # a failed write leaves no partial folder behind
        raise WriteError(err.errno, err.strerror, str(root / name / Path(str(err.filename)).name)) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = root / name
    _publish(root, tmp, final, keep, within)
    return final


def _publish(root: Path, tmp: Path, final: Path, keep: int, within: str | Path) -> None:
    """Rename the complete folder ``tmp`` to ``final``, point ``root/latest`` at it, keep the newest ``keep``."""
    if final.exists():  # re-saving a step (after a resume): one exchange, the step folder never missing
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
        best = read_best(root)  # the best evaluation's folder (train.keep_best) is never pruned
        for old in step_dirs(root)[:-keep]:
            if old != final and (best is None or old.name != best["checkpoint"]):
                shutil.rmtree(old, ignore_errors=True)


def quarantine_after(root: str | Path, step: int) -> Path | None:
    """After divergence at ``step``: rename checkpoints from ``step`` on (their weights produced the
    divergence) and any with non-finite weights to ``diverged_step_N``; point ``latest`` at the newest
    remaining good one and return it (None when there is none)."""
    root = Path(root)
    good = None
    for folder in candidate_checkpoints(root):
        m = STEP_DIR.match(folder.name)
        if good is None and int(m.group(1)) < step and _unusable(folder, hashes=False) is None:
            good = folder
        elif good is None:
            os.replace(folder, folder.with_name(f"diverged_{folder.name}"))
            log.warning("divergence: %s renamed to diverged_%s (not a good checkpoint)", folder, folder.name)
    if good is not None:
        atomic_write_text(root / LATEST, good.name + "\n", root=root)
    elif (root / LATEST).is_file():
        (root / LATEST).unlink()
    return good


# --------------------------------------------------------------------------------------------
# Finding one
# --------------------------------------------------------------------------------------------
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
    if name is None or not STEP_DIR.match(name):
        log.warning("%s does not hold a step_N folder name; ignoring it", pointer)
        return None
    target = root / name
    return target if target.is_dir() else None


def candidate_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint folders under ``root``, newest first (the ``latest`` pointer's target leads)."""
    root = Path(root)
    dirs = step_dirs(root)[::-1]
    target = _pointer_target(root)
    if target is not None and target in dirs:
        dirs.remove(target)
        dirs.insert(0, target)
    return dirs


def latest_checkpoint(root: str | Path) -> Path | None:
    """The folder ``root/latest`` points to (or the newest step folder), None when there is none."""
    return next(iter(candidate_checkpoints(root)), None)


def latest_good_checkpoint(root: str | Path) -> tuple[Path | None, list[str]]:
    """(the newest checkpoint under ``root`` that verifies and holds finite weights, the reasons the
    newer ones were skipped: "step_N: why")."""
    skipped = []
    for folder in candidate_checkpoints(root):
        why = _unusable(folder)
        if why is None:
            return folder, skipped
        named = folder / why.split(" ", 1)[0]  # the file the reason is about, when it names one
        skipped.append(f"{named if named.is_file() else folder}: {why}")
    return None, skipped


def _unusable(folder: Path, hashes: bool = True) -> str | None:
    """Why ``folder`` cannot be resumed from (``verify_checkpoint``, or its weights are not finite), or None."""
    if (why := verify_checkpoint(folder, hashes)) is not None or is_sharded(folder):
        return why  # a sharded one: each rank checked its own shards before writing
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


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------
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
    cfg_path = resolve_checkpoint(path) / "config.json"
    raw = read_record(cfg_path, StoredConfig, CheckpointError)
    where = f"checkpoint {cfg_path}"
    with reading_data(where):
        check_recorded(raw.get("plugins", []), where)
        try:
            config = load_config_file(cfg_path, check=check)
        except ConfigError as err:
            raise CheckpointError(f"{cfg_path}: {err}") from None
    return config, raw.get("family", ""), raw.get("step", 0)


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
    weights_file, ema_state = stored_weights(folder, model)  # a full or a sharded checkpoint
    floats = [t.dtype for t in weights_file.values() if t.is_floating_point()]
    if floats and all(d == torch.float64 for d in floats):
        model.to(torch.float64)  # a float64 checkpoint (a converted one) is not rounded on load
    model.to(device)
    check_weights(weights_file, model, str(folder))
    model.load_state_dict(weights_file, strict=True)
    if ema_state is not None:
        check_weights(ema_state, model, f"{folder} (EMA weights)", subset=True)
    weights = "model"
    if use_ema and ema_state is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in ema_state:
                    p.copy_(ema_state[name].to(p.device))
        weights = "ema"
    check_weights_finite(model.state_dict(), f"checkpoint {folder} ({weights} weights)")
    return ema_state, weights


def stored_weights(folder: Path, model: nn.Module | None = None) -> tuple[dict[str, Tensor], dict[str, Tensor] | None]:
    """(the model weights, the EMA weights or None) of a checkpoint folder, full or sharded; ``model``: the
    model they must fit, checked before a tensor is read (``load_weights``)."""
    if is_sharded(folder):
        full = read_full(folder)
        return full["model"], full["ema"] or None
    ema = folder / "ema.safetensors"
    weights = load_weights(folder / "model.safetensors", model)
    return weights, load_weights(ema, model, subset=True) if ema.exists() else None


def load_training_state(path: str | Path) -> dict[str, Any]:
    """The nested training state saved by ``save_checkpoint`` (tensors on CPU)."""
    folder = verified(resolve_checkpoint(path))
    json_path, tensor_path = folder / "state.json", folder / "state.safetensors"
    skeleton = check_record(read_json(json_path, CheckpointError), StateRecord, json_path, CheckpointError)
    tensors = load_weights(tensor_path) if tensor_path.is_file() else {}
    try:
        return unflatten_state(skeleton, tensors)
    except KeyError as err:
        raise CheckpointError(f"{json_path} names the tensor {err.args[0]!r}, which {tensor_path} does not hold") from None
    except TypeError as err:
        raise CheckpointError(f"{json_path} does not match {tensor_path} ({type(err).__name__})") from None


# --------------------------------------------------------------------------------------------
# The best checkpoint (train.keep_best)
# --------------------------------------------------------------------------------------------
def best_label(record: dict[str, Any]) -> str:
    """'best (by eval_<metric>, step N)': how reports name the best checkpoint."""
    return f"best (by eval_{record['metric']}, step {record['step']})"


def read_best(root: str | Path) -> dict[str, Any] | None:
    """The record ``root/best`` holds (None when there is none); a malformed record, or one naming
    a folder that is gone (e.g. quarantined after a divergence), is ignored with a warning."""
    pointer = Path(root) / BEST
    if not pointer.is_file():
        return None
    try:
        record = read_record(pointer, BestRecord, CheckpointError)
    except CheckpointError as err:
        log.warning("%s (not a best-checkpoint record); ignoring it", err)
        return None
    if not (Path(root) / record["checkpoint"]).is_dir():
        log.warning("%s names %s, which is gone; ignoring it", pointer, record["checkpoint"])
        return None
    return record


def find_best(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """(the best checkpoint folder, its record) of a run folder, a ``checkpoints/`` root or a
    ``loopformer run`` folder; CheckpointError when the run keeps none (train.keep_best unset)."""
    path = Path(path)
    if path.is_file() and path.name == BEST:
        path = path.parent
    for root in (path, path / "checkpoints", path / "model" / "checkpoints"):
        record = read_best(root)
        if record is not None:
            return root / record["checkpoint"], record
    raise CheckpointError(
        f"{path} keeps no best checkpoint (no checkpoints/best: the run was trained without train.keep_best)"
    )


class BestTracker:
    """The best value of one evaluation metric so far, and the step and checkpoint it came from."""

    def __init__(self, metric: str, mode: str = "max") -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"train.keep_best_mode must be 'max' or 'min', got {mode!r}")
        self.metric, self.mode = metric, mode
        self.value: float | None = None
        self.step: int | None = None
        self.checkpoint: str | None = None  # the step folder's name

    @property
    def enabled(self) -> bool:
        return bool(self.metric)

    def better(self, value: float) -> bool:
        """Whether ``value`` strictly beats the best so far (the first finite value always does)."""
        if not math.isfinite(value):
            return False
        if self.value is None:
            return True
        return value > self.value if self.mode == "max" else value < self.value

    def consider(self, result: dict[str, Any], step: int) -> bool:
        """Take the evaluation ``result`` of ``step``; True when it is the new best (the caller then
        checkpoints the step and calls ``mark``, which writes the pointer)."""
        if not self.enabled or not result:
            return False
        if self.metric not in result:
            have = ", ".join(
                k for k, v in result.items() if isinstance(v, int | float) and not isinstance(v, bool)
            )
            raise ValueError(
                f"train.keep_best={self.metric!r} is not an evaluation metric of this run (it has {have})"
            )
        value = float(result[self.metric])
        if not self.better(value):
            return False
        self.value, self.step, self.checkpoint = value, step, step_name(step)
        return True

    def mark(self, checkpoint: Path, write: bool = True) -> None:
        """The best step's checkpoint folder, as written; ``write``: point its ``checkpoints/best`` at it (rank 0
        does, under torchrun)."""
        if checkpoint.name != self.checkpoint:
            raise ValueError(f"the best evaluation is step {self.step}, but {checkpoint} was written")
        if write:  # the record (BestRecord), replaced atomically: temp file, fsync, rename, fsync the folder
            if not checkpoint.is_dir():
                raise CheckpointError(f"best checkpoint {checkpoint} is not a step folder")
            log.info("best checkpoint: %s (eval_%s = %s)", checkpoint, self.metric, self.value)
            atomic_write_text(checkpoint.parent / BEST, json.dumps(self.state_dict()) + "\n", root=checkpoint.parent)

    def state_dict(self) -> dict[str, Any] | None:
        """The record a checkpoint's training state carries (None until there is a best)."""
        if not self.enabled or self.value is None:
            return None
        return {"metric": self.metric, "mode": self.mode, "value": self.value, "step": self.step,
                "checkpoint": self.checkpoint}  # fmt: skip

    def load_state_dict(self, saved: dict[str, Any] | None, root: Path, resumed_step: int) -> None:
        """Continue from a checkpoint's record (``saved``) and the run's ``root/best`` pointer: the
        better of the two that name a folder still in ``root`` at or before ``resumed_step`` (the
        pointer can be newer than the state: the final evaluation runs after the final checkpoint)."""
        if not self.enabled:
            return
        candidates = []
        for record in (saved, read_best(root)):
            if not record or record.get("metric") != self.metric or record.get("mode", "max") != self.mode:
                continue
            if record.get("checkpoint") is None or record["step"] > resumed_step:
                continue
            if not (root / record["checkpoint"]).is_dir():
                log.warning("resume: the best checkpoint %s is not in %s; the best restarts", record["checkpoint"], root)
                continue
            candidates.append(record)
        self.value = self.step = self.checkpoint = None
        for record in candidates:
            if self.better(float(record["value"])) or (self.value == record["value"] and record["step"] < self.step):
                self.value, self.step = float(record["value"]), int(record["step"])
                self.checkpoint = record["checkpoint"]

    def fields(self) -> dict[str, Any]:
        """``best_step`` (the best evaluation's step so far) for an evaluation's metrics record."""
        return {"best_step": self.step} if self.enabled and self.step is not None else {}

    def summary(self, root: Path) -> dict[str, Any] | None:
        """What ``summary.json`` reports: the folder (its full path under ``root``), metric, value, step, label."""
        record = self.state_dict() if self.checkpoint is not None else None
        if record is None:
            return None
        return {**record, "label": best_label(record), "checkpoint": str(root / record["checkpoint"])}


# --------------------------------------------------------------------------------------------
# Sharded checkpoints
# --------------------------------------------------------------------------------------------
def is_sharded(folder: str | Path) -> bool:
    """Whether ``folder`` is a sharded checkpoint (shard files, no ``model.safetensors``)."""
    folder = Path(folder)
    if (folder / "model.safetensors").is_file() or not folder.is_dir():
        return False
    return any(p.name.startswith(SHARD_PREFIX) and p.name.endswith(SHARD_SUFFIX) for p in folder.iterdir())


def _hf_storage() -> Any:
    try:
        from torch.distributed.checkpoint import hf_storage
    except ImportError:
        raise CheckpointError(
            f"sharded checkpoints need torch.distributed.checkpoint.hf_storage (torch >= 2.9; this is "
            f"torch {torch.__version__}); set train.checkpoint_format=full"
        ) from None
    return hf_storage


def _safe_writer(path: Path) -> Any:
    """DCP's safetensors writer whose files go through ``loopformer.files.atomic_path``."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class SafeFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, file: str | os.PathLike, mode: str) -> Iterator[Any]:
            if "r" in mode:
                with super().create_stream(file, mode) as stream:
                    yield stream
                return
            with atomic_path(Path(file), path) as tmp, open(tmp, mode) as stream:  # DCP closes it itself
                yield stream

    writer = _hf_storage().HuggingFaceStorageWriter(str(path), save_distributed=True)
    writer.fs = SafeFileSystem()
    return writer


def _reader(folder: Path) -> Any:
    """DCP's safetensors reader over the shard files only (not ``state.safetensors`` beside them)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class ShardFiles(FileSystem):
        def ls(self, path: str | os.PathLike) -> list[str]:
            return [str(p) for p in sorted(Path(path).iterdir()) if p.name.startswith(SHARD_PREFIX)]

    reader = _hf_storage().HuggingFaceStorageReader(str(folder))
    reader.fs = ShardFiles()
    return reader


def tensor_table(
    model: nn.Module, optimizer: torch.optim.Optimizer, ema: dict[str, Tensor] | None
) -> tuple[dict[str, Tensor], dict[str, Any], dict[str, str]]:
    """(the tensors DCP stores, the optimiser's non-tensor part, aliases of tied tensors) of the live
    training state; the tensors are the live ones (a ``dcp.load`` into them restores in place)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    items = [(f"model.{k}", v) for k, v in model_sd.items()]
    items += [(f"ema.{k}", v) for k, v in (ema or {}).items()]
    scalars: dict[str, dict[str, Any]] = {}
    for name, state in optim_sd["state"].items():
        for k, v in state.items():
            if isinstance(v, Tensor):
                items.append((f"optim.{name}.{k}", v))
            else:
                scalars.setdefault(name, {})[k] = v
    table, aliases = tied(items)
    return table, {"param_groups": optim_sd["param_groups"], "scalars": scalars}, aliases


def _grouped() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def _barrier() -> None:
    if _grouped():
        tdist.barrier()


def save_sharded(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: RunConfig,
    ema_state: dict[str, Tensor] | None,
    training_state: dict[str, Any],
    keep: int,
    is_main: bool,
) -> Path:
    """Write ``root/step_N`` as a sharded checkpoint (collective: every rank calls it); see the module
    docstring. ``training_state``: what rank 0 writes beside the shards (without the optimiser)."""
    from torch.distributed.checkpoint import save as dcp_save

    name = step_name(step)
    tmp = root / f".tmp-{name}-sharded"
    if is_main:
        _fresh_tmp(root, tmp)
    _barrier()
    table, optim_rest, aliases = tensor_table(model, optimizer, ema_state)
    try:
        dcp_save(table, storage_writer=_safe_writer(tmp), no_dist=not _grouped())
        if is_main:
            world = tdist.get_world_size() if _grouped() else 1
            state = {
                "step": step,
                **training_state,
                "optimizer": optim_rest,
                "optimizer_layout": SHARDED_LAYOUT,
                "sharded": {"world_size": world, "aliases": aliases, "ema": ema_state is not None},
            }
            extras = _config_extras(getattr(model, "module", model), config, model_family(model), step)
            _write_rest(tmp, config, extras, state)
    except BaseException:
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = root / name
    if is_main:
        _publish(root, tmp, final, keep, _run_root(root))
    _barrier()
    return final


def load_sharded(
    folder: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: dict[str, Tensor] | None,
    state: dict[str, Any],
) -> None:
    """Restore the weights, the optimiser and the EMA (in place) from the sharded checkpoint ``folder``
    on this process group's world size (or in one process); ``state``: its ``load_training_state``."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if ema is not None and not (state.get("sharded") or {}).get("ema"):
        raise CheckpointError(f"{folder} holds no EMA weights but this run keeps an EMA (train.ema > 0)")
    table, _, _ = tensor_table(model, optimizer, ema)
    try:
        dcp_load(table, storage_reader=_reader(folder), no_dist=not _grouped())
    except (RuntimeError, ValueError, KeyError, AssertionError) as err:
        raise CheckpointError(f"sharded checkpoint {folder} does not fit this model / optimizer: {err}") from None
    model_sd, optim_sd = get_state_dict(model, optimizer)  # the live tensors, now holding the checkpoint
    optim_sd = _optimizer_state(optim_sd["state"], state["optimizer"])
    try:
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    except (RuntimeError, ValueError, KeyError) as err:
        raise CheckpointError(f"optimizer state in {folder} does not fit this model: {err}") from None


def read_full(folder: str | Path) -> dict[str, dict[str, Tensor]]:
    """The full tensors of a sharded checkpoint in one process: ``{"model", "ema", "optim"}`` tables
    (``optim``: ``name.key`` -> tensor); tied tensors restored from the ``aliases`` in state.json."""
    from torch.distributed.checkpoint import load as dcp_load

    folder = Path(folder)
    try:
        meta = _reader(folder).read_metadata().state_dict_metadata
        need = sum(math.prod(m.size) * m.properties.dtype.itemsize for m in meta.values())
        have = sum(p.stat().st_size for p in folder.glob(f"{SHARD_PREFIX}*{SHARD_SUFFIX}"))
        if need > have:  # checked against the bytes the shards hold before the full tensors are allocated
            raise CheckpointError(f"sharded checkpoint {folder}: its tensors need {need:,} bytes but its shards "
                                  f"hold {have:,} (crafted or damaged headers)")  # fmt: skip
        table = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items()}
        dcp_load(table, storage_reader=_reader(folder), no_dist=True)
    except CheckpointError:
        raise
    except (RuntimeError, ValueError, KeyError, OSError, AssertionError) as err:
        raise CheckpointError(f"sharded checkpoint {folder} is unreadable: {err}") from None
    aliases = (load_training_state(folder).get("sharded") or {}).get("aliases", {})
    check_aliases(aliases, table, f"{folder / 'state.json'} (sharded.aliases)", f"the sharded checkpoint {folder}")
    table.update({alias: table[target] for alias, target in aliases.items()})
    out: dict[str, dict[str, Tensor]] = {"model": {}, "ema": {}, "optim": {}}
    for key, t in table.items():
        part, _, name = key.partition(".")
        if part not in out:
            raise CheckpointError(f"sharded checkpoint {folder} holds an unknown tensor {key!r}")
        out[part][name] = t
    return out


def _optimizer_state(tensors: dict[str, dict[str, Any]], saved: dict[str, Any]) -> dict[str, Any]:
    """The optimiser state keyed by parameter name: its tensors (``tensors``: name -> key -> tensor) joined with
    the non-tensor part a sharded checkpoint keeps in state.json (``saved``: the scalars and param_groups)."""
    for name, extra in saved.get("scalars", {}).items():
        tensors.setdefault(name, {}).update(extra)
    return {"state": tensors, "param_groups": saved["param_groups"]}


def consolidate(src: str | Path, out: str | Path, replace: bool = False) -> Path:
    """Write the sharded checkpoint ``src`` as a full (safetensors) checkpoint ``out/step_N`` (the
    ``latest`` pointer beside it); what ``convert`` / ``push`` / a resume with any strategy read. An
    ``out/step_N`` already there is replaced (in one exchange) only when ``replace``. Everything is read
    before anything is written, and the source must still be the checkpoint it was when reading began (a
    training rotating its checkpoints meanwhile gives a CheckpointError, not a mix of two steps)."""
    folder = verified(resolve_checkpoint(src))
    if not is_sharded(folder):
        raise CheckpointError(f"{folder} is not a sharded checkpoint (it already holds model.safetensors)")
    manifest = manifest_bytes(folder)
    try:
        config, family, step = read_checkpoint_config(folder)
        state = load_training_state(folder)
        full = read_full(folder)
    except (CheckpointError, OSError) as err:
        unchanged_since(folder, manifest)
        raise err from None
    unchanged_since(folder, manifest)
    if (Path(out) / step_name(step)).exists() and not replace:
        raise CheckpointError(
            f"{Path(out) / step_name(step)} exists (an earlier consolidation?); pass --overwrite to replace it"
        )
    state.pop("step", None)
    state.pop("sharded", None)
    tensors: dict[str, dict[str, Any]] = {}
    for key, t in full["optim"].items():  # "name.key": the full tensors of the fsdp_full layout
        name, _, k = key.rpartition(".")
        tensors.setdefault(name, {})[k] = t
    state["optimizer"] = _optimizer_state(tensors, state["optimizer"])
    state["optimizer_layout"] = "fsdp_full"
    return save_checkpoint(
        Path(out), step, None, config, ema_state=full["ema"] or None, training_state=state,
        weights=full["model"], family=family,
    )  # fmt: skip
