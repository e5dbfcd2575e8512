"""The ``source,question,answer,rating`` CSV of Sudoku-Extreme and Maze-Hard: a vectorised reader.

Sudoku-Extreme's ``train.csv`` has 3.8M rows (hub dataset ``sapientinc/sudoku-extreme``, read the same
way by HRM's and TRM's ``dataset/build_sudoku_dataset.py``), so the reader works on bytes with numpy:

* the file is read in blocks of ``CHUNK_BYTES`` cut at line breaks, so memory stays bounded; a line
  longer than ``MAX_LINE_BYTES`` (a file without line breaks, a binary file) is rejected after reading
  at most one block;
* in each block, line and comma positions come from one pass; rows whose fields have the expected
  shape (no quotes, the right number of commas, ``seq_len`` characters of the task's alphabet, a
  plain integer rating) are tokenised by table look-up and validated in one vectorised call of the
  task's ``FastRows.check``;
* every other row (quoted fields, empty answers or ratings, blanks written as whitespace, any row the
  fast check rejects) takes the slow path: Python's ``csv`` module and the task's per-row parser,
  which fills in what the fast path cannot (a solver for an empty answer) or raises the precise error.

Errors name the file, the line and the column: ``<file>: line <n>: <column> ...``.  Also errors: bytes
that are not UTF-8, a non-finite rating (``nan``, ``inf``), and a last line without a line break (the
file may have been cut inside the rating: ``...,12`` cut to ``...,1`` would otherwise load silently).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loopformer.files import regular_file
from loopformer.tasks.base import TaskDataError, TokenDataset

PUZZLE_CSV_COLUMNS = ("source", "question", "answer", "rating")
CHUNK_BYTES = 1 << 24
MAX_LINE_BYTES = 1 << 20
MAX_FAST_RATING_DIGITS = 15

PuzzleRowParser = Callable[[str, str, str], "tuple[np.ndarray, np.ndarray, float]"]
"""``parse_row(where, question_text, answer_text) -> (question, answer, fallback_rating)``: validates one
row (raising TaskDataError that starts with ``where``, i.e. "<file>: line <n>"); ``fallback_rating`` is
the difficulty used when the row's rating is empty."""


@dataclass(frozen=True)
class FastRows:
    """A task's vectorised row path.

    question_lut / answer_lut: uint8 [256], byte -> token, 255 for a byte the fast path does not take.
    check(q, a) -> bool [N] for integer token arrays [N, T]: True for valid rows (the slow path explains
    the others).
    difficulty(q) -> float [N]: the rating used where a row has none (None: such rows go the slow path).
    """

    question_lut: np.ndarray
    answer_lut: np.ndarray
    check: Callable[[np.ndarray, np.ndarray], np.ndarray]
    difficulty: Callable[[np.ndarray], np.ndarray] | None = None


def _blocks(path: Path, chunk_bytes: int, max_line: int) -> Iterator[tuple[int, bytes, bool]]:
    """(first line number, block, terminated): blocks of whole lines; the last may lack its line break. ``path``
    must be a regular file (``loopformer.files.regular_file``: a FIFO or a device is named, never read)."""
    with open(regular_file(path, TaskDataError), "rb") as fh:
        carry, line = b"", 1
        while True:
            data = fh.read(chunk_bytes)
            if not data:
                break
            buf = carry + data if carry else data
            cut = buf.rfind(b"\n") + 1
            block, carry = buf[:cut], buf[cut:]
            if len(carry) > max_line:
                line_at = line + block.count(b"\n")
                raise TaskDataError(
                    f"{path}: line {line_at}: longer than {max_line} bytes without a line break "
                    "(not a puzzle CSV?)"
                )
            if block:
                yield line, block, True
                line += block.count(b"\n")
        if carry:
            yield line, carry, False


def _check_utf8(path: Path, first_line: int, block: bytes, arr: np.ndarray) -> None:
    if not (arr >= 0x80).any():
        return
    try:
        block.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = first_line + block.count(b"\n", 0, exc.start)
        column = exc.start - (block.rfind(b"\n", 0, exc.start) + 1) + 1
        raise TaskDataError(
            f"{path}: line {line}: byte {column} (0x{block[exc.start]:02x}) is not UTF-8 text"
        ) from None


def _rating(where: str, text: str) -> float | None:
    text = text.strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise TaskDataError(f"{where}: column 'rating': rating {text!r} is not a number") from None
    if not math.isfinite(value):
        raise TaskDataError(f"{where}: column 'rating': rating {text!r} is not a finite number")
    return value


