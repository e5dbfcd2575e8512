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
- output: tied unembedding of ``RMSNorm(y*)`` (``tie_embeddings`` True by default), times ``logit_scale``.

The authors' language model (github jacobfa/Attractor, ``attractor/models/attractor/attractor.py``,
``configs/attractor/attractor-small-140m.py``) is reached with options, all off by default:
``mlp: relu2`` (``BaseMLP`` + ``ReLU2``: ``relu(x)^2 / 2``, width ``expansion * d``), ``qk_norm``
(per-head RMSNorm of q and k after RoPE), ``norm_eps`` (every RMSNorm), ``rope_base`` (the reference's
50000), ``embed_scale`` (the token embedding's multiplier; 0 = loopformer's sqrt(d), the reference: 1),
``logit_scale``, ``init: scaled_zero`` (the reference's ``scaled-zero`` strategy with
``init_orthogonal``: matrices orthogonal with gain ``std * sqrt(max(rows, cols))``, std = sqrt(2/(5d)),
the embedding likewise, backbone output projections zero, head output projections truncated
N(0, 2/(5d)) at +-3 std because they would be zero), and ``head_parameter_prefixes()`` for the
optimiser's head group (``train.head_lr_scale`` / ``train.head_weight_decay``: the reference's
``fp_lr_scale`` / ``fp_wd``). The solver plug-in ``anderson_attractor``
(``loopformer/models/attractor_solvers.py``) returns the reference's ``f(x_k)``.

