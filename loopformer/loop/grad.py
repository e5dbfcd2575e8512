"""Gradient modes for the implicit family: onestep, neumann(k), ift (Attractor, SYSTEMS.md section 2).

The forward solve runs without gradient. One step ``fz = f(z*)`` is then recomputed with
gradient from the detached fixed point (a leaf ``zl``), and ``_ImplicitGrad`` returns the
solver's value z* while replacing the incoming gradient v by an adjoint u before it flows back
through that one step into f's parameters and context:

- ``onestep``: ``u = v`` (Jacobian-free; TRM / phantom one-step gradient); equals neumann with k = 0.
- ``neumann``: ``u = sum_{j=0..k} (J^T)^j v`` by vector-Jacobian products on the recomputed step;
  with ``neumann_clip`` each term is clipped to ``clip * ||v||`` per sample (Attractor's "onestep"
  is k = 1 with clipping).
- ``ift``: solve ``u = v + J^T u`` to ``ift_tol`` (relative change, max over the batch) by Picard
  or Anderson, the implicit function theorem gradient ``(I - J^T)^{-1} v``.

This is the robust form LESSONS.md asks for: an autograd.Function over one recomputed step (no
gradient hooks), memory of one loop regardless of the forward iteration count.
``bptt`` and ``truncated`` live in the engine (unrolled steps, replayed last k steps).
"""

from __future__ import annotations

import torch
from torch import Tensor

from loopformer.loop.config import LoopConfig
from loopformer.loop.solvers import anderson_weights


def _per_sample_norm(x: Tensor) -> Tensor:
    return torch.linalg.vector_norm(x.reshape(x.shape[0], -1), dim=1)


def adjoint(v: Tensor, vjp, cfg: LoopConfig) -> Tensor:
    """The adjoint u for incoming gradient v; ``vjp(w) = J^T w`` at the fixed point."""
    if cfg.grad == "onestep":
        return v
    if cfg.grad == "neumann":
        u, w = v, v
        vnorm = _per_sample_norm(v)
        for _ in range(cfg.grad_steps):
            w = vjp(w)
            if cfg.neumann_clip is not None:
                limit = cfg.neumann_clip * vnorm
                scale = (limit / _per_sample_norm(w).clamp_min(torch.finfo(w.dtype).tiny)).clamp(max=1.0)
                w = w * scale.view(-1, *([1] * (w.dim() - 1)))
            u = u + w
        return u
    if cfg.grad == "ift":
        return _ift_solve(v, vjp, cfg)
    raise ValueError(f"grad={cfg.grad!r} is not an implicit gradient mode")


def _ift_solve(v: Tensor, vjp, cfg: LoopConfig) -> Tensor:
    """Solve u = v + J^T u (Picard or Anderson on the flattened per-sample vectors)."""
    b = v.shape[0]
    u = v
    xs: list[Tensor] = []
    gs: list[Tensor] = []
    for _ in range(cfg.ift_max_steps):
        gu = v + vjp(u)
        change = (_per_sample_norm(gu - u) / (_per_sample_norm(gu) + 1e-30)).max()
        if cfg.ift_solver == "picard":
            u_next = gu
        else:
            xs = [*xs, u][-cfg.anderson_m:]
            gs = [*gs, gu][-cfg.anderson_m:]
            if len(xs) == 1:
                u_next = gu
            else:
                x_st, f_st = torch.stack(xs, 1), torch.stack(gs, 1)
                dtype = torch.promote_types(v.dtype, torch.float32)
                alpha = anderson_weights((f_st - x_st).reshape(b, len(xs), -1).to(dtype), cfg.anderson_reg)
                u_next = (alpha.to(v.dtype).view(b, len(xs), *([1] * (v.dim() - 1))) * f_st).sum(1)
        if not torch.isfinite(change) or change < cfg.ift_tol:
            return gu if torch.isfinite(change) else u
        u = u_next
    return u


class _ImplicitGrad(torch.autograd.Function):
    """Value: the solver's z*. Gradient: adjoint u pushed into the recomputed step fz = f(zl)."""

    @staticmethod
    def forward(ctx, fz: Tensor, z_star: Tensor, zl: Tensor, cfg: LoopConfig) -> Tensor:  # type: ignore[override]
        ctx.fz, ctx.zl, ctx.cfg = fz, zl, cfg
        return z_star.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, v: Tensor):  # type: ignore[override]
        fz, zl, cfg = ctx.fz, ctx.zl, ctx.cfg

        def vjp(w: Tensor) -> Tensor:
            (g,) = torch.autograd.grad(fz, zl, w, retain_graph=True, allow_unused=True)
            return torch.zeros_like(w) if g is None else g

        u = adjoint(v, vjp, cfg)
        return u, None, None, None


def implicit_attach(step, z_star: Tensor, ctx: tuple, cfg: LoopConfig) -> Tensor:
    """Return z* (value) whose gradient flows through one recomputed step by cfg.grad's adjoint."""
    needs_vjp = cfg.grad == "ift" or (cfg.grad == "neumann" and cfg.grad_steps > 0)
    zl = z_star.detach().requires_grad_(needs_vjp)
    fz = step(zl, *ctx)
    if not fz.requires_grad:
        return z_star.detach()  # nothing in step needs a gradient
    return _ImplicitGrad.apply(fz, z_star.detach(), zl, cfg)
