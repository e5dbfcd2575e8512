"""TRM: the Tiny Recursive Model (Jolicoeur-Martineau, arXiv 2510.04871).

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
  As TRM's code (``models/layers.py``): RMSNorm without gain, eps 1e-5 (``norm_gain``, ``norm_eps``),
  SwiGLU widths rounded up to 256 (``mlp_multiple``; the MLP mixer's too), the MLP mixer's post-norm
  taken over the positions (``mlp_t`` transposes before its norm), linear weights truncated LeCun normal
  with the flax convention (the std is that of the truncated law, ``init="lecun"``; ``init="torch"``
  keeps PyTorch's defaults). RoPE pairs dimensions (2i, 2i+1) where TRM rotates halves (i, i + d/2):
  a fixed permutation of each head's q / k dimensions, applied by ``loopformer convert``.
- Embedding: token table with init std ``1/sqrt(d)`` scaled by ``sqrt(d)`` (TRM's ``embed_scale``), so
  the scaled embedding has unit scale. A per-puzzle embedding ``puzzle_emb`` (``num_puzzle_ids`` rows of
  ``puzzle_emb_dim`` values, zero-initialised as TRM's sparse embedding, zero-padded to
  ``puzzle_emb_len * d``) is reshaped to ``puzzle_emb_len`` tokens and prepended before scaling. TRM's
  configs: ``puzzle_emb_dim = d`` and 16 tokens (the first holds the puzzle's vector, the other 15 are
  zero); Sudoku / maze use one identifier (id 0) for every puzzle. ``puzzle_ids=None`` uses id 0.
  Its name contains ``puzzle_emb`` so ``num_parameters()`` leaves it out, as the paper counts; the
  trainer gives it TRM's sign-SGD optimiser (``train.puzzle_emb_optimizer``).
- Initial state: TRM uses fixed truncated-normal (std 1, flax convention) vectors ``H_init`` / ``L_init`` broadcast over
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
import torch.nn.functional as F
from torch import Tensor, nn

from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel, ModelConfig
from loopformer.nn import Block, DepthwiseConv2d, LearnedPositions, trunc_normal_state

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
        dim = getattr(
            config, "puzzle_emb_dim", 0
        )  # -1: d_model (TRM / HRM "puzzle_emb_ndim: ${.hidden_size}")
        self.puzzle_dim = d if dim == -1 else (dim or self.prefix_len * d)
        if self.prefix_len and self.puzzle_dim > self.prefix_len * d:
            raise ValueError(
                f"puzzle_emb_dim {self.puzzle_dim} does not fit in puzzle_emb_len * d_model = {self.prefix_len * d}"
            )
        self.scale = math.sqrt(d)
        self.tokens = nn.Embedding(config.vocab_size, d)
        if getattr(config, "init", "torch") == "lecun":
            trunc_normal_init_(self.tokens.weight, std=1.0 / self.scale)
        else:
            nn.init.trunc_normal_(
                self.tokens.weight, std=1.0 / self.scale, a=-2.0 / self.scale, b=2.0 / self.scale
            )
        self.puzzle_emb: nn.Embedding | None = None
        if self.prefix_len > 0:
            self.puzzle_emb = nn.Embedding(self.num_puzzle_ids, self.puzzle_dim)
            nn.init.zeros_(self.puzzle_emb.weight)
        self.positions = (
            LearnedPositions(config.seq_len, d, scaled=False) if config.learned_positions else None
        )

    def forward(self, inputs: Tensor, puzzle_ids: Tensor | None = None) -> Tensor:
        if inputs.dim() != 2 or inputs.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"inputs must be integer tokens of shape [B, T], got {tuple(inputs.shape)} {inputs.dtype}"
            )
        h = self.tokens(inputs)
        if self.positions is not None:  # unscaled here: the whole embedding is scaled by sqrt(d) below
            h = self.positions(h)
        if self.puzzle_emb is not None:
            B = inputs.shape[0]
            if puzzle_ids is None:
                puzzle_ids = torch.zeros(B, dtype=torch.long, device=inputs.device)
            if puzzle_ids.shape != (B,):
                raise ValueError(f"puzzle_ids must have shape [{B}], got {tuple(puzzle_ids.shape)}")
            if puzzle_ids.numel():  # checked on the device: a GPU asserts without the host waiting for it
                inside = (puzzle_ids >= 0).all() & (puzzle_ids < self.num_puzzle_ids).all()
                try:
                    torch._assert_async(inside, f"puzzle_ids must lie in [0, {self.num_puzzle_ids})")
                except RuntimeError as err:  # the CPU checks at once
                    raise ValueError(str(err)) from None
            prefix = self.puzzle_emb(puzzle_ids).to(h.dtype)
            pad = self.prefix_len * self.d - self.puzzle_dim
            prefix = (F.pad(prefix, (0, pad)) if pad else prefix).view(B, self.prefix_len, self.d)
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
                norm_eps=getattr(config, "norm_eps", 1e-6),
                norm_gain=getattr(config, "norm_gain", True),
                mlp_multiple=getattr(config, "mlp_multiple", 64),
                mixer_multiple=getattr(config, "mlp_multiple", 8),
                mixer_norm_over_tokens=getattr(config, "mixer_norm_over_tokens", False),
            )
            for _ in range(n_layers)
        )
        if getattr(config, "init", "torch") == "lecun":
            lecun_init_(self)
        # the head-to-head's convolution control (issue 46): FPRM's depthwise grid convolution on the sum
        # h + injection before the blocks, replacing it as the FPRM authors' code does (PyTorch's Conv init)
        self.conv: DepthwiseConv2d | None = None
        if getattr(config, "grid_conv", False):
            if config.grid is None:
                raise ValueError("grid_conv needs config.grid, e.g. (9, 9) for Sudoku")
            self.conv = DepthwiseConv2d(config.d_model, tuple(config.grid), kernel=3)
            self.conv.conv.reset_parameters()

    def forward(self, h: Tensor, injection: Tensor) -> Tensor:
        h = h + injection
        if self.conv is not None:
            P = h.shape[1] - self.conv.grid[0] * self.conv.grid[1]
            h = torch.cat([h[:, :P], self.conv(h[:, P:])], dim=1) if P else self.conv(h)
        for layer in self.layers:
            h = layer(h)
        return h


def trunc_normal_init_(t: Tensor, std: float, lower: float = -2.0, upper: float = 2.0) -> Tensor:
    """Truncated normal in the flax / JAX convention, TRM's and HRM's ``trunc_normal_init_``
    (``models/common.py``): ``std`` is the standard deviation of the *truncated* law, whose support is
    ``[lower, upper]`` in units of the underlying normal's sigma. For the standard normal cut to
    ``[a, b]`` with mass ``Z``, ``Var = 1 + (a phi(a) - b phi(b)) / Z - ((phi(a) - phi(b)) / Z)^2``, so
    sigma = std / sqrt(Var). Sampled by inverse CDF: ``u ~ U(erf(a/sqrt2), erf(b/sqrt2))``,
    ``x = sqrt2 erfinv(u) sigma`` (then clipped to the support against rounding).
    PyTorch's ``nn.init.trunc_normal_`` instead gives a law whose std is smaller than ``std``."""
    with torch.no_grad():
        if std == 0:
            return t.zero_()
        r2 = math.sqrt(2.0)
        mass = (math.erf(upper / r2) - math.erf(lower / r2)) / 2

        def phi(x: float) -> float:
            return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)

        var = 1 + (lower * phi(lower) - upper * phi(upper)) / mass - ((phi(lower) - phi(upper)) / mass) ** 2
        sigma = std / math.sqrt(var)
        t.uniform_(math.erf(lower / r2), math.erf(upper / r2)).erfinv_().mul_(r2 * sigma)
        return t.clip_(lower * sigma, upper * sigma)


