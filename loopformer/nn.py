"""Building blocks shared by every model family.

- ``RMSNorm``: root-mean-square norm (no mean subtraction), learnable gain.
- ``Rotary``: rotary position embeddings (RoFormer), tables cached per length / device / dtype; q and k
  rotated together by one complex multiplication.
- ``Attention``: multi-head attention through ``F.scaled_dot_product_attention`` (causal or
  bidirectional), so CUDA gets flash / memory-efficient kernels and CPU the math kernel;
  no flash-attn dependency.
- ``SwiGLU``: gated MLP, hidden width ``expansion * d * 2/3`` rounded up (TRM / FPRM sizing).
- ``ReLU2MLP``: ``down(relu(up(x))^2 / 2)``, hidden width ``expansion * d`` (the Attractor LM's
  ``BaseMLP`` with ``ReLU2``, github jacobfa/Attractor ``attractor/modules/mlp.py`` / ``basic.py``).
- ``Block``: attention + MLP with the norm placement chosen by name (arXiv 2606.18206; TRM arXiv 2510.04871, HRM arXiv 2506.21734):
  ``pre``  h = h (+) S(norm(h))            (GPT-2, FPRM, Attractor)
  ``post`` h = norm(h (+) S(h))            (original Transformer, TRM, HRM, UT)
  ``sandwich`` / ``peri``  h = h (+) norm(S(norm(h)))  (Huginn sandwich, Peri-LN; FPRM's "peri-norm")
  where (+) is the residual update, ``h + u`` by default. FPRM replaces it with its tied
  scaling ``a1 * h + b1 * u`` through the ``residual`` hook, without a separate block class.
- ``GPT2Block``: GPT-2's block as Hugging Face's ``GPT2Block`` computes it (the Loop, Think &
  Generalize reference uses it): pre-LayerNorm with biases, fused qkv and output projections with
  biases, tanh-GELU MLP of width ``expansion * d``, dropout on the attention weights and on both
  residual branches; weights N(0, 0.02), biases 0, output projections times ``out_init_scale``.
- ``DepthwiseConv1d`` (causal, kernel 4) and ``DepthwiseConv2d`` (grid, kernel 3): FPRM's optional
  token-mixing convolutions.
- ``trunc_normal_state``: FPRM's truncated-normal initial iterate (std 6).
- ``autocast``: bf16 autocast (``auto``: on CUDA only; ``true``: on the CPU too), else a no-op.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ResidualFn = Callable[[Tensor, Tensor], Tensor]
NORM_PLACEMENTS = ("pre", "post", "sandwich", "peri")


def _add(h: Tensor, u: Tensor) -> Tensor:
    return h + u


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, learnable: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if learnable else None

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class LearnedPositions(nn.Module):
    """``x + s * p[t]`` for a learned table ``p`` [seq_len, d] (TRM / HRM ``pos_encodings: learned``),
    initialised like the token embeddings (truncated normal, std 1/sqrt(d)); ``s`` = sqrt(d) when ``scaled``
    (embeddings that were already scaled by sqrt(d)), else 1. ``prefix=True`` also accepts inputs shorter
    than ``seq_len`` and adds the table's first rows (GPT-2's ``position_embedding(arange(T))``)."""

    def __init__(self, seq_len: int, d_model: int, scaled: bool = True, prefix: bool = False) -> None:
        super().__init__()
        std = 1.0 / math.sqrt(d_model)
        self.seq_len, self.prefix = seq_len, prefix
        self.scale = math.sqrt(d_model) if scaled else 1.0
        self.table = nn.Parameter(torch.empty(seq_len, d_model))
        nn.init.trunc_normal_(self.table, std=std, a=-2.0 * std, b=2.0 * std)

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[1]
        if n > self.seq_len or (n < self.seq_len and not self.prefix):
            raise ValueError(
                f"learned positions cover {'at most' if self.prefix else 'exactly'} seq_len = {self.seq_len} "
                f"tokens, got inputs of length {n}"
            )
        return x + self.table[:n].to(x.dtype) * self.scale


class Rotary(nn.Module):
    """Rotary position embedding (RoFormer, interleaved pairs): channel pair (2i, 2i + 1) at position t
    is rotated by the angle ``t * base^(-2i / head_dim)``.

    ``forward(x)`` rotates one tensor ``[..., T, Dh]``; ``rotate_qk(qkv)`` rotates q and k of a packed
    ``[B, T, 3, H, Dh]`` projection together.  Float32 / float64 inputs take one complex
    multiplication by a cached ``exp(i angle)`` table (one kernel forward and backward); other dtypes
    (bf16 has no complex type) and code traced by ``torch.compile`` (inductor fuses the real form,
    not complex ops) the real form ``(x1 cos - x2 sin, x1 sin + x2 cos)``.
    """

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head dimension, got {head_dim}")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cache: dict[tuple[int, torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}
        self._cis: dict[tuple[int, torch.device, torch.dtype], Tensor] = {}

    def cos_sin(self, T: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos / sin tables [T, Dh / 2], computed once per (length, device, dtype); in traced code, in the graph
        (a guard on the cache's contents would recompile the graph once the cache fills)."""
        key = (T, device, dtype)
        if torch.compiler.is_compiling() or key not in self._cache:
            t = torch.arange(T, device=device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq.to(device))
            if torch.compiler.is_compiling():
                return freqs.cos().to(dtype), freqs.sin().to(dtype)
            self._cache[key] = (freqs.cos().to(dtype), freqs.sin().to(dtype))
        return self._cache[key]

    def cis(self, T: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """``cos + i sin`` [T, Dh / 2] as a complex tensor matching the real ``dtype``."""
        key = (T, device, dtype)
        if key not in self._cis:
            cos, sin = self.cos_sin(T, device, dtype)
            self._cis[key] = torch.complex(cos, sin)
        return self._cis[key]

    @staticmethod
    def _complex_ok(x: Tensor) -> bool:
        # inductor generates no code for complex ops: under torch.compile the real form fuses instead
        return x.dtype in (torch.float32, torch.float64) and not torch.compiler.is_compiling()

    def _real(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    def forward(self, x: Tensor) -> Tensor:
        T = x.shape[-2]
        if self._complex_ok(x):
            xc = torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())
            return torch.view_as_real(xc * self.cis(T, x.device, x.dtype)).flatten(-2)
        cos, sin = self.cos_sin(T, x.device, x.dtype)
        return self._real(x, cos, sin)

    def rotate_qk(self, qkv: Tensor) -> tuple[Tensor, Tensor]:
        """q and k ``[B, H, T, Dh]`` (rotated) from a packed ``qkv`` of shape ``[B, T, 3, H, Dh]``."""
        T = qkv.shape[1]
        qk = qkv[:, :, :2]
        if self._complex_ok(qkv) and qkv.is_contiguous():
            table = self.cis(T, qkv.device, qkv.dtype)[:, None, None]  # [T, 1, 1, Dh / 2]
            rot = torch.view_as_real(torch.view_as_complex(qk.unflatten(-1, (-1, 2))) * table).flatten(-2)
        else:
            cos, sin = self.cos_sin(T, qkv.device, qkv.dtype)
            rot = self._real(qk, cos[:, None, None], sin[:, None, None])
        q, k = rot.permute(2, 0, 3, 1, 4).unbind(0)
        return q, k


class Attention(nn.Module):
    """Multi-head attention (fused qkv, no biases). ``qk_norm``: q and k are RMS-normalised per head
    after the rotation, without gain and with PyTorch's default epsilon (the Attractor LM's
    ``CausalSelfAttention`` with ``qk_norm=True``); ``rope_base``: the rotary base.
    ``forward(x, ve)``: a value embedding ``ve`` [B, T, dim] is added to v through ``ve_gate`` (set by the
    model, ``Linear(c, n_heads)``): ``v + 2 sigmoid(ve_gate(x[..., :c])) ve`` per head (github
    jacobfa/Attractor ``attractor/modules/mixer.py``, the GPT / Parcae baselines' value embeddings)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        causal: bool = False,
        rope: bool = True,
        qk_norm: bool = False,
        rope_base: float = 10000.0,
    ) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"d_model {dim} is not divisible by n_heads {n_heads}")
        self.n_heads, self.head_dim, self.causal = n_heads, dim // n_heads, causal
        self.qk_norm = qk_norm
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.rotary = Rotary(self.head_dim, rope_base) if rope else None
        self.ve_gate: nn.Linear | None = None

    def forward(self, x: Tensor, ve: Tensor | None = None) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-2], shape[-1])  # any leading dims fold into the batch
        B, T, D = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary.rotate_qk(qkv)
            v = qkv[:, :, 2].transpose(1, 2)
        else:
            q, k, v = qkv.permute(2, 0, 3, 1, 4)
        if ve is not None:
            if self.ve_gate is None:
                raise ValueError("a value embedding needs the attention's ve_gate")
            gate = 2 * torch.sigmoid(self.ve_gate(x[..., : self.ve_gate.in_features]))  # [B, T, H]
            ve = ve.reshape(B, T, self.n_heads, self.head_dim) * gate.unsqueeze(-1)
            v = v + ve.transpose(1, 2)
        if self.qk_norm:
            q, k = F.rms_norm(q, (self.head_dim,)), F.rms_norm(k, (self.head_dim,))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(B, T, D)).reshape(shape)


def swiglu_hidden(dim: int, expansion: float, multiple_of: int = 64) -> int:
    h = round(expansion * dim * 2 / 3)
    return multiple_of * math.ceil(h / multiple_of)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, expansion: float = 4.0, multiple_of: int = 64) -> None:
        super().__init__()
        hidden = swiglu_hidden(dim, expansion, multiple_of)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class ReLU2MLP(nn.Module):
    """``down(relu(up(x))^2 / 2)`` with hidden width ``round(expansion * d)``, no biases."""

    def __init__(self, dim: int, expansion: float = 4.0) -> None:
        super().__init__()
        hidden = int(round(expansion * dim))
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.relu(self.up(x)).pow(2).mul(0.5))


MLP_KINDS = ("swiglu", "relu2")


class MLPMixer(nn.Module):
    """Token mixing by an MLP across positions (TRM's attention-free variant for fixed-size grids)."""

    def __init__(self, seq_len: int, expansion: float = 4.0, multiple_of: int = 8) -> None:
        super().__init__()
        self.mlp = SwiGLU(seq_len, expansion, multiple_of=multiple_of)

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(x.transpose(-1, -2)).transpose(-1, -2)


class Block(nn.Module):
    """Token mixer (attention or MLP-mixer) + SwiGLU, with a chosen norm placement.

    ``forward(h, residual=fn)`` applies ``fn(h, u)`` for each of the two sub-layer outputs ``u``
    (default ``h + u``); FPRM passes its tied scaling ``a1 * h + b1 * u``.
    ``norm_eps`` / ``norm_gain``: the RMSNorms' epsilon and learnable gain (TRM / HRM: 1e-5, no gain);
    ``mlp_multiple``: SwiGLU widths round up to this (TRM / HRM: 256; MLP-mixer: ``mixer_multiple``);
    ``mixer_norm_over_tokens``: with the MLP mixer and post-norm, normalise the token-mixing sub-layer
    over the positions (TRM's ``mlp_t`` block norms ``h^T + mlp_t(h^T)`` before transposing back);
    ``mlp``: ``swiglu`` (default) or ``relu2`` (``ReLU2MLP``); ``qk_norm`` / ``rope_base``: see ``Attention``.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        norm: str = "pre",
        causal: bool = False,
        rope: bool = True,
        expansion: float = 4.0,
        mixer: str = "attention",
        seq_len: int | None = None,
        out_init_scale: float = 1.0,
        norm_eps: float = 1e-6,
        norm_gain: bool = True,
        mlp_multiple: int = 64,
        mixer_multiple: int = 8,
        mixer_norm_over_tokens: bool = False,
        mlp: str = "swiglu",
        qk_norm: bool = False,
        rope_base: float = 10000.0,
    ) -> None:
        super().__init__()
        if mlp not in MLP_KINDS:
            raise ValueError(f"unknown MLP {mlp!r}; choose one of {MLP_KINDS}")
        if norm not in NORM_PLACEMENTS:
            raise ValueError(f"unknown norm placement {norm!r}; choose one of {NORM_PLACEMENTS}")
        self.norm = "sandwich" if norm == "peri" else norm
        if mixer == "attention":
            self.mix: nn.Module = Attention(dim, n_heads, causal, rope, qk_norm, rope_base)
        elif mixer == "mlp":
            if seq_len is None or causal:
                raise ValueError("the MLP-mixer needs a fixed seq_len and bidirectional inputs")
            self.mix = MLPMixer(seq_len, expansion, mixer_multiple)
        else:
            raise ValueError(f"unknown token mixer {mixer!r}; choose 'attention' or 'mlp'")
        self.mix_over_tokens = mixer_norm_over_tokens and mixer == "mlp"
        if self.mix_over_tokens and self.norm != "post":
            raise ValueError("mixer_norm_over_tokens needs norm='post' (TRM's mlp_t block)")
        self.mlp = SwiGLU(dim, expansion, mlp_multiple) if mlp == "swiglu" else ReLU2MLP(dim, expansion)

        def make_norm(n: int) -> RMSNorm:
            return RMSNorm(n, eps=norm_eps, learnable=norm_gain)

        self.norm1 = make_norm(seq_len if self.mix_over_tokens else dim)  # type: ignore[arg-type]
        self.norm2 = make_norm(dim)
        if self.norm == "sandwich":
            self.out_norm1, self.out_norm2 = make_norm(dim), make_norm(dim)
        if out_init_scale != 1.0:  # e.g. LTG / GPT-2: output projections scaled near zero at init
            with torch.no_grad():
                for lin in self.output_projections():
                    lin.weight.mul_(out_init_scale)

    def output_projections(self) -> list[nn.Linear]:
        outs = [self.mlp.down]
        if isinstance(self.mix, Attention):
            outs.append(self.mix.proj)
        else:
            outs.append(self.mix.mlp.down)
        return outs

    def sublayers(self) -> Iterator[tuple[nn.Module, RMSNorm, RMSNorm | None]]:
        yield self.mix, self.norm1, getattr(self, "out_norm1", None)
        yield self.mlp, self.norm2, getattr(self, "out_norm2", None)

    def forward(self, h: Tensor, residual: ResidualFn = _add, ve: Tensor | None = None) -> Tensor:
        """``ve``: a value embedding for the attention (``Attention.forward``)."""
        if self.mix_over_tokens:  # TRM mlp_t: norm(h^T + mlp_t(h^T)) over positions, then the MLP
            t = h.transpose(-1, -2)
            h = self.norm1(residual(t, self.mix.mlp(t))).transpose(-1, -2)
            return self.norm2(residual(h, self.mlp(h)))
        for layer, norm, out_norm in self.sublayers():
            if ve is not None and layer is self.mix:
                layer = partial(self.mix, ve=ve)
            if self.norm == "pre":
                h = residual(h, layer(norm(h)))
            elif self.norm == "post":
                h = norm(residual(h, layer(h)))
            else:
                h = residual(h, out_norm(layer(norm(h))))
        return h


class GPT2Block(nn.Module):
    """GPT-2 block (pre-LayerNorm, biases, tanh-GELU MLP, dropout); ``forward(h, residual=fn)`` as ``Block``."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        causal: bool = True,
        expansion: float = 4.0,
        dropout: float = 0.0,
        eps: float = 1e-5,
        out_init_scale: float = 1.0,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"d_model {dim} is not divisible by n_heads {n_heads}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.n_heads, self.head_dim, self.causal, self.dropout = n_heads, dim // n_heads, causal, dropout
        hidden = int(round(expansion * dim))
        self.ln_1, self.ln_2 = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)
        self.c_attn, self.attn_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.c_fc, self.mlp_proj = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)
        with torch.no_grad():
            for lin in (self.c_attn, self.attn_proj, self.c_fc, self.mlp_proj):
                nn.init.normal_(lin.weight, std=init_std)
                nn.init.zeros_(lin.bias)
            for lin in self.output_projections():
                lin.weight.mul_(out_init_scale)

    def output_projections(self) -> list[nn.Linear]:
        return [self.mlp_proj, self.attn_proj]

    def attention(self, x: Tensor, key_mask: Tensor | None = None) -> Tensor:
        """``key_mask`` [B, T] bool (True = a real token): other keys are masked out, as the padding
        ``attention_mask`` Hugging Face's GPT-2 adds (-10000, which is exactly 0 weight after the softmax)."""
        B, T, D = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        if key_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        else:
            mask = key_mask[:, None, None, :].bool()
            if self.causal:
                mask = mask & torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return self.attn_proj(y.transpose(1, 2).reshape(B, T, D))

    def forward(self, h: Tensor, residual: ResidualFn = _add, key_mask: Tensor | None = None) -> Tensor:
        h = residual(h, self.drop(self.attention(self.ln_1(h), key_mask)))
        u = self.mlp_proj(F.gelu(self.c_fc(self.ln_2(h)), approximate="tanh"))
        return residual(h, self.drop(u))


