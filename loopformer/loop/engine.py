"""run_loop: the one iteration loop every loopformer model uses (docs/architecture.md).

``run_loop(step, z0, cfg, ctx, readout, halt_fn, callback)`` iterates ``z <- solver(z, step(z, *ctx))``
until each sample's halting rule fires, per sample:

- every iteration evaluates ``step`` once on the *active* samples, measures the residual
  (``norms.py``) and the state RMS, forms the next iterate (``solvers.py``) and asks the halting
  rule (``halting.py``) which samples are done; the step cap, FPRM's stalled damping
  (eta < min step) and divergence (non-finite residual or state, residual > diverge_threshold)
  also stop a sample. A diverged sample keeps its last finite iterate and converged=False.
- with ``compaction`` halted samples leave the active batch (state, ctx rows, solver and
  halting state are index-selected), so adaptive halting saves real compute; without it
  finished rows are frozen with ``torch.where``. Both give the same results.
- per-iteration cost (small maps are dominated by it): residuals and ||state|| are written in
  place into preallocated history rows, one host sync per step (``aminmax`` of the residuals:
  could any sample stop?) and the exact halting / divergence masks only when it could; fixed
  halting with ``trace=False`` is a plain loop for every solver (no norms, no divergence check,
  no sync; the damped solver still measures its residual on the device).
- gradient modes (chosen by ``cfg.grad`` only, never by ``module.training``):
  ``bptt`` unrolls every step; ``truncated`` runs without gradient and makes the last k steps
  of each sample differentiable. For picard / damped this is exact: with fixed halting the last
  k steps simply run with gradient, with adaptive halting the last k inputs (and damping steps)
  are kept in a (k+1)-slot ring buffer and the last k steps are replayed with gradient when the
  sample halts (FPRM's truncated BPTT = truncated Neumann series, SYSTEMS.md section 1); from
  z0 when k >= steps. For anderson / broyden it is k Picard steps from the detached solution,
  with the solver's value kept (straight-through). ``onestep`` / ``neumann`` / ``ift``
  recompute one step from the detached solution (``grad.py``, Attractor IFT, SYSTEMS.md section 2).
  The returned state always carries a gradient path through ``step`` (unlike TorchDEQ issue 8).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from loopformer.loop.config import LoopConfig
from loopformer.loop.grad import implicit_attach
from loopformer.loop.halting import ACTHalting, make_halting
from loopformer.loop.norms import residual_into
from loopformer.loop.solvers import make_solver

StepFn = Callable[..., Tensor]


@dataclass
class LoopResult:
    """What ``run_loop`` returns (docs/architecture.md, Engine contract)."""

    state: Tensor  # final state [B, ...], differentiable according to cfg.grad
    steps: Tensor  # LongTensor [B]: accepted iterations per sample
    converged: Tensor  # BoolTensor [B]: the halting criterion held (never for diverged / stalled / capped)
    residuals: Tensor  # [steps_run, B] residual per step, NaN after a sample halted
    # (with trace=False and fixed halting: a plain loop, residuals / state_norms are [0, B], converged False)
    logits: Tensor | None = None  # readout(state, *ctx) when a readout was given
    ponder_cost: Tensor | None = None  # [B] Graves N + R (ACT only), differentiable
    state_norms: Tensor | None = None  # [steps_run, B] RMS of the state after each step, NaN after halt


def _select(obj: Any, rows: Tensor) -> Any:
    """Index-select every batch-first tensor inside obj (tensors, lists, tuples, dicts)."""
    if isinstance(obj, Tensor):
        return obj.index_select(0, rows) if obj.dim() > 0 else obj
    if isinstance(obj, list):
        return [_select(o, rows) for o in obj]
    if isinstance(obj, tuple):
        return tuple(_select(o, rows) for o in obj)
    if isinstance(obj, dict):
        return {k: _select(v, rows) for k, v in obj.items()}
    return obj


class _Ring:
    """The last k+1 step inputs (and damping steps) in full-batch coordinates, without gradient."""

    def __init__(self, size: int, z0: Tensor) -> None:
        self.size = size
        self.z = torch.empty((size, *z0.shape), dtype=z0.dtype, device=z0.device)
        self.eta: Tensor | None = None

    @torch.no_grad()
    def write(self, t: int, idx: Tensor, z: Tensor, eta: Tensor | None) -> None:
        self.z[t % self.size].index_copy_(0, idx, z.detach())
        if eta is not None:
            if self.eta is None:
                self.eta = torch.empty((self.size, self.z.shape[1]), dtype=eta.dtype, device=eta.device)
            self.eta[t % self.size].index_copy_(0, idx, eta)


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


def _check_step_output(fz: Any, z: Tensor) -> None:
    if not isinstance(fz, Tensor) or fz.shape != z.shape:
        got = tuple(fz.shape) if isinstance(fz, Tensor) else type(fz).__name__
        raise ValueError(f"step(z, *ctx) must return a tensor shaped like z {tuple(z.shape)}, got {got}")


def run_loop(
    step: StepFn,
    z0: Tensor,
    cfg: LoopConfig,
    ctx: Sequence[Any] | Tensor = (),
    readout: Callable[..., Tensor] | None = None,
    halt_fn: Callable[..., Tensor] | None = None,
    callback: Callable[[int, Tensor, Tensor], None] | None = None,
) -> LoopResult:
    """Iterate ``z <- step(z, *ctx)`` per cfg (solver, halting, grad) and return a LoopResult.

    ``readout(z, *ctx) -> logits [B, ..., V]`` is required for kl_entropy halting (and, when given,
    produces ``LoopResult.logits``); ``halt_fn(z, *ctx) -> p`` ([B] or [B, T]) for act halting;
    ``callback(t, z_active, active_idx)`` runs after each step with the new iterate of the samples
    active in that step (t = iterations done).
    """
    ctx = (ctx,) if isinstance(ctx, Tensor) else tuple(ctx)
    _check_inputs(z0, cfg, ctx)
    halting = make_halting(cfg, readout, halt_fn)
    solver = make_solver(cfg)
    is_act = isinstance(halting, ACTHalting)
    b, device = z0.shape[0], z0.device
    grad_on = torch.is_grad_enabled()
    k = cfg.grad_steps
    exact_trunc = cfg.grad == "truncated" and cfg.solver in ("picard", "damped")
    direct_trunc = exact_trunc and cfg.halting == "fixed"
    if cfg.grad == "bptt":
        grad_from = 0
    elif direct_trunc:
        grad_from = cfg.max_steps - k
    else:
        grad_from = cfg.max_steps + 1  # never: forward without gradient
    ring = _Ring(k + 1, z0) if (exact_trunc and not direct_trunc and grad_on) else None

    def replay(rows: Tensor, n: int) -> Tensor:
        """Recompute the last min(k, n) of n steps for these rows with gradient (exact truncation)."""
        s = max(0, n - k)
        with torch.enable_grad():
            z = z0.index_select(0, rows) if s == 0 else ring.z[s % ring.size].index_select(0, rows)
            c = _select(ctx, rows)
            for j in range(s, n):
                f = step(z, *c)
                if ring.eta is not None:
                    e = ring.eta[j % ring.size].index_select(0, rows)
                    e = e.view(-1, *([1] * (z.dim() - 1))).to(z.dtype)
                    z = torch.lerp(z, f, e)  # the damped solver's own formula (bit-identical replay)
                else:
                    z = f
        return z

    rdtype = torch.promote_types(z0.dtype, torch.float32)
    upcast = z0.dtype != rdtype
    fixed = cfg.halting == "fixed"
    track = cfg.trace or not fixed
    n_rec = cfg.max_steps if track else 0
    resid_buf = torch.full((n_rec, b), float("nan"), dtype=rdtype, device=device)
    norm_buf = torch.full((n_rec, b), float("nan"), dtype=rdtype, device=device)
    steps = torch.zeros(b, dtype=torch.long, device=device)
    converged = torch.zeros(b, dtype=torch.bool, device=device)
    piece_idx: list[Tensor] = []
    piece_val: list[Tensor] = []
    piece_ponder: list[Tensor] = []

    idx = torch.arange(b, device=device)
    z = z0
    ctx_a = ctx
    sstate = solver.init(z0)
    hstate = halting.init(z0, ctx)
    t_run = 0
    kind = cfg.residual_norm
    channels = z0.shape[-1] if z0.dim() > 1 else 1
    width = z0[0].numel()

    def flat(x: Tensor) -> Tensor:
        x = x.detach().reshape(x.shape[0], -1)
        return x.to(rdtype) if upcast else x


    def emit(rows_local: Tensor, value: Tensor, hst: dict, n: int) -> None:
        rows = idx.index_select(0, rows_local)
        piece_idx.append(rows)
        if ring is not None:
            piece_val.append(replay(rows, n))
        else:
            piece_val.append(value.index_select(0, rows_local))
        if is_act:
            piece_ponder.append(ACTHalting.ponder(_select(hst, rows_local)))

    def _tracked() -> int:
        """Residual / kl / act halting, or fixed halting with trace: per-sample halting and history.

        Every step writes the residual and ||state|| straight into preallocated history rows and
        asks the host one cheap question (``aminmax`` of the residuals: could any sample stop
        here?); only when the answer is yes are the exact halting / divergence masks formed.
        With compaction the history of the active rows is kept in a segment buffer that is
        scattered into full-batch coordinates when the active set changes.
        """
        nonlocal z, ctx_a, sstate, hstate, idx, grad_mode
        generic = cfg.halting in ("kl_entropy", "act")
        picard_norm = cfg.solver == "picard" and not is_act  # ||state|| = ||f(z)||, already measured
        check_stalled = cfg.solver == "damped" and not fixed
        compaction = cfg.compaction
        tol, thr, inf = cfg.tol, cfg.diverge_threshold, float("inf")
        active = torch.ones(b, dtype=torch.bool, device=device)  # masking mode only
        all_active = True
        ran = torch.zeros(b, dtype=torch.long, device=device)  # masking mode: recorded steps per sample
        t0 = 0
        seg_res = torch.empty((cfg.max_steps, b), dtype=rdtype, device=device) if compaction else resid_buf
        seg_norm = torch.empty((cfg.max_steps, b), dtype=rdtype, device=device) if compaction else norm_buf
        t = 0
        for t in range(cfg.max_steps):
            last = t + 1 == cfg.max_steps
            mode = grad_on and t >= grad_from
            if mode is not grad_mode:
                torch.set_grad_enabled(mode)
                grad_mode = mode
            if ring is not None:
                ring.write(t, idx, z, sstate.get("eta"))
            fz = step(z, *ctx_a)
            if t == 0:
                _check_step_output(fz, z)
            res, nrm = seg_res[t - t0], seg_norm[t - t0]
            residual_into(flat(z), flat(fz), kind, channels, res, nrm if picard_norm else None)
            z_next, sstate, info = solver.update(z, fz, res, sstate)
            h_prev = hstate
            if generic:
                z_next, done, conv, hstate = halting.check(t, z, z_next, res, hstate, ctx_a)
            if not picard_norm:
                torch.linalg.vector_norm(flat(z_next), dim=1, out=nrm)

            # could any sample stop here? (one host sync; exact masks only when it could)
            fire = last
            if not fire:
                low_ok = cfg.halting == "residual" and t + 1 >= cfg.min_steps
                lo, hi = torch.aminmax(res)
                fire = not (lo.item() >= (tol if low_ok else 0.0) and hi.item() <= thr)  # NaN fires
                if not fire and not (picard_norm and low_ok):  # else ||f(z)|| = inf gives res 0 or NaN
                    fire = not nrm.amax().item() < inf
                if not fire and check_stalled:
                    fire = bool(info["stalled"].any())
                if not fire and generic:
                    fire = bool(done.any())
            if not fire:
                if compaction or all_active:
                    z = z_next
                else:
                    z = torch.where(active.view(-1, *([1] * (z.dim() - 1))), z_next, z)
                if callback is not None:
                    if compaction or all_active:
                        callback(t + 1, z_next, idx)
                    else:
                        live = active.nonzero().squeeze(1)
                        callback(t + 1, z_next.index_select(0, live), live)
                continue

            with torch.no_grad():
                if not generic:
                    _, done, conv, _ = halting.check(t, z, z_next, res, hstate, ctx_a)
                # non-finite residual or state, or residual above the threshold (NaN compares False)
                bad = ~((res <= thr) & (nrm < inf))
                finished = torch.ones_like(done) if last else done | bad
                if check_stalled:
                    finished = finished | info["stalled"]
                conv = conv & ~bad
                if not compaction:
                    finished = finished & active
            if callback is not None:
                if compaction:
                    callback(t + 1, z_next, idx)
                else:
                    live = active.nonzero().squeeze(1)
                    callback(t + 1, z_next.index_select(0, live), live)

            n_finished = int(finished.sum())
            n_active = z.shape[0]
            if n_finished:
                good = (finished & ~bad).nonzero().squeeze(1)
                broken = (finished & bad).nonzero().squeeze(1)
                with torch.no_grad():
                    rows = idx.index_select(0, good)
                    steps.index_fill_(0, rows, t + 1)
                    converged.index_copy_(0, rows, conv.index_select(0, good))
                    steps.index_fill_(0, idx.index_select(0, broken), t)
                    if not compaction:
                        ran.masked_fill_(finished, t + 1)
                if good.numel():
                    emit(good, halting.output(z_next, hstate), hstate, t + 1)
                if broken.numel():
                    emit(broken, halting.output(z, h_prev), h_prev, t)
            if compaction:
                if n_finished == n_active:
                    break
                if n_finished:
                    # flush this segment's history, continue with the rows still running
                    resid_buf[t0 : t + 1].index_copy_(1, idx, seg_res[: t + 1 - t0])
                    norm_buf[t0 : t + 1].index_copy_(1, idx, seg_norm[: t + 1 - t0])
                    keep = (~finished).nonzero().squeeze(1)
                    z = z_next.index_select(0, keep)
                    ctx_a = _select(ctx_a, keep)
                    sstate = _select(sstate, keep)
                    hstate = _select(hstate, keep)
                    idx = idx.index_select(0, keep)
                    t0 = t + 1
                    seg_res = torch.empty((cfg.max_steps - t0, keep.numel()), dtype=rdtype, device=device)
                    seg_norm = torch.empty_like(seg_res)
                else:
                    z = z_next
            else:
                frozen = (~active) | bad
                active = active & ~finished
                all_active = False
                if n_finished and not bool(active.any()):
                    break
                z = torch.where(frozen.view(-1, *([1] * (z.dim() - 1))), z, z_next)
        t_end = t + 1
        with torch.no_grad():
            if compaction:
                resid_buf[t0:t_end].index_copy_(1, idx, seg_res[: t_end - t0])
                norm_buf[t0:t_end].index_copy_(1, idx, seg_norm[: t_end - t0])
            else:  # rows after a sample halted are NaN
                after = torch.arange(t_end, device=device).unsqueeze(1) >= ran.unsqueeze(0)
                resid_buf[:t_end].masked_fill_(after, float("nan"))
                norm_buf[:t_end].masked_fill_(after, float("nan"))
            norm_buf[:t_end].div_(math.sqrt(max(1, width)))  # ||state|| -> RMS, once for the history
        return t_end

    grad_mode: bool | None = None
    try:
        if not track:
            # fixed halting without trace: a plain loop, no norms, no divergence check, no host syncs
            # (the damped solver still measures its residual on the device)
            res_row = torch.empty(b, dtype=rdtype, device=device) if cfg.solver == "damped" else None
            for t in range(cfg.max_steps):
                t_run = t + 1
                mode = grad_on and t >= grad_from
                if mode is not grad_mode:
                    torch.set_grad_enabled(mode)
                    grad_mode = mode
                fz = step(z, *ctx_a)
                if t == 0:
                    _check_step_output(fz, z)
                if res_row is not None:
                    residual_into(flat(z), flat(fz), kind, channels, res_row)
                z, sstate, _ = solver.update(z, fz, res_row, sstate)
                if callback is not None:
                    callback(t + 1, z, idx)
            piece_idx.append(idx)
            piece_val.append(z)
            steps.fill_(cfg.max_steps)
        else:
            t_run = _tracked()
    finally:
        torch.set_grad_enabled(grad_on)

    order = torch.cat(piece_idx).argsort()
    state = torch.cat(piece_val).index_select(0, order)
    ponder = torch.cat(piece_ponder).index_select(0, order) if is_act else None

    if grad_on:
        if cfg.grad in ("onestep", "neumann", "ift"):
            state = implicit_attach(step, state, ctx, cfg)
        elif cfg.grad == "truncated" and not exact_trunc:
            p = state.detach()
            for _ in range(k):
                p = step(p, *ctx)
            state = p + (state.detach() - p).detach()

    logits = readout(state, *ctx) if readout is not None else None
    return LoopResult(
        state=state,
        steps=steps,
        converged=converged,
        residuals=resid_buf[:t_run],
        logits=logits,
        ponder_cost=ponder,
        state_norms=norm_buf[:t_run],
    )
