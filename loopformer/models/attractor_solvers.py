"""The Attractor paper's two Anderson solves as its authors' code computes them: solver plug-ins (registered in
``loopformer.loop.SOLVERS`` on import, by ``loopformer.models``) that differ from the engine's ``anderson``.

**``anderson_attractor``** (the language model): github jacobfa/Attractor,
``attractor/models/attractor/solvers.py: anderson_solve``. Its iterates are the engine's ``anderson``
(type-II, a ring of the last m pairs, the first iterate ``f(y0)``; the options are the ``anderson``
group: ``anderson.m``, ``anderson.reg`` with ``anderson.reg_relative: false`` for the reference's
``lam`` added to the raw Gram matrix, ``anderson.beta``). What differs is the value a sample returns
when it stops: the reference returns ``f(x_k)`` of the last iterate it checked (``Fh[:, last_idx]``),
the engine's ``anderson`` the next mixed iterate. This solver returns ``f(z)`` on the step at which a
sample stops: the step cap, or the halting rule's test on this step's residual (``residual``:
``res < tol`` per sample; ``batch_residual``: every running sample (of its ``halt_group``) below tol, the
reference's ``rel.max() < tol`` over its micro-batch; both from ``min_steps`` on). With any other halting rule only the step cap
returns ``f(z)`` (the solver cannot know when such a rule stops). The implicit gradient modes then attach at ``f(x_k)``, as the reference's
``_attach_implicit_grad`` does.

**``anderson_trmdeq``** (the puzzle model, TRM-DEQ): github jacobfa/Attractor,
``experiments/attractor_puzzles/trm/trm_deq.py: _anderson_solve``, which the paper's Sudoku-Extreme /
Maze-Hard runs used. It differs from the engine's ``anderson`` in its history:
the m-slot buffers start as ``[y0, f(y0), 0, ...]`` / ``[f(y0), f(f(y0)), 0, ...]``, every step rolls
them by one slot and writes the new iterate into the last slot, and the mixing reads the *first*
``min(k, m)`` slots. For k = 3..m+1 those include slots that were never written (zeros): their
residual is 0, so the regularised least-squares weights concentrate on them and the next iterate is
close to 0. From k = m + 2 on the buffer holds real iterates again. The regulariser ``reg`` (1e-4) is
added to the raw Gram matrix. The engine's ``anderson`` keeps the true last m iterates; with at most
3 map evaluations (``deq_max_iter`` 3) both give the same iterates.

The weights solve the reference's bordered system ``[[0, 1^T], [1, G G^T + reg I]] [_, a] = e_0``
(``torch.linalg.solve``). When LU finds that system singular for any sample of the batch, the reference's
``except RuntimeError: break`` ends the whole solve and returns its last slot (the current iterate; zeros
if it happens at the first mix, before any roll); in float32 (the
reference's solver precision, also under bf16 training) this happens within the zero-slot steps: on the
head-to-head benchmark's model, at random initialisation, every solve of ``deq_max_iter`` 8 stopped after
5 or 6 map evaluations. Here the same check reports every sample as stalled (``can_stall``): the engine
stops the solve and keeps that slot.

Per-sample state: ``Y``, ``F`` [B, m, n] (in at least float32) and the step counter ``k`` (a plain
int, the same for every sample: the reference solves the batch in lock step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from loopformer.loop.config import NoOptions, option_error
from loopformer.loop.halting import group_all, halt_groups
from loopformer.loop.solvers import SOLVERS, Anderson, Info, Solver, State, exact

RESIDUAL_RULES = ("residual", "batch_residual")


@SOLVERS.register(replace=True)
class AttractorAnderson(Anderson):
    """The engine's Anderson, returning ``f(z)`` on the step a sample stops (see the module docstring)."""

    name = "anderson_attractor"
    Options = NoOptions  # it reads the anderson table (LoopConfig.options_for("anderson"))
    needs_residual = True  # the stopping test reads this step's residual
    adjoint_ok = False

    def __init__(self, cfg: Any, options: Any = None) -> None:
        super().__init__(cfg, cfg.options_for("anderson") if options is None else options)
        self.needs_residual = True

    def init(self, z: Tensor) -> State:
        groups = halt_groups(z.shape[0], self.cfg.halt_group, z.device)
        return {"k": 0, "t": 0} if groups is None else {"k": 0, "t": 0, "group": groups}

    def _stops(
        self, res: Tensor | None, t: int, b: int, device: torch.device, groups: Tensor | None
    ) -> Tensor:
        cfg = self.cfg
        if t + 1 >= cfg.max_steps:
            return torch.ones(b, dtype=torch.bool, device=device)
        if cfg.halting not in RESIDUAL_RULES or res is None or t + 1 < cfg.min_steps:
            return torch.zeros(b, dtype=torch.bool, device=device)
        below = res < cfg.tol
        return below if cfg.halting == "residual" else group_all(below, groups)

    def update(self, z: Tensor, fz: Tensor, res: Tensor | None, state: State) -> tuple[Tensor, State, Info]:
        t = state["t"]
        mixed, state, info = super().update(z, fz, res, state)
        state = {**state, "t": t + 1}
        stop = self._stops(res, t, z.shape[0], z.device, state.get("group"))
        # unconditional (no host read to ask whether any sample stops): rows not stopping keep the mix
        mixed = torch.where(stop.view(-1, *([1] * (z.dim() - 1))), fz.to(mixed.dtype), mixed)
        return mixed, state, info


