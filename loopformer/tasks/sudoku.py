"""Sudoku of any box shape: exact solver, unique-solution generator, augmentations, Sudoku-Extreme CSV.

Data conventions follow HRM's dataset builders, arXiv 2506.21734 (Sudoku-Extreme, HRM/TRM):
- tokens: 0 = PAD (unused), 1 = blank, digit d -> d + 1; vocab = size + 2; seq_len = size * size;
  labels are the full solution's tokens (HRM's ``arr + 1`` encoding).
- CSV ``source,question,answer,rating``: ``question``/``answer`` are size*size characters row-major,
  '.' (or '0') for blanks; digits are the symbols ``123456789ABCDEFG`` (so 16x16 writes 10..16 as
  A..G, read case-insensitively).  ``rating`` in Sudoku-Extreme is the tdoku backtrack count; here
  ``load`` puts the rating column into ``TokenDataset.difficulty`` and ``save`` writes ``difficulty``
  as the rating, so the two are exact inverses.  Generated datasets use difficulty = number of blanks
  and keep the solver's backtrack counts in ``meta["backtracks"]``.

Solver and generator: ``loopformer.tasks.sudoku_solver`` (bitmask candidates, naked + hidden singles,
MRV search counting refuted branches as ``backtracks``; clues removed while the solution stays unique).

Augmentations (HRM's dataset builders, arXiv 2506.21734: digit permutation, band / row-in-band and stack / column-in-stack
shuffles, transpose) have exact inverses; transpose is only offered for square boxes (it would swap a 2x3 box into a 3x2 box).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loopformer.tasks.base import Task, TaskDataError, TokenDataset, sub_seed
from loopformer.tasks.puzzle_csv import (
    FastRows,
    first_question,
    read_puzzle_csv,
    sudoku_fast_rows,
    write_puzzle_csv,
)
from loopformer.tasks.sudoku_solver import SYMBOLS, SudokuGeometry, generate_worker, search, warm_up

BLANK_TOKEN = 1
DEFAULT_BOXES: dict[int, tuple[int, int]] = {4: (2, 2), 6: (2, 3), 9: (3, 3), 16: (4, 4)}


# ----------------------------------------------------------------------------------------------------
# augmentation
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SudokuTransform:
    """A validity-preserving relabelling: out = digit_map[transpose?(grid[rows][:, cols])].

    digit_map[d - 1] is the new digit for digit d; rows / cols are the source row / column of each output
    row / column (band and row-in-band / stack and column-in-stack shuffles); transpose applies last.
    """

    digit_map: tuple[int, ...]
    rows: tuple[int, ...]
    cols: tuple[int, ...]
    transpose: bool


# ----------------------------------------------------------------------------------------------------
# the task
# ----------------------------------------------------------------------------------------------------


class SudokuTask(Task):
    """size x size Sudoku with box_r x box_c boxes (4: 2x2, 6: 2x3, 9: 3x3, 16: 4x4 unless ``box`` given)."""

    name = "sudoku"
    causal = False

    def __init__(self, size: int = 9, box: tuple[int, int] | list[int] | None = None) -> None:
        if box is None:
            if size not in DEFAULT_BOXES:
                raise ValueError(f"no default box shape for size {size}; pass box=(rows, cols)")
            box = DEFAULT_BOXES[size]
        box_t = (int(box[0]), int(box[1]))
        self.geometry = SudokuGeometry(size, box_t)
        self.size = size
        self.box = box_t
        self.vocab_size = size + 2
        self.seq_len = size * size
        self.symbols = SYMBOLS[:size]
        self._fast_rows = sudoku_fast_rows(self.geometry.units, size, self.symbols)

    # ---------------------------------------------------------------- conversions
    def _digits(self, grid: np.ndarray | list[int], what: str = "grid") -> list[int]:
        """Token array [T] or [size, size] -> digits list (0 blank)."""
        arr = np.asarray(grid).reshape(-1)
        if arr.shape != (self.seq_len,):
            raise TaskDataError(f"{what} has {arr.size} cells, expected {self.seq_len}")
        if arr.min() < BLANK_TOKEN or arr.max() > self.size + 1:
            raise TaskDataError(
                f"{what} has tokens outside [1, {self.size + 1}] (1 = blank, d + 1 = digit d)"
            )
        return [int(t) - 1 for t in arr]

    def parse_grid(self, text: str, what: str = "grid") -> np.ndarray:
        """size*size characters row-major ('.' or '0' blank, symbols 1-9 A-G; whitespace ignored) -> tokens [T]."""
        chars = "".join(text.split())
        if len(chars) != self.seq_len:
            raise TaskDataError(f"{what} has {len(chars)} characters, expected {self.seq_len}")
        codes = np.fromiter((min(ord(ch), 255) for ch in chars), np.int64, len(chars))
        out = self._fast_rows.question_lut[codes].astype(np.int64)  # the CSV reader's table: 255 = not a cell
        bad = np.flatnonzero(out == 255)
        if bad.size:
            raise TaskDataError(f"{what} has bad character {chars[bad[0]]!r} at position {bad[0]} "
                                f"(allowed: '.', '0', {self.symbols!r})")  # fmt: skip
        return out

    def format_grid(self, tokens: np.ndarray) -> str:
        """Tokens [T] -> size*size characters, '.' for blanks (the CSV encoding)."""
        return "".join("." if d == 0 else self.symbols[d - 1] for d in self._digits(tokens))

    def find_conflict(self, tokens: np.ndarray) -> str | None:
        """A description of the first duplicated digit in a row / column / box, or None."""
        digits = self._digits(tokens)
        geo = self.geometry
        for kind, units in (("row", geo.rows), ("column", geo.cols), ("box", geo.boxes)):
            for idx, unit in enumerate(units):
                seen: dict[int, int] = {}
                for cell in unit:
                    d = digits[cell]
                    if d:
                        if d in seen:
                            return f"digit {self.symbols[d - 1]} appears twice in {kind} {idx + 1}"
                        seen[d] = cell
        return None

    # ---------------------------------------------------------------- solver
    def solve(self, grid: np.ndarray) -> tuple[np.ndarray | None, int]:
        """(solution tokens [T] or None if unsolvable, backtracks) for a token grid; the first solution found."""
        solution, _, backtracks = search(self.geometry, self._digits(grid), 1)
        return (None if solution is None else np.asarray(solution, dtype=np.int64) + 1), backtracks

    def count_solutions(self, grid: np.ndarray, limit: int = 2) -> int:
        """Number of solutions, counting stops at ``limit``."""
        return search(self.geometry, self._digits(grid), limit)[1]

    def backtracks(self, grid: np.ndarray) -> int:
        """Refuted branches of a full uniqueness search (solve to the second solution or exhaustion)."""
        return search(self.geometry, self._digits(grid), 2)[2]

    # ---------------------------------------------------------------- generation
    def generate(
        self,
        n: int,
        seed: int,
        min_blanks: int | None = None,
        max_blanks: int | None = None,
        min_backtracks: int = 0,
        workers: int | None = None,
        progress: Any = None,
    ) -> TokenDataset:
        """``n`` distinct puzzles with unique solutions, deterministic in ``seed`` (independent of workers).

        Each puzzle draws a target blank count uniformly in [min_blanks, max_blanks] (defaults: half the
        cells .. all cells; 60% of cells for 16x16) and removes clues in random order until the target is met or no clue can be
        removed without losing uniqueness (a minimal puzzle); puzzles short of ``min_blanks`` or with fewer
        than ``min_backtracks`` solver backtracks are redrawn.  difficulty = blanks; meta["backtracks"].
        ``workers``: processes (default: all CPUs when n >= 200); ``progress(k)`` is called as puzzles finish.
        """
        cells = self.seq_len
        # 16x16 near-minimal puzzles cost seconds each to prove unique; default to 60% blanks there
        hi = (cells if self.size <= 9 else int(0.6 * cells)) if max_blanks is None else int(max_blanks)
        lo = min(cells // 2, hi) if min_blanks is None else int(min_blanks)
        if max_blanks is None:
            hi = max(hi, lo)
        if not 0 <= lo <= hi <= cells:
            raise ValueError(f"need 0 <= min_blanks ({lo}) <= max_blanks ({hi}) <= {cells}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if workers is None:
            import os

            workers = (os.cpu_count() or 1) if n >= 200 else 1

        results: list[tuple[list[int], list[int], int, int] | None] = [None] * n
        attempts = [0] * n
        seen: set[tuple[int, ...]] = set()
        todo = list(range(n))
        pool = None
        warm_up()  # compile the kernels once here, before forking workers that would each compile them
        if workers > 1:
            import multiprocessing as mp

            pool = mp.get_context("fork" if hasattr(__import__("os"), "fork") else "spawn").Pool(workers)
        try:
            while todo:
                jobs = [
                    (self.size, self.box, sub_seed(seed, i, attempts[i]), lo, hi, int(min_backtracks))
                    for i in todo
                ]
                if pool is not None:
                    outs = pool.imap(
                        generate_worker, jobs, chunksize=max(1, min(64, len(jobs) // (8 * workers)))
                    )
                else:
                    outs = map(generate_worker, jobs)
                retry = []
                for i, out in zip(todo, outs):
                    key = tuple(out[0])
                    if key in seen:
                        attempts[i] += 1
                        if attempts[i] > 50:
                            raise ValueError(
                                f"only {len(seen)} distinct {self.size}x{self.size} puzzles found for "
                                f"min_blanks={lo}, max_blanks={hi}; ask for fewer than {n}"
                            )
                        retry.append(i)
                        continue
                    seen.add(key)
                    results[i] = out
                    if progress is not None:
                        progress(1)
                todo = retry
        finally:
            if pool is not None:
                pool.close()
                pool.join()

        inputs = np.asarray([r[0] for r in results], dtype=np.int64).reshape(n, cells) + 1  # type: ignore[index]
        labels = np.asarray([r[1] for r in results], dtype=np.int64).reshape(n, cells) + 1  # type: ignore[index]
        blanks = np.asarray([r[2] for r in results], dtype=np.float64)  # type: ignore[index]
        backtracks = [int(r[3]) for r in results]  # type: ignore[index]
        meta = {
            "task": self.name,
            "size": self.size,
            "box": list(self.box),
            "seed": seed,
            "min_blanks": lo,
            "max_blanks": hi,
            "min_backtracks": int(min_backtracks),
            "difficulty": "blanks",
            "backtracks": backtracks,
        }
        return TokenDataset(inputs, labels, blanks, None, meta)

    # ---------------------------------------------------------------- augmentation
    def random_transform(self, rng: np.random.Generator) -> SudokuTransform:
        size, (box_r, box_c) = self.size, self.box
        bands = rng.permutation(size // box_r)
        rows = [int(b * box_r + r) for b in bands for r in rng.permutation(box_r)]
        stacks = rng.permutation(size // box_c)
        cols = [int(s * box_c + c) for s in stacks for c in rng.permutation(box_c)]
        digit_map = tuple(int(d) + 1 for d in rng.permutation(size))
        transpose = bool(box_r == box_c and rng.random() < 0.5)
        return SudokuTransform(digit_map, tuple(rows), tuple(cols), transpose)

    def _token_map(self, digit_map: tuple[int, ...]) -> np.ndarray:
        table = np.arange(self.size + 2, dtype=np.int64)
        table[2:] = np.asarray(digit_map, dtype=np.int64) + 1
        return table

    def apply_transform(self, grid: np.ndarray, transform: SudokuTransform) -> np.ndarray:
        """Apply ``transform`` to a token grid ([T] or [size, size]; same shape back)."""
        arr = np.asarray(grid, dtype=np.int64)
        g = arr.reshape(self.size, self.size)[np.ix_(transform.rows, transform.cols)]
        if transform.transpose:
            if self.box[0] != self.box[1]:
                raise ValueError(f"transpose does not preserve {self.box[0]}x{self.box[1]} boxes")
            g = g.T
        return self._token_map(transform.digit_map)[g].reshape(arr.shape)

    def invert(self, grid: np.ndarray, transform: SudokuTransform) -> np.ndarray:
        """Exact inverse of ``apply_transform``: the transform of the inverted permutations (after a transpose the
        row and column orders swap, as transpose(g[rows][:, cols]) = transpose(g)[cols][:, rows])."""
        digits, rows, cols = (tuple(int(i) for i in np.argsort(p)) for p in (transform.digit_map, transform.rows, transform.cols))
        if transform.transpose:
            rows, cols = cols, rows
        return self.apply_transform(grid, SudokuTransform(tuple(d + 1 for d in digits), rows, cols, transform.transpose))

    def augment(self, grid: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, SudokuTransform]:
        """A random validity-preserving transform of ``grid``; apply the same transform to its label."""
        transform = self.random_transform(rng)
        return self.apply_transform(grid, transform), transform

    def augment_dataset(self, ds: TokenDataset, copies: int, seed: int) -> TokenDataset:
        """``ds`` followed by ``copies`` augmented copies of every puzzle (HRM's 1k x 1000 recipe).

        Copies are relabelled versions of the same puzzles: isomorphic, not new (only 1 / (copies + 1)
        of the result is independent).  meta["augmented_from"] gives each row's source row.
        """
        rng = np.random.default_rng(seed)
        inputs, labels, source = [ds.inputs], [ds.labels], [np.arange(len(ds))]
        for _ in range(copies):
            ins, labs = np.empty_like(ds.inputs), np.empty_like(ds.labels)
            for i in range(len(ds)):
                t = self.random_transform(rng)
                ins[i] = self.apply_transform(ds.inputs[i], t)
                labs[i] = self.apply_transform(ds.labels[i], t)
            inputs.append(ins)
            labels.append(labs)
            source.append(np.arange(len(ds)))
        meta = dict(ds.meta, augmented_copies=copies, augmented_from=np.concatenate(source).tolist())
        meta.pop("backtracks", None)  # augmentation can change the search order, hence the count
        return TokenDataset(
            np.concatenate(inputs), np.concatenate(labels), np.tile(ds.difficulty, copies + 1), None, meta
        )

    # ---------------------------------------------------------------- validity, difficulty, render
    def check(self, inputs: np.ndarray, prediction: np.ndarray) -> bool:
        """A complete valid grid that keeps every given of ``inputs`` (the labels are not consulted): the one
        row check (``rows_agree``) on this row; False for a row of the wrong length or non-integer tokens."""
        rows = [np.asarray(a).reshape(1, -1) for a in (inputs, prediction)]
        if any(r.shape != (1, self.seq_len) or (r != r.astype(np.int64)).any() for r in rows):
            return False
        return bool(self.rows_agree(rows[0].astype(np.int64), rows[1].astype(np.int64))[0])

    def difficulty(self, inputs: np.ndarray) -> float:
        """Number of blank cells."""
        return float(np.sum(np.asarray(inputs).reshape(-1) == BLANK_TOKEN))

    def difficulties(self, inputs: np.ndarray) -> np.ndarray:
        return (np.asarray(inputs) == BLANK_TOKEN).sum(axis=1).astype(np.float64)

    label_rule = "incomplete, changes a given, or repeats a digit in a row / column / box"

    def rows_agree(self, inputs: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """Each label a complete valid grid keeping every given of its input (the CSV reader's fast check)."""
        return self.fast_rows().check(inputs, labels)

    def fast_rows(self) -> FastRows:
        """The vectorised CSV path and row check of this board (``loopformer.tasks.puzzle_csv``)."""
        return self._fast_rows

    def render(self, inputs: np.ndarray, prediction: np.ndarray | None = None, markup: bool = False) -> str:
        """A boxed grid.  Givens plain, filled-in cells in parentheses ``(5)`` (or cyan with rich markup;
        a filled cell that breaks a row / column / box rule or overwrites a given is red / ``!5!``)."""
        given = np.asarray(inputs).reshape(-1)
        shown = given if prediction is None else np.asarray(prediction).reshape(-1)
        bad = np.zeros(self.seq_len, dtype=bool)
        if prediction is not None:
            bad |= (given >= 2) & (shown != given)
            for unit in self.geometry.units:
                vals = shown[list(unit)]
                for k, cell in enumerate(unit):
                    if vals[k] >= 2 and (vals == vals[k]).sum() > 1 and given[cell] < 2:
                        bad[cell] = True
        box_r, box_c = self.box

        def cell_text(i: int) -> str:
            t = int(shown[i])
            sym = "." if t < 2 or t > self.size + 1 else self.symbols[t - 2]
            if t < 2 or (given[i] >= 2 and not bad[i]):
                return f" [bold]{sym}[/bold] " if markup and t >= 2 else f" {sym} "
            if bad[i]:
                return f"[bold red]!{sym}![/bold red]" if markup else f"!{sym}!"
            return f" [cyan]{sym}[/cyan] " if markup else f"({sym})"

        seg = "-" * (box_c * 4 + 1)
        border = "+" + "+".join([seg] * (self.size // box_c)) + "+"
        lines = [border]
        for r in range(self.size):
            parts = []
            for s in range(self.size // box_c):
                cells = [cell_text(r * self.size + s * box_c + c) for c in range(box_c)]
                parts.append(" " + " ".join(cells) + " ")
            lines.append("|" + "|".join(parts) + "|")
            if (r + 1) % box_r == 0:
                lines.append(border)
        return "\n".join(lines)

    # ---------------------------------------------------------------- files
    @staticmethod
    def infer_options(path: str | Path) -> dict[str, Any]:
        """Constructor options for a CSV file: ``size`` from the first question's length."""
        q = "".join(first_question(path).split())
        side = int(round(len(q) ** 0.5))
        return {"size": side} if side * side == len(q) and side in DEFAULT_BOXES else {}

    def load(self, path: str | Path, progress: Callable[[int], None] | None = None) -> TokenDataset:
        """Read a Sudoku-Extreme CSV (``source,question,answer,rating``); difficulty = rating column.

        Every row is validated: length, characters, contradictory clues, the answer a complete valid grid
        agreeing with the question.  An empty answer is filled in by the solver (the puzzle must then have a
        unique solution); an empty rating becomes the blank count.  Errors name the file and line;
        ``progress(n_bytes)`` is called as blocks are read (``read_puzzle_csv``).
        """
        meta = {"task": self.name, "size": self.size, "box": list(self.box)}
        return read_puzzle_csv(path, self._parse_csv_row, self.seq_len, meta, fast=self.fast_rows(), progress=progress)

    def _parse_csv_row(self, where: str, question: str, answer: str) -> tuple[np.ndarray, np.ndarray, float]:
        q = self.parse_grid(question, f"{where}: question")
        conflict = self.find_conflict(q)
        if conflict:
            raise TaskDataError(f"{where}: contradictory clues: {conflict}")
        answer_text = answer.strip()
        if answer_text:
            a = self.parse_grid(answer_text, f"{where}: answer")
            if not self.check(q, a):
                mism = np.flatnonzero((q >= 2) & (a != q))
                if len(mism):
                    r, c = divmod(int(mism[0]), self.size)
                    why = f"answer changes the given at row {r + 1}, column {c + 1}"
                else:
                    why = self.find_conflict(a) or "answer has blanks"
                raise TaskDataError(f"{where}: answer inconsistent with question: {why}")
        else:
            if self.count_solutions(q, 2) != 1:
                raise TaskDataError(f"{where}: empty answer and the question has no unique solution")
            a, _ = self.solve(q)
        return q, a, self.difficulty(q)

    def save(self, dataset: TokenDataset, path: str | Path) -> None:
        """Write a Sudoku-Extreme CSV; rating = ``dataset.difficulty`` (integers written without '.0')."""
        write_puzzle_csv(dataset, path, self.seq_len, self.format_grid, f"loopformer-sudoku{self.size}")
