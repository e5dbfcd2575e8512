"""run_loop: the one iteration loop every loopformer model uses (docs/architecture.md).

``run_loop(step, z0, cfg, ctx, readout, halt_fn, callback)`` iterates ``z <- solver(z, step(z, *ctx))``
until each sample's halting rule fires, per sample. The solver, halting rule and gradient mode
are plug-ins looked up by name in their registries (solvers.py, halting.py, grad.py); the engine
reads only what their classes declare, never their names.

- every iteration evaluates ``step`` once on the *active* samples, measures the residual
  (``norms.py``) and the state RMS, forms the next iterate (the solver) and asks the halting rule
  which samples are done; the step cap, a solver's stall (``can_stall``) and divergence
  (non-finite residual or state, residual > diverge_threshold) also stop a sample. A diverged
  sample keeps its last finite iterate and converged=False; ``stop_diverged=False`` turns the
  divergence stop off (the references' training segments have none).
- with ``compaction`` halted samples leave the active batch (``LoopState.compact``), so adaptive
  halting saves real compute; without it finished rows are frozen with ``torch.where``. One driver
  (``_run_per_step``) takes that choice as a parameter; both give the same results.
- per-iteration cost (small maps are dominated by it): residuals and ||state|| are written in
  place into preallocated history rows, one host sync per step (``aminmax`` of the residuals
  against the rule's ``residual_bound``: could any sample stop?) and the exact halting /
  divergence masks only when it could; a rule that never stops early with ``trace=False`` is a
  plain loop (``_run_plain``: no norms, no divergence check, no sync).
- gradients: the mode says from which iteration the forward records a graph, may watch the step
  inputs and replay the last steps of a halting sample (exact truncation), and attaches the
  final state (implicit modes); see grad.py.
- halting decided on the device (``sync_every != 1``, ``_run_deferred``; ``Finished`` / ``split_rows``
  below):
  Asking the host after every iteration whether a sample halted stalls a GPU: the CPU cannot queue the next
  iteration until the answer arrives. On the deferred path the halting rule, the step cap, stalls and divergence
  are evaluated on the device every iteration, exactly as on the per-step path, but their outcome is *recorded*
  instead of acted on: a row that finishes keeps its result (steps, convergence, the value it returns and the
  plug-ins' per-sample stats) in ``Finished``, and its iterate is frozen with ``torch.where`` (a diverged row at
  its last finite iterate), so the rows still running see exactly what they would have seen. The host reads
  once every ``sync_every`` iterations (``0``: never): whether any row is still running, and with compaction it
  then drops the finished rows from the batch (``retire``). Every result equals the per-step path's (the rows
  of a batch are independent; tests/test_loop_sync.py checks each halting rule, solver and gradient mode).

  Static shapes between host reads are what CUDA graphs and a ``torch.compile``d training step need; the price
  is that a finished row is carried (and its step computed) until the next read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor

from loopformer.loop.config import LoopConfig
from loopformer.loop.halting import Halting
from loopformer.loop.state import LoopState

StepFn = Callable[..., Tensor]
INF = float("inf")


# -- halting decided on the device: the deferred path's bookkeeping (sync_every != 1) ----------------

def _rows(mask: Tensor, like: Tensor) -> Tensor:
    """A [B] mask shaped to broadcast against ``like`` [B, ...]."""
    return mask.view(-1, *([1] * (like.dim() - 1)))


class Finished:
    """Per active row: still running (``active``), and the results of the rows that finished."""

    def __init__(self, lp: LoopState) -> None:
        self.lp = lp
        b, device = lp.z.shape[0], lp.device
        self.active = torch.ones(b, dtype=torch.bool, device=device)
        self.steps = torch.zeros(b, dtype=torch.long, device=device)
        self.ran = torch.zeros(b, dtype=torch.long, device=device)  # history rows written before halting
        self.conv = torch.zeros(b, dtype=torch.bool, device=device)
        self.ran_all = torch.zeros(lp.b, dtype=torch.long, device=device)  # full batch, for the history mask
        # the value a finished row returns, kept only when the rule's output is not the iterate itself (ACT)
        self.keep_value = type(lp.halting).output is not Halting.output
        self.value: Tensor | None = None
        self.stats: dict[str, Tensor] | None = None

    def _stats(self, hstate: dict) -> dict[str, Tensor]:
        lp = self.lp
        return {**lp.solver.sample_stats(lp.sstate), **lp.halting.sample_stats(hstate)}

    def record(
        self, t: int, z_next: Tensor, h_prev: dict, finished: Tensor, bad: Tensor, conv: Tensor
    ) -> Tensor:
        """Record the rows that finish in iteration t; returns the next iterate (finished rows frozen)."""
        lp = self.lp
        with torch.no_grad():
            newly = finished & self.active
            good, broken = newly & ~bad, newly & bad
            self.steps = torch.where(good, t + 1, torch.where(broken, t, self.steps))
            self.ran = torch.where(newly, t + 1, self.ran)
            self.conv = torch.where(newly, conv, self.conv)
            ok, gone = self._stats(lp.hstate), self._stats(h_prev) if lp.halting.stats else None
            old = self.stats if self.stats is not None else ok
            self.stats = {
                k: torch.where(good, v, torch.where(broken, gone[k] if gone else v, old[k]))
                for k, v in ok.items()
            }
        if self.keep_value:
            out_ok, out_bad = lp.halting.output(z_next, lp.hstate), lp.halting.output(lp.z, h_prev)
            prev = self.value if self.value is not None else out_ok
            self.value = torch.where(
                _rows(good, out_ok), out_ok, torch.where(_rows(broken, out_ok), out_bad, prev)
            )
        frozen = ~self.active | bad
        self.active = self.active & ~finished
        return torch.where(_rows(frozen, z_next), lp.z, z_next)

    def retire(self, rows: Tensor) -> None:
        """Hand the finished active rows ``rows`` (local indices) to the loop's results."""
        lp = self.lp
        full = lp.idx.index_select(0, rows)
        value = (self.value if self.keep_value else lp.halting.output(lp.z, lp.hstate)).index_select(0, rows)
        stats = {k: v.index_select(0, rows) for k, v in (self.stats or {}).items()}
        lp.steps.index_copy_(0, full, self.steps.index_select(0, rows))
        lp.converged.index_copy_(0, full, self.conv.index_select(0, rows))
        self.ran_all.index_copy_(0, full, self.ran.index_select(0, rows))
        lp._pieces.append((full, lp.grad.emit(full, value, -1), stats))

    def retire_all(self) -> None:
        """Every active row has finished (the last iteration): all of them in one piece."""
        lp = self.lp
        value = self.value if self.keep_value else lp.halting.output(lp.z, lp.hstate)
        lp.steps.index_copy_(0, lp.idx, self.steps)
        lp.converged.index_copy_(0, lp.idx, self.conv)
        self.ran_all.index_copy_(0, lp.idx, self.ran)
        lp._pieces.append((lp.idx, lp.grad.emit(lp.idx, value, -1), self.stats or {}))

    def keep(self, rows: Tensor) -> None:
        """Continue with the active rows ``rows`` only (after ``LoopState.compact``)."""
        self.active, self.steps = self.active.index_select(0, rows), self.steps.index_select(0, rows)
        self.ran, self.conv = self.ran.index_select(0, rows), self.conv.index_select(0, rows)
        if self.value is not None:
            self.value = self.value.index_select(0, rows)
        if self.stats is not None:
            self.stats = {k: v.index_select(0, rows) for k, v in self.stats.items()}


