"""The deep-supervision carry: the slots a ``deep_supervision`` run refines over segments.

TRM / HRM / FPRM training (arXiv 2606.18206; TRM arXiv 2510.04871, HRM arXiv 2506.21734) keeps a carried batch of
``train.batch_size`` slots, each holding an example, its detached state and a segment count.
Each optimiser step runs ONE segment on the carry; afterwards ``advance_carry`` stores
``out.state.detach()`` and decides which slots halt: when their segment count reaches
``max_segments``, or (options) when their Q logit is > 0 (TRM, with exploration: with
probability ``halt_exploration`` a slot must first run a random 2..max_segments segments) or
when their loop converged (FPRM). Before the next segment ``refill_carry`` gives halted slots
new examples and fresh ``init_state`` rows as the references do (TinyRecursiveModels
``models/recursive_reasoning/trm.py``, ``TinyRecursiveReasoningModel_ACTV1.forward``: every step reads a
whole new batch and ``torch.where(halted, new, carried)`` keeps the running slots): the next ``batch_size``
rows of the index stream are drawn every step and a halted slot takes the row at its own position. Every
decision stays on the device and every shape is static: no host read per step, and CUDA graphs apply.

Under torchrun each rank holds its contiguous share of the slots; the checkpoint stores one
global carry (``global_carry_state``) and ``carry_from_checkpoint`` takes this rank's share
back, so a run resumes under any world size that divides the batch.

The halting exploration draws come from ``loopformer.train.seeding`` (a function of seed and step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from loopformer.config import TrainConfig
from loopformer.models.base import ModelOutput
from loopformer.runs.layout import CheckpointError
from loopformer.tasks.base import TokenDataset
from loopformer.train import dist
from loopformer.train.data import make_batch
from loopformer.train.dist import DistEnv
from loopformer.train.seeding import SALT_EXPLORE, seed_for

if TYPE_CHECKING:
    from loopformer.loop.solvers import Solver


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


@dataclass
class CarryFeed:
    """Where a carry's new examples come from: ``take(n)`` draws ``n`` rows of the global index
    stream of ``dataset``; ``fresh_states(inputs, puzzle_ids)`` returns detached initial states;
    ``global_batch`` slots in all, this rank's share of them on ``device``."""

    dataset: TokenDataset
    take: Callable[[int], np.ndarray]
    fresh_states: Callable[[Tensor, Tensor | None], Tensor]
    global_batch: int
    env: DistEnv
    device: torch.device
    fresh_solver: Callable[[int], dict[str, Tensor]] | None = None  # n slots' fresh solver state


def _rows(mask: Tensor, like: Tensor) -> Tensor:
    return mask.view(-1, *([1] * (like.dim() - 1)))


def refill_carry(carry: Carry | None, feed: CarryFeed) -> Carry:
    """Give halted (or all, when ``carry`` is None) slots new examples and fresh states.

    Every call draws this rank's share of the next global batch from the stream, as the references read a
    new batch every step; a halted slot takes the new row at its position (``torch.where``: no host read,
    static shapes). An existing carry is updated in place and returned.
    """
    batch = make_batch(feed.dataset, dist.shard(feed.take(feed.global_batch)), feed.device)
    fresh = feed.fresh_states(batch.inputs, batch.puzzle_ids)
    index = batch.index.to(feed.device, non_blocking=True)
    if carry is None:
        B = batch.inputs.shape[0]  # this rank's slots
        return Carry(
            index=index,
            inputs=batch.inputs,
            labels=batch.labels,
            puzzle_ids=batch.puzzle_ids,
            state=fresh,
            segments=torch.zeros(B, dtype=torch.long, device=feed.device),
            halted=torch.zeros(B, dtype=torch.bool, device=feed.device),
        )
    c, h = carry, carry.halted
    c.index = torch.where(h, index, c.index)
    c.inputs = torch.where(_rows(h, c.inputs), batch.inputs, c.inputs)
    c.labels = torch.where(_rows(h, c.labels), batch.labels, c.labels)
    if c.puzzle_ids is not None and batch.puzzle_ids is not None:
        c.puzzle_ids = torch.where(h, batch.puzzle_ids, c.puzzle_ids)
    c.state = torch.where(_rows(h, c.state), fresh.to(c.state.dtype), c.state)
    if c.solver and feed.fresh_solver is not None:  # a new example starts the solver afresh
        new = feed.fresh_solver(h.shape[0])
        c.solver = {k: torch.where(_rows(h, v), new[k].to(v), v) for k, v in c.solver.items()}
    c.segments = torch.where(h, 0, c.segments)
    c.halted = torch.zeros_like(h)
    return c


