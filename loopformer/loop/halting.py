"""Halting rules: per-sample done masks, evaluated after every iteration.

Each rule sees the iteration index, the previous and new iterate, the residual and the active
context rows, and returns ``(z_next, done, converged, state)``; its state is batch-first so the
engine can compact it. The engine adds the step cap and divergence on top of every rule.

- ``fixed``: never halts before ``max_steps``; ``converged`` reports residual < tol at the end.
- ``residual``: halt at the first step (>= min_steps) with residual < tol (FPRM eps; Attractor tol).
- ``kl_entropy``: LTG (SYSTEMS.md section 3): read ``p_t = softmax(readout(z_t))`` every step (p_0
  from z0) and halt at the first t >= 1 with ``KL(p_t || p_{t-1}) < kl_threshold`` AND
  ``H(p_t) < entropy_threshold`` (nats); per-position values reduce to one per sample by max
  (all positions settled) or mean.
- ``act``: Graves ACT / Universal Transformer (SYSTEMS.md section 4). ``halt_fn(z_t) -> h_t`` in
  (0, 1), shape [B] or per unit [B, T] (broadcast over the state's trailing dims). A unit halts at
  the first N with ``sum_{t<=N} h_t >= 1 - eps`` or at ``max_steps`` (the last step always halts);
  its weights are ``h_t`` for t < N and the remainder ``R = 1 - sum_{t<N} h_t`` at N (they sum
  to 1); the output is ``sum_t w_t z_t``; ponder cost ``N + R`` (mean over units). Halted units are
  frozen; a sample halts when all its units have.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from loopformer.loop.config import LoopConfig

State = dict[str, Any]


class Halting:
    """Base rule: ``check`` returns (z_next, done, converged, state)."""

    def __init__(self, cfg: LoopConfig) -> None:
        self.cfg = cfg

    def init(self, z0: Tensor, ctx: tuple[Any, ...]) -> State:
        return {}

    def check(
        self, t: int, z: Tensor, z_next: Tensor, res: Tensor, state: State, ctx: tuple[Any, ...]
    ) -> tuple[Tensor, Tensor, Tensor, State]:
        raise NotImplementedError

    def output(self, z_next: Tensor, state: State) -> Tensor:
        """The value a halting sample returns (ACT: the weighted sum of its iterates)."""
        return z_next


class FixedHalting(Halting):
    def check(self, t, z, z_next, res, state, ctx):
        conv = res < self.cfg.tol
        return z_next, torch.zeros_like(conv), conv, state


class ResidualHalting(Halting):
    def check(self, t, z, z_next, res, state, ctx):
        conv = res < self.cfg.tol
        done = conv if t + 1 >= self.cfg.min_steps else torch.zeros_like(conv)
        return z_next, done, conv, state


def _reduce(x: Tensor, how: str) -> Tensor:
    flat = x.reshape(x.shape[0], -1)
    return flat.amax(dim=1) if how == "max" else flat.mean(dim=1)


class KLEntropyHalting(Halting):
    """LTG: KL(p_t || p_{t-1}) < kl_threshold and H(p_t) < entropy_threshold."""

    def __init__(self, cfg: LoopConfig, readout: Callable[..., Tensor]) -> None:
        super().__init__(cfg)
        self.readout = readout

    @torch.no_grad()
    def _logp(self, z: Tensor, ctx: tuple[Any, ...]) -> Tensor:
        logits = self.readout(z, *ctx)
        if logits.shape[0] != z.shape[0]:
            raise ValueError(f"readout returned batch {logits.shape[0]}, expected {z.shape[0]} (batch-first logits)")
        return F.log_softmax(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, dim=-1)

    def init(self, z0: Tensor, ctx: tuple[Any, ...]) -> State:
        return {"logp": self._logp(z0, ctx)}

    @torch.no_grad()
    def check(self, t, z, z_next, res, state, ctx):
        cfg = self.cfg
        logp = self._logp(z_next, ctx)
        p = logp.exp()
        kl = _reduce((p * (logp - state["logp"])).sum(-1), cfg.kl_reduce)
        entropy = _reduce(-(p * logp).sum(-1), cfg.kl_reduce)
        conv = (kl < cfg.kl_threshold) & (entropy < cfg.entropy_threshold)
        done = conv if t + 1 >= max(1, cfg.min_steps) else torch.zeros_like(conv)
        return z_next, done, conv, {"logp": logp, "kl": kl, "entropy": entropy}


class ACTHalting(Halting):
    """Graves ACT with per-sample or per-unit (token) halting probabilities."""

    def __init__(self, cfg: LoopConfig, halt_fn: Callable[..., Tensor]) -> None:
        super().__init__(cfg)
        self.halt_fn = halt_fn

    def init(self, z0: Tensor, ctx: tuple[Any, ...]) -> State:
        # unit shape is only known after the first halt_fn call
        return {"acc": torch.zeros_like(z0), "cum": None, "halted": None, "n": None, "rem": None, "forced": None}

    def _units(self, h: Tensor, z: Tensor) -> Tensor:
        if h.dim() == 0 or h.shape != z.shape[: h.dim()]:
            raise ValueError(
                f"halt_fn must return halting probabilities of shape [B] or [B, T] matching the state's leading "
                f"dims {tuple(z.shape)}, got {tuple(h.shape)}"
            )
        return h

    def check(self, t, z, z_next, res, state, ctx):
        cfg = self.cfg
        h = self._units(self.halt_fn(z_next, *ctx), z_next)
        if state["cum"] is None:
            zeros = torch.zeros_like(h)
            state = {**state, "cum": zeros, "halted": torch.zeros(h.shape, dtype=torch.bool, device=h.device),
                     "n": torch.zeros(h.shape, dtype=torch.long, device=h.device), "rem": zeros,
                     "forced": torch.zeros(h.shape, dtype=torch.bool, device=h.device)}
        cum, halted = state["cum"], state["halted"]
        expand = (-1, *h.shape[1:], *([1] * (z.dim() - h.dim())))
        bview = halted.view(expand) if halted.dim() else halted
        z_next = torch.where(bview, z, z_next)  # halted units stay frozen
        active = ~halted
        cum_new = cum + h
        last = t + 1 >= cfg.max_steps
        reached = cum_new.detach() >= 1 - cfg.act_eps
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

    @staticmethod
    def ponder(state: State) -> Tensor:
        """Graves ponder cost N + R per sample (mean over units)."""
        cost = state["n"].to(state["rem"].dtype) + state["rem"]
        return cost.reshape(cost.shape[0], -1).mean(dim=1)


def make_halting(
    cfg: LoopConfig, readout: Callable[..., Tensor] | None, halt_fn: Callable[..., Tensor] | None
) -> Halting:
    if cfg.halting == "fixed":
        return FixedHalting(cfg)
    if cfg.halting == "residual":
        return ResidualHalting(cfg)
    if cfg.halting == "kl_entropy":
        if readout is None:
            raise ValueError("halting='kl_entropy' needs readout=(z, *ctx) -> logits [B, ..., V] in run_loop")
        return KLEntropyHalting(cfg, readout)
    if cfg.halting == "act":
        if halt_fn is None:
            raise ValueError("halting='act' needs halt_fn=(z, *ctx) -> halting probability [B] or [B, T] in run_loop")
        return ACTHalting(cfg, halt_fn)
    raise ValueError(f"unknown halting {cfg.halting!r}")
