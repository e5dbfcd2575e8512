"""``loopformer train RECIPE --plan``: the memory a recipe needs per GPU, and the micro-batch that fits.

The plan builds the recipe's model on PyTorch's ``meta`` device (shapes and dtypes, no storage, no
arithmetic: a 140M-parameter model at sequence 2048 is measured in seconds on a CPU) and counts:

- model state: parameters and buffers, gradients (one per trainable parameter), the optimiser's
  state (measured: one meta optimiser step, then the bytes of its state tensors), the EMA copy
  (``train.ema``), DDP's gradient buckets (one more gradient-sized buffer when ``--gpus`` > 1 under
  ``train.strategy=ddp``; FSDP2 instead divides parameters, gradients and optimiser state by the
  number of GPUs), and under ``bf16`` autocast's cached bf16 copy of the weights;
- activations: one training forward and loss at batch 2 and at batch 4, at the recipe's full
  sequence length, inside ``torch.autograd.graph.saved_tensors_hooks``; the bytes of the unique
  storages of the tensors saved for backward (parameters and buffers excluded) give the bytes per
  example (the difference) and a fixed part. The training loop runs to its cap (``fixed`` halting at
  ``max_steps``, the largest loop count a sampler draws): the worst case of adaptive halting.
  Attention is counted as a fused kernel saves it (q, k, v, output and a float32 log-sum-exp row),
  as CUDA's flash / memory-efficient kernels and this CPU's flash kernel do; the meta device's own
  math path would save the T x T probabilities instead. Under ``bf16`` (true or auto: a GPU run) the meta
  device, which has no autocast, runs autocast's policy (``Bf16Autocast``: the inputs of matrix products
  and convolutions cast to bfloat16 above autograd), so the count is the bf16 one; it agrees with the same
  hooks on real tensors under CPU autocast within a few percent for every paper recipe family
  (tests/test_train_plan_measured.py);
- the deep-supervision carry (``train.mode=deep_supervision``): every slot's state, alive across steps.

Peak per GPU (micro-batch m) = model state + carry + fixed activations + m x activations per
example, plus a margin of 5% and 2 GiB (the CUDA context, allocator fragmentation and the
transient buffers of the backward). The largest m that divides the rows per GPU and fits gives
``train.grad_accum_steps`` = rows per GPU / m (``loopformer.train.accumulate``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from loopformer.config import ConfigError, RunConfig
from loopformer.tasks.base import TaskDataError, TokenDataset
from loopformer.train.losses import q_halt_loss, sequence_loss

# the margin on top of the counted bytes: the CUDA context (~0.5-1 GiB), the backward's transient gradient
# buffers (a few activation-sized tensors) and the caching allocator's fragmentation, small now that every
# shape of a training step is static (issue 33: the carry is refilled in place, the loops do not compact)
MARGIN_FRACTION = 0.05
MARGIN_BYTES = 2 * 2**30
GiB = 2**30
MEASURED_AT = (
    2,
    4,
)  # batch sizes of the two measurements (batch 1 can share storages a larger batch does not)


def parse_memory(text: str) -> int:
    """``"80GB"`` -> 80e9 bytes, ``"80GiB"`` -> 80 * 2^30, a plain number: GB."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(gib|gb|g|mib|mb|tb|tib)?\s*", text.lower())
    if not m:
        raise ConfigError(f"--gpu-memory {text!r}: expected a size such as 80GB, 141GB or 80GiB")
    unit = {"gb": 1e9, "g": 1e9, None: 1e9, "gib": GiB, "mb": 1e6, "mib": 2**20, "tb": 1e12, "tib": 2**40}
    size = int(float(m.group(1)) * unit[m.group(2)])
    if size < 2**20:  # 0 (or a few bytes) plans nothing: every micro-batch "fits" nowhere
        raise ConfigError(f"--gpu-memory {text!r}: a GPU's memory must be at least 1 MiB (e.g. 80GB)")
    return size


def _key(t: Tensor) -> int:
    return t.untyped_storage()._cdata


class _FusedAttention(torch.autograd.Function):
    """A meta stand-in for a fused attention kernel: saves q, k, v, the output and a float32 LSE row."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:  # type: ignore[override]
        # laid out [B, T, H, D] as the flash kernels write it (a transpose + reshape after is free)
        out = q.new_empty((*q.shape[:-3], q.shape[-2], q.shape[-3], v.shape[-1])).transpose(-2, -3)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, *(() if mask is None else (mask,)))
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        raise RuntimeError("the plan's meta attention has no backward")


def _fused_sdpa(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, *args: Any, **kw: Any
) -> Tensor:
    return _FusedAttention.apply(q, k, v, attn_mask)


@contextmanager
def count_saved(exclude: set[int]) -> Iterator[dict[int, int]]:
    """Inside: ``{storage: bytes}`` of every tensor autograd saves for backward, storages in
    ``exclude`` (parameters, buffers) left out; on the meta device attention is the fused kernel's."""
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        key = _key(t)
        if key not in exclude:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), meta_safe():
        yield seen


