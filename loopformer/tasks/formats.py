"""The numpy dataset files: HRM / TRM folders (with their ``dataset.json``) and the ``.npz`` of the generated
tasks, read into and written from TokenDataset, every field checked on reading; ``save_parquet`` writes a
generated set as Parquet for the Hugging Face ``datasets`` library (``loopformer data --format parquet``).

**HRM / TRM folder** (HRM's dataset builders, arXiv 2506.21734)::

    ROOT/identifiers.json               ["<blank>", ...] puzzle identifier names
    ROOT/<split>/dataset.json           metadata (below)
    ROOT/<split>/<set>__inputs.npy      uint8 [N, seq_len]  example inputs       (set is usually "all")
    ROOT/<split>/<set>__labels.npy      uint8 [N, seq_len]  targets, ignore_label_id where no loss
    ROOT/<split>/<set>__puzzle_identifiers.npy  int32 [P]   identifier of each puzzle
    ROOT/<split>/<set>__puzzle_indices.npy      int32 [P+1] CSR: puzzle p owns examples [idx[p], idx[p+1])
    ROOT/<split>/<set>__group_indices.npy       int32 [G+1] CSR: group g owns puzzles [idx[g], idx[g+1])

dataset.json: pad_id, ignore_label_id, blank_identifier_id, vocab_size, seq_len, num_puzzle_identifiers,
total_groups, mean_puzzle_examples, sets.  HRM's tokens put PAD at 0 and its labels use 0 (ignore_label_id)
for "no loss"; on reading, labels equal to ignore_label_id become IGNORE_INDEX, so a genuine target token
0 cannot be expressed in this format (none of our tasks has one).

``read_dataset_json(path)`` refuses, as a ``TaskDataError`` naming the file and the field: bytes that are
not UTF-8, invalid JSON (line and column, never the contents), a duplicated key, something other than an
object, a missing field, a field of the wrong type (``vocab_size: "12"``, ``seq_len: 1.5``, ``true`` where
a number belongs) or range, and set names that could leave the folder: every name in ``sets`` is a plain
file-name stem (letters, digits, ``_``, ``-``, ``.``; no ``/``, ``\\``, ``..``, absolute paths or a leading
dot), listed once. ``confined_file(folder, name)`` is ``folder / name`` after refusing a symbolic link
that resolves outside ``folder``.

Writing: when ``puzzle_ids`` is None every example is one puzzle with the blank identifier 0 (HRM's
Sudoku / maze convention); otherwise each run of consecutive equal ids is one puzzle with that identifier.
One group per puzzle.  An extra ``<set>__difficulty.npy`` (float64 [N], ignored by HRM's loader) keeps
the difficulty so that a write/read round trip is exact.

**``.npz``** (the files of the generated tasks: group words, knowledge-graph paths, ARC, text): ``inputs`` and ``labels`` (integer [N, T]), ``difficulty`` (finite numbers
[N]), optionally ``puzzle_ids`` (non-negative integers [N]) and ``meta`` (a JSON object as a 0-d string
array). ``load_npz(path, vocab_size)`` refuses, as a ``TaskDataError`` naming the file, the array (and the
row and column where there is one) and the reason: a file that is no ``.npz`` archive (a bare ``.npy``,
random or truncated bytes), pickled object arrays, a missing array, arrays of the wrong shape or kind (float
tokens such as ``1.5`` are never truncated to ``1``), tokens outside ``[0, vocab_size)`` (labels may also
hold ``IGNORE_INDEX``), non-finite difficulties, negative puzzle ids and a ``meta`` that is no JSON object.
``NpzTask`` is a task whose ``load`` / ``save`` are these, ``load`` bounding the tokens by its vocabulary.

The Sudoku-Extreme / Maze-Hard CSV is ``loopformer.tasks.puzzle_csv``'s.
"""

from __future__ import annotations

import json
import math
import re
import struct
import tokenize
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from loopformer.files import atomic_write_json, atomic_writer, read_json, regular_file, save_npy
from loopformer.tasks.base import IGNORE_INDEX, Task, TaskDataError, TokenDataset

