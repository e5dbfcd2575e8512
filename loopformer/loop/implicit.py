"""Implicit gradient modes: onestep, neumann(k), ift (Attractor; DEQ, arXiv 1909.01377).

The forward solve runs without gradient. One step ``fz = f(z*)`` is then recomputed with
gradient from the detached fixed point (a leaf ``zl``), and ``_ImplicitGrad`` returns the
solver's value z* while replacing the incoming gradient v by an adjoint u before it flows back
through that one step into f's parameters and context:

- ``onestep``: ``u = v`` (Jacobian-free; TRM / phantom one-step gradient); equals neumann with k = 0.
- ``neumann``: ``u = sum_{j=0..k} (J^T)^j v`` by vector-Jacobian products on the recomputed step;
  with ``neumann.clip`` each term is clipped to ``clip * ||v||`` per sample (Attractor's
  "onestep" is k = 1 with clipping).
- ``ift``: solve ``u = v + J^T u`` to ``ift.tol`` (relative change, per sample) with one
  of the forward solvers (``ift.solver``, any solver with ``adjoint_ok``; its options are the
  forward's, e.g. ``cfg.anderson``), the implicit function theorem gradient ``(I - J^T)^{-1} v``.

An autograd.Function over one recomputed step (no gradient hooks): memory of one loop regardless
of the forward iteration count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from loopformer.loop.grad import GRADS, GradMode, select_rows
from loopformer.loop.solvers import SOLVERS, option_error

Vjp = Callable[[Tensor], Tensor]


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
    legacy_names: ClassVar[dict[str, str]] = {"clip": "neumann_clip"}

    def __post_init__(self) -> None:
        if self.clip is not None and not self.clip > 0:
            raise option_error("neumann", "clip", self.legacy_names, f"must be > 0, got {self.clip!r}")


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
    are the forward's group, e.g. ``cfg.safe_anderson``), per-sample tolerance on the relative
    change ||g(u) - u|| / ||g(u)|| (a number, or ``auto``: ``AUTO_TOL`` by the gradient's dtype) and
    iteration cap."""

    solver: str = "safe_anderson"
    tol: float | Literal["auto"] = "auto"
    max_steps: int = 200
    legacy_names: ClassVar[dict[str, str]] = {
        "solver": "ift_solver",
        "tol": "ift_tol",
        "max_steps": "ift_max_steps",
    }

    def __post_init__(self) -> None:
        allowed = SOLVERS.select(lambda c: c.adjoint_ok)
        if self.solver not in allowed:
            raise option_error(
                "ift",
                "solver",
                self.legacy_names,
                f"={self.solver!r} is not one of {', '.join(map(repr, allowed))}",
            )
        if self.tol != "auto" and (
            isinstance(self.tol, bool) or not isinstance(self.tol, (int, float)) or not self.tol > 0
        ):
            raise option_error("ift", "tol", self.legacy_names, f"must be a number > 0 or 'auto', got {self.tol!r}")
        if not isinstance(self.max_steps, int) or isinstance(self.max_steps, bool) or self.max_steps < 1:
            raise option_error(
                "ift", "max_steps", self.legacy_names, f"must be an integer >= 1, got {self.max_steps!r}"
            )

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
