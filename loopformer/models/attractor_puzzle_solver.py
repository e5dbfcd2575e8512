"""``anderson_trmdeq``: the Attractor puzzle model's Anderson solve as its authors' code computes it.

A solver plug-in (registered in ``loopformer.loop.SOLVERS`` on import) reproducing
github jacobfa/Attractor, ``experiments/attractor_puzzles/trm/trm_deq.py: _anderson_solve``, which the
paper's Sudoku-Extreme / Maze-Hard runs used. It differs from the engine's ``anderson`` in its history:
the m-slot buffers start as ``[y0, f(y0), 0, ...]`` / ``[f(y0), f(f(y0)), 0, ...]``, every step rolls
them by one slot and writes the new iterate into the last slot, and the mixing reads the *first*
``min(k, m)`` slots. For k = 3..m+1 those include slots that were never written (zeros): their
residual is 0, so the regularised least-squares weights concentrate on them and the next iterate is
close to 0. From k = m + 2 on the buffer holds real iterates again. The regulariser ``reg`` (1e-4) is
added to the raw Gram matrix. The engine's ``anderson`` keeps the true last m iterates; with at most
3 map evaluations (``deq_max_iter`` 3) both give the same iterates.

Per-sample state: ``Y``, ``F`` [B, m, n] (in at least float32) and the step counter ``k`` (a plain
int, the same for every sample: the reference solves the batch in lock step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from loopformer.loop.quasi_newton import exact, gram_weights
from loopformer.loop.solvers import SOLVERS, Info, Solver, State, option_error


@dataclass(frozen=True)
class TRMDEQAndersonOptions:
    m: int = 5
    reg: float = 1e-4
    beta: float = 1.0
    legacy_names: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        if not isinstance(self.m, int) or isinstance(self.m, bool) or self.m < 2:
            raise option_error("anderson_trmdeq", "m", {}, f"must be an integer >= 2, got {self.m!r}")
        if not self.reg > 0 or not self.beta > 0:
            raise option_error(
                "anderson_trmdeq", "reg/beta", {}, f"must be > 0, got {self.reg!r}, {self.beta!r}"
            )


@SOLVERS.register(replace=True)
class TRMDEQAnderson(Solver):
    """The reference's rolled-buffer Anderson (see the module docstring)."""

    name = "anderson_trmdeq"
    Options = TRMDEQAndersonOptions

    def init(self, z: Tensor) -> State:
        b, m = z.shape[0], self.opts.m
        dtype = torch.promote_types(z.dtype, torch.float32)
        n = z[0].numel()
        return {
            "Y": torch.zeros(b, m, n, dtype=dtype, device=z.device),
            "F": torch.zeros(b, m, n, dtype=dtype, device=z.device),
            "k": 0,
        }

    def update(self, z: Tensor, fz: Tensor, res: Tensor | None, state: State) -> tuple[Tensor, State, Info]:
        opts, k = self.opts, state["k"]
        Y, F = state["Y"].clone(), state["F"].clone()
        b = z.shape[0]
        zf = z.detach().reshape(b, -1).to(Y.dtype)
        ff = fz.detach().reshape(b, -1).to(Y.dtype)
        if k == 0:  # Y0 = y0, F0 = f(y0); the next iterate is Y1 = F0
            Y[:, 0], F[:, 0], Y[:, 1] = zf, ff, ff
            return fz, {"Y": Y, "F": F, "k": 1}, {}
        F[:, 1 if k == 1 else -1] = ff  # f of the previous step's new iterate
        n_act = min(k + 1, opts.m)
        with torch.no_grad(), exact(Y):  # outside autocast: the buffers' own dtype (no bf16 LU)
            g = F[:, :n_act] - Y[:, :n_act]
            alpha = gram_weights(torch.bmm(g, g.transpose(1, 2)), opts.reg, relative=False)
            mix = (alpha.unsqueeze(-1) * F[:, :n_act]).sum(1)
            if opts.beta != 1.0:
                mix = opts.beta * mix + (1 - opts.beta) * (alpha.unsqueeze(-1) * Y[:, :n_act]).sum(1)
        Y, F = torch.roll(Y, -1, dims=1), torch.roll(F, -1, dims=1)
        Y[:, -1] = mix
        z_next = mix.reshape(z.shape).to(z.dtype)
        return z_next, {"Y": Y, "F": F, "k": k + 1}, {}