METADATA_FIELDS = (
    "pad_id",
    "ignore_label_id",
    "blank_identifier_id",
    "vocab_size",
    "seq_len",
    "num_puzzle_identifiers",
    "total_groups",
    "mean_puzzle_examples",
    "sets",
)
ARRAY_FIELDS = ("inputs", "labels", "puzzle_identifiers", "puzzle_indices", "group_indices")
SET_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
# dataset.json field -> (required, accepts null, minimum)
INT_FIELDS: dict[str, tuple[bool, bool, int]] = {
    "vocab_size": (True, False, 1),
    "seq_len": (True, False, 1),
    "num_puzzle_identifiers": (True, False, 0),
    "ignore_label_id": (True, True, -(2**31)),
    "pad_id": (False, True, 0),
    "blank_identifier_id": (False, True, 0),
    "total_groups": (False, True, 0),
}
NPZ_REQUIRED = ("inputs", "labels", "difficulty")
NPZ_KNOWN = (*NPZ_REQUIRED, "puzzle_ids", "meta")
BLOCK_ROWS = 1 << 16  # rows checked at a time (an array may be memory-mapped)


def check_tokens(arr: np.ndarray, where: str, vocab_size: int, labels: bool = False) -> None:
    """Integer tokens in ``[0, vocab_size)`` (``vocab_size`` 0: only non-negative; ``labels``: IGNORE_INDEX
    too), checked in blocks of rows; the error names ``where``, the first bad row, column and token."""
    if arr.dtype.kind not in "iu":
        raise TaskDataError(
            f"{where}: dtype {arr.dtype}: token arrays must hold integers (floats such as 1.5 are not "
            "truncated to tokens)"
        )
    for start in range(0, len(arr), BLOCK_ROWS):
        block = np.asarray(arr[start : start + BLOCK_ROWS], dtype=np.int64)
        low = (block < 0) & ~(block == IGNORE_INDEX) if labels else block < 0
        bad = low | (block >= vocab_size) if vocab_size else low
        if bad.any():
            r, c = divmod(int(np.flatnonzero(bad.reshape(-1))[0]), block.shape[1])
            token = int(block[r, c])
            if token < 0:
                why = "negative" + (f" (other than IGNORE_INDEX {IGNORE_INDEX})" if labels else "")
            else:
                why = f"outside the vocabulary [0, {vocab_size})"
            raise TaskDataError(
                f"{where}: tokens outside [0, vocab_size={vocab_size}): first at row {start + r}, column {c}: "
                f"token {token} is {why}"
            )


# ------------------------------------------------------------------------------------------- dataset.json


def _no_duplicates(path: Path) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise TaskDataError(f"{path}: field {key!r} is given twice")
            out[key] = value
        return out

    return hook


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
    meta = read_json(path, TaskDataError, object_pairs_hook=_no_duplicates(path))
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
        if not isinstance(value, int) or isinstance(value, bool):
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


# ------------------------------------------------------------------------------------------- HRM / TRM folder


def _load_npy(path: Path) -> np.ndarray:
    """A .npy file, memory-mapped (nothing is read until used); numeric dtypes only (no pickles)."""
    regular_file(path, TaskDataError)
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError, SyntaxError, tokenize.TokenError) as exc:  # a corrupt header
        raise TaskDataError(f"{path}: unreadable or truncated .npy file ({type(exc).__name__})") from None
    if arr.dtype.kind not in "biuf":
        raise TaskDataError(f"{path}: dtype {arr.dtype} is not numeric")
    return arr


