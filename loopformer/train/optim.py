"""Optimiser, learning-rate schedule and weight EMA.

- ``build_optimizer``: AdamW with two parameter groups. No weight decay on: tensors with fewer
  than two dimensions (biases, norm gains, per-channel residual scalars and gates: FPRM's
  ``a = sigmoid(p)`` parameters, SYSTEMS.md section 1), parameters of normalisation modules,
  the names a model lists in ``no_weight_decay()`` (optional; exact names or module prefixes),
  and embeddings when ``decay_embeddings`` is False.
- ``lr_at``: linear warm-up then constant (FPRM: constant after 2000 warm-up steps) or cosine
  down to ``min_lr_ratio * lr``. A pure function of the step, so the schedule's only state is
  the step counter the checkpoint already holds.
- ``clip_grad_norm``: global-norm clipping returning the pre-clip norm (for divergence checks).
- ``EMA``: exponential moving average of the weights (TRM / FPRM use 0.999), with a
  ``state_dict`` of plain tensors (saved to ``ema.safetensors``) and ``applied(model)`` to
  evaluate with the averaged weights.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor, nn

_NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.RMSNorm)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or type(module).__name__.lower().endswith("norm")


def _listed(name: str, listed: set[str]) -> bool:
    return any(name == n or name.startswith(n + ".") or name.endswith("." + n) for n in listed)


def parameter_groups(model: nn.Module, weight_decay: float, decay_embeddings: bool = True) -> list[dict]:
    """``[{'params': decayed, 'weight_decay': wd, 'names': [...]}, {... 0.0 ...}]`` (empty groups dropped)."""
    listed_fn = getattr(model, "no_weight_decay", None)
    listed = set(listed_fn()) if callable(listed_fn) else set()
    no_decay_ids: set[int] = set()
    for module_name, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if _is_norm(module) or (not decay_embeddings and isinstance(module, nn.Embedding)):
            no_decay_ids.update(id(p) for _, p in own)
        for pname, p in own:
            full = f"{module_name}.{pname}" if module_name else pname
            if p.ndim < 2 or _listed(full, listed):
                no_decay_ids.add(id(p))
    decay, no_decay = ([], []), ([], [])
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        target = no_decay if id(p) in no_decay_ids else decay
        target[0].append(p)
        target[1].append(name)
    groups = [
        {"params": decay[0], "names": decay[1], "weight_decay": weight_decay},
        {"params": no_decay[0], "names": no_decay[1], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    decay_embeddings: bool = True,
) -> torch.optim.AdamW:
    """AdamW over ``parameter_groups`` (foreach on CPU / CUDA; deterministic)."""
    groups = parameter_groups(model, weight_decay, decay_embeddings)
    if not groups:
        raise ValueError(f"{type(model).__name__} has no trainable parameters")
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def lr_at(
    step: int,
    lr: float,
    warmup_steps: int,
    total_steps: int,
    schedule: str = "constant",
    min_lr_ratio: float = 0.0,
) -> float:
    """Learning rate for optimiser step ``step`` (0-based): warm-up, then constant or cosine."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    raise ValueError(f"unknown schedule {schedule!r}; expected 'constant' or 'cosine'")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(parameters: list[Tensor], max_norm: float) -> float:
    """Global gradient norm before clipping; clips in place when ``max_norm > 0``."""
    grads = [p for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(grads, max_norm))
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in grads])))


class EMA:
    """Exponential moving average of a model's parameters: ``s <- d * s + (1 - d) * p``.

    ``d = decay``, or with ``warmup`` ``d_t = min(decay, (1 + t) / (10 + t))`` at optimiser step
    ``t``, so short (CPU-sized) runs do not evaluate weights that are still mostly the random
    init (0.999^150 = 0.86); TRM's code uses the plain form (``warmup=False``).
    """

    def __init__(self, model: nn.Module, decay: float, warmup: bool = False) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.warmup = warmup
        self.shadow: dict[str, Tensor] = {
            name: p.detach().clone() for name, p in model.named_parameters() if p.dtype.is_floating_point
        }

    def decay_at(self, step: int | None) -> float:
        if not self.warmup or step is None:
            return self.decay
        return min(self.decay, (1.0 + step) / (10.0 + step))

    @torch.no_grad()
    def update(self, model: nn.Module, step: int | None = None) -> None:
        """One EMA update after optimiser step ``step`` (0-based; used by the warm-up)."""
        weight = 1.0 - self.decay_at(step)
        for name, p in model.named_parameters():
            if name in self.shadow:
                self.shadow[name].lerp_(p.detach(), weight)

    def state_dict(self) -> dict[str, Tensor]:
        return dict(self.shadow)

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        missing = sorted(set(self.shadow) - set(state))
        unexpected = sorted(set(state) - set(self.shadow))
        if missing or unexpected:
            raise ValueError(f"EMA state does not match the model: missing {missing}, unexpected {unexpected}")
        for name, value in state.items():
            if value.shape != self.shadow[name].shape:
                raise ValueError(
                    f"EMA tensor {name!r} has shape {tuple(value.shape)}, model has {tuple(self.shadow[name].shape)}"
                )
            self.shadow[name].copy_(value)

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        for name, p in model.named_parameters():
            if name in self.shadow:
                p.copy_(self.shadow[name])

    @contextlib.contextmanager
    def applied(self, model: nn.Module) -> Iterator[nn.Module]:
        """Temporarily load the averaged weights into ``model`` (restored on exit)."""
        backup = {name: p.detach().clone() for name, p in model.named_parameters() if name in self.shadow}
        self.copy_to(model)
        try:
            yield model
        finally:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name in backup:
                        p.copy_(backup[name])