def split_rows(active: Tensor, running: int) -> tuple[Tensor, Tensor]:
    """(finished rows, running rows) as local indices, from the mask and the host's count of running rows
    (one stable sort on the device: no second host read)."""
    order = torch.sort(active.to(torch.uint8), stable=True).indices
    n_done = active.shape[0] - running
    return order[:n_done], order[n_done:]


@dataclass
class LoopResult:
    """What ``run_loop`` returns (docs/architecture.md, Engine contract)."""

    state: Tensor  # final state [B, ...], differentiable according to cfg.grad
    steps: Tensor  # LongTensor [B]: accepted iterations per sample
    converged: Tensor  # BoolTensor [B]: the halting criterion held (never for diverged / stalled / capped)
    residuals: Tensor  # [steps_run, B] residual per step, NaN after a sample halted
    # (with trace=False and fixed halting: a plain loop, residuals / state_norms are [0, B], converged False)
    logits: Tensor | None = None  # readout(state, *ctx) when a readout was given
    ponder_cost: Tensor | None = None  # [B] Graves N + R (ACT), differentiable
    state_norms: Tensor | None = None  # [steps_run, B] RMS of the state after each step, NaN after halt
    stats: dict[str, Tensor] = field(default_factory=dict)  # per-sample stats the plug-ins report


@dataclass
class _Iteration:
    """What one iteration over the active samples produced."""

    z_next: Tensor
    res: Tensor
    nrm: Tensor
    info: dict[str, Tensor]
    done: Tensor | None
    conv: Tensor | None
    h_prev: Any


