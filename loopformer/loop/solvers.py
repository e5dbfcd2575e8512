"""Fixed-point solvers: given z and f(z), form the next iterate. All state is per sample.

Each solver evaluates ``f`` exactly once per iteration (the engine does it) and turns
``(z, f(z), residual)`` into the next iterate. Solver state is a dict of batch-first tensors
(or lists of them) so the engine can compact it when samples halt. A solver is one class
registered in ``SOLVERS``; its class attributes tell the engine what it needs to know
(``Solver``), its options are the frozen dataclass ``Options``, grouped in ``LoopConfig`` under
the solver's name (``LoopConfig(solver="anderson", anderson=AndersonOptions(m=5))``).

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
- ``broyden``: limited-memory "good" Broyden on g(z) = f(z) - z with inverse-Jacobian estimate
  ``H = -I + sum_i u_i v_i^T``, at most ``m`` rank-one terms; when the memory is full it restarts
  from ``H = -I`` and forms the new term against it, so the secant condition ``H dg = dx`` holds after
  the restart too (bounded memory; dropping only the oldest term diverges).
Mixing coefficients (Anderson a_i, Broyden u_i v_i, damping eta) are constants for autograd:
under ``grad="bptt"`` gradients flow through the iterates, not through the coefficients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from loopformer.loop.registry import NoOptions, Registry

if TYPE_CHECKING:
    from loopformer.loop.config import LoopConfig

State = dict[str, Any]
Info = dict[str, Tensor]


def option_error(group: str, field: str, legacy: dict[str, str], message: str) -> ValueError:
    """``LoopConfig.<group>.<field> / <flat name> <message>`` (both spellings, for searching)."""
    flat = f" / {legacy[field]}" if field in legacy else ""
    return ValueError(f"LoopConfig.{group}.{field}{flat} {message}")


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
    legacy_names: ClassVar[dict[str, str]] = {
        "gamma": "damp_gamma",
        "patience": "damp_patience",
        "min_step": "damp_min_step",
        "min_improvement": "damp_min_improvement",
    }

    def __post_init__(self) -> None:
        if not 0 < self.gamma < 1:
            raise option_error("damped", "gamma", self.legacy_names, f"must be in (0, 1), got {self.gamma!r}")
        if not isinstance(self.patience, int) or isinstance(self.patience, bool) or self.patience < 1:
            raise option_error(
                "damped", "patience", self.legacy_names, f"must be an integer >= 1, got {self.patience!r}"
            )
        if not self.min_step > 0:
            raise option_error("damped", "min_step", self.legacy_names, f"must be > 0, got {self.min_step!r}")
        if not 0 <= self.min_improvement < float("inf"):
            raise option_error(
                "damped", "min_improvement", self.legacy_names, f"must be >= 0, got {self.min_improvement!r}"
            )


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


from loopformer.loop.quasi_newton import (  # noqa: E402
    Anderson,
    AndersonOptions,
    Broyden,
    BroydenOptions,
    SafeAnderson,
    SafeAndersonOptions,
)

__all__ = [
    "SOLVERS",
    "Anderson",
    "AndersonOptions",
    "Broyden",
    "BroydenOptions",
    "Damped",
    "DampedOptions",
    "Picard",
    "SafeAnderson",
    "SafeAndersonOptions",
    "Solver",
    "option_error",
]
