"""Gradient modes: how gradients flow back through the loop (one class each, in ``GRADS``).

The engine asks a mode four things (``GradMode``): from which iteration the forward records a
graph (``graph_from``), whether it watches the step inputs (``before_step``, for an exact
replay), what value a halting sample returns (``emit``) and how the final state is attached to
the graph (``finish``). Modes are chosen by ``cfg.grad`` only, never by ``module.training``.

- ``bptt``: every step records a graph (unrolled backpropagation).
- ``truncated``: the last k = ``grad_steps`` steps of each sample are differentiable. For a
  ``replayable`` solver (picard, damped) this is exact: with a rule that never stops early the
  last k steps simply run with gradient; otherwise the last k step inputs (and the solver's
  per-sample coefficients, damping eta) are kept in a (k+1)-slot ring buffer and the last k steps
  are replayed with gradient when the sample halts (FPRM's truncated BPTT = truncated Neumann
  series, arXiv 2505.18001); from z0 when k >= steps. Other solvers: k Picard steps from the
  detached solution, with the solver's value kept (straight-through).
- ``onestep`` / ``neumann`` / ``ift`` (implicit.py): the forward runs without gradient and one
  step is recomputed from the detached solution.
The returned state always carries a gradient path through ``step`` when one exists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from loopformer.loop.registry import NoOptions, Registry

if TYPE_CHECKING:
    from loopformer.loop.config import LoopConfig
    from loopformer.loop.halting import Halting
    from loopformer.loop.solvers import Solver


def select_rows(obj: Any, rows: Tensor) -> Any:
    """Index-select every batch-first tensor inside obj (tensors, lists, tuples, dicts, and objects
    with a ``select_rows(rows)`` method)."""
    if isinstance(obj, Tensor):
        return obj.index_select(0, rows) if obj.dim() > 0 else obj
    if isinstance(obj, list):
        return [select_rows(o, rows) for o in obj]
    if isinstance(obj, tuple):
        return tuple(select_rows(o, rows) for o in obj)
    if isinstance(obj, dict):
        return {k: select_rows(v, rows) for k, v in obj.items()}
    if hasattr(obj, "select_rows"):
        return obj.select_rows(rows)
    return obj


class GradMode:
    """Base class (forward without gradient, the state returned as it is).

    ``full_graph``: the whole forward records a graph (halting rules with learned weights,
    e.g. ACT, need it). ``records``: set by ``start`` when ``before_step`` must see every step.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    full_graph: ClassVar[bool] = False

    def __init__(self, cfg: LoopConfig, solver: Solver, halting: Halting) -> None:
        self.cfg = cfg
        self.opts = cfg.options_for(type(self))
        self.solver = solver
        self.halting = halting
        self.records = False

    @classmethod
    def check_config(cls, cfg: LoopConfig) -> None:
        """Raise ValueError when ``cfg`` combines this mode with something it cannot do."""

    def graph_from(self) -> int:
        """The first iteration whose forward records a graph (> max_steps: none does)."""
        return self.cfg.max_steps + 1

    def start(self, step: Callable[..., Tensor], z0: Tensor, ctx: tuple[Any, ...], grad_on: bool) -> None:
        """Called once before the first iteration."""

    def before_step(self, t: int, idx: Tensor, z: Tensor, solver_state: dict[str, Any]) -> None:
        """Called before iteration t with the active rows (only when ``self.records``)."""

    def emit(self, rows: Tensor, value: Tensor, n: int) -> Tensor:
        """The value returned for halting samples ``rows`` (full-batch indices) after n steps."""
        return value

    def finish(
        self, step: Callable[..., Tensor], state: Tensor, ctx: tuple[Any, ...]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Attach the assembled final state to the graph (only called with gradients enabled);
        returns it and per-sample stats of the mode."""
        return state, {}


GRADS: Registry[type[GradMode]] = Registry("grad", GradMode)


@GRADS.register
class BPTT(GradMode):
    name = "bptt"
    full_graph = True

    def graph_from(self) -> int:
        return 0


class _Ring:
    """The last k+1 step inputs (and solver coefficients) in full-batch coordinates, no gradient."""

    def __init__(self, size: int, z0: Tensor) -> None:
        self.size = size
        self.z = torch.empty((size, *z0.shape), dtype=z0.dtype, device=z0.device)
        self.coeff: Tensor | None = None

    @torch.no_grad()
    def write(self, t: int, idx: Tensor, z: Tensor, coeff: Tensor | None) -> None:
        self.z[t % self.size].index_copy_(0, idx, z.detach())
        if coeff is not None:
            if self.coeff is None:
                self.coeff = torch.empty((self.size, self.z.shape[1]), dtype=coeff.dtype, device=coeff.device)
            self.coeff[t % self.size].index_copy_(0, idx, coeff)


@GRADS.register
class Truncated(GradMode):
    """Differentiable last k steps: exact replay for replayable solvers, else straight-through."""

    name = "truncated"

    def __init__(self, cfg: LoopConfig, solver: Solver, halting: Halting) -> None:
        super().__init__(cfg, solver, halting)
        self.k = cfg.grad_steps
        self.exact = solver.replayable
        self.direct = self.exact and not halting.stops_early  # the last k steps are known in advance
        self.ring: _Ring | None = None

    @classmethod
    def check_config(cls, cfg: LoopConfig) -> None:
        if cfg.grad_steps < 1:
            raise ValueError("LoopConfig.grad='truncated' needs grad_steps >= 1 (differentiable final steps)")

    def graph_from(self) -> int:
        return self.cfg.max_steps - self.k if self.direct else self.cfg.max_steps + 1

    def start(self, step, z0, ctx, grad_on) -> None:
        self.step, self.z0, self.ctx = step, z0, ctx
        if self.exact and not self.direct and grad_on:
            self.ring = _Ring(self.k + 1, z0)
            self.records = True

    def before_step(self, t, idx, z, solver_state) -> None:
        self.ring.write(t, idx, z, self.solver.replay_coeff(solver_state))

    def emit(self, rows: Tensor, value: Tensor, n: int) -> Tensor:
        return value if self.ring is None else self._replay(rows, n)

    def _replay(self, rows: Tensor, n: int) -> Tensor:
        """Recompute the last min(k, n) of n steps for these rows with gradient (bit-identical)."""
        ring, s = self.ring, max(0, n - self.k)
        with torch.enable_grad():
            z = self.z0.index_select(0, rows) if s == 0 else ring.z[s % ring.size].index_select(0, rows)
            c = select_rows(self.ctx, rows)
            for j in range(s, n):
                coeff = None if ring.coeff is None else ring.coeff[j % ring.size].index_select(0, rows)
                z = self.solver.replay_step(z, self.step(z, *c), coeff)
        return z

    def finish(self, step, state, ctx):
        if self.exact:
            return state, {}
        p = state.detach()
        for _ in range(self.k):
            p = step(p, *ctx)
        return p + (state.detach() - p).detach(), {}


from loopformer.loop.implicit import IFT, IFTOptions, Neumann, NeumannOptions, OneStep  # noqa: E402

__all__ = [
    "BPTT",
    "GRADS",
    "IFT",
    "GradMode",
    "IFTOptions",
    "Neumann",
    "NeumannOptions",
    "OneStep",
    "Truncated",
    "select_rows",
]
