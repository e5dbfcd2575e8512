"""``anderson_attractor``: the Attractor language model's Anderson solve as its authors' code returns it.

A solver plug-in (registered in ``loopformer.loop.SOLVERS`` on import) for github jacobfa/Attractor,
``attractor/models/attractor/solvers.py: anderson_solve``. Its iterates are the engine's ``anderson``
(type-II, a ring of the last m pairs, the first iterate ``f(y0)``; the options are the ``anderson``
table: ``anderson.m``, ``anderson.reg`` with ``anderson.reg_relative: false`` for the reference's
``lam`` added to the raw Gram matrix, ``anderson.beta``). What differs is the value a sample returns
when it stops: the reference returns ``f(x_k)`` of the last iterate it checked (``Fh[:, last_idx]``),
the engine's ``anderson`` the next mixed iterate. This solver returns ``f(z)`` on the step at which a
sample stops: the step cap, or the halting rule's test on this step's residual (``residual``:
``res < tol`` per sample; ``batch_residual``: every running sample (of its ``halt_group``) below tol, the
reference's ``rel.max() < tol`` over its micro-batch; both from ``min_steps`` on). With any other halting rule only the step cap
returns ``f(z)`` (the solver cannot know when such a rule stops). The implicit gradient modes then attach at ``f(x_k)``, as the reference's
``_attach_implicit_grad`` does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from loopformer.loop.config import NoOptions
from loopformer.loop.halting import group_all, halt_groups
from loopformer.loop.solvers import SOLVERS, Anderson, Info, State

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
