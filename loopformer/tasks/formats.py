"""The HRM / TRM on-disk puzzle format (SYSTEMS.md section 5), read into and written from TokenDataset.

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

import csv
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from loopformer.tasks.base import IGNORE_INDEX, TaskDataError, TokenDataset

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
PUZZLE_CSV_COLUMNS = ("source", "question", "answer", "rating")

PuzzleRowParser = Callable[[str, str, str], "tuple[np.ndarray, np.ndarray, float]"]
"""``parse_row(where, question_text, answer_text) -> (question, answer, fallback_rating)``: validates one
row (raising TaskDataError that starts with ``where``, i.e. "<file>: line <n>"); ``fallback_rating`` is
the difficulty used when the row's rating is empty."""


def _load_npy(path: Path) -> np.ndarray:
    if not path.is_file():
        raise TaskDataError(f"{path}: missing file")
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise TaskDataError(f"{path}: unreadable or truncated .npy file ({exc})") from None


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


def _load_set(folder: Path, set_name: str, meta: dict[str, Any]) -> dict[str, np.ndarray]:
    arrays = {name: _load_npy(folder / f"{set_name}__{name}.npy") for name in ARRAY_FIELDS}
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
        arr = arrays[name]
        if arr.size and (arr.min() < 0 or arr.max() >= meta["vocab_size"]):
            raise TaskDataError(
                f"{folder / f'{set_name}__{name}.npy'}: tokens outside [0, vocab_size={meta['vocab_size']})"
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
        "inputs": inputs.astype(np.int64),
        "labels": labels.astype(np.int64),
        "puzzle_ids": np.repeat(identifiers, np.diff(puzzle_indices)),
        "group_ids": np.repeat(
            np.repeat(np.arange(len(group_indices) - 1), np.diff(group_indices)), np.diff(puzzle_indices)
        ),
    }
    diff_path = folder / f"{set_name}__difficulty.npy"
    if diff_path.exists():
        difficulty = _load_npy(diff_path)
        if difficulty.shape != (len(inputs),):
            raise TaskDataError(f"{diff_path}: shape {difficulty.shape}, expected ({len(inputs)},)")
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
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TaskDataError(f"{meta_path}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise TaskDataError(f"{meta_path}: expected a JSON object")
    missing = [
        f
        for f in ("vocab_size", "seq_len", "sets", "ignore_label_id", "num_puzzle_identifiers")
        if f not in meta
    ]
    if missing:
        raise TaskDataError(f"{meta_path}: missing field(s) {missing}")
    if not isinstance(meta["sets"], list) or not meta["sets"]:
        raise TaskDataError(f"{meta_path}: 'sets' must be a non-empty list of set names")
    parts = [_load_set(folder, str(s), meta) for s in meta["sets"]]
    inputs = np.concatenate([p["inputs"] for p in parts])
    labels = np.concatenate([p["labels"] for p in parts])
    ignore = meta["ignore_label_id"]
    if ignore is not None:
        labels = np.where(labels == int(ignore), IGNORE_INDEX, labels)
    if all("difficulty" in p for p in parts):
        difficulty = np.concatenate([p["difficulty"] for p in parts])
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
    dataset: TokenDataset, path: str | Path, split: str = "train", vocab_size: int | None = None
) -> None:
    """Write ``dataset`` as ``path/split`` in HRM's format (set "all"); see the module docstring."""
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
    n = len(dataset)
    if dataset.puzzle_ids is None:
        identifiers = np.zeros(n, dtype=np.int32)
        puzzle_indices = np.arange(n + 1, dtype=np.int32)
        num_ids = 1
    else:
        ids = dataset.puzzle_ids
        starts = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]])) if n else np.zeros(0, np.int64)
        identifiers = ids[starts].astype(np.int32)
        puzzle_indices = np.concatenate([starts, [n]]).astype(np.int32)
        num_ids = int(ids.max(initial=0)) + 1
    num_puzzles = len(identifiers)
    group_indices = np.arange(num_puzzles + 1, dtype=np.int32)
    folder = Path(path) / split
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "all__inputs.npy", inputs.astype(dtype))
    np.save(folder / "all__labels.npy", np.where(labels == IGNORE_INDEX, 0, labels).astype(dtype))
    np.save(folder / "all__puzzle_identifiers.npy", identifiers)
    np.save(folder / "all__puzzle_indices.npy", puzzle_indices)
    np.save(folder / "all__group_indices.npy", group_indices)
    np.save(folder / "all__difficulty.npy", dataset.difficulty.astype(np.float64))
    metadata = {
        "pad_id": 0,
        "ignore_label_id": 0,
        "blank_identifier_id": 0,
        "vocab_size": int(vocab_size),
        "seq_len": int(inputs.shape[1]),
        "num_puzzle_identifiers": num_ids,
        "total_groups": num_puzzles,
        "mean_puzzle_examples": float(n / num_puzzles) if num_puzzles else 0.0,
        "sets": ["all"],
    }
    (folder / "dataset.json").write_text(json.dumps(metadata, indent=2))
    identifiers_path = Path(path) / "identifiers.json"
    names = ["<blank>"] + [str(i) for i in range(1, num_ids)]
    try:
        existing = json.loads(identifiers_path.read_text()) if identifiers_path.exists() else []
    except (json.JSONDecodeError, UnicodeDecodeError):
        existing = []
    if not isinstance(existing, list) or len(existing) < len(names):
        identifiers_path.write_text(json.dumps(names))