def check_task_rows(task: Task | None, inputs: np.ndarray, labels: np.ndarray, where: str) -> None:
    """The task's vectorised label / input agreement check where it has one (``Task.rows_agree``: Sudoku's
    label is a complete valid grid keeping every given; a maze's keeps walls, S and G and marks the path on
    open cells); the error names the first failing row."""
    if task is None or not task.label_rule:
        return
    if inputs.shape[1:] != (task.seq_len,):
        raise TaskDataError(
            f"{where}: rows have {inputs.shape[1]} tokens, task {task.name!r} expects {task.seq_len}"
        )
    for start in range(0, len(inputs), BLOCK_ROWS):
        ok = task.rows_agree(np.asarray(inputs[start : start + BLOCK_ROWS], dtype=np.int64),
                             np.asarray(labels[start : start + BLOCK_ROWS], dtype=np.int64))  # fmt: skip
        if not ok.all():
            row = start + int(np.flatnonzero(~ok)[0])
            raise TaskDataError(
                f"{where}: row {row}: the label does not agree with the input ({task.label_rule})"
            )


def _check_offsets(offsets: np.ndarray, total: int, path: Path, what: str) -> None:
    if offsets.ndim != 1 or len(offsets) < 1:
        raise TaskDataError(f"{path}: {what} offsets must be a 1-D array with at least one entry")
    if offsets[0] != 0:
        raise TaskDataError(f"{path}: {what} offsets must start at 0, found {offsets[0]}")
    steps = np.diff(offsets)
    if (steps < 0).any():
        bad = int(np.flatnonzero(steps < 0)[0])
        raise TaskDataError(
            f"{path}: {what} offsets are not monotone: entry {bad + 1} ({offsets[bad + 1]}) < entry {bad} ({offsets[bad]})"
        )
    if offsets[-1] != total:
        raise TaskDataError(f"{path}: {what} offsets end at {offsets[-1]}, expected {total}")


def _check_difficulty(difficulty: np.ndarray, labels: np.ndarray, meta: dict[str, Any], path: Path) -> None:
    """Finite difficulties; NaN only for rows whose label is unknown (every position ignore_label_id)."""
    if np.isinf(difficulty).any():
        raise TaskDataError(
            f"{path}: row {int(np.flatnonzero(np.isinf(difficulty))[0])}: difficulty is infinite"
        )
    nan = np.flatnonzero(np.isnan(difficulty))
    if len(nan):
        ignore = meta.get("ignore_label_id")
        known = (
            (np.asarray(labels[nan]) != ignore).any(axis=1) if ignore is not None else np.ones(len(nan), bool)
        )
        if known.any():
            raise TaskDataError(
                f"{path}: row {int(nan[known][0])}: difficulty is NaN but the row has a label"
            )


def _load_set(folder: Path, set_name: str, meta: dict[str, Any], vocab_size: int) -> dict[str, np.ndarray]:
    arrays = {name: _load_npy(confined_file(folder, f"{set_name}__{name}.npy")) for name in ARRAY_FIELDS}
    inputs, labels = arrays["inputs"], arrays["labels"]
    p_inputs = folder / f"{set_name}__inputs.npy"
    if inputs.ndim != 2:
        raise TaskDataError(f"{p_inputs}: expected a 2-D [N, seq_len] array, got shape {inputs.shape}")
    if labels.shape != inputs.shape:
        raise TaskDataError(
            f"{folder / f'{set_name}__labels.npy'}: shape {labels.shape} differs from inputs {inputs.shape}"
        )
    if inputs.shape[1] != meta["seq_len"]:
        raise TaskDataError(
            f"{p_inputs}: rows have {inputs.shape[1]} tokens, dataset.json says seq_len {meta['seq_len']}"
        )
    for name in ("inputs", "labels"):
        check_tokens(arrays[name], str(folder / f"{set_name}__{name}.npy"), vocab_size)
    for name in ("puzzle_identifiers", "puzzle_indices", "group_indices"):
        if arrays[name].dtype.kind not in "iu":
            raise TaskDataError(
                f"{folder / f'{set_name}__{name}.npy'}: dtype {arrays[name].dtype}, expected integers"
            )
    puzzle_indices = arrays["puzzle_indices"].astype(np.int64)
    _check_offsets(puzzle_indices, len(inputs), folder / f"{set_name}__puzzle_indices.npy", "puzzle")
    identifiers = arrays["puzzle_identifiers"].astype(np.int64)
    p_ids = folder / f"{set_name}__puzzle_identifiers.npy"
    if identifiers.shape != (len(puzzle_indices) - 1,):
        raise TaskDataError(
            f"{p_ids}: shape {identifiers.shape}, expected ({len(puzzle_indices) - 1},) (one per puzzle)"
        )
    if identifiers.size and (identifiers.min() < 0 or identifiers.max() >= meta["num_puzzle_identifiers"]):
        raise TaskDataError(
            f"{p_ids}: identifiers outside [0, num_puzzle_identifiers={meta['num_puzzle_identifiers']})"
        )
    group_indices = arrays["group_indices"].astype(np.int64)
    _check_offsets(group_indices, len(identifiers), folder / f"{set_name}__group_indices.npy", "group")
    out = {
        "inputs": inputs,
        "labels": labels,
        "puzzle_ids": np.repeat(identifiers, np.diff(puzzle_indices)),
        "group_ids": np.repeat(
            np.repeat(np.arange(len(group_indices) - 1), np.diff(group_indices)), np.diff(puzzle_indices)
        ),
    }
    diff_path = folder / f"{set_name}__difficulty.npy"
    if diff_path.exists() or diff_path.is_symlink():
        diff_path = confined_file(folder, diff_path.name)
        difficulty = _load_npy(diff_path)
        if difficulty.shape != (len(inputs),):
            raise TaskDataError(f"{diff_path}: shape {difficulty.shape}, expected ({len(inputs)},)")
        _check_difficulty(np.asarray(difficulty, dtype=np.float64), labels, meta, diff_path)
        out["difficulty"] = difficulty.astype(np.float64)
    return out


