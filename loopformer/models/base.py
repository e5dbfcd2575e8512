"""The model contract: a model defines embed / init_state / step / readout, the engine loops.

``LoopedModel.forward`` is the only place a model meets the loop engine; no model writes its
own iteration loop. ``ModelConfig`` holds the fields every family shares; each family's
config dataclass extends it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from loopformer.loop import LoopConfig, LoopResult, run_loop


@dataclass
class ModelConfig:
    """Fields shared by every model family."""

    vocab_size: int = 16
    seq_len: int = 81  # input length; positions beyond it are allowed when rope / no positions
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2  # layers per looped block (or total for the plain transformer)
    expansion: float = 4.0  # SwiGLU width factor
    causal: bool = False
    rope: bool = True
    # a learned absolute position table added to the token embeddings (TRM / HRM ``pos_encodings: learned``);
    # independent of ``rope`` (set rope=false for learned positions only); needs inputs of length seq_len
    learned_positions: bool = False
    grid: tuple[int, int] | None = None  # token layout for 2-D convolutions (e.g. (9, 9) for Sudoku)
    num_puzzle_ids: int = 0  # size of a per-puzzle embedding table (TRM/HRM ARC), 0 = none
    puzzle_emb_len: int = 0  # tokens the puzzle embedding occupies (prepended); 0 = none
    tie_embeddings: bool = False
    q_head: bool = False  # a halting / Q logit read from the state (TRM, HRM, FPRM)
    loop: LoopConfig = field(default_factory=LoopConfig)  # the model's default loop (train and eval)

    def replace(self, **changes: object) -> ModelConfig:
        return dataclasses.replace(self, **changes)


@dataclass
class ModelOutput:
    logits: Tensor  # [B, T, V]
    state: Tensor  # final state, the trainer's carry (detach before reusing it)
    loop: LoopResult | None  # the engine's trace (steps, residuals, converged...)
    q_logits: Tensor | None = None  # [B] halting / Q logit
    aux_loss: Tensor | None = None  # scalar added to the task loss (e.g. ACT ponder cost)


class LoopedModel(nn.Module):
    """Base class: subclasses implement embed, init_state, step and readout."""

    config: ModelConfig

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    # -- the four functions a family defines -------------------------------------------------
    def embed(self, inputs: Tensor, puzzle_ids: Tensor | None = None) -> tuple[Tensor, ...]:
        """Input tokens [B, T] -> batch-first context tensors passed to every step."""
        raise NotImplementedError

    def init_state(self, ctx: tuple[Tensor, ...], generator: torch.Generator | None = None) -> Tensor:
        """The initial iterate z0 [B, ...] for a fresh sample."""
        raise NotImplementedError

    def step(self, z: Tensor, *ctx: Tensor) -> Tensor:
        """One application of the looped body."""
        raise NotImplementedError

    def readout(self, z: Tensor, *ctx: Tensor) -> Tensor:
        """State -> logits [B, T, V] (also used by the logit lens on intermediate states)."""
        raise NotImplementedError

    # -- optional heads -------------------------------------------------------------------------
    def q_head(self, z: Tensor, *ctx: Tensor) -> Tensor | None:
        """Halting / Q logit [B] (TRM, HRM, FPRM); None when the model has none."""
        return None

    def halting_readout(self, z: Tensor, *ctx: Tensor) -> Tensor:
        """The logits the KL + entropy halting rule reads (default: ``readout``, every position).

        A model may restrict them, e.g. to the answer position (``RecurrentConfig.halt_position``)."""
        return self.readout(z, *ctx)

    def halt_prob(self, z: Tensor, *ctx: Tensor) -> Tensor:
        """ACT halting probability [B] or [B, T]; only models trained with ACT define it."""
        raise NotImplementedError(f"{type(self).__name__} has no ACT halting unit")

    def aux_loss(self, result: LoopResult) -> Tensor | None:
        """Extra training loss from the loop (e.g. ponder cost); None by default."""
        return None

    def training_draws(self, inputs: Tensor, generator: torch.Generator | None) -> dict[str, Tensor]:
        """The random tensors a training forward on ``inputs`` draws from its generator after ``init_state``, drawn
        ahead: ``forward``'s keyword arguments for a compiled step, which takes no generator (none by default)."""
        return {}

    # -- the engine call --------------------------------------------------------------------------
    def forward(
        self,
        inputs: Tensor,
        loop: LoopConfig | None = None,
        state: Tensor | None = None,
        puzzle_ids: Tensor | None = None,
        callback: Callable[[int, Tensor, Tensor], None] | None = None,
        generator: torch.Generator | None = None,
        solver_state: dict[str, Tensor] | None = None,
    ) -> ModelOutput:
        """One engine call from ``state`` (or ``init_state``); ``solver_state`` continues the solver's
        per-sample state of a previous call (``ModelOutput.loop.stats``, see ``run_loop``)."""
        cfg = loop if loop is not None else self.config.loop
        ctx = self.embed(inputs, puzzle_ids)
        z0 = state if state is not None else self.init_state(ctx, generator)
        own_halting_readout = type(self).halting_readout is not LoopedModel.halting_readout
        res = run_loop(
            self.step,
            z0,
            cfg,
            ctx=ctx,
            readout=self.halting_readout if cfg.halting == "kl_entropy" else None,
            halt_fn=self.halt_prob if cfg.halting == "act" else None,
            callback=callback,
            solver_state=solver_state,
        )
        reuse = res.logits is not None and not own_halting_readout
        logits = res.logits if reuse else self.readout(res.state, *ctx)
        return ModelOutput(
            logits=logits,
            state=res.state,
            loop=res,
            q_logits=self.q_head(res.state, *ctx),
            aux_loss=self.aux_loss(res),
        )

    def blocks_per_step(self) -> float:
        """Transformer blocks one loop step applies to a sample: the unit of test-time compute that ``compare``,
        ``eval`` reports and the head-to-head count (``evaluate`` multiplies each forward call's loop steps by
        it). A step of a looped stack of ``n_layers`` blocks by default; a model whose step applies its net
        more than once says so, and one whose step varies (an inner solve) reports what its latest forward
        call measured."""
        return int(self.config.n_layers)

    def num_parameters(self, exclude_puzzle_embedding: bool = True) -> int:
        """Parameter count; the per-puzzle embedding table is excluded by default (as the papers count)."""
        skip = {id(p) for n, p in self.named_parameters() if exclude_puzzle_embedding and "puzzle_emb" in n}
        return sum(p.numel() for p in self.parameters() if id(p) not in skip)