def _check_inputs(z0: Tensor, cfg: LoopConfig, ctx: tuple[Any, ...]) -> None:
    if not isinstance(cfg, LoopConfig):
        raise ValueError(f"run_loop needs a LoopConfig, got {type(cfg).__name__}")
    if not isinstance(z0, Tensor) or z0.dim() < 1 or z0.shape[0] < 1:
        raise ValueError("run_loop needs z0 as a batch-first tensor [B, ...] with B >= 1")
    for i, c in enumerate(ctx):
        if isinstance(c, Tensor) and (c.dim() == 0 or c.shape[0] != z0.shape[0]):
            raise ValueError(
                f"ctx[{i}] has shape {tuple(c.shape)}; every ctx tensor must be batch-first with batch "
                f"{z0.shape[0]} (the engine selects rows of halted samples)"
            )


def _in_state_dtype(z0: Tensor, ctx: tuple[Any, ...], cfg: LoopConfig) -> tuple[Tensor, tuple[Any, ...]]:
    """``LoopConfig.state_dtype``: the initial iterate and the floating context tensors (the injected
    input) cast to it (differentiably); auto leaves them as they are."""
    dtype = cfg.torch_state_dtype
    if dtype is None:
        return z0, ctx
    cast = tuple(c.to(dtype) if isinstance(c, Tensor) and c.is_floating_point() else c for c in ctx)
    return z0.to(dtype), cast


def _check_step_output(fz: Any, z: Tensor) -> None:
    if not isinstance(fz, Tensor) or fz.shape != z.shape:
        got = tuple(fz.shape) if isinstance(fz, Tensor) else type(fz).__name__
        raise ValueError(f"step(z, *ctx) must return a tensor shaped like z {tuple(z.shape)}, got {got}")


def _iterate(lp: LoopState, t: int, running: Tensor | None = None) -> _Iteration:
    """One step on the active samples: f(z), residual and norm rows, solver, every-step halting.
    ``running`` (deferred path): the rows still running; the solver and the halting rule see a residual
    of 0 for the frozen ones, so a batch-wide decision counts the running rows only."""
    lp.set_grad(t)
    z = lp.z
    if lp.grad.records:
        lp.grad.before_step(t, lp.idx, z, lp.sstate)
    fz = lp.step(z, *lp.ctx_a)
    if t == 0:
        _check_step_output(fz, z)
    res, nrm = lp.history.row(t)
    lp.residual(lp.rflat(z), lp.rflat(fz), lp.kind, lp.channels, res, nrm if lp.norm_is_step else None)
    seen = res if running is None else torch.where(running, res, torch.zeros_like(res))
    z_next, lp.sstate, info = lp.solver.update(z, fz, seen, lp.sstate)
    h_prev, done, conv = lp.hstate, None, None
    if lp.every_step:
        z_next, done, conv, lp.hstate = lp.halting.check(t, z, z_next, seen, lp.hstate, lp.ctx_a)
    if not lp.norm_is_step:
        torch.linalg.vector_norm(lp.flat(z_next), dim=1, out=nrm)
    return _Iteration(z_next, res, nrm, info, done, conv, h_prev)


def _could_stop(lp: LoopState, t: int, it: _Iteration) -> bool:
    """One cheap host question per step: could any active sample stop here? (NaN answers yes.)"""
    bound = lp.halting.residual_bound(t)
    lo, hi = torch.aminmax(it.res)
    if not (lo.item() >= bound and hi.item() <= lp.diverge_threshold):
        return True
    # with the rule's bound > 0 a non-finite ||f(z)|| already shows as a residual of 0 or NaN
    if lp.cfg.stop_diverged and not (lp.norm_is_step and bound > 0) and not it.nrm.amax().item() < INF:
        return True
    if lp.watch_stalls and bool(_stalled(lp, it).any()):
        return True
    return lp.every_step and bool(it.done.any())