def load_hrm_folder(path: str | Path, split: str = "train", task: Task | None = None) -> TokenDataset:
    """Read ``path/split`` (all sets listed in dataset.json, concatenated) into a TokenDataset.

    Labels equal to ``ignore_label_id`` become IGNORE_INDEX; ``puzzle_ids`` are each example's puzzle
    identifier; difficulty comes from ``<set>__difficulty.npy`` when present, else from
    ``task.difficulties`` when a task is given, else zeros.  meta holds dataset.json and ``group_ids``.
    """
    folder = Path(path) / split
    if not folder.is_dir():
        raise TaskDataError(f"{folder}: missing split folder (expected {Path(path)}/{{train,test}})")
    meta_path = folder / "dataset.json"
    meta = read_dataset_json(confined_file(folder, meta_path.name))
    vocab_size = int(meta["vocab_size"])
    if task is not None and task.vocab_size:  # a folder prepared for a larger vocabulary: the task's bounds
        vocab_size = min(vocab_size, int(task.vocab_size))
    parts = [_load_set(folder, str(s), meta, vocab_size) for s in meta["sets"]]
    inputs = np.concatenate([p["inputs"] for p in parts]).astype(np.int64, copy=False)
    labels = np.concatenate([p["labels"] for p in parts]).astype(np.int64, copy=False)
    check_task_rows(task, inputs, labels, str(folder))
    ignore = meta["ignore_label_id"]
    if ignore is not None:
        labels[labels == int(ignore)] = IGNORE_INDEX
    if all("difficulty" in p for p in parts):
        difficulty = np.concatenate([p["difficulty"] for p in parts])
    elif task is not None:
        difficulty = task.difficulties(inputs)
    else:
        difficulty = np.zeros(len(inputs))
    group_ids, offset = [], 0
    for p in parts:
        group_ids.append(p["group_ids"] + offset)
        offset += int(p["group_ids"].max()) + 1 if len(p["group_ids"]) else 0
    info = dict(meta, path=str(folder), split=split, group_ids=np.concatenate(group_ids).tolist())
    return TokenDataset(inputs, labels, difficulty, np.concatenate([p["puzzle_ids"] for p in parts]), info)