class DepthwiseConv1d(nn.Module):
    """Causal depthwise convolution over the token axis of [B, T, d] (FPRM: kernel 4)."""

    def __init__(self, dim: int, kernel: int = 4) -> None:
        super().__init__()
        self.kernel = kernel
        self.conv = nn.Conv1d(dim, dim, kernel, groups=dim, bias=False)
        nn.init.zeros_(self.conv.weight)  # starts as the identity map through the residual

    def forward(self, x: Tensor) -> Tensor:
        y = F.pad(x.transpose(1, 2), (self.kernel - 1, 0))
        return self.conv(y).transpose(1, 2)


class DepthwiseConv2d(nn.Module):
    """Depthwise convolution over tokens laid out as an H x W grid (FPRM Sudoku: kernel 3).

    Tokens beyond H * W (e.g. prepended puzzle-embedding tokens) pass through unchanged (zero output).
    """

    def __init__(self, dim: int, grid: tuple[int, int], kernel: int = 3) -> None:
        super().__init__()
        self.grid = grid
        self.conv = nn.Conv2d(dim, dim, kernel, padding=kernel // 2, groups=dim, bias=False)
        nn.init.zeros_(self.conv.weight)

    def forward(self, x: Tensor) -> Tensor:
        H, W = self.grid
        B, T, D = x.shape
        n = H * W
        if T < n:
            raise ValueError(f"grid convolution expects at least {n} tokens ({H}x{W}), got {T}")
        # [B, n, D] viewed as a channels-last [B, D, H, W] image: no transposing copies in or out
        g = x[:, T - n :].unflatten(1, (H, W)).permute(0, 3, 1, 2)
        y = self.conv(g).permute(0, 2, 3, 1).reshape(B, n, D)
        return F.pad(y, (0, 0, T - n, 0)) if T > n else y


def trunc_normal_state(
    shape: tuple[int, ...],
    std: float,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
) -> Tensor:
    """A truncated-normal tensor (a normal of standard deviation ``std`` cut at +-2 std, the law of
    ``nn.init.trunc_normal_(std=std, a=-2 std, b=2 std)``), FPRM's initial iterate (std 6.0). Drawn by the
    inverse CDF (``u ~ U(erf(-sqrt 2), erf(sqrt 2))``, ``sqrt 2 std erfinv(u)``): a fixed number of kernels and no
    host read, where torch's rejection sampler asks the host whether it must draw again."""
    return trunc_normal_fill_(torch.empty(shape, device=device, dtype=dtype), std, generator)


def trunc_normal_fill_(z: Tensor, std: float, generator: torch.Generator | None = None) -> Tensor:
    """Fill ``z`` in place with ``trunc_normal_state``'s law (a normal of ``std`` cut at +-2 std)."""
    if std == 0:
        return z.detach().zero_()
    bound = math.erf(2.0 / math.sqrt(2.0))
    with torch.no_grad():
        z.uniform_(-bound, bound, generator=generator).erfinv_().mul_(math.sqrt(2.0) * std)
        return z.clamp_(-2 * std, 2 * std)


def autocast(device: torch.device | str, bf16: bool | str) -> contextlib.AbstractContextManager:
    """bf16 autocast: ``bf16="auto"`` on CUDA only, ``True`` on every device (CPU included), ``False`` never."""
    device_type = torch.device(device).type
    if bf16 is True or (bf16 == "auto" and device_type == "cuda"):
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
