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
- The Attractor paper's LM layer options (opt-in, defaults unchanged; ``LMLayerOptions``, shared with
  the ``recurrent`` family): ``mlp: relu2``, ``qk_norm``, ``norm_eps``, ``rope_base``, ``embed_scale``,
  ``logit_scale``, ``init: scaled_zero`` (+ ``init_orthogonal``; ``weight_init`` in ``recurrent``), as in the ``attractor`` family: github
  jacobfa/Attractor ``attractor/configs/gpt/gpt-small-140m.py`` and ``parcae/parcae-small-140m.py``.

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
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel, ModelConfig
from loopformer.nn import MLP_KINDS, Block, LearnedPositions, RMSNorm

LM_INITS = ("default", "scaled_zero")


class InputEmbedding(nn.Module):
    """Tokens [B, T] (+ puzzle ids [B]) -> embeddings [B, P + T, d] with P prepended puzzle tokens."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.d_model
        self.d_model = d
        self.scale = math.sqrt(d)
        self.tokens = nn.Embedding(config.vocab_size, d)
        nn.init.trunc_normal_(
            self.tokens.weight, std=1.0 / self.scale, a=-2.0 / self.scale, b=2.0 / self.scale
        )
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
        self.default_puzzle_id = False  # puzzle_ids=None means identifier 0 (else an error)

    def forward(self, inputs: Tensor, puzzle_ids: Tensor | None = None) -> Tensor:
        if inputs.dim() != 2 or inputs.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"inputs must be integer tokens of shape [B, T], got {tuple(inputs.shape)} {inputs.dtype}"
            )
        x = self.tokens(inputs) * self.scale
        if self.positions is not None:
            x = self.positions(x)
        if self.puzzle_emb is None:
            return x
        if puzzle_ids is None and not self.default_puzzle_id:
            raise ValueError(
                "this model has a per-puzzle embedding table (num_puzzle_ids > 0): pass puzzle_ids"
            )
        if puzzle_ids is None:  # the FPRM authors' Sudoku / maze data: one identifier (0) for every puzzle
            puzzle_ids = torch.zeros(inputs.shape[0], dtype=torch.long, device=inputs.device)
        p = self.puzzle_emb(puzzle_ids)
        width = self.prefix_len * self.d_model
        if p.shape[-1] < width:  # a narrower table (FPRM's puzzle_emb_dim), zero-padded
            p = F.pad(p, (0, width - p.shape[-1]))
        p = p.view(inputs.shape[0], self.prefix_len, self.d_model) * self.scale
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


def make_blocks(
    config: ModelConfig, n: int, norm: str = "pre", out_init_scale: float = 1.0, **kw: object
) -> nn.ModuleList:
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


@dataclass
class LMLayerOptions:
    """The Attractor paper's LM layer options (mixed into a family's config; defaults are loopformer's)."""

    mlp: str = "swiglu"  # swiglu | relu2 (the reference's BaseMLP + ReLU2)
    qk_norm: bool = False  # parameter-free RMSNorm of q and k after RoPE
    norm_eps: float = 1e-6  # every RMSNorm (blocks and the final norm)
    rope_base: float = 10000.0
    embed_scale: float = 0.0  # token-embedding multiplier; 0 = sqrt(d_model)
    logit_scale: float = 1.0
    init_orthogonal: bool = True  # scaled_zero: orthogonal matrices (else truncated normal)

    def check_layer_options(self, init_key: str = "init") -> None:
        """Validate the options; ``init_key`` names the weight-init field (default | scaled_zero)."""
        name = type(self).__name__
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"{name}.mlp={self.mlp!r} is not one of {MLP_KINDS}")
        init = getattr(self, init_key)
        if init not in LM_INITS:
            raise ValueError(f"{name}.{init_key}={init!r} is not one of {LM_INITS}")
        for key in ("norm_eps", "rope_base", "logit_scale"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}.{key} must be a finite number > 0, got {value!r}")
        if not (
            isinstance(self.embed_scale, (int, float))
            and math.isfinite(self.embed_scale)
            and self.embed_scale >= 0
        ):
            raise ValueError(f"{name}.embed_scale must be >= 0 (0 = sqrt(d)), got {self.embed_scale!r}")

    def layer_kwargs(self) -> dict[str, object]:
        """``nn.Block`` keyword arguments for these options."""
        return dict(mlp=self.mlp, qk_norm=self.qk_norm, rope_base=self.rope_base, norm_eps=self.norm_eps)


def apply_layer_options(config: LMLayerOptions, embedding: InputEmbedding, output: OutputHead) -> None:
    """``embed_scale`` on the embedding and ``norm_eps`` on the final norm (``logit_scale``: the readout)."""
    if config.embed_scale:
        embedding.scale = float(config.embed_scale)
    output.norm.eps = config.norm_eps


def matrix_init(w: Tensor, std: float, orthogonal: bool) -> None:
    """The reference's ``Init.normal_``: orthogonal with gain ``std * sqrt(max(rows, cols))``
    (``wrapped_trunc_ortho``) or a normal truncated at +-3 std (``wrapped_trunc_normal``)."""
    if std == 0:
        nn.init.zeros_(w)
    elif orthogonal:
        nn.init.orthogonal_(w, gain=std * math.sqrt(max(w.shape)))
    else:
        nn.init.trunc_normal_(w, std=std, a=-3 * std, b=3 * std)


