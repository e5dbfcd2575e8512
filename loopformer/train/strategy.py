"""Distributed strategies: how the trainer runs on one process, under DDP or under FSDP2.

The trainer holds one ``Strategy`` and never asks which one it is. A strategy answers:

- ``wrap(model, tc, probe)``: the module ``forward`` is called on (the model itself, DDP, or the
  model after FSDP2's ``fully_shard``); ``probe()`` returns the parameters the real loss leaves
  without gradient, asked only when ``train.find_unused_parameters`` is None under DDP / FSDP;
- checkpoints: ``optimizer_state`` / ``load_optimizer_state`` (with the ``optimizer_layout``
  tag written beside them), ``full_weights`` / ``full_ema`` (the tensors rank 0 writes; None:
  the model's own), ``load_weights`` / ``like`` (full tensors laid out as the live ones);
- a step: ``clip_grad_norm`` (a device tensor), ``gathered(model)`` (full parameters for calls that bypass
  ``forward``), ``mean_tensor`` (on the device, every step) / ``mean`` / ``reduce_metrics`` (host values,
  when the trainer reads its metrics) over ranks, ``barrier``, ``is_main``;
- evaluation, as a ``loopformer.eval.evaluate.EvalComm``: ``local_rows`` (DDP shards the rows;
  FSDP evaluates all rows on every rank because each forward gathers the weights), ``sum``,
  ``max``, ``lockstep`` (``train.sync_halting``).

``Strategy`` itself is the single process (also under torchrun with ``WORLD_SIZE=1``);
``DDPStrategy`` and ``FSDPStrategy`` are chosen by ``train.strategy`` when the world has more than
one rank. ``STRATEGIES`` maps the names to the classes; ``make_strategy`` builds the one a run asks for.
The collectives themselves are ``loopformer.train.dist``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from loopformer.config import TrainConfig
from loopformer.eval.evaluate import EvalComm
from loopformer.runs.layout import CheckpointError, check_weights, load_weights, load_weights_into
from loopformer.train import dist
from loopformer.train.optim import clip_grad_norm
from loopformer.train.setup import resolve_device


class Strategy(EvalComm):
    """One process: every hook is the identity or a no-op."""

    name: ClassVar[str] = "none"
    layout: ClassVar[str] = "torch"  # the optimizer_layout tag of the checkpoints it writes

    def __init__(
        self, env: dist.DistEnv, device: torch.device, sync_halting: bool = False, owns_group: bool = False
    ) -> None:
        self.env = env
        self.device = device
        self.sync_halting = sync_halting
        self.owns_group = owns_group  # this process created the process group: shutdown() ends it
        self.find_unused_parameters = False
        self.unused_parameters: list[str] = []

    @property
    def is_main(self) -> bool:
        return self.env.is_main

    @property
    def rank(self) -> int | None:
        """The rank that salts per-rank random streams (None in one process)."""
        return self.env.rank if self.env.enabled else None

    # -- model --------------------------------------------------------------------------------
    def validate(self, tc: TrainConfig) -> None:
        """Raise for training options this strategy cannot run."""

    def wrap(self, model: nn.Module, tc: TrainConfig, probe: Callable[[], list[str]]) -> nn.Module:
        return model

    @contextlib.contextmanager
    def gathered(self, model: nn.Module) -> Iterator[nn.Module]:
        yield model

    def no_sync(self, forward_model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """Around one micro-step's forward + backward (``loopformer.train.accumulate``): ``sync``
        False (an inner micro-step) leaves the gradients local; one process: nothing to do."""
        return contextlib.nullcontext()

    # -- a step -------------------------------------------------------------------------------
    def clip_grad_norm(self, params: list[Tensor], max_norm: float) -> Tensor:
        return clip_grad_norm(params, max_norm)

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        return dict(values)

    def mean_tensor(self, values: Tensor) -> Tensor:
        """``values`` averaged over ranks on the device (no host read); one process: as they are."""
        return values

    def reduce_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        return metrics

    def barrier(self) -> None:
        dist.barrier()

    def shutdown(self, sync: bool) -> None:
        """End the process group this strategy created (``sync``: meet at a barrier first)."""
        if self.owns_group:
            dist.shutdown(sync=sync)
            self.owns_group = False

    # -- checkpoints --------------------------------------------------------------------------
    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: Any) -> None:
        groups = state.get("param_groups") or [{}]
        if groups[0].get("params") and isinstance(
            groups[0]["params"][0], str
        ):  # keyed by name: FSDP's layout
            dist.load_fsdp_optimizer_state(model, optimizer, state)
        else:
            optimizer.load_state_dict(state)

    def full_weights(self, model: nn.Module) -> dict[str, Tensor] | None:
        return None

    def full_ema(self, ema_state: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
        return ema_state

    def load_weights(self, model: nn.Module, path: Path) -> None:
        load_weights_into(model, path)

    def like(self, target: Tensor | None, full: Tensor) -> Tensor:
        return full

    def sharded_checkpoints(self, tc: TrainConfig) -> bool:
        """Whether checkpoints are sharded (``loopformer.runs.sharded``): only when asked for here."""
        return tc.checkpoint_format == "sharded"

    def check_layout(self, layout: str, folder: Path) -> None:
        if layout != self.layout and not (
            layout == "fsdp_full" and not self.env.enabled
        ):  # one process reads both
            raise CheckpointError(
                f"{folder} holds {'an FSDP' if layout == 'fsdp_full' else 'a DDP / single-process'} optimizer "
                f"state; resume it with train.strategy={'fsdp' if layout == 'fsdp_full' else 'ddp'}"
            )


class _Distributed(Strategy):
    """What DDP and FSDP share: the unused-parameter probe, metric reduction, lock-step halting."""

    def wrap(self, model: nn.Module, tc: TrainConfig, probe: Callable[[], list[str]]) -> nn.Module:
        find_unused = tc.find_unused_parameters
        if find_unused is None:  # automatic: does the real loss leave a parameter without gradient?
            self.unused_parameters = probe()
            find_unused = dist.all_reduce_max(float(bool(self.unused_parameters))) > 0
        self.find_unused_parameters = bool(find_unused)
        unused_outputs = tuple(
            name
            for name, weight in (("q_logits", tc.q_loss_weight), ("aux_loss", tc.ponder_weight))
            if weight <= 0
        )
        return dist.wrap_model(model, self.name, self.device, self.find_unused_parameters, unused_outputs)

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        return dist.all_reduce_mean(values)

    def mean_tensor(self, values: Tensor) -> Tensor:
        return dist.all_reduce_mean_tensor(values)

    def reduce_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Per-rank metrics -> their mean over ranks ("halted": the total); shared values kept."""
        shared = ("step", "lr", "grad_norm", "loops", "level")
        keys = [
            k
            for k, v in metrics.items()
            if k not in shared and isinstance(v, int | float) and not isinstance(v, bool)
        ]
        mean = dist.all_reduce_mean({k: metrics[k] for k in keys})
        out = {**metrics, **mean}
        if "halted" in out:
            out["halted"] = int(round(mean["halted"] * self.env.world_size))
        return out

    def max(self, value: float) -> float:
        return dist.all_reduce_max(value)

    def lockstep(self) -> dist.LockstepHalting | None:
        lock = dist.LockstepHalting(self.sync_halting)
        return lock if lock.enabled else None


