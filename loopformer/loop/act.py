"""Graves ACT halting (arXiv 1603.08983), per sample or per unit (token); see halting.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from loopformer.loop.halting import HALTINGS, Halting, State
from loopformer.loop.solvers import option_error

if TYPE_CHECKING:
    from loopformer.loop.config import LoopConfig


@dataclass(frozen=True)
class ACTOptions:
    """A unit halts once its cumulative halting probability reaches 1 - eps."""

    eps: float = 0.01
    legacy_names: ClassVar[dict[str, str]] = {"eps": "act_eps"}

    def __post_init__(self) -> None:
        if not 0 < self.eps < 1:
            raise option_error("act", "eps", self.legacy_names, f"must be in (0, 1), got {self.eps!r}")


@HALTINGS.register
class ACTHalting(Halting):
    """Graves ACT with per-sample or per-unit (token) halting probabilities."""

    name = "act"
    Options = ACTOptions
    every_step = True
    edits_iterate = True
    stats = ("ponder_cost",)
    learned = True

    def __init__(self, cfg: LoopConfig, readout=None, halt_fn=None) -> None:
        if halt_fn is None:
            raise ValueError(
                "halting='act' needs halt_fn=(z, *ctx) -> halting probability [B] or [B, T] in run_loop"
            )
        super().__init__(cfg, readout, halt_fn)

    @classmethod
    def check_config(cls, cfg: LoopConfig) -> None:
        from loopformer.loop.grad import GRADS
        from loopformer.loop.solvers import SOLVERS

        if not SOLVERS.get(cfg.solver).returns_step:
            raise ValueError(
                f"LoopConfig.halting='act' needs a solver whose iterate is f(z) (solver='picard'), "
                f"got {cfg.solver!r}"
            )
        if not GRADS.get(cfg.grad).full_graph:
            raise ValueError(
                f"LoopConfig.halting='act' needs grad='bptt' (weights are learned), got {cfg.grad!r}"
            )
        if cfg.min_steps:
            raise ValueError("LoopConfig.halting='act' does not support min_steps > 0 (Graves ACT has none)")

    def init(self, z0: Tensor, ctx: tuple[Any, ...]) -> State:
        # unit shape is only known after the first halt_fn call
        return {
            "acc": torch.zeros_like(z0),
            "cum": None,
            "halted": None,
            "n": None,
            "rem": None,
            "forced": None,
        }

    def _units(self, h: Tensor, z: Tensor) -> Tensor:
        if h.dim() == 0 or h.shape != z.shape[: h.dim()]:
            raise ValueError(
                f"halt_fn must return halting probabilities of shape [B] or [B, T] matching the state's leading "
                f"dims {tuple(z.shape)}, got {tuple(h.shape)}"
            )
        return h

    @staticmethod
    def _fresh(h: Tensor, state: State) -> State:
        zeros = torch.zeros_like(h)
        flags = {k: torch.zeros(h.shape, dtype=torch.bool, device=h.device) for k in ("halted", "forced")}
        n = torch.zeros(h.shape, dtype=torch.long, device=h.device)
        return {**state, "cum": zeros, "n": n, "rem": zeros, **flags}

    def check(self, t, z, z_next, res, state, ctx):
        h = self._units(self.halt_fn(z_next, *ctx), z_next)
        if state["cum"] is None:
            state = self._fresh(h, state)
        cum, halted = state["cum"], state["halted"]
        expand = (-1, *h.shape[1:], *([1] * (z.dim() - h.dim())))
        bview = halted.view(expand) if halted.dim() else halted
        z_next = torch.where(bview, z, z_next)  # halted units stay frozen
        active = ~halted
        cum_new = cum + h
        last = t + 1 >= self.cfg.max_steps
        reached = cum_new.detach() >= 1 - self.opts.eps
        halt_now = active & (reached | last)
        remainder = 1 - cum
        w = torch.where(halt_now, remainder, torch.where(active, h, torch.zeros_like(h)))
        acc = state["acc"] + w.view(expand).to(z_next.dtype) * z_next
        new_state = {
            "acc": acc,
            "cum": torch.where(active, cum_new, cum),
            "halted": halted | halt_now,
            "n": torch.where(halt_now, t + 1, state["n"]),
            "rem": torch.where(halt_now, remainder, state["rem"]),
            "forced": state["forced"] | (halt_now & ~reached),
        }
        units = new_state["halted"].reshape(h.shape[0], -1)
        done = units.all(dim=1)
        conv = done & ~new_state["forced"].reshape(h.shape[0], -1).any(dim=1)
        return z_next, done, conv, new_state

    def output(self, z_next: Tensor, state: State) -> Tensor:
        return state["acc"]

    def sample_stats(self, state: State) -> dict[str, Tensor]:
        return {"ponder_cost": self.ponder(state)}

    @staticmethod
    def ponder(state: State) -> Tensor:
        """Graves ponder cost N + R per sample (mean over units); 0 before the first step."""
        if state["n"] is None:
            return torch.zeros(state["acc"].shape[0], dtype=state["acc"].dtype, device=state["acc"].device)
        cost = state["n"].to(state["rem"].dtype) + state["rem"]
        return cost.reshape(cost.shape[0], -1).mean(dim=1)