def advance_carry(c: Carry, out: ModelOutput, tc: TrainConfig, seed: int, step: int, world_size: int) -> None:
    """After a segment: carry ``out.state`` (detached), count the segment and mark halted slots
    (``tc.max_segments``, ``tc.halt_on_q`` with ``tc.halt_exploration``, ``tc.halt_on_converged``)."""
    c.state = out.state.detach()
    c.segments = c.segments + 1
    halted = c.segments >= tc.max_segments
    if tc.halt_on_q and out.q_logits is not None:
        q_halt = out.q_logits.detach().float().reshape(-1) > 0
        if tc.halt_exploration > 0:
            # drawn on the CPU for the global batch and sharded: the same draws as one process would make
            g = torch.Generator().manual_seed(seed_for(seed, step, SALT_EXPLORE))
            n_global = len(c.segments) * world_size
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


def carry_solver_state(c: Carry, out: ModelOutput, solver: Solver, halt_on_stall: bool) -> None:
    """After a segment (``train.carry_solver_state``, after ``advance_carry``): keep each slot's
    final solver state (the ``LoopResult.stats`` entries ``solver.stats`` names) for its next
    segment; ``refill_carry`` restarts it for the slots that take a new example. With
    ``halt_on_stall`` (``train.halt_on_converged``) a slot whose step size fell below the solver's
    ``min_step`` halts too (FPRM's ``halting_mechanism: fixed_point``: residual < ``fp_thresh`` or
    ``stepsize < 1e-3``, nilskiKonjIzDunava/fprm ``models/fixed_point_reasoning/fprm.py``)."""
    if out.loop is None:
        raise ValueError("train.carry_solver_state: the model returned no loop result to carry")
    missing = [k for k in solver.stats if k not in out.loop.stats]
    if missing:
        raise ValueError(f"train.carry_solver_state: the loop reported no solver state {missing}")
    c.solver = {k: out.loop.stats[k].detach() for k in solver.stats}
    min_step = getattr(solver.opts, "min_step", None)
    if halt_on_stall and min_step is not None and "eta" in c.solver:
        c.halted = c.halted | (c.solver["eta"] < min_step)


def global_carry_state(carry: Carry | None, distributed: bool) -> dict[str, Any] | None:
    """The carry of all ranks as one (rank order = slot order of a single-process run)."""
    if carry is None:
        return None
    state = carry.state_dict()
    if not distributed:
        return state
    return {k: dist.all_gather_rows(v) for k, v in state.items()}


def carry_from_checkpoint(
    saved: dict[str, Any] | None, global_batch: int, folder: Path, distributed: bool, device: torch.device
) -> Carry | None:
    """This rank's carry from the global one a checkpoint holds (None when it holds none)."""
    if saved and len(saved["index"]) != global_batch:
        raise CheckpointError(
            f"{folder} carries {len(saved['index'])} deep-supervision slots but train.batch_size is "
            f"{global_batch}; resume with the batch size the run was started with"
        )
    if saved and distributed:  # the saved carry is global: take this rank's slots
        saved = {k: None if v is None else dist.shard(v) for k, v in saved.items()}
    return Carry.from_state(saved, device) if saved else None
