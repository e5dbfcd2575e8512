"""The HRM / TRM on-disk puzzle format (HRM's dataset builders, arXiv 2506.21734), read into and written from TokenDataset.

Layout (as HRM's dataset builders write it)::

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

Writing: when ``puzzle_ids`` is None every example is one puzzle with the blank identifier 0 (HRM's
Sudoku / maze convention); otherwise each run of consecutive equal ids is one puzzle with that identifier.
One group per puzzle.  An extra ``<set>__difficulty.npy`` (float64 [N], ignored by HRM's loader) keeps
the difficulty so that a write/read round trip is exact.

Also here: the ``source,question,answer,rating`` CSV that Sudoku-Extreme and Maze-Hard ship in
(``read_puzzle_csv`` / ``write_puzzle_csv``); the task supplies the per-row grid parser / formatter.
"""

from __future__ import annotations

import json
import tokenize
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from loopformer.files import atomic_write_json, save_npy
from loopformer.tasks.base import IGNORE_INDEX, TaskDataError, TokenDataset
from loopformer.tasks.puzzle_csv import (  # noqa: F401  (re-exported: the CSV half of the formats)
    PUZZLE_CSV_COLUMNS,
    FastRows,
    PuzzleRowParser,
    read_puzzle_csv,
    write_puzzle_csv,
)

if TYPE_CHECKING:
    from loopformer.tasks.base import Task

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


def _load_npy(path: Path) -> np.ndarray:
    """A .npy file, memory-mapped (nothing is read until used); numeric dtypes only (no pickles)."""
    if not path.is_file():
        raise TaskDataError(f"{path}: missing file")
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError, SyntaxError, tokenize.TokenError) as exc:  # a corrupt header
        raise TaskDataError(f"{path}: unreadable or truncated .npy file ({type(exc).__name__})") from None
    if arr.dtype.kind not in "biuf":
        raise TaskDataError(f"{path}: dtype {arr.dtype} is not numeric")
    return arr


def _check_tokens(arr: np.ndarray, path: Path, vocab_size: int) -> None:
    """Integer tokens in [0, vocab_size), checked in blocks of rows (the array may be memory-mapped)."""
    if arr.dtype.kind not in "iu":
        raise TaskDataError(
            f"{path}: dtype {arr.dtype}: token arrays must hold integers (floats are not truncated to tokens)"
        )
    for start in range(0, len(arr), 1 << 16):
        block = np.asarray(arr[start : start + (1 << 16)])
        bad = (block < 0) | (block >= vocab_size)
        if bad.any():
            r, c = divmod(int(np.flatnonzero(bad.reshape(-1))[0]), block.shape[1])
            raise TaskDataError(
                f"{path}: tokens outside [0, vocab_size={vocab_size}): first at row {start + r}, column {c} "
                f"(token {int(block[r, c])})"
            )


def _maze_agreement(q: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Maze-Hard tokens (1 '#', 2 ' ', 3 'S', 4 'G', 5 'o'): the label keeps walls, S and G, marks the path
    on open cells only, and the input holds one S, one G and no path."""
    from loopformer.tasks.maze import GOAL, OPEN, PATH, START

    ok = np.where(q == OPEN, (a == OPEN) | (a == PATH), a == q).all(axis=1)
    return ok & ((q == START).sum(1) == 1) & ((q == GOAL).sum(1) == 1) & ~(q == PATH).any(axis=1)


def check_task_rows(task: Task | None, inputs: np.ndarray, labels: np.ndarray, where: str) -> None:
    """The task's vectorised label / input agreement check where it has one (Sudoku: the label is a
    complete valid grid keeping every given; maze: the label keeps walls, S and G and marks the path on open
    cells); the error names the first failing row.  (Maze shortest-path validity is checked per row by the
    CSV loader, not here.)"""
    if task is None or task.name not in ("sudoku", "maze"):
        return
    if inputs.shape[1:] != (task.seq_len,):
        raise TaskDataError(
            f"{where}: rows have {inputs.shape[1]} tokens, task {task.name!r} expects {task.seq_len}"
        )
    if task.name == "sudoku":
        from loopformer.tasks.puzzle_csv import sudoku_fast_rows

        check = sudoku_fast_rows(task.geometry.units, task.size, task.symbols).check  # type: ignore[attr-defined]
        why = "incomplete, changes a given, or repeats a digit in a row / column / box"
    else:
        check, why = (
            _maze_agreement,
            "walls / S / G changed, a path off the open cells, or not one S and one G",
        )
    for start in range(0, len(inputs), 1 << 16):
        ok = check(np.asarray(inputs[start : start + (1 << 16)], dtype=np.int64),
                   np.asarray(labels[start : start + (1 << 16)], dtype=np.int64))  # fmt: skip
        if not ok.all():
            row = start + int(np.flatnonzero(~ok)[0])
            raise TaskDataError(f"{where}: row {row}: the label does not agree with the input ({why})")


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
    from loopformer.tasks.dataset_meta import confined_file

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
        _check_tokens(arrays[name], folder / f"{set_name}__{name}.npy", vocab_size)
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
    ``task.difficulty`` when a task is given, else zeros.  meta holds dataset.json and ``group_ids``.
    """
    folder = Path(path) / split
    if not folder.is_dir():
        raise TaskDataError(f"{folder}: missing split folder (expected {Path(path)}/{{train,test}})")
    meta_path = folder / "dataset.json"
    if not meta_path.is_file():
        raise TaskDataError(f"{meta_path}: missing file")
    from loopformer.tasks.dataset_meta import confined_file, read_dataset_json

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
    elif task is not None and task.name == "sudoku":
        difficulty = (inputs == 1).sum(axis=1).astype(np.float64)  # SudokuTask.difficulty: the blank count
    elif task is not None:
        difficulty = np.asarray([task.difficulty(row) for row in inputs], dtype=np.float64)
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
) -> None:
    """Write ``dataset`` as ``path/split`` in HRM's format (set "all"); see the module docstring.
    ``split_folder``: where the split's files go instead of ``path/split`` (a staging folder that is
    swapped in whole afterwards); ``identifiers.json`` is still written to ``path``."""
    inputs, labels = dataset.inputs, dataset.labels
    if vocab_size is None:
        vocab_size = int(dataset.meta.get("vocab_size", 0)) or int(
            max(inputs.max(initial=0), labels.max(initial=0)) + 1
        )
    if inputs.size and (inputs.min() < 0 or inputs.max() >= vocab_size):
        raise TaskDataError(f"inputs have tokens outside [0, vocab_size={vocab_size})")
    real = labels[labels != IGNORE_INDEX]
    if real.size and (real.min() < 0 or real.max() >= vocab_size):
        raise TaskDataError(
            f"labels have tokens outside [0, vocab_size={vocab_size}) other than IGNORE_INDEX"
        )
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
        existing = json.loads(identifiers_path.read_text()) if identifiers_path.exists() else []
    except (json.JSONDecodeError, UnicodeDecodeError):
        existing = []
    if not isinstance(existing, list) or len(existing) < len(names):
        atomic_write_json(identifiers_path, names, root=path)
