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
- ``onestep`` / ``neumann`` / ``ift``: the implicit modes (Attractor; DEQ, arXiv 1909.01377). The forward
  solve runs without gradient. One step ``fz = f(z*)`` is then recomputed with gradient from the detached
  fixed point (a leaf ``zl``), and ``_ImplicitGrad`` returns the solver's value z* while replacing the
  incoming gradient v by an adjoint u before it flows back through that one step into f's parameters and
  context:

  - ``onestep``: ``u = v`` (Jacobian-free; TRM / phantom one-step gradient); equals neumann with k = 0.
  - ``neumann``: ``u = sum_{j=0..k} (J^T)^j v`` by vector-Jacobian products on the recomputed step;
    with ``neumann.clip`` each term is clipped to ``clip * ||v||`` per sample (Attractor's
    "onestep" is k = 1 with clipping).
  - ``ift``: solve ``u = v + J^T u`` to ``ift.tol`` (relative change, per sample) with one
    of the forward solvers (``ift.solver``, any solver with ``adjoint_ok``; its options are the
    forward's, e.g. the ``anderson`` table), the implicit function theorem gradient ``(I - J^T)^{-1} v``.

  An autograd.Function over one recomputed step (no gradient hooks): memory of one loop regardless
  of the forward iteration count.
The returned state always carries a gradient path through ``step`` when one exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import Tensor

from loopformer.loop.config import LoopConfig, NoOptions, Registry, option_error
from loopformer.loop.solvers import SOLVERS, Solver

if TYPE_CHECKING:
    from loopformer.loop.halting import Halting

Vjp = Callable[[Tensor], Tensor]


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



# --------------------------------------------------------------------------------------------
# Implicit gradients: onestep, neumann(k), ift
# --------------------------------------------------------------------------------------------
def _bcast(mask: Tensor, like: Tensor) -> Tensor:
    return mask.view(-1, *([1] * (like.dim() - 1)))


def _per_sample_norm(x: Tensor) -> Tensor:
    return torch.linalg.vector_norm(x.reshape(x.shape[0], -1), dim=1)


class ImplicitGradMode(GradMode):
    """Base of the implicit modes: ``adjoint(v, vjp)`` turns the incoming gradient into u."""

    needs_vjp: ClassVar[bool] = True

    def adjoint(self, v: Tensor, vjp: Vjp) -> Tensor:
        raise NotImplementedError

    def finish(self, step, state, ctx):
        return implicit_attach(step, state, ctx, self), {}


@GRADS.register
class OneStep(ImplicitGradMode):
    name = "onestep"
    needs_vjp = False

    def adjoint(self, v: Tensor, vjp: Vjp) -> Tensor:
        return v


@dataclass(frozen=True)
class NeumannOptions:
    """Clip each J^T term to ``clip * ||v||`` per sample (None: no clipping)."""

    clip: float | None = None

    def __post_init__(self) -> None:
        if self.clip is not None and not self.clip > 0:
            raise option_error("neumann", "clip", f"must be > 0, got {self.clip!r}")


@GRADS.register
class Neumann(ImplicitGradMode):
    """u = sum_{j<=k} (J^T)^j v with k = grad_steps."""

    name = "neumann"
    Options = NeumannOptions

    def __init__(self, cfg, solver, halting) -> None:
        super().__init__(cfg, solver, halting)
        self.needs_vjp = cfg.grad_steps > 0

    def adjoint(self, v: Tensor, vjp: Vjp) -> Tensor:
        u, w = v, v
        vnorm = _per_sample_norm(v)
        clip = self.opts.clip
        for _ in range(self.cfg.grad_steps):
            w = vjp(w)
            if clip is not None:
                limit = clip * vnorm
                scale = (limit / _per_sample_norm(w).clamp_min(torch.finfo(w.dtype).tiny)).clamp(max=1.0)
                w = w * scale.view(-1, *([1] * (w.dim() - 1)))
            u = u + w
        return u


# ``ift.tol: auto``: the backward's tolerance by the dtype it runs in. float32 cannot resolve a relative change
# of 1e-9 (its epsilon is 1.2e-7), so a fixed 1e-9 ran every float32 backward to its cap (200 vector-Jacobian
# products, 17.5x the truncated gradient's training step on sudoku4 FPRM). ``python -m benchmarks --only ift``
# (benchmarks/bench_ift.py) measures each tolerance's float32 gradient error on a trained sudoku4 FPRM and on a
# linear map with spectral radius 0.99 (error ~ tol / (1 - rho)); 1e-5 is the loosest within 1e-3 on both (a
# bf16 step rounds at 2^-8 = 3.9e-3; 1e-4 gives 6e-3 on the linear map). float64 keeps 1e-9 (a 1e-6 gradient
# error on tests/test_loop_quasi_newton.py's linear problems). 16-bit adjoints (a bf16 state) are not measured:
# 1e-2, about their rounding.
AUTO_TOL = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@dataclass(frozen=True)
class IFTOptions:
    """The backward solve of u = v + J^T u: solver (a registered ``adjoint_ok`` solver; its options
    are the forward's, e.g. the ``safe_anderson`` table), per-sample tolerance on the relative
    change ||g(u) - u|| / ||g(u)|| (a number, or ``auto``: ``AUTO_TOL`` by the gradient's dtype) and
    iteration cap."""

    solver: str = "safe_anderson"
    tol: float | Literal["auto"] = "auto"
    max_steps: int = 200

    def __post_init__(self) -> None:
        allowed = SOLVERS.select(lambda c: c.adjoint_ok)
        if self.solver not in allowed:
            choices = ", ".join(map(repr, allowed))
            raise option_error("ift", "solver", f"={self.solver!r} is not one of {choices}")
        if self.tol != "auto" and (
            isinstance(self.tol, bool) or not isinstance(self.tol, (int, float)) or not self.tol > 0
        ):
            raise option_error("ift", "tol", f"must be a number > 0 or 'auto', got {self.tol!r}")
        if not isinstance(self.max_steps, int) or isinstance(self.max_steps, bool) or self.max_steps < 1:
            raise option_error("ift", "max_steps", f"must be an integer >= 1, got {self.max_steps!r}")

    def tolerance(self, dtype: torch.dtype) -> float:
        """The tolerance the backward uses for gradients of ``dtype``: ``tol``, or ``AUTO_TOL[dtype]``."""
        if self.tol != "auto":
            return float(self.tol)
        return AUTO_TOL.get(dtype, AUTO_TOL[torch.float32])


@GRADS.register
class IFT(ImplicitGradMode):
    """The implicit function theorem gradient, solved per sample by a forward solver class.

    Reports per sample, once the backward ran: ``LoopResult.stats["ift_steps"]`` (vector-Jacobian
    products until the sample's relative change fell below ``ift.tolerance(dtype)``; ``ift.max_steps`` when it
    did not), ``stats["ift_residual"]`` (its last relative change) and ``stats["ift_capped"]`` (the cap
    stopped it). The trainer logs the first two with the step's metrics and warns about the third.
    """

    name = "ift"
    Options = IFTOptions

    def finish(self, step, state, ctx):
        b, device = state.shape[0], state.device
        self.steps = torch.zeros(b, dtype=torch.long, device=device)
        self.residual = torch.full((b,), float("nan"), dtype=torch.float64, device=device)
        self.capped = torch.zeros(b, dtype=torch.bool, device=device)
        return implicit_attach(step, state, ctx, self), {
            "ift_steps": self.steps,
            "ift_residual": self.residual,
            "ift_capped": self.capped,
        }

    def adjoint(self, v: Tensor, vjp: Vjp) -> Tensor:
        """Solve u = v + J^T u; converged samples keep their answer and leave the solver's batch."""
        opts = self.opts
        solver = SOLVERS.get(opts.solver)(self.cfg)
        solver.report_stalls = False
        tol = opts.tolerance(v.dtype)
        u, active = v, torch.arange(v.shape[0], device=v.device)
        state = solver.init(v)
        for it in range(opts.max_steps):
            gu = v + vjp(u)
            gu_a, u_a = gu.index_select(0, active), u.index_select(0, active)
            change = _per_sample_norm(gu_a - u_a) / (_per_sample_norm(gu_a) + 1e-30)
            self.residual.index_copy_(0, active, change.to(self.residual.dtype))
            finite = torch.isfinite(change)
            done = (change < tol) | ~finite
            u_next, state, _ = solver.update(u_a, gu_a, change, state)
            # a converged sample takes one more application of the map (gu); a broken one keeps u
            u_next = torch.where(
                _bcast(done & finite, u_a), gu_a, torch.where(_bcast(finite, u_a), u_next, u_a)
            )
            u = u.index_copy(0, active, u_next)
            self.steps.index_fill_(0, active, it + 1)
            if bool(done.all()):
                break
            if bool(done.any()):
                keep = (~done).nonzero().squeeze(1)
                active, state = active.index_select(0, keep), select_rows(state, keep)
        else:  # the cap stopped the samples still running (the trainer warns: loopformer.train.step_metrics)
            self.capped.index_fill_(0, active, True)
        return u


class _ImplicitGrad(torch.autograd.Function):
    """Value: the solver's z*. Gradient: adjoint u pushed into the recomputed step fz = f(zl)."""

    @staticmethod
    def forward(ctx, fz: Tensor, z_star: Tensor, zl: Tensor, mode: ImplicitGradMode) -> Tensor:  # type: ignore[override]
        ctx.fz, ctx.zl, ctx.mode = fz, zl, mode
        return z_star.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, v: Tensor):  # type: ignore[override]
        fz, zl, mode = ctx.fz, ctx.zl, ctx.mode

        def vjp(w: Tensor) -> Tensor:
            (g,) = torch.autograd.grad(fz, zl, w, retain_graph=True, allow_unused=True)
            return torch.zeros_like(w) if g is None else g

        return mode.adjoint(v, vjp), None, None, None


def implicit_attach(
    step: Callable[..., Tensor], z_star: Tensor, ctx: tuple[Any, ...], mode: ImplicitGradMode
) -> Tensor:
    """Return z* (value) whose gradient flows through one recomputed step by the mode's adjoint."""
    zl = z_star.detach().requires_grad_(mode.needs_vjp)
    fz = step(zl, *ctx)
    if not fz.requires_grad:
        return z_star.detach()  # nothing in step needs a gradient
    return _ImplicitGrad.apply(fz, z_star.detach(), zl, mode)
