"""Per-sample residual and state norms used for halting and the loop trace.

- ``rel_l2``: ``||f(z) - z|| / (||f(z)|| + 1e-8)`` over all non-batch dims (DEQ; Attractor,
  arXiv 2605.12466).
- ``rel_sup``: FPRM's relative sup norm (arXiv 2606.18206, Algorithm 1):
  ``max over tokens t of ||z_t - f(z)_t||_inf / (||f(z)_t||_inf + 1e-8)``; channels are the last
  dim, tokens every dim between batch and channels.
The engine also records ||f(z)||_2 per sample (the state's RMS once divided by sqrt(D), logged every step:
how looped runs are debugged). All are computed without gradient: they only drive halting decisions and
logging. ``residual_into`` is the engine's per-iteration form: flat, already detached inputs, results written
into preallocated history rows (``out=``), no decorator or dtype casts (small maps are dominated by
per-op overhead: benchmarks/notes.md). ``residual_lowp_into`` is the same residual computed in the
state's own low precision (``LoopConfig.state_dtype="bfloat16"``), as the FPRM reference does
(``FixedPointOptimizer.step``: ``(y - f(y)).norm(inf) / (f(y).norm(inf) + eps)`` on bf16 tensors).
"""

from __future__ import annotations

import torch
from torch import Tensor

EPS = 1e-8
RESIDUAL_NORMS = ("rel_l2", "rel_sup")


def residual_into(
    zf: Tensor, fzf: Tensor, kind: str, channels: int, res_out: Tensor, norm_out: Tensor | None = None
) -> Tensor:
    """Write the residual of flat detached [B, D] states into ``res_out`` [B]; return ||f(z)||_2 [B].

    The residual in at least float32 (the caller casts), the RMS as ``||f(z)|| / sqrt(D)``, which the engine
    divides once for the whole history; ``channels`` is the state's last dim (rel_sup's tokens are
    the rest); ``norm_out`` optionally receives ``||f(z)||_2``. The caller guarantees that no
    gradient is recorded (detached inputs) and that ``zf`` / ``fzf`` already have the result dtype.
    """
    vector_norm = torch.linalg.vector_norm
    fz_norm = vector_norm(fzf, dim=1) if norm_out is None else vector_norm(fzf, dim=1, out=norm_out)
    if kind == "rel_l2":
        torch.div(vector_norm(fzf - zf, dim=1), fz_norm + EPS, out=res_out)
    elif kind == "rel_sup":
        b = zf.shape[0]
        num = (fzf - zf).reshape(b, -1, channels).abs().amax(dim=2)
        den = fzf.reshape(b, -1, channels).abs().amax(dim=2) + EPS
        torch.amax(num / den, dim=1, out=res_out)
    else:
        raise ValueError(f"unknown residual norm {kind!r} (use 'rel_l2' or 'rel_sup')")
    return fz_norm


def residual_lowp_into(
    zf: Tensor, fzf: Tensor, kind: str, channels: int, res_out: Tensor, norm_out: Tensor | None = None
) -> Tensor:
    """``residual_into`` for flat detached low-precision states: the difference, the norms and the
    ratio are rounded in the states' dtype (bf16 arithmetic) and the result is written into the
    float32 history row ``res_out``; ``||f(z)||_2`` (logging only) is computed in float32."""
    fz_norm = torch.linalg.vector_norm(fzf.float(), dim=1)
    if norm_out is not None:
        norm_out.copy_(fz_norm)
    b = zf.shape[0]
    if kind == "rel_l2":
        res = torch.linalg.vector_norm(zf - fzf, dim=1) / (torch.linalg.vector_norm(fzf, dim=1) + EPS)
    elif kind == "rel_sup":
        num = (zf - fzf).reshape(b, -1, channels).abs().amax(dim=2)
        den = fzf.reshape(b, -1, channels).abs().amax(dim=2) + EPS
        res = (num / den).amax(dim=1)
    else:
        raise ValueError(f"unknown residual norm {kind!r} (use 'rel_l2' or 'rel_sup')")
    res_out.copy_(res)
    return fz_norm
