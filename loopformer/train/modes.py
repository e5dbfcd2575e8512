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
  (``Carry``, below), from the detached carried state; afterwards the state is carried
  and slots that reached ``max_segments``, whose Q-head says halt or whose loop converged are
  replaced before the next segment.

A new mode is a subclass with a ``name`` and ``batch`` (``after_step`` / ``state_dict`` /
``load_state_dict`` / ``probe_batch`` when it needs them) decorated with
``@register_training_mode``; ``train.mode=<name>`` then selects it. It reads what it needs from
the trainer it is built with: ``trainer.config``, ``trainer.loop_train``, ``trainer.sampler``,
``trainer.next_batch()`` (this rank's share of the next global batch), ``trainer.fresh_states``,
``trainer.train_data``, ``trainer.stream``, ``trainer.strategy`` (rank, world size), ``trainer.device``.

The deep-supervision carry: the slots a ``deep_supervision`` run refines over segments.

TRM / HRM / FPRM training (arXiv 2606.18206; TRM arXiv 2510.04871, HRM arXiv 2506.21734) keeps a carried batch of
``train.batch_size`` slots, each holding an example, its detached state and a segment count.
Each optimiser step runs ONE segment on the carry; afterwards ``DeepSupervisionMode.after_step`` stores
``out.state.detach()`` and decides which slots halt: when their segment count reaches
``max_segments``, or (options) when their Q logit is > 0 (TRM, with exploration: with
probability ``halt_exploration`` a slot must first run a random 2..max_segments segments) or
when their loop converged (FPRM). Before the next segment ``DeepSupervisionMode.batch`` gives halted slots
new examples and fresh ``init_state`` rows as the references do (TinyRecursiveModels
``models/recursive_reasoning/trm.py``, ``TinyRecursiveReasoningModel_ACTV1.forward``: every step reads a
whole new batch and ``torch.where(halted, new, carried)`` keeps the running slots): the next ``batch_size``
rows of the index stream are drawn every step and a halted slot takes the row at its own position. Every
decision stays on the device and every shape is static: no host read per step, and CUDA graphs apply.

Under torchrun each rank holds its contiguous share of the slots; the checkpoint stores one
global carry (``state_dict``, gathered over ranks) and ``load_state_dict`` takes this rank's share
back, so a run resumes under any world size that divides the batch.

The halting exploration draws come from ``loopformer.train.data.seed_for`` (a function of seed and step).
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
from loopformer.runs.checkpoint import CheckpointError
from loopformer.train import dist
from loopformer.train.data import SALT_EXPLORE, Batch, seed_for

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

    def rows(self, sl: slice, state: Tensor | None, first: bool) -> SegmentBatch:
        """The rows ``sl`` of this batch, starting from ``state`` (its rows already cut): one micro-batch of
        gradient accumulation; ``first``: the micro-batch that logs the batch's metrics."""

        def cut(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[sl]

        solver = {k: v[sl] for k, v in self.solver_state.items()} if self.solver_state else None
        metrics = self.metrics if first else {}
        return SegmentBatch(
            self.inputs[sl], self.labels[sl], cut(self.puzzle_ids), cut(state), self.loop, metrics, solver
        )


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


@dataclass
class Carry:
    """Deep-supervision slots: each row an example being refined over segments (all on the device)."""

    index: Tensor  # [B] dataset rows (int64)
    inputs: Tensor  # [B, T]
    labels: Tensor  # [B, T]
    puzzle_ids: Tensor | None  # [B]
    state: Tensor  # [B, ...] detached carried state
    segments: Tensor  # [B] segments run so far (int64)
    halted: Tensor  # [B] bool: replace before the next segment
    # [B] per-sample solver state (train.carry_solver_state; damped: eta, best, patience); empty: none
    solver: dict[str, Tensor] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        out = {
            k: getattr(self, k)
            for k in ("index", "inputs", "labels", "puzzle_ids", "state", "segments", "halted")
        }
        return {**out, **{f"solver.{k}": v for k, v in self.solver.items()}}

    @classmethod
    def from_state(cls, state: dict[str, Any], device: torch.device) -> Carry:
        def dev(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device)

        return cls(
            index=state["index"].long().to(device),
            inputs=dev(state["inputs"]),
            labels=dev(state["labels"]),
            puzzle_ids=dev(state["puzzle_ids"]),
            state=dev(state["state"]),
            segments=state["segments"].long().to(device),
            halted=state["halted"].bool().to(device),
            solver={k[len("solver.") :]: v.to(device) for k, v in state.items() if k.startswith("solver.")},
        )


def _rows(mask: Tensor, like: Tensor) -> Tensor:
    return mask.view(-1, *([1] * (like.dim() - 1)))


@register_training_mode
class DeepSupervisionMode(TrainingMode):
    """One segment per step on a carried batch of slots (``Carry``); halted slots replaced."""

    name = "deep_supervision"

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer)
        self.solver: Solver | None = None
        if trainer.config.train.carry_solver_state:  # FPRM: the damped solver's state spans segments
            self.solver = carried_solver(trainer.loop_train)

    def batch(self, step: int) -> SegmentBatch:
        self.carry = self.refill(self.carry)
        c = self.carry
        solver_state = c.solver or None
        return SegmentBatch(
            c.inputs, c.labels, c.puzzle_ids, c.state, self.trainer.loop_train, solver_state=solver_state
        )

    def refill(self, carry: Carry | None) -> Carry:
        """Give halted (or all, when ``carry`` is None) slots new examples and fresh states.

        Every call draws this rank's share of the next global batch from the stream, as the references read a
        new batch every step; a halted slot takes the new row at its position (``torch.where``: no host read,
        static shapes). An existing carry is updated in place and returned.
        """
        tr = self.trainer
        batch = tr.next_batch()
        fresh = tr.fresh_states(batch.inputs, batch.puzzle_ids, tr.step)
        index = batch.index.to(tr.device, non_blocking=True)
        if carry is None:
            B = batch.inputs.shape[0]  # this rank's slots
            return Carry(
                index=index,
                inputs=batch.inputs,
                labels=batch.labels,
                puzzle_ids=batch.puzzle_ids,
                state=fresh,
                segments=torch.zeros(B, dtype=torch.long, device=tr.device),
                halted=torch.zeros(B, dtype=torch.bool, device=tr.device),
            )
        c, h = carry, carry.halted
        c.index = torch.where(h, index, c.index)
        c.inputs = torch.where(_rows(h, c.inputs), batch.inputs, c.inputs)
        c.labels = torch.where(_rows(h, c.labels), batch.labels, c.labels)
        if c.puzzle_ids is not None and batch.puzzle_ids is not None:
            c.puzzle_ids = torch.where(h, batch.puzzle_ids, c.puzzle_ids)
        c.state = torch.where(_rows(h, c.state), fresh.to(c.state.dtype), c.state)
        if c.solver and self.solver is not None:  # a new example starts the solver afresh
            new = self.solver.init(torch.zeros(h.shape[0], 1, device=tr.device))
            c.solver = {k: torch.where(_rows(h, v), new[k].to(v), v) for k, v in c.solver.items()}
        c.segments = torch.where(h, 0, c.segments)
        c.halted = torch.zeros_like(h)
        return c

    def after_step(self, batch: SegmentBatch, out: ModelOutput, step: int) -> dict[str, Any]:
        """Carry ``out.state`` (detached), count the segment and mark halted slots (``train.max_segments``,
        ``train.halt_on_q`` with ``train.halt_exploration``, ``train.halt_on_converged``); with
        ``train.carry_solver_state`` keep each slot's solver state (``carry_solver``)."""
        tc, c = self.trainer.config.train, self.carry
        c.state = out.state.detach()
        c.segments = c.segments + 1
        halted = c.segments >= tc.max_segments
        if tc.halt_on_q and out.q_logits is not None:
            q_halt = out.q_logits.detach().float().reshape(-1) > 0
            if tc.halt_exploration > 0:
                # drawn on the CPU for the global batch and sharded: the same draws as one process would make
                g = torch.Generator().manual_seed(seed_for(self.trainer.config.seed, step, SALT_EXPLORE))
                n_global = len(c.segments) * self.trainer.strategy.env.world_size
                explore = dist.shard(torch.rand(n_global, generator=g, device="cpu") < tc.halt_exploration)
                min_segments = dist.shard(
                    torch.randint(2, tc.max_segments + 1, (n_global,), generator=g, device="cpu")
                )
                floor = torch.where(explore, min_segments, torch.zeros_like(min_segments))
                q_halt = q_halt & (c.segments >= floor.to(c.segments.device, non_blocking=True))
            halted = halted | q_halt
        if tc.halt_on_converged and out.loop is not None:
            halted = halted | out.loop.converged.detach().reshape(-1)
        c.halted = halted
        if self.solver is not None:
            self.carry_solver(out, tc.halt_on_converged)
        # device tensors, read when the trainer logs (``halted``: slots halted at this step)
        return {"segments": c.segments.float().mean(), "halted": c.halted.sum()}

    def carry_solver(self, out: ModelOutput, halt_on_stall: bool) -> None:
        """After a segment (``train.carry_solver_state``): keep each slot's final solver state (the
        ``LoopResult.stats`` entries ``solver.stats`` names) for its next segment; ``refill`` restarts it for
        the slots that take a new example. With ``halt_on_stall`` (``train.halt_on_converged``) a slot whose
        step size fell below the solver's ``min_step`` halts too (FPRM's ``halting_mechanism: fixed_point``:
        residual < ``fp_thresh`` or ``stepsize < 1e-3``, nilskiKonjIzDunava/fprm
        ``models/fixed_point_reasoning/fprm.py``)."""
        c, solver = self.carry, self.solver
        if out.loop is None:
            raise ValueError("train.carry_solver_state: the model returned no loop result to carry")
        missing = [k for k in solver.stats if k not in out.loop.stats]
        if missing:
            raise ValueError(f"train.carry_solver_state: the loop reported no solver state {missing}")
        c.solver = {k: out.loop.stats[k].detach() for k in solver.stats}
        min_step = getattr(solver.opts, "min_step", None)
        if halt_on_stall and min_step is not None and "eta" in c.solver:
            c.halted = c.halted | (c.solver["eta"] < min_step)

    def probe_batch(self, rows: Batch) -> SegmentBatch:
        state = self.trainer.fresh_states(rows.inputs, rows.puzzle_ids, 0)
        return SegmentBatch(rows.inputs, rows.labels, rows.puzzle_ids, state, self.trainer.loop_train)

    def state_dict(self) -> Any:
        """The carry of all ranks as one (rank order = slot order of a single-process run)."""
        if self.carry is None:
            return None
        state = self.carry.state_dict()
        if not self.trainer.strategy.env.enabled:
            return state
        return {k: dist.all_gather_rows(v) for k, v in state.items()}

    def load_state_dict(self, saved: Any, folder: Path) -> None:
        """This rank's carry from the global one a checkpoint holds (None when it holds none)."""
        tr = self.trainer
        global_batch = tr.config.train.batch_size
        if saved and len(saved["index"]) != global_batch:
            raise CheckpointError(
                f"{folder} carries {len(saved['index'])} deep-supervision slots but train.batch_size is "
                f"{global_batch}; resume with the batch size the run was started with"
            )
        if saved and tr.strategy.env.enabled:  # the saved carry is global: take this rank's slots
            saved = {k: None if v is None else dist.shard(v) for k, v in saved.items()}
        self.carry = Carry.from_state(saved, tr.device) if saved else None
