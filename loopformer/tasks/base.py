"""The task interface every task module implements, and the token dataset they produce.

A task owns its truth: ``check`` decides whether a prediction is valid from the puzzle's
own rules (Sudoku constraints, shortest-path validity, group products, graph lookups),
never by comparing with the stored label.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    """

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

    Subclasses set ``name``, ``vocab_size``, ``seq_len`` (input length; 0 when variable) and
    ``causal`` (True when the natural model for the task is causal: text, group word problems,
    knowledge-graph queries).
    """

    name: str = ""
    vocab_size: int = 0
    seq_len: int = 0
    causal: bool = False
    num_puzzle_ids: int = 0  # size of a per-puzzle embedding table, 0 when unused
    has_validator: bool = True  # False where check() cannot judge a prediction (language modelling)

    @abstractmethod
    def generate(self, n: int, seed: int, **difficulty: Any) -> TokenDataset:
        """Generate ``n`` examples deterministically from ``seed``."""

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

    def render(self, inputs: np.ndarray, prediction: np.ndarray | None = None) -> str:
        """A human-readable rendering for the terminal."""
        return " ".join(str(int(t)) for t in (inputs if prediction is None else prediction))
