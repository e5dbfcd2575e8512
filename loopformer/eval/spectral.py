"""Spectral radius of the loop step's Jacobian ``J = d step / dz`` at the (approximate) fixed point.

Power iteration with Jacobian-vector products (``torch.func.jvp``) or vector-Jacobian products
(``J^T`` has the same spectrum). arXiv 2606.18206 (Theorem 3): damping matters when eigenvalues
leave the unit circle. Re-exported by :mod:`loopformer.eval.analysis`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from loopformer.eval.evaluate import model_device
from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel


def spectral_radius(
    f: Callable[[Tensor], Tensor],
    z: Tensor,
    iters: int = 200,
    tol: float = 1e-6,
    method: str = "jvp",
    generator: torch.Generator | None = None,
    per_sample: bool = True,
) -> Tensor:
    """Spectral radius of ``J = df/dz`` at ``z`` by power iteration; [B] (per sample) or a scalar.

    ``f`` must act on each sample independently (true of a transformer step), so ``J`` is block
    diagonal and every sample is its own power iteration. ``method``: ``jvp`` iterates ``v <- J v``
    (``torch.func.jvp``), ``vjp`` iterates ``v <- J^T v`` (autograd; same spectrum). The estimate is
    the geometric mean of the growth ``||J v|| / ||v||`` over the second half of the iterations, which
    also converges when the dominant eigenvalues are a complex pair. Stops early once two successive
    windowed estimates agree to ``tol`` (relative).
    """
    if method not in ("jvp", "vjp"):
        raise ValueError(f"unknown method {method!r} (jvp | vjp)")
    z = z.detach()
    batch = z.shape[0] if per_sample else 1
    v = torch.randn(z.shape, generator=generator, dtype=z.dtype, device=z.device)

    def norms(x: Tensor) -> Tensor:
        flat = x.reshape(batch, -1)
        return flat.norm(dim=1).clamp_min(torch.finfo(x.dtype).tiny)

    def shape_b(n: Tensor) -> Tensor:
        return n.reshape(batch, *([1] * (z.dim() - (1 if per_sample else 0))))

    v = v / shape_b(norms(v))
    if method == "vjp":
        with torch.enable_grad():
            z_req = z.clone().requires_grad_(True)
            fz = f(z_req)

        def apply(u: Tensor) -> Tensor:
            (g,) = torch.autograd.grad(fz, z_req, u, retain_graph=True)
            return g
    else:

        def apply(u: Tensor) -> Tensor:
            return torch.func.jvp(f, (z,), (u,))[1]

    logs: list[Tensor] = []
    estimate = None
    for k in range(iters):
        w = apply(v).detach()
        g = norms(w)
        logs.append(g.log())
        v = w / shape_b(g)
        if k >= 9 and (k + 1) % 5 == 0:
            window = torch.stack(logs[len(logs) // 2 :])
            new = window.mean(0).exp()
            if estimate is not None and bool(
                ((new - estimate).abs() <= tol * estimate.abs().clamp_min(1e-12)).all()
            ):
                estimate = new
                break
            estimate = new
    if estimate is None:
        estimate = torch.stack(logs[len(logs) // 2 :]).mean(0).exp()
    return estimate if per_sample else estimate.reshape(())


@torch.no_grad()
def spectral_radius_at_fixed_point(
    model: LoopedModel,
    inputs: Tensor,
    loop: LoopConfig | None = None,
    puzzle_ids: Tensor | None = None,
    iters: int = 100,
    tol: float = 1e-4,
    method: str = "vjp",
    seed: int = 0,
) -> Tensor:
    """Run the model's loop to its final (approximately fixed) state, then the spectral radius of the
    step's Jacobian there, per sample [B]."""
    was_training = model.training
    model.eval()
    try:
        device = model_device(model)
        inputs = inputs.to(device)
        generator = torch.Generator(device=device).manual_seed(seed)
        ctx = tuple(c.detach() if isinstance(c, Tensor) else c for c in model.embed(inputs, puzzle_ids))
        z0 = model.init_state(ctx, generator)
        out = model(inputs, loop=loop, state=z0, puzzle_ids=puzzle_ids)
        z_star = out.state.detach()

        def f(z: Tensor) -> Tensor:
            return model.step(z, *ctx)

        return spectral_radius(f, z_star, iters=iters, tol=tol, method=method, generator=generator)
    finally:
        model.train(was_training)


def spectral_radius_summary(radii: Tensor) -> dict[str, float]:
    r = radii.detach().double().cpu().numpy()
    return {
        "mean": float(r.mean()),
        "median": float(np.median(r)),
        "max": float(r.max()),
        "fraction_below_1": float((r < 1).mean()),
    }
