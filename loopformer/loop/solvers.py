"""Fixed-point solvers: given z and f(z), form the next iterate. All state is per sample.

Each solver evaluates ``f`` exactly once per iteration (the engine does it) and turns
``(z, f(z), residual)`` into the next iterate. Solver state is a dict of batch-first tensors
(or lists of them) so the engine can compact it when samples halt. A solver is one class
registered in ``SOLVERS``; its class attributes tell the engine what it needs to know
(``Solver``), its options are the frozen dataclass ``Options``, kept in ``LoopConfig.plugins`` under
the solver's name (``LoopConfig(solver="anderson", plugins={"anderson": {"m": 5}})``).

- ``picard``: ``z <- f(z)``.
- ``damped``: FPRM's Algorithm 1 (arXiv 2505.18001): per sample step ``eta`` (starts at 1),
  best residual ``r*`` and patience ``p``; ``z <- eta f(z) + (1 - eta) z`` (one ``torch.lerp``); if
  ``r < r*`` reset the patience, else ``p -= 1``; when ``p <= 0`` and ``r >= tol`` shrink
  ``eta *= gamma`` and reset ``p``. ``eta < min_step`` reports the sample as stalled. Under
  ``LoopConfig.state_dtype="bfloat16"`` eta and r* are bf16 tensors and every operation rounds as the
  FPRM reference's ``FixedPointOptimizer.step`` does: ``f(z) eta + z (1 - eta)`` in bf16, and
  ``eta * bf16(gamma)`` (gamma itself rounded: 0.996 and 0.997 are both 0.99609375 in bf16).
- ``anderson``: type-II Anderson acceleration (Attractor; DEQ): with the last m iterates X_i and
  residuals g_i = f(X_i) - X_i, solve ``min ||sum a_i g_i||`` s.t. ``sum a_i = 1`` per sample via
  ``(G / s + lam I) w = 1``, ``a = w / sum w``, G the Gram matrix of the g_i and s = trace(G) / n.
  The regulariser is *relative* to the Gram matrix: an absolute one dominates once residuals are
  small and makes Anderson slower than Picard. Next iterate ``sum a_i (beta f(X_i) + (1 - beta) X_i)``.
- ``broyden``: limited-memory multisecant "good" Broyden on g(z) = f(z) - z: the inverse-Jacobian
  estimate ``H = -I + (P + Q)^T (P Q^T)^-1 P`` satisfies the secant equations of its last ``m``
  (conjugated) secant pairs; on a symmetric contractive linear map its iterates are conjugate
  gradient's followed by a Picard step (``Broyden``'s docstring).
Mixing coefficients (Anderson a_i, Broyden's correction, damping eta) are constants for autograd:
under ``grad="bptt"`` gradients flow through the iterates, not through the coefficients.

Anderson and Broyden keep their history in preallocated batch-first buffers, written in place one slot per
iteration (no re-stacking): Anderson a ring of the last m f(X_i) and residuals g_i with the Gram
matrix G_ij = g_i . g_j updated by one new row per step (O(m D) instead of O(m^2 D), as the row
vector g_k^T G^T: ``_dots``), the whole update in one no_grad region without autocast bookkeeping
outside autocast (the per-step cost beside the map: benchmarks/bench_solvers.py); Broyden a ring
of its secant pairs p_i, q_i with the Galerkin matrix P Q^T, one new row per step. Every sample
has its own history, so samples converge (and leave the batch) one by one.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from loopformer.loop.config import LoopConfig, NoOptions, Registry, option_error

State = dict[str, Any]
Info = dict[str, Tensor]


def _bcast(v: Tensor, like: Tensor) -> Tensor:
    """Reshape a per-sample vector [B] to broadcast against a state [B, ...]."""
    v = v.view(v.shape[0], *([1] * (like.dim() - 1)))
    return v if v.dtype == like.dtype else v.to(like.dtype)


class Solver:
    """Base class: ``init`` builds per-sample state, ``update`` forms the next iterate.

    What the engine needs to know (class attributes, all default False / empty):

    - ``returns_step``: the next iterate is exactly ``f(z)`` (the engine reuses ||f(z)||);
    - ``replayable``: the next iterate is ``replay_step(z, f(z), replay_coeff(state))``, a
      function of the step input and per-sample coefficients only, so ``grad="truncated"`` can
      replay the last k steps exactly with gradient;
    - ``can_stall``: ``update`` reports ``info["stalled"]`` [B] (those samples stop, not converged)
      while ``self.report_stalls`` is True (the engine clears it when nothing may stop early);
    - ``needs_residual``: ``update`` reads the residual even when the engine keeps no trace;
    - ``adjoint_ok``: usable for the implicit (IFT) backward solve ``u = v + J^T u``;
    - ``stats``: names of the per-sample values ``sample_stats(state)`` reports, collected into
      ``LoopResult.stats`` when a sample halts.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    returns_step: ClassVar[bool] = False
    replayable: ClassVar[bool] = False
    can_stall: ClassVar[bool] = False
    needs_residual: ClassVar[bool] = False
    adjoint_ok: ClassVar[bool] = False
    stats: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: LoopConfig, options: Any = None) -> None:
        self.cfg = cfg
        self.opts = cfg.options_for(type(self)) if options is None else options
        self.report_stalls = True

    @classmethod
    def check_config(cls, cfg: LoopConfig) -> None:
        """Raise ValueError when ``cfg`` combines this solver with something it cannot do."""

    def init(self, z: Tensor) -> State:
        return {}

    def update(self, z: Tensor, fz: Tensor, res: Tensor | None, state: State) -> tuple[Tensor, State, Info]:
        raise NotImplementedError

    def replay_coeff(self, state: State) -> Tensor | None:
        """Per-sample coefficients [B] the next ``update`` will use (replayable solvers)."""
        return None

    def replay_step(self, z: Tensor, fz: Tensor, coeff: Tensor | None) -> Tensor:
        """The next iterate from the step input, f(z) and ``replay_coeff`` (replayable solvers)."""
        raise NotImplementedError(f"solver {self.name!r} cannot replay its steps")

    def sample_stats(self, state: State) -> dict[str, Tensor]:
        return {}

    def resume(self, state: State, carried: dict[str, Tensor]) -> State:
        """The fresh ``state`` with the per-sample entries of ``carried`` (values a previous call
        reported in ``LoopResult.stats``) put back: the solver continues where that call stopped."""
        unknown = sorted(set(carried) - set(self.stats))
        if unknown:
            raise ValueError(f"solver {self.name!r} cannot resume {unknown} (it carries {list(self.stats)})")
        out = dict(state)
        for key, value in carried.items():
            if value.shape != state[key].shape:
                raise ValueError(
                    f"carried solver state {key!r} has shape {tuple(value.shape)}, expected {tuple(state[key].shape)}"
                )
            out[key] = value.to(device=state[key].device, dtype=state[key].dtype)
        return out


