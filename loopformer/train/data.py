"""Training data and randomness: the per-step seeds, a deterministic index stream and the difficulty curriculum.

Every random draw of a run is a function of (seed, global step[, rank]):

- ``seed_everything``: the global torch / numpy / python generators, once at the start of a run
  (before the model is built, so its initial weights are a function of the seed).
- ``seed_for``: a 32-bit seed for the stream (seed, step, salt[, rank]); the salts keep the
  per-step streams (initial states, halting exploration, Jacobian probes, curriculum samples)
  independent of each other. ``step_generator``: a ``torch.Generator`` on a device seeded by it.

Because nothing draws from a generator that outlives a step (the loop-count samplers in
``loopformer.loop.samplers`` are also seeded by the step), a resumed run replays exactly; the
global generators' states are saved in each checkpoint for whatever else draws from them.

- ``IndexStream``: an endless stream of example indices. Epoch ``e`` is a permutation of the
  eligible examples drawn from ``numpy.random.default_rng([seed, e])``, so the order is a pure
  function of (seed, epoch, position) and a resumed run replays it exactly from the two
  integers in ``state_dict()``. When the eligible set changes (the curriculum advanced), a new
  epoch starts.
- ``WindowStream``: the stream of a streamed training set (``TokenDataset.streamed``: the text task's
  windows, ``loopformer.tasks.text``): window numbers 0, 1, 2, ... in order, which the set maps to its
  windows; one integer (how many were drawn) resumes it exactly.
- ``Curriculum``: Loop, Think & Generalize's schedule (arXiv 2604.07822): train on examples
  whose difficulty <= level; start at ``start``; advance by ``step`` when the exact-match
  accuracy on the current level reaches ``threshold`` (0.95); stop at ``max_level``
  (``make_curriculum``: the one ``data.curriculum`` asks for).
- ``Batch`` / ``make_batch``: tensors of a set of rows of a ``TokenDataset`` on a device.

A run's train / eval sets themselves come from ``loopformer.runs.load_split``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from loopformer.config import ConfigError, CurriculumConfig
from loopformer.tasks.base import TokenDataset

# salts that keep the per-step random streams independent
SALT_INIT, SALT_EXPLORE, SALT_JAC, SALT_CURRICULUM = 11, 13, 17, 19


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy's global generator and python's ``random``."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def seed_for(seed: int, step: int, salt: int, rank: int | None = None) -> int:
    """A 32-bit seed for the random stream (seed, step, salt[, rank])."""
    entropy = [seed, step, salt] if rank is None else [seed, step, salt, rank]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def step_generator(
    device: torch.device, seed: int, step: int, salt: int, rank: int | None = None
) -> torch.Generator:
    """A generator on ``device`` for the stream (seed, step, salt[, rank])."""
    return torch.Generator(device=device).manual_seed(seed_for(seed, step, salt, rank))


@dataclass
class Batch:
    inputs: Tensor  # [B, T] int64
    labels: Tensor  # [B, T] int64, IGNORE_INDEX where no loss
    puzzle_ids: Tensor | None  # [B] int64
    index: Tensor  # [B] dataset row of each example (int64, CPU)


def to_device(rows: np.ndarray, device: torch.device | str) -> Tensor:
    """``rows`` as a tensor on ``device``; to a GPU through pinned memory without waiting (a copy from
    pageable memory would wait for the device's queue: a host sync per batch)."""
    t = torch.from_numpy(np.ascontiguousarray(rows))
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def make_batch(dataset: TokenDataset, index: np.ndarray, device: torch.device | str = "cpu") -> Batch:
    """Rows ``index`` of ``dataset`` as tensors on ``device`` (``to_device``)."""
    index = np.asarray(index, dtype=np.int64)
    puzzle_ids = None
    if dataset.puzzle_ids is not None:
        puzzle_ids = to_device(dataset.puzzle_ids[index], device)
    return Batch(
        inputs=to_device(dataset.inputs[index], device),
        labels=to_device(dataset.labels[index], device),
        puzzle_ids=puzzle_ids,
        index=torch.from_numpy(index),
    )


class IndexStream:
    """Endless, resumable stream of row indices over the eligible subset of a dataset."""

    def __init__(self, n: int, seed: int, eligible: np.ndarray | None = None) -> None:
        if n < 1:
            raise ValueError("cannot draw batches from an empty dataset")
        self.n = n
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._eligible = self._check(eligible)
        self._order: np.ndarray | None = None

    def _check(self, eligible: np.ndarray | None) -> np.ndarray:
        if eligible is None:
            return np.arange(self.n, dtype=np.int64)
        eligible = np.asarray(eligible, dtype=np.int64)
        if eligible.size == 0:
            raise ValueError("no training example is eligible (curriculum level below every difficulty?)")
        return eligible

    def _permutation(self) -> np.ndarray:
        if self._order is None:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._order = self._eligible[rng.permutation(len(self._eligible))]
        return self._order

    def set_eligible(self, eligible: np.ndarray | None) -> None:
        """Restrict to new rows; starts the next epoch (unless nothing was drawn from this one)."""
        self._eligible = self._check(eligible)
        if self.position > 0:
            self.epoch += 1
            self.position = 0
        self._order = None

    def take(self, k: int) -> np.ndarray:
        """The next ``k`` indices (wrapping into new epochs)."""
        out = []
        while k > 0:
            order = self._permutation()
            chunk = order[self.position : self.position + k]
            out.append(chunk)
            k -= len(chunk)
            self.position += len(chunk)
            if self.position >= len(order):
                self.epoch += 1
                self.position = 0
                self._order = None
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed, self.epoch, self.position = int(state["seed"]), int(state["epoch"]), int(state["position"])
        self._order = None


class WindowStream:
    """The rows of a streamed training set in order: ``take(k)`` returns the next ``k`` window numbers (they
    run past the set's ``n`` rows into its next pass; the set maps any number to a window). Same interface
    as ``IndexStream``; its state is the count drawn, kept as (epoch, position) of ``n``-row epochs."""

    def __init__(self, n: int, seed: int) -> None:
        if n < 1:
            raise ValueError("cannot draw batches from an empty dataset")
        self.n, self.seed, self.drawn = n, seed, 0

    @property
    def epoch(self) -> int:
        return self.drawn // self.n

    @property
    def position(self) -> int:
        return self.drawn % self.n

    def set_eligible(self, eligible: np.ndarray | None) -> None:
        if eligible is not None:
            raise ValueError("a streamed training set has no curriculum (its rows are read, not held)")

    def take(self, k: int) -> np.ndarray:
        out = np.arange(self.drawn, self.drawn + k, dtype=np.int64)
        self.drawn += k
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self.drawn = int(state["epoch"]) * self.n + int(state["position"])


def make_stream(
    dataset: TokenDataset, seed: int, curriculum: Curriculum | None
) -> IndexStream | WindowStream:
    """The training stream of ``dataset``: in order for a streamed set, else seeded epochs over the rows the
    curriculum (if any) makes eligible."""
    if dataset.streamed:
        return WindowStream(len(dataset), seed)
    return IndexStream(len(dataset), seed, curriculum.eligible() if curriculum is not None else None)


class Curriculum:
    """Difficulty levels: train on difficulty <= level, advance when the current level is solved."""

    def __init__(
        self,
        difficulty: np.ndarray,
        start: float = 2.0,
        step: float = 1.0,
        max_level: float | None = None,
        threshold: float = 0.95,
        restart_schedule: bool = False,
    ) -> None:
        if step <= 0:
            raise ValueError(f"curriculum step must be > 0, got {step}")
        self.difficulty = np.asarray(difficulty, dtype=np.float64)
        self.start = float(start)
        self.step = float(step)
        self.max_level = float(max_level) if max_level is not None else float(self.difficulty.max())
        self.threshold = float(threshold)
        self.level = min(self.start, self.max_level)
        self.history: list[dict[str, float]] = []
        self.restart_schedule = bool(restart_schedule)
        self.stage_start = 0  # the global step the current level began at
        if not (self.difficulty <= self.level).any():
            raise ValueError(
                f"curriculum start level {self.level} is below every training difficulty "
                f"(min {self.difficulty.min()})"
            )

    @property
    def done(self) -> bool:
        return self.level >= self.max_level

    def eligible(self) -> np.ndarray:
        """Training rows with difficulty <= level."""
        return np.flatnonzero(self.difficulty <= self.level)

    def current_rows(self, difficulty: np.ndarray) -> np.ndarray:
        """Rows of ``difficulty`` at the current level: in (level - step, level]."""
        d = np.asarray(difficulty, dtype=np.float64)
        return np.flatnonzero((d > self.level - self.step) & (d <= self.level))

    def update(self, accuracy: float, global_step: int) -> bool:
        """Record ``accuracy`` on the current level (measured after ``global_step`` optimiser steps);
        advance one level when it passes the threshold (the new level starts at ``global_step``)."""
        self.history.append({"step": float(global_step), "level": self.level, "accuracy": float(accuracy)})
        if accuracy >= self.threshold and not self.done:
            self.level = min(self.level + self.step, self.max_level)
            self.stage_start = int(global_step)
            return True
        return False

    def schedule_step(self, global_step: int) -> int:
        """The step the learning-rate schedule is at for optimiser step ``global_step``: the steps
        since the current level began with ``restart_schedule``, else ``global_step``."""
        return global_step - self.stage_start if self.restart_schedule else global_step

    def state_dict(self) -> dict[str, Any]:
        return {"level": self.level, "history": list(self.history), "stage_start": self.stage_start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.level = float(state["level"])
        self.history = [dict(h) for h in state.get("history", [])]
        self.stage_start = int(state.get("stage_start", 0))  # absent in checkpoints from before the option


def make_curriculum(cc: CurriculumConfig, train_data: TokenDataset) -> Curriculum | None:
    """The difficulty curriculum over the training set's difficulty (None when ``enabled`` is off)."""
    if not cc.enabled:
        return None
    if train_data.streamed:
        raise ConfigError(
            "data.curriculum: the training set is streamed (read a batch at a time), so there are no rows "
            "to order by difficulty; turn the curriculum off"
        )
    return Curriculum(
        train_data.difficulty, cc.start, cc.step, cc.max_level, cc.threshold, cc.restart_optimizer
    )
