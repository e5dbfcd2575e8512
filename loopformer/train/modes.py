"""Training modes: what one optimiser step feeds the model, and what it keeps between steps.

A mode is a ``TrainingMode`` subclass registered under a name (``train.mode``). Each step the
trainer asks ``mode.batch(step)`` for a ``SegmentBatch`` (inputs, labels, puzzle ids, the state to
start from or None for the model's ``init_state``, the loop configuration, extra metrics), runs
the model once on it, takes the loss, steps the optimiser and hands the output back to
``mode.after_step(batch, out, step)``, whose dictionary is logged with the step's metrics. A mode
that carries something between steps returns it from ``state_dict()`` (saved in every checkpoint
and given back to ``load_state_dict`` on resume, so a resumed run replays exactly).

The two built-in modes:

- ``simple`` (Loop, Think & Generalize, arXiv 2604.07822): every step draws a fresh batch and a
  loop count ``R`` from ``loopformer.loop.make_sampler`` seeded by the global step (fixed,
  Poisson(4) clipped to [2, 8], log-normal Poisson) and runs one forward with ``max_steps = R``
  and fixed halting (an ACT model keeps its learned halting with ``R`` as the cap).
  ``train.loop_sampler: none`` runs the training loop as configured instead (its own halting,
  e.g. an Attractor's Anderson solve to tolerance, capped at ``loop_train.max_steps``).
- ``deep_supervision`` (TRM / HRM / FPRM): each step runs ONE segment on a carried batch of slots
  (``loopformer.train.carry``), from the detached carried state; afterwards the state is carried
  and slots that reached ``max_segments``, whose Q-head says halt or whose loop converged are
  replaced before the next segment.

A new mode is a subclass with a ``name`` and ``batch`` (``after_step`` / ``state_dict`` /
``load_state_dict`` / ``probe_batch`` when it needs them) decorated with
``@register_training_mode``; ``train.mode=<name>`` then selects it. It reads what it needs from
the trainer it is built with: ``trainer.config``, ``trainer.loop_train``, ``trainer.sampler``,
``trainer.next_batch()`` (this rank's share of the next global batch), ``trainer.fresh_states``,
``trainer.train_data``, ``trainer.stream``, ``trainer.strategy`` (rank, world size), ``trainer.device``.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from loopformer.config import ConfigError
from loopformer.loop import LoopConfig
from loopformer.loop.halting import HALTINGS, FixedHalting
from loopformer.loop.solvers import SOLVERS, Solver
from loopformer.models.base import ModelOutput
from loopformer.train.carry import (
    Carry,
    CarryFeed,
    advance_carry,
    carry_from_checkpoint,
    carry_solver_state,
    global_carry_state,
    refill_carry,
)
from loopformer.train.data import Batch

if TYPE_CHECKING:
    from loopformer.train.trainer import Trainer


@dataclass
class SegmentBatch:
    """What one optimiser step runs the model on."""

    inputs: Tensor  # [B, T] this rank's rows
    labels: Tensor  # [B, T]
    puzzle_ids: Tensor | None  # [B]
    state: Tensor | None  # the state to start the loop from; None: the model's init_state
    loop: LoopConfig
    metrics: dict[str, Any] = field(default_factory=dict)  # logged with the step's metrics
    solver_state: dict[str, Tensor] | None = None  # per-sample solver state to resume (FPRM's carry)


class TrainingMode:
    """Base class of the training modes (see the module docstring)."""

    name: ClassVar[str] = ""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.carry: Carry | None = None  # the deep-supervision slots (None for a mode without a carry)

    def batch(self, step: int) -> SegmentBatch:
        """The batch, starting state and loop configuration of optimiser step ``step``."""
        raise NotImplementedError(f"training mode {self.name!r} does not define batch()")

    def after_step(self, batch: SegmentBatch, out: ModelOutput, step: int) -> dict[str, Any]:
        """Called after the optimiser step with the model's output; returns extra metrics."""
        return {}

    def probe_batch(self, rows: Batch) -> SegmentBatch:
        """A batch like the first step's on ``rows`` (the unused-parameter probe under DDP / FSDP);
        must not advance the data stream or any state."""
        return SegmentBatch(rows.inputs, rows.labels, rows.puzzle_ids, None, self.trainer.loop_train)

    def first_loop(self) -> LoopConfig:
        """The loop configuration of step 0 (the trainer checks it against gradient accumulation)."""
        return self.trainer.loop_train

    def state_dict(self) -> Any:
        """What the mode carries between steps (a checkpoint's ``carry``); None when nothing."""
        return None

    def load_state_dict(self, saved: Any, folder: Path) -> None:
        """Restore ``state_dict()``'s value from the checkpoint ``folder``."""


TRAINING_MODES: dict[str, type[TrainingMode]] = {}


def register_training_mode(cls: type[TrainingMode]) -> type[TrainingMode]:
    """Class decorator: make ``cls`` selectable as ``train.mode=<cls.name>``."""
    if not (isinstance(cls, type) and issubclass(cls, TrainingMode)):
        raise TypeError(f"{cls!r} is not a TrainingMode subclass")
    if not cls.name:
        raise ValueError(f"training mode {cls.__name__} has no name")
    known = TRAINING_MODES.get(cls.name)
    if known is not None and known is not cls:
        raise ValueError(
            f"a training mode named {cls.name!r} is already registered ({known.__module__}.{known.__name__})"
        )
    TRAINING_MODES[cls.name] = cls
    return cls