def lecun_init_(module: nn.Module) -> None:
    """TRM / HRM ``CastedLinear`` init on every ``nn.Linear`` in ``module``: weight truncated LeCun
    normal (flax convention, std ``1/sqrt(fan_in)``), bias zero."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            trunc_normal_init_(m.weight, std=1.0 / math.sqrt(m.in_features))
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def init_vector(d: int, learned: bool, flax: bool = False) -> Tensor | nn.Parameter:
    """TRM / HRM initial-state vector: truncated normal, std 1 (``flax``: TRM's convention, whose
    std is the truncated law's; otherwise PyTorch's ``trunc_normal_`` cut at +-2)."""
    v = trunc_normal_init_(torch.empty(d), std=1.0) if flax else trunc_normal_state((d,), std=1.0)
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
    grid_conv: bool = False  # FPRM's depthwise 3x3 grid convolution before each net call (issue 46's control)
    q_head: bool = True
    puzzle_emb_dim: int = (
        0  # values per puzzle-embedding row; 0 = puzzle_emb_len * d_model, -1 = d_model (TRM)
    )
    norm_eps: float = 1e-5  # TRM models/layers.py rms_norm
    norm_gain: bool = False  # TRM's RMSNorm has no gain
    mlp_multiple: int = 256  # SwiGLU width rounding (TRM _find_multiple(.., 256))
    mixer_norm_over_tokens: bool = True  # MLP mixer: post-norm over positions (TRM mlp_t)
    init: str = "lecun"  # "lecun": TRM's truncated LeCun normal (flax convention); "torch": PyTorch defaults
    loop: LoopConfig = field(
        default_factory=lambda: LoopConfig(halting="fixed", max_steps=3, grad="truncated", grad_steps=1)
    )


def check_family_config(config: ModelConfig) -> None:
    init = getattr(config, "init", "torch")
    if init not in ("lecun", "torch"):
        raise ValueError(f"init must be 'lecun' (TRM / HRM) or 'torch', got {init!r}")
    if getattr(config, "mlp_multiple", 1) < 1 or getattr(config, "puzzle_emb_dim", 0) < -1:
        raise ValueError("mlp_multiple must be >= 1 and puzzle_emb_dim >= -1 (-1 = d_model)")


class RecursiveModel(LoopedModel):
    """What TRM, HRM and TRM-DEQ share: the puzzle-token embedding, a state of two stacked latents started
    from fixed (or learned) vectors ``init_names``, the readout of the first latent on the token positions and
    a linear Q head (``q_outputs`` logits) at its first position. A family builds its nets (``build_nets``,
    called between the embedding and the initial vectors: the order the parameters are drawn in) and
    defines ``step``."""

    init_names: tuple[str, str] = ("y_init", "z_init")
    q_outputs = 1

    def __init__(self, config: ModelConfig) -> None:  # TRMConfig or HRMConfig: init, learned_init, mixer, ...
        super().__init__(config)
        check_family_config(config)
        self.embedding = PuzzleTokenEmbedding(config)
        self.build_nets(config)
        d, flax = config.d_model, config.init == "lecun"
        for name in self.init_names:
            if config.learned_init:
                setattr(self, name, init_vector(d, learned=True, flax=flax))
            else:
                self.register_buffer(name, init_vector(d, learned=False, flax=flax))
        self.lm_head = None if config.tie_embeddings else nn.Linear(d, config.vocab_size, bias=False)
        if self.lm_head is not None and flax:
            lecun_init_(self.lm_head)
        self.q_proj: nn.Linear | None = None
        if config.q_head:
            self.q_proj = nn.Linear(d, self.q_outputs)
            nn.init.zeros_(self.q_proj.weight)
            nn.init.constant_(self.q_proj.bias, Q_BIAS_INIT)

    def build_nets(self, config: ModelConfig) -> None:
        raise NotImplementedError

    def embed(self, inputs: Tensor, puzzle_ids: Tensor | None = None) -> tuple[Tensor, ...]:
        check_token_count(self.config, self.config.mixer, inputs)
        return (self.embedding(inputs, puzzle_ids),)

    def init_state(self, ctx: tuple[Tensor, ...], generator: torch.Generator | None = None) -> Tensor:
        x = ctx[0]
        B, L, d = x.shape
        first, second = (getattr(self, name).to(x.dtype).expand(B, L, d) for name in self.init_names)
        return torch.stack((first, second), dim=1)

    def readout(self, z: Tensor, *ctx: Tensor) -> Tensor:
        y = z[:, 0, self.config.puzzle_emb_len :]
        if self.lm_head is None:
            return y @ self.embedding.tokens.weight.t()
        return self.lm_head(y)


class TRM(RecursiveModel):
    config: TRMConfig

    def __init__(self, config: TRMConfig) -> None:
        if config.n_inner < 1:
            raise ValueError(f"n_inner must be >= 1, got {config.n_inner}")
        super().__init__(config)

    def build_nets(self, config: TRMConfig) -> None:
        self.net = ReasoningModule(config, config.n_layers, config.mixer)

    def step(self, z: Tensor, *ctx: Tensor) -> Tensor:
        x = ctx[0]
        y, latent = z[:, 0], z[:, 1]
        for _ in range(self.config.n_inner):
            latent = self.net(latent, y + x)
        y = self.net(y, latent)
        return torch.stack((y, latent), dim=1)

    def blocks_per_step(self) -> int:
        """A cycle: ``n_inner`` latent updates and one answer update, each through the ``n_layers``-block net."""
        return (self.config.n_inner + 1) * self.config.n_layers

    def q_head(self, z: Tensor, *ctx: Tensor) -> Tensor | None:
        if self.q_proj is None:
            return None
        return self.q_proj(z[:, 0, 0]).squeeze(-1)


def paper_config(mixer: str = "attention") -> TRMConfig:
    """TRM at paper size for Sudoku-Extreme: d 512, 2 layers, n = 6, T = 3 (~7M attention, ~5M MLP),
    with TRM's 16 puzzle-identifier tokens (one identifier for every Sudoku, ``config/arch/trm.yaml``)."""
    return TRMConfig(
        vocab_size=11,
        seq_len=81,
        d_model=512,
        n_heads=8,
        n_layers=2,
        expansion=4.0,
        n_inner=6,
        mixer=mixer,
        num_puzzle_ids=1,
        puzzle_emb_len=16,
        puzzle_emb_dim=512,
    )
