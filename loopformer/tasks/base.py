"""The task interface every task module implements, the token dataset they produce, and the helpers they share
(``splitmix64``: keyed draws; ``sub_seed``: a generated row's seed; ``square_symmetry``: the dihedral transforms).

A task owns its truth: ``check`` decides whether a prediction is valid from the puzzle's
own rules (Sudoku constraints, shortest-path validity, group products, graph lookups),
never by comparing with the stored label.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

IGNORE_INDEX = -100  # label value for positions that carry no loss (torch's cross-entropy default)


class TaskDataError(ValueError):
    """Malformed task data: the message names the file, row or field at fault."""


@dataclass
class TokenDataset:
    """Tokenised examples of one task.

    inputs:     int64 [N, T] model input tokens.
    labels:     int64 [N, T] target tokens, IGNORE_INDEX where no loss is taken.
    difficulty: float64 [N] the task's difficulty measure (blanks, backtracks, hops, path length...).
    puzzle_ids: int64 [N] per-puzzle identifiers (ARC, TRM-style puzzle embeddings) or None.
    meta:       free-form description (task name, generation arguments, source file).

    ``streamed``: False here; True for a set whose rows are read when indexed, never held whole
    (``Task.stream``: the text task's windows). The trainer draws such a set's rows in order.
    """

    streamed: ClassVar[bool] = False

    inputs: np.ndarray
    labels: np.ndarray
    difficulty: np.ndarray
    puzzle_ids: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.inputs = np.asarray(self.inputs, dtype=np.int64)
        self.labels = np.asarray(self.labels, dtype=np.int64)
        self.difficulty = np.asarray(self.difficulty, dtype=np.float64)
        if self.inputs.ndim != 2 or self.inputs.shape != self.labels.shape:
            raise TaskDataError(
                f"inputs {self.inputs.shape} and labels {self.labels.shape} must be equal [N, T] arrays"
            )
        if self.difficulty.shape != (len(self.inputs),):
            raise TaskDataError(f"difficulty has shape {self.difficulty.shape}, expected ({len(self.inputs)},)")
        if self.puzzle_ids is not None:
            self.puzzle_ids = np.asarray(self.puzzle_ids, dtype=np.int64)
            if self.puzzle_ids.shape != (len(self.inputs),):
                raise TaskDataError(f"puzzle_ids has shape {self.puzzle_ids.shape}, expected ({len(self.inputs)},)")

    def __len__(self) -> int:
        return len(self.inputs)

    def subset(self, index: np.ndarray | slice) -> TokenDataset:
        """Rows ``index``; row-aligned meta entries (lists or arrays of length N) are sliced too."""
        n = len(self)
        meta: dict[str, Any] = {}
        for key, value in self.meta.items():
            if isinstance(value, np.ndarray) and value.shape[:1] == (n,):
                meta[key] = value[index]
            elif isinstance(value, list) and len(value) == n:
                meta[key] = np.asarray(value, dtype=object)[index].tolist()
            else:
                meta[key] = value
        return TokenDataset(
            self.inputs[index],
            self.labels[index],
            self.difficulty[index],
            None if self.puzzle_ids is None else self.puzzle_ids[index],
            meta,
        )


class Task(ABC):
    """One task: vocabulary, generation with a difficulty knob, loading, checking, rendering.

    This class declares everything the rest of the library reads from a task (the trainer, the
    analyses, ``loopformer solve`` and ``loopformer data``), each with a default, so nothing
    probes a task with ``getattr`` / ``hasattr``. A subclass sets the attributes that differ and
    overrides the methods it supports:

    - ``name``, ``vocab_size``, ``seq_len`` (input length; 0 when variable) and ``causal`` (True when
      the natural model for the task is causal: text, group word problems, knowledge-graph queries);
    - ``num_puzzle_ids``: rows of a per-puzzle embedding table (ARC), 0 when unused;
    - ``has_validator``: False where ``check`` cannot judge a prediction (language modelling: the
      task is then scored by loss and bits per byte, with ``tokens_per_byte`` tokens per byte);
    - ``size`` / ``grid``: a square board's side (Sudoku, mazes) or an explicit (rows, cols) layout of
      the input tokens; ``grid_shape()`` is what the models' 2-D position encodings use;
    - ``generate`` and ``check`` (abstract); ``load`` / ``save`` (the task's file format);
      ``difficulty`` (``difficulties`` for many rows); ``rows_agree`` (a vectorised label check, with
      ``label_rule``); ``render``; ``parse_grid`` / ``format_grid`` (the puzzle as text, used by
      ``loopformer solve``); ``find_conflict`` / ``count_solutions`` / ``shortest_path_length`` (what an
      exact solver says about a puzzle's givens, ``solve``'s check before the model runs); ``bridges`` (a multi-hop query's intermediate answers, used by the
      logit lens); ``infer_options`` (task options read off a data file, used by ``loopformer data``).
    """

    name: str = ""
    vocab_size: int = 0
    seq_len: int = 0
    causal: bool = False
    num_puzzle_ids: int = 0  # size of a per-puzzle embedding table, 0 when unused
    has_validator: bool = True  # False where check() cannot judge a prediction (language modelling)
    tokens_per_byte: float = 1.0  # for bits per byte (1 for byte-level tokens)
    size: int = 0  # side length of a square board (Sudoku, maze); 0 when the task has none
    grid: tuple[int, int] | None = None  # explicit (rows, cols) layout of the input tokens, when not square

    def grid_shape(self) -> tuple[int, int] | None:
        """(rows, cols) of the input tokens: ``grid``, else a ``size`` x ``size`` board that covers
        ``seq_len`` exactly, else None (a sequence task)."""
        if self.grid is not None:
            return (int(self.grid[0]), int(self.grid[1]))
        if self.size and self.seq_len == self.size * self.size:
            return (self.size, self.size)
        return None

    @abstractmethod
    def generate(self, n: int, seed: int, **difficulty: Any) -> TokenDataset:
        """Generate ``n`` examples deterministically from ``seed``."""

    streams: ClassVar[bool] = False  # True: the training set comes from ``stream``, not ``generate``

    def stream(self, n: int, seed: int, **options: Any) -> TokenDataset:
        """A training set of ``n`` rows read when a batch indexes them (``TokenDataset.streamed``), for a
        task with ``streams``; ``options`` as ``generate``'s."""
        raise NotImplementedError(f"task {self.name!r} does not stream its training set")

    @classmethod
    def resident_bytes(cls, options: dict[str, Any]) -> int:
        """Host memory a streamed training set of this task built with ``options`` holds (the memory
        check's term for it); 0 when nothing is held."""
        return 0

    def load(self, path: str | Path) -> TokenDataset:
        """Load the task's standard on-disk format."""
        raise NotImplementedError(f"task {self.name!r} has no file format")

    def save(self, dataset: TokenDataset, path: str | Path) -> None:
        """Write ``dataset`` in the task's standard on-disk format (the inverse of ``load``)."""
        raise NotImplementedError(f"task {self.name!r} has no file format")

    @abstractmethod
    def check(self, inputs: np.ndarray, prediction: np.ndarray) -> bool:
        """Independent validity of one prediction (token arrays [T]); never compares with labels."""

    def difficulty(self, inputs: np.ndarray) -> float:
        """Difficulty of one example from its input tokens."""
        raise NotImplementedError

    def difficulties(self, inputs: np.ndarray) -> np.ndarray:
        """float64 [N]: ``difficulty`` of every row of ``inputs`` [N, T] (a task may vectorise it)."""
        return np.asarray([self.difficulty(row) for row in inputs], dtype=np.float64)

    label_rule: str = ""  # what ``rows_agree`` checks, for a loader's error; empty: the task has no such check

    def rows_agree(self, inputs: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """bool [N]: whether each label agrees with its input by the task's rules (``label_rule``), vectorised
        over int64 [N, T] rows for the loaders of large files (the HRM / TRM folders)."""
        raise NotImplementedError(f"task {self.name!r} has no vectorised label check")

    def render(self, inputs: np.ndarray, prediction: np.ndarray | None = None) -> str:
        """A human-readable rendering for the terminal."""
        return " ".join(str(int(t)) for t in (inputs if prediction is None else prediction))

    def parse_grid(self, text: str, what: str = "puzzle") -> np.ndarray:
        """Input tokens [T] of one puzzle given as text (``what`` names it in errors). The default
        reads whitespace- or comma-separated token ids and checks them against ``vocab_size`` and
        ``seq_len``; a task with a board (Sudoku, maze) reads its own notation."""
        parts = text.replace(",", " ").split()
        try:
            tokens = np.asarray([int(p) for p in parts], dtype=np.int64)
        except ValueError:
            raise TaskDataError(
                f"task {self.name!r} reads a {what} as whitespace-separated token ids, got {text!r}"
            ) from None
        if tokens.size == 0:
            raise TaskDataError(f"the {what} is empty")
        if self.vocab_size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise TaskDataError(f"{what} tokens must lie in [0, {self.vocab_size - 1}] for task {self.name!r}")
        if self.seq_len and tokens.size != self.seq_len:
            raise TaskDataError(f"task {self.name!r} expects {self.seq_len} tokens, got {tokens.size}")
        return tokens

    def format_grid(self, tokens: np.ndarray) -> str:
        """A prediction as the task writes it (a board as text); the default: the token ids joined by spaces."""
        return " ".join(str(int(t)) for t in np.asarray(tokens).reshape(-1))

    def find_conflict(self, inputs: np.ndarray) -> str | None:
        """What makes a puzzle's givens contradict each other (Sudoku: a repeated digit), or None."""
        return None

    def count_solutions(self, inputs: np.ndarray, limit: int = 2) -> int | None:
        """Solutions of the puzzle, counted up to ``limit`` by an exact solver; None: the task has none."""
        return None

    def shortest_path_length(self, inputs: np.ndarray) -> int | None:
        """Length of the shortest start-goal path (-1: none); None: the task is not a path task."""
        return None

    def bridges(self, inputs: np.ndarray) -> np.ndarray | None:
        """Per row, the intermediate answer token of a multi-hop query (-1: none); None when the task
        has no such notion (the logit lens then reports no bridge ranks)."""
        return None

    @staticmethod
    def infer_options(path: str | Path) -> dict[str, Any]:
        """Task options that can be read off a data file (e.g. a board size); none by default."""
        return {}


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic; a bijection: distinct inputs give distinct
    outputs), the keyed hash of the tasks' seeded choices (the text task's windows, the KG train / test split)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def sub_seed(seed: int, index: int, attempt: int) -> int:
    """A 64-bit seed for draw ``attempt`` of row ``index`` of a generation seeded by ``seed`` (``SeedSequence``):
    each row of a generated set depends on its own index only, so a pool of workers changes nothing."""
    state = np.random.SeedSequence([seed, index, attempt]).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 32 | int(state[1])


def square_symmetry(grid: np.ndarray, k: int) -> np.ndarray:
    """Symmetry ``k`` (0..7) of the square on the last two axes of ``grid`` (one board or a stack of them): a
    rotation by 90 * (k % 4) degrees counter-clockwise, then, for k >= 4, a mirror left-right; a copy.
    The maze's transforms and the prepared datasets' use this numbering; ARC numbers the same eight by name
    (``loopformer.tasks.arc.DIHEDRAL_NAMES``). ``DIHEDRAL_INVERSE[k]`` undoes ``k``."""
    if not 0 <= k < 8:
        raise TaskDataError(f"dihedral transform index must be 0..7, got {k}")
    g = np.rot90(np.asarray(grid), k % 4, axes=(-2, -1))
    return (g[..., ::-1] if k >= 4 else g).copy()


DIHEDRAL_INVERSE = (0, 3, 2, 1, 4, 5, 6, 7)  # rotations by 90 / 270 degrees undo each other; reflections themselves


def task_model_fields(task: Task) -> dict[str, Any]:
    """Model fields ``task`` fixes before any data is read: ``vocab_size`` (when the task has a fixed
    vocabulary), ``causal``, ``num_puzzle_ids`` (with one prepended puzzle token when non-zero) and
    ``grid``. The trainer adds ``seq_len`` from the training data; ``--print-config`` shows these."""
    out: dict[str, Any] = {}
    if task.vocab_size:
        out["vocab_size"] = int(task.vocab_size)
    out["causal"] = bool(task.causal)
    out["num_puzzle_ids"] = int(task.num_puzzle_ids)
    if out["num_puzzle_ids"]:
        out["puzzle_emb_len"] = 1  # one prepended puzzle token unless the recipe asks for more
    grid = task.grid_shape()
    if grid is not None:
        out["grid"] = grid
    return out
