"""FPRM: the Fixed-Point Reasoning Model (Movahedi et al., arXiv 2606.18206).

One latent ``h`` and one body ``F(h; x)`` of ``L = n_layers`` pre-norm blocks (attention + SwiGLU),
i.e. ``2L`` residual sub-layer updates per iteration. One iteration (``step``):

1. optional depthwise convolution over the tokens (``conv``: ``grid2d`` kernel 3 over
   ``config.grid``, e.g. Sudoku; ``causal1d`` kernel 4, e.g. maze / ARC / state tracking), applied as
   a plain residual ``h <- h + conv(h)`` with the kernel initialised to zero. A depthwise
   ``h + conv(h)`` is itself a depthwise convolution (kernel + identity tap), so this is the same
   function class as the authors' code, which replaces ``h <- conv(h)``, only initialised at the
   identity; it sits outside the tied scaling so the b-tying below stays exact. Prepended
   puzzle-embedding tokens are not convolved.
2. input re-injection, once per iteration: ``h <- a2 * h + b2 * x`` (x is not normalised);
3. every sub-layer S: ``h <- a1 * h + b1 * S(RMSNorm(h))``, the same a1, b1 in every layer
   (``nn.Block`` with its ``residual`` hook; ``norm="post"`` gives ``RMSNorm(a1 h + b1 S(h))``,
   ``norm="peri"`` gives ``a1 h + b1 RMSNorm(S(RMSNorm(h)))``, the paper's other placements).

Scalars: ``a = sigmoid(p)`` per channel, ``p`` = ``residual_logit_a1`` / ``residual_logit_a2``
(``no_weight_decay()`` names them for the optimiser). The b's are tied, not free:
``b2 = 1 - a2 a1^(2L)``, ``b1 = b2 (1 - a1) / (1 - a1^(2L)) = b2 / sum_{k<2L} a1^k`` (the second
form is exact and stays finite as a1 -> 1). With every sub-layer output equal to a common u, one
iteration is ``h' = rho h + (1 - rho)(a1^(2L) x + u)``, ``rho = a2 a1^(2L) < 1``: a convex
contraction, so iterates stay bounded (the paper's Theorem 1; tested in tests/test_models_fprm.py).
``scalars``:
- ``learned`` (default): input-independent per-channel logits, init a1 = 0.75, a2 = 0.25;
- ``fixed``: the same values as non-trainable buffers;
- ``input``: ``p = p0 + W mean_t(x)`` per sample (W zero-initialised, so training starts from the
  learned init); one pair of scalar vectors per sample, so the contraction argument holds per sample;
- ``state``: ``p = p0 + W h`` per token from the current (convolved) state, the authors' code's
  "input-dependent" variant (W zero-initialised).

Precision: under ``LoopConfig.state_dtype="bfloat16"`` the engine keeps the iterate and the injected
input in bf16 and the scalars a1, a2 are cast to bf16 before the b's are tied (the authors'
``FixedPointTransformer.forward``: ``sigmoid(p).to(hidden_states.dtype)``), so the whole iteration runs
in bf16 arithmetic as in their code; the default keeps the state in float32 (docs/fidelity.md, FPRM).

Initial iterate: truncated normal with std ``init_std`` = 6.0 (all of the paper's task configs),
drawn with the engine's generator. Readout: ``head(RMSNorm(h))`` (tied option). Q-head: a linear
map of the mean (``q_pool="mean"``) or first token (``"first"``, the puzzle-embedding position in
the authors' code) of ``RMSNorm(h)`` -> one logit [B]; weight zero and bias -5 at init (TRM / FPRM),
trained by a BCE loss, not used for halting.

Default loop (training and evaluation): damped solver (gamma 0.9, patience 5, Algorithm 1),
residual halting at tol 0.1 in the relative sup norm, at most 16 steps, truncated backprop through
the last 6 steps. For deep-supervision training segments the trainer sets ``max_steps = K =
grad_steps`` (K = 6 Sudoku / maze, 4 for A5 / S5) and carries the detached state between segments;
evaluation raises gamma to 0.99 and the step cap. State tracking uses ``causal=True``, ``rope=False``,
``conv="causal1d"``, a1 = a2 = 0.5 (``state_tracking_config``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel, ModelConfig
from loopformer.models.transformer import InputEmbedding, OutputHead, make_blocks
from loopformer.nn import DepthwiseConv1d, DepthwiseConv2d, RMSNorm, trunc_normal_fill_, trunc_normal_state

SCALAR_MODES = ("learned", "fixed", "input", "state")
CONVS = ("none", "grid2d", "causal1d")
FPRM_NORMS = ("pre", "post", "peri")
Q_POOLS = ("mean", "first")
CONV_FORMS = ("residual", "replace")
STATE_NORMS = ("none", "input", "output")
INITS = ("torch", "lecun")

# standard deviation of N(0, 1) truncated to [-2, 2]: 1 - 2 a phi(a) / (2 Phi(a) - 1) at a = 2, square-rooted
_TRUNC2_STD = math.sqrt(1 - 2 * 2 * math.exp(-2.0) / math.sqrt(2 * math.pi) / math.erf(2 / math.sqrt(2)))


def lecun_trunc_normal_(t: Tensor, std: float, generator: torch.Generator | None = None) -> Tensor:
    """Truncated normal (cut at 2 of its own scale) whose *actual* standard deviation is ``std``.

    The JAX / flax convention the authors' code uses for every weight and for the initial iterate
    (``trunc_normal_init_`` in their ``models/common.py``); ``nn.init.trunc_normal_(std=s)`` has an
    actual standard deviation of ``0.88 s``.
    """
    scale = std / _TRUNC2_STD
    if std == 0:
        return t.detach().zero_()
    return nn.init.trunc_normal_(t, 0.0, scale, -2 * scale, 2 * scale, generator=generator)


def _default_loop() -> LoopConfig:
    return LoopConfig(
        solver="damped",
        plugins={"damped": {"gamma": 0.9, "patience": 5}},
        halting="residual",
        tol=0.1,
        residual_norm="rel_sup",
        max_steps=16,
        grad="truncated",
        grad_steps=6,
    )


def tied_coefficients(a1: Tensor, a2: Tensor, n_sublayers: int, eps: float = 0.0) -> tuple[Tensor, Tensor]:
    """FPRM's tied b's: ``b2 = 1 - a2 a1^n``, ``b1 = b2 (1 - a1) / (1 - a1^n)`` with n = 2L sub-layers.

    ``(1 - a1) / (1 - a1^n)`` is computed as ``1 / sum_{k<n} a1^k`` (exact, finite at a1 = 1).
    ``eps > 0`` gives the authors' guarded form ``b2 (1 - a1) / (1 - a1^n + eps)`` instead
    (``FixedPointTransformer.forward`` in their ``models/transformer.py`` uses eps = 1e-5).
    """
    if n_sublayers < 1:
        raise ValueError(f"n_sublayers must be >= 1, got {n_sublayers}")
    b2 = 1 - a2 * a1**n_sublayers
    if eps:
        return b2 * (1 - a1) / (1 - a1**n_sublayers + eps), b2
    geometric = sum(a1**k for k in range(n_sublayers))
    return b2 / geometric, b2


def _logit(p: float) -> float:
    if not 0 < p < 1:
        raise ValueError(f"FPRM residual scalars must lie in (0, 1), got {p}")
    return math.log(p / (1 - p))


@dataclass
class FPRMConfig(ModelConfig):
    n_layers: int = 2
    norm: str = "pre"  # pre | post | peri
    scalars: str = "learned"  # learned | fixed | input | state
    a1_init: float = 0.75  # 0.5 for A5 / S5
    a2_init: float = 0.25  # 0.5 for A5 / S5
    conv: str = "none"  # none | grid2d (needs grid, kernel 3) | causal1d (kernel 4)
    conv_kernel: int = 0  # 0 = the paper's default for the conv type (3 for grid2d, 4 for causal1d)
    init_std: float = 6.0  # std of the truncated-normal initial iterate
    mixer: str = "attention"  # attention | mlp (MLP-mixer over a fixed number of tokens)
    q_head: bool = True
    q_pool: str = "mean"  # mean | first
    # options that reproduce the authors' code (nilskiKonjIzDunava/fprm; docs/fidelity.md, FPRM)
    conv_form: str = "residual"  # residual: h + conv(h), kernel zero-init | replace: conv(h), PyTorch init
    state_norm: str = "none"  # none | input | output: gain-free RMSNorm of the iterate inside the map
    head_norm: bool = True  # False: readout and Q-head read the raw state (no final RMSNorm)
    norm_eps: float = 1e-6  # RMSNorm epsilon (authors: 1e-5)
    norm_gain: bool = True  # False: RMSNorms without a learnable gain (authors' rms_norm)
    mlp_multiple: int = 64  # SwiGLU hidden width rounded up to a multiple of this (authors: 256)
    init: str = "torch"  # torch (PyTorch defaults) | lecun: exact-std truncated LeCun normal (authors)
    tied_eps: float = 0.0  # > 0: b1 = b2 (1 - a1) / (1 - a1^(2L) + tied_eps) (authors: 1e-5)
    puzzle_emb_dim: int = 0  # 0: puzzle_emb_len * d_model; else a narrower table, zero-padded (authors)
    decay_vectors: bool = False  # True: weight decay on biases too (authors: all but the residual logits)
    loop: LoopConfig = field(default_factory=_default_loop)


def _validate(config: FPRMConfig) -> None:
    for name, allowed in (
        ("norm", FPRM_NORMS),
        ("scalars", SCALAR_MODES),
        ("conv", CONVS),
        ("q_pool", Q_POOLS),
        ("conv_form", CONV_FORMS),
        ("state_norm", STATE_NORMS),
        ("init", INITS),
    ):
        if getattr(config, name) not in allowed:
            raise ValueError(f"FPRMConfig.{name}={getattr(config, name)!r} is not one of {allowed}")
    if config.n_layers < 1:
        raise ValueError(f"FPRMConfig.n_layers must be >= 1, got {config.n_layers}")
    if config.mlp_multiple < 1:
        raise ValueError(f"FPRMConfig.mlp_multiple must be >= 1, got {config.mlp_multiple}")
    if not 0 < config.norm_eps < 1:
        raise ValueError(f"FPRMConfig.norm_eps must be in (0, 1), got {config.norm_eps}")
    if config.tied_eps < 0:
        raise ValueError(f"FPRMConfig.tied_eps must be >= 0, got {config.tied_eps}")
    width = config.puzzle_emb_len * config.d_model
    if config.puzzle_emb_dim and not (config.puzzle_emb_len and 0 < config.puzzle_emb_dim <= width):
        raise ValueError(
            f"FPRMConfig.puzzle_emb_dim={config.puzzle_emb_dim} needs puzzle_emb_len > 0 and at most "
            f"puzzle_emb_len * d_model = {width} (it is zero-padded to that width)"
        )


class PaddedInputEmbedding(InputEmbedding):
    """A puzzle table ``puzzle_emb_dim`` wide, zero-padded to ``puzzle_emb_len`` prepended tokens.

    The authors' layout (``puzzle_emb_ndim`` = d_model with ``puzzle_emb_len`` = 16: the puzzle vector
    fills the first prefix token, the other 15 start as zeros and carry only their own iterate).
    ``puzzle_ids=None`` uses identifier 0 (their Sudoku and maze builds give every puzzle id 0).
    """

    def __init__(self, config: FPRMConfig) -> None:
        super().__init__(config)
        self.puzzle_emb = nn.Embedding(config.num_puzzle_ids, config.puzzle_emb_dim)
        nn.init.zeros_(self.puzzle_emb.weight)
        self.default_puzzle_id = True


class FPRM(LoopedModel):
    """Pre-norm looped body with tied residual scaling, solved to a fixed point by the engine."""

    config: FPRMConfig

    def __init__(self, config: FPRMConfig) -> None:
        super().__init__(config)
        _validate(config)
        d = config.d_model
        self.n_sublayers = 2 * config.n_layers
        self.embedding = PaddedInputEmbedding(config) if config.puzzle_emb_dim else InputEmbedding(config)
        self.prefix_len = self.embedding.prefix_len
        block_kw: dict[str, object] = {
            "norm": config.norm,
            "mixer": config.mixer,
            "norm_eps": config.norm_eps,
            "norm_gain": config.norm_gain,
            "mlp_multiple": config.mlp_multiple,
        }
        if config.mlp_multiple != 64:  # the authors round the token-mixing MLP the same way
            block_kw["mixer_multiple"] = config.mlp_multiple
        if config.mixer == "mlp":
            block_kw["seq_len"] = config.seq_len + self.prefix_len
        self.layers = make_blocks(config, config.n_layers, **block_kw)
        self.output = OutputHead(config, self.embedding)
        self._reference_layers()

        self.conv: nn.Module | None = None
        if config.conv == "grid2d":
            if config.grid is None:
                raise ValueError("FPRM conv='grid2d' needs config.grid, e.g. (9, 9) for Sudoku")
            if config.causal:
                raise ValueError("FPRM conv='grid2d' is bidirectional; use conv='causal1d' with causal=True")
            self.conv = DepthwiseConv2d(d, tuple(config.grid), kernel=config.conv_kernel or 3)
        elif config.conv == "causal1d":
            self.conv = DepthwiseConv1d(d, kernel=config.conv_kernel or 4)
        if self.conv is not None and config.conv_form == "replace":
            self.conv.conv.reset_parameters()  # h <- conv(h): PyTorch's default Conv init, as the authors

        p1 = torch.full((d,), _logit(config.a1_init))
        p2 = torch.full((d,), _logit(config.a2_init))
        if config.scalars == "fixed":
            self.register_buffer("residual_logit_a1", p1)
            self.register_buffer("residual_logit_a2", p2)
        else:
            self.residual_logit_a1 = nn.Parameter(p1)
            self.residual_logit_a2 = nn.Parameter(p2)
        self.scalar_net: nn.Linear | None = None
        if config.scalars in ("input", "state"):
            self.scalar_net = nn.Linear(d, 2 * d, bias=False)
            nn.init.zeros_(self.scalar_net.weight)

        self.q_linear: nn.Linear | None = None
        if config.q_head:
            self.q_linear = nn.Linear(d, 1)
            nn.init.zeros_(self.q_linear.weight)
            nn.init.constant_(self.q_linear.bias, -5.0)
        if config.init == "lecun":
            self._lecun_init()

    def _reference_layers(self) -> None:
        """The head norm as configured: epsilon / gain like the blocks', or none (authors' options)."""
        cfg = self.config
        if not cfg.head_norm:
            self.output.norm = nn.Identity()
        else:
            self.output.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, learnable=cfg.norm_gain)

    def _lecun_init(self) -> None:
        """Every linear weight and the token embedding as the authors' ``CastedLinear`` /
        ``CastedEmbedding``: exact-std truncated normal, std 1/sqrt(fan_in) (embedding 1/sqrt(d))."""
        lecun_trunc_normal_(self.embedding.tokens.weight.data, 1.0 / math.sqrt(self.config.d_model))
        for module in [*self.layers.modules(), *self.output.modules()]:
            if isinstance(module, nn.Linear) and module.weight is not getattr(
                self.embedding.tokens, "weight", None
            ):
                lecun_trunc_normal_(module.weight.data, 1.0 / math.sqrt(module.in_features))

    @property
    def decay_vectors(self) -> bool:
        """Whether the optimiser decays one-dimensional parameters (the Q-head bias) too."""
        return self.config.decay_vectors

    def no_weight_decay(self) -> set[str]:
        """Names of parameters the optimiser must not decay: the residual-scaling logits."""
        names = {"residual_logit_a1", "residual_logit_a2"}
        return {n for n, _ in self.named_parameters() if n in names}

    # -- the scalars -----------------------------------------------------------------------------
    def residual_scalars(self, h: Tensor, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(a1, a2, b1, b2), each broadcastable to h: [d], [B, 1, d] ('input') or [B, T, d] ('state')."""
        p1, p2 = self.residual_logit_a1, self.residual_logit_a2
        if self.scalar_net is not None:
            src = x.mean(dim=1, keepdim=True) if self.config.scalars == "input" else h
            d1, d2 = self.scalar_net(src).chunk(2, dim=-1)
            p1, p2 = p1 + d1, p2 + d2
        a1, a2 = torch.sigmoid(p1), torch.sigmoid(p2)
        if h.dtype.itemsize < a1.dtype.itemsize:  # a bf16 state (LoopConfig.state_dtype): the reference casts
            a1, a2 = a1.to(h.dtype), a2.to(h.dtype)  # the a's to the state's dtype and ties the b's in it
        b1, b2 = tied_coefficients(a1, a2, self.n_sublayers, self.config.tied_eps)
        return a1, a2, b1, b2

    # -- the contract ----------------------------------------------------------------------------
    def embed(self, inputs: Tensor, puzzle_ids: Tensor | None = None) -> tuple[Tensor, ...]:
        return (self.embedding(inputs, puzzle_ids),)

    def init_state(self, ctx: tuple[Tensor, ...], generator: torch.Generator | None = None) -> Tensor:
        x = ctx[0]
        if self.config.init == "lecun":  # std the truncated law's own (drawn by inverse CDF: no host read)
            z = torch.empty(x.shape, device=x.device, dtype=x.dtype)
            return trunc_normal_fill_(z, self.config.init_std / _TRUNC2_STD, generator=generator)
        return trunc_normal_state(
            tuple(x.shape), self.config.init_std, device=x.device, dtype=x.dtype, generator=generator
        )

    def apply_conv(self, h: Tensor) -> Tensor:
        """The token convolution of the grid tokens (prefix tokens pass unchanged): h + conv(h) or conv(h)."""
        if self.conv is None:
            return h
        P = self.prefix_len
        grid = h[:, P:] if P else h
        y = self.conv(grid)
        out = y if self.config.conv_form == "replace" else grid + y
        return torch.cat([h[:, :P], out], dim=1) if P else out

    def _state_norm(self, h: Tensor) -> Tensor:
        return F.rms_norm(h, (h.shape[-1],), None, self.config.norm_eps)

    def step(self, z: Tensor, *ctx: Tensor) -> Tensor:
        x = ctx[0]
        h = self.apply_conv(z)
        a1, a2, b1, b2 = self.residual_scalars(h, x)
        if self.config.state_norm == "input":
            h = self._state_norm(h)
        if h.dtype.itemsize < 4:  # bf16 state: each product and the sum rounded, as the reference's code
            h = a2 * h + b2 * x

            def scaled(h_: Tensor, u: Tensor) -> Tensor:
                return a1 * h_ + b1 * u
        else:
            h = torch.addcmul(b2 * x, a2, h)  # a2 h + b2 x in two kernels instead of three

            def scaled(h_: Tensor, u: Tensor) -> Tensor:
                return torch.addcmul(b1 * u, a1, h_)  # a1 h + b1 u

        for block in self.layers:
            h = block(h, residual=scaled)
        if self.config.state_norm == "output":
            h = self._state_norm(h)
        return h

    def readout(self, z: Tensor, *ctx: Tensor) -> Tensor:
        return self.output(z)

    def q_head(self, z: Tensor, *ctx: Tensor) -> Tensor | None:
        if self.q_linear is None:
            return None
        h = self.output.norm(z)
        pooled = h.mean(dim=1) if self.config.q_pool == "mean" else h[:, 0]
        return self.q_linear(pooled).squeeze(-1)


