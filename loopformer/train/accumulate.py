"""Gradient accumulation: one optimiser step's batch run as ``k`` micro-batches.

``train.grad_accum_steps = k`` (or ``train.micro_batch_size = m``, i.e. ``k = batch_size / ranks / m``)
splits each rank's share of the step's batch -- whatever the training mode handed the trainer
(``SegmentBatch``: a fresh batch, or the deep-supervision carry after its refill) -- into ``k``
contiguous micro-batches of equal size. Each micro-batch runs forward, its loss is weighted by
``1 / k`` and backpropagated at once (so only one micro-batch's activations are alive at a time);
then the trainer clips, checks and steps the optimiser once. Under DDP the first ``k - 1``
backwards run inside ``no_sync()`` and under FSDP2 with ``set_requires_gradient_sync(False)``
(``Strategy.no_sync``): the gradients are all-reduced / reduce-scattered once, on the last.

Why the accumulated step equals the full-batch step (tests/test_train_accumulate.py checks it in
float64 for every training mode, to 1e-10): every loss term is a mean over the rows of equally
sized micro-batches, so ``sum_i loss_i / k`` is the full-batch loss and its gradient; the loop
engine treats rows independently (per-sample halting, solvers and their state, implicit
gradients); and what the mode keeps between steps is fed from the merged output
(``merge_outputs``: the rows' states, Q logits, loop results and solver state in batch order),
so ``after_step`` advances the carry exactly as for the full batch. Random draws that the full
batch makes with the step's generators are made once for the whole batch and sliced: the initial
states of a mode that starts from ``init_state`` (``initial_states``) and the Hutchinson probes of
``train.jacobian_weight``.

A halting rule that couples the rows of a batch (``Halting.batch_stalls``, i.e. ``batch_residual``: every
sample runs until the *largest* residual of the batch is below tol) is exact too when it couples groups of
rows that no micro-batch splits: ``LoopConfig.halt_group`` = g dividing the micro-batch (the Attractor LM:
its micro-batch of 32, github jacobfa/Attractor ``launch_configs/attractor-small-140m.yaml``); refused
(``AccumulationError``) otherwise, because a micro-batch would stop on its own rows' residuals.
Not exact: random draws a model makes from the global RNG or inside its forward -- dropout masks
and AttractorPuzzle's Jacobian probes -- are drawn per micro-batch: the same distribution, other
draws (documented in docs/architecture.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from loopformer.config import ConfigError, TrainConfig
from loopformer.loop import LoopConfig
from loopformer.loop.engine import LoopResult
from loopformer.loop.halting import HALTINGS
from loopformer.models.base import ModelOutput
from loopformer.nn import autocast
from loopformer.train.losses import Accuracy
from loopformer.train.modes import SegmentBatch
from loopformer.train.seeding import SALT_INIT, SALT_JAC

if TYPE_CHECKING:
    from loopformer.train.trainer import Trainer

log = logging.getLogger("loopformer.train")


class AccumulationError(ConfigError):
    """A run asked for gradient accumulation that cannot equal its full-batch step."""


def micro_steps(tc: TrainConfig, world_size: int = 1) -> int:
    """The number of micro-batches ``k`` each rank runs per optimiser step (``train.grad_accum_steps``,
    or ``batch_size / world_size / train.micro_batch_size``); ConfigError when they do not divide."""
    if tc.batch_size % world_size:
        raise ConfigError(f"train.batch_size={tc.batch_size} cannot be split evenly over {world_size} ranks")
    local, k = tc.batch_size // world_size, tc.grad_accum_steps
    if k < 1 or tc.micro_batch_size < 0:
        raise ConfigError("train.grad_accum_steps must be >= 1 and train.micro_batch_size >= 0")
    if tc.micro_batch_size:
        if local % tc.micro_batch_size:
            raise ConfigError(
                f"train.micro_batch_size={tc.micro_batch_size} does not divide the {local} rows per rank "
                f"(train.batch_size={tc.batch_size} over {world_size} ranks)"
            )
        implied = local // tc.micro_batch_size
        if k not in (1, implied):
            raise ConfigError(
                f"train.grad_accum_steps={k} and train.micro_batch_size={tc.micro_batch_size} disagree: "
                f"{local} rows per rank in micro-batches of {tc.micro_batch_size} is {implied} micro-steps"
            )
        k = implied
    if local % k:
        raise ConfigError(
            f"train.grad_accum_steps={k} does not divide the {local} rows per rank "
            f"(train.batch_size={tc.batch_size} over {world_size} ranks)"
        )
    return k


def check_loop(loop: LoopConfig, k: int, rows: int) -> None:
    """AccumulationError for a halting rule whose decision couples rows that micro-batches of ``rows``
    rows would split (a batch-wide rule without a ``halt_group`` dividing ``rows``)."""
    g = loop.halt_group
    if k > 1 and HALTINGS.get(loop.halting).batch_stalls and not (0 < g and rows % g == 0):
        group = f"groups of loop_train.halt_group={g} rows" if g else "the whole batch"
        raise AccumulationError(
            f"train.grad_accum_steps={k}: the training loop's halting rule {loop.halting!r} is batch-wide "
            f"(every sample runs until the largest residual of {group} is below tol), which micro-batches "
            f"of {rows} rows would split, so the step would differ from the full batch; set "
            f"loop_train.halt_group to a divisor of {rows} (a group per micro-batch or smaller), train with "
            "a per-sample rule (loop_train.halting=residual) or without accumulation"
        )


@dataclass
class StepResult:
    """What the forward / backward passes of one optimiser step give the trainer (all detached)."""

    loss: Tensor
    parts: dict[str, Tensor]
    acc: Accuracy
    out: ModelOutput


def _rows(batch: SegmentBatch, sl: slice, state: Tensor | None, first: bool) -> SegmentBatch:
    def cut(t: Tensor | None) -> Tensor | None:
        return None if t is None else t[sl]

    solver = {k: v[sl] for k, v in batch.solver_state.items()} if batch.solver_state else None
    metrics = batch.metrics if first else {}
    return SegmentBatch(
        batch.inputs[sl], batch.labels[sl], cut(batch.puzzle_ids), cut(state), batch.loop, metrics, solver
    )


def initial_states(trainer: Trainer, batch: SegmentBatch) -> Tensor | None:
    """The whole batch's initial states when the model draws them from the step's generator (None
    when it draws nothing: its ``init_state`` rows are then the same for any split of the batch).

    AccumulationError when the draw also depends on the parameters (it could not be detached). Whether
    the model draws is found once per trainer (a generator-state comparison) and remembered."""
    model, device = trainer.model, trainer.device
    draws = getattr(trainer, "_init_state_draws", None)
    if draws is False:
        return None
    g = trainer.generator(trainer.step, SALT_INIT)
    before = g.get_state()
    with torch.no_grad(), autocast(device, trainer.config.bf16), trainer.strategy.gathered(model):
        z0 = model.init_state(model.embed(batch.inputs, batch.puzzle_ids), g)
    if draws:
        return z0.detach()
    trainer._init_state_draws = not torch.equal(g.get_state(), before)
    if not trainer._init_state_draws:
        return None
    pid = None if batch.puzzle_ids is None else batch.puzzle_ids[:1]
    with autocast(device, trainer.config.bf16), trainer.strategy.gathered(model):
        probe = model.init_state(model.embed(batch.inputs[:1], pid), trainer.generator(0, SALT_INIT))
    if probe.requires_grad:
        raise AccumulationError(
            f"train.grad_accum_steps: {type(model).__name__}.init_state draws random states that also "
            "depend on trainable parameters; they cannot be drawn once for the whole batch and split"
        )
    return z0.detach()


def _cat_trace(rows: list[Tensor]) -> Tensor:
    """[steps_i, b_i] traces side by side, NaN-padded to the longest (NaN: after a sample halted)."""
    n = max(r.shape[0] for r in rows)
    pad = [torch.cat([r, r.new_full((n - r.shape[0], *r.shape[1:]), float("nan"))]) for r in rows]
    return torch.cat(pad, dim=1)


def merge_outputs(outs: list[ModelOutput]) -> ModelOutput:
    """The micro-batches' outputs as one detached output in batch order (no logits: they are not
    kept; the loss and accuracy were taken per micro-batch)."""
    if len(outs) == 1:
        return outs[0]
    loops = [o.loop for o in outs]

    def cat(ts: list[Tensor | None]) -> Tensor | None:
        return None if any(t is None for t in ts) else torch.cat([t.detach() for t in ts])

    state = cat([o.state for o in outs])
    loop = None
    if all(lp is not None for lp in loops):
        n = [lp.steps.shape[0] for lp in loops]
        keys = [k for k, v in loops[0].stats.items() if v.dim() and v.shape[0] == n[0]]
        loop = LoopResult(
            state=state,
            steps=cat([lp.steps for lp in loops]),
            converged=cat([lp.converged for lp in loops]),
            residuals=_cat_trace([lp.residuals.detach() for lp in loops]),
            ponder_cost=cat([lp.ponder_cost for lp in loops]),
            state_norms=None
            if any(lp.state_norms is None for lp in loops)
            else _cat_trace([lp.state_norms.detach() for lp in loops]),
            stats={k: cat([lp.stats[k] for lp in loops]) for k in keys},
        )
    return ModelOutput(logits=None, state=state, loop=loop, q_logits=cat([o.q_logits for o in outs]))  # type: ignore[arg-type]


def _merge_acc(accs: list[Accuracy]) -> Accuracy:
    if len(accs) == 1:
        return accs[0]
    return Accuracy(
        *(torch.cat([getattr(a, f) for a in accs]) for f in ("token_correct", "token_count", "exact"))
    )


def _jacobian_probe(trainer: Trainer, out: ModelOutput, rows: int) -> Tensor:
    """``train.jacobian_weight``'s probe for the whole batch, as ``jacobian_frobenius`` draws it."""
    g = trainer.generator(trainer.step, SALT_JAC)
    return torch.randn((rows, *out.state.shape[1:]), generator=g, device=g.device, dtype=out.state.dtype)


