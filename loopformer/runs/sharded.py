"""Sharded checkpoints: every rank writes its own shards through ``torch.distributed.checkpoint``.

Under FSDP2 (``train.strategy=fsdp``; ``train.checkpoint_format`` "auto" or "sharded") a checkpoint no
longer gathers full tensors on rank 0. ``save_sharded`` takes the model's and the optimiser's state
dicts from ``torch.distributed.checkpoint.state_dict.get_state_dict`` (DTensor shards, keyed by
parameter name) plus the EMA, and ``dcp.save``s them with DCP's safetensors storage
(``HuggingFaceStorageWriter(save_distributed=True)``): rank ``r`` writes
``shard-0000{r+1}-model-00001-of-00001.safetensors`` holding its pieces, each file's header recording
every piece's offsets in the full tensor. No pickle anywhere (DCP's default ``.metadata`` file is a
pickle, this format has none), so ``loopformer.runs.checkpoint``'s "safetensors and JSON only" holds.

Layout of a sharded ``step_N/``: the shard files; ``config.json``; ``state.safetensors`` +
``state.json`` (rank 0: the stream, curriculum, carry, RNG, ``optimizer`` = the optimiser's
non-tensor part (``param_groups``, non-tensor per-parameter values), ``optimizer_layout: "dcp"`` and
``sharded`` = {"world_size", "aliases"}); ``manifest.json`` last. Keys in the shards: ``model.<name>``,
``ema.<name>``, ``optim.<name>.<key>``; a tied weight is stored once (``aliases``).

Atomicity: rank 0 creates ``.tmp-step_N-sharded`` (a name every rank knows), every rank writes its
shard into it through ``loopformer.files.atomic_path`` (``SafeFileSystem``), rank 0 adds the rest
and the manifest and renames the folder into place (``checkpoint.publish``). A write that fails on
any rank fails ``dcp.save`` on every rank and leaves no folder behind.

``load_sharded`` restores into a live model / optimiser / EMA on any world size (DCP reads the
pieces each rank needs, one process included); ``read_full`` rebuilds the full tensors in one
process (``loopformer consolidate``, ``push``, ``eval``) and ``consolidate`` writes them as a full
safetensors checkpoint (optimiser layout ``fsdp_full``: resumable with ``train.strategy=fsdp``).
Needs ``torch.distributed.checkpoint.hf_storage`` (torch >= 2.9).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch import Tensor, nn

from loopformer.config import RunConfig, config_to_json
from loopformer.files import WriteError, atomic_path, atomic_write_json, atomic_write_text, fsync_dir
from loopformer.runs.layout import CheckpointError, load_weights, save_tensors, step_name
from loopformer.runs.manifest import write_manifest
from loopformer.runs.plugin_record import config_extras
from loopformer.runs.state import flatten_state

LAYOUT = "dcp"
SHARD_PREFIX = "shard-"
SHARD_SUFFIX = ".safetensors"


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


def _key(t: Tensor) -> tuple:
    local = t.to_local() if hasattr(t, "to_local") else t
    return (local.device, local.data_ptr(), local.dtype, tuple(t.shape))


def tensor_table(
    model: nn.Module, optimizer: torch.optim.Optimizer, ema: dict[str, Tensor] | None
) -> tuple[dict[str, Tensor], dict[str, Any], dict[str, str]]:
    """(the tensors DCP stores, the optimiser's non-tensor part, aliases of tied tensors) of the live
    training state; the tensors are the live ones (a ``dcp.load`` into them restores in place)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    table: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    items = [(f"model.{k}", v) for k, v in model_sd.items()]
    items += [(f"ema.{k}", v) for k, v in (ema or {}).items()]
    scalars: dict[str, dict[str, Any]] = {}
    for name, state in optim_sd["state"].items():
        for k, v in state.items():
            if isinstance(v, Tensor):
                items.append((f"optim.{name}.{k}", v))
            else:
                scalars.setdefault(name, {})[k] = v
    for key, t in items:
        ident = _key(t) if t.numel() else None
        if ident is not None and ident in seen:
            aliases[key] = seen[ident]
            continue
        if ident is not None:
            seen[ident] = key
        table[key] = t
    return table, {"param_groups": optim_sd["param_groups"], "scalars": scalars}, aliases


def _grouped() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def _barrier() -> None:
    if _grouped():
        tdist.barrier()


def save_sharded(
    root: Path,
    step: int,
    family: str,
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

    from loopformer.runs.checkpoint import publish

    name = step_name(step)
    tmp = root / f".tmp-{name}-sharded"
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-step_*"):
            shutil.rmtree(stale, ignore_errors=True)
        try:
            tmp.mkdir()
        except OSError as err:
            raise WriteError(err.errno, err.strerror, str(tmp)) from None
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
                "optimizer_layout": LAYOUT,
                "sharded": {"world_size": world, "aliases": aliases, "ema": ema_state is not None},
            }
            extra = config_extras(getattr(model, "module", model), config, family, step)
            atomic_write_text(tmp / "config.json", config_to_json(config, **extra), root=tmp)
            skeleton, tensors = flatten_state(state)
            save_tensors(tensors, tmp / "state.safetensors", None, tmp)
            atomic_write_json(tmp / "state.json", skeleton, root=tmp)
            write_manifest(tmp)
            fsync_dir(tmp)
    except BaseException:
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = root / name
    if is_main:
        publish(root, tmp, final, keep)
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
    from torch.distributed.checkpoint.state_dict import set_state_dict

    table, _, _ = tensor_table(model, optimizer, ema)
    try:
        dcp_load(table, storage_reader=_reader(folder), no_dist=not _grouped())
    except (RuntimeError, ValueError, KeyError, AssertionError) as err:
        raise CheckpointError(
            f"sharded checkpoint {folder} does not fit this model / optimizer: {err}"
        ) from None
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)  # the live tensors, now holding the checkpoint
    saved = state["optimizer"]
    for name, extra in saved.get("scalars", {}).items():
        optim_sd["state"].setdefault(name, {}).update(extra)
    optim_sd["param_groups"] = saved["param_groups"]
    try:
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    except (RuntimeError, ValueError, KeyError) as err:
        raise CheckpointError(f"optimizer state in {folder} does not fit this model: {err}") from None