class DDPStrategy(_Distributed):
    """``DistributedDataParallel``: replicated weights; evaluation rows are sharded and the counts summed."""

    name = "ddp"

    def local_rows(self, rows: np.ndarray) -> np.ndarray:
        return rows[dist.eval_shard(len(rows))]

    def local_batches(self, n: int) -> np.ndarray:
        return np.arange(self.env.rank, n, self.env.world_size, dtype=np.int64)

    def no_sync(self, forward_model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """An inner micro-step runs in DDP's ``no_sync()``: no gradient all-reduce until the last."""
        return contextlib.nullcontext() if sync else forward_model.no_sync()

    def sum(self, values: list[float]) -> list[float]:
        return dist.all_reduce_sum(values)


class FSDPStrategy(_Distributed):
    """FSDP2 ``fully_shard`` on the model's root: sharded weights, full tensors in checkpoints."""

    name = "fsdp"
    layout = "fsdp_full"

    def validate(self, tc: TrainConfig) -> None:
        if tc.jacobian_weight > 0:
            raise ValueError(
                "train.jacobian_weight > 0 is not supported with train.strategy=fsdp (it calls "
                "the step outside forward); use train.strategy=ddp"
            )

    @contextlib.contextmanager
    def gathered(self, model: nn.Module) -> Iterator[nn.Module]:
        with dist.gathered(model):
            yield model

    @contextlib.contextmanager
    def no_sync(self, forward_model: nn.Module, sync: bool) -> Iterator[None]:
        """An inner micro-step runs with ``set_requires_gradient_sync(False)``: the unsharded
        gradients accumulate locally and are reduce-scattered once, in the last micro-step."""
        if sync:
            yield
            return
        forward_model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            forward_model.set_requires_gradient_sync(True)

    def clip_grad_norm(self, params: list[Tensor], max_norm: float) -> Tensor:
        return dist.clip_grad_norm(params, max_norm)

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return dist.fsdp_optimizer_state(model, optimizer)

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: Any) -> None:
        dist.load_fsdp_optimizer_state(model, optimizer, state)

    def full_weights(self, model: nn.Module) -> dict[str, Tensor] | None:
        return dist.full_state(model.state_dict())  # gathers the shards (every rank takes part)

    def full_ema(self, ema_state: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
        return dist.full_state(ema_state) if ema_state is not None else None

    def load_weights(self, model: nn.Module, path: Path) -> None:
        weights = load_weights(path)  # full tensors from the file, re-sharded like the live parameters
        check_weights(weights, model, str(path))
        with torch.no_grad():
            for name, t in model.state_dict().items():
                t.copy_(dist.like(t, weights[name]))

    def like(self, target: Tensor | None, full: Tensor) -> Tensor:
        return full if target is None else dist.like(target, full)

    def sharded_checkpoints(self, tc: TrainConfig) -> bool:
        return tc.checkpoint_format != "full"  # "auto": every rank writes its own shards


STRATEGIES: dict[str, type[Strategy]] = {"ddp": DDPStrategy, "fsdp": FSDPStrategy}


def make_strategy(tc: TrainConfig, device_name: str) -> Strategy:
    """Join the job (torchrun's environment) and return its strategy: ``Strategy`` for one process
    (device ``resolve_device(device_name)``), else ``STRATEGIES[train.strategy]`` on the rank's device."""
    if tc.strategy not in STRATEGIES:
        raise ValueError(f"unknown train.strategy {tc.strategy!r}; expected one of {tuple(STRATEGIES)}")
    env, device, created = dist.setup(device_name)
    if not env.enabled:
        return Strategy(env, resolve_device(device_name), tc.sync_halting, created)
    return STRATEGIES[tc.strategy](env, device, tc.sync_halting, created)
