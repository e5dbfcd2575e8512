"""Recurrent-depth transformer: Loop-Think-Generalize, Huginn and Parcae on one class.

Equations (arXiv 2604.07822; TRM arXiv 2510.04871, HRM arXiv 2506.21734):
- prelude: ``e = P(E(x))`` with ``n_prelude`` distinct blocks (0 for LTG, a few for Huginn / Parcae);
- core: ``n_layers`` blocks with shared weights, looped R times by the engine; the state update is
  chosen by ``injection``:
    ``none``    h <- core(h)                      h0 = e   (LTG without re-injection)
    ``add``     h <- core(h + e)                  h0 = e   (LTG's optional additive re-injection)
    ``concat``  h <- core(W [h; e])               h0 ~ N(0, init_std^2)  (Huginn; W: 2d -> d)
    ``parcae``  h <- core(exp(-softplus(dt) * exp(A)) * h + softplus(dt) * B e)   h0 = 0
               (Parcae's contractive diagonal injection: the decay is in (0, 1) per channel for
               any parameters, so the injection alone is a contraction)
  ``init`` overrides h0: ``embed`` (e), ``zeros``, ``random`` (normal, std ``init_std``, drawn with
  the engine's generator).
- coda: ``n_coda`` distinct blocks, then final RMSNorm + head (tied embeddings optional; LTG ties).
  ``readout`` applies coda + norm + head to ANY state, so on intermediate states it is the logit
  lens used to find bridge entities and to measure overthinking (arXiv 2604.07822).

Design choices:
- Output projections of every block are multiplied by ``out_init_scale`` at init (LTG / GPT-2:
  "scaled near zero"; default 0.1), so each loop starts close to the identity.
- ``rope=False`` gives no positional encoding at all (LTG's setting; causal attention still
  orders tokens).
- ``concat``: W is initialised to ``[I, I]``, so at init ``W[h; e] = h + e`` and concat starts as
  additive injection; it can then learn any linear mix.
- ``parcae``: A (``injection_log_A``) initialised to 0 (exp(A) = 1), dt so that the initial decay is
  ``parcae_decay`` (default 0.5: dt = 0; the reference's ``ssm_decay`` sqrt(1/5)), B to the identity.
  ``coda_proj`` adds Parcae's output projection C (d x d, before the coda; github jacobfa/Attractor
  ``attractor/models/parcae/parcae.py``), ``prelude_norm`` an RMSNorm after the prelude (its
  ``prelude_norm``). ``value_embeddings``: Parcae's per-token tables added to v (``transformer.value_embeddings``)
  on the effective layers ``i % 2 == (n - 1) % 2`` of prelude + core + coda; the core's and the coda's
  are computed in ``embed`` and travel at the end of the context.
- The Attractor paper's LM layer options of ``transformer.LMLayerOptions`` (``mlp: relu2``, ``qk_norm``,
  ``norm_eps``, ``rope_base``, ``embed_scale``, ``logit_scale``, ``init_orthogonal``) with
  ``weight_init: scaled_zero`` (``init`` here is the initial state); loopformer blocks only.
- KL / entropy halting reads ``halting_readout``: with ``halt_position="all"`` every position (reduced
  by ``kl_entropy.reduce``), with ``"answer"`` only the answer position, the last token that is
  not ``pad_id`` (the LTG reference's ``forward_adapative`` with ``pred_pos="inp_len"`` reads that
  position; github OSU-NLP-Group/Loop-Think-Generalize, gpt_utils_extrapolation.py), with ``"last"``
  only the last position of the padded sequence (``pred_pos="last_token"``, the reference's default; the
  task must put the label there: ``kg_files`` with ``pred_pos: last``). Other positions are replaced by a
  certain, constant distribution (KL 0, entropy 0), so they never block halting.
- ``pad_mask=True`` (``block="gpt2"``): padding keys (``pad_id``) are masked out of every attention, as
  the reference's ``attention_mask`` does; the outputs at pad positions then equal the reference's too
  (needed when the answer is read at a pad position, ``halt_position="last"``). Real positions of
  right-padded queries are the same either way (causal attention never reaches a later pad).
- ``block="gpt2"``: the LTG reference's architecture (github OSU-NLP-Group/Loop-Think-Generalize,
  gpt_utils_extrapolation.py ``RecurrentGPT2Block``): Hugging Face ``GPT2Block`` layers
  (``loopformer.nn.GPT2Block``: LayerNorm, GELU, biases, ``dropout`` on attention weights and both
  residual branches, output projections times ``out_init_scale``, 0 = zero-initialised as the
  reference's ``--c_scale 0``), a final LayerNorm, a token embedding ~ N(0, 1) used unscaled and
  tied to the head, ``embed_dropout`` on the embedded input, ``learned_positions``: an N(0, 1) table
  added once, unscaled, whose first T rows serve inputs of T <= ``seq_len`` tokens
  (gpt_utils_systematicity.py ``position_embedding``). ``norm`` must stay ``"pre"``.
  With ``injection="add"`` and ``init="zeros"`` the loop is the reference's ``--input_injection``
  (no injection before the first loop: ``h1 = core(e)``, then ``h <- core(h + e)``).
- Default loop: 4 Picard steps, fixed halting, BPTT. LTG's Poisson(4) loop counts in [2, 8] come
  from the trainer's samplers; KL/entropy halting (``halting="kl_entropy"``) reads this readout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel, ModelConfig
from loopformer.models.transformer import (
    InputEmbedding,
    LMLayerOptions,
    OutputHead,
    apply_layer_options,
    make_blocks,
    matrix_init,
    scaled_zero_blocks,
    scaled_zero_io,
    value_embeddings,
)
from loopformer.nn import GPT2Block, RMSNorm

INJECTIONS = ("none", "add", "concat", "parcae")
HALT_POSITIONS = ("all", "answer", "last")
BLOCKS = ("loopformer", "gpt2")
INITS = ("auto", "embed", "zeros", "random")
_AUTO_INIT = {"none": "embed", "add": "embed", "concat": "random", "parcae": "zeros"}


def _default_loop() -> LoopConfig:
    return LoopConfig(solver="picard", halting="fixed", max_steps=4, grad="bptt")


@dataclass
class RecurrentConfig(LMLayerOptions, ModelConfig):
    n_prelude: int = 0  # distinct blocks before the loop
    n_coda: int = 0  # distinct blocks after the loop (part of the readout)
    injection: str = "add"  # none | add | concat | parcae
    init: str = (
        "auto"  # auto | embed | zeros | random (auto: embed for none/add, random concat, zeros parcae)
    )
    init_std: float = 1.0  # std of the random initial state
    norm: str = "pre"  # pre | post | sandwich | peri (Huginn uses sandwich)
    out_init_scale: float = 0.1  # output projections scaled near zero at init (LTG)
    halt_position: str = "all"  # KL / entropy halting reads: all | answer (last non-pad) | last
    block: str = (
        "loopformer"  # loopformer (nn.Block: RMSNorm, SwiGLU, no biases) | gpt2 (the LTG reference's)
    )
    dropout: float = 0.0  # gpt2 blocks: attention and residual dropout (GPT2Config default 0.1)
    embed_dropout: float = 0.0  # gpt2: dropout on the embedded input (the reference's embd_pdrop)
    pad_id: int | None = None  # the padding token (needed by halt_position="answer" and pad_mask)
    pad_mask: bool = False  # gpt2: mask padding keys (pad_id) out of attention, as the LTG reference
    weight_init: str = "default"  # default | scaled_zero (the Attractor paper's baselines)
    prelude_norm: bool = False  # Parcae: RMSNorm after the prelude
    coda_proj: bool = False  # Parcae: linear C (d x d, no bias) on the state before the coda
    parcae_decay: float = 0.5  # injection=parcae: initial per-channel decay exp(-softplus(dt) exp(A))
    value_embeddings: bool = False  # Parcae: gated per-token tables added to v (prelude + core + coda layers)
    loop: LoopConfig = field(default_factory=_default_loop)

    def __post_init__(self) -> None:
        self.check_layer_options("weight_init")
        if not (isinstance(self.parcae_decay, (int, float)) and 0 < self.parcae_decay < 1):
            raise ValueError(f"RecurrentConfig.parcae_decay must lie in (0, 1), got {self.parcae_decay!r}")
        if self.block == "gpt2":
            defaults = LMLayerOptions()
            changed = [k for k in vars(defaults) if getattr(self, k) != getattr(defaults, k)]
            changed += ["weight_init"] * (self.weight_init != "default")
            changed += [k for k in ("prelude_norm", "coda_proj", "value_embeddings") if getattr(self, k)]
            if changed:
                raise ValueError(
                    f"RecurrentConfig: block='gpt2' has its own layers; {changed} need block='loopformer'"
                )
        if self.value_embeddings and self.num_puzzle_ids:
            raise ValueError("RecurrentConfig.value_embeddings needs no puzzle embedding (num_puzzle_ids 0)")


class RecurrentDepth(LoopedModel):
    """Prelude -> looped core (shared weights) with input re-injection -> coda -> norm -> head."""

    config: RecurrentConfig

    def __init__(self, config: RecurrentConfig) -> None:
        super().__init__(config)
        if config.injection not in INJECTIONS:
            raise ValueError(f"unknown injection {config.injection!r}; choose one of {INJECTIONS}")
        if config.init not in INITS:
            raise ValueError(f"unknown init {config.init!r}; choose one of {INITS}")
        if config.n_layers < 1 or config.n_prelude < 0 or config.n_coda < 0:
            raise ValueError(
                f"need n_layers >= 1 and n_prelude, n_coda >= 0; got {config.n_layers}, "
                f"{config.n_prelude}, {config.n_coda}"
            )
        if config.block not in BLOCKS:
            raise ValueError(f"unknown block {config.block!r}; choose one of {BLOCKS}")
        d = config.d_model
        self.embedding = InputEmbedding(config)
        if config.block == "gpt2":
            self._gpt2_layers(config)
        else:
            kw = dict(norm=config.norm, out_init_scale=config.out_init_scale, **config.layer_kwargs())
            self.prelude = make_blocks(config, config.n_prelude, **kw)  # type: ignore[arg-type]
            self.core = make_blocks(config, config.n_layers, **kw)  # type: ignore[arg-type]
            self.coda = make_blocks(config, config.n_coda, **kw)  # type: ignore[arg-type]
            self.output = OutputHead(config, self.embedding)
            apply_layer_options(config, self.embedding, self.output)
        self.ve_prelude = self.ve_core = self.ve_coda = None
        if config.value_embeddings:  # effective layers prelude, core (once), coda, as Parcae counts them
            n_p, n_c = config.n_prelude, config.n_layers
            total = n_p + n_c + config.n_coda
            self.ve_prelude = value_embeddings(config, self.prelude, 0, total)
            self.ve_core = value_embeddings(config, self.core, n_p, total)
            self.ve_coda = value_embeddings(config, self.coda, n_p + n_c, total)
        self.prelude_out_norm = RMSNorm(d, eps=config.norm_eps) if config.prelude_norm else None
        self.coda_in = nn.Linear(d, d, bias=False) if config.coda_proj else None
        self.embed_drop = nn.Dropout(config.embed_dropout)
        if config.injection == "concat":
            self.injection_proj = nn.Linear(2 * d, d, bias=False)
            with torch.no_grad():
                eye = torch.eye(d)
                self.injection_proj.weight.copy_(torch.cat([eye, eye], dim=1))
        elif config.injection == "parcae":
            self.injection_log_A = nn.Parameter(torch.zeros(d))
            self.injection_dt = nn.Parameter(torch.zeros(d))
            self.injection_B = nn.Linear(d, d, bias=False)
            with torch.no_grad():
                self.injection_B.weight.copy_(torch.eye(d))
                dt = -math.log(config.parcae_decay)  # softplus(raw) = dt: raw = dt + log(1 - exp(-dt))
                self.injection_dt.fill_(dt + math.log(-math.expm1(-dt)))
        if config.weight_init == "scaled_zero":
            std = scaled_zero_io(config, self.embedding, self.output, config.init_orthogonal)
            for blocks in (self.prelude, self.core, self.coda):
                scaled_zero_blocks(blocks, std, config.init_orthogonal)
            if self.coda_in is not None and not self.coda_in.weight.is_meta:
                with torch.no_grad():
                    matrix_init(self.coda_in.weight, std, config.init_orthogonal)
        self.init_mode = _AUTO_INIT[config.injection] if config.init == "auto" else config.init
        if config.halt_position not in HALT_POSITIONS:
            raise ValueError(
                f"unknown halt_position {config.halt_position!r}; choose one of {HALT_POSITIONS}"
            )
        if config.halt_position == "answer" and config.pad_id is None:
            raise ValueError(
                "halt_position='answer' needs pad_id (the answer is the last token that is not padding)"
            )
        if config.pad_mask and (config.pad_id is None or config.block != "gpt2"):
            raise ValueError("pad_mask needs block='gpt2' and pad_id (the token whose keys are masked)")

    def _gpt2_layers(self, config: RecurrentConfig) -> None:
        """GPT-2 blocks, final LayerNorm, unscaled N(0, 1) token embedding (LTG's RecurrentGPT2Block)."""
        if config.norm != "pre":
            raise ValueError(f"block='gpt2' is pre-LayerNorm; norm must be 'pre', got {config.norm!r}")
        if config.num_puzzle_ids:
            raise ValueError("block='gpt2' has no per-puzzle embedding (num_puzzle_ids must be 0)")

        def blocks(n: int) -> nn.ModuleList:
            return nn.ModuleList(
                GPT2Block(
                    config.d_model,
                    config.n_heads,
                    causal=config.causal,
                    expansion=config.expansion,
                    dropout=config.dropout,
                    out_init_scale=config.out_init_scale,
                )
                for _ in range(n)
            )

        self.prelude, self.core, self.coda = (
            blocks(config.n_prelude),
            blocks(config.n_layers),
            blocks(config.n_coda),
        )
        self.embedding.scale = 1.0
        nn.init.normal_(self.embedding.tokens.weight, std=1.0)  # nn.Embedding's default, as the reference
        if self.embedding.positions is not None:  # gpt_utils_systematicity.py: position_embedding, an
            self.embedding.positions.scale = 1.0  # nn.Embedding added to the token embeddings: N(0, 1),
            self.embedding.positions.prefix = True  # rows 0..T-1 for T tokens
            nn.init.normal_(self.embedding.positions.table, std=1.0)
        self.output = OutputHead(config, self.embedding)
        self.output.norm = nn.LayerNorm(config.d_model, eps=1e-5)  # type: ignore[assignment]

    def no_weight_decay(self) -> set[str]:
        """Parcae's diagonal dynamics parameters (A, dt) are excluded from weight decay; with
        ``weight_init="scaled_zero"`` (the Attractor paper's Parcae) B too, and C always, as the
        reference's optimiser groups (``recpre/optim/muon_adamw.py``: ``adapter.B``, ``transformer.C``)."""
        names = {"injection_log_A", "injection_dt"} if self.config.injection == "parcae" else set()
        if names and self.config.weight_init == "scaled_zero":
            names.add("injection_B")
        return names | ({"coda_in"} if self.coda_in is not None else set())

    def embed(self, inputs: Tensor, puzzle_ids: Tensor | None = None) -> tuple[Tensor, ...]:
        """``(e, [monitored positions (halt_position answer / last)], [real tokens (pad_mask)])``."""
        keys = inputs != self.config.pad_id if self.config.pad_mask else None
        e = self.embed_drop(self.embedding(inputs, puzzle_ids))
        if self.ve_prelude is not None:
            e = self._ve_blocks(
                self.prelude, self.ve_prelude, e, [t(inputs) for t in self.ve_prelude.values()]
            )
        else:
            e = self._blocks(self.prelude, e, keys)
        if self.prelude_out_norm is not None:
            e = self.prelude_out_norm(e)
        ctx: tuple[Tensor, ...] = (e,)
        if self.config.halt_position == "answer":
            ctx += (answer_mask(inputs, self.config.pad_id),)
        elif self.config.halt_position == "last":
            ctx += (
                torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs) == inputs.shape[1] - 1,
            )
        if self.ve_core is not None and self.ve_coda is not None:  # the core's, then the coda's, at the end
            ctx += tuple(t(inputs) for t in (*self.ve_core.values(), *self.ve_coda.values()))
        return ctx if keys is None else (*ctx, keys)

    def _ve_blocks(
        self, blocks: nn.ModuleList, tables: nn.ModuleDict, h: Tensor, ves: list[Tensor]
    ) -> Tensor:
        by_layer = dict(zip(tables.keys(), ves))
        for i, block in enumerate(blocks):
            h = block(h, ve=by_layer.get(str(i)))
        return h

    def _ctx_ves(self, ctx: tuple[Tensor, ...]) -> tuple[list[Tensor], list[Tensor]]:
        """The core's and the coda's value embeddings from the end of ``ctx`` (``embed``)."""
        assert self.ve_core is not None and self.ve_coda is not None
        n_core, n_coda = len(self.ve_core), len(self.ve_coda)
        if len(ctx) < 1 + n_core + n_coda:
            raise ValueError(
                "this model has value embeddings: pass the context from embed() to step / readout"
            )
        tail = list(ctx[len(ctx) - n_core - n_coda :])
        return tail[:n_core], tail[n_core:]

    def _blocks(self, blocks: nn.ModuleList, h: Tensor, keys: Tensor | None) -> Tensor:
        for block in blocks:
            h = block(h) if keys is None else block(h, key_mask=keys)
        return h

    def _keys(self, ctx: tuple[Tensor, ...]) -> Tensor | None:
        return ctx[-1] if self.config.pad_mask else None

    def halting_readout(self, z: Tensor, *ctx: Tensor) -> Tensor:
        logits = self.readout(z, *ctx)
        if self.config.halt_position == "all":
            return logits
        certain = torch.full_like(logits, -1e4)
        certain[..., 0] = 0.0
        return torch.where(ctx[1].unsqueeze(-1), logits, certain)

    def init_state(self, ctx: tuple[Tensor, ...], generator: torch.Generator | None = None) -> Tensor:
        e = ctx[0]
        if self.init_mode == "embed":
            return e
        if self.init_mode == "zeros":
            return torch.zeros_like(e)
        z = torch.randn(e.shape, generator=generator, device=e.device, dtype=e.dtype)
        return z * self.config.init_std

    def inject(self, h: Tensor, e: Tensor) -> Tensor:
        """The core's input before the shared blocks (see the module docstring)."""
        mode = self.config.injection
        if mode == "none":
            return h
        if mode == "add":
            return h + e
        if mode == "concat":
            return self.injection_proj(torch.cat([h, e], dim=-1))
        dt = F.softplus(self.injection_dt)
        decay = torch.exp(-dt * torch.exp(self.injection_log_A))
        return decay * h + dt * self.injection_B(e)

    def step(self, z: Tensor, *ctx: Tensor) -> Tensor:
        if self.ve_core is not None:
            return self._ve_blocks(self.core, self.ve_core, self.inject(z, ctx[0]), self._ctx_ves(ctx)[0])
        return self._blocks(self.core, self.inject(z, ctx[0]), self._keys(ctx))

    def readout(self, z: Tensor, *ctx: Tensor) -> Tensor:
        if self.coda_in is not None:
            z = self.coda_in(z)
        if self.ve_coda is not None:
            z = self._ve_blocks(self.coda, self.ve_coda, z, self._ctx_ves(ctx)[1])
        else:
            z = self._blocks(self.coda, z, self._keys(ctx) if ctx else None)
        logits = self.output(z)
        return logits if self.config.logit_scale == 1.0 else logits * self.config.logit_scale


def answer_mask(inputs: Tensor, pad_id: int | None) -> Tensor:
    """[B, T] bool, True at each row's last token that is not ``pad_id`` (right-padded queries)."""
    real = inputs != pad_id
    positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    last = torch.where(real, positions, -1).amax(dim=1, keepdim=True)
    return positions == last


def paper_config() -> RecurrentConfig:
    """LTG (arXiv 2604.07822): a 4-layer block, d 768, 12 heads, tied embeddings, no positional encoding,
    causal; vocabulary of the depth-extrapolation graph (200 entities + 10 relations + 4 specials,
    an assumption of this library's task encoding); SwiGLU x4 has GPT-2's MLP parameter count."""
    return RecurrentConfig(
        vocab_size=214,
        seq_len=42,
        d_model=768,
        n_heads=12,
        n_layers=4,
        causal=True,
        rope=False,
        tie_embeddings=True,
        injection="none",
    )
