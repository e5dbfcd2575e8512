"""Fingerprints of a run's data: what decides that two trainings, or two evaluations, saw the same rows.

A fingerprint is a small JSON record of one data set: where it came from (``source``: a file or folder
path, or the generator's options and seed) and a digest of the rows themselves (``rows``, ``sha256`` of the
token ids, labels and puzzle ids), so a data file regenerated in place, another generator setting or
another seed all give another fingerprint, while the same rows read from a moved file give the same one.

- ``data_fingerprint(data, split, dataset)``: the record of a run's ``train`` / ``eval`` set.
- ``training_data(config, train, held_out)``: what a checkpoint records (``state.json`` ``data``): both sets.
- ``data_changes(saved, current)``: the sets whose digest differs between a checkpoint and this run, as
  ``{"data.train (rows)": {"old": ..., "new": ...}}``; a resume refuses them unless
  ``--allow-config-change`` (``loopformer.train.resume``).
- ``heldout_record(config, dataset)``: what every evaluation report records (``metrics.json`` ``heldout``):
  the task, its options, the held-out set's fingerprint and the rows left out because they cannot be
  scored (``unscored_rows``); ``loopformer compare`` compares reports only when these agree.

Data sets above ``FULL_HASH_BYTES`` are digested from evenly spaced row blocks (``"sampled": true``), so a
multi-gigabyte token file costs a bounded read at start-up.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

from loopformer.config import DataConfig, RunConfig

FULL_HASH_BYTES = 1 << 30
SAMPLE_BLOCKS = 4096


def _update(h: Any, array: np.ndarray, sampled: bool) -> None:
    """Feed ``array`` (rows first) to ``h``: every row, or ``SAMPLE_BLOCKS`` evenly spaced row blocks."""
    h.update(f"{array.dtype.str}{array.shape}".encode())
    n = len(array)
    if n == 0:
        return
    if not sampled:
        step = max(1, (64 << 20) // max(array[:1].nbytes, 1))  # about 64 MiB at a time
        for start in range(0, n, step):
            h.update(np.ascontiguousarray(array[start : start + step]).tobytes())
        return
    block = max(1, n // (SAMPLE_BLOCKS * 64))
    for start in np.linspace(0, max(n - block, 0), SAMPLE_BLOCKS).astype(np.int64):
        h.update(np.ascontiguousarray(array[start : start + block]).tobytes())


def dataset_digest(dataset: Any) -> dict[str, Any]:
    """``{"rows", "sha256"[, "sampled"]}`` of a data set's token ids, labels and puzzle ids; a streamed set
    (``tasks.text.StreamedWindows``, read from its token file a batch at a time) by what draws its windows:
    the token file's own fingerprint (size, SHA-256), the split, window length, order and seed."""
    if getattr(dataset, "streamed", False):
        keys = ("fingerprint", "split", "seq_len", "order", "seed")
        what = json.dumps({k: dataset.meta.get(k) for k in keys}, sort_keys=True, default=str)
        return {"rows": len(dataset), "sha256": hashlib.sha256(what.encode()).hexdigest(), "streamed": True}
    arrays = [dataset.inputs, dataset.labels]
    if getattr(dataset, "puzzle_ids", None) is not None:
        arrays.append(dataset.puzzle_ids)
    sampled = sum(int(a.nbytes) for a in arrays) > FULL_HASH_BYTES
    h = hashlib.sha256()
    for array in arrays:
        _update(h, np.asarray(array), sampled)
    out: dict[str, Any] = {"rows": int(len(dataset.inputs)), "sha256": h.hexdigest()}
    if sampled:
        out["sampled"] = True
    return out


def source(data: DataConfig, split: str) -> dict[str, Any]:
    """Where a run's ``split`` ("train" | "eval") set comes from: a path, or the generator's settings."""
    path = data.train_path if split == "train" else data.eval_path
    if path:
        return {"path": os.path.abspath(path)}
    return {
        "generate": dict(data.train_generate if split == "train" else data.eval_generate),
        "seed": data.train_seed if split == "train" else data.eval_seed,
        "size": data.train_size if split == "train" else data.eval_size,
    }


def data_fingerprint(data: DataConfig, split: str, dataset: Any) -> dict[str, Any] | None:
    """The fingerprint of a run's ``split`` set (None when there is none)."""
    if dataset is None:
        return None
    return {"source": source(data, split), **dataset_digest(dataset)}


def training_data(config: RunConfig, train: Any, held_out: Any) -> dict[str, Any]:
    """What a checkpoint records of the data it was trained and evaluated on."""
    return {
        "task": config.data.task,
        "train": data_fingerprint(config.data, "train", train),
        "eval": data_fingerprint(config.data, "eval", held_out),
    }


def _described(fp: Any) -> str:
    if not isinstance(fp, dict):
        return "none"
    where = fp.get("source") or {}
    origin = where.get("path") or f"generated (seed {where.get('seed')}, {where.get('generate') or {}})"
    return f"{fp.get('rows')} rows of {origin}, sha256 {str(fp.get('sha256'))[:12]}"


def data_changes(saved: Any, current: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"data.<split> (rows)": {"old": description, "new": description}}`` for each set whose rows differ
    between a checkpoint's record ``saved`` (None for a checkpoint written before data was recorded: nothing
    to compare) and ``current``."""
    if not isinstance(saved, dict):
        return {}
    changes = {}
    for split in ("train", "eval"):
        old, new = saved.get(split), current.get(split)
        key = lambda fp: (fp.get("rows"), fp.get("sha256")) if isinstance(fp, dict) else None  # noqa: E731
        if key(old) != key(new):
            changes[f"data.{split} (rows)"] = {"old": _described(old), "new": _described(new)}
    return changes


def heldout_record(config: RunConfig, dataset: Any) -> dict[str, Any]:
    """What an evaluation report records about its held-out set: task, task options, fingerprint."""
    unscored = int((getattr(dataset, "meta", None) or {}).get("unscored_rows", 0))
    return {"task": config.data.task, "options": dict(config.data.options),
            **(data_fingerprint(config.data, "eval", dataset) or {}), "unscored_rows": unscored}  # fmt: skip


__all__ = ["data_changes", "data_fingerprint", "dataset_digest", "heldout_record", "source", "training_data"]