@contextmanager
def meta_safe() -> Iterator[None]:
    """What a training forward needs to run on the meta device: the fused attention stand-in, no
    autocast query for "meta", and data-dependent reads (``int`` / ``bool`` / ``item`` of a meta
    tensor: input validation) answered 0 / False; every loop, inner solves included, runs to its cap
    as a plain loop (no halting checks, no host syncs): the worst case of adaptive halting."""
    autocast_on, as_int, as_bool, item = (
        torch.is_autocast_enabled,
        torch.Tensor.__int__,
        torch.Tensor.__bool__,
        torch.Tensor.item,
    )

    def is_autocast_enabled(*args: Any) -> bool:
        return False if args and str(args[0]) == "meta" else autocast_on(*args)

    with mock.patch.object(F, "scaled_dot_product_attention", _fused_sdpa), \
            mock.patch.object(torch, "is_autocast_enabled", is_autocast_enabled), \
            mock.patch.object(torch.Tensor, "__int__", lambda t: 0 if t.is_meta else as_int(t)), \
            mock.patch.object(torch.Tensor, "__bool__", lambda t: False if t.is_meta else as_bool(t)), \
            mock.patch.object(torch.Tensor, "item", lambda t: 0 if t.is_meta else item(t)):  # fmt: skip
        yield


def _to_bf16(x: Any) -> Any:
    return x.to(torch.bfloat16) if isinstance(x, Tensor) and x.dtype == torch.float32 else x


