"""Universal Transformer with per-token ACT (Dehghani et al., arXiv 1807.03819; Graves, arXiv
1603.08983; the last step must halt and the weights sum to one).

One shared post-norm block (``n_layers`` = 1 by default) is applied repeatedly to every position. Before
each application a coordinate signal is added (Dehghani eq. "P^t"): the sinusoidal timestep signal of
the step number ``t`` (1-based) and, without RoPE, the sinusoidal position signal:

    h^t = Block(h^{t-1} + P_pos + P_time(t))          (post-norm: h = norm(h + S(h)) per sub-layer)

Halting is Graves' ACT per token, run by the loop engine (``halting="act"``): the halting unit
``p = sigmoid(w . h + b)`` (``halt_prob``, ``[B, T]``) accumulates to ``1 - act.eps``; the step where it
crosses (or the last step, ``max_steps``) halts with the remainder ``R``; the output state is the
halting-weighted mixture of the per-step states and the ponder cost is ``N + R``. The engine owns those
semantics; ``aux_loss`` returns ``ponder_weight * mean(ponder_cost)``.

Design choices:
- The step counter lives in the state. ``step(z, *ctx)`` is stateless, so the state is
  ``[B, T, d + 1]``: channels ``[:d]`` are the hidden state, channel ``d`` counts the steps taken
  (0 in ``init_state``). ``step`` reads the counter for the timestep signal and writes ``counter + 1``.
  The counter is detached where it is read and written, so it carries no gradient and contributes
  nothing to the step's Jacobian (the implicit-gradient modes stay well posed). Under ACT the engine's
  halting-weighted mixture also mixes the counter (giving the expected step count); ``readout`` and
  ``halt_prob`` ignore that channel. A carried state (deep supervision) continues counting.
  Limitation: the counter moves by 1 every step, so the engine's relative L2 residual of the whole
  state stays above about ``1 / sqrt(d + t^2)`` at step t (hidden RMS ~1); ``halting="residual"``
  with a small ``tol`` runs to ``max_steps``. UT halts by ACT (or fixed); the engine's logged state
  RMS includes the counter too.
- Initial state: the embedded input (embedding init std ``1/sqrt(d)`` scaled by ``sqrt(d)``, as
  tensor2tensor's ``sqrt_depth`` mode); the input is not re-injected at later steps (as in UT).
- Halting unit: ``Linear(d, 1)`` with bias 1.0 at init (tensor2tensor ``act_halting_bias_init``), read
  from the hidden state after the step (Graves: ``p_n`` from ``s_n``).
- Readout: ``head(h)``; ``h`` is already normalised by the post-norm block.
- Deviation: the feed-forward is ``loopformer.nn``'s SwiGLU (UT used a ReLU FFN / separable conv).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from loopformer.loop import LoopConfig, LoopResult
from loopformer.models.base import LoopedModel, ModelConfig
from loopformer.nn import Block, LearnedPositions


def sinusoid_signal(positions: Tensor, dim: int, max_timescale: float = 1.0e4) -> Tensor:
    """tensor2tensor's ``get_timing_signal_1d``: ``[sin(p * f_i), cos(p * f_i)]`` with geometric
    frequencies from 1 to ``1/max_timescale``; ``positions`` of any shape -> ``[..., dim]``."""
    half = dim // 2
    increment = math.log(max_timescale) / max(half - 1, 1)
    freqs = torch.exp(-increment * torch.arange(half, device=positions.device, dtype=positions.dtype))
    angles = positions.unsqueeze(-1) * freqs
    signal = torch.cat((angles.sin(), angles.cos()), dim=-1)
    if dim % 2:
        signal = nn.functional.pad(signal, (0, 1))
    return signal


@dataclass
class UTConfig(ModelConfig):
    n_layers: int = 1  # blocks in the shared step (UT: one)
    rope: bool = False  # UT adds sinusoidal position signals each step; RoPE replaces them when True
    ponder_weight: float = 0.01  # tau: weight of the ACT ponder cost in the loss
    halt_bias_init: float = 1.0
    loop: LoopConfig = field(
        default_factory=lambda: LoopConfig(
            solver="picard", halting="act", max_steps=8, plugins={"act": {"eps": 0.01}}, grad="bptt"
        )
    )


class UniversalTransformer(LoopedModel):
    config: UTConfig

    def __init__(self, config: UTConfig) -> None:
        super().__init__(config)
        if config.num_puzzle_ids or config.puzzle_emb_len:
            raise ValueError("the Universal Transformer has no per-puzzle embedding; set num_puzzle_ids=0")
        if config.n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {config.n_layers}")
        d = config.d_model
        self.scale = math.sqrt(d)
        self.tokens = nn.Embedding(config.vocab_size, d)
        nn.init.normal_(self.tokens.weight, std=1.0 / self.scale)
        self.positions = LearnedPositions(config.seq_len, d) if config.learned_positions else None
        self.blocks = nn.ModuleList(
            Block(
                d,
                config.n_heads,
                norm="post",
                causal=config.causal,
                rope=config.rope,
                expansion=config.expansion,
            )
            for _ in range(config.n_layers)
        )
        self.halt_unit = nn.Linear(d, 1)
        nn.init.constant_(self.halt_unit.bias, config.halt_bias_init)
        self.head = None if config.tie_embeddings else nn.Linear(d, config.vocab_size, bias=False)

    @staticmethod
    def split(z: Tensor) -> tuple[Tensor, Tensor]:
        """State ``[B, T, d + 1]`` -> (hidden ``[B, T, d]``, step counter ``[B, T]``)."""
        return z[..., :-1], z[..., -1]

    def embed(self, inputs: Tensor, puzzle_ids: Tensor | None = None) -> tuple[Tensor, ...]:
        if inputs.dim() != 2 or inputs.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"inputs must be integer tokens of shape [B, T], got {tuple(inputs.shape)} {inputs.dtype}"
            )
        x = self.scale * self.tokens(inputs)
        return (x if self.positions is None else self.positions(x),)

    def init_state(self, ctx: tuple[Tensor, ...], generator: torch.Generator | None = None) -> Tensor:
        x = ctx[0]
        return torch.cat((x, x.new_zeros(*x.shape[:-1], 1)), dim=-1)

    def step(self, z: Tensor, *ctx: Tensor) -> Tensor:
        h, counter = self.split(z)
        counter = counter.detach()
        signal = sinusoid_signal(counter + 1, h.shape[-1])  # timestep t = 1, 2, ...
        if not self.config.rope:
            pos = torch.arange(h.shape[-2], device=h.device, dtype=h.dtype)
            signal = signal + sinusoid_signal(pos, h.shape[-1])
        h = h + signal
        for block in self.blocks:
            h = block(h)
        return torch.cat((h, (counter + 1).unsqueeze(-1)), dim=-1)

    def readout(self, z: Tensor, *ctx: Tensor) -> Tensor:
        h, _ = self.split(z)
        if self.head is None:
            return h @ self.tokens.weight.t()
        return self.head(h)

    def halt_prob(self, z: Tensor, *ctx: Tensor) -> Tensor:
        h, _ = self.split(z)
        return torch.sigmoid(self.halt_unit(h)).squeeze(-1)

    def aux_loss(self, result: LoopResult) -> Tensor | None:
        if result.ponder_cost is None:
            return None
        return self.config.ponder_weight * result.ponder_cost.mean()


def paper_config() -> UTConfig:
    """UT base width (d 512, 8 heads, one shared layer, up to 8 ACT steps) on a Sudoku-sized input."""
    return UTConfig(vocab_size=11, seq_len=81, d_model=512, n_heads=8, n_layers=1, expansion=4.0)