Default loop: Anderson (m 5, relative regulariser 1e-4, mixing 1.0), residual halting at
``||f(y) - y|| / ||y||`` < 3e-4 between 4 and 12 iterations (puzzles; language uses 6..64 through the
loop config), gradient ``neumann`` with one term: ``u = v + J^T v`` backpropagated through one
recomputed f (the code's "onestep"; ``neumann.clip`` bounds ``||J^T v||`` by clip * ||v||). The
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
from loopformer.models.transformer import (
    InputEmbedding,
    LMLayerOptions,
    OutputHead,
    apply_layer_options,
    make_blocks,
    scaled_zero_blocks,
    scaled_zero_io,
)

ATTRACTOR_INJECTIONS = ("add", "concat")


def _default_loop() -> LoopConfig:
    return LoopConfig(
        solver="anderson",
        plugins={"anderson": {"m": 5}},
        halting="residual",
        tol=3e-4,
        residual_norm="rel_l2",
        min_steps=4,
        max_steps=12,
        grad="neumann",
        grad_steps=1,
    )


@dataclass
class AttractorConfig(LMLayerOptions, ModelConfig):
    """The attractor head's fields; the language model's layer options (``mlp``, ``qk_norm``, ``norm_eps``,
    ``rope_base``, ``embed_scale``, ``logit_scale``, ``init_orthogonal``: module docstring) are the transformer
    family's ``LMLayerOptions``, whose defaults are loopformer's own choices."""

    n_backbone: int = 2  # backbone (proposal) blocks
    n_layers: int = 2  # weight-tied attractor-head blocks
    layer_scale_init: float = 0.75  # initial gamma of every head sub-layer
    gamma_max: float = 1.0  # gamma = gamma_max * sigmoid(g)
    injection: str = "add"  # add | concat
    proposal: bool = True  # False: DEQ-style ablation (inject E(x), start from 0)
    tie_embeddings: bool = True
    init: str = "default"  # default (PyTorch's) | scaled_zero (the reference's)
    value_embeddings: bool = False  # the authors' Attractor removes them (ve_gate = None); False only
    loop: LoopConfig = field(default_factory=_default_loop)

    def __post_init__(self) -> None:
        self.check_layer_options()
        if self.value_embeddings:
            raise ValueError(
                "AttractorConfig.value_embeddings is not available (the authors' Attractor removes them); "
                "set it false"
            )


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
        kw = config.layer_kwargs()
        self.backbone = make_blocks(config, config.n_backbone if config.proposal else 0, **kw)
        self.head_blocks = make_blocks(config, config.n_layers, **kw)
        # the reference's FixedPointBlock clamps sigmoid(g) to [1e-6, 1 - 1e-6] (init 0.75 / 0.75 in its configs)
        p = min(max(config.layer_scale_init / config.gamma_max, 1e-6), 1 - 1e-6)
        self.gate_logit = nn.Parameter(torch.full((config.n_layers, 2, d), math.log(p / (1 - p))))
        if config.injection == "concat":
            self.injection_proj = nn.Linear(2 * d, d, bias=False)
            with torch.no_grad():
                eye = torch.eye(d)
                self.injection_proj.weight.copy_(torch.cat([eye, eye], dim=1))
        self.output = OutputHead(config, self.embedding)
        apply_layer_options(config, self.embedding, self.output)
        if config.init == "scaled_zero":
            scaled_zero_init(self, config.init_orthogonal)

    def no_weight_decay(self) -> set[str]:
        """The layer-scale gate logits are excluded from weight decay (as in the authors' code)."""
        return {"gate_logit"}

    def head_parameter_prefixes(self) -> set[str]:
        """The attractor head's parameters (blocks and gates): the optimiser's head group."""
        return {"head_blocks", "gate_logit"}

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
        logits = self.output(z)
        return logits if self.config.logit_scale == 1.0 else logits * self.config.logit_scale

    @torch.no_grad()
    def internalization_gap(self, inputs: Tensor, puzzle_ids: Tensor | None = None) -> Tensor:
        """Relative residual at the initial iterate, ``||f(y0) - y0|| / ||f(y0)||`` per sample [B]."""
        ctx = self.embed(inputs, puzzle_ids)
        y0 = self.init_state(ctx)
        fy = self.step(y0, *ctx)
        B = y0.shape[0]
        return (fy - y0).reshape(B, -1).norm(dim=1) / fy.reshape(B, -1).norm(dim=1).clamp_min(1e-8)


@torch.no_grad()
def scaled_zero_init(model: Attractor, orthogonal: bool = True) -> None:
    """github jacobfa/Attractor ``init_strategy="scaled-zero"`` (``attractor/utils/init.py``
    ``get_factor_table``): std sqrt(2/(5d)) for the embedding, q, k, v (each d x d block of the fused
    qkv on its own), the MLP input and an untied head; output projections 0; then the attractor head's
    zero output projections are re-drawn as truncated N(0, 2/(5d)) (``FixedPointBlock.__init__``).
    Norm gains are 1; the gates keep their ``layer_scale_init`` value. The embedding / head and the
    per-block part are the transformer family's (``scaled_zero_io``, ``scaled_zero_blocks``)."""
    std = scaled_zero_io(model.config, model.embedding, model.output, orthogonal)
    if model.embedding.tokens.weight.is_meta:  # built on the meta device (parameter counts): nothing to fill
        return
    scaled_zero_blocks(model.backbone, std, orthogonal)
    for block in model.head_blocks:  # block by block: the draws in the order they always had
        scaled_zero_blocks([block], std, orthogonal)
        for lin in block.output_projections():
            nn.init.trunc_normal_(lin.weight, std=std, a=-3 * std, b=3 * std)


def paper_config() -> AttractorConfig:
    """The family's paper size: the authors' 140M language model (``lm_paper_config``, 134.24M parameters;
    ``loopformer models`` counts it). Their puzzle results come from ``attractor_puzzle`` (TRM-DEQ)."""
    return lm_paper_config()


def puzzle_head_config() -> AttractorConfig:
    """Backbone + attractor head at the puzzle size (arXiv 2605.12466: 27M parameters): Sudoku vocab 11, 81
    tokens, d 512, 8 heads, 4 backbone + 4 head blocks (~25.7M; the block split is this library's assumption;
    ``paper_sudoku_extreme_attractor_head.yaml``; not the authors' puzzle model)."""
    return AttractorConfig(vocab_size=11, seq_len=81, d_model=512, n_heads=8, n_backbone=4, n_layers=4)


def lm_paper_config(vocab_size: int = 32768) -> AttractorConfig:
    """The authors' 140M language model (github jacobfa/Attractor ``configs/attractor/attractor-small-140m.py``):
    d 1024, 8 heads, ReLU^2 MLP 4096, qk-norm, RMSNorm eps 1e-5, 7 backbone + 1 head block, RoPE base 50000,
    context 2048, tied embeddings, scaled-zero orthogonal init, gates 0.75 / 0.75, vocabulary 32768 (its BPE
    tokenizer; ``recipes/paper_lm_attractor_140m.yaml`` is byte-level: ``vocab_size=256``)."""
    return AttractorConfig(
        vocab_size=vocab_size,
        seq_len=2048,
        d_model=1024,
        n_heads=8,
        n_backbone=7,
        n_layers=1,
        expansion=4.0,
        causal=True,
        layer_scale_init=0.75,
        gamma_max=0.75,
        mlp="relu2",
        qk_norm=True,
        norm_eps=1e-5,
        rope_base=50000.0,
        embed_scale=1.0,
        init="scaled_zero",
    )
