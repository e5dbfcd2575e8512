"""Halting rules: per-sample done masks, evaluated after every iteration.

Each rule sees the iteration index, the previous and new iterate, the residual and the active
context rows, and returns ``(z_next, done, converged, state)``; its state is batch-first so the
engine can compact it. The engine adds the step cap, stalls and divergence on top of every rule.
A rule is one class registered in ``HALTINGS``; its class attributes tell the engine what it
needs to know (``Halting``), its options are the frozen dataclass ``Options``.

- ``fixed``: never halts before ``max_steps``; ``converged`` reports residual < tol at the end.
- ``residual``: halt at the first step (>= min_steps) with residual < tol (FPRM eps; Attractor tol).
- ``batch_residual``: every sample halts at the first step where all running samples' residuals are
  below tol (FPRM's inference in the authors' code); per-sample otherwise identical to ``residual``.
  With ``LoopConfig.halt_group`` = g > 0 "all" means all running rows of the sample's group, the
  consecutive rows ``[k g, (k + 1) g)`` of the batch (``group_all``): the Attractor LM's stop spans its
  micro-batch of 32 sequences, not the whole batch.
- ``kl_entropy``: Loop-Think-Generalize: read ``p_t = softmax(readout(z_t))`` every step (p_0
  from z0) and halt at the first t >= 1 with ``KL(p_t || p_{t-1}) < kl_threshold`` AND
  ``H(p_t) < entropy_threshold`` (nats); per-position values reduce to one per sample by max
  (all positions settled) or mean.
- ``act``: Graves ACT (arXiv 1603.08983) / Universal Transformer. ``halt_fn(z_t) -> h_t`` in
  (0, 1), shape [B] or per unit [B, T] (broadcast over the state's trailing dims). A unit halts at
  the first N with ``sum_{t<=N} h_t >= 1 - eps`` or at ``max_steps`` (the last step always halts);
  its weights are ``h_t`` for t < N and the remainder ``R = 1 - sum_{t<N} h_t`` at N (they sum
  to 1); the output is ``sum_t w_t z_t``; ponder cost ``N + R`` (mean over units). Halted units are
  frozen; a sample halts when all its units have.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from loopformer.loop.config import LoopConfig, NoOptions, Registry, option_error
from loopformer.loop.grad import GRADS
from loopformer.loop.solvers import SOLVERS

State = dict[str, Any]


class Halting:
    """Base rule: ``check`` returns (z_next, done, converged, state).

    What the engine needs to know (class attributes):

    - ``stops_early``: the rule can stop a sample before ``max_steps`` (``fixed`` cannot);
    - ``every_step``: ``check`` must run after every iteration (it keeps state or edits the
      iterate); otherwise the engine calls it only when ``residual_bound`` says a sample could stop;
    - ``edits_iterate``: ``check`` may return a z_next other than the solver's;
    - ``stats``: per-sample values ``sample_stats(state)`` reports (``ponder_cost`` also becomes
      ``LoopResult.ponder_cost``);
    - ``learned``: the rule is part of what training learns (ACT: the model's halting weights
      enter its output and loss), so a training mode that fixes the loop count (simple mode's
      sampled ``R``) keeps it with ``R`` as the cap; other rules give way to ``fixed`` there;
    - ``batch_stalls``: a solver's stall stops the batch only once every running sample has
      stalled (until then a stalled sample keeps iterating); otherwise each stalled sample stops.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    stops_early: ClassVar[bool] = True
    every_step: ClassVar[bool] = False
    edits_iterate: ClassVar[bool] = False
    stats: ClassVar[tuple[str, ...]] = ()
    learned: ClassVar[bool] = False
    batch_stalls: ClassVar[bool] = False

    def __init__(
        self,
        cfg: LoopConfig,
        readout: Callable[..., Tensor] | None = None,
        halt_fn: Callable[..., Tensor] | None = None,
    ) -> None:
        self.cfg = cfg
        self.opts = cfg.options_for(type(self))
        self.readout = readout
        self.halt_fn = halt_fn

    @classmethod
    def check_config(cls, cfg: LoopConfig) -> None:
        """Raise ValueError when ``cfg`` combines this rule with something it cannot do."""

    def residual_bound(self, t: int) -> float:
        """A sample can be done after iteration t only if its residual is below this (0: none can)."""
        return 0.0

    def init(self, z0: Tensor, ctx: tuple[Any, ...]) -> State:
        return {}

    def check(
        self, t: int, z: Tensor, z_next: Tensor, res: Tensor, state: State, ctx: tuple[Any, ...]
    ) -> tuple[Tensor, Tensor, Tensor, State]:
        raise NotImplementedError

    def output(self, z_next: Tensor, state: State) -> Tensor:
        """The value a halting sample returns (ACT: the weighted sum of its iterates)."""
        return z_next

    def sample_stats(self, state: State) -> dict[str, Tensor]:
        return {}

    def batch_all(self, mask: Tensor, state: State) -> Tensor:
        """For a rule with ``batch_stalls``: per running row, whether ``mask`` holds for every running row it
        halts with (the whole batch here; its group under ``halt_group``)."""
        return mask.all().expand_as(mask)


def halt_groups(b: int, group: int, device: torch.device) -> Tensor | None:
    """Each row's group of ``group`` consecutive rows of a batch of ``b`` (None: one group, the batch)."""
    if group <= 0 or group >= b:
        return None
    return torch.arange(b, device=device) // group