def make_training_mode(name: str, trainer: Trainer) -> TrainingMode:
    """The registered mode ``name`` for ``trainer``; ConfigError (with the nearest name) when unknown."""
    cls = TRAINING_MODES.get(name)
    if cls is None:
        near = difflib.get_close_matches(name, list(TRAINING_MODES), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ConfigError(
            f"train.mode: unknown training mode {name!r} (known: {', '.join(TRAINING_MODES)}){hint}"
        )
    return cls(trainer)


@register_training_mode
class SimpleMode(TrainingMode):
    """A fresh batch per step; the loop count drawn by the step-seeded sampler."""

    name = "simple"

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer)
        if trainer.config.train.carry_solver_state:
            raise ConfigError(
                "train.carry_solver_state: only train.mode=deep_supervision carries the solver's state "
                "across segments (train.mode is 'simple')"
            )
        self._loops: dict[int, LoopConfig] = {}

    def loop_for(self, step: int) -> tuple[LoopConfig, int | None]:
        """The training loop with ``R`` steps drawn for ``step`` (the same on every rank);
        ``train.loop_sampler: none``: the training loop as configured and ``R`` None."""
        loop_train = self.trainer.loop_train
        if self.trainer.sampler is None:
            return loop_train, None
        R = int(self.trainer.sampler.sample(step))
        rule = HALTINGS.get(loop_train.halting)  # a learned rule (ACT) stays, capped at R
        halting = rule.name if rule.learned else FixedHalting.name
        if R not in self._loops:  # one object per count (a compiled step is traced once per loop count)
            self._loops[R] = dataclasses.replace(
                loop_train, max_steps=R, min_steps=min(loop_train.min_steps, R), halting=halting
            )
        return self._loops[R], R

    def batch(self, step: int) -> SegmentBatch:
        b = self.trainer.next_batch()
        loop, R = self.loop_for(step)
        return SegmentBatch(b.inputs, b.labels, b.puzzle_ids, None, loop, {} if R is None else {"loops": R})

    def probe_batch(self, rows: Batch) -> SegmentBatch:
        return SegmentBatch(rows.inputs, rows.labels, rows.puzzle_ids, None, self.loop_for(0)[0])

    def first_loop(self) -> LoopConfig:
        return self.loop_for(0)[0]


def carried_solver(loop: LoopConfig) -> Solver:
    """The training loop's solver for ``train.carry_solver_state``; ConfigError when it keeps no
    per-sample state to carry (only ``damped`` does: step size, patience, best residual)."""
    solver = SOLVERS.get(loop.solver)(loop)
    if not solver.stats:
        carrying = list(SOLVERS.select(lambda cls: bool(cls.stats)))
        raise ConfigError(
            f"train.carry_solver_state: loop_train.solver {loop.solver!r} keeps no per-sample state "
            f"across segments (solvers that do: {carrying}); set train.carry_solver_state=false"
        )
    return solver


@register_training_mode
class DeepSupervisionMode(TrainingMode):
    """One segment per step on a carried batch of slots; halted slots replaced."""

    name = "deep_supervision"

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer)
        self.feed = CarryFeed(
            dataset=trainer.train_data,
            take=trainer.stream.take,
            fresh_states=lambda inputs, puzzle_ids: trainer.fresh_states(inputs, puzzle_ids, trainer.step),
            global_batch=trainer.config.train.batch_size,
            env=trainer.strategy.env,
            device=trainer.device,
        )
        self.solver: Solver | None = None
        if trainer.config.train.carry_solver_state:  # FPRM: the damped solver's state spans segments
            self.solver = carried_solver(trainer.loop_train)
            self.feed.fresh_solver = lambda n: self.solver.init(torch.zeros(n, 1, device=trainer.device))

    def batch(self, step: int) -> SegmentBatch:
        self.carry = refill_carry(self.carry, self.feed)
        c = self.carry
        solver_state = c.solver or None
        return SegmentBatch(
            c.inputs, c.labels, c.puzzle_ids, c.state, self.trainer.loop_train, solver_state=solver_state
        )

    def after_step(self, batch: SegmentBatch, out: ModelOutput, step: int) -> dict[str, Any]:
        tr = self.trainer
        advance_carry(self.carry, out, tr.config.train, tr.config.seed, step, tr.strategy.env.world_size)
        if self.solver is not None:
            carry_solver_state(self.carry, out, self.solver, tr.config.train.halt_on_converged)
        # device tensors, read when the trainer logs (``halted``: slots halted at this step)
        return {"segments": self.carry.segments.float().mean(), "halted": self.carry.halted.sum()}

    def probe_batch(self, rows: Batch) -> SegmentBatch:
        state = self.trainer.fresh_states(rows.inputs, rows.puzzle_ids, 0)
        return SegmentBatch(rows.inputs, rows.labels, rows.puzzle_ids, state, self.trainer.loop_train)

    def state_dict(self) -> Any:
        return global_carry_state(self.carry, self.trainer.strategy.env.enabled)

    def load_state_dict(self, saved: Any, folder: Path) -> None:
        tr = self.trainer
        self.carry = carry_from_checkpoint(
            saved, tr.config.train.batch_size, folder, tr.strategy.env.enabled, tr.device
        )
