"""The per-call state of ``run_loop``: plug-ins, the active set, histories and results.

``LoopState`` holds what one call iterates over: the active samples (their full-batch indices,
state, context rows, solver and halting state), which ``compact`` index-selects in one
operation when samples halt; the per-sample results (steps, convergence, the returned value and
plug-in stats); and the ``History`` of residuals and state norms.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from loopformer.loop.config import SYNC_AUTO, SYNC_EVERY_CUDA, LoopConfig
from loopformer.loop.grad import GRADS, select_rows
from loopformer.loop.halting import HALTINGS
from loopformer.loop.norms import residual_into, residual_lowp_into
from loopformer.loop.solvers import SOLVERS


class History:
    """Residual and ||state|| per step [steps, B] in full-batch coordinates (NaN after a halt).

    With compaction the active rows write into a segment buffer that ``flush`` scatters into
    the history when the active set changes; without it rows are written in place.
    """

    def __init__(self, n_rec: int, b: int, dtype: torch.dtype, device: torch.device, segmented: bool) -> None:
        self.res = torch.full((n_rec, b), float("nan"), dtype=dtype, device=device)
        self.norm = torch.full((n_rec, b), float("nan"), dtype=dtype, device=device)
        self.n_rec, self.t0, self.segmented = n_rec, 0, segmented
        self.restart(0, b)

    def restart(self, t0: int, n: int) -> None:
        """A new segment from iteration t0 for n active rows."""
        self.t0 = t0
        if self.segmented:
            self.seg_res = torch.empty((self.n_rec - t0, n), dtype=self.res.dtype, device=self.res.device)
            self.seg_norm = torch.empty_like(self.seg_res)
        else:
            self.seg_res, self.seg_norm = self.res, self.norm

    def row(self, t: int) -> tuple[Tensor, Tensor]:
        return self.seg_res[t - self.t0], self.seg_norm[t - self.t0]

    def flush(self, idx: Tensor, t_end: int) -> None:
        if self.segmented:
            with torch.no_grad():
                self.res[self.t0 : t_end].index_copy_(1, idx, self.seg_res[: t_end - self.t0])
                self.norm[self.t0 : t_end].index_copy_(1, idx, self.seg_norm[: t_end - self.t0])

    def mask_after(self, ran: Tensor, t_end: int) -> None:
        """Masking mode: rows after a sample halted are NaN."""
        with torch.no_grad():
            after = torch.arange(t_end, device=ran.device).unsqueeze(1) >= ran.unsqueeze(0)
            self.res[:t_end].masked_fill_(after, float("nan"))
            self.norm[:t_end].masked_fill_(after, float("nan"))

    def finish(self, t_end: int, width: int) -> None:
        with torch.no_grad():
            self.norm[:t_end].div_(math.sqrt(max(1, width)))  # ||state|| -> RMS, once for the history


class LoopState:
    """Plug-ins, active set and results of one ``run_loop`` call."""

    def __init__(
        self,
        step: Callable[..., Tensor],
        z0: Tensor,
        cfg: LoopConfig,
        ctx: tuple[Any, ...],
        readout: Callable[..., Tensor] | None,
        halt_fn: Callable[..., Tensor] | None,
        callback: Callable[[int, Tensor, Tensor], None] | None,
        solver_state: dict[str, Tensor] | None = None,
    ) -> None:
        self.cfg, self.ctx, self.callback = cfg, ctx, callback
        # LoopConfig.state_dtype: every step's output is cast to it (the gradient modes' replays see the same
        # step); in bf16 the residual is bf16 arithmetic
        self.state_dtype = cfg.torch_state_dtype
        self.lowp = cfg.low_precision_state
        self.residual = residual_lowp_into if self.lowp else residual_into
        self.step = step if self.state_dtype is None else self._cast_step(step, self.state_dtype)
        self.halting = HALTINGS.get(cfg.halting)(cfg, readout=readout, halt_fn=halt_fn)
        self.solver = SOLVERS.get(cfg.solver)(cfg)
        self.grad = GRADS.get(cfg.grad)(cfg, self.solver, self.halting)
        # what the plug-ins declare, read once
        self.watch_stalls = self.solver.can_stall and self.halting.stops_early
        self.batch_stalls = self.halting.batch_stalls  # stalls stop all running samples, or none
        self.solver.report_stalls = self.watch_stalls
        self.norm_is_step = self.solver.returns_step and not self.halting.edits_iterate
        self.every_step = self.halting.every_step
        # the residual above which a sample counts as diverged (none with stop_diverged off)
        self.diverge_threshold = cfg.diverge_threshold if cfg.stop_diverged else math.inf
        self.track = cfg.trace or self.halting.stops_early
        b, device = z0.shape[0], z0.device
        self.b, self.device = b, device
        self.rdtype = torch.promote_types(z0.dtype, torch.float32)
        self.upcast = z0.dtype != self.rdtype
        self.kind, self.width = cfg.residual_norm, z0[0].numel()
        self.channels = z0.shape[-1] if z0.dim() > 1 else 1
        self.grad_on, self._mode = torch.is_grad_enabled(), None
        self.graph_from = self.grad.graph_from()
        # the active set
        self.idx = self._all = torch.arange(b, device=device)
        self.z, self.ctx_a = z0, ctx
        self.sstate = self.solver.init(z0)
        if solver_state:
            self.sstate = self.solver.resume(self.sstate, solver_state)
        self.hstate = self.halting.init(z0, ctx)
        # results
        self.steps = torch.zeros(b, dtype=torch.long, device=device)
        self.converged = torch.zeros(b, dtype=torch.bool, device=device)
        self._pieces: list[tuple[Tensor, Tensor, dict[str, Tensor]]] = []
        self.grad.start(self.step, z0, ctx, self.grad_on)
        # halting decided on the device (the engine's deferred path, loopformer.loop.engine); with sync_every 0 no row ever leaves the
        # batch, so the history is written in place (no segment buffers: static shapes)
        every = cfg.sync_every
        if every == SYNC_AUTO:  # a host read costs nothing on the CPU; on a GPU it stalls the queue
            every = SYNC_EVERY_CUDA if z0.is_cuda else 1
        self.sync_every = every
        self.deferred = every != 1 and callback is None and not self.grad.records
        segmented = cfg.compaction and not (self.deferred and every == 0)
        self.history = History(cfg.max_steps if self.track else 0, b, self.rdtype, device, segmented)

    def set_grad(self, t: int) -> None:
        """Record a graph in iteration t or not (the gradient mode's ``graph_from``)."""
        mode = self.grad_on and t >= self.graph_from
        if mode is not self._mode:
            torch.set_grad_enabled(mode)
            self._mode = mode

    def flat(self, x: Tensor) -> Tensor:
        x = x.detach().reshape(x.shape[0], -1)
        return x.to(self.rdtype) if self.upcast else x

    def rflat(self, x: Tensor) -> Tensor:
        """``x`` flat and detached for the residual: in the state's own dtype for a low-precision state."""
        return x.detach().reshape(x.shape[0], -1) if self.lowp else self.flat(x)

    @staticmethod
    def _cast_step(step: Callable[..., Tensor], dtype: torch.dtype) -> Callable[..., Tensor]:
        """``step`` whose output is cast to the loop's state dtype (the FPRM reference's
        ``FixedPointOptimizer.step``: ``y = y.to(state_dtype)``)."""

        def cast(z: Tensor, *ctx: Any) -> Tensor:
            fz = step(z, *ctx)
            return fz if not isinstance(fz, Tensor) or fz.dtype == dtype else fz.to(dtype)

        return cast

    def emit(self, rows_local: Tensor, value: Tensor, hstate: dict[str, Any], n: int) -> None:
        """Record the returned value (and plug-in stats) of halting active rows after n steps."""
        rows = self.idx.index_select(0, rows_local)
        stats = {**self.solver.sample_stats(self.sstate), **self.halting.sample_stats(hstate)}
        stats = {k: v.index_select(0, rows_local) for k, v in stats.items()}
        self._pieces.append((rows, self.grad.emit(rows, value.index_select(0, rows_local), n), stats))

    def emit_all(self, value: Tensor, n: int) -> None:
        """Every active row halts after n steps (the plain loop)."""
        stats = {**self.solver.sample_stats(self.sstate), **self.halting.sample_stats(self.hstate)}
        self._pieces.append((self.idx, self.grad.emit(self.idx, value, n), stats))

    def compact(self, keep: Tensor, z_next: Tensor) -> None:
        """Continue with the active rows ``keep`` only (state, ctx, solver and halting state)."""
        self.z = z_next.index_select(0, keep)
        self.ctx_a = select_rows(self.ctx_a, keep)
        self.sstate = select_rows(self.sstate, keep)
        self.hstate = select_rows(self.hstate, keep)
        self.idx = self.idx.index_select(0, keep)

    def assemble(self) -> tuple[Tensor, dict[str, Tensor]]:
        """The returned value of every sample in batch order, and the per-sample stats."""
        if len(self._pieces) == 1 and self._pieces[0][0] is self._all:  # every row at once, in order
            return self._pieces[0][1], self._pieces[0][2]
        order = torch.cat([p[0] for p in self._pieces]).argsort()
        state = torch.cat([p[1] for p in self._pieces]).index_select(0, order)
        keys = self._pieces[0][2].keys()
        stats = {k: torch.cat([p[2][k] for p in self._pieces]).index_select(0, order) for k in keys}
        return state, stats
