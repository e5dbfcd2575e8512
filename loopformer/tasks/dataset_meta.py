"""``dataset.json`` of an HRM / TRM numpy folder (``loopformer.tasks.formats``): read and checked field by field.

``read_dataset_json(path)`` refuses, as a ``TaskDataError`` naming the file and the field: bytes that are
not UTF-8, invalid JSON (line and column, never the contents), a duplicated key, something other than an
object, a missing field, a field of the wrong type (``vocab_size: "12"``, ``seq_len: 1.5``, ``true`` where
a number belongs) or range, and set names that could leave the folder: every name in ``sets`` is a plain
file-name stem (letters, digits, ``_``, ``-``, ``.``; no ``/``, ``\\``, ``..``, absolute paths or a leading
dot), listed once. ``confined_file(folder, name)`` is ``folder / name`` after refusing a symbolic link
that resolves outside ``folder``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from loopformer.files import read_json
from loopformer.tasks.base import TaskDataError

SET_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
# field -> (required, accepts null, minimum)
INT_FIELDS: dict[str, tuple[bool, bool, int]] = {
    "vocab_size": (True, False, 1),
    "seq_len": (True, False, 1),
    "num_puzzle_identifiers": (True, False, 0),
    "ignore_label_id": (True, True, -(2**31)),
    "pad_id": (False, True, 0),
    "blank_identifier_id": (False, True, 0),
    "total_groups": (False, True, 0),
}


def _no_duplicates(path: Path) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise TaskDataError(f"{path}: field {key!r} is given twice")
            out[key] = value
        return out

    return hook


def _read(path: Path) -> Any:
    return read_json(path, TaskDataError, object_pairs_hook=_no_duplicates(path))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_set_name(name: Any, where: str) -> str:
    """``name`` when it is a plain set name (module docstring), else TaskDataError naming ``where``."""
    if not isinstance(name, str):
        raise TaskDataError(f"{where}: a set name must be a string, got {type(name).__name__}")
    if not SET_NAME.fullmatch(name):
        raise TaskDataError(
            f"{where}: set name {name!r} is not a plain name (letters, digits, '_', '-', '.'; no path "
            "separators, '..', absolute paths or leading dot): the arrays must lie in the dataset folder"
        )
    return name


def read_dataset_json(path: str | Path) -> dict[str, Any]:
    """The checked contents of a ``dataset.json`` (see the module docstring)."""
    path = Path(path)
    meta = _read(path)
    if not isinstance(meta, dict):
        raise TaskDataError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    missing = [f for f, (required, _, _) in INT_FIELDS.items() if required and f not in meta]
    missing += [] if "sets" in meta else ["sets"]
    if missing:
        raise TaskDataError(f"{path}: missing field(s) {missing}")
    for field, (_, nullable, low) in INT_FIELDS.items():
        if field not in meta or (nullable and meta[field] is None):
            continue
        value = meta[field]
        if not _is_int(value):
            kind = "null" if value is None else type(value).__name__
            raise TaskDataError(f"{path}: field {field!r} must be an integer, got {kind} {value!r}")
        if value < low:
            raise TaskDataError(f"{path}: field {field!r} must be >= {low}, got {value}")
    mean = meta.get("mean_puzzle_examples")
    if mean is not None and (
        isinstance(mean, bool) or not isinstance(mean, int | float) or not math.isfinite(mean)
    ):
        raise TaskDataError(f"{path}: field 'mean_puzzle_examples' must be a finite number, got {mean!r}")
    sets = meta["sets"]
    if not isinstance(sets, list) or not sets:
        raise TaskDataError(f"{path}: field 'sets' must be a non-empty list of set names")
    seen: set[str] = set()
    for i, name in enumerate(sets):
        check_set_name(name, f"{path}: field 'sets' entry {i}")
        if name in seen:
            raise TaskDataError(f"{path}: field 'sets' lists {name!r} twice")
        seen.add(name)
    return meta


def confined_file(folder: Path, name: str) -> Path:
    """``folder / name``; TaskDataError when it is a symbolic link resolving outside ``folder``."""
    path = Path(folder) / name
    if path.is_symlink():
        target, root = path.resolve(), Path(folder).resolve()
        if root not in target.parents:
            raise TaskDataError(
                f"{path}: a symbolic link to {target}, outside the dataset folder {folder}; refusing to read it"
            )
    return path
