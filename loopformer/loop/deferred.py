"""Halting decided on the device: the bookkeeping of ``run_loop``'s deferred path (``LoopConfig.sync_every != 1``).

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

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from loopformer.loop.halting import Halting

if TYPE_CHECKING:
    from loopformer.loop.state import LoopState


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
