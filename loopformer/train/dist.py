"""Multi-process training on plain ``torch.distributed`` (launched by ``torchrun``).

What lives here (the trainer calls it; a single process that was not launched by torchrun
gets ``DistEnv(rank=0, world_size=1)`` and every helper is then a no-op or the identity):

- ``env_from_environ`` / ``setup`` / ``shutdown``: rank, world size and local rank from the
  torchrun environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``MASTER_ADDR`` / ``MASTER_PORT``); backend ``nccl`` on CUDA (device ``cuda:LOCAL_RANK``, passed as
  ``init_process_group(device_id=)``), ``gloo`` on CPU; ``shutdown`` destroys the process group the trainer
  created. Joining never waits in silence: the process says how many processes it waits for and where, and
  gives up after ``train.rendezvous_timeout_s`` (a ``TCPStore`` rendezvous bounded apart from the collectives'
  timeout) with one line naming the variables (a ``WORLD_SIZE`` left in the environment by another job).
- ``all_reduce_mean`` (metrics), ``all_reduce_max``, ``all_gather_rows`` (the deep-supervision
  carry, gathered to one global carry for the checkpoint), ``barrier``.
- ``shard``: rank ``r`` of ``w`` takes rows ``[r * B / w, (r + 1) * B / w)`` of each global
  batch of ``B`` rows. The index stream (``loopformer.train.data.IndexStream``) is global and
  identical on every rank (a pure function of seed, epoch and position), so the concatenation
  of the ranks' shards is exactly the batch a single process would draw, and the stream state
  saved in a checkpoint is global: a run resumes under any world size that divides the batch.
- ``wrap_model``: ``DistributedDataParallel`` (strategy "ddp") or FSDP2 ``fully_shard`` on the
  model's root (strategy "fsdp", opt-in). The trainer calls ``forward`` through the wrapper:
  ``LoopedModel.forward`` runs the whole loop (and the readout / Q-head), so one DDP forward is
  one engine call. ``find_unused_parameters`` is switched on only when ``unused_parameters``
  finds parameters that get no gradient from the trainer's real loss (measured per family in
  tests/test_dist.py: e.g. FPRM's Q-head when ``train.q_loss_weight=0``, TRM / HRM learned
  initial states under the truncated gradient).
- ``LockstepHalting`` (``train.sync_halting``): data-dependent halting stays per rank (each
  rank's engine drops its own halted samples); with the option on, each loop step all-reduces
  the number of ranks still looping and a rank whose samples all halted keeps answering
  all-reduces until the global count is zero, so every rank leaves ``forward`` on the same
  global iteration count. That is needed when a strategy puts collectives inside the loop
  step (per-block FSDP, tensor parallelism) and gives every rank the same "all halted"
  decision in evaluation; it costs one tiny all-reduce per loop step, so it is off by default
  (DDP and root-level FSDP run no collective inside ``forward``).

The distributed layer follows nanochat's shape (a hundred lines on torch.distributed); the
loop-count samplers are already seeded by the global step, so all ranks draw the
same loop count without communication.

The strategies (``Strategy``, ``DDPStrategy``, ``FSDPStrategy``): the trainer holds one and never asks which
one it is. A strategy answers:

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
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from loopformer.config import TrainConfig
from loopformer.devices import resolve_device
from loopformer.eval.evaluate import EvalComm
from loopformer.runs.checkpoint import CheckpointError, check_weights
from loopformer.train.optim import clip_grad_norm

log = logging.getLogger("loopformer.train")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job (``world_size == 1``: not distributed)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int_env(environ: Mapping[str, str], key: str, default: int) -> int:
    raw = environ.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None


def env_from_environ(environ: Mapping[str, str] | None = None) -> DistEnv:
    """The torchrun environment; ``DistEnv()`` (one process) when ``WORLD_SIZE`` is unset or 1."""
    environ = os.environ if environ is None else environ
    world = _int_env(environ, "WORLD_SIZE", 1)
    rank = _int_env(environ, "RANK", 0)
    local_rank = _int_env(environ, "LOCAL_RANK", rank)
    local_world = _int_env(environ, "LOCAL_WORLD_SIZE", world)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"bad torchrun environment: RANK={rank}, WORLD_SIZE={world}")
    if world > 1:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(k)]
        if missing:
            raise ValueError(
                f"WORLD_SIZE={world} but {', '.join(missing)} is not set; launch with torchrun "
                "(e.g. torchrun --standalone --nproc_per_node=2 -m loopformer train RECIPE)"
            )
    return DistEnv(rank, world, local_rank, max(1, local_world))


def current_env() -> DistEnv:
    """The initialised process group's rank / world size, else the torchrun environment."""
    env = env_from_environ()
    if dist.is_available() and dist.is_initialized():
        return DistEnv(dist.get_rank(), dist.get_world_size(), env.local_rank, env.local_world_size)
    return env