@dataclass(frozen=True)
class TRMDEQAndersonOptions:
    m: int = 5
    reg: float = 1e-4
    beta: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.m, int) or isinstance(self.m, bool) or self.m < 2:
            raise option_error("anderson_trmdeq", "m", f"must be an integer >= 2, got {self.m!r}")
        if not self.reg > 0 or not self.beta > 0:
            raise option_error(
                "anderson_trmdeq", "reg/beta", f"must be > 0, got {self.reg!r}, {self.beta!r}"
            )


@SOLVERS.register(replace=True)
class TRMDEQAnderson(Solver):
    """The reference's rolled-buffer Anderson (see the module docstring)."""

    name = "anderson_trmdeq"
    Options = TRMDEQAndersonOptions
    can_stall = True  # a singular mixing system ends the solve for the batch (the reference's ``break``)

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
            return fz, {"Y": Y, "F": F, "k": 1}, self._no_stall(b, z)
        F[:, 1 if k == 1 else -1] = ff  # f of the previous step's new iterate
        n_act = min(k + 1, opts.m)
        with torch.no_grad(), exact(Y):  # outside autocast: the buffers' own dtype (no bf16 LU)
            g = F[:, :n_act] - Y[:, :n_act]
            alpha, singular = bordered_weights(torch.bmm(g, g.transpose(1, 2)), opts.reg)
            mix = (alpha.unsqueeze(-1) * F[:, :n_act]).sum(1)
            if opts.beta != 1.0:
                mix = opts.beta * mix + (1 - opts.beta) * (alpha.unsqueeze(-1) * Y[:, :n_act]).sum(1)
            # a singular system ends the solve for the whole batch (the reference: ``except RuntimeError:
            # break``), decided on the device: the batch then returns its last slot (the current iterate,
            # or 0 before the first roll) and keeps its buffers
            broken = singular.any()
            last = Y[:, -1].clone()
            Y_next, F_next = torch.roll(Y, -1, dims=1), torch.roll(F, -1, dims=1)
            Y_next[:, -1] = mix
            Y, F = torch.where(broken, Y, Y_next), torch.where(broken, F, F_next)
            z_next = torch.where(broken, last, mix).reshape(z.shape).to(z.dtype)
        info = {"stalled": broken.expand(b).clone()} if self.report_stalls else {}
        return z_next, {"Y": Y, "F": F, "k": k + 1}, info

    def _no_stall(self, b: int, z: Tensor) -> Info:
        return {"stalled": torch.zeros(b, dtype=torch.bool, device=z.device)} if self.report_stalls else {}


def bordered_weights(gram: Tensor, reg: float) -> tuple[Tensor, Tensor]:
    """Anderson weights [B, n] from ``[[0, 1^T], [1, gram + reg I]] x = e_0`` (x = [lambda, a]), and
    [B] whether LU found the system singular (``torch.linalg.solve_ex`` info > 0)."""
    b, n = gram.shape[0], gram.shape[-1]
    h = gram.new_zeros(b, n + 1, n + 1)
    h[:, 0, 1:] = 1.0
    h[:, 1:, 0] = 1.0
    h[:, 1:, 1:] = gram + reg * torch.eye(n, dtype=gram.dtype, device=gram.device)
    rhs = gram.new_zeros(b, n + 1, 1)
    rhs[:, 0] = 1.0
    x, info = torch.linalg.solve_ex(h, rhs)
    return x[:, 1:, 0], info > 0
