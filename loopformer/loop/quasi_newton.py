"""Quasi-Newton solvers: Anderson acceleration and limited-memory Broyden (see solvers.py).

Both keep their history in preallocated batch-first buffers, written in place one slot per
iteration (no re-stacking): Anderson a ring of the last m f(X_i) and residuals g_i with the Gram
matrix G_ij = g_i . g_j updated by one new row per step (O(m D) instead of O(m^2 D), as the row
vector g_k^T G^T: ``_dots``), the whole update in one no_grad region without autocast bookkeeping
outside autocast (the per-step cost beside the map: benchmarks/bench_solvers.py); Broyden
the rank-one terms u_i, v_i of its inverse-Jacobian estimate, applied with two batched matrix
products. Every sample has its own history, so samples converge (and leave the batch) one by one.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from loopformer.loop.solvers import SOLVERS, Info, Solver, State, option_error


class Terms:
    """A batch-first buffer [B, m, D] of which the first ``n`` slots hold terms; ``len()`` is n.

    The engine compacts it through ``select_rows`` (any state value may define it).
    """

    def __init__(self, buf: Tensor, n: int = 0) -> None:
        self.buf, self.n = buf, n

    def __len__(self) -> int:
        return self.n

    def select_rows(self, rows: Tensor) -> Terms:
        return Terms(self.buf.index_select(0, rows), self.n)

    def grown(self, limit: int) -> Terms:
        """The same terms in a buffer with twice the slots (at most ``limit``)."""
        extra = min(self.buf.shape[1], limit - self.buf.shape[1])
        pad = self.buf.new_zeros((self.buf.shape[0], extra, self.buf.shape[2]))
        return Terms(torch.cat([self.buf, pad], dim=1), self.n)

    @property
    def active(self) -> Tensor:
        return self.buf[:, : self.n]


def _dots(terms: Tensor, y: Tensor) -> Tensor:
    """``terms @ y`` per sample, [B, n], for terms [B, n, D] and y [B, D], computed as the row vector
    ``y^T terms^T``: on CPU the matrix-vector form ``bmm(terms, y[..., None])`` is ~10x slower."""
    return torch.bmm(y.unsqueeze(1), terms.transpose(1, 2)).squeeze(1)


def exact(like: Tensor) -> AbstractContextManager:
    """Solver arithmetic runs outside autocast (a bf16 region would run the Gram matrix, the
    solves and the mixing in bf16, and there is no bf16 LU): in the buffers' own dtype. Outside
    an autocast region this is a no-op context (entering torch.autocast costs per solver step)."""
    if torch.is_autocast_enabled(like.device.type):
        return torch.autocast(like.device.type, enabled=False)
    return nullcontext()


def anderson_weights(g: Tensor, reg: float, relative: bool = True) -> Tensor:
    """Per-sample type-II Anderson mixing weights a [B, n] (sum to 1) from residuals g [B, n, D].

    ``relative=False`` adds ``reg`` to the raw Gram matrix (TorchDEQ's absolute regulariser; kept
    only to measure how it stalls at tight tolerances).
    """
    g = g.float() if g.dtype in (torch.bfloat16, torch.float16) else g
    with exact(g):
        return gram_weights(torch.bmm(g, g.transpose(1, 2)), reg, relative)


@functools.lru_cache(maxsize=32)
def _constants(b: int, n: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """The right-hand side ones [b, n, 1] and the uniform weights [b, n] of an n-slot solve."""
    return torch.ones(b, n, 1, dtype=dtype, device=device), torch.full(
        (b, n), 1.0 / n, dtype=dtype, device=device
    )


def gram_weights(gram: Tensor, reg: float, relative: bool = True, valid: Tensor | None = None) -> Tensor:
    """Anderson weights a [B, n] from the Gram matrix [B, n, n] of the residuals: the solution of
    ``(G / s + reg I) w = 1``, ``a = w / sum w`` (s = trace(G) / n when relative; solved as
    ``(G + reg s I) w = 1``, which has the same a). With ``valid`` [B, n], slots marked False get
    weight 0 (they are decoupled by an identity block). A sample with a non-finite residual gets
    uniform weights: a diverged row must not break the batch."""
    b, n = gram.shape[0], gram.shape[-1]
    tiny = torch.finfo(gram.dtype).tiny
    if valid is None:
        a = gram.clone()
        rhs, uniform = _constants(b, n, gram.dtype, gram.device)
        diag = a.diagonal(dim1=1, dim2=2)
        trace = diag.sum(-1, keepdim=True)  # [B, 1]
        shift = (trace * (reg / n)).clamp_min_(tiny) if relative else torch.full_like(trace, reg)
        diag.add_(shift)
    else:
        vm = valid.to(gram.dtype)
        a = gram * (vm.unsqueeze(2) * vm.unsqueeze(1))
        count = vm.sum(-1, keepdim=True)
        rhs, uniform = vm.unsqueeze(-1), vm / count
        diag = a.diagonal(dim1=1, dim2=2)
        trace = diag.sum(-1, keepdim=True)
        shift = (trace * reg / count).clamp_min_(tiny) if relative else torch.full_like(trace, reg)
        diag.add_(torch.where(valid, shift, 1.0))
    w, _ = torch.linalg.solve_ex(a, rhs)
    w = w.squeeze(-1)
    w = w.div_(w.sum(dim=1, keepdim=True))
    # trace >= 0 or NaN, so ``trace < inf`` is isfinite(trace) in one comparison
    return torch.where(trace < float("inf"), w, uniform)


@dataclass(frozen=True)
class AndersonOptions:
    """Type-II Anderson: history m, regulariser (relative to the Gram matrix), mixing beta and an
    optional safeguard: a sample whose residual rises above ``restart`` times its best so far
    drops its history (the next step is a plain (beta-)Picard step) and starts a new one."""

    m: int = 5
    reg: float = 1e-4
    beta: float = 1.0
    reg_relative: bool = True  # False: TorchDEQ's absolute regulariser (stalls at tight tol)
    restart: float | None = None
    legacy_names: ClassVar[dict[str, str]] = {
        "m": "anderson_m",
        "reg": "anderson_reg",
        "beta": "anderson_beta",
        "reg_relative": "anderson_reg_relative",
    }

    def __post_init__(self) -> None:
        group = "anderson"
        if not isinstance(self.m, int) or isinstance(self.m, bool) or self.m < 1:
            raise option_error(group, "m", self.legacy_names, f"must be an integer >= 1, got {self.m!r}")
        for name in ("reg", "beta"):
            if not getattr(self, name) > 0:
                raise option_error(
                    group, name, self.legacy_names, f"must be > 0, got {getattr(self, name)!r}"
                )
        if self.restart is not None and not self.restart >= 1:
            raise option_error(
                group, "restart", self.legacy_names, f"must be >= 1 (or None), got {self.restart!r}"
            )


@SOLVERS.register
class Anderson(Solver):
    """Type-II Anderson acceleration with a relative regulariser, ring-buffer history."""

    name = "anderson"
    Options = AndersonOptions
    adjoint_ok = True

    def __init__(self, cfg: Any, options: Any = None) -> None:
        super().__init__(cfg, options)
        self.needs_residual = self.opts.restart is not None  # the safeguard reads the residual

    def init(self, z: Tensor) -> State:
        return {"k": 0}

    def _buffers(self, z: Tensor, dtype: torch.dtype) -> State:
        b, d, m = z.shape[0], z[0].numel(), self.opts.m
        return {
            "f": torch.zeros(b, m, d, dtype=dtype, device=z.device),
            "g": torch.zeros(b, m, d, dtype=dtype, device=z.device),
            "gram": torch.zeros(b, m, m, dtype=dtype, device=z.device),
            "best": torch.full((b,), float("inf"), dtype=dtype, device=z.device),
        }

    def _record(self, z: Tensor, fz: Tensor, res: Tensor | None, state: State) -> State:
        """Write (f(z), g = f(z) - z) into the next ring slot and its row of the Gram matrix
        (in place, under no_grad: the caller's)."""
        dtype = torch.promote_types(z.dtype, torch.float32)
        if "f" not in state:
            state = {**state, **self._buffers(z, dtype), "n": 0, "valid": None}
        b, k = z.shape[0], state["k"]
        f_flat, z_flat = fz.detach().reshape(b, -1), z.detach().reshape(b, -1)
        if f_flat.dtype != dtype:
            f_flat, z_flat = f_flat.to(dtype), z_flat.to(dtype)
        state["f"][:, k] = f_flat
        state["g"][:, k] = f_flat - z_flat  # written into its slot (an out= view is not contiguous)
        g_flat = state["g"][:, k]
        n = min(state["n"] + 1, self.opts.m)
        # the ring fills slots 0, 1, ... in order before it wraps: the first n slots are the ones in
        # use (the rest are zeros, whose Gram entries stay 0)
        row = _dots(state["g"][:, :n], g_flat)
        state["gram"][:, k, :n] = row
        state["gram"][:, :n, k] = row
        valid = state["valid"]
        if self.opts.restart is not None and res is not None:
            rose = res > self.opts.restart * state["best"]
            if bool(rose.any()):  # from now on the slots of this batch are masked per sample
                if valid is None:
                    valid = (torch.arange(self.opts.m, device=z.device) < n).expand(b, -1).clone()
                valid.masked_fill_(rose.unsqueeze(1), False)
            torch.minimum(state["best"], res, out=state["best"])
        if valid is not None:
            valid[:, k] = True
        return {**state, "k": (k + 1) % self.opts.m, "n": n, "valid": valid}

    def _weights(self, state: State) -> tuple[Tensor, int]:
        """Mixing weights over the first n slots (all of them valid unless a sample restarted)."""
        opts, n = self.opts, state["n"]
        if state["valid"] is not None:  # some sample restarted: per-sample slot masks
            return gram_weights(state["gram"], opts.reg, opts.reg_relative, state["valid"]), opts.m
        return gram_weights(state["gram"][:, :n, :n], opts.reg, opts.reg_relative), n

    def update(self, z: Tensor, fz: Tensor, res: Tensor | None, state: State) -> tuple[Tensor, State, Info]:
        opts = self.opts
        k = state["k"]
        graph = "fz" in state or (fz.requires_grad and torch.is_grad_enabled())
        with torch.no_grad(), exact(z):  # one no_grad / autocast region for the whole update
            state = self._record(z, fz, res, state)
            alpha, n = self._weights(state)
            if not graph:
                mixed = torch.bmm(alpha.unsqueeze(1), state["f"][:, :n]).squeeze(1)
                if opts.beta != 1.0:
                    mixed = mixed - (1 - opts.beta) * torch.bmm(
                        alpha.unsqueeze(1), state["g"][:, :n]
                    ).squeeze(1)
                return mixed.reshape(z.shape).to(z.dtype), state, {}
        return self._mix_with_graph(z, fz, k, alpha.to(z.dtype), n, state)

    def _mix_with_graph(
        self, z: Tensor, fz: Tensor, k: int, alpha: Tensor, n: int, state: State
    ) -> tuple[Tensor, State, Info]:
        """bptt through Anderson: the mixed iterate keeps the graph of the f(X_i) (and X_i) it uses."""
        opts = self.opts
        fzs = list(state.get("fz", [None] * opts.m))
        xs = list(state.get("x", [None] * opts.m))
        fzs[k], xs[k] = fz, z
        shape = (-1, *([1] * (z.dim() - 1)))
        mixed = torch.zeros_like(fz)
        for i in range(n):
            if fzs[i] is not None:
                term = fzs[i] if opts.beta == 1.0 else opts.beta * fzs[i] + (1 - opts.beta) * xs[i]
                mixed = mixed + alpha[:, i].view(shape) * term
        return mixed, {**state, "fz": fzs, "x": xs}, {}


@dataclass(frozen=True)
class BroydenOptions:
    """Limited-memory good Broyden: at most m rank-one terms, then a restart from H = -I."""

    m: int = 16
    legacy_names: ClassVar[dict[str, str]] = {"m": "broyden_m"}

    def __post_init__(self) -> None:
        if not isinstance(self.m, int) or isinstance(self.m, bool) or self.m < 1:
            raise option_error("broyden", "m", self.legacy_names, f"must be an integer >= 1, got {self.m!r}")


def _uvy(u: Tensor, v: Tensor, y: Tensor) -> Tensor:
    """U^T (V y) for flat y [B, D] and terms u, v [B, n, D]. (The row-vector form of ``_dots`` would
    be faster on CPU, but Broyden's last steps at tight tolerances amplify its different rounding.)"""
    return torch.bmm(u.transpose(1, 2), torch.bmm(v, y.unsqueeze(-1))).squeeze(-1)


def _hv(u: Tensor, v: Tensor, y: Tensor) -> Tensor:
    """H y = -y + U^T (V y)."""
    return -y if u.shape[1] == 0 else _uvy(u, v, y) - y


def _yh(u: Tensor, v: Tensor, y: Tensor) -> Tensor:
    """y^T H = -y + V^T (U y) for flat y [B, D] and terms u, v [B, n, D]."""
    return _hv(v, u, y)


@SOLVERS.register
class Broyden(Solver):
    """Limited-memory good Broyden on g(z) = f(z) - z (H = -I + U^T V, at most m terms)."""

    name = "broyden"
    Options = BroydenOptions

    def init(self, z: Tensor) -> State:
        return {"u": Terms(torch.empty(0)), "v": Terms(torch.empty(0)), "z_prev": None, "g_prev": None}

    @torch.no_grad()
    def _add_term(self, state: State, dx: Tensor, dg: Tensor) -> tuple[Terms, Terms]:
        """The good-Broyden rank-one update from the last step. On a full memory the terms are dropped
        first and the new term is formed against H = -I, so the restarted estimate satisfies the
        secant condition ``H dg = dx``. (Forming it against the full H and then keeping it alone on
        -I, as before, broke that condition: every restart's next step went astray, and at rho 0.99
        the solve needed twice TorchDEQ's map evaluations.)"""
        us, vs = state["u"], state["v"]
        if us.buf.dim() != 3:  # first update: allocate the term buffers (grown on demand up to m)
            shape = (dx.shape[0], min(self.opts.m, 16), dx.shape[1])
            us = Terms(torch.zeros(shape, dtype=dx.dtype, device=dx.device))
            vs = Terms(torch.zeros(shape, dtype=dx.dtype, device=dx.device))
        elif us.n == us.buf.shape[1] < self.opts.m:
            us, vs = us.grown(self.opts.m), vs.grown(self.opts.m)
        if us.n >= self.opts.m:  # memory full: restart from H = -I *before* forming the new term
            us, vs = Terms(us.buf, 0), Terms(vs.buf, 0)
        vt = _yh(us.active, vs.active, dx)
        denom = (vt * dg).sum(1, keepdim=True)
        ok = torch.isfinite(denom) & (denom.abs() > torch.finfo(dx.dtype).tiny ** 0.5)
        u = torch.where(ok, (dx - _hv(us.active, vs.active, dg)) / torch.where(ok, denom, 1.0), 0.0)
        u = torch.nan_to_num(u, nan=0.0, posinf=0.0, neginf=0.0)
        n = us.n
        us.buf[:, n] = u
        vs.buf[:, n] = vt
        return Terms(us.buf, n + 1), Terms(vs.buf, n + 1)

    def update(self, z: Tensor, fz: Tensor, res: Tensor | None, state: State) -> tuple[Tensor, State, Info]:
        b = z.shape[0]
        with torch.no_grad(), exact(z):
            dtype = torch.promote_types(z.dtype, torch.float32)
            zf = z.detach().reshape(b, -1).to(dtype)
            gf = (fz.detach() - z.detach()).reshape(b, -1).to(dtype)
            us, vs = state["u"], state["v"]
            if state["z_prev"] is not None:
                us, vs = self._add_term(state, zf - state["z_prev"], gf - state["g_prev"])
            # z_next = z - H g = z + g - U^T (V g); the correction is a constant for autograd
            corr = _uvy(us.active, vs.active, gf) if us.n else torch.zeros_like(gf)
            corr = torch.nan_to_num(corr).reshape(z.shape).to(z.dtype)
        return fz - corr, {"u": us, "v": vs, "z_prev": zf, "g_prev": gf}, {}


@dataclass(frozen=True)
class SafeAndersonOptions(AndersonOptions):
    """Defaults for accuracy per map evaluation: a longer history, a tiny regulariser and the
    restart safeguard (a sample whose residual rises tenfold above its best drops its history)."""

    m: int = 20
    reg: float = 1e-10
    restart: float | None = 10.0
    legacy_names: ClassVar[dict[str, str]] = {}


@SOLVERS.register
class SafeAnderson(Anderson):
    """Anderson with a long history and a restart when the residual rises (``safe_anderson``)."""

    name = "safe_anderson"
    Options = SafeAndersonOptions