def group_all(mask: Tensor, groups: Tensor | None) -> Tensor:
    """Per row: ``mask`` holds for every row of its group (``groups``: the rows' group ids, None: all rows)."""
    if groups is None:
        return mask.all().expand_as(mask)
    # the running rows' groups renumbered 0, 1, ... (rows stay in batch order, so equal ids are adjacent):
    # fewer ids than rows, no host read
    dense = torch.cumsum(torch.cat([groups.new_ones(1), (groups[1:] != groups[:-1]).long()]), 0) - 1
    failing = torch.zeros(mask.shape[0], dtype=torch.int32, device=mask.device)
    failing.index_add_(0, dense, (~mask).to(torch.int32))
    return failing.index_select(0, dense) == 0


HALTINGS: Registry[type[Halting]] = Registry("halting", Halting, aliases={"never": "fixed"})


@HALTINGS.register
class FixedHalting(Halting):
    name = "fixed"
    stops_early = False

    def check(self, t, z, z_next, res, state, ctx):
        conv = res < self.cfg.tol
        return z_next, torch.zeros_like(conv), conv, state


@HALTINGS.register
class ResidualHalting(Halting):
    name = "residual"

    def residual_bound(self, t: int) -> float:
        return self.cfg.tol if t + 1 >= self.cfg.min_steps else 0.0

    def check(self, t, z, z_next, res, state, ctx):
        conv = res < self.cfg.tol
        done = conv if t + 1 >= self.cfg.min_steps else torch.zeros_like(conv)
        return z_next, done, conv, state


@HALTINGS.register
class BatchResidualHalting(Halting):
    """Every running sample halts at the first step (>= min_steps) where the *largest* residual of
    the running batch is below tol; until then all keep iterating. FPRM's inference in the authors'
    code (nilskiKonjIzDunava/fprm ``FixedPointReasoningModel_ACTV1.forward`` in eval mode:
    ``residues.max() < fp_thresh``). Stalls too are batch-wide, as that code stops when
    ``stepsize.max() < 1e-3``: a sample whose step size fell below ``min_step`` keeps iterating
    until every running sample's has. Divergence still stops a sample on its own."""

    name = "batch_residual"
    batch_stalls = True

    def residual_bound(self, t: int) -> float:
        return self.cfg.tol if t + 1 >= self.cfg.min_steps else 0.0

    def init(self, z0: Tensor, ctx: tuple[Any, ...]) -> State:
        groups = halt_groups(z0.shape[0], self.cfg.halt_group, z0.device)
        return {} if groups is None else {"group": groups}  # batch-first: compacted with the rows

    def check(self, t, z, z_next, res, state, ctx):
        conv = res < self.cfg.tol
        if t + 1 < self.cfg.min_steps:
            return z_next, torch.zeros_like(conv), conv, state
        return z_next, group_all(conv, state.get("group")), conv, state

    def batch_all(self, mask: Tensor, state: State) -> Tensor:
        return group_all(mask, state.get("group"))


def _reduce(x: Tensor, how: str) -> Tensor:
    flat = x.reshape(x.shape[0], -1)
    return flat.amax(dim=1) if how == "max" else flat.mean(dim=1)


@dataclass(frozen=True)
class KLEntropyOptions:
    """LTG halting thresholds (nats) and how per-position values reduce per sample."""

    kl_threshold: float = 1e-3
    entropy_threshold: float = 3.0
    reduce: str = "max"  # max | mean

    def __post_init__(self) -> None:
        for name in ("kl_threshold", "entropy_threshold"):
            if not getattr(self, name) > 0:
                raise option_error("kl_entropy", name, f"must be > 0, got {getattr(self, name)!r}")
        if self.reduce not in ("max", "mean"):
            raise option_error("kl_entropy", "reduce", f"={self.reduce!r} is not one of 'max', 'mean'")


@HALTINGS.register
class KLEntropyHalting(Halting):
    """LTG: KL(p_t || p_{t-1}) < kl_threshold and H(p_t) < entropy_threshold."""

    name = "kl_entropy"
    Options = KLEntropyOptions
    every_step = True

    def __init__(self, cfg: LoopConfig, readout=None, halt_fn=None) -> None:
        if readout is None:
            raise ValueError("halting='kl_entropy' needs readout=(z, *ctx) -> logits [B, ..., V] in run_loop")
        super().__init__(cfg, readout, halt_fn)

    @torch.no_grad()
    def _logp(self, z: Tensor, ctx: tuple[Any, ...]) -> Tensor:
        logits = self.readout(z, *ctx)
        if logits.shape[0] != z.shape[0]:
            raise ValueError(
                f"readout returned batch {logits.shape[0]}, expected {z.shape[0]} (batch-first logits)"
            )
        return F.log_softmax(
            logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, dim=-1
        )

    def init(self, z0: Tensor, ctx: tuple[Any, ...]) -> State:
        return {"logp": self._logp(z0, ctx)}

    @torch.no_grad()
    def check(self, t, z, z_next, res, state, ctx):
        opts = self.opts
        logp = self._logp(z_next, ctx)
        p = logp.exp()
        kl = _reduce((p * (logp - state["logp"])).sum(-1), opts.reduce)
        entropy = _reduce(-(p * logp).sum(-1), opts.reduce)
        conv = (kl < opts.kl_threshold) & (entropy < opts.entropy_threshold)
        done = conv if t + 1 >= max(1, self.cfg.min_steps) else torch.zeros_like(conv)
        return z_next, done, conv, {"logp": logp, "kl": kl, "entropy": entropy}


# --------------------------------------------------------------------------------------------
# Graves ACT, per sample or per unit (token)
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ACTOptions:
    """A unit halts once its cumulative halting probability reaches 1 - eps."""

    eps: float = 0.01

    def __post_init__(self) -> None:
        if not 0 < self.eps < 1:
            raise option_error("act", "eps", f"must be in (0, 1), got {self.eps!r}")


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
