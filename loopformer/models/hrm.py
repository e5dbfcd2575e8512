"""HRM: the Hierarchical Reasoning Model (HRM, arXiv 2506.21734).

Two recurrent modules, a slow high-level ``H`` and a fast low-level ``L``, each ``n_layers`` = 4
post-norm blocks (d 512, ~27M parameters at paper size). One *step* of the loop engine is one
high-level cycle of HRM's code:

    for i in range(l_cycles):  zL = L(zL + (zH + x))      # HRM code: L_level(z_L, z_H + input)
    zH = H(zH + zL)                                       # HRM code: H_level(z_H, z_L)

and the ``H_cycles`` high-level cycles are the engine's steps:
``LoopConfig(halting="fixed", max_steps=H_cycles (2), grad="truncated", grad_steps=1)``.

HRM's one-step gradient: the gradient flows only through the LAST call of each module in the segment
(the final ``zL = L(...)`` and the final ``zH = H(...)``); every other call runs without gradient.
Here it is split between the engine and the step map:
- the engine's truncated gradient (``grad_steps=1``) runs all but the last step under ``no_grad`` and
  feeds the last step a detached state (so the earlier H calls and all their L calls carry no gradient);
- inside ``step``, when ``one_step_grad`` is on (default) and autograd is recording
  (``torch.is_grad_enabled()``), the first ``l_cycles - 1`` L calls run under ``torch.no_grad()``; only
  the last L call and the H call are recorded. With autograd off (the engine's no-grad prefix,
  evaluation) the step is the same computation with nothing recorded.
Consequence: the step's Jacobian w.r.t. the incoming ``zL`` is zero whenever ``l_cycles > 1`` (the first
L call is not recorded), in every gradient mode, including bptt / neumann / ift. ``one_step_grad=False``
records every call, so ``grad="bptt"`` then backpropagates through the whole schedule.

Design choices (where they come from):
- State ``[B, 2, P + T, d]``: index 0 = ``zH`` (read out), index 1 = ``zL``; P = ``puzzle_emb_len``.
- Embedding, per-puzzle embedding (one token of ``d`` values: HRM's ``puzzle_emb_len`` is
  ``ceil(puzzle_emb_ndim / d)`` = 1), post-norm blocks without norm gain (eps 1e-5), SwiGLU widths
  rounded to 256, truncated LeCun normal init (flax convention), fixed truncated-normal ``H_init`` /
  ``L_init`` vectors (buffers by default, see ``loopformer.models.trm``): as HRM's code, shared with
  TRM through ``RecursiveModel`` / ``PuzzleTokenEmbedding`` / ``ReasoningModule``.
- Readout ``lm_head(zH)`` on the token positions.
- Q-learning ACT head: ``Linear(d, 2)`` on ``zH`` at the first position gives HRM's ``(q_halt,
  q_continue)`` logits (weight 0, bias -5 at init). ``q_values`` returns both ``[B, 2]`` (for a
  Q-learning trainer); ``q_head`` returns ``q_halt - q_continue`` ``[B]``, whose sign is HRM's halting
  decision (halt when ``q_halt > q_continue``), so a trainer that treats it as a halting logit (BCE
  against correctness, TRM style) halts exactly when HRM would.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import Tensor

from loopformer.loop import LoopConfig
from loopformer.models.base import ModelConfig
from loopformer.models.trm import ReasoningModule, RecursiveModel


@dataclass
class HRMConfig(ModelConfig):
    n_layers: int = 4  # layers in H (and in L unless l_layers is set)
    l_layers: int = 0  # layers in L; 0 = n_layers (HRM's H_layers / L_layers, both 4 in its configs)
    l_cycles: int = 2  # L updates per H update
    mixer: str = "attention"  # "attention" or "mlp" (TRM's MLP across positions; the head-to-head's HRM, issue 46)
    one_step_grad: bool = True  # HRM's 1-step gradient: record only the last L call of a step
    learned_init: bool = False  # learn the zH / zL initial vectors instead of HRM's fixed buffers
    q_head: bool = True
    puzzle_emb_dim: int = (
        0  # values per puzzle-embedding row; 0 = puzzle_emb_len * d_model, -1 = d_model (HRM)
    )
    norm_eps: float = 1e-5  # HRM models/layers.py rms_norm
    norm_gain: bool = False  # HRM's RMSNorm has no gain
    mlp_multiple: int = 256  # SwiGLU width rounding (HRM _find_multiple(.., 256))
    init: str = "lecun"  # "lecun": HRM's truncated LeCun normal (flax convention); "torch": PyTorch defaults
    loop: LoopConfig = field(
        default_factory=lambda: LoopConfig(halting="fixed", max_steps=2, grad="truncated", grad_steps=1)
    )


class HRM(RecursiveModel):
    config: HRMConfig
    init_names = ("h_init", "l_init")
    q_outputs = 2  # (q_halt, q_continue)

    def __init__(self, config: HRMConfig) -> None:
        if config.l_cycles < 1:
            raise ValueError(f"l_cycles must be >= 1, got {config.l_cycles}")
        super().__init__(config)

    def build_nets(self, config: HRMConfig) -> None:
        self.H = ReasoningModule(config, config.n_layers, config.mixer)
        self.L = ReasoningModule(config, config.l_layers or config.n_layers, config.mixer)

    def step(self, z: Tensor, *ctx: Tensor) -> Tensor:
        x = ctx[0]
        zh, zl = z[:, 0], z[:, 1]
        skip_grad = self.config.one_step_grad and torch.is_grad_enabled()
        for i in range(self.config.l_cycles):
            last = i == self.config.l_cycles - 1
            with torch.no_grad() if (skip_grad and not last) else contextlib.nullcontext():
                zl = self.L(zl, zh + x)
        zh = self.H(zh, zl)
        return torch.stack((zh, zl), dim=1)

    def blocks_per_step(self) -> int:
        """An H-cycle: ``l_cycles`` passes of the L module and one of the H module."""
        return self.config.l_cycles * (self.config.l_layers or self.config.n_layers) + self.config.n_layers

    def q_values(self, z: Tensor, *ctx: Tensor) -> Tensor | None:
        """HRM's Q-learning logits ``[B, 2]`` = (q_halt, q_continue), read from ``zH`` at position 0."""
        if self.q_proj is None:
            return None
        return self.q_proj(z[:, 0, 0])

    def q_head(self, z: Tensor, *ctx: Tensor) -> Tensor | None:
        q = self.q_values(z, *ctx)
        return None if q is None else q[:, 0] - q[:, 1]


def paper_config() -> HRMConfig:
    """HRM at paper size for Sudoku-Extreme: H and L of 4 layers each, d 512, 2 x 2 cycles (~27M), with
    HRM's one puzzle-identifier token (``puzzle_emb_ndim = hidden_size``; one identifier for every Sudoku)."""
    return HRMConfig(
        vocab_size=11,
        seq_len=81,
        d_model=512,
        n_heads=8,
        n_layers=4,
        expansion=4.0,
        l_cycles=2,
        num_puzzle_ids=1,
        puzzle_emb_len=1,
        puzzle_emb_dim=512,
    )
