"""Fixed-point solvers: given z and f(z), form the next iterate. All state is per sample.

Each solver evaluates ``f`` exactly once per iteration (the engine does it) and turns
``(z, f(z), residual)`` into the next iterate. Solver state is a dict of batch-first tensors
(or lists of them) so the engine can compact it when samples halt.

- ``picard``: ``z <- f(z)``.
- ``damped``: FPRM's Algorithm 1 (SYSTEMS.md section 1): per sample step ``eta`` (starts at 1),
  best residual ``r*`` and patience ``p``; ``z <- eta f(z) + (1 - eta) z`` (one ``torch.lerp``); if ``r < r*`` reset
  the patience, else ``p -= 1``; when ``p <= 0`` and ``r >= eps`` shrink ``eta *= gamma`` and reset
  ``p``. ``eta < min_step`` reports the sample as stalled (halted, not converged).
- ``anderson``: type-II Anderson acceleration (Attractor, SYSTEMS.md section 2; DEQ): with the last
  m iterates X_i and residuals g_i = f(X_i) - X_i, solve ``min ||sum a_i g_i||`` s.t. ``sum a_i = 1``
  per sample via ``(G / s + lam I) w = 1``, ``a = w / sum w``, G the Gram matrix of the g_i and
  s = trace(G) / n. The regulariser is *relative* to the Gram matrix: an absolute one dominates
  once residuals are small and makes Anderson slower than Picard (LESSONS.md).
  Next iterate ``sum a_i (beta f(X_i) + (1 - beta) X_i)``.
- ``broyden``: limited-memory "good" Broyden on g(z) = f(z) - z with inverse-Jacobian estimate
  ``H = -I + sum_i u_i v_i^T``, at most ``m`` rank-one terms; when the memory is full it restarts
  from ``H = -I`` (bounded memory, LESSONS.md / deq issue 28; dropping only the oldest term diverges).
Mixing coefficients (Anderson a_i, Broyden u_i v_i, damping eta) are constants for autograd:
under ``grad="bptt"`` gradients flow through the iterates, not through the coefficients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from loopformer.loop.config import LoopConfig

State = dict[str, Any]


def _bcast(v: Tensor, like: Tensor) -> Tensor:
    """Reshape a per-sample vector [B] to broadcast against a state [B, ...]."""
    v = v.view(v.shape[0], *([1] * (like.dim() - 1)))
    return v if v.dtype == like.dtype else v.to(like.dtype)


def anderson_weights(g: Tensor, reg: float, relative: bool = True) -> Tensor:
    """Per-sample type-II Anderson mixing weights a [B, n] (sum to 1) from residuals g [B, n, D].

    ``relative=False`` adds ``reg`` to the raw Gram matrix (TorchDEQ's absolute regulariser; kept
    only to measure how it stalls at tight tolerances, LESSONS.md).
    """
    gram = torch.bmm(g, g.transpose(1, 2))  # [B, n, n]
    n = gram.shape[-1]
    if relative:
        scale = gram.diagonal(dim1=1, dim2=2).sum(-1) / n
        scale = scale.clamp_min(torch.finfo(gram.dtype).tiny)
        gram = gram / scale.view(-1, 1, 1)
    eye = torch.eye(n, dtype=gram.dtype, device=gram.device)
    finite = torch.isfinite(gram).flatten(1).all(dim=1)
    gram = torch.where(finite.view(-1, 1, 1), gram, eye)  # a diverged row must not break the batch
    ones = torch.ones(gram.shape[0], n, 1, dtype=gram.dtype, device=gram.device)
    w, _ = torch.linalg.solve_ex(gram + reg * eye, ones)
    w = w.squeeze(-1)
    return w / w.sum(dim=1, keepdim=True)


class Solver:
    """Base class: ``init`` builds per-sample state, ``update`` forms the next iterate."""

    name = "base"

    def __init__(self, cfg: LoopConfig) -> None:
        self.cfg = cfg

    def init(self, z: Tensor) -> State:
        return {}

    def update(self, z: Tensor, fz: Tensor, res: Tensor, state: State) -> tuple[Tensor, State, dict[str, Tensor]]:
        raise NotImplementedError


class Picard(Solver):
    name = "picard"

    def update(self, z: Tensor, fz: Tensor, res: Tensor, state: State) -> tuple[Tensor, State, dict[str, Tensor]]:
        return fz, state, {}


class Damped(Solver):
    """FPRM Algorithm 1 (SYSTEMS.md section 1)."""

    name = "damped"

    def init(self, z: Tensor) -> State:
        b = z.shape[0]
        dtype = torch.promote_types(z.dtype, torch.float32)
        return {
            "eta": torch.ones(b, dtype=dtype, device=z.device),
            "best": torch.full((b,), float("inf"), dtype=dtype, device=z.device),
            "patience": torch.full((b,), self.cfg.damp_patience, dtype=torch.long, device=z.device),
        }

    def update(self, z: Tensor, fz: Tensor, res: Tensor, state: State) -> tuple[Tensor, State, dict[str, Tensor]]:
        cfg = self.cfg
        eta = state["eta"]
        # one fused op; lerp with weight 1 returns f(z) exactly. The engine's truncated-gradient
        # replay uses the same torch.lerp, so replayed iterates match these bit for bit.
        z_next = torch.lerp(z, fz, _bcast(eta, z))
        with torch.no_grad():
            improved = res < state["best"]
            best = torch.where(improved, res, state["best"])
            patience = (state["patience"] - 1).masked_fill_(improved, cfg.damp_patience)
            # improved implies patience > 0, so the shrink test needs no extra mask
            shrink = (patience <= 0).logical_and_(res >= cfg.tol)
            new_eta = torch.where(shrink, eta * cfg.damp_gamma, eta)
            patience.masked_fill_(shrink, cfg.damp_patience)
            info = {"eta": eta}
            if cfg.halting != "fixed":  # fixed halting ignores stalls: skip the op
                info["stalled"] = new_eta < cfg.damp_min_step
        return z_next, {"eta": new_eta, "best": best, "patience": patience}, info


class Anderson(Solver):
    """Type-II Anderson acceleration with a relative regulariser."""

    name = "anderson"

    def init(self, z: Tensor) -> State:
        return {"x": [], "f": []}

    def update(self, z: Tensor, fz: Tensor, res: Tensor, state: State) -> tuple[Tensor, State, dict[str, Tensor]]:
        cfg = self.cfg
        xs = ([*state["x"], z])[-cfg.anderson_m:]
        fs = ([*state["f"], fz])[-cfg.anderson_m:]
        new_state = {"x": xs, "f": fs}
        if len(xs) == 1:
            z_next = fz if cfg.anderson_beta == 1.0 else cfg.anderson_beta * fz + (1 - cfg.anderson_beta) * z
            return z_next, new_state, {}
        b = z.shape[0]
        xstack = torch.stack(xs, dim=1)  # [B, n, ...]
        fstack = torch.stack(fs, dim=1)
        with torch.no_grad():
            dtype = torch.promote_types(z.dtype, torch.float32)
            g = (fstack - xstack).reshape(b, len(xs), -1).to(dtype)
            alpha = anderson_weights(g, cfg.anderson_reg, cfg.anderson_reg_relative).to(z.dtype)
        a = alpha.view(b, len(xs), *([1] * (z.dim() - 1)))
        beta = cfg.anderson_beta
        mixed = (a * fstack).sum(1) if beta == 1.0 else (a * (beta * fstack + (1 - beta) * xstack)).sum(1)
        return mixed, new_state, {}


class Broyden(Solver):
    """Limited-memory good Broyden on g(z) = f(z) - z (H = -I + U V^T, at most broyden_m terms)."""

    name = "broyden"

    def init(self, z: Tensor) -> State:
        return {"u": [], "v": [], "z_prev": None, "g_prev": None}

    @staticmethod
    def _hv(us: list[Tensor], vs: list[Tensor], y: Tensor) -> Tensor:
        """H y = -y + sum_i u_i (v_i . y) for flat [B, D] tensors."""
        out = -y
        for u, v in zip(us, vs):
            out = out + u * (v * y).sum(1, keepdim=True)
        return out

    @staticmethod
    def _yh(us: list[Tensor], vs: list[Tensor], y: Tensor) -> Tensor:
        """y^T H = -y + sum_i v_i (u_i . y) for flat [B, D] tensors."""
        out = -y
        for u, v in zip(us, vs):
            out = out + v * (u * y).sum(1, keepdim=True)
        return out

    def update(self, z: Tensor, fz: Tensor, res: Tensor, state: State) -> tuple[Tensor, State, dict[str, Tensor]]:
        b = z.shape[0]
        us, vs = list(state["u"]), list(state["v"])
        with torch.no_grad():
            dtype = torch.promote_types(z.dtype, torch.float32)
            zf = z.detach().reshape(b, -1).to(dtype)
            gf = (fz.detach() - z.detach()).reshape(b, -1).to(dtype)
            if state["z_prev"] is not None:
                dx = zf - state["z_prev"]
                dg = gf - state["g_prev"]
                vt = self._yh(us, vs, dx)
                denom = (vt * dg).sum(1, keepdim=True)
                ok = torch.isfinite(denom) & (denom.abs() > torch.finfo(dtype).tiny ** 0.5)
                u = torch.where(ok, (dx - self._hv(us, vs, dg)) / torch.where(ok, denom, 1.0), 0.0)
                u = torch.nan_to_num(u, nan=0.0, posinf=0.0, neginf=0.0)
                if len(us) >= self.cfg.broyden_m:  # memory full: restart from H = -I (bounded memory)
                    us, vs = [], []
                us, vs = [*us, u], [*vs, vt]
            # z_next = z - H g = z + g - U (V^T g); the correction is a constant for autograd
            corr = torch.zeros_like(gf)
            for u, v in zip(us, vs):
                corr = corr + u * (v * gf).sum(1, keepdim=True)
            corr = torch.nan_to_num(corr).reshape(z.shape).to(z.dtype)
        z_next = fz - corr
        return z_next, {"u": us, "v": vs, "z_prev": zf, "g_prev": gf}, {}


SOLVER_CLASSES: dict[str, type[Solver]] = {"picard": Picard, "damped": Damped, "anderson": Anderson, "broyden": Broyden}


def make_solver(cfg: LoopConfig) -> Solver:
    return SOLVER_CLASSES[cfg.solver](cfg)