def run_micro_steps(trainer: Trainer, batch: SegmentBatch, k: int) -> StepResult:
    """Forward and backward of ``batch`` as ``k`` micro-batches (the gradients are left in ``.grad``,
    summed; the caller zeroes them before). ``k == 1``: one forward and backward, as without accumulation."""
    tc = trainer.config.train
    B = batch.inputs.shape[0]
    b = B // k
    check_loop(batch.loop, k, B // k)
    state = batch.state if batch.state is not None or k == 1 else initial_states(trainer, batch)
    probe: Tensor | None = None
    losses, parts_sum, accs, outs = [], {}, [], []
    for i in range(k):
        sl = slice(i * b, (i + 1) * b)
        mb = batch if k == 1 else _rows(batch, sl, state, i == 0)
        with trainer.strategy.no_sync(trainer.forward_model, sync=i == k - 1):
            out = trainer._forward(mb)
            if tc.jacobian_weight > 0 and k > 1 and probe is None:
                probe = _jacobian_probe(trainer, out, B)
            loss, parts, acc = trainer.loss(out, mb, None if probe is None else probe[sl])
            if tc.q_learning and trainer.mode.carry is not None:  # HRM: Q-learning over the carried segments
                loss = loss + trainer._q_learning(out, mb, acc.exact, parts, trainer.mode.carry.segments[sl])
            (loss if k == 1 else loss / k).backward()
        losses.append(loss.detach())
        for name, v in parts.items():
            parts_sum[name] = parts_sum.get(name, 0.0) + v.detach() / (1 if k == 1 else k)
        accs.append(acc)
        outs.append(out if k == 1 else _detached(out))
    total = losses[0] if k == 1 else torch.stack(losses).sum() / k
    return StepResult(total, parts_sum, _merge_acc(accs), merge_outputs(outs))


def _detached(out: ModelOutput) -> ModelOutput:
    """What ``merge_outputs`` keeps of a micro-batch's output: its per-sample results, detached (no
    logits, no graph: the micro-batch's activations are freed before the next one runs)."""

    def d(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.detach()

    lp = out.loop
    loop = None
    if lp is not None:
        loop = LoopResult(
            state=lp.state.detach(), steps=lp.steps, converged=lp.converged, residuals=lp.residuals.detach(),
            ponder_cost=d(lp.ponder_cost), state_norms=d(lp.state_norms),
            stats={k: v.detach() for k, v in lp.stats.items()},
        )  # fmt: skip
    return ModelOutput(logits=None, state=out.state.detach(), loop=loop, q_logits=d(out.q_logits))  # type: ignore[arg-type]
