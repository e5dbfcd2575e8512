"""The one memory model: what a run must hold at once, refused before any work when it cannot fit, and planned
per GPU for ``loopformer train RECIPE --plan``.

**The bound every command checks** (``check_memory``, inside ``loopformer.config.schema.validate``, so
``train``, ``eval``, ``solve``, ``run`` and ``push`` refuse the same sizes): a *lower bound* of what the run
must hold at once, each term tied to the keys that set it:

- the weights: ``model.n_layers`` x 4 ``model.d_model``^2 (attention projections; the MLP left out)
  plus ``model.vocab_size`` x ``model.d_model``, as float32, x4 when training (gradients, two Adam moments);
- one hidden state of a batch: ``train.batch_size`` (or ``eval.batch_size``) x sequence length x
  ``model.d_model`` in bf16 (a real forward keeps many more);
- generated data sets (no ``data.train_path`` / ``data.eval_path``): ``data.train_size`` /
  ``data.eval_size`` rows x sequence length of int64 inputs and labels, in host memory; a training set the
  task streams (``Task.streams``: text) holds no rows, only its corpus when that is read into memory
  (``Task.resident_bytes``: 0 for a memory-mapped token file), so ``data.train_size`` does not count;
- the loop's per-step history (``loopformer.loop.state.History``: a float32 residual and state norm per
  step and sample, kept twice with compaction): ``loop_train.max_steps`` x ``train.batch_size`` when
  training, ``loop_eval.max_steps`` / ``loop_periodic.max_steps`` x ``eval.batch_size``, 16 bytes each.
  ``check_loops`` applies the same bound to a command's own loop counts (``eval --max-steps``,
  ``--lens-loops``, ``run.budgets``, ...), naming the option, and ``check_rows`` to the rows
  ``data generate --count`` asks for.

The sequence length is the model's ``seq_len`` when the config sets it (a trained run's config always
does), else what the task says (the built task's, else its class's ``seq_len``, ``size`` x ``size`` for a
board task, a ``seq_len`` or ``width`` option: ``sequence_length``), else 1. The device's memory is the GPU's
when the run is on CUDA, else the machine's RAM; the data sets are always compared with the RAM. Only a bound
more than ``FAR_BEYOND`` (4) times that memory is refused, so the paper recipes still build on a small machine
(their data sets are large, 17 GiB for ARC) while sizes no machine holds (a batch of 10**9, a width of 10**6)
are refused: a run the check lets through can still run out of memory, one it refuses cannot fit.

**The plan** measures the same terms instead of bounding them. The recipe's model is built on PyTorch's
``meta`` device (shapes and dtypes, no storage, no arithmetic: a 140M-parameter model at sequence 2048 is
measured in seconds on a CPU); the training layer hands over what only it knows (``Probe``: the run's model,
one training forward and loss as the trainer computes it, its optimiser, two example rows:
``loopformer.train.plan``). Counted:

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
  device, which has no autocast, runs autocast's policy (the inputs of matrix products and convolutions cast
  to bfloat16 above autograd), so the count is the bf16 one; it agrees with the same hooks on real tensors
  under CPU autocast within a few percent for every paper recipe family (tests/test_train_plan_measured.py).
  All of this is one ``TorchFunctionMode`` (``MetaRun``) around the forward: the library's own code runs
  unchanged;
- the deep-supervision carry (``train.mode=deep_supervision``): every slot's state, alive across steps.

Peak per GPU (micro-batch m) = model state + carry + fixed activations + m x activations per
example, plus a margin of 5% and 2 GiB (the CUDA context, allocator fragmentation and the
transient buffers of the backward). The largest m that divides the rows per GPU and fits gives
``train.grad_accum_steps`` = rows per GPU / m (``loopformer.train.accumulate``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from loopformer.config.strict import ConfigError

GIB = float(1 << 30)
FAR_BEYOND = 4  # refuse only a bound this many times the memory: an estimate that is off never refuses a run
HISTORY_BYTES = 16.0  # per loop step and sample: float32 residual + state norm, and their segment buffers
# the plan's margin on top of the counted bytes: the CUDA context (~0.5-1 GiB), the backward's transient
# gradient buffers (a few activation-sized tensors) and the caching allocator's fragmentation, small now that
# every shape of a training step is static (issue 33: the carry is refilled in place, the loops do not compact)
MARGIN_FRACTION = 0.05
MARGIN_BYTES = 2 * 2**30
GiB = 2**30
# batch sizes of the plan's two measurements (batch 1 can share storages a larger batch does not)
MEASURED_AT = (2, 4)


def physical_memory() -> int | None:
    """Bytes of RAM of this machine (None where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def device_memory(device: str) -> tuple[int | None, str]:
    """(bytes of memory of ``device`` — ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` —, its description)."""
    kind = str(device or "auto").split(":")[0]
    if kind in ("cuda", "auto"):
        if torch.cuda.is_available():
            index = int(str(device).split(":")[1]) if ":" in str(device) else 0
            return int(torch.cuda.get_device_properties(index).total_memory), f"GPU {index}"
    return physical_memory(), "RAM"


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


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def sequence_length(cfg: Any, task: Any = None) -> int:
    """The model's ``seq_len`` when the config sets it; else what the task says without reading its data (the
    built ``task``'s ``seq_len``, else its class's: a fixed ``seq_len`` such as ARC's 900 canvas tokens,
    ``size`` x ``size`` for a board task, a ``seq_len`` or ``width`` option); else 0 (unknown)."""
    explicit = cfg.model.fields.get("seq_len")
    if _int(explicit) > 1 or explicit == 1:
        return _int(explicit)
    if _int(getattr(task, "seq_len", 0)) > 1:
        return _int(task.seq_len)
    from loopformer.tasks.registry import TASKS, task_class

    if cfg.data.task not in TASKS:
        return 0
    cls = task_class(cfg.data.task)
    if _int(getattr(cls, "seq_len", 0)) > 1:
        return _int(cls.seq_len)
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        params = {}

    def option(name: str) -> int:
        value = cfg.data.options.get(name, params[name].default if name in params else None)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    if "size" in params:
        return _int(option("size")) ** 2
    return option("seq_len") or option("width")


# --------------------------------------------------------------------------------------------
# The bound every command checks
# --------------------------------------------------------------------------------------------
def loop_terms(cfg: Any, training: bool = True) -> list[tuple[float, str]]:
    """(bytes, what sets them) of the loops' per-step histories (module docstring)."""
    base = cfg.model_config().loop
    phases = [("train", "train")] if training else []
    phases += [("eval", "eval")] + ([("periodic", "eval")] if training else [])
    terms = []
    for phase, section in phases:
        steps, batch = _int(cfg.loop_config(base, phase).max_steps), _int(getattr(cfg, section).batch_size)
        terms.append((HISTORY_BYTES * steps * batch,
                      f"loop_{phase}.max_steps={steps} x {section}.batch_size={batch}"))  # fmt: skip
    return terms


def memory_terms(cfg: Any, training: bool = True) -> tuple[list[tuple[float, str]], list[tuple[float, str]]]:
    """(device terms, host terms): lists of (bytes, what sets them) of ``cfg``'s lower bound."""
    mc = cfg.model_config()
    d, layers = _int(getattr(mc, "d_model", 1)), _int(getattr(mc, "n_layers", 1))
    vocab = _int(getattr(mc, "vocab_size", 1))
    seq = _int(sequence_length(cfg))
    weights = 4.0 * (layers * 4 * d * d + vocab * d) * (4 if training else 1)
    device = [(weights, f"model.n_layers={layers}, model.d_model={d}, model.vocab_size={vocab}")]
    for section, batch in (("train", cfg.train.batch_size), ("eval", cfg.eval.batch_size)):
        if section == "train" and not training:
            continue
        b = _int(batch)
        device.append(
            (2.0 * b * seq * d, f"{section}.batch_size={b} x sequence length {seq} x model.d_model={d}")
        )
    device += loop_terms(cfg, training)
    host = []
    for split, size, path in (("train", cfg.data.train_size, cfg.data.train_path),
                              ("eval", cfg.data.eval_size, cfg.data.eval_path)):  # fmt: skip
        if not path and (split == "eval" or training):
            n = _int(size)
            streamed = _streamed_bytes(cfg) if split == "train" else None
            if streamed is not None:  # read a batch at a time: what it holds is its corpus, not n rows
                what = f"data.task={cfg.data.task}'s streamed training corpus (data.options.path)"
                host.append((float(streamed), what))
            else:
                host.append((16.0 * n * seq, f"data.{split}_size={n} rows x sequence length {seq}"))
    return device, host


def _streamed_bytes(cfg: Any) -> int | None:
    """Bytes the training set holds when the task streams it (``Task.resident_bytes``), else None."""
    from loopformer.tasks.registry import TASKS, task_class

    if cfg.data.task not in TASKS or not task_class(cfg.data.task).streams:
        return None
    return int(task_class(cfg.data.task).resident_bytes(dict(cfg.data.options)))


def check_memory(cfg: Any, device: str | None = None, training: bool = True) -> None:
    """ConfigError when ``cfg``'s lower bound (module docstring) exceeds the memory of ``device``
    (default ``cfg.device``) or the RAM; the message names the keys of the largest term."""
    _check_terms(*memory_terms(cfg, training), device or cfg.device)


def check_rows(option: str, rows: int, seq_len: int) -> None:
    """ConfigError naming ``option`` when ``rows`` generated rows of ``seq_len`` tokens (int64 inputs and
    labels, as a generated data set is counted above) need far more than the RAM (``data generate --count``)."""
    _check_terms([], [(16.0 * rows * _int(seq_len), f"{option} {rows:,} rows x sequence length {seq_len}")], "cpu")


def check_loops(cfg: Any, option: str, loops: int, device: str | None = None) -> None:
    """ConfigError naming ``option`` when evaluating ``cfg`` with ``loops`` loops (a command's own count:
    ``eval --max-steps``, ``--lens-loops``, ``run.budgets``...) needs far more memory than there is: the
    bound ``check_memory`` applies to ``loop_eval.max_steps``, with ``loops`` in its place."""
    device_terms, host_terms = memory_terms(cfg, training=False)
    batch = _int(cfg.eval.batch_size)
    device_terms = [t for t in device_terms if not t[1].startswith("loop_")]
    device_terms.append((HISTORY_BYTES * _int(loops) * batch, f"{option} {loops} (loops) x eval.batch_size={batch}"))
    _check_terms(device_terms, host_terms, device or cfg.device)


def _check_terms(device_terms: list[tuple[float, str]], host_terms: list[tuple[float, str]], device: str) -> None:
    """ConfigError when the device terms exceed ``device``'s memory or the host terms the RAM."""
    ram = physical_memory()
    capacity, where = device_memory(device)
    checks = [(device_terms, capacity, where)]
    if where == "RAM":
        checks = [(device_terms + host_terms, ram, "RAM")]
    else:
        checks.append((host_terms, ram, "RAM"))
    for terms, limit, name in checks:
        need = sum(b for b, _ in terms)
        if limit is None or not terms or need <= FAR_BEYOND * limit:
            continue
        largest = max(terms, key=lambda t: t[0])[1]  # the first of equal terms: loop_eval before loop_periodic
        raise ConfigError(
            f"{largest}: the run needs at least {need / GIB:,.1f} GiB of {name}, far more than the "
            f"{limit / GIB:,.1f} GiB this machine has; lower these sizes"
        )


# --------------------------------------------------------------------------------------------
# The plan: the same terms measured on the meta device
# --------------------------------------------------------------------------------------------
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
        # shapes only (meta): a forward that differentiates inside itself (TRM-DEQ's Jacobian probe) runs
        q, k, v = ctx.saved_tensors[:3]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


def _to_bf16(x: Any) -> Any:
    return x.to(torch.bfloat16) if isinstance(x, Tensor) and x.dtype == torch.float32 else x


class MetaRun(TorchFunctionMode):
    """What a training forward needs to run on the meta device, as one ``TorchFunctionMode``:

    - ``F.scaled_dot_product_attention`` is the fused kernel's stand-in (``_FusedAttention``);
    - data-dependent reads of a meta tensor (``bool`` / ``int`` / ``item``: input validation, a loop's host
      reads) answer False / 0; on the meta device every loop runs to its cap (``loopformer.loop.engine``);
    - with ``bf16``, autocast's bfloat16 policy where there is no autocast: the floating inputs of the ops
      autocast runs in bf16 (``torch.autocast`` "lower precision" ops: linear, matrix products, convolutions)
      are cast to bf16 first, above autograd, so the tensors saved for backward are the bf16 copies, as under
      CPU and CUDA autocast; everything else runs in its inputs' dtype (a float32 residual plus a bf16 update
      is float32, as autocast promotes). tests/test_train_plan_measured.py checks the count against real CPU
      autocast for every paper recipe family.
    """

    LOWER = (F.linear, torch.matmul, Tensor.matmul, Tensor.__matmul__, Tensor.__rmatmul__, torch.bmm, torch.mm,
             torch.baddbmm, torch.addmm, torch.addbmm, F.conv1d, F.conv2d, F.conv3d)  # fmt: skip
    READS = {Tensor.__bool__: False, Tensor.__int__: 0, Tensor.item: 0}

    def __init__(self, bf16: bool = False) -> None:
        super().__init__()
        self.bf16 = bf16

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            if q.is_meta:
                return _FusedAttention.apply(q, k, v, mask)
        if func in self.READS and args[0].is_meta:
            return self.READS[func]
        if self.bf16 and func in self.LOWER:
            args = tuple(_to_bf16(a) for a in args)
            kwargs = {k: _to_bf16(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _key(t: Tensor) -> int:
    return t.untyped_storage()._cdata


@contextlib.contextmanager
def count_saved(exclude: set[int]) -> Iterator[dict[int, int]]:
    """Inside: ``{storage: bytes}`` of every tensor autograd saves for backward, storages in
    ``exclude`` (parameters, buffers) left out."""
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        key = _key(t)
        if key not in exclude:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


def bf16_counting(cfg: Any) -> bool:
    """Whether the run's matrix products run under bf16 autocast on its GPU (``bf16: true`` or ``auto``)."""
    return cfg.bf16 is True or cfg.bf16 == "auto"


def plan_loop(cfg: Any, model: nn.Module) -> Any:
    """The training loop at its cap: ``fixed`` halting (learned ACT kept) at the largest count."""
    from loopformer.loop import HALTINGS
    from loopformer.loop.samplers import training_sampler

    loop = cfg.loop_config(model.config.loop, "train")
    steps = loop.max_steps
    tc = cfg.train
    sampler = training_sampler(tc.loop_sampler, tc.loop_sampler_options, loop.max_steps, cfg.seed)
    if sampler is not None:
        steps = max(int(sampler.sample(s)) for s in range(256))
    halting = loop.halting if HALTINGS.get(loop.halting).learned else "fixed"
    return dataclasses.replace(
        loop, halting=halting, max_steps=steps, min_steps=min(loop.min_steps, steps), trace=False
    )


Forward = Callable[[nn.Module, Tensor, Tensor, "Tensor | None"], "tuple[Tensor, Tensor]"]


@dataclass
class Probe:
    """What the training layer hands the plan (``loopformer.train.plan``): the run's model (``build``, called
    under the meta device), one training forward and loss as the trainer computes it (``forward(model, inputs,
    labels, puzzle_ids) -> (loss, final state)``), the optimiser the run builds, two example rows of the
    recipe's width and where they came from."""

    build: Callable[[], nn.Module]
    forward: Forward
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    rows: Any  # a loopformer.tasks.base.TokenDataset
    source: str


def activation_bytes(build: Callable[[], nn.Module], forward: Forward, rows: Any, batches: tuple[int, ...],
                     bf16: bool, device: str = "meta") -> list[int]:  # fmt: skip
    """Saved-activation bytes of one training forward + loss at each batch size (``rows`` repeated); on the
    meta device under ``MetaRun`` (with ``bf16``: autocast's policy)."""
    model = build()
    model.train()
    exclude = {_key(t) for t in (*model.parameters(), *model.buffers())}
    out = []
    for b in batches:
        idx = (torch.arange(b) % len(rows)).numpy()
        inputs = torch.as_tensor(rows.inputs[idx], device=device)
        labels = torch.as_tensor(rows.labels[idx], device=device)
        pids = None if rows.puzzle_ids is None else torch.as_tensor(rows.puzzle_ids[idx], device=device)
        mode = MetaRun(bf16) if device == "meta" else contextlib.nullcontext()
        with count_saved(exclude) as seen, mode:
            loss, _ = forward(model, inputs, labels, pids)
        out.append(sum(seen.values()))
        del loss
    return out


def carried_state(forward: Forward, model: nn.Module, rows: Any) -> Tensor:
    """The final state of one meta training forward at batch 1, no gradient: what a deep-supervision slot
    carries from step to step (its shape and dtype)."""
    one = torch.as_tensor(rows.inputs[:1], device="meta")
    pids = None if rows.puzzle_ids is None else torch.as_tensor(rows.puzzle_ids[:1], device="meta")
    with torch.no_grad(), MetaRun():
        _, state = forward(model, one, one.clone(), pids)
    return state


def optimizer_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, str]:
    """Bytes of ``optimizer``'s state after one step on the meta device, and how they were counted (a formula
    naming the operation that has no meta kernel, when the step cannot run there)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    import torch.fx.experimental._config as fx_config

    try:  # sign-SGD's rows: nonzero() on meta, taken as all rows
        with fx_config.patch(meta_nonzero_assume_all_nonzero=True):
            optimizer.step()
    except (RuntimeError, NotImplementedError, TypeError) as err:  # an op without a meta kernel
        n = sum(
            p.numel() * p.element_size()
            for g in optimizer.param_groups
            if not g.get("sign_sgd")
            for p in g["params"]
        )
        name, text = type(optimizer).__name__, " ".join(str(err).split())
        if "fused" in text:  # torch's fused AdamW kernel takes only real devices' tensors
            why = "its fused kernel (fused=True) takes only tensors of a real device"
        else:
            why = f"{type(err).__name__}: {text if len(text) <= 200 else text[:197] + '...'}"
        return 2 * n, (
            f"2 moments per parameter outside the sign-SGD rows (a formula: the {name} state could not be "
            f"measured, as {name}.step does not run on the meta device: {why})"
        )
    finally:
        for p in params:
            p.grad = None
    total = sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, Tensor)
    )
    return total, f"measured ({type(optimizer).__name__} state after one step)"


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


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


def make_plan(cfg: Any, gpus: int, gpu_memory: int, probe: Probe) -> Plan:
    """The plan of ``cfg`` on ``gpus`` GPUs of ``gpu_memory`` bytes each, measured with ``probe``."""
    from loopformer.loop import HALTINGS

    tc = cfg.train
    if gpus < 1 or tc.batch_size % gpus:
        raise ConfigError(f"--gpus {gpus}: train.batch_size={tc.batch_size} must split evenly over the GPUs")

    def build() -> nn.Module:
        with torch.device("meta"):
            return probe.build()

    a1, a2 = activation_bytes(build, probe.forward, probe.rows, MEASURED_AT, bf16_counting(cfg))
    model = build()
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    optim, how = optimizer_state_bytes(model, probe.optimizer(model))
    rows_per_gpu = tc.batch_size // gpus
    carry = 0
    if tc.mode == "deep_supervision":  # every slot's state, its inputs and labels
        state = carried_state(probe.forward, model, probe.rows)
        slot = math.prod(state.shape[1:]) * state.element_size() + 2 * probe.rows.inputs.shape[1] * 8
        carry = rows_per_gpu * slot
    ema = 0
    if tc.ema > 0:
        kept = (p for n, p in model.named_parameters() if tc.ema_puzzle_embeddings or "puzzle_emb" not in n)
        ema = _nbytes(kept)
    loop = cfg.loop_config(model.config.loop, "train")
    sampled = cfg.train.loop_sampler != "none" and cfg.train.mode == "simple"
    halting = plan_loop(cfg, model).halting if sampled else loop.halting
    per_example = (a2 - a1) // (MEASURED_AT[1] - MEASURED_AT[0])
    return Plan(
        parameters=sum(p.numel() for p in params), trainable=sum(p.numel() for p in trainable),
        model_bytes=_nbytes(params) + _nbytes(model.buffers()), grad_bytes=_nbytes(trainable),
        optimizer_bytes=optim, optimizer_how=how, ema_bytes=ema,
        bucket_bytes=_nbytes(trainable) if gpus > 1 and tc.strategy == "ddp" else 0,
        cast_bytes=2 * sum(p.numel() for p in trainable) if bf16_counting(cfg) else 0,
        carry_bytes=carry, per_example=per_example, fixed=max(a1 - MEASURED_AT[0] * per_example, 0),
        measured=(a1, a2), rows_per_gpu=rows_per_gpu, gpus=gpus, gpu_memory=gpu_memory, strategy=tc.strategy,
        batch_wide=halting if HALTINGS.get(halting).batch_stalls else "", halt_group=loop.halt_group,
    )  # fmt: skip


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def describe(plan: Plan, cfg: Any, source: str) -> list[str]:
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
