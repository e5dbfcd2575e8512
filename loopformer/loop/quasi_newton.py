"""Quasi-Newton solvers: Anderson acceleration and limited-memory Broyden (see solvers.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from loopformer.loop.solvers import SOLVERS, Info, Solver, State, option_error


def anderson_weights(g: Tensor, reg: float, relative: bool = True) -> Tensor:
    """Per-sample type-II Anderson mixing weights a [B, n] (sum to 1) from residuals g [B, n, D].

    ``relative=False`` adds ``reg`` to the raw Gram matrix (TorchDEQ's absolute regulariser; kept
    only to measure how it stalls at tight tolerances).
    """
    if g.dtype in (torch.bfloat16, torch.float16):
        g = g.float()
    with torch.autocast(g.device.type, enabled=False):  # bf16 autocast: the Gram matrix in float32
        gram = torch.bmm(g, g.transpose(1, 2))
    return gram_weights(gram, reg, relative)


def gram_weights(gram: Tensor, reg: float, relative: bool = True) -> Tensor:
    """Anderson weights a [B, n] from the Gram matrix [B, n, n] of the residuals."""
    if gram.dtype in (torch.bfloat16, torch.float16):  # under bf16 autocast: solve in float32 (no bf16 LU)
        gram = gram.float()
    n = gram.shape[-1]
    if relative:
        scale = gram.diagonal(dim1=1, dim2=2).sum(-1) / n
        scale = scale.clamp_min(torch.finfo(gram.dtype).tiny)
        gram = gram / scale.view(-1, 1, 1)
    eye = torch.eye(n, dtype=gram.dtype, device=gram.device)
    finite = torch.isfinite(gram).flatten(1).all(dim=1)
    gram = torch.where(finite.view(-1, 1, 1), gram, eye)  # a diverged row must not break the batch
    ones = torch.ones(gram.shape[0], n, 1, dtype=gram.dtype, device=gram.device)
    with torch.autocast(gram.device.type, enabled=False):
        w, _ = torch.linalg.solve_ex(gram + reg * eye, ones)
    w = w.squeeze(-1)
    return w / w.sum(dim=1, keepdim=True)


@dataclass(frozen=True)
class AndersonOptions:
    """Type-II Anderson: history m, regulariser (relative to the Gram matrix) and mixing beta."""

    m: int = 5
    reg: float = 1e-4
    beta: float = 1.0
    reg_relative: bool = True  # False: TorchDEQ's absolute regulariser (stalls at tight tol)
    legacy_names: ClassVar[dict[str, str]] = {
        "m": "anderson_m",
        "reg": "anderson_reg",
        "beta": "anderson_beta",
        "reg_relative": "anderson_reg_relative",
    }

    def __post_init__(self) -> None:
        if not isinstance(self.m, int) or isinstance(self.m, bool) or self.m < 1:
            raise option_error("anderson", "m", self.legacy_names, f"must be an integer >= 1, got {self.m!r}")
        for name in ("reg", "beta"):
            if not getattr(self, name) > 0:
                raise option_error(
                    "anderson", name, self.legacy_names, f"must be > 0, got {getattr(self, name)!r}"
                )


@SOLVERS.register
class Anderson(Solver):
    """Type-II Anderson acceleration with a relative regulariser."""

    name = "anderson"
    Options = AndersonOptions
    adjoint_ok = True

    def init(self, z: Tensor) -> State:
        return {"x": [], "f": []}

    def update(self, z: Tensor, fz: Tensor, res: Tensor | None, state: State) -> tuple[Tensor, State, Info]:
        opts = self.opts
        xs = ([*state["x"], z])[-opts.m :]
        fs = ([*state["f"], fz])[-opts.m :]
        new_state = {"x": xs, "f": fs}
        if len(xs) == 1:
            z_next = fz if opts.beta == 1.0 else opts.beta * fz + (1 - opts.beta) * z
            return z_next, new_state, {}
        b = z.shape[0]
        xstack = torch.stack(xs, dim=1)  # [B, n, ...]
        fstack = torch.stack(fs, dim=1)
        with torch.no_grad():
            dtype = torch.promote_types(z.dtype, torch.float32)
            g = (fstack - xstack).reshape(b, len(xs), -1).to(dtype)
            alpha = anderson_weights(g, opts.reg, opts.reg_relative).to(z.dtype)
        a = alpha.view(b, len(xs), *([1] * (z.dim() - 1)))
        beta = opts.beta
        mixed = (a * fstack).sum(1) if beta == 1.0 else (a * (beta * fstack + (1 - beta) * xstack)).sum(1)
        return mixed, new_state, {}


@dataclass(frozen=True)
class BroydenOptions:
    """Limited-memory good Broyden: at most m rank-one terms, then a restart from H = -I."""

    m: int = 16
    legacy_names: ClassVar[dict[str, str]] = {"m": "broyden_m"}

    def __post_init__(self) -> None:
        if not isinstance(self.m, int) or isinstance(self.m, bool) or self.m < 1:
            raise option_error("broyden", "m", self.legacy_names, f"must be an integer >= 1, got {self.m!r}")


def _hv(us: list[Tensor], vs: list[Tensor], y: Tensor) -> Tensor:
    """H y = -y + sum_i u_i (v_i . y) for flat [B, D] tensors."""
    out = -y
    for u, v in zip(us, vs):
        out = out + u * (v * y).sum(1, keepdim=True)
    return out


def _yh(us: list[Tensor], vs: list[Tensor], y: Tensor) -> Tensor:
    """y^T H = -y + sum_i v_i (u_i . y) for flat [B, D] tensors."""
    out = -y
    for u, v in zip(us, vs):
        out = out + v * (u * y).sum(1, keepdim=True)
    return out


@SOLVERS.register
class Broyden(Solver):
    """Limited-memory good Broyden on g(z) = f(z) - z (H = -I + U V^T, at most m terms)."""

    name = "broyden"
    Options = BroydenOptions

    def init(self, z: Tensor) -> State:
        return {"u": [], "v": [], "z_prev": None, "g_prev": None}

    def update(self, z: Tensor, fz: Tensor, res: Tensor | None, state: State) -> tuple[Tensor, State, Info]:
        b = z.shape[0]
        us, vs = list(state["u"]), list(state["v"])
        with torch.no_grad():
            dtype = torch.promote_types(z.dtype, torch.float32)
            zf = z.detach().reshape(b, -1).to(dtype)
            gf = (fz.detach() - z.detach()).reshape(b, -1).to(dtype)
            if state["z_prev"] is not None:
                dx = zf - state["z_prev"]
                dg = gf - state["g_prev"]
                vt = _yh(us, vs, dx)
                denom = (vt * dg).sum(1, keepdim=True)
                ok = torch.isfinite(denom) & (denom.abs() > torch.finfo(dtype).tiny ** 0.5)
                u = torch.where(ok, (dx - _hv(us, vs, dg)) / torch.where(ok, denom, 1.0), 0.0)
                u = torch.nan_to_num(u, nan=0.0, posinf=0.0, neginf=0.0)
                if len(us) >= self.opts.m:  # memory full: restart from H = -I (bounded memory)
                    us, vs = [], []
                us, vs = [*us, u], [*vs, vt]
            # z_next = z - H g = z + g - U (V^T g); the correction is a constant for autograd
            corr = torch.zeros_like(gf)
            for u, v in zip(us, vs):
                corr = corr + u * (v * gf).sum(1, keepdim=True)
            corr = torch.nan_to_num(corr).reshape(z.shape).to(z.dtype)
        z_next = fz - corr
        return z_next, {"u": us, "v": vs, "z_prev": zf, "g_prev": gf}, {}
