"""A training step's metrics and its divergence check, kept on the device between two host reads.

A step yields its metrics as device tensors (loss and its parts, accuracies, norms, the loop's statistics,
the training mode's) and host values (step, learning rate, loop count, curriculum level). Reading a device
value makes the host wait for the device (a sync per value, ~10-15 per step before; issue 33), so:

- ``StepMeter`` sums the device metrics over the steps between two reads and brings them back in ONE
  transfer when the trainer logs (every ``train.log_every`` steps and at the last step), evaluates,
  checkpoints, checks the curriculum or stops. A logged device metric is the mean over the steps since the
  previous logged record ("halted": slots halted per step; under torchrun summed over ranks); a host value
  is the last step's. With ``train.log_every: 1`` every record is its own step's, as before.
- ``DivergenceCheck`` decides on the device whether a step's loss, state norm and gradient norm are finite
  and within ``train.max_loss`` / ``train.max_state_norm``. A failed step is not applied: the optimiser and
  the EMA are told to skip it (``optim.skip_step``, as mixed-precision loss scalers skip a step with
  non-finite gradients) and so is every later step, and the first failure (step, quantity, value) is kept
  on the device; the next read brings it back and the trainer raises ``TrainingDivergedError`` naming it,
  before any checkpoint or evaluation of the steps after it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from loopformer.models.base import ModelOutput
from loopformer.train.metrics import last_finite

QUANTITIES = ("loss", "state norm", "gradient norm")


def host_value(value: Any) -> Any:
    """A 0-dim tensor as a Python number (a host read); anything else as it is."""
    if isinstance(value, Tensor) and value.dim() == 0:
        return value.item()
    return value


class StepMetrics(Mapping):
    """What ``Trainer.train_step`` returns: the step's metrics by name. ``raw`` holds them as produced (device
    tensors and host values; what the trainer's ``StepMeter`` sums without reading); looking one up by name
    reads it (``host_value``), for callers that drive ``train_step`` themselves."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self.raw = raw

    def __getitem__(self, key: str) -> Any:
        return host_value(self.raw[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)


class DivergenceCheck:
    """The step-level divergence test, on the device; ``first``: [step, quantity index, value] of the first
    failed step (step -1: none yet)."""

    def __init__(self, device: torch.device, max_loss: float | None, max_state_norm: float | None) -> None:
        limits = [math.inf if x is None else float(x) for x in (max_loss, max_state_norm, None)]
        self.limits = torch.tensor(limits, dtype=torch.float64, device=device)
        self.first = torch.tensor([-1.0, 0.0, math.nan], dtype=torch.float64, device=device)

    def check(self, step: int, loss: Tensor, state_norm: Tensor, grad_norm: Tensor) -> Tensor:
        """Whether step ``step`` (0-based) may update (a 0-dim bool tensor): no step so far has failed."""
        return self.check_tensor(torch.full_like(self.first[0], step), loss, state_norm, grad_norm)

    def check_tensor(self, step: Tensor, loss: Tensor, state_norm: Tensor, grad_norm: Tensor) -> Tensor:
        """``check`` with the step as a 0-dim tensor (a compiled step: a new step does not recompile)."""
        values = torch.stack([loss.double(), state_norm.double(), grad_norm.double().to(loss.device)])
        bad = ~torch.isfinite(values) | (values > self.limits)
        which = torch.argmax(bad.to(torch.int32))  # the first failed quantity, in QUANTITIES' order
        worst = values.gather(0, which.reshape(1)).reshape(())  # a tensor index: no host read
        record = torch.stack([step.double().to(values.device), which.double(), worst])
        self.first = torch.where(bad.any() & (self.first[0] < 0), record, self.first)
        return self.first[0] < 0

    @staticmethod
    def failure(first: list[float]) -> tuple[int, str, float] | None:
        """(step, quantity, value) of a read ``first``; None when no step failed."""
        if first[0] < 0:
            return None
        return int(first[0]), QUANTITIES[int(first[1])], first[2]


class StepMeter:
    """Sums of the steps' device metrics since the last logged record (see the module docstring)."""

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, int] = {}
        self.host: dict[str, Any] = {}
        self.carried: dict[str, float] = {}  # sums restored from a checkpoint (added at the next read)

    def add(self, metrics: Mapping[str, Any]) -> None:
        """Add one step's metrics (device tensors summed in float64; other values kept as the last)."""
        raw = metrics.raw if isinstance(metrics, StepMetrics) else metrics
        for key, value in raw.items():
            if isinstance(value, Tensor):
                value = value.detach().to(torch.float64)
                total = self.sums.get(key)
                self.sums[key] = value if total is None else total + value
                self.counts[key] = self.counts.get(key, 0) + 1
            else:
                self.host[key] = value

    def read(self, extra: Tensor | None = None, reset: bool = True) -> tuple[dict[str, Any], list[float]]:
        """(the record: means of the device metrics and the last host values, ``extra`` read alongside) in one
        transfer; ``reset`` starts the next interval."""
        keys = list(self.sums)
        parts = [self.sums[k].reshape(1) for k in keys] + ([extra.reshape(-1)] if extra is not None else [])
        values = torch.cat([p.to(parts[0].device) for p in parts]).tolist() if parts else []
        record = dict(self.host)
        for key, total in zip(keys, values):
            record[key] = (total + self.carried.get(key, 0.0)) / self.counts[key]
        tail = values[len(keys) :]
        if reset:
            self.sums, self.counts, self.host, self.carried = {}, {}, {}, {}
        return record, tail

    def state_dict(self) -> dict[str, Any]:
        """The interval so far, for a checkpoint (a read: checkpoints are written at read points anyway)."""
        keys = list(self.sums)
        values = torch.cat([self.sums[k].reshape(1) for k in keys]).tolist() if keys else []
        sums = {k: v + self.carried.get(k, 0.0) for k, v in zip(keys, values)}
        return {"sums": {**self.carried, **sums}, "counts": dict(self.counts), "host": dict(self.host)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Continue the interval a checkpoint was written in (its sums are added at the next read)."""
        self.sums, self.counts, self.host, self.carried = {}, {}, {}, {}
        if state:
            self.carried = {k: float(v) for k, v in state["sums"].items()}
            self.counts = {k: int(v) for k, v in state["counts"].items()}
            self.host = dict(state["host"])


def loop_metrics(out: ModelOutput) -> dict[str, Tensor]:
    """Mean loop steps, last finite residual and converged fraction of a forward's loop, and with the
    implicit gradient (``ift``) the backward solve's mean iterations and largest final residual (device
    tensors; the backward ran inside this step)."""
    if out.loop is None:
        return {}
    metrics = {"loop_steps": out.loop.steps.float().mean()}
    if out.loop.residuals is not None and out.loop.residuals.numel():
        metrics["residual"] = torch.nanmean(last_finite(out.loop.residuals.detach().float()))
    metrics["converged"] = out.loop.converged.float().mean()
    if "ift_steps" in out.loop.stats:
        metrics["ift_steps"] = out.loop.stats["ift_steps"].float().mean()
        metrics["ift_residual"] = out.loop.stats["ift_residual"].float().nan_to_num(nan=0.0).amax()
        if "ift_capped" in out.loop.stats:
            metrics["ift_capped"] = out.loop.stats["ift_capped"].float().mean()
    return metrics