def setup(device: str = "auto", timeout_s: float = 600.0, rendezvous_s: float = 300.0) -> tuple[DistEnv, torch.device, bool]:
    """Join the job: ``(env, device, created)``; ``created`` says this call made the process group.

    ``device``: "auto" | "cpu" | "cuda". Under torchrun with CUDA the device is
    ``cuda:LOCAL_RANK`` and the backend ``nccl``; on CPU the backend is ``gloo``. A process
    group that already exists (tests that spawn workers themselves) is used as it is. ``rendezvous_s``: how
    long to wait for the other processes (``rendezvous``); ``timeout_s``: the collectives' timeout.
    """
    env = env_from_environ()
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was asked for but CUDA is not available")
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; expected 'auto', 'cpu' or 'cuda'")
    dev = torch.device("cpu")
    if use_cuda:
        dev = torch.device("cuda", env.local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(dev)
    created = False
    if dist.is_available() and dist.is_initialized():
        env = current_env()
    elif env.enabled:
        if not dist.is_available():
            raise RuntimeError("WORLD_SIZE > 1 but this PyTorch build has no torch.distributed")
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            store=rendezvous(env, rendezvous_s),
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            # bound to this rank's GPU: NCCL connects eagerly and barriers know their device
            device_id=dev if use_cuda else None,
        )
        created = True
    return env, dev, created