def stored_weights(folder: Path) -> tuple[dict[str, Tensor], dict[str, Tensor] | None]:
    """(the model weights, the EMA weights or None) of a checkpoint folder, full or sharded."""
    if is_sharded(folder):
        full = read_full(folder)
        return full["model"], full["ema"] or None
    ema = folder / "ema.safetensors"
    return load_weights(folder / "model.safetensors"), load_weights(ema) if ema.is_file() else None


def read_full(folder: str | Path) -> dict[str, dict[str, Tensor]]:
    """The full tensors of a sharded checkpoint in one process: ``{"model", "ema", "optim"}`` tables
    (``optim``: ``name.key`` -> tensor); tied tensors restored from the ``aliases`` in state.json."""
    from torch.distributed.checkpoint import load as dcp_load

    from loopformer.runs.checkpoint import load_training_state

    folder = Path(folder)
    try:
        meta = _reader(folder).read_metadata().state_dict_metadata
        table = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items()}
        dcp_load(table, storage_reader=_reader(folder), no_dist=True)
    except (RuntimeError, ValueError, KeyError, OSError, AssertionError) as err:
        raise CheckpointError(f"sharded checkpoint {folder} is unreadable: {err}") from None
    aliases = (load_training_state(folder).get("sharded") or {}).get("aliases", {})
    for alias, target in aliases.items():
        if target not in table:
            raise CheckpointError(
                f"{folder / 'state.json'}: 'sharded.aliases.{alias}' names the tensor {target!r}, which the "
                f"shards of {folder} do not hold"
            )
        table[alias] = table[target]
    out: dict[str, dict[str, Tensor]] = {"model": {}, "ema": {}, "optim": {}}
    for key, t in table.items():
        part, _, name = key.partition(".")
        if part not in out:
            raise CheckpointError(f"sharded checkpoint {folder} holds an unknown tensor {key!r}")
        out[part][name] = t
    return out


def full_optimizer_state(full: dict[str, Tensor], saved: dict[str, Any]) -> dict[str, Any]:
    """The optimiser state keyed by parameter name with full tensors (``fsdp_full`` layout) from
    ``read_full(...)["optim"]`` and the non-tensor part in state.json."""
    state: dict[str, dict[str, Any]] = {}
    for key, t in full.items():
        name, _, k = key.rpartition(".")
        state.setdefault(name, {})[k] = t
    for name, extra in saved.get("scalars", {}).items():
        state.setdefault(name, {}).update(extra)
    return {"state": state, "param_groups": saved["param_groups"]}


def consolidate(src: str | Path, out: str | Path, replace: bool = False) -> Path:
    """Write the sharded checkpoint ``src`` as a full (safetensors) checkpoint ``out/step_N`` (the
    ``latest`` pointer beside it); what ``convert`` / ``push`` / a resume with any strategy read. An
    ``out/step_N`` already there is replaced (in one exchange) only when ``replace``. Everything is read
    before anything is written, and the source must still be the checkpoint it was when reading began (a
    training rotating its checkpoints meanwhile gives a CheckpointError, not a mix of two steps)."""
    from loopformer.runs.checkpoint import (
        load_training_state,
        read_checkpoint_config,
        resolve_checkpoint,
        save_checkpoint,
        verified,
    )

    folder = verified(resolve_checkpoint(src))
    if not is_sharded(folder):
        raise CheckpointError(f"{folder} is not a sharded checkpoint (it already holds model.safetensors)")
    manifest = _manifest_bytes(folder)
    try:
        config, family, step = read_checkpoint_config(folder)
        state = load_training_state(folder)
        full = read_full(folder)
    except (CheckpointError, OSError) as err:
        _still_there(folder, manifest)
        raise err from None
    _still_there(folder, manifest)
    if (Path(out) / step_name(step)).exists() and not replace:
        raise CheckpointError(
            f"{Path(out) / step_name(step)} exists (an earlier consolidation?); pass --overwrite to replace it"
        )
    state.pop("step", None)
    state.pop("sharded", None)
    state["optimizer"] = full_optimizer_state(full["optim"], state["optimizer"])
    state["optimizer_layout"] = "fsdp_full"
    return save_checkpoint(
        Path(out), step, None, config, ema_state=full["ema"] or None, training_state=state,
        weights=full["model"], family=family,
    )  # fmt: skip


def _manifest_bytes(folder: Path) -> bytes | None:
    try:
        return (folder / "manifest.json").read_bytes()
    except OSError:
        return None


def _still_there(folder: Path, manifest: bytes | None) -> None:
    """CheckpointError when ``folder`` was removed or replaced since its manifest read ``manifest``."""
    if not folder.is_dir() or _manifest_bytes(folder) != manifest:
        raise CheckpointError(
            f"checkpoint {folder} was removed or replaced while it was being read (a training in that run "
            f"rotates its checkpoints: train.keep_checkpoints); run the command again, or name a checkpoint "
            f"that is kept (checkpoints/best)"
        )