SOLVERS: Registry[type[Solver]] = Registry("solver", Solver)


@SOLVERS.register
class Picard(Solver):
    name = "picard"
    returns_step = True
    replayable = True
    adjoint_ok = True

    def update(self, z: Tensor, fz: Tensor, res: Tensor | None, state: State) -> tuple[Tensor, State, Info]:
        return fz, state, {}

    def replay_step(self, z: Tensor, fz: Tensor, coeff: Tensor | None) -> Tensor:
        return fz


@dataclass(frozen=True)
class DampedOptions:
    """FPRM Algorithm 1: step decay, patience and the step size below which a sample stalls.

    ``min_improvement``: a residual counts as an improvement (resetting the patience) only when it is below
    the best so far minus this much. 0 (default) is nilskiKonjIzDunava/fprm at 68e118cd
    (``models/fixed_point_reasoning/model_utils.py`` ``FixedPointOptimizer.step``: ``residues < best``);
    0.01 is the same function at 9e0ebf35 (``residues < best - 1e-2``, "so slow monotonic drift doesn't keep
    resetting patience")."""

    gamma: float = 0.9
    patience: int = 5
    min_step: float = 1e-3
    min_improvement: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.gamma < 1:
            raise option_error("damped", "gamma", f"must be in (0, 1), got {self.gamma!r}")
        if not isinstance(self.patience, int) or isinstance(self.patience, bool) or self.patience < 1:
            raise option_error("damped", "patience", f"must be an integer >= 1, got {self.patience!r}")
        if not self.min_step > 0:
            raise option_error("damped", "min_step", f"must be > 0, got {self.min_step!r}")
        if not 0 <= self.min_improvement < float("inf"):
            raise option_error("damped", "min_improvement", f"must be >= 0, got {self.min_improvement!r}")