class _Reader:
    """State of one read: the header's column positions and the task's parsers."""

    def __init__(self, path: Path, header: list[str], parse_row: PuzzleRowParser, fast: FastRows | None,
                 seq_len: int) -> None:  # fmt: skip
        self.path, self.header, self.parse_row, self.fast, self.seq_len = (
            path,
            header,
            parse_row,
            fast,
            seq_len,
        )
        self.col = {name: header.index(name) for name in header}

    def slow_row(self, line: int, text: str) -> tuple[np.ndarray, np.ndarray, float, str] | None:
        """One row through the csv module and the task's parser; None for an empty line."""
        where = f"{self.path}: line {line}"
        try:
            rows = list(csv.reader([text]))
        except csv.Error as exc:
            raise TaskDataError(f"{where}: {exc}") from None
        if not rows or not rows[0]:
            return None
        row = rows[0]
        if len(row) != len(self.header):
            raise TaskDataError(
                f"{where}: {len(row)} fields, expected {len(self.header)} ({','.join(self.header)}); truncated file?"
            )
        q, a, fallback = self.parse_row(where, row[self.col["question"]], row[self.col["answer"]])
        rating = _rating(where, row[self.col["rating"]]) if "rating" in self.col else None
        source = row[self.col["source"]] if "source" in self.col else ""
        return q, a, float(fallback) if rating is None else rating, source

    def block(self, first_line: int, block: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
        """Parse a block of whole lines: (questions uint8 [n, T], answers, ratings, sources)."""
        arr = np.frombuffer(block, dtype=np.uint8)
        _check_utf8(self.path, first_line, block, arr)
        ends = np.flatnonzero(arr == 10)
        starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
        ends = ends.astype(np.int64)
        cr = (ends > starts) & (arr[np.maximum(ends - 1, 0)] == 13)
        ends[cr] -= 1
        keep = np.flatnonzero(ends > starts)
        starts, ends, lines = starts[keep], ends[keep], first_line + keep
        n, T = len(keep), self.seq_len
        q_out, a_out = np.zeros((n, T), np.uint8), np.zeros((n, T), np.uint8)
        r_out, sources = np.zeros(n), np.empty(n, dtype=object)
        fast_rows = (
            self._fast(arr, starts, ends, q_out, a_out, r_out, sources) if self.fast else np.zeros(n, bool)
        )
        for i in np.flatnonzero(~fast_rows):
            parsed = self.slow_row(int(lines[i]), block[starts[i] : ends[i]].decode("utf-8"))
            if parsed is None:
                continue
            q, a, r_out[i], sources[i] = parsed
            q_out[i], a_out[i] = q, a
            fast_rows[i] = True
        return q_out, a_out, r_out, sources.tolist()

    def _field(self, arr: np.ndarray, commas: np.ndarray, c0: np.ndarray, starts: np.ndarray,
               ends: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        k = len(self.header)
        s = starts if j == 0 else commas[c0 + j - 1] + 1
        e = ends if j == k - 1 else commas[c0 + j]
        return s, e

    def _fast(self, arr: np.ndarray, starts: np.ndarray, ends: np.ndarray, q_out: np.ndarray, a_out: np.ndarray,
              r_out: np.ndarray, sources: np.ndarray) -> np.ndarray:  # fmt: skip
        """Fill the rows the fast path can take; returns their mask."""
        fast, T = self.fast, self.seq_len
        assert fast is not None
        commas = np.flatnonzero(arr == 44)
        if len(commas) < len(self.header) - 1:
            return np.zeros(len(starts), bool)
        quotes = np.flatnonzero(arr == 34)
        c0 = np.searchsorted(commas, starts)
        ok = (np.searchsorted(commas, ends) - c0 == len(self.header) - 1) & (
            np.searchsorted(quotes, ends) == np.searchsorted(quotes, starts)
        )
        c0 = np.where(ok, c0, 0)
        if len(arr) < T:
            return np.zeros(len(starts), bool)
        windows = np.lib.stride_tricks.sliding_window_view(arr, T)  # windows[s] = arr[s : s + T], no copy
        grids = []
        for name, lut in (("question", fast.question_lut), ("answer", fast.answer_lut)):
            s, e = self._field(arr, commas, c0, starts, ends, self.col[name])
            ok &= e - s == T
            tokens = lut[windows[np.where(ok, s, 0)]]
            ok &= (tokens != 255).all(axis=1)
            grids.append(tokens)
        if "rating" in self.col:
            rating, has, empty = self._fast_rating(arr, commas, c0, starts, ends)
            ok &= has | (empty & (fast.difficulty is not None))
        else:
            rating, has = np.zeros(len(starts)), np.zeros(len(starts), bool)
            ok &= fast.difficulty is not None
        rows = np.flatnonzero(ok)
        q, a = grids[0][rows], grids[1][rows]
        valid = np.asarray(fast.check(q, a), dtype=bool)
        rows, q, a = rows[valid], q[valid], a[valid]
        q_out[rows], a_out[rows] = q, a
        r_out[rows] = rating[rows]
        missing = rows[~has[rows]]
        if len(missing):
            assert fast.difficulty is not None
            r_out[missing] = fast.difficulty(q[~has[rows]])
        if "source" in self.col:
            s, e = self._field(arr, commas, c0, starts, ends, self.col["source"])
            sources[rows] = _decode_fields(arr, s[rows], e[rows])
        else:
            sources[rows] = ""
        mask = np.zeros(len(starts), bool)
        mask[rows] = True
        return mask

    def _fast_rating(self, arr: np.ndarray, commas: np.ndarray, c0: np.ndarray, starts: np.ndarray,
                     ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        """Plain non-negative integer ratings of up to 15 digits: (values, parsed mask, empty mask)."""
        s, e = self._field(arr, commas, c0, starts, ends, self.col["rating"])
        width = e - s
        has = (width >= 1) & (width <= MAX_FAST_RATING_DIGITS)
        values = np.zeros(len(s), dtype=np.int64)
        last = len(arr) - 1
        for j in range(int(np.where(has, width, 0).max(initial=0))):  # one digit column at a time
            digit = arr[np.minimum(s + j, last)].astype(np.int64) - 48
            active = j < width
            has &= ~active | ((digit >= 0) & (digit <= 9))
            values = np.where(active, values * 10 + digit, values)
        return values.astype(np.float64), has, width == 0


def _decode_fields(arr: np.ndarray, s: np.ndarray, e: np.ndarray) -> np.ndarray:
    """The byte fields [s, e) as str: distinct values decoded once (sources repeat across rows), found by
    ``np.unique`` over each field's bytes (zero-padded to the longest) and length."""
    width = e - s
    W = int(width.max(initial=0))
    if len(s) == 0 or W > 256:
        return np.asarray([arr[a:b].tobytes().decode("utf-8") for a, b in zip(s, e)], dtype=object)
    windows = np.lib.stride_tricks.sliding_window_view(np.concatenate([arr, np.zeros(W, np.uint8)]), W)[s]
    keys = np.concatenate([np.where(np.arange(W) < width[:, None], windows, 0).astype(np.uint8),
                           width[:, None].astype("<u2").view(np.uint8)], axis=1)  # fmt: skip
    _, first, inverse = np.unique(keys.view(np.dtype((np.void, W + 2))).ravel(), return_index=True,
                                  return_inverse=True)  # fmt: skip
    names = np.asarray([arr[s[i] : e[i]].tobytes().decode("utf-8") for i in first], dtype=object)
    return names[inverse.reshape(-1)]


def sudoku_fast_rows(units: list[tuple[int, ...]], size: int, symbols: str) -> FastRows:
    """The vectorised path of a size x size Sudoku: '.' / '0' blank (token 1), symbol i -> token i + 2 (either
    case); a row is valid when the answer is complete, keeps every given, and each of ``units`` (rows,
    columns, boxes) holds every digit once (the bitwise OR of its digits' bits is full)."""
    lut = np.full(256, 255, dtype=np.uint8)
    lut[[ord("."), ord("0")]] = 1
    for i, ch in enumerate(symbols[:size]):
        lut[[ord(ch.upper()), ord(ch.lower())]] = i + 2
    unit_index = np.asarray(units, dtype=np.int64)  # [units, size]
    full = (1 << size) - 1
    bit = np.zeros(max(256, size + 2), dtype=np.uint16)
    bit[2 : size + 2] = 1 << np.arange(size)  # token d + 2 -> bit d

    def check(q: np.ndarray, a: np.ndarray) -> np.ndarray:
        ok = ((a >= 2) & (a <= size + 1) & (q >= 1) & (q <= size + 1) & ((q < 2) | (q == a))).all(axis=1)
        for start in range(0, len(a), 16384):  # [rows, units, size] bits at a time: at most 25 MB (16 x 16)
            bits = bit[np.clip(a[start : start + 16384], 0, size + 1)][:, unit_index]
            ok[start : start + 16384] &= (np.bitwise_or.reduce(bits, axis=2) == full).all(axis=1)
        return ok

    def blanks(q: np.ndarray) -> np.ndarray:
        return (q == 1).sum(axis=1).astype(np.float64)

    return FastRows(lut, lut, check, blanks)


def _read_header(path: Path, first: bytes) -> tuple[list[str], int]:
    """(header fields, length of the header line in bytes) from the first block."""
    cut = first.find(b"\n")
    raw = first if cut < 0 else first[:cut]
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise TaskDataError(f"{path}: line 1: byte {exc.start + 1} is not UTF-8 text") from None
    try:
        rows = list(csv.reader([text.rstrip("\r")]))
    except csv.Error as exc:
        raise TaskDataError(f"{path}: line 1: {exc}") from None
    header = [h.strip() for h in rows[0]] if rows else []
    if not header:
        raise TaskDataError(f"{path}: empty file (expected header {','.join(PUZZLE_CSV_COLUMNS)})")
    for i, name in enumerate(header):
        if name in header[:i]:  # which of the two would be read is a guess: refused
            raise TaskDataError(
                f"{path}: line 1 (the header): column {name[:40]!r} appears twice (fields {header.index(name) + 1} "
                f"and {i + 1})"
            )
    missing = [c for c in ("question", "answer") if c not in header]
    if missing:
        # the header is not quoted: a data path read from a run's config.json may name any file
        raise TaskDataError(
            f"{path}: line 1 (the header) lacks column(s) {missing}; expected {','.join(PUZZLE_CSV_COLUMNS)}"
        )
    return header, (len(first) if cut < 0 else cut + 1)


def read_puzzle_csv(
    path: str | Path,
    parse_row: PuzzleRowParser,
    seq_len: int,
    meta: dict[str, Any],
    fast: FastRows | None = None,
    progress: Callable[[int], None] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> TokenDataset:
    """Read a ``source,question,answer,rating`` CSV (Sudoku-Extreme / Maze-Hard) into a TokenDataset.

    ``parse_row`` turns one row's question / answer text into token grids (see ``PuzzleRowParser``);
    ``fast`` is the task's vectorised path (see the module docstring).  difficulty = the rating column,
    or the parser's fallback where it is empty.  ``meta`` is extended with ``path``, ``source`` (one per
    row) and ``difficulty = "rating"``.  ``progress(n_bytes)`` is called after every block.
    """
    path = Path(path)
    reader: _Reader | None = None
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]] = []
    for first_line, block, terminated in _blocks(path, chunk_bytes, max_line_bytes):
        skip = 0
        if reader is None:
            header, skip = _read_header(path, block)
            reader = _Reader(path, header, parse_row, fast, seq_len)
            first_line += 1
        body = block[skip:]
        if not terminated:
            last = reader.block(first_line, body + b"\n")
            if len(last[0]):  # the row parsed: still, it may have been cut inside the rating
                line = first_line + body.count(b"\n")
                raise TaskDataError(
                    f"{path}: line {line}: the file ends without a line break, so "
                    "the last row may be cut short (a truncated download?); end the file with a newline "
                    "if the row is complete"
                )
        elif body:
            parts.append(reader.block(first_line, body))
        if progress is not None:
            progress(len(block))
    if reader is None:
        raise TaskDataError(f"{path}: empty file (expected header {','.join(PUZZLE_CSV_COLUMNS)})")
    return _assemble(path, parts, seq_len, meta)


def _assemble(path: Path, parts: list[Any], seq_len: int, meta: dict[str, Any]) -> TokenDataset:
    if parts:
        inputs = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        ratings = np.concatenate([p[2] for p in parts])
        sources = [s for p in parts for s in p[3]]
    else:
        inputs = labels = np.zeros((0, seq_len), np.uint8)
        ratings, sources = np.zeros(0), []
    return TokenDataset(inputs, labels, ratings, None, {**meta, "path": str(path), "source": sources,
                                                        "difficulty": "rating"})  # fmt: skip


def first_question(path: str | Path) -> str:
    """The first row's ``question`` of a puzzle CSV ('' without one): what a task reads its size off, read in
    blocks of whole lines as ``read_puzzle_csv`` reads (a line past ``MAX_LINE_BYTES`` is an error)."""
    lines: list[str] = []
    for _, block, _ in _blocks(Path(path), 1 << 16, MAX_LINE_BYTES):
        lines += block.decode("utf-8", errors="replace").splitlines()
        if len(lines) >= 2:
            break
    return next(csv.DictReader(lines[:2]), {}).get("question") or ""


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
    if not (isinstance(sources, list | np.ndarray) and len(sources) == len(dataset)):
        default = default_source
        if "seed" in dataset.meta:
            default += f"-seed{dataset.meta['seed']}"
        sources = [default] * len(dataset)
    from loopformer.files import atomic_writer

    with atomic_writer(path, "w", newline="") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(PUZZLE_CSV_COLUMNS)
        for i in range(len(dataset)):
            d = float(dataset.difficulty[i])
            rating = str(int(d)) if d.is_integer() else repr(d)
            writer.writerow(
                [sources[i], format_grid(dataset.inputs[i]), format_grid(dataset.labels[i]), rating]
            )
