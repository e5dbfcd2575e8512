"""Attractor Models (Fein-Ashley and Rashidinejad, arXiv 2605.12466).

A backbone proposes output embeddings, an attractor head refines them to an equilibrium:
- backbone: ``c = T_b(E(x))``, ``n_backbone`` ordinary pre-norm blocks (causal for language);
- attractor head ``H``: ``n_layers`` weight-tied pre-norm blocks, each sub-layer output gated per
  channel, ``u <- u + gamma * S(RMSNorm(u))`` with ``gamma = gamma_max * sigmoid(g)``; ``g``
  (parameter ``gate_logit`` [n_layers, 2, d], excluded from weight decay by ``no_weight_decay()``)
  is initialised so gamma = ``layer_scale_init`` (0.75), which starts the map contractive.
  Write ``H(u) = u + Delta(u)``; Delta is accumulated exactly as the sum of the gated sub-layer
  outputs (no ``H(u) - u`` cancellation).
- the map (``step``), with persistent injection of the proposal:
    ``add``    (default, the paper's form)  ``f(y, c) = H(y + c) - y = c + Delta(y + c)``
    ``concat`` (the paper's alternative)    ``f(y, c) = c + Delta(W [y; c])``, W: 2d -> d
               initialised to ``[I, I]`` so it starts equal to the additive form;
  solved ``y* = f(y*, c)`` from ``y0 = c`` (``init_state`` returns c).
- output: tied unembedding of ``RMSNorm(y*)`` (``tie_embeddings`` True by default).

Default loop: Anderson (m 5, relative regulariser 1e-4, mixing 1.0), residual halting at
``||f(y) - y|| / ||y||`` < 3e-4 between 4 and 12 iterations (puzzles; language uses 6..64 through the
loop config), gradient ``neumann`` with one term: ``u = v + J^T v`` backpropagated through one
recomputed f (the code's "onestep"; ``neumann_clip`` bounds ``||J^T v||`` by clip * ||v||). The
paper's cheapest form ``u = v`` is ``grad="onestep"``; the full adjoint solve is ``grad="ift"``.

Equilibrium internalization: because the proposal c is both the initial iterate and the injected
signal, training pulls the backbone toward proposing c already close to y*; the solver's residual
at y0 = c shrinks, iteration counts fall to the minimum and at inference 0 or 1 solver iterations
give peak accuracy. A DEQ, which starts from y0 = 0 and injects only the input embedding, has no
such pressure and its iteration counts grow during training. ``proposal=False`` is that DEQ-style
ablation: no backbone is built (``n_backbone`` is ignored), the injection is the token embedding
``c = E(x)`` and ``y0 = 0``. ``internalization_gap(inputs)`` measures the relative residual at y0,
the quantity the claim is about.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel, ModelConfig
from loopformer.models.transformer import InputEmbedding, OutputHead, make_blocks

ATTRACTOR_INJECTIONS = ("add", "concat")


def _default_loop() -> LoopConfig:
    return LoopConfig(
        solver="anderson",
        anderson_m=5,
        halting="residual",
        tol=3e-4,
        residual_norm="rel_l2",
        min_steps=4,
        max_steps=12,
        grad="neumann",
        grad_steps=1,
    )


@dataclass
class AttractorConfig(ModelConfig):
    n_backbone: int = 2  # backbone (proposal) blocks
    n_layers: int = 2  # weight-tied attractor-head blocks
    layer_scale_init: float = 0.75  # initial gamma of every head sub-layer
    gamma_max: float = 1.0  # gamma = gamma_max * sigmoid(g)
    injection: str = "add"  # add | concat
    proposal: bool = True  # False: DEQ-style ablation (inject E(x), start from 0)
    tie_embeddings: bool = True
    loop: LoopConfig = field(default_factory=_default_loop)


class Attractor(LoopedModel):
    """Backbone proposal c, attractor head solved to y* = c + Delta(y* + c), tied readout."""

    config: AttractorConfig

    def __init__(self, config: AttractorConfig) -> None:
        super().__init__(config)
        if config.injection not in ATTRACTOR_INJECTIONS:
            raise ValueError(
                f"AttractorConfig.injection={config.injection!r} is not one of {ATTRACTOR_INJECTIONS}"
            )
        if config.n_layers < 1 or config.n_backbone < 0:
            raise ValueError(
                f"need n_layers >= 1 and n_backbone >= 0, got {config.n_layers}, {config.n_backbone}"
            )
        if not 0 < config.layer_scale_init <= config.gamma_max:
            raise ValueError(
                f"layer_scale_init must lie in (0, gamma_max={config.gamma_max}], got {config.layer_scale_init}"
            )
        d = config.d_model
        self.embedding = InputEmbedding(config)
        self.backbone = make_blocks(config, config.n_backbone if config.proposal else 0)
        self.head_blocks = make_blocks(config, config.n_layers)
        # the reference's FixedPointBlock clamps sigmoid(g) to [1e-6, 1 - 1e-6] (init 0.75 / 0.75 in its configs)
        p = min(max(config.layer_scale_init / config.gamma_max, 1e-6), 1 - 1e-6)
        self.gate_logit = nn.Parameter(torch.full((config.n_layers, 2, d), math.log(p / (1 - p))))
        if config.injection == "concat":
            self.injection_proj = nn.Linear(2 * d, d, bias=False)
            with torch.no_grad():
                eye = torch.eye(d)
                self.injection_proj.weight.copy_(torch.cat([eye, eye], dim=1))
        self.output = OutputHead(config, self.embedding)

    def no_weight_decay(self) -> set[str]:
        """The layer-scale gate logits are excluded from weight decay (as in the authors' code)."""
        return {"gate_logit"}

    def gammas(self) -> Tensor:
        """Per-channel sub-layer gates [n_layers, 2, d] in (0, gamma_max)."""
        return self.config.gamma_max * torch.sigmoid(self.gate_logit)

    def delta(self, u: Tensor) -> Tensor:
        """``Delta(u) = H(u) - u``: the sum of the head's gated sub-layer outputs."""
        gammas = self.gammas()
        updates: list[Tensor] = []
        for i, block in enumerate(self.head_blocks):
            gates = iter(gammas[i])  # one gate per sub-layer, in the block's order

            def gated(h: Tensor, s: Tensor, gates=gates) -> Tensor:
                update = next(gates) * s
                updates.append(update)
                return h + update

            u = block(u, residual=gated)
        return torch.stack(updates).sum(dim=0)

    def embed(self, inputs: Tensor, puzzle_ids: Tensor | None = None) -> tuple[Tensor, ...]:
        c = self.embedding(inputs, puzzle_ids)
        for block in self.backbone:
            c = block(c)
        return (c,)

    def init_state(self, ctx: tuple[Tensor, ...], generator: torch.Generator | None = None) -> Tensor:
        c = ctx[0]
        return c if self.config.proposal else torch.zeros_like(c)

    def step(self, z: Tensor, *ctx: Tensor) -> Tensor:
        c = ctx[0]
        u = z + c if self.config.injection == "add" else self.injection_proj(torch.cat([z, c], dim=-1))
        return c + self.delta(u)

    def readout(self, z: Tensor, *ctx: Tensor) -> Tensor:
        return self.output(z)

    @torch.no_grad()
    def internalization_gap(self, inputs: Tensor, puzzle_ids: Tensor | None = None) -> Tensor:
        """Relative residual at the initial iterate, ``||f(y0) - y0|| / ||f(y0)||`` per sample [B]."""
        ctx = self.embed(inputs, puzzle_ids)
        y0 = self.init_state(ctx)
        fy = self.step(y0, *ctx)
        B = y0.shape[0]
        return (fy - y0).reshape(B, -1).norm(dim=1) / fy.reshape(B, -1).norm(dim=1).clamp_min(1e-8)


def paper_config() -> AttractorConfig:
    """Attractor at the puzzle size (arXiv 2605.12466: 27M parameters): Sudoku vocab 11, 81 tokens, d 512,
    8 heads, 4 backbone + 4 head blocks (~25.7M; the block split is this library's assumption)."""
    return AttractorConfig(vocab_size=11, seq_len=81, d_model=512, n_heads=8, n_backbone=4, n_layers=4)