def save_hrm_folder(
    dataset: TokenDataset, path: str | Path, split: str = "train", vocab_size: int | None = None,
    split_folder: str | Path | None = None,
) -> None:  # fmt: skip
    """Write ``dataset`` as ``path/split`` in HRM's format (set "all"); see the module docstring.
    ``split_folder``: where the split's files go instead of ``path/split`` (a staging folder that is
    swapped in whole afterwards); ``identifiers.json`` is still written to ``path``."""
    inputs, labels = dataset.inputs, dataset.labels
    if vocab_size is None:
        vocab_size = int(dataset.meta.get("vocab_size", 0)) or int(
            max(inputs.max(initial=0), labels.max(initial=0)) + 1
        )
    check_tokens(inputs, "inputs", vocab_size)
    check_tokens(labels, "labels", vocab_size, labels=True)
    dtype = np.uint8 if vocab_size <= 256 else np.int32
    folder = Path(split_folder) if split_folder is not None else Path(path) / split
    root = folder if split_folder is not None else path
    folder.mkdir(parents=True, exist_ok=True)
    save_npy(folder / "all__inputs.npy", inputs.astype(dtype), root=root)
    save_npy(folder / "all__labels.npy", np.where(labels == IGNORE_INDEX, 0, labels).astype(dtype), root=root)
    write_hrm_index(path, split, inputs.shape[1], dataset.puzzle_ids, dataset.difficulty, vocab_size,
                    split_folder=split_folder)  # fmt: skip


def write_hrm_index(path: str | Path, split: str, seq_len: int, puzzle_ids: np.ndarray | None,
                    difficulty: np.ndarray, vocab_size: int, num_ids: int | None = None,
                    split_folder: str | Path | None = None) -> None:  # fmt: skip
    """Everything of ``path/split`` but the inputs / labels arrays (already written there, e.g. through
    ``np.lib.format.open_memmap`` for sets larger than memory): identifiers, CSR offsets, difficulty,
    ``dataset.json`` and ``identifiers.json``.  ``num_ids`` defaults to the largest puzzle id + 1."""
    n = len(difficulty)
    if puzzle_ids is None:
        identifiers = np.zeros(n, dtype=np.int32)
        puzzle_indices = np.arange(n + 1, dtype=np.int32)
        num_ids = num_ids or 1
    else:
        ids = np.asarray(puzzle_ids)
        starts = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]])) if n else np.zeros(0, np.int64)
        identifiers = ids[starts].astype(np.int32)
        puzzle_indices = np.concatenate([starts, [n]]).astype(np.int32)
        num_ids = num_ids or int(ids.max(initial=0)) + 1
    num_puzzles = len(identifiers)
    folder = Path(split_folder) if split_folder is not None else Path(path) / split
    root = folder if split_folder is not None else path
    folder.mkdir(parents=True, exist_ok=True)
    save_npy(folder / "all__puzzle_identifiers.npy", identifiers, root=root)
    save_npy(folder / "all__puzzle_indices.npy", puzzle_indices, root=root)
    save_npy(folder / "all__group_indices.npy", np.arange(num_puzzles + 1, dtype=np.int32), root=root)
    save_npy(folder / "all__difficulty.npy", np.asarray(difficulty, dtype=np.float64), root=root)
    metadata = {
        "pad_id": 0,
        "ignore_label_id": 0,
        "blank_identifier_id": 0,
        "vocab_size": int(vocab_size),
        "seq_len": int(seq_len),
        "num_puzzle_identifiers": int(num_ids),
        "total_groups": num_puzzles,
        "mean_puzzle_examples": float(n / num_puzzles) if num_puzzles else 0.0,
        "sets": ["all"],
    }
    atomic_write_json(folder / "dataset.json", metadata, root=root, indent=2)
    identifiers_path = Path(path) / "identifiers.json"
    names = ["<blank>"] + [str(i) for i in range(1, int(num_ids))]
    try:
        existing = read_json(identifiers_path) if identifiers_path.exists() else []
    except ValueError:  # unreadable: written anew
        existing = []
    if not isinstance(existing, list) or len(existing) < len(names):
        atomic_write_json(identifiers_path, names, root=path)


# ------------------------------------------------------------------------------------------- .npz


