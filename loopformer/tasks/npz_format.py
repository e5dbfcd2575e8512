"""The ``.npz`` dataset file of the generated tasks (group words, knowledge-graph paths, ARC, text): writing
and a reader that checks everything it reads.

A file holds ``inputs`` and ``labels`` (integer [N, T]), ``difficulty`` (finite numbers [N]), optionally
``puzzle_ids`` (non-negative integers [N]) and ``meta`` (a JSON object as a 0-d string array).
``load_npz(path, vocab_size)`` refuses, as a ``TaskDataError`` naming the file, the array (and the row and
column where there is one) and the reason: a file that is no ``.npz`` archive (a bare ``.npy``, random or
truncated bytes), pickled object arrays, a missing array, arrays of the wrong shape or kind (float tokens
such as ``1.5`` are never truncated to ``1``), tokens outside ``[0, vocab_size)`` (labels may also hold
``IGNORE_INDEX``), non-finite difficulties, negative puzzle ids and a ``meta`` that is no JSON object.
"""

from __future__ import annotations

import json
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from loopformer.tasks.base import IGNORE_INDEX, TaskDataError, TokenDataset

REQUIRED = ("inputs", "labels", "difficulty")
KNOWN = (*REQUIRED, "puzzle_ids", "meta")


def save_npz(dataset: TokenDataset, path: str | Path) -> None:
    """Write a TokenDataset as a compressed ``.npz`` (arrays + JSON meta); the inverse of :func:`load_npz`."""
    arrays = {"inputs": dataset.inputs, "labels": dataset.labels, "difficulty": dataset.difficulty}
    if dataset.puzzle_ids is not None:
        arrays["puzzle_ids"] = dataset.puzzle_ids
    arrays["meta"] = np.array(json.dumps(dataset.meta, default=_json_default))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from loopformer.files import atomic_writer

    with atomic_writer(path, "wb") as handle:  # a file handle keeps numpy from appending ".npz"
        np.savez_compressed(handle, **arrays)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"meta value of type {type(value).__name__} is not JSON-serialisable")


def _first_bad(bad: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(bad)[0])


def _tokens(arr: np.ndarray, where: str, vocab_size: int, labels: bool) -> np.ndarray:
    if arr.dtype.kind not in "iu":
        raise TaskDataError(
            f"{where}: dtype {arr.dtype}: tokens must be integers (floats such as 1.5 are not truncated to tokens)"
        )
    arr = arr.astype(np.int64, copy=False)
    low = (arr < 0) & ~(arr == IGNORE_INDEX) if labels else arr < 0
    high = arr >= vocab_size if vocab_size else np.zeros_like(low)
    for bad, why in ((low, "negative" + (f" (other than IGNORE_INDEX {IGNORE_INDEX})" if labels else "")),
                     (high, f"outside the vocabulary [0, {vocab_size})")):  # fmt: skip
        if bad.any():
            r, c = _first_bad(bad)
            raise TaskDataError(f"{where}: row {r}, column {c}: token {int(arr[r, c])} is {why}")
    return arr


def _read(data: Any, path: Path) -> dict[str, Any]:
    """Every array of the archive, read and checked for kind (no pickles), by name."""
    names = list(data.files)
    missing = [n for n in REQUIRED if n not in names]
    if missing:
        raise TaskDataError(f"{path}: not a loopformer dataset (missing array(s) {missing})")
    out = {}
    for name in (n for n in KNOWN if n in names):
        try:
            arr = data[name]
        except ValueError as err:  # object arrays need pickles, which are never loaded
            raise TaskDataError(f"{path}: array {name!r} cannot be read without pickle ({err})") from None
        if name != "meta" and arr.dtype.kind not in "biuf":
            raise TaskDataError(f"{path}: array {name!r} has dtype {arr.dtype}, not numbers")
        out[name] = arr
    return out


def _meta(arr: Any, path: Path) -> dict[str, Any]:
    if arr is None:
        return {}
    if arr.shape != () or arr.dtype.kind not in "US":
        raise TaskDataError(
            f"{path}: array 'meta' must be one JSON string, got dtype {arr.dtype} shape {arr.shape}"
        )
    try:
        meta = json.loads(str(arr[()] if arr.dtype.kind == "U" else arr[()].decode("utf-8")))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise TaskDataError(f"{path}: array 'meta' is not valid JSON ({type(err).__name__})") from None
    if not isinstance(meta, dict):
        raise TaskDataError(f"{path}: array 'meta' must hold a JSON object, got {type(meta).__name__}")
    return meta


def load_npz(path: str | Path, vocab_size: int = 0) -> TokenDataset:
    """Read and check a dataset written by :func:`save_npz` (see the module docstring); ``vocab_size``
    (0: unchecked) bounds the tokens."""
    path = Path(path)
    if not path.is_file():
        raise TaskDataError(f"{path}: no such dataset file")
    # random bytes, a pickle, a truncated archive, a member that does not decompress, a header whose shape
    # does not match its data or claims more than memory
    unreadable = (
        ValueError,
        OSError,
        EOFError,
        KeyError,
        zipfile.BadZipFile,
        zlib.error,
        NotImplementedError,
        struct.error,
        OverflowError,
        MemoryError,
    )
    try:
        data = np.load(path, allow_pickle=False)
    except unreadable as err:
        raise TaskDataError(f"{path}: not a readable .npz dataset archive ({type(err).__name__})") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise TaskDataError(f"{path}: a single .npy array, not an .npz dataset archive")
    try:
        with data:
            arrays = _read(data, path)
    except TaskDataError:  # a ValueError too, already naming the problem
        raise
    except unreadable as err:
        raise TaskDataError(f"{path}: not a readable .npz dataset archive ({type(err).__name__})") from None
    inputs, labels = arrays["inputs"], arrays["labels"]
    if inputs.ndim != 2 or labels.shape != inputs.shape:
        raise TaskDataError(
            f"{path}: 'inputs' {inputs.shape} and 'labels' {labels.shape} must be equal [N, T] arrays"
        )
    n = len(inputs)
    inputs = _tokens(inputs, f"{path}: array 'inputs'", vocab_size, labels=False)
    labels = _tokens(labels, f"{path}: array 'labels'", vocab_size, labels=True)
    difficulty = arrays["difficulty"]
    if difficulty.shape != (n,):
        raise TaskDataError(f"{path}: array 'difficulty' has shape {difficulty.shape}, expected ({n},)")
    difficulty = difficulty.astype(np.float64)
    if not np.isfinite(difficulty).all():
        row = int(np.flatnonzero(~np.isfinite(difficulty))[0])
        raise TaskDataError(
            f"{path}: array 'difficulty': row {row}: {difficulty[row]} is not a finite number"
        )
    puzzle_ids = arrays.get("puzzle_ids")
    if puzzle_ids is not None:
        if puzzle_ids.dtype.kind not in "iu" or puzzle_ids.shape != (n,):
            raise TaskDataError(
                f"{path}: array 'puzzle_ids' must be {n} integers, got dtype {puzzle_ids.dtype} shape {puzzle_ids.shape}"
            )
        if (puzzle_ids < 0).any():
            row = int(np.flatnonzero(puzzle_ids < 0)[0])
            raise TaskDataError(
                f"{path}: array 'puzzle_ids': row {row}: id {int(puzzle_ids[row])} is negative"
            )
    return TokenDataset(inputs, labels, difficulty, puzzle_ids, _meta(arrays.get("meta"), path))
