"""Refuse a configuration whose sizes cannot fit in this machine's memory, before any work.

``check_memory(cfg, device)`` runs inside ``loopformer.config.validate.validate``, so every command that
validates a config (``train`` when it builds one; ``eval``, ``solve``, ``run`` and ``push`` through
``loopformer.config.checks``) refuses the same sizes. It adds up a *lower bound* of what the run must
hold at once, each term tied to the keys that set it:

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
  ``--lens-loops``, ``run.budgets``, ...), naming the option.

The sequence length is the model's ``seq_len`` when the config sets it (a trained run's config always
does), else what the task's class says without building it (``sequence_length``), else 1. The device's
memory is the GPU's when the run is on CUDA, else the machine's RAM; the data sets are always compared
with the RAM. Only a bound more
than ``FAR_BEYOND`` (4) times that memory is refused, so the paper recipes still build on a small machine
(their data sets are large, 17 GiB for ARC) while sizes no machine holds (a batch of 10**9, a width of
10**6) are refused: a run the check lets through can still run out of memory, one it refuses cannot fit.
"""

from __future__ import annotations

import os
from typing import Any

GIB = float(1 << 30)
FAR_BEYOND = 4  # refuse only a bound this many times the memory: an estimate that is off never refuses a run


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
        import torch

        if torch.cuda.is_available():
            index = int(str(device).split(":")[1]) if ":" in str(device) else 0
            return int(torch.cuda.get_device_properties(index).total_memory), f"GPU {index}"
    return physical_memory(), "RAM"


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def sequence_length(cfg: Any) -> int:
    """The model's ``seq_len`` when the config sets it; else what the task's class says without building
    the task (a fixed ``seq_len`` such as ARC's 900 canvas tokens, ``size`` x ``size`` for a board task,
    a ``seq_len`` option); else 1."""
    explicit = cfg.model.fields.get("seq_len")
    if _int(explicit) > 1 or explicit == 1:
        return _int(explicit)
    import inspect

    from loopformer.tasks.registry import TASKS, task_class

    if cfg.data.task not in TASKS:
        return 1
    cls = task_class(cfg.data.task)
    if _int(getattr(cls, "seq_len", 0)) > 1:
        return _int(cls.seq_len)
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return 1

    def option(name: str) -> int:
        default = params[name].default if name in params else None
        return _int(cfg.data.options.get(name, default))

    if "size" in params:
        return option("size") ** 2
    return option("seq_len") if "seq_len" in params else 1


HISTORY_BYTES = 16.0  # per loop step and sample: float32 residual + state norm, and their segment buffers


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
    seq = sequence_length(cfg)
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
    from loopformer.config.strict import ConfigError

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
