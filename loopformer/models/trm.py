"""TRM: the Tiny Recursive Model (Jolicoeur-Martineau, arXiv 2510.04871; SYSTEMS.md section 4).

One small net (``n_layers`` = 2 post-norm blocks, d 512 at paper size) refines a latent ``z`` and an
answer ``y`` given the embedded input ``x``. One *step* of the loop engine is TRM's latent recursion

    for i in range(n_inner):  z = net(z + (y + x))      # TRM code: L_level(z_L, z_H + input)
    y = net(y + z)                                      # TRM code: L_level(z_H, z_L)

and the paper's ``T`` outer cycles, "the first T-1 without gradient", are the engine's steps with
``LoopConfig(halting="fixed", max_steps=T, grad="truncated", grad_steps=1)`` (T = 3 by default).
Deep supervision (up to 16 segments, carrying the detached state) belongs to the trainer.

Design choices (where they come from):
- State: ``y`` and ``z`` stacked as ``[B, 2, P + T, d]`` with index 0 = ``y`` (the answer, TRM code's
  ``z_H``, the one read out) and index 1 = ``z`` (the latent, ``z_L``); P = ``puzzle_emb_len``.
- Blocks: ``loopformer.nn.Block`` with ``norm="post"`` (TRM code: ``rms_norm(h + attn(h))``,
  ``rms_norm(h + mlp(h))``), RoPE attention or, with ``mixer="mlp"``, an MLP across positions for
  fixed-size grids (TRM's ``mlp_t``; needs bidirectional inputs of exactly ``seq_len`` tokens).
  Deviations: our RMSNorm has a learnable gain (TRM's has none) and SwiGLU widths round to 64 (TRM: 256).
- Embedding: token table with init std ``1/sqrt(d)`` scaled by ``sqrt(d)`` (TRM's ``embed_scale``), so
  the scaled embedding has unit scale. A per-puzzle embedding ``puzzle_emb`` (``num_puzzle_ids`` rows of
  ``puzzle_emb_len * d``, zero-initialised as TRM's sparse embedding) is reshaped to ``puzzle_emb_len``
  tokens and prepended before scaling (ARC). ``puzzle_ids=None`` uses id 0, TRM's blank identifier.
  Its name contains ``puzzle_emb`` so ``num_parameters()`` leaves it out, as the paper counts.
- Initial state: TRM uses fixed truncated-normal (std 1) vectors ``H_init`` / ``L_init`` broadcast over
  batch and positions. They are buffers by default: under the default truncated gradient the initial
  state only ever enters the no-grad prefix, so learned vectors would never receive a gradient (and DDP
  would report unused parameters). ``learned_init=True`` makes them parameters (trained under bptt).
- Readout: ``lm_head(y)`` on the token positions (the prepended puzzle positions are dropped); ``y`` is
  already normalised by the post-norm block. ``tie_embeddings`` reuses the token table.
- Halting head: ``q_head`` is a linear map of ``y`` at the first position to one logit (TRM's
  ``q_halt``; TRM's default ``no_ACT_continue`` drops the continue logit), weight 0 and bias -5 at init
  as in TRM's code, trained by the trainer with BCE against "the answer is right".

The puzzle-token embedding and the injected stack of post-norm blocks (``ReasoningModule``) are shared
with ``loopformer.models.hrm``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel, ModelConfig
from loopformer.nn import Block, trunc_normal_state

Q_BIAS_INIT = -5.0  # TRM / HRM code: the halting head starts at "do not halt"


class PuzzleTokenEmbedding(nn.Module):
    """Tokens -> ``sqrt(d)``-scaled embeddings with optional per-puzzle tokens prepended (TRM / HRM)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.d_model
        if config.puzzle_emb_len < 0 or config.num_puzzle_ids < 0:
            raise ValueError("num_puzzle_ids and puzzle_emb_len must be >= 0")
        if (config.puzzle_emb_len > 0) != (config.num_puzzle_ids > 0):
            raise ValueError(
                "a per-puzzle embedding needs both num_puzzle_ids > 0 and puzzle_emb_len > 0, got "
                f"num_puzzle_ids={config.num_puzzle_ids}, puzzle_emb_len={config.puzzle_emb_len}"
            )
        self.d, self.prefix_len, self.num_puzzle_ids = d, config.puzzle_emb_len, config.num_puzzle_ids
        self.scale = math.sqrt(d)
        self.tokens = nn.Embedding(config.vocab_size, d)
        nn.init.trunc_normal_(
            self.tokens.weight, std=1.0 / self.scale, a=-2.0 / self.scale, b=2.0 / self.scale
        )
        self.puzzle_emb: nn.Embedding | None = None
        if self.prefix_len > 0:
            self.puzzle_emb = nn.Embedding(self.num_puzzle_ids, self.prefix_len * d)
            nn.init.zeros_(self.puzzle_emb.weight)

    def forward(self, inputs: Tensor, puzzle_ids: Tensor | None = None) -> Tensor:
        if inputs.dim() != 2 or inputs.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"inputs must be integer tokens of shape [B, T], got {tuple(inputs.shape)} {inputs.dtype}"
            )
        h = self.tokens(inputs)
        if self.puzzle_emb is not None:
            B = inputs.shape[0]
            if puzzle_ids is None:
                puzzle_ids = torch.zeros(B, dtype=torch.long, device=inputs.device)
            if puzzle_ids.shape != (B,):
                raise ValueError(f"puzzle_ids must have shape [{B}], got {tuple(puzzle_ids.shape)}")
            if puzzle_ids.numel() and (
                int(puzzle_ids.min()) < 0 or int(puzzle_ids.max()) >= self.num_puzzle_ids
            ):
                raise ValueError(
                    f"puzzle_ids must lie in [0, {self.num_puzzle_ids}), got {puzzle_ids.tolist()}"
                )
            prefix = self.puzzle_emb(puzzle_ids).view(B, self.prefix_len, self.d).to(h.dtype)
            h = torch.cat((prefix, h), dim=1)
        return self.scale * h