@torch.no_grad()
def _stop_masks(
    lp: LoopState, t: int, it: _Iteration, last: bool, running: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """(finished, bad, converged) per active sample; bad: diverged (keeps its previous iterate).
    ``running``: the deferred path's rows still running (the frozen ones do not hold a batch-wide rule back)."""
    if not lp.every_step:
        res = it.res if running is None else torch.where(running, it.res, torch.zeros_like(it.res))
        _, it.done, it.conv, _ = lp.halting.check(t, lp.z, it.z_next, res, lp.hstate, lp.ctx_a)
    # non-finite residual or state, or residual above the threshold (NaN compares False); none without stop_diverged
    if lp.cfg.stop_diverged:
        bad = ~((it.res <= lp.cfg.diverge_threshold) & (it.nrm < INF))
    else:
        bad = torch.zeros_like(it.done)
    finished = torch.ones_like(it.done) if last else it.done | bad
    if lp.watch_stalls:
        finished = finished | _stalled(lp, it, running)
    return finished, bad, it.conv & ~bad


def _stalled(lp: LoopState, it: _Iteration, running: Tensor | None = None) -> Tensor:
    """The active samples a solver stall stops: the stalled ones, or with ``batch_stalls`` all of
    them once every running one (of their halting group) has stalled, and none before."""
    stalled = it.info["stalled"]
    if lp.batch_stalls:
        every = stalled if running is None else stalled | ~running
        return lp.halting.batch_all(every, lp.hstate)
    return stalled


def _retire(lp: LoopState, t: int, it: _Iteration, finished: Tensor, bad: Tensor, conv: Tensor) -> None:
    """Record the results of the finished active rows (a diverged row returns its previous iterate)."""
    good = (finished & ~bad).nonzero().squeeze(1)
    broken = (finished & bad).nonzero().squeeze(1)
    with torch.no_grad():
        rows = lp.idx.index_select(0, good)
        lp.steps.index_fill_(0, rows, t + 1)
        lp.converged.index_copy_(0, rows, conv.index_select(0, good))
        lp.steps.index_fill_(0, lp.idx.index_select(0, broken), t)
    if good.numel():
        lp.emit(good, lp.halting.output(it.z_next, lp.hstate), lp.hstate, t + 1)
    if broken.numel():
        lp.emit(broken, lp.halting.output(lp.z, it.h_prev), it.h_prev, t)


def _run_plain(lp: LoopState) -> int:
    """A rule that never stops early, without trace: no norms, no divergence check, no host sync."""
    cfg, step, update, callback, ctx = lp.cfg, lp.step, lp.solver.update, lp.callback, lp.ctx_a
    res_row = torch.empty(lp.b, dtype=lp.rdtype, device=lp.device) if lp.solver.needs_residual else None
    before = lp.grad.before_step if lp.grad.records else None
    z, sstate = lp.z, lp.sstate
    for t in range(cfg.max_steps):
        lp.set_grad(t)
        if before is not None:
            before(t, lp.idx, z, sstate)
        fz = step(z, *ctx)
        if t == 0:
            _check_step_output(fz, z)
        if res_row is not None:
            lp.residual(lp.rflat(z), lp.rflat(fz), lp.kind, lp.channels, res_row)
        z, sstate, _ = update(z, fz, res_row, sstate)
        if callback is not None:
            callback(t + 1, z, lp.idx)
    lp.z, lp.sstate = z, sstate
    lp.emit_all(z, cfg.max_steps)
    lp.steps.fill_(cfg.max_steps)
    return cfg.max_steps


def _notify(lp: LoopState, t: int, z_next: Tensor, active: Tensor | None) -> None:
    """The callback with the new iterate of the rows active in step t (``active``: the frozen-rows path's
    running rows, None while every row of the batch runs)."""
    if lp.callback is None:
        return
    if active is None:
        lp.callback(t + 1, z_next, lp.idx)
    else:
        live = active.nonzero().squeeze(1)
        lp.callback(t + 1, z_next.index_select(0, live), live)


def _run_per_step(lp: LoopState, compact: bool) -> int:
    """Per-sample halting with a host read every step. How finished rows leave: with ``compact`` they are
    dropped from the active batch (``LoopState.compact``); without, every row stays in the batch and the
    finished ones are frozen with ``torch.where`` (``compaction=False``). Both give the same results."""
    cfg, t, n_active = lp.cfg, 0, lp.b
    active: Tensor | None = None  # frozen rows: the rows still running (None until the first stop check)
    ran = None if compact else torch.zeros(lp.b, dtype=torch.long, device=lp.device)  # frozen rows: steps
    shape = (-1, *([1] * (lp.z.dim() - 1)))
    for t in range(cfg.max_steps):
        it = _iterate(lp, t)
        last = t + 1 == cfg.max_steps
        if not last and not _could_stop(lp, t, it):
            lp.z = it.z_next if active is None else torch.where(active.view(shape), it.z_next, lp.z)
            _notify(lp, t, it.z_next, active)
            continue
        finished, bad, conv = _stop_masks(lp, t, it, last)
        if not compact:
            active = torch.ones_like(finished) if active is None else active
            finished = finished & active
        _notify(lp, t, it.z_next, active)
        n_finished = int(finished.sum())
        if n_finished:
            _retire(lp, t, it, finished, bad, conv)
            if ran is not None:
                ran.masked_fill_(finished, t + 1)
        n_active -= n_finished
        if n_active == 0:
            break
        if active is not None:
            frozen = (~active) | bad
            active = active & ~finished
            lp.z = torch.where(frozen.view(shape), lp.z, it.z_next)
        elif n_finished:  # flush this segment's history, continue with the rows still running
            lp.history.flush(lp.idx, t + 1)
            keep = (~finished).nonzero().squeeze(1)
            lp.compact(keep, it.z_next)
            lp.history.restart(t + 1, keep.numel())
        else:
            lp.z = it.z_next
    if ran is None:
        lp.history.flush(lp.idx, t + 1)
    else:
        lp.history.mask_after(ran, t + 1)
    return t + 1


def _run_deferred(lp: LoopState) -> int:
    """Halting decided on the device (``Finished``, above): finished rows are frozen and their
    results recorded; the host reads once every ``sync_every`` iterations (0: never) whether any row still
    runs, and with compaction drops the finished ones then."""
    cfg, every, t = lp.cfg, lp.sync_every, 0
    rec = Finished(lp)
    longest = cfg.max_steps  # iterations the per-step path would have run (the traces' length)
    for t in range(cfg.max_steps):
        running = rec.active
        it = _iterate(lp, t, running)
        last = t + 1 == cfg.max_steps
        finished, bad, conv = _stop_masks(lp, t, it, last, running)
        lp.z = rec.record(t, it.z_next, it.h_prev, finished, bad, conv)
        if not every or (t + 1) % every and not last:
            continue
        # the one host read of these `every` iterations (and one after the last)
        n_running, longest = torch.stack([rec.active.sum(), rec.ran.max()]).tolist()
        if n_running == 0:
            break
        if cfg.compaction and n_running < rec.active.shape[0]:
            done, keep = split_rows(rec.active, n_running)
            rec.retire(done)
            lp.history.flush(lp.idx, t + 1)
            lp.compact(keep, lp.z)
            rec.keep(keep)
            lp.history.restart(t + 1, n_running)
    rec.retire_all()
    lp.history.flush(lp.idx, t + 1)
    lp.history.mask_after(rec.ran_all, t + 1)
    return int(longest)


def run_loop(
    step: StepFn,
    z0: Tensor,
    cfg: LoopConfig,
    ctx: Sequence[Any] | Tensor = (),
    readout: Callable[..., Tensor] | None = None,
    halt_fn: Callable[..., Tensor] | None = None,
    callback: Callable[[int, Tensor, Tensor], None] | None = None,
    solver_state: dict[str, Tensor] | None = None,
) -> LoopResult:
    """Iterate ``z <- step(z, *ctx)`` per cfg (solver, halting, grad) and return a LoopResult.

    ``readout(z, *ctx) -> logits [B, ..., V]`` is required for kl_entropy halting (and, when given,
    produces ``LoopResult.logits``); ``halt_fn(z, *ctx) -> p`` ([B] or [B, T]) for act halting;
    ``callback(t, z_active, active_idx)`` runs after each step with the new iterate of the samples
    active in that step (t = iterations done). ``solver_state``: per-sample solver values a previous
    call returned in ``LoopResult.stats`` (e.g. the damped solver's ``eta`` / ``best`` /
    ``patience``), to continue that solve instead of starting fresh (FPRM's deep-supervision segments).
    """
    ctx = (ctx,) if isinstance(ctx, Tensor) else tuple(ctx)
    _check_inputs(z0, cfg, ctx)
    z0, ctx = _in_state_dtype(z0, ctx, cfg)
    lp = LoopState(step, z0, cfg, ctx, readout, halt_fn, callback, solver_state)
    if not lp.track:
        run = _run_plain
    elif lp.deferred:
        run = _run_deferred
    elif z0.is_meta:  # no values to halt on (the memory plan, loopformer.config.memory): loops run to their cap
        run = _run_plain
    else:
        run = partial(_run_per_step, compact=cfg.compaction)
    try:
        t_run = run(lp)
    finally:
        torch.set_grad_enabled(lp.grad_on)
    if lp.track:
        lp.history.finish(t_run, lp.width)
    state, stats = lp.assemble()
    if lp.grad_on:
        state, extra = lp.grad.finish(step, state, ctx)
        stats.update(extra)
    return LoopResult(
        state=state,
        steps=lp.steps,
        converged=lp.converged,
        residuals=lp.history.res[:t_run],
        logits=readout(state, *ctx) if readout is not None else None,
        ponder_cost=stats.get("ponder_cost"),
        state_norms=lp.history.norm[:t_run],
        stats=stats,
    )