class Bf16Autocast(TorchFunctionMode):
    """Autocast's bfloat16 policy where there is no autocast (the meta device): the floating inputs of the ops
    autocast runs in bf16 (``torch.autocast`` "lower precision" ops: linear, matrix products, convolutions)
    are cast to bf16 first, above autograd, so the tensors saved for backward are the bf16 copies, as under
    CPU and CUDA autocast; everything else runs in its inputs' dtype (a float32 residual plus a bf16 update is
    float32, as autocast promotes). tests/test_train_plan_measured.py checks the count against real CPU
    autocast for every paper recipe family."""

    LOWER = (F.linear, torch.matmul, Tensor.matmul, Tensor.__matmul__, Tensor.__rmatmul__, torch.bmm, torch.mm,
             torch.baddbmm, torch.addmm, torch.addbmm, F.conv1d, F.conv2d, F.conv3d)  # fmt: skip

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in self.LOWER:
            args = tuple(_to_bf16(a) for a in args)
            kwargs = {k: _to_bf16(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def bf16_counting(cfg: RunConfig) -> bool:
    """Whether the run's matrix products run under bf16 autocast on its GPU (``bf16: true`` or ``auto``)."""
    return cfg.bf16 is True or cfg.bf16 == "auto"


def state_keys(model: nn.Module) -> set[int]:
    return {_key(t) for t in (*model.parameters(), *model.buffers())}


def training_loss(
    model: nn.Module, cfg: RunConfig, inputs: Tensor, labels: Tensor, pids: Tensor | None
) -> Tensor:
    """One training forward and loss as the trainer computes it (no randomness that matters)."""
    tc = cfg.train
    loop = plan_loop(cfg, model)
    state = None
    if tc.mode == "deep_supervision":  # one segment from a detached (carried) state
        with torch.no_grad():
            state = model.init_state(model.embed(inputs, pids)).detach()
    out = model(inputs, loop=loop, state=state, puzzle_ids=pids)
    loss = sequence_loss(out.logits, labels, tc.loss, tc.label_smoothing)
    if out.q_logits is not None and tc.q_loss_weight > 0:
        loss = loss + tc.q_loss_weight * q_halt_loss(
            out.q_logits, torch.zeros_like(out.q_logits, dtype=torch.bool)
        )
    if out.aux_loss is not None and tc.ponder_weight > 0:
        loss = loss + tc.ponder_weight * out.aux_loss
    if tc.q_learning and hasattr(model, "q_values"):
        loss = loss + model.q_values(out.state).sum()
    model.plan_state_shape = tuple(out.state.shape[1:])  # type: ignore[attr-defined]
    model.plan_state_dtype = out.state.dtype  # type: ignore[attr-defined]
    return loss


def plan_loop(cfg: RunConfig, model: nn.Module) -> Any:
    """The training loop at its cap: ``fixed`` halting (learned ACT kept) at the largest count."""
    from loopformer.loop.halting import HALTINGS
    from loopformer.loop.samplers import training_sampler

    loop = cfg.loop_config(model.config.loop, "train")
    steps = loop.max_steps
    sampler = training_sampler(
        cfg.train.loop_sampler, cfg.train.loop_sampler_options, loop.max_steps, cfg.seed
    )
    if sampler is not None:
        steps = max(int(sampler.sample(s)) for s in range(256))
    halting = loop.halting if HALTINGS.get(loop.halting).learned else "fixed"
    return dataclasses.replace(
        loop, halting=halting, max_steps=steps, min_steps=min(loop.min_steps, steps), trace=False
    )


def activation_bytes(build: Callable[[], nn.Module], cfg: RunConfig, rows: TokenDataset, batches: tuple[int, ...],
                     device: str = "meta") -> list[int]:  # fmt: skip
    """Saved-activation bytes of one training forward + loss at each batch size (``rows`` repeated)."""
    model = build()
    model.train()
    exclude = state_keys(model)
    out = []
    for b in batches:
        idx = np.arange(b) % len(rows)
        inputs = torch.as_tensor(rows.inputs[idx], device=device)
        labels = torch.as_tensor(rows.labels[idx], device=device)
        pids = None if rows.puzzle_ids is None else torch.as_tensor(rows.puzzle_ids[idx], device=device)
        autocast = Bf16Autocast() if device == "meta" and bf16_counting(cfg) else contextlib.nullcontext()
        with count_saved(exclude) as seen, autocast:
            loss = training_loss(model, cfg, inputs, labels, pids)
        out.append(sum(seen.values()))
        del loss
    return out


@dataclass
class Plan:
    """What ``--plan`` prints (bytes unless named otherwise)."""

    parameters: int
    trainable: int
    model_bytes: int  # parameters + buffers
    grad_bytes: int
    optimizer_bytes: int
    optimizer_how: str
    ema_bytes: int
    bucket_bytes: int
    cast_bytes: int
    carry_bytes: int
    per_example: int
    fixed: int
    measured: tuple[int, int]
    rows_per_gpu: int
    gpus: int
    gpu_memory: int
    strategy: str
    batch_wide: str = ""  # the training loop's halting rule when it is batch-wide (accumulation refuses it)
    halt_group: int = 0  # its loop_train.halt_group: micro-batches it divides are exact

    @property
    def state_bytes(self) -> int:
        shard = self.gpus if (self.strategy == "fsdp" and self.gpus > 1) else 1
        sharded = (self.model_bytes + self.grad_bytes + self.optimizer_bytes + self.ema_bytes) / shard
        return int(sharded + self.bucket_bytes + self.cast_bytes + self.carry_bytes)

    def peak(self, micro: int) -> int:
        raw = self.state_bytes + self.fixed + micro * self.per_example
        return int(raw * (1 + MARGIN_FRACTION) + MARGIN_BYTES)

    def best_micro(self) -> int | None:
        """The largest micro-batch dividing the rows per GPU whose peak fits; None when none does."""
        fits = [
            m
            for m in range(1, self.rows_per_gpu + 1)
            if self.rows_per_gpu % m == 0 and self.peak(m) <= self.gpu_memory
        ]
        return max(fits) if fits else None

    def accum_steps(self) -> int | None:
        m = self.best_micro()
        return None if m is None else self.rows_per_gpu // m


def optimizer_state_bytes(model: nn.Module, cfg: RunConfig) -> tuple[int, str]:
    """Bytes of the optimiser's state after one step on the meta device (a formula when that fails)."""
    from loopformer.train.setup import make_optimizer

    opt = make_optimizer(model, cfg.train)
    params = [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    import torch.fx.experimental._config as fx_config

    try:  # sign-SGD's rows: nonzero() on meta, taken as all rows
        with mock.patch.object(fx_config, "meta_nonzero_assume_all_nonzero", True):
            opt.step()
    except (RuntimeError, NotImplementedError, TypeError) as err:  # an op without a meta kernel
        n = sum(
            p.numel() * p.element_size()
            for g in opt.param_groups
            if not g.get("sign_sgd")
            for p in g["params"]
        )
        return (
            2 * n,
            f"2 moments per parameter outside the sign-SGD rows (formula: a meta step raised {type(err).__name__})",
        )
    finally:
        for p in params:
            p.grad = None
    total = sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)
    )
    return total, f"measured ({type(opt).__name__} state after one step)"


def _seq_len(cfg: RunConfig, task: Any) -> int:
    for value in (cfg.model.fields.get("seq_len"), getattr(task, "seq_len", 0), cfg.data.options.get("seq_len"),
                  cfg.data.options.get("width")):  # fmt: skip
        if value:
            return int(value)
    return 0


def plan_rows(cfg: RunConfig, task: Any) -> tuple[TokenDataset, str]:
    """Two example rows at the recipe's sequence length: synthetic tokens (the token values do not
    change what a forward saves) when the length is known, else the first rows of the training data."""
    from loopformer.runs import task_dataset

    T = _seq_len(cfg, task)
    vocab = int(cfg.model.fields.get("vocab_size") or getattr(task, "vocab_size", 0) or 2)
    n_ids = int(cfg.model.fields.get("num_puzzle_ids") or getattr(task, "num_puzzle_ids", 0) or 0)
    if T:
        inputs = np.arange(2 * T).reshape(2, T) % vocab
        pids = np.zeros(2, dtype=np.int64) if n_ids else None
        return TokenDataset(
            inputs, inputs.copy(), np.zeros(2), puzzle_ids=pids
        ), f"synthetic rows of {T} tokens"
    try:
        data = task_dataset(task, cfg.data, "train")
    except (OSError, ValueError, TaskDataError) as err:
        raise ConfigError(f"--plan: the recipe's sequence length is unknown and its data cannot be read ({err}); "
                          "set model.seq_len=N") from err  # fmt: skip
    return data.subset(
        np.arange(min(2, len(data)))
    ), f"the first rows of the training data ({data.inputs.shape[1]} tokens)"


def _meta_builder(cfg: RunConfig, task: Any, rows: TokenDataset) -> Callable[[], nn.Module]:
    import copy

    from loopformer.train.setup import build_run_model

    def build() -> nn.Module:
        with torch.device("meta"):
            return build_run_model(copy.deepcopy(cfg), task, rows)

    return build


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def make_plan(cfg: RunConfig, gpus: int, gpu_memory: int) -> tuple[Plan, str]:
    """The plan of ``cfg`` on ``gpus`` GPUs of ``gpu_memory`` bytes each, and where its rows came from."""
    from loopformer.runs import run_task

    tc = cfg.train
    if gpus < 1 or tc.batch_size % gpus:
        raise ConfigError(f"--gpus {gpus}: train.batch_size={tc.batch_size} must split evenly over the GPUs")
    try:
        task = run_task(cfg.data)
        missing = ""
    except (
        OSError,
        TaskDataError,
    ) as err:  # the task reads files that are not here: the recipe's fields decide
        task, missing = (
            None,
            f"; the task's files are not here ({type(err).__name__}), so the model fields decide",
        )
    rows, source = plan_rows(cfg, task)
    source += missing
    build = _meta_builder(cfg, task, rows)
    a1, a2 = activation_bytes(build, cfg, rows, MEASURED_AT)
    model = build()
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    optim, how = optimizer_state_bytes(model, cfg)
    training_loss_shape(model, cfg, rows)
    rows_per_gpu = tc.batch_size // gpus
    carry = 0
    if tc.mode == "deep_supervision":
        state = (
            math.prod(model.plan_state_shape) * torch.empty((), dtype=model.plan_state_dtype).element_size()
        )
        carry = rows_per_gpu * (state + 2 * rows.inputs.shape[1] * 8)
    ema = 0
    if tc.ema > 0:
        ema = _nbytes(
            p for n, p in model.named_parameters() if tc.ema_puzzle_embeddings or "puzzle_emb" not in n
        )
    plan = Plan(
        parameters=sum(p.numel() for p in params), trainable=sum(p.numel() for p in trainable),
        model_bytes=_nbytes(params) + _nbytes(model.buffers()), grad_bytes=_nbytes(trainable),
        optimizer_bytes=optim, optimizer_how=how, ema_bytes=ema,
        bucket_bytes=_nbytes(trainable) if gpus > 1 and tc.strategy == "ddp" else 0,
        cast_bytes=2 * sum(p.numel() for p in trainable) if cfg.bf16 is True or cfg.bf16 == "auto" else 0,
        carry_bytes=carry, per_example=(a2 - a1) // (MEASURED_AT[1] - MEASURED_AT[0]),
        fixed=max(a1 - MEASURED_AT[0] * (a2 - a1) // (MEASURED_AT[1] - MEASURED_AT[0]), 0), measured=(a1, a2),
        rows_per_gpu=rows_per_gpu, gpus=gpus, gpu_memory=gpu_memory, strategy=tc.strategy,
        batch_wide=_batch_wide(cfg, model), halt_group=cfg.loop_config(model.config.loop, "train").halt_group,
    )  # fmt: skip
    return plan, source


def _batch_wide(cfg: RunConfig, model: nn.Module) -> str:
    from loopformer.loop.halting import HALTINGS

    halting = plan_loop(cfg, model).halting if cfg.train.loop_sampler != "none" and cfg.train.mode == "simple" else (
        cfg.loop_config(model.config.loop, "train").halting)  # fmt: skip
    return halting if HALTINGS.get(halting).batch_stalls else ""


def training_loss_shape(model: nn.Module, cfg: RunConfig, rows: TokenDataset) -> None:
    """Record the carried state's shape / dtype on ``model`` (one meta forward at batch 1)."""
    t = torch.as_tensor(rows.inputs[:1], device="meta")
    pids = None if rows.puzzle_ids is None else torch.as_tensor(rows.puzzle_ids[:1], device="meta")
    with torch.no_grad(), meta_safe():
        training_loss(model, cfg, t, t.clone(), pids)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def describe(plan: Plan, cfg: RunConfig, source: str) -> list[str]:
    """The plan as printed lines."""
    p, tc = plan, cfg.train
    bf16 = p.cast_bytes > 0
    lines = [
        f"parameters: {p.parameters:,} ({p.trainable:,} trainable); weights + buffers {_gib(p.model_bytes)}, "
        f"gradients {_gib(p.grad_bytes)}",
        f"optimiser ({tc.optimizer}): {_gib(p.optimizer_bytes)}, {p.optimizer_how}"
        + (f"; EMA copy {_gib(p.ema_bytes)}" if p.ema_bytes else ""),
        f"saved activations (measured on the meta device with saved_tensors_hooks, {source}, the training loop "
        f"at its cap): {p.measured[0]:,} B at batch {MEASURED_AT[0]}, {p.measured[1]:,} B at batch {MEASURED_AT[1]} -> "
        f"{_gib(p.per_example)} per example + {_gib(max(p.fixed, 0))} fixed"
        + ("; counted under bf16 autocast's policy (matrix-product inputs saved in bf16)" if bf16 else ""),
    ]  # fmt: skip
    extra = []
    if p.bucket_bytes:
        extra.append(f"DDP gradient buckets {_gib(p.bucket_bytes)}")
    if p.cast_bytes:
        extra.append(f"bf16 weight copies {_gib(p.cast_bytes)}")
    if p.carry_bytes:
        extra.append(f"deep-supervision carry of {p.rows_per_gpu} slots {_gib(p.carry_bytes)}")
    shard = (
        " (FSDP2: weights, gradients, optimiser and EMA divided by the GPUs)"
        if p.strategy == "fsdp" and p.gpus > 1
        else ""
    )
    lines.append(
        f"per GPU, besides activations: {_gib(p.state_bytes)}{shard}"
        + (f" ({', '.join(extra)})" if extra else "")
    )
    lines.append(
        f"margin: +{int(MARGIN_FRACTION * 100)}% + {_gib(MARGIN_BYTES)} (CUDA context, fragmentation, backward buffers)"
    )
    full = p.peak(p.rows_per_gpu)
    lines.append(f"{p.gpus} GPU(s) of {p.gpu_memory / 1e9:.0f} GB ({_gib(p.gpu_memory)}); batch {tc.batch_size} = "
                 f"{p.rows_per_gpu} rows per GPU: peak estimate at the full batch {_gib(full)}")  # fmt: skip
    lines.append(verdict(p))
    return lines


def verdict(p: Plan) -> str:
    """One line: the micro-batch that fits and what to set."""
    m = p.best_micro()
    if m is None:
        return (f"does not fit: even a micro-batch of 1 needs {_gib(p.peak(1))}; use more GPUs "
                "(--gpus N, train.strategy=fsdp shards the model state)")  # fmt: skip
    k = p.rows_per_gpu // m
    if k == 1:
        return f"fits: micro-batch {m} = the full {p.rows_per_gpu} rows per GPU (peak {_gib(p.peak(m))}); no accumulation needed"
    split = p.batch_wide and not (p.halt_group and m % p.halt_group == 0)
    refused = (f"; the training loop's halting {p.batch_wide!r} is batch-wide, which accumulation refuses when "
               f"micro-batches split its groups: also set loop_train.halt_group to a divisor of {m} (or "
               "loop_train.halting=residual, per sample)") if split else ""  # fmt: skip
    return (f"largest micro-batch that fits: {m} (peak {_gib(p.peak(m))}) -> set train.grad_accum_steps={k} "
            f"(or train.micro_batch_size={m}){refused}")  # fmt: skip
