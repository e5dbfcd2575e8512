"""Plain (non-looped) transformer baseline, and the input / output layers every family shares.

Design choices (the puzzle papers' baseline, "a plain transformer of equal parameters"):
- ``n_layers`` distinct pre-norm blocks (attention + SwiGLU, ``loopformer.nn.Block``) applied once.
  It sits on the same contract as the looped families: ``embed -> (x,)``, ``init_state = x``,
  ``step`` applies every layer once, and the default loop is one Picard step with BPTT
  (``LoopConfig(solver="picard", halting="fixed", max_steps=1, grad="bptt")``). Giving it a longer
  loop turns it into a weight-tied stack, which is allowed but not the baseline.
- Bidirectional (puzzles) or causal (language, state tracking) through ``config.causal``;
  rotary positions unless ``config.rope`` is False.
- Readout ``head(RMSNorm(z))``; ``tie_embeddings`` shares the head with the token embedding.

Shared layers, used by every family in this package:
- ``InputEmbedding``: token embedding with TRM / FPRM scaling (weights ~ N(0, 1/d) truncated, output
  multiplied by sqrt(d), so embedded tokens have unit RMS), plus an optional per-puzzle embedding
  table (``num_puzzle_ids`` x ``puzzle_emb_len`` tokens, zero-initialised, prepended to the sequence;
  named ``puzzle_emb`` so parameter counts can exclude it, as the papers do).
- ``OutputHead``: final RMSNorm + linear head (tied or not); drops the prepended puzzle tokens, so
  logits are always ``[B, T, V]`` for ``T`` input tokens. Applied to an intermediate state it is the
  logit lens (arXiv 2604.07822).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel, ModelConfig
from loopformer.nn import Block, LearnedPositions, RMSNorm


class InputEmbedding(nn.Module):
    """Tokens [B, T] (+ puzzle ids [B]) -> embeddings [B, P + T, d] with P prepended puzzle tokens."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.d_model
        self.d_model = d
        self.scale = math.sqrt(d)
        self.tokens = nn.Embedding(config.vocab_size, d)
        nn.init.trunc_normal_(self.tokens.weight, std=1.0 / self.scale, a=-2.0 / self.scale, b=2.0 / self.scale)
        if (config.num_puzzle_ids > 0) != (config.puzzle_emb_len > 0):
            raise ValueError(
                "num_puzzle_ids and puzzle_emb_len must both be > 0 (a puzzle embedding) or both 0, "
                f"got {config.num_puzzle_ids} and {config.puzzle_emb_len}"
            )
        self.prefix_len = config.puzzle_emb_len
        self.puzzle_emb: nn.Embedding | None = None
        if self.prefix_len:
            self.puzzle_emb = nn.Embedding(config.num_puzzle_ids, self.prefix_len * d)
            nn.init.zeros_(self.puzzle_emb.weight)
        self.positions = LearnedPositions(config.seq_len, d) if config.learned_positions else None

    def forward(self, inputs: Tensor, puzzle_ids: Tensor | None = None) -> Tensor:
        if inputs.dim() != 2 or inputs.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"inputs must be integer tokens of shape [B, T], got {tuple(inputs.shape)} {inputs.dtype}")
        x = self.tokens(inputs) * self.scale
        if self.positions is not None:
            x = self.positions(x)
        if self.puzzle_emb is None:
            return x
        if puzzle_ids is None:
            raise ValueError("this model has a per-puzzle embedding table (num_puzzle_ids > 0): pass puzzle_ids")
        p = self.puzzle_emb(puzzle_ids).view(inputs.shape[0], self.prefix_len, self.d_model) * self.scale
        return torch.cat([p, x], dim=1)


class OutputHead(nn.Module):
    """Final RMSNorm + linear head; drops the puzzle-prefix positions. The logit lens on any state."""

    def __init__(self, config: ModelConfig, embedding: InputEmbedding) -> None:
        super().__init__()
        self.prefix_len = embedding.prefix_len
        self.norm = RMSNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = embedding.tokens.weight

    def forward(self, z: Tensor) -> Tensor:
        if self.prefix_len:
            z = z[:, self.prefix_len :]
        return self.head(self.norm(z))


def make_blocks(config: ModelConfig, n: int, norm: str = "pre", out_init_scale: float = 1.0, **kw: object) -> nn.ModuleList:
    """``n`` distinct ``nn.Block``s sized by ``config`` (d_model, heads, expansion, causal, rope)."""
    return nn.ModuleList(
        Block(
            config.d_model,
            config.n_heads,
            norm=norm,
            causal=config.causal,
            rope=config.rope,
            expansion=config.expansion,
            out_init_scale=out_init_scale,
            **kw,  # type: ignore[arg-type]
        )
        for _ in range(n)
    )


def _single_pass() -> LoopConfig:
    return LoopConfig(solver="picard", halting="fixed", max_steps=1, grad="bptt")


@dataclass
class TransformerConfig(ModelConfig):
    norm: str = "pre"  # pre | post | sandwich | peri (nn.Block)
    mixer: str = "attention"  # attention | mlp (an MLP across the seq_len positions, TRM's mlp_t; fixed-size grids)
    loop: LoopConfig = field(default_factory=_single_pass)


class Transformer(LoopedModel):
    """A plain transformer: every layer applied once (one engine step)."""

    config: TransformerConfig

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        if config.n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {config.n_layers}")
        if config.mixer not in ("attention", "mlp"):
            raise ValueError(f"unknown mixer {config.mixer!r}; choose 'attention' or 'mlp'")
        self.embedding = InputEmbedding(config)
        kw: dict[str, object] = {}
        if config.mixer == "mlp":
            kw = {"mixer": "mlp", "seq_len": config.seq_len + config.puzzle_emb_len}
        self.layers = make_blocks(config, config.n_layers, norm=config.norm, **kw)
        self.output = OutputHead(config, self.embedding)

    def embed(self, inputs: Tensor, puzzle_ids: Tensor | None = None) -> tuple[Tensor, ...]:
        return (self.embedding(inputs, puzzle_ids),)

    def init_state(self, ctx: tuple[Tensor, ...], generator: torch.Generator | None = None) -> Tensor:
        return ctx[0]

    def step(self, z: Tensor, *ctx: Tensor) -> Tensor:
        for layer in self.layers:
            z = layer(z)
        return z

    def readout(self, z: Tensor, *ctx: Tensor) -> Tensor:
        return self.output(z)


def paper_config() -> TransformerConfig:
    """Plain-transformer baseline at the puzzle papers' 27M size (the puzzle papers' baseline): Sudoku vocab 11,
    81 tokens, d 512, 8 heads, 8 distinct layers (~25.7M parameters)."""
    return TransformerConfig(vocab_size=11, seq_len=81, d_model=512, n_heads=8, n_layers=8, expansion=4.0)