def rendezvous(env: DistEnv, timeout_s: float, environ: Mapping[str, str] | None = None) -> Any:
    """The job's ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` (rank 0 serves it) once all ``WORLD_SIZE``
    processes joined; says what it waits for, and gives up after ``timeout_s`` with a ValueError naming the
    variables."""
    environ = os.environ if environ is None else environ
    addr, port = environ["MASTER_ADDR"], _int_env(environ, "MASTER_PORT", 0)
    names = f"WORLD_SIZE={env.world_size} RANK={env.rank} MASTER_ADDR={addr} MASTER_PORT={port}"
    log.info("rank %d: waiting up to %g s for %d processes at %s:%d (%s; train.rendezvous_timeout_s)",
             env.rank, timeout_s, env.world_size, addr, port, names)  # fmt: skip
    try:
        agent = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent serves the store
        return dist.TCPStore(addr, port, env.world_size, is_master=env.rank == 0 and not agent, multi_tenant=True,
                             timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip
    except (RuntimeError, OSError, ValueError) as err:  # DistStoreError / DistNetworkError: a timeout, a refusal
        raise ValueError(
            f"no distributed job formed within {timeout_s:g} s ({names} in the environment; "
            f"{' '.join(str(err).split())[:200]}): start the other processes (torchrun), raise "
            f"train.rendezvous_timeout_s, or unset WORLD_SIZE to train in one process"
        ) from None


def shutdown(sync: bool = True) -> None:
    """Destroy the default process group (no-op when there is none).

    With ``sync`` every rank first meets at a barrier, so no rank tears its group down while another
    still has collectives in flight (rank 0's final evaluation and checkpoint); without it (an error is
    unwinding and a peer may be gone) the group is destroyed at once.
    """
    if dist.is_available() and dist.is_initialized():
        if sync and dist.get_world_size() > 1:
            dist.barrier()
        gc.collect()  # free dropped DDP reducers (reference cycles) that still hold the group
        dist.destroy_process_group()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def _comm_device() -> torch.device:
    """Tensors for collectives live here (nccl needs CUDA tensors; gloo takes CPU ones)."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_mean(values: Mapping[str, float]) -> dict[str, float]:
    """Mean over ranks of each value (every rank must pass the same keys)."""
    if not is_distributed() or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    t /= dist.get_world_size()
    return dict(zip(keys, t.tolist(), strict=True))


def all_reduce_mean_tensor(values: Tensor) -> Tensor:
    """Mean over ranks of a device tensor, on the device (no host read; a new tensor)."""
    if not is_distributed():
        return values
    out = values.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / dist.get_world_size()


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum over ranks, element by element."""
    if not is_distributed():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_max(value: float) -> float:
    if not is_distributed():
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_gather_rows(t: Tensor | None) -> Tensor | None:
    """Concatenate every rank's ``t`` along dim 0 in rank order (equal shapes on all ranks)."""
    if t is None or not is_distributed():
        return t
    dtype = t.dtype
    x = (t.to(torch.uint8) if dtype == torch.bool else t).to(_comm_device()).contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return torch.cat(parts).to(device=t.device, dtype=dtype)


def shard(rows: np.ndarray | Tensor, rank_: int | None = None, world: int | None = None) -> Any:
    """Rank ``rank_``'s contiguous share of a global batch; the length must divide by ``world``."""
    rank_ = rank() if rank_ is None else rank_
    world = world_size() if world is None else world
    n = len(rows)
    if n % world:
        raise ValueError(f"a global batch of {n} rows cannot be split evenly over {world} ranks")
    per = n // world
    return rows[rank_ * per : (rank_ + 1) * per]


def eval_shard(n: int, rank_: int | None = None, world: int | None = None) -> np.ndarray:
    """Rank ``rank_``'s rows of an evaluation set of ``n`` rows (contiguous, sizes differ by <= 1)."""
    rank_ = rank() if rank_ is None else rank_
    world = world_size() if world is None else world
    bounds = np.linspace(0, n, world + 1).round().astype(np.int64)
    return np.arange(bounds[rank_], bounds[rank_ + 1], dtype=np.int64)


# --------------------------------------------------------------------------------------------
# Model wrapping
# --------------------------------------------------------------------------------------------
def unused_parameters(model: nn.Module, loss_of: Callable[[], Tensor]) -> list[str]:
    """Names of ``model``'s trainable parameters that get no gradient from ``loss_of()``.

    Runs one forward / backward (``loss_of`` calls the model and returns the loss) and leaves
    every ``.grad`` as it was before.
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    saved = {n: p.grad for n, p in params}
    for _, p in params:
        p.grad = None
    try:
        loss_of().backward()
        return [n for n, p in params if p.grad is None]
    finally:
        for n, p in params:
            p.grad = saved[n]


class UsedOutputs(nn.Module):
    """``model.forward`` with the outputs the loss does not use detached.

    DDP with ``find_unused_parameters`` marks as used every parameter reachable from the
    forward's output tensors; a Q logit the loss ignores (``train.q_loss_weight=0``) would then
    be waited for and never arrive. Detaching it makes DDP's graph the loss's graph.
    ``unused``: names of ``ModelOutput`` fields to detach ("q_logits", "aux_loss").
    """

    def __init__(self, model: nn.Module, unused: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.model = model
        self.unused = tuple(unused)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.model(*args, **kwargs)
        for name in self.unused:
            value = getattr(out, name, None)
            if isinstance(value, Tensor):
                setattr(out, name, value.detach())
        if (
            "aux_loss" in self.unused
            and getattr(out, "loop", None) is not None
            and out.loop.ponder_cost is not None
        ):
            out.loop.ponder_cost = out.loop.ponder_cost.detach()
        return out


def wrap_model(
    model: nn.Module,
    strategy: str,
    device: torch.device,
    find_unused_parameters: bool = False,
    unused_outputs: tuple[str, ...] = (),
) -> nn.Module:
    """The module the trainer calls ``forward`` on: ``model`` itself (one process), DDP or FSDP2.

    "ddp": ``DistributedDataParallel(UsedOutputs(model, unused_outputs))``; rank 0's weights are
    broadcast at construction. "fsdp": ``fully_shard(model)`` on a 1-D device mesh over all
    ranks: ``model`` itself becomes the FSDP module (its parameters DTensor shards), so build
    the optimiser after this call.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown train.strategy {strategy!r}; expected one of {tuple(STRATEGIES)}")
    if not is_distributed():
        return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(
            UsedOutputs(model, unused_outputs) if unused_outputs else model,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=find_unused_parameters,
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    fully_shard(model, mesh=mesh)
    return model


def is_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(model, FSDPModule)


def full_tensor(t: Tensor) -> Tensor:
    """A plain tensor from a DTensor shard (collective: every rank must call it) or ``t`` itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_state(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``{name: full tensor}`` of a state dict that may hold DTensors (collective under FSDP)."""
    return {k: full_tensor(v) for k, v in tensors.items()}


def local_state(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``{name: this rank's shard}`` of a state dict that may hold DTensors (no communication)."""
    return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in tensors.items()}


# --------------------------------------------------------------------------------------------
# Synchronised halting
# --------------------------------------------------------------------------------------------
class LockstepHalting:
    """Keep all ranks on the same loop iteration count under data-dependent halting.

    Pass ``callback`` to ``model(..., callback=...)``: after each loop step this rank all-reduces
    1 ("still looping"). After ``forward`` returns call ``drain()``: the rank all-reduces 0 until
    the sum is 0, i.e. until every rank has halted all of its samples. ``global_steps`` is then
    the loop count of the slowest rank, the same on every rank. Outside a process group both
    are no-ops.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and is_distributed()
        self.local_steps = 0
        self.global_steps = 0

    def _reduce(self, flag: int) -> int:
        t = torch.tensor([flag], dtype=torch.int64, device=_comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return int(t.item())

    def callback(self, t: int, z: Tensor, active: Tensor) -> None:
        self.local_steps = t
        if self.enabled:
            self._reduce(1)
            self.global_steps += 1

    def drain(self) -> int:
        """Wait (answering all-reduces) until every rank's loop has ended; returns ``global_steps``."""
        if not self.enabled:
            return self.local_steps
        while self._reduce(0) > 0:
            self.global_steps += 1
        return self.global_steps


# --------------------------------------------------------------------------------------------
# FSDP2 state: full (unsharded) tensors in checkpoints, shards in memory
# --------------------------------------------------------------------------------------------
def load_fsdp_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------
class Strategy(EvalComm):
    """One process: every hook is the identity or a no-op."""

    name: ClassVar[str] = "none"
    layout: ClassVar[str] = "torch"  # the optimizer_layout tag of the checkpoints it writes

    def __init__(
        self, env: DistEnv, device: torch.device, sync_halting: bool = False, owns_group: bool = False
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
        """Around one micro-step's forward + backward (gradient accumulation, ``Trainer._micro_steps``): ``sync``
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
        barrier()

    def shutdown(self, sync: bool) -> None:
        """End the process group this strategy created (``sync``: meet at a barrier first)."""
        if self.owns_group:
            shutdown(sync=sync)
            self.owns_group = False

    # -- checkpoints --------------------------------------------------------------------------
    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: Any) -> None:
        groups = state.get("param_groups") or [{}]
        if groups[0].get("params") and isinstance(
            groups[0]["params"][0], str
        ):  # keyed by name: FSDP's layout
            load_fsdp_optimizer_state(model, optimizer, state)
        else:
            optimizer.load_state_dict(state)

    def full_weights(self, model: nn.Module) -> dict[str, Tensor] | None:
        return None

    def full_ema(self, ema_state: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
        return ema_state

    def load_weights(self, model: nn.Module, weights: dict[str, Tensor], source: str) -> None:
        """A checkpoint's full ``weights`` into ``model`` (names, shapes and dtypes checked; ``source`` names
        the file)."""
        check_weights(weights, model, source)
        model.load_state_dict(weights, strict=True)

    def like(self, target: Tensor | None, full: Tensor) -> Tensor:
        """A full tensor of a checkpoint laid out as the live ``target`` (one process: as it is)."""
        return full

    def sharded_checkpoints(self, tc: TrainConfig) -> bool:
        """Whether checkpoints are sharded (``loopformer.runs.checkpoint.save_sharded``): only when asked for here."""
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
            find_unused = all_reduce_max(float(bool(self.unused_parameters))) > 0
        self.find_unused_parameters = bool(find_unused)
        unused_outputs = tuple(
            name
            for name, weight in (("q_logits", tc.q_loss_weight), ("aux_loss", tc.ponder_weight))
            if weight <= 0
        )
        return wrap_model(model, self.name, self.device, self.find_unused_parameters, unused_outputs)

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        return all_reduce_mean(values)

    def mean_tensor(self, values: Tensor) -> Tensor:
        return all_reduce_mean_tensor(values)

    def reduce_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Per-rank metrics -> their mean over ranks ("halted": the total); shared values kept."""
        shared = ("step", "lr", "grad_norm", "loops", "level")
        keys = [
            k
            for k, v in metrics.items()
            if k not in shared and isinstance(v, int | float) and not isinstance(v, bool)
        ]
        mean = all_reduce_mean({k: metrics[k] for k in keys})
        out = {**metrics, **mean}
        if "halted" in out:
            out["halted"] = int(round(mean["halted"] * self.env.world_size))
        return out

    def max(self, value: float) -> float:
        return all_reduce_max(value)

    def lockstep(self) -> LockstepHalting | None:
        lock = LockstepHalting(self.sync_halting)
        return lock if lock.enabled else None


class DDPStrategy(_Distributed):
    """``DistributedDataParallel``: replicated weights; evaluation rows are sharded and the counts summed."""

    name = "ddp"

    def local_rows(self, rows: np.ndarray) -> np.ndarray:
        return rows[eval_shard(len(rows))]

    def local_batches(self, n: int) -> np.ndarray:
        return np.arange(self.env.rank, n, self.env.world_size, dtype=np.int64)

    def no_sync(self, forward_model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """An inner micro-step runs in DDP's ``no_sync()``: no gradient all-reduce until the last."""
        return contextlib.nullcontext() if sync else forward_model.no_sync()

    def sum(self, values: list[float]) -> list[float]:
        return all_reduce_sum(values)


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
        """Full parameters inside the block for calls that bypass ``forward`` (FSDP ``unshard``)."""
        if not is_fsdp(model):
            yield model
            return
        model.unshard()
        try:
            yield model
        finally:
            model.reshard()

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
        """Global gradient norm of the sharded gradients before clipping, as a device tensor; clips when
        ``max_norm > 0`` (the scale applied on the device)."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros(())
        total = full_tensor(torch.nn.utils.get_total_norm(grads))
        if max_norm > 0:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for g in grads:  # a DTensor shard is scaled in place through its local tensor
                local = g.to_local() if hasattr(g, "to_local") else g
                local.mul_(coef.to(local.device))
        return total

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimiser state with full tensors keyed by parameter name (collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: Any) -> None:
        load_fsdp_optimizer_state(model, optimizer, state)

    def full_weights(self, model: nn.Module) -> dict[str, Tensor] | None:
        return full_state(model.state_dict())  # gathers the shards (every rank takes part)

    def full_ema(self, ema_state: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
        return full_state(ema_state) if ema_state is not None else None

    def load_weights(self, model: nn.Module, weights: dict[str, Tensor], source: str) -> None:
        check_weights(weights, model, source)  # full tensors, re-sharded like the live parameters
        with torch.no_grad():
            for name, t in model.state_dict().items():
                t.copy_(self.like(t, weights[name]))

    def like(self, target: Tensor | None, full: Tensor) -> Tensor:
        """``full`` laid out as ``target``: sharded like a DTensor ``target``, else moved to its device."""
        if target is None:
            return full
        if hasattr(target, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor

            return distribute_tensor(full.to(target.device, target.dtype), target.device_mesh, target.placements)
        return full.to(target.device, target.dtype)

    def sharded_checkpoints(self, tc: TrainConfig) -> bool:
        return tc.checkpoint_format != "full"  # "auto": every rank writes its own shards


STRATEGIES: dict[str, type[Strategy]] = {"ddp": DDPStrategy, "fsdp": FSDPStrategy}


def make_strategy(tc: TrainConfig, device_name: str) -> Strategy:
    """Join the job (torchrun's environment) and return its strategy: ``Strategy`` for one process
    (device ``resolve_device(device_name)``), else ``STRATEGIES[train.strategy]`` on the rank's device."""
    if tc.strategy not in STRATEGIES:
        raise ValueError(f"unknown train.strategy {tc.strategy!r}; expected one of {tuple(STRATEGIES)}")
    env, device, created = setup(device_name, rendezvous_s=tc.rendezvous_timeout_s)
    if not env.enabled:
        return Strategy(env, resolve_device(device_name), tc.sync_halting, created)
    return STRATEGIES[tc.strategy](env, device, tc.sync_halting, created)