@torch.no_grad()
def scaled_zero_blocks(blocks: Iterable[Block], std: float, orthogonal: bool) -> None:
    """github jacobfa/Attractor ``init_strategy="scaled-zero"`` (``attractor/utils/init.py``
    ``get_factor_table``) on ``nn.Block``s: q, k, v (each d x d block of the fused qkv) and the MLP input
    ``std``; output projections 0; norm gains 1."""
    for block in blocks:
        if block.output_projections()[0].weight.is_meta:  # built on the meta device: nothing to fill
            return
        for chunk in block.mix.qkv.weight.chunk(3, dim=0):
            matrix_init(chunk, std, orthogonal)
        mlp_in = block.mlp.up if hasattr(block.mlp, "up") else block.mlp.gate_up
        matrix_init(mlp_in.weight, std, orthogonal)
        for lin in block.output_projections():
            nn.init.zeros_(lin.weight)
        for norm in (block.norm1, block.norm2):
            if norm.weight is not None:
                nn.init.ones_(norm.weight)


@torch.no_grad()
def scaled_zero_io(
    config: ModelConfig, embedding: InputEmbedding, output: OutputHead, orthogonal: bool
) -> float:
    """Scaled-zero std sqrt(2/(5d)) on the token embedding and an untied head; returns the std."""
    std = math.sqrt(2.0 / (5.0 * config.d_model))
    if not embedding.tokens.weight.is_meta:
        matrix_init(embedding.tokens.weight, std, orthogonal)
        if not config.tie_embeddings:
            matrix_init(output.head.weight, std, orthogonal)
    return std


def value_embedding_layers(n_layers: int) -> list[int]:
    """The layers with a value embedding: ``i % 2 == (n - 1) % 2`` (github jacobfa/Attractor
    ``attractor/modules/mixer.py: has_ve``: every other layer, the last always)."""
    return [i for i in range(n_layers) if i % 2 == (n_layers - 1) % 2]


def value_embeddings(
    config: ModelConfig, blocks: nn.ModuleList, offset: int = 0, total: int = 0
) -> nn.ModuleDict:
    """The reference's value embeddings for ``blocks`` (effective layers ``offset..`` of ``total``, default
    just these): a ``vocab x d`` table per chosen layer (``nn.Embedding``'s N(0, 1), as the reference leaves
    it) and the layer attention's ``ve_gate`` ``Linear(32, n_heads)`` (PyTorch's default init, as there)."""
    chosen = set(value_embedding_layers(total or len(blocks)))
    tables = {}
    for i, block in enumerate(blocks):
        if offset + i in chosen:
            tables[str(i)] = nn.Embedding(config.vocab_size, config.d_model)
            block.mix.ve_gate = nn.Linear(min(32, config.d_model), config.n_heads, bias=False)
    return nn.ModuleDict(tables)


def _single_pass() -> LoopConfig:
    return LoopConfig(solver="picard", halting="fixed", max_steps=1, grad="bptt")


@dataclass
class TransformerConfig(LMLayerOptions, ModelConfig):
    norm: str = "pre"  # pre | post | sandwich | peri (nn.Block)
    mixer: str = (
        "attention"  # attention | mlp (an MLP across the seq_len positions, TRM's mlp_t; fixed-size grids)
    )
    init: str = "default"  # default (PyTorch's) | scaled_zero (the reference's)
    value_embeddings: bool = False  # the Attractor paper's GPT: gated per-token tables added to v
    loop: LoopConfig = field(default_factory=_single_pass)

    def __post_init__(self) -> None:
        self.check_layer_options()
        if self.value_embeddings and (self.mixer != "attention" or self.num_puzzle_ids):
            raise ValueError(
                "TransformerConfig.value_embeddings needs mixer='attention' and no puzzle embedding"
            )


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
        self.layers = make_blocks(config, config.n_layers, norm=config.norm, **kw, **config.layer_kwargs())
        self.value_embeds = value_embeddings(config, self.layers) if config.value_embeddings else None
        self.output = OutputHead(config, self.embedding)
        apply_layer_options(config, self.embedding, self.output)
        if config.init == "scaled_zero":
            std = scaled_zero_io(config, self.embedding, self.output, config.init_orthogonal)
            scaled_zero_blocks(self.layers, std, config.init_orthogonal)

    def embed(self, inputs: Tensor, puzzle_ids: Tensor | None = None) -> tuple[Tensor, ...]:
        """``(x, [the value embeddings of the layers that take one, in layer order]))``."""
        x = self.embedding(inputs, puzzle_ids)
        if self.value_embeds is None:
            return (x,)
        return (x, *(table(inputs) for table in self.value_embeds.values()))

    def init_state(self, ctx: tuple[Tensor, ...], generator: torch.Generator | None = None) -> Tensor:
        return ctx[0]

    def step(self, z: Tensor, *ctx: Tensor) -> Tensor:
        if self.value_embeds is None:
            for layer in self.layers:
                z = layer(z)
            return z
        ves = dict(zip(self.value_embeds.keys(), ctx[1:]))
        for i, layer in enumerate(self.layers):
            z = layer(z, ve=ves.get(str(i)))
        return z

    def readout(self, z: Tensor, *ctx: Tensor) -> Tensor:
        logits = self.output(z)
        return logits if self.config.logit_scale == 1.0 else logits * self.config.logit_scale


def paper_config() -> TransformerConfig:
    """Plain-transformer baseline at the puzzle papers' 27M size (the puzzle papers' baseline): Sudoku vocab 11,
    81 tokens, d 512, 8 heads, 8 distinct layers (~25.7M parameters)."""
    return TransformerConfig(vocab_size=11, seq_len=81, d_model=512, n_heads=8, n_layers=8, expansion=4.0)