def save_npz(dataset: TokenDataset, path: str | Path) -> None:
    """Write a TokenDataset as a compressed ``.npz`` (arrays + JSON meta); the inverse of :func:`load_npz`."""
    arrays = {"inputs": dataset.inputs, "labels": dataset.labels, "difficulty": dataset.difficulty}
    if dataset.puzzle_ids is not None:
        arrays["puzzle_ids"] = dataset.puzzle_ids
    arrays["meta"] = np.array(json.dumps(dataset.meta, default=_json_default))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_writer(path, "wb") as handle:  # a file handle keeps numpy from appending ".npz"
        np.savez_compressed(handle, **arrays)


def save_parquet(dataset: TokenDataset, path: str | Path) -> None:
    """Write a TokenDataset as Parquet, one row per example (``inputs`` / ``labels``: lists of token ids,
    ``difficulty``, ``puzzle_id`` when the set has them; the meta as the schema's ``loopformer`` metadata),
    which ``datasets.load_dataset("parquet", data_files=PATH)`` and ``pyarrow.parquet.read_table`` read."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise RuntimeError("writing Parquet needs pyarrow: pip install 'loopformer[parquet]' (or use the native / hrm "
                           "format)") from None
    columns = {"inputs": pa.array(dataset.inputs.tolist(), pa.list_(pa.int64())),
               "labels": pa.array(dataset.labels.tolist(), pa.list_(pa.int64())),
               "difficulty": pa.array(dataset.difficulty, pa.float64())}  # fmt: skip
    if dataset.puzzle_ids is not None:
        columns["puzzle_id"] = pa.array(dataset.puzzle_ids, pa.int64())
    table = pa.table(columns).replace_schema_metadata({"loopformer": json.dumps(dataset.meta, default=_json_default)})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_writer(path, "wb") as handle:
        pq.write_table(table, handle)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"meta value of type {type(value).__name__} is not JSON-serialisable")


def _read_npz(data: Any, path: Path) -> dict[str, Any]:
    """Every array of the archive, read and checked for kind (no pickles), by name."""
    names = list(data.files)
    missing = [n for n in NPZ_REQUIRED if n not in names]
    if missing:
        raise TaskDataError(f"{path}: not a loopformer dataset (missing array(s) {missing})")
    out = {}
    for name in (n for n in NPZ_KNOWN if n in names):
        try:
            arr = data[name]
        except ValueError as err:  # object arrays need pickles, which are never loaded
            raise TaskDataError(f"{path}: array {name!r} cannot be read without pickle ({err})") from None
        if name != "meta" and arr.dtype.kind not in "biuf":
            raise TaskDataError(f"{path}: array {name!r} has dtype {arr.dtype}, not numbers")
        out[name] = arr
    return out


def _npz_meta(arr: Any, path: Path) -> dict[str, Any]:
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
    path = regular_file(path, TaskDataError, "dataset file")
    # random bytes, a pickle, a truncated archive, a member that does not decompress, a header whose shape
    # does not match its data or claims more than memory
    unreadable = (ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile, zlib.error, NotImplementedError,
                  struct.error, OverflowError, MemoryError)  # fmt: skip
    try:
        data = np.load(path, allow_pickle=False)
    except unreadable as err:
        raise TaskDataError(f"{path}: not a readable .npz dataset archive ({type(err).__name__})") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise TaskDataError(f"{path}: a single .npy array, not an .npz dataset archive")
    try:
        with data:
            arrays = _read_npz(data, path)
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
    check_tokens(inputs, f"{path}: array 'inputs'", vocab_size)
    check_tokens(labels, f"{path}: array 'labels'", vocab_size, labels=True)
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
    return TokenDataset(inputs, labels, difficulty, puzzle_ids, _npz_meta(arrays.get("meta"), path))


class NpzTask(Task):
    """A task whose files are ``.npz`` archives (module docstring): ``load_npz`` bounded by the task's vocabulary
    and ``save_npz``."""

    def load(self, path: str | Path) -> TokenDataset:
        return load_npz(path, self.vocab_size)

    def save(self, dataset: TokenDataset, path: str | Path) -> None:
        save_npz(dataset, path)
