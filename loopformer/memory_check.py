"""Refuse a configuration whose sizes cannot fit in this machine's memory, before any work.

``check_memory(cfg, device)`` runs inside ``loopformer.config_validate.validate``, so every command that
validates a config (``train`` when it builds one; ``eval``, ``solve``, ``run`` and ``push`` through
``loopformer.command_checks``) refuses the same sizes. It adds up a *lower bound* of what the run must
hold at once, each term tied to the keys that set it:

- the weights: ``model.n_layers`` x 4 ``model.d_model``^2 (attention projections; the MLP left out)
  plus ``model.vocab_size`` x ``model.d_model``, as float32, x4 when training (gradients, two Adam moments);
- one hidden state of a batch: ``train.batch_size`` (or ``eval.batch_size``) x sequence length x
  ``model.d_model`` in bf16 (a real forward keeps many more);
- generated data sets (no ``data.train_path`` / ``data.eval_path``): ``data.train_size`` /
  ``data.eval_size`` rows x sequence length of int64 inputs and labels, in host memory.

The sequence length is the model's ``seq_len`` when the config sets it (a trained run's config always
does) and 1 otherwise, so the bound never overestimates. The device's memory is the GPU's when the run
is on CUDA, else the machine's RAM; the data sets are always compared with the RAM. Only a bound past
that memory is refused: a run the check lets through can still run out of memory, one it refuses cannot fit.
"""

from __future__ import annotations

import os
from typing import Any

GIB = float(1 << 30)


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


def memory_terms(cfg: Any, training: bool = True) -> tuple[list[tuple[float, str]], list[tuple[float, str]]]:
    """(device terms, host terms): lists of (bytes, what sets them) of ``cfg``'s lower bound."""
    mc = cfg.model_config()
    d, layers = _int(getattr(mc, "d_model", 1)), _int(getattr(mc, "n_layers", 1))
    vocab = _int(getattr(mc, "vocab_size", 1))
    seq = _int(cfg.model.fields.get("seq_len"))
    weights = 4.0 * (layers * 4 * d * d + vocab * d) * (4 if training else 1)
    device = [(weights, f"model.n_layers={layers}, model.d_model={d}, model.vocab_size={vocab}")]
    for section, batch in (("train", cfg.train.batch_size), ("eval", cfg.eval.batch_size)):
        if section == "train" and not training:
            continue
        b = _int(batch)
        device.append(
            (2.0 * b * seq * d, f"{section}.batch_size={b} x sequence length {seq} x model.d_model={d}")
        )
    host = []
    for split, size, path in (("train", cfg.data.train_size, cfg.data.train_path),
                              ("eval", cfg.data.eval_size, cfg.data.eval_path)):  # fmt: skip
        if not path and (split == "eval" or training):
            n = _int(size)
            host.append((16.0 * n * seq, f"data.{split}_size={n} rows x sequence length {seq}"))
    return device, host


def check_memory(cfg: Any, device: str | None = None, training: bool = True) -> None:
    """ConfigError when ``cfg``'s lower bound (module docstring) exceeds the memory of ``device``
    (default ``cfg.device``) or the RAM; the message names the keys of the largest term."""
    from loopformer.config import ConfigError

    device_terms, host_terms = memory_terms(cfg, training)
    ram = physical_memory()
    capacity, where = device_memory(device or cfg.device)
    checks = [(device_terms, capacity, where)]
    if where == "RAM":
        checks = [(device_terms + host_terms, ram, "RAM")]
    else:
        checks.append((host_terms, ram, "RAM"))
    for terms, limit, name in checks:
        need = sum(b for b, _ in terms)
        if limit is None or not terms or need <= limit:
            continue
        largest = max(terms)[1]
        raise ConfigError(
            f"{largest}: the run needs at least {need / GIB:,.1f} GiB of {name}, more than the "
            f"{limit / GIB:,.1f} GiB this machine has; lower these sizes"
        )