@SOLVERS.register
class Damped(Solver):
    """FPRM Algorithm 1 (arXiv 2505.18001)."""

    name = "damped"
    Options = DampedOptions
    replayable = True
    can_stall = True
    needs_residual = True
    stats = ("eta", "best", "patience")  # reported per sample, and resumable across calls

    def __init__(self, cfg: LoopConfig, options: Any = None) -> None:
        super().__init__(cfg, options)
        self.lowp = cfg.low_precision_state  # the reference's bf16 scalars and update

    def init(self, z: Tensor) -> State:
        b = z.shape[0]
        dtype = z.dtype if self.lowp else torch.promote_types(z.dtype, torch.float32)
        return {
            "eta": torch.ones(b, dtype=dtype, device=z.device),
            "best": torch.full((b,), float("inf"), dtype=dtype, device=z.device),
            "patience": torch.full((b,), self.opts.patience, dtype=torch.long, device=z.device),
        }

    def update(self, z: Tensor, fz: Tensor, res: Tensor | None, state: State) -> tuple[Tensor, State, Info]:
        opts, tol = self.opts, self.cfg.tol
        eta = state["eta"]
        # replay_step uses the same update, so replayed iterates match these bit for bit
        z_next = self.replay_step(z, fz, eta)
        with torch.no_grad():
            if self.lowp:  # the residual in the scalars' dtype (bf16 values already: exact)
                res = res.to(eta.dtype)
            margin = opts.min_improvement
            improved = res < (state["best"] - margin if margin else state["best"])
            best = torch.where(improved, res, state["best"])
            patience = (state["patience"] - 1).masked_fill_(improved, opts.patience)
            # improved implies patience > 0, so the shrink test needs no extra mask
            shrink = (patience <= 0).logical_and_(res >= tol)
            # bf16: the reference multiplies by gamma rounded to bf16 (a Python float would be applied
            # in float32 and rounded once)
            gamma = torch.tensor(opts.gamma, dtype=eta.dtype, device=eta.device) if self.lowp else opts.gamma
            new_eta = torch.where(shrink, eta * gamma, eta)
            patience.masked_fill_(shrink, opts.patience)
            info = {"stalled": new_eta < opts.min_step} if self.report_stalls else {}
        return z_next, {"eta": new_eta, "best": best, "patience": patience}, info

    def replay_coeff(self, state: State) -> Tensor | None:
        return state["eta"]

    def replay_step(self, z: Tensor, fz: Tensor, coeff: Tensor | None) -> Tensor:
        eta = _bcast(coeff, z)
        if self.lowp:  # the reference's y * s + z * (1 - s), each product and the sum rounded to bf16
            return fz * eta + z * (1 - eta)
        return torch.lerp(z, fz, eta)  # one fused op; weight 1 returns f(z) exactly

    def sample_stats(self, state: State) -> dict[str, Tensor]:
        return {"eta": state["eta"], "best": state["best"], "patience": state["patience"]}



# --------------------------------------------------------------------------------------------
# Quasi-Newton: Anderson acceleration and limited-memory Broyden
# --------------------------------------------------------------------------------------------
def _dots(terms: Tensor, y: Tensor) -> Tensor:
    """``terms @ y`` per sample, [B, n], for terms [B, n, D] and y [B, D], computed as the row vector
    ``y^T terms^T``: on CPU the matrix-vector form ``bmm(terms, y[..., None])`` is ~10x slower."""
    return torch.bmm(y.unsqueeze(1), terms.transpose(1, 2)).squeeze(1)