class ReasoningModule(nn.Module):
    """A stack of post-norm blocks with additive input injection: ``blocks(h + injection)``."""

    def __init__(self, config: ModelConfig, n_layers: int, mixer: str = "attention") -> None:
        super().__init__()
        if n_layers < 1:
            raise ValueError(f"a reasoning module needs n_layers >= 1, got {n_layers}")
        total_len = config.seq_len + config.puzzle_emb_len
        self.layers = nn.ModuleList(
            Block(
                config.d_model,
                config.n_heads,
                norm="post",
                causal=config.causal,
                rope=config.rope,
                expansion=config.expansion,
                mixer=mixer,
                seq_len=total_len if mixer == "mlp" else None,
            )
            for _ in range(n_layers)
        )

    def forward(self, h: Tensor, injection: Tensor) -> Tensor:
        h = h + injection
        for layer in self.layers:
            h = layer(h)
        return h


def init_vector(d: int, learned: bool) -> Tensor | nn.Parameter:
    """TRM / HRM initial-state vector: truncated normal, std 1 (cut at +-2)."""
    v = trunc_normal_state((d,), std=1.0)
    return nn.Parameter(v) if learned else v


def check_token_count(config: ModelConfig, mixer: str, inputs: Tensor) -> None:
    if mixer == "mlp" and inputs.shape[-1] != config.seq_len:
        raise ValueError(
            f"the MLP mixer needs exactly seq_len={config.seq_len} tokens, got {inputs.shape[-1]}"
        )


@dataclass
class TRMConfig(ModelConfig):
    n_layers: int = 2
    n_inner: int = 6  # latent updates z = net(z + y + x) per step (TRM's n)
    mixer: str = "attention"  # "attention" or "mlp" (MLP-mixer across positions, fixed-size grids)
    learned_init: bool = False  # learn the y / z initial vectors instead of TRM's fixed buffers
    q_head: bool = True
    loop: LoopConfig = field(
        default_factory=lambda: LoopConfig(halting="fixed", max_steps=3, grad="truncated", grad_steps=1)
    )


class TRM(LoopedModel):
    config: TRMConfig

    def __init__(self, config: TRMConfig) -> None:
        super().__init__(config)
        if config.n_inner < 1:
            raise ValueError(f"n_inner must be >= 1, got {config.n_inner}")
        self.embedding = PuzzleTokenEmbedding(config)
        self.net = ReasoningModule(config, config.n_layers, config.mixer)
        d = config.d_model
        if config.learned_init:
            self.y_init = init_vector(d, learned=True)
            self.z_init = init_vector(d, learned=True)
        else:
            self.register_buffer("y_init", init_vector(d, learned=False))
            self.register_buffer("z_init", init_vector(d, learned=False))
        self.lm_head = None if config.tie_embeddings else nn.Linear(d, config.vocab_size, bias=False)
        self.q_proj: nn.Linear | None = None
        if config.q_head:
            self.q_proj = nn.Linear(d, 1)
            nn.init.zeros_(self.q_proj.weight)
            nn.init.constant_(self.q_proj.bias, Q_BIAS_INIT)

    def embed(self, inputs: Tensor, puzzle_ids: Tensor | None = None) -> tuple[Tensor, ...]:
        check_token_count(self.config, self.config.mixer, inputs)
        return (self.embedding(inputs, puzzle_ids),)

    def init_state(self, ctx: tuple[Tensor, ...], generator: torch.Generator | None = None) -> Tensor:
        x = ctx[0]
        B, L, d = x.shape
        y0 = self.y_init.to(x.dtype).expand(B, L, d)
        z0 = self.z_init.to(x.dtype).expand(B, L, d)
        return torch.stack((y0, z0), dim=1)

    def step(self, z: Tensor, *ctx: Tensor) -> Tensor:
        x = ctx[0]
        y, latent = z[:, 0], z[:, 1]
        for _ in range(self.config.n_inner):
            latent = self.net(latent, y + x)
        y = self.net(y, latent)
        return torch.stack((y, latent), dim=1)

    def readout(self, z: Tensor, *ctx: Tensor) -> Tensor:
        y = z[:, 0, self.config.puzzle_emb_len :]
        if self.lm_head is None:
            return y @ self.embedding.tokens.weight.t()
        return self.lm_head(y)

    def q_head(self, z: Tensor, *ctx: Tensor) -> Tensor | None:
        if self.q_proj is None:
            return None
        return self.q_proj(z[:, 0, 0]).squeeze(-1)


def paper_config(mixer: str = "attention") -> TRMConfig:
    """TRM at paper size for Sudoku-Extreme: d 512, 2 layers, n = 6, T = 3 (~7M attention, ~5M MLP)."""
    return TRMConfig(
        vocab_size=11, seq_len=81, d_model=512, n_heads=8, n_layers=2, expansion=4.0, n_inner=6, mixer=mixer
    )