def read_puzzle_csv(
    path: str | Path, parse_row: PuzzleRowParser, seq_len: int, meta: dict[str, Any]
) -> TokenDataset:
    """Read a ``source,question,answer,rating`` CSV (Sudoku-Extreme / Maze-Hard) into a TokenDataset.

    ``parse_row`` turns each row's question / answer text into token grids (see ``PuzzleRowParser``);
    difficulty = the rating column, or the parser's fallback where it is empty.  ``meta`` is extended with
    ``path``, ``source`` (one per row) and ``difficulty = "rating"``.  Errors name the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise TaskDataError(f"{path}: no such file")
    inputs, labels, ratings, sources = [], [], [], []
    with open(path, newline="") as fh:
        reader = csv.reader(fh)
        try:
            header = next(reader)
        except StopIteration:
            raise TaskDataError(f"{path}: empty file (expected header {','.join(PUZZLE_CSV_COLUMNS)})") from None
        except csv.Error as exc:
            raise TaskDataError(f"{path}: line 1: {exc}") from None
        header = [h.strip() for h in header]
        missing = [c for c in ("question", "answer") if c not in header]
        if missing:
            raise TaskDataError(f"{path}: header {header} lacks column(s) {missing}")
        col = {name: header.index(name) for name in header}
        while True:
            try:
                row = next(reader)
            except StopIteration:
                break
            except csv.Error as exc:
                raise TaskDataError(f"{path}: line {reader.line_num}: {exc}") from None
            if not row:
                continue
            where = f"{path}: line {reader.line_num}"
            if len(row) != len(header):
                raise TaskDataError(
                    f"{where}: {len(row)} fields, expected {len(header)} ({','.join(header)}); truncated file?"
                )
            q, a, fallback_rating = parse_row(where, row[col["question"]], row[col["answer"]])
            rating_text = row[col["rating"]].strip() if "rating" in col else ""
            if rating_text:
                try:
                    rating = float(rating_text)
                except ValueError:
                    raise TaskDataError(f"{where}: rating {rating_text!r} is not a number") from None
            else:
                rating = float(fallback_rating)
            inputs.append(q)
            labels.append(a)
            ratings.append(rating)
            sources.append(row[col["source"]] if "source" in col else "")
    n = len(inputs)
    return TokenDataset(
        np.asarray(inputs, dtype=np.int64).reshape(n, seq_len),
        np.asarray(labels, dtype=np.int64).reshape(n, seq_len),
        np.asarray(ratings, dtype=np.float64),
        None,
        {**meta, "path": str(path), "source": sources, "difficulty": "rating"},
    )


def write_puzzle_csv(
    dataset: TokenDataset,
    path: str | Path,
    seq_len: int,
    format_grid: Callable[[np.ndarray], str],
    default_source: str,
) -> None:
    """Write a ``source,question,answer,rating`` CSV; rating = ``dataset.difficulty`` (integers without
    '.0').  Sources come from ``dataset.meta["source"]`` when it has one per row, else ``default_source``
    (plus ``-seed<seed>`` when the meta records a seed)."""
    if dataset.inputs.shape[1:] != (seq_len,):
        raise TaskDataError(f"dataset rows have {dataset.inputs.shape[1]} tokens, expected {seq_len}")
    sources = dataset.meta.get("source")
    if not (isinstance(sources, list) and len(sources) == len(dataset)):
        default = default_source
        if "seed" in dataset.meta:
            default += f"-seed{dataset.meta['seed']}"
        sources = [default] * len(dataset)
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(PUZZLE_CSV_COLUMNS)
        for i in range(len(dataset)):
            d = float(dataset.difficulty[i])
            rating = str(int(d)) if d.is_integer() else repr(d)
            writer.writerow(
                [sources[i], format_grid(dataset.inputs[i]), format_grid(dataset.labels[i]), rating]
            )