def exact(like: Tensor) -> AbstractContextManager:
    """Solver arithmetic runs outside autocast (a bf16 region would run the Gram matrix, the
    solves and the mixing in bf16, and there is no bf16 LU): in the buffers' own dtype. Outside
    an autocast region this is a no-op context (entering torch.autocast costs per solver step); so it is on
    a device without autocast (the meta device a memory plan runs on: loopformer.config.memory)."""
    kind = like.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
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

    def __post_init__(self) -> None:
        group = "anderson"
        if not isinstance(self.m, int) or isinstance(self.m, bool) or self.m < 1:
            raise option_error(group, "m", f"must be an integer >= 1, got {self.m!r}")
        for name in ("reg", "beta"):
            if not getattr(self, name) > 0:
                raise option_error(group, name, f"must be > 0, got {getattr(self, name)!r}")
        if self.restart is not None and not self.restart >= 1:
            raise option_error(group, "restart", f"must be >= 1 (or None), got {self.restart!r}")


@SOLVERS.register
class Anderson(Solver):
    """Type-II Anderson acceleration with a relative regulariser, ring-buffer history."""

    name = "anderson"
    Options = AndersonOptions
    adjoint_ok = True

    def __init__(self, cfg: LoopConfig, options: Any = None) -> None:
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
    """Multisecant good Broyden: at most ``m`` conjugated secant pairs (the oldest is dropped when the memory is
    full); a new pair whose conjugation leaves ``|cos(p, q)| < max(pivot, consistency |cos(s, y)|)`` restarts the
    sample's memory from that raw pair alone."""

    m: int = 16
    consistency: float = 0.3
    pivot: float = 1e-2

    def __post_init__(self) -> None:
        if not isinstance(self.m, int) or isinstance(self.m, bool) or self.m < 1:
            raise option_error("broyden", "m", f"must be an integer >= 1, got {self.m!r}")
        for name in ("consistency", "pivot"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise option_error("broyden", name, f"must be in [0, 1), got {value!r}")


def _mv(a: Tensor, y: Tensor) -> Tensor:
    """``a @ y`` per sample, [B, n], for a [B, n, D] and y [B, D]. In float64 (the tight tolerances) as a matrix-vector
    product: ``_dots``'s row-vector form rounds differently and Broyden's last steps amplify it. Below float64
    ``_dots``, much faster on one CPU thread at 4x4 Sudoku's evaluation batch (B 200, n 16, D 1024), where the
    matrix-vector form made Broyden's update cost as much as the map (``inference.fprm_vs_reference_sudoku4``)."""
    if a.dtype == torch.float64:
        return torch.bmm(a, y.unsqueeze(-1)).squeeze(-1)
    return _dots(a, y)


def _comb(c: Tensor, a: Tensor) -> Tensor:
    """``sum_i c_i a_i`` per sample, [B, D], for c [B, n] and a [B, n, D]."""
    return torch.bmm(c.unsqueeze(1), a).squeeze(1)


@functools.lru_cache(maxsize=64)
def _age_order(n: int, newest: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """For a ring of n slots whose newest entry is in slot ``newest``: the slots oldest first, the inverse
    permutation, and the identity [n, n] (the unused slots' block)."""
    order = (torch.arange(n, device=device) + newest + 1) % n
    return order, torch.argsort(order), torch.eye(n, dtype=torch.bool, device=device)


def _solve_lower(pq: Tensor, valid: Tensor, rhs: Tensor, newest: int) -> Tensor:
    """``M^-1 rhs`` [B, n] over the valid slots (0 on the others) for the Galerkin matrix ``M_ij = p_i . q_j``,
    lower triangular in the pairs' age order (``p_i . q_j = 0`` for j newer than i: the conjugation), the newest
    pair in ring slot ``newest``: one triangular solve with the slots permuted oldest first. A sample whose
    solution is not finite gets zeros (its step is a Picard step)."""
    order, back, eye = _age_order(pq.shape[1], newest, pq.device)
    both = valid.unsqueeze(2) & valid.unsqueeze(1)
    a = torch.where(both, pq, eye.to(pq.dtype)).index_select(1, order).index_select(2, order)  # identity: unused
    r = torch.where(valid, rhs, 0.0).index_select(1, order).unsqueeze(-1)
    x = torch.linalg.solve_triangular(a, r, upper=False).squeeze(-1).index_select(1, back)
    return torch.where(valid & torch.isfinite(x).all(1, keepdim=True), x, 0.0)


@SOLVERS.register
class Broyden(Solver):
    """Limited-memory multisecant good Broyden on g(z) = f(z) - z with a conjugated secant basis.

    ``H ~ (dg/dz)^-1`` starts at -I (the first step is a Picard step) and satisfies the secant equations
    ``H q_i = p_i`` of every pair it keeps, not only the last: ``H = -I + (P + Q)^T M^-1 P``, ``M = P Q^T``
    (projected / multisecant Broyden: Gay & Schnabel 1978; "generalized Broyden's first method" of Fang &
    Saad 2009 with H0 = -I). The step ``z - H g`` is a Galerkin projection followed by a Picard step:
    ``c = -M^-1 P g`` and ``z_next = f(z) + (P + Q)^T c``. Each new pair ``(s, y) = (dz, dg)`` is first made
    conjugate to the kept ones, ``(p, q) = (s, y) - sum_i gamma_i (p_i, q_i)`` with ``p_i . q = 0``, and
    scaled to ``||p|| = 1``: M is then lower triangular in age order (two triangular solves a step), H does
    not change (it depends on the pairs' span only), and the raw secant equation ``H dg = dz`` holds after
    every update, also when the memory is full and the oldest conjugated pair is dropped. On a linear map
    with symmetric W and spectral radius < 1 the iterates are, in exact arithmetic, conjugate gradient's on
    ``(I - W) z = x`` each followed by a Picard step, for any m >= 3 (the Lanczos short recurrence keeps a new
    pair conjugate to the dropped ones): fewer map evaluations than TorchDEQ's full-memory rank-one Broyden,
    and closer to the fixed point at equal evaluations (benchmarks/bench_solvers.py).
    A nonlinear map can make the kept pairs contradict the new one; the conjugated pair's curvature
    ``|cos(p, q)|`` then collapses against the raw ``|cos(s, y)|`` a step or two before the residual rises, so
    a sample whose pair fails ``|cos(p, q)| >= max(pivot, consistency |cos(s, y)|)`` (or shrinks to rounding,
    ``||p|| < sqrt(eps) ||s||``) restarts from the raw pair alone (a measured rule, not a proven one).
    Memory per sample: 2 m D numbers for the pairs and m^2 for M (the buffers grow on demand up to m).
    """

    name = "broyden"
    Options = BroydenOptions

    def init(self, z: Tensor) -> State:
        return {"z_prev": None, "g_prev": None}

    def _grown(self, state: State, b: int, d: int, like: Tensor) -> State:
        """The buffers with twice the slots (at most m; 16 to start); the ring fills slots in order before it wraps."""
        n = state["p"].shape[1] if "p" in state else 0
        extra = min(max(n, 16), self.opts.m - n)
        new = {
            "p": like.new_zeros((b, extra, d)),
            "q": like.new_zeros((b, extra, d)),
            "pg": like.new_zeros((b, extra)),  # p_i . g at the last step: P y = P g - P g_prev
            "valid": torch.zeros((b, extra), dtype=torch.bool, device=like.device),
        }
        if not n:
            return {**state, **new, "pq": like.new_zeros((b, extra, extra)), "k": 0}  # pq[:, i, j] = p_i . q_j
        grown = {key: torch.cat([state[key], new[key]], 1) for key in new}
        return {**state, **grown, "pq": torch.nn.functional.pad(state["pq"], (0, extra, 0, extra))}

    def _step(self, state: State, s: Tensor, y: Tensor, g: Tensor) -> tuple[Tensor, State]:
        """Keep the pair (s, y) and return the correction ``(P + Q)^T c`` for the residual g (in place, under
        the caller's no_grad). About 6 m D multiply-adds: P g (P y is P g less the last step's P g_prev), the
        conjugation, the new row Q p of M and the correction; and two m x m triangular solves."""
        opts, k = self.opts, state.get("k", 0)
        if "p" not in state or k == state["p"].shape[1]:
            state = self._grown(state, s.shape[0], s.shape[1], s)
        p_buf, q_buf, pq, valid = state["p"], state["q"], state["pq"], state["valid"]
        pg = _mv(p_buf, g)
        # forget slot k (the oldest pair once the memory is full) before conjugating against the others, so
        # that the raw secant equation H y = s holds after the update
        valid[:, k] = False
        pq[:, k, :] = 0
        pq[:, :, k] = 0
        gamma = _solve_lower(pq, valid, pg - state["pg"], (k - 1) % pq.shape[1])
        p, q = s - _comb(gamma, p_buf), y - _comb(gamma, q_buf)
        # |cos| of the raw and the conjugated pair; a NaN fails every test below (restart, then not kept)
        vnorm, tiny, cut = torch.linalg.vector_norm, torch.finfo(s.dtype).tiny, torch.finfo(s.dtype).eps ** 0.5
        ns, ny, np_, nq = vnorm(s, dim=1), vnorm(y, dim=1), vnorm(p, dim=1), vnorm(q, dim=1)
        cos_sy = ((s * y).sum(1) / (ns * ny).clamp_min(tiny)).abs()
        cos_pq = ((p * q).sum(1) / (np_ * nq).clamp_min(tiny)).abs()
        restart = ~(cos_pq >= (opts.consistency * cos_sy).clamp_min(opts.pivot))
        restart |= ~(np_ >= cut * ns) | ~(nq >= cut * ny)
        valid.masked_fill_(restart.unsqueeze(1), False)
        rows = restart.unsqueeze(1)
        p, q = torch.where(rows, s, p), torch.where(rows, y, q)
        nrm, cos = torch.where(restart, ns, np_), torch.where(restart, cos_sy, cos_pq)
        # kept when finite with a pivot p . q that is not negligible (|cos| > sqrt(eps), the rank-one test)
        ok = ((nrm < float("inf")) & (nrm > tiny) & (cos > cut)).unsqueeze(1)
        inv = 1 / nrm.clamp_min(tiny).unsqueeze(1)
        p_buf[:, k] = p = torch.where(ok, p * inv, 0.0).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        q_buf[:, k] = torch.where(ok, q * inv, 0.0).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        pq[:, k, :] = _mv(q_buf, p)  # p . q_j; the column p_i . q stays 0 (conjugated)
        valid[:, k] = ok.squeeze(1)
        pg[:, k] = (p * g).sum(1)
        c = _solve_lower(pq, valid, pg, k)
        return _comb(c, p_buf) + _comb(c, q_buf), {**state, "pg": pg, "k": (k + 1) % self.opts.m}

    def update(self, z: Tensor, fz: Tensor, res: Tensor | None, state: State) -> tuple[Tensor, State, Info]:
        b = z.shape[0]
        with torch.no_grad(), exact(z):
            dtype = torch.promote_types(z.dtype, torch.float32)
            zf = z.detach().reshape(b, -1).to(dtype)
            gf = (fz.detach() - z.detach()).reshape(b, -1).to(dtype)
            if state["z_prev"] is None:  # H = -I: a Picard step
                return fz, {**state, "z_prev": zf, "g_prev": gf}, {}
            corr, state = self._step(state, zf - state["z_prev"], gf - state["g_prev"], gf)
            # z_next = z - H g = f(z) - (P + Q)^T M^-1 P g; the correction is a constant for autograd
            corr = torch.nan_to_num(corr, nan=0.0, posinf=0.0, neginf=0.0).reshape(z.shape).to(z.dtype)
        return fz - corr, {**state, "z_prev": zf, "g_prev": gf}, {}


@dataclass(frozen=True)
class SafeAndersonOptions(AndersonOptions):
    """Defaults for accuracy per map evaluation: a longer history, a tiny regulariser and the
    restart safeguard (a sample whose residual rises tenfold above its best drops its history)."""

    m: int = 20
    reg: float = 1e-10
    restart: float | None = 10.0


@SOLVERS.register
class SafeAnderson(Anderson):
    """Anderson with a long history and a restart when the residual rises (``safe_anderson``)."""

    name = "safe_anderson"
    Options = SafeAndersonOptions