# the authors' code's choices, where loopformer's defaults differ (docs/fidelity.md, FPRM); their
# config/arch/fprm.yaml + models/config.py defaults
REFERENCE_OPTIONS: dict[str, object] = {
    "conv_form": "replace",
    "head_norm": False,
    "norm_eps": 1e-5,
    "norm_gain": False,
    "mlp_multiple": 256,
    "init": "lecun",
    "tied_eps": 1e-5,
    "decay_vectors": True,
    "q_pool": "first",
}


def paper_config() -> FPRMConfig:
    """FPRM on Sudoku-Extreme as the authors' ``config/cfg_pretrain_sudoku.yaml`` builds it: d 512,
    8 heads, 2 blocks, SwiGLU x4 (width 1536), RoPE, 2-D conv kernel 3 on the 9x9 grid, 16 prefix
    tokens (one 512-wide puzzle row, zero-padded), vocab 11, 81 tokens: ~6.8M parameters (paper: ~7M)."""
    return FPRMConfig(
        vocab_size=11,
        seq_len=81,
        d_model=512,
        n_heads=8,
        n_layers=2,
        expansion=4.0,
        grid=(9, 9),
        conv="grid2d",
        num_puzzle_ids=1,
        puzzle_emb_len=16,
        puzzle_emb_dim=512,
        **REFERENCE_OPTIONS,  # type: ignore[arg-type]
    )


def state_tracking_config(group_size: int = 120) -> FPRMConfig:
    """FPRM on A5 / S5 word problems (arXiv 2606.18206): causal, no RoPE, causal 1-D conv, a1 = a2 = 0.5,
    K = 4 differentiable steps; vocab |G| + 1 (61 for A5, 121 for S5)."""
    loop = _default_loop()
    loop = replace(loop, grad_steps=4, plugins={"damped": {"gamma": 0.95, "patience": 10}})
    return FPRMConfig(
        vocab_size=group_size + 1,
        seq_len=32,
        d_model=512,
        n_heads=8,
        n_layers=2,
        causal=True,
        rope=False,
        conv="causal1d",
        a1_init=0.5,
        a2_init=0.5,
        loop=loop,
    )
