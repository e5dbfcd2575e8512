"""The trainer: simple looped training and deep supervision, with exact resume.

Two modes (``train.mode``):

- ``simple`` (Loop, Think & Generalize, SYSTEMS.md section 3): every step draws a fresh batch,
  a loop count ``R`` from ``loopformer.loop.make_sampler`` seeded by the global step (fixed,
  Poisson(4) clipped to [2, 8], log-normal Poisson), runs one forward with ``max_steps = R``
  and fixed halting (an ACT model keeps its learned halting with ``R`` as the cap), and steps.
  ``train.loop_sampler: none`` runs the training loop as configured instead (its own halting,
  e.g. an Attractor's Anderson solve to tolerance, capped at ``loop_train.max_steps``).
- ``deep_supervision`` (TRM / HRM / FPRM, SYSTEMS.md sections 1 and 4): a carried batch of
  ``batch_size`` slots, each holding an example, its detached state and a segment count. Each
  optimiser step runs ONE segment (``model.forward(state=carry.state)`` with the training loop
  config), takes the loss on that segment's output (plus the Q-head BCE against "the answer is
  exactly right"), steps, and carries ``out.state.detach()``. A slot halts when its segment count
  reaches ``max_segments``, or (options) when its Q logit is > 0 (TRM, with exploration: with
  probability ``halt_exploration`` a slot must first run a random 2..max_segments segments) or
  when its loop converged (FPRM). Halted slots get new examples and fresh ``init_state`` rows.

Around both: CPU float32 (flush denormals, one thread per physical core) or CUDA with bf16
autocast (``bf16``), optionally a ``torch.compile``d step; warm-up + constant / cosine lr, clipping, EMA, the difficulty curriculum, periodic
evaluation (``loopformer.eval.evaluate`` when a task is known, loss and bits per byte for a task
without a validator such as text, else exact-match on the labels; the final checkpoint is written first),
metrics as JSONL (+ optional TensorBoard), a rich progress bar, divergence detection
(``TrainingDivergedError`` before the bad update is applied, the last good checkpoint kept),
and atomic checkpoints holding everything needed to resume bit-exactly (``train.resume``).
Every random draw is a function of (seed, global step), so a resumed run replays exactly.

Launched by ``torchrun`` (``loopformer.train.dist``), every rank runs this same trainer:
the index stream is global and each rank takes its contiguous shard of each global batch
(``train.batch_size`` rows, ``batch_size / world`` per rank); the model is called through
DDP (or FSDP2 with ``train.strategy=fsdp``), with ``find_unused_parameters`` switched on only
when a probe forward / backward of the real loss leaves a parameter without gradient; the
deep-supervision carry holds each rank's slots and is gathered into one global carry for the
checkpoint (so a run resumes under another world size that divides the batch); random initial
states and Jacobian probes are drawn per (seed, step, rank); metrics are averaged over ranks;
files, progress bars and logs come from rank 0 only. ``fit()`` ends a process group the
trainer created itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from loopformer.config import RunConfig, save_config, to_dict
from loopformer.loop import LoopConfig, make_sampler
from loopformer.models.base import LoopedModel, ModelOutput
from loopformer.nn import autocast
from loopformer.tasks.base import Task, TokenDataset
from loopformer.train import dist
from loopformer.train.checkpoint import (
    CheckpointError,
    check_weights,
    latest_checkpoint,
    load_training_state,
    load_weights,
    load_weights_into,
    rng_state,
    save_checkpoint,
    set_rng_state,
    step_dirs,
)
from loopformer.train.data import Batch, Curriculum, IndexStream, load_split, make_batch
from loopformer.train.losses import accuracy, jacobian_frobenius, q_halt_loss, sequence_loss
from loopformer.train.optim import EMA, build_optimizer, clip_grad_norm, lr_at, set_lr

log = logging.getLogger("loopformer.train")

# salts that keep the per-step random streams independent
_SALT_INIT, _SALT_EXPLORE, _SALT_JAC, _SALT_CURRICULUM = 11, 13, 17, 19


class TrainingDivergedError(RuntimeError):
    """Training produced a non-finite or exploding quantity; no update was applied for that step."""

    def __init__(self, step: int, quantity: str, value: float, checkpoint: Path | None) -> None:
        where = f"; the last good checkpoint is {checkpoint}" if checkpoint else "; no checkpoint was written"
        super().__init__(f"training diverged at step {step}: {quantity} = {value}{where}")
        self.step, self.quantity, self.value, self.checkpoint = step, quantity, value, checkpoint


def physical_cores() -> int:
    """Physical CPU cores available to this process (from /proc/cpuinfo; else os.cpu_count())."""
    try:
        pairs, phys = set(), None
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    pairs.add((phys, line.split(":")[1].strip()))
        if pairs:
            return max(1, min(len(pairs), len(os.sched_getaffinity(0))))
    except (OSError, AttributeError):
        pass
    return max(1, os.cpu_count() or 1)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was asked for but CUDA is not available")
    return torch.device(name)


def _seed_for(seed: int, step: int, salt: int, rank: int | None = None) -> int:
    entropy = [seed, step, salt] if rank is None else [seed, step, salt, rank]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def _last_finite(rows: Tensor) -> Tensor:
    """Per column, the last non-NaN value of a [steps, B] trace (NaN when none)."""
    finite = ~torch.isnan(rows)
    if rows.numel() == 0:
        return rows.new_full(rows.shape[1:], float("nan"))
    last = (finite.cumsum(0) == finite.sum(0, keepdim=True)) & finite
    vals = torch.where(last, rows, torch.zeros_like(rows)).sum(0)
    return torch.where(finite.any(0), vals, torch.full_like(vals, float("nan")))


@dataclass
class Carry:
    """Deep-supervision slots: each row an example being refined over segments."""

    index: Tensor  # [B] dataset rows (CPU int64)
    inputs: Tensor  # [B, T]
    labels: Tensor  # [B, T]
    puzzle_ids: Tensor | None  # [B]
    state: Tensor  # [B, ...] detached carried state
    segments: Tensor  # [B] segments run so far (CPU int64)
    halted: Tensor  # [B] bool (CPU): replace before the next segment

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("index", "inputs", "labels", "puzzle_ids", "state", "segments", "halted")}

    @classmethod
    def from_state(cls, state: dict[str, Any], device: torch.device) -> Carry:
        def dev(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device)

        return cls(
            index=state["index"].long(),
            inputs=dev(state["inputs"]),
            labels=dev(state["labels"]),
            puzzle_ids=dev(state["puzzle_ids"]),
            state=dev(state["state"]),
            segments=state["segments"].long(),
            halted=state["halted"].bool(),
        )


class Trainer:
    """Train ``config``'s model on its task; ``fit()`` returns a summary dict.

    ``model``, ``task``, ``train_data`` and ``eval_data`` override what the config would build
    (tests pass tiny ones). The run folder ``config.out_dir`` receives ``config.yaml`` /
    ``config.json``, ``metrics.jsonl``, ``checkpoints/`` and ``summary.json``.
    """

    def __init__(
        self,
        config: RunConfig,
        model: LoopedModel | None = None,
        task: Task | None = None,
        train_data: TokenDataset | None = None,
        eval_data: TokenDataset | None = None,
    ) -> None:
        self.config = config
        tc = config.train
        # torchrun: join the process group (one process: world_size 1, nothing to join)
        self.dist_env, dist_device, self._owns_group = dist.setup(config.device)
        self.device = dist_device if self.dist_env.enabled else resolve_device(config.device)
        self.strategy: str = tc.strategy
        self.sync_halting: bool = tc.sync_halting
        if self.dist_env.enabled and not self.dist_env.is_main:
            logging.getLogger("loopformer").setLevel(logging.WARNING)  # logs come from rank 0
        if self.dist_env.enabled and tc.batch_size % self.dist_env.world_size:
            raise ValueError(
                f"train.batch_size={tc.batch_size} (the global batch) must be divisible by the world size "
                f"{self.dist_env.world_size}"
            )
        if self.device.type == "cpu":
            torch.set_flush_denormal(True)
            torch.set_num_threads(tc.threads or max(1, physical_cores() // self.dist_env.local_world_size))
        torch.manual_seed(config.seed)
        np.random.seed(config.seed % 2**32)
        random.seed(config.seed)

        # -- task and data ----------------------------------------------------------------------
        dc = config.data
        if task is None and (train_data is None or model is None):  # given data + model: no task needed
            from loopformer.tasks.registry import get_task

            task = get_task(dc.task, **dc.options)
        self.task = task
        self.train_data = train_data if train_data is not None else self._dataset("train")
        self.eval_data = eval_data if eval_data is not None else self._dataset("eval")
        if len(self.train_data) == 0:
            raise ValueError("the training set is empty")
        # decided once: a task whose check raises NotImplementedError (text) is scored by loss / bits per byte
        from loopformer.eval.evaluate import has_validator

        self.has_validator = self.task is None or has_validator(self.task, self.eval_data)

        # -- model ------------------------------------------------------------------------------
        if model is None:
            model = self._build_model()
        self.model = model.to(self.device)
        if config.compile:  # compile the looped body (the hot path); the engine's loop stays eager
            self.model.step = torch.compile(self.model.step)  # type: ignore[method-assign]
        self.loop_train: LoopConfig = config.loop_config(self.model.config.loop, "train")
        self.loop_eval: LoopConfig = config.loop_config(self.model.config.loop, "eval")
        self.sampler = self._loop_sampler()

        # -- multi-process: DDP / FSDP wrapper (forward runs the whole loop through it) ---------
        self.forward_model: torch.nn.Module = self.model
        self.unused_parameters: list[str] = []
        self.find_unused_parameters = False
        if self.dist_env.enabled:
            find_unused = tc.find_unused_parameters
            if find_unused is None:  # automatic: does the real loss leave a parameter without gradient?
                self.unused_parameters = self.probe_unused_parameters()
                find_unused = dist.all_reduce_max(float(bool(self.unused_parameters))) > 0
            self.find_unused_parameters = bool(find_unused)
            unused_outputs = tuple(name for name, weight in (("q_logits", tc.q_loss_weight),
                                                             ("aux_loss", tc.ponder_weight)) if weight <= 0)
            self.forward_model = dist.wrap_model(
                self.model, self.strategy, self.device, self.find_unused_parameters, unused_outputs
            )
        self.fsdp = dist.is_fsdp(self.model)
        if self.fsdp and tc.jacobian_weight > 0:
            raise ValueError("train.jacobian_weight > 0 is not supported with train.strategy=fsdp (it calls "
                             "the step outside forward); use train.strategy=ddp")

        # -- optimisation -----------------------------------------------------------------------
        self.optimizer = build_optimizer(
            self.model, tc.lr, tc.weight_decay, tuple(tc.betas), tc.eps, tc.decay_embeddings
        )
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.ema = EMA(self.model, tc.ema, tc.ema_warmup) if tc.ema > 0 else None

        # -- data order and curriculum ----------------------------------------------------------
        self.curriculum: Curriculum | None = None
        cc = dc.curriculum
        if cc.enabled:
            self.curriculum = Curriculum(self.train_data.difficulty, cc.start, cc.step, cc.max_level, cc.threshold)
        self.stream = IndexStream(
            len(self.train_data), config.seed, self.curriculum.eligible() if self.curriculum else None
        )
        self.carry: Carry | None = None

        # -- bookkeeping ------------------------------------------------------------------------
        self.step = 0
        self.elapsed_before = 0.0  # wall time spent before a resume
        self.run_dir = Path(config.out_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.last_checkpoint: Path | None = None
        self.resumed_from: Path | None = None
        self.last_metrics: dict[str, Any] = {}
        self.last_eval: dict[str, Any] = {}
        self._resume()

    # ------------------------------------------------------------------------------------------
    # construction helpers
    # ------------------------------------------------------------------------------------------
    def _dataset(self, split: str) -> TokenDataset | None:
        if self.task is None:
            if split == "train":
                raise ValueError("no training data: pass train_data or a task")
            return None
        dataset = load_split(self.task, self.config.data, split)
        if dataset is None and split == "train":
            raise ValueError(f"the training set is empty: data.train_size=0 asks for all rows, but task "
                             f"{self.task.name!r} generates rows on demand; set data.train_size > 0")
        return dataset

    def _task_defaults(self) -> dict[str, Any]:
        """Model fields the task determines, used where the recipe leaves them unset."""
        out: dict[str, Any] = {}
        task = self.task
        if task is not None:
            if task.vocab_size:
                out["vocab_size"] = int(task.vocab_size)
            out["causal"] = bool(task.causal)
            out["num_puzzle_ids"] = int(getattr(task, "num_puzzle_ids", 0) or 0)
            grid = getattr(task, "grid", None)
            size = getattr(task, "size", None)
            if grid is None and isinstance(size, int) and task.seq_len == size * size:
                grid = (size, size)
            if grid is not None:
                out["grid"] = tuple(grid)
        out["seq_len"] = int(self.train_data.inputs.shape[1])
        if "vocab_size" not in out:
            out["vocab_size"] = int(max(self.train_data.inputs.max(), self.train_data.labels.max()) + 1)
        return out

    def _build_model(self) -> LoopedModel:
        from loopformer.models.registry import build_model, model_classes

        _, config_cls = model_classes(self.config.model.name)
        valid = {f.name for f in dataclasses.fields(config_cls)}
        defaults = {k: v for k, v in self._task_defaults().items() if k in valid}
        model_config = self.config.model_config(**defaults)
        # the run folder records the fully resolved model config
        self.config.model.fields = {
            f.name: to_dict(getattr(model_config, f.name)) for f in dataclasses.fields(model_config)
        }
        return build_model(self.config.model.name, config=model_config)

    def _loop_sampler(self) -> Any:
        """The simple-mode loop-count sampler; None for ``train.loop_sampler: none`` (loop_train as is)."""
        tc = self.config.train
        if tc.loop_sampler == "none":
            return None
        options = dict(tc.loop_sampler_options)
        if tc.loop_sampler == "fixed":
            options.setdefault("n", self.loop_train.max_steps)
        else:
            options.setdefault("seed", self.config.seed)
        return make_sampler(tc.loop_sampler, **options)

    # ------------------------------------------------------------------------------------------
    # checkpoints and resume
    # ------------------------------------------------------------------------------------------
    def training_state(self) -> dict[str, Any]:
        return {
            # FSDP: full tensors keyed by parameter name (torch.distributed.checkpoint's layout)
            "optimizer": dist.fsdp_optimizer_state(self.model, self.optimizer) if self.fsdp
            else self.optimizer.state_dict(),
            "optimizer_layout": "fsdp_full" if self.fsdp else "torch",
            "stream": self.stream.state_dict(),
            "curriculum": self.curriculum.state_dict() if self.curriculum else None,
            "carry": self._global_carry_state(),
            "rng": rng_state(),
            "elapsed": self.elapsed_before + self._elapsed(),
        }

    def _global_carry_state(self) -> dict[str, Any] | None:
        """The carry of all ranks as one (rank order = slot order of a single-process run)."""
        if self.carry is None:
            return None
        state = self.carry.state_dict()
        if not self.dist_env.enabled:
            return state
        return {k: dist.all_gather_rows(v) for k, v in state.items()}

    def save(self) -> Path:
        """Checkpoint the current step (atomic; keeps the newest ``train.keep_checkpoints``).

        Under torchrun every rank must call it (the carry is gathered); only rank 0 writes.
        """
        training_state = self.training_state()
        ema_state = self.ema.state_dict() if self.ema else None
        weights = None
        if self.fsdp:  # gather the shards (every rank takes part); rank 0 writes plain tensors
            weights = dist.full_state(self.model.state_dict())
            ema_state = dist.full_state(ema_state) if ema_state is not None else None
        if self.dist_env.is_main:
            self.last_checkpoint = save_checkpoint(
                self.ckpt_dir,
                self.step,
                self.model,
                self.config,
                ema_state=ema_state,
                training_state=training_state,
                keep=self.config.train.keep_checkpoints,
                weights=weights,
            )
        else:
            self.last_checkpoint = self.ckpt_dir / f"step_{self.step:08d}"
        dist.barrier()
        return self.last_checkpoint

    def _resume(self) -> None:
        resume = self.config.train.resume
        if resume is False or resume == "":
            return
        if resume is True:
            folder = latest_checkpoint(self.ckpt_dir)
            if folder is None:
                log.info("resume: no checkpoint in %s, starting from scratch", self.ckpt_dir)
                return
        else:
            from loopformer.train.checkpoint import resolve_checkpoint

            folder = resolve_checkpoint(resume)
        self.load(folder)

    def load(self, folder: Path) -> None:
        """Restore weights, EMA, optimiser, data stream, curriculum, carry and RNG from ``folder``."""
        if self.fsdp:  # full tensors from the file, re-sharded like the live parameters
            weights = load_weights(folder / "model.safetensors")
            check_weights(weights, self.model, str(folder / "model.safetensors"))
            with torch.no_grad():
                for name, t in self.model.state_dict().items():
                    t.copy_(dist.like(t, weights[name]))
        else:
            load_weights_into(self.model, folder / "model.safetensors")
        state = load_training_state(folder)
        if self.ema is not None:
            if not (folder / "ema.safetensors").is_file():
                raise CheckpointError(f"{folder} has no ema.safetensors but this run keeps an EMA (train.ema > 0)")
            ema = load_weights(folder / "ema.safetensors")
            if self.fsdp:
                ema = {k: dist.like(self.ema.shadow[k], v) if k in self.ema.shadow else v for k, v in ema.items()}
            self.ema.load_state_dict(ema)
        layout = state.get("optimizer_layout", "torch")
        if layout != ("fsdp_full" if self.fsdp else "torch"):
            raise CheckpointError(
                f"{folder} holds {'an FSDP' if layout == 'fsdp_full' else 'a DDP / single-process'} optimizer state; "
                f"resume it with train.strategy={'fsdp' if layout == 'fsdp_full' else 'ddp'}"
            )
        try:
            if self.fsdp:
                dist.load_fsdp_optimizer_state(self.model, self.optimizer, state["optimizer"])
            else:
                self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError) as err:
            raise CheckpointError(f"optimizer state in {folder} does not fit this model: {err}") from None
        if self.curriculum is not None and state.get("curriculum"):
            self.curriculum.load_state_dict(state["curriculum"])
            self.stream.set_eligible(self.curriculum.eligible())
        self.stream.load_state_dict(state["stream"])
        carry = state.get("carry")
        if carry and len(carry["index"]) != self.config.train.batch_size:
            raise CheckpointError(
                f"{folder} carries {len(carry['index'])} deep-supervision slots but train.batch_size is "
                f"{self.config.train.batch_size}; resume with the batch size the run was started with"
            )
        if carry and self.dist_env.enabled:  # the saved carry is global: take this rank's slots
            carry = {k: None if v is None else dist.shard(v) for k, v in carry.items()}
        self.carry = Carry.from_state(carry, self.device) if carry else None
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.elapsed_before = float(state.get("elapsed", 0.0))
        self.resumed_from = folder
        self.last_checkpoint = folder
        log.info("resumed from %s at step %d", folder, self.step)

    # ------------------------------------------------------------------------------------------
    # one optimiser step
    # ------------------------------------------------------------------------------------------
    def _generator(self, step: int, salt: int) -> torch.Generator:
        """Seeded by (seed, step, salt), plus the rank under torchrun (independent draws per rank)."""
        rank = self.dist_env.rank if self.dist_env.enabled else None
        return torch.Generator(device=self.device).manual_seed(_seed_for(self.config.seed, step, salt, rank))

    def _fresh_states(self, inputs: Tensor, puzzle_ids: Tensor | None, step: int) -> Tensor:
        with torch.no_grad(), autocast(self.device, self.config.bf16), dist.gathered(self.model):
            ctx = self.model.embed(inputs, puzzle_ids)
            return self.model.init_state(ctx, self._generator(step, _SALT_INIT)).detach()

    def _refill(self) -> None:
        """Deep supervision: give halted (or all, at the start) slots new examples and fresh states."""
        B = self.config.train.batch_size // self.dist_env.world_size  # this rank's slots
        if self.carry is None:
            batch = make_batch(self.train_data, dist.shard(self.stream.take(self.config.train.batch_size)), self.device)
            self.carry = Carry(
                index=batch.index,
                inputs=batch.inputs,
                labels=batch.labels,
                puzzle_ids=batch.puzzle_ids,
                state=self._fresh_states(batch.inputs, batch.puzzle_ids, self.step),
                segments=torch.zeros(B, dtype=torch.long),
                halted=torch.zeros(B, dtype=torch.bool),
            )
            return
        c = self.carry
        rows = torch.nonzero(c.halted).reshape(-1)
        # the stream is global: draw every rank's halted slots, in rank order, and keep this rank's
        counts = dist.all_gather_counts(int(rows.numel()))
        drawn = self.stream.take(sum(counts))
        first = sum(counts[: self.dist_env.rank])
        if rows.numel() == 0:
            return
        new = make_batch(self.train_data, drawn[first : first + int(rows.numel())], self.device)
        dev_rows = rows.to(self.device)
        c.index = c.index.clone()
        c.index[rows] = new.index
        c.inputs = c.inputs.index_copy(0, dev_rows, new.inputs)
        c.labels = c.labels.index_copy(0, dev_rows, new.labels)
        if c.puzzle_ids is not None and new.puzzle_ids is not None:
            c.puzzle_ids = c.puzzle_ids.index_copy(0, dev_rows, new.puzzle_ids)
        fresh = self._fresh_states(new.inputs, new.puzzle_ids, self.step)
        c.state = c.state.index_copy(0, dev_rows, fresh.to(c.state.dtype))
        c.segments = c.segments.clone()
        c.segments[rows] = 0
        c.halted = torch.zeros_like(c.halted)

    def _loss(self, out: ModelOutput, batch_inputs: Tensor, labels: Tensor, puzzle_ids: Tensor | None) -> tuple:
        tc = self.config.train
        task_loss = sequence_loss(out.logits, labels, tc.loss)
        acc = accuracy(out.logits, labels)
        parts = {"task_loss": task_loss}
        total = task_loss
        if out.q_logits is not None and tc.q_loss_weight > 0:
            parts["q_loss"] = q_halt_loss(out.q_logits, acc.exact)
            total = total + tc.q_loss_weight * parts["q_loss"]
        if out.aux_loss is not None and tc.ponder_weight > 0:
            parts["ponder"] = out.aux_loss.float()
            total = total + tc.ponder_weight * parts["ponder"]
        if tc.jacobian_weight > 0:
            with autocast(self.device, self.config.bf16):
                ctx = self.model.embed(batch_inputs, puzzle_ids)
                parts["jacobian"] = jacobian_frobenius(
                    self.model.step, out.state, ctx, self._generator(self.step, _SALT_JAC)
                )
            total = total + tc.jacobian_weight * parts["jacobian"]
        return total, parts, acc

    def _check(self, quantity: str, value: float, limit: float | None = None) -> None:
        if not math.isfinite(value) or (limit is not None and value > limit):
            self.optimizer.zero_grad(set_to_none=True)
            self._write_metrics({"step": self.step, "diverged": quantity, "value": value})
            raise TrainingDivergedError(self.step, quantity, value, self.last_checkpoint)

    def train_step(self) -> dict[str, Any]:
        """One optimiser step (one segment in deep supervision); returns its metrics."""
        tc = self.config.train
        self.model.train()
        lr = lr_at(self.step, tc.lr, tc.warmup_steps, tc.steps, tc.schedule, tc.min_lr_ratio)
        set_lr(self.optimizer, lr)
        if tc.mode == "simple":
            batch = make_batch(self.train_data, dist.shard(self.stream.take(tc.batch_size)), self.device)
            loop, R = self._simple_loop(self.step)
            inputs, labels, puzzle_ids, state = batch.inputs, batch.labels, batch.puzzle_ids, None
        elif tc.mode == "deep_supervision":
            self._refill()
            c = self.carry
            loop = self.loop_train
            inputs, labels, puzzle_ids, state = c.inputs, c.labels, c.puzzle_ids, c.state
        else:
            raise ValueError(f"unknown train.mode {tc.mode!r}")

        lockstep = dist.LockstepHalting(self.sync_halting)
        with autocast(self.device, self.config.bf16):
            out = self.forward_model(
                inputs, loop=loop, state=state, puzzle_ids=puzzle_ids, generator=self._generator(self.step, _SALT_INIT),
                callback=lockstep.callback if lockstep.enabled else None,
            )
        lockstep.drain()
        loss, parts, acc = self._loss(out, inputs, labels, puzzle_ids)
        state_rms = float(out.state.detach().float().pow(2).flatten(1).mean(1).sqrt().mean())
        # every rank takes the same divergence decision (a NaN on one rank reaches all)
        checked = dist.all_reduce_mean({"loss": float(loss.detach()), "state_norm": state_rms})
        self._check("loss", checked["loss"], tc.max_loss)
        self._check("state norm", checked["state_norm"], tc.max_state_norm)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = (dist.clip_grad_norm if self.fsdp else clip_grad_norm)(self.params, tc.grad_clip)
        self._check("gradient norm", grad_norm)
        self.optimizer.step()
        if self.ema is not None:
            self.ema.update(self.model, self.step)

        metrics: dict[str, Any] = {
            "step": self.step + 1,
            "loss": float(loss.detach()),
            **{k: float(v.detach()) for k, v in parts.items()},
            "token_acc": acc.token_acc,
            "exact_acc": acc.exact_acc,
            "lr": lr,
            "grad_norm": grad_norm,
            "state_norm": state_rms,
        }
        if out.loop is not None:
            metrics["loop_steps"] = float(out.loop.steps.float().mean())
            if out.loop.residuals is not None and out.loop.residuals.numel():
                metrics["residual"] = float(torch.nanmean(_last_finite(out.loop.residuals.detach().float())))
            metrics["converged"] = float(out.loop.converged.float().mean())
        if tc.mode == "simple":
            if R is not None:
                metrics["loops"] = R
        else:
            self._advance_carry(out)
            metrics["segments"] = float(self.carry.segments.float().mean())
            metrics["halted"] = int(self.carry.halted.sum())
        if self.curriculum is not None:
            metrics["level"] = self.curriculum.level
        return self._reduce_metrics(metrics) if self.dist_env.enabled else metrics

    def _simple_loop(self, step: int) -> tuple[LoopConfig, int | None]:
        """Simple mode: the training loop with ``R`` steps drawn for ``step`` (same on every rank).

        With ``train.loop_sampler: none`` the training loop is used as configured (its halting rule
        and ``max_steps``, e.g. an Attractor's solve to tolerance) and ``R`` is None.
        """
        if self.sampler is None:
            return self.loop_train, None
        R = int(self.sampler.sample(step))
        halting = "act" if self.loop_train.halting == "act" else "fixed"
        loop = dataclasses.replace(
            self.loop_train, max_steps=R, min_steps=min(self.loop_train.min_steps, R), halting=halting
        )
        return loop, R

    def _reduce_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Per-rank metrics -> their mean over ranks ("halted": the total); shared values kept."""
        shared = ("step", "lr", "grad_norm", "loops", "level")
        keys = [k for k, v in metrics.items()
                if k not in shared and isinstance(v, int | float) and not isinstance(v, bool)]
        mean = dist.all_reduce_mean({k: metrics[k] for k in keys})
        out = {**metrics, **mean}
        if "halted" in out:
            out["halted"] = int(round(mean["halted"] * self.dist_env.world_size))
        return out

    def probe_unused_parameters(self, rows: int = 2) -> list[str]:
        """Parameters that one training forward / backward of the real loss leaves without gradient.

        Uses the first ``rows`` training examples, the training loop of step 0 and (deep
        supervision) fresh initial states; the RNG, the data stream and every ``.grad`` are left as
        they were. A non-empty answer makes DDP run with ``find_unused_parameters=True``.
        """
        tc = self.config.train
        batch = make_batch(self.train_data, np.arange(min(rows, len(self.train_data))), self.device)
        loop = self._simple_loop(0)[0] if tc.mode == "simple" else self.loop_train
        state = self._fresh_states(batch.inputs, batch.puzzle_ids, 0) if tc.mode == "deep_supervision" else None

        def loss_of() -> Tensor:
            with autocast(self.device, self.config.bf16):
                out = self.model(batch.inputs, loop=loop, state=state, puzzle_ids=batch.puzzle_ids,
                                 generator=self._generator(0, _SALT_INIT))
            return self._loss(out, batch.inputs, batch.labels, batch.puzzle_ids)[0]

        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            return dist.unused_parameters(self.model, loss_of)

    def _advance_carry(self, out: ModelOutput) -> None:
        tc = self.config.train
        c = self.carry
        c.state = out.state.detach()
        c.segments = c.segments + 1
        halted = c.segments >= tc.max_segments
        if tc.halt_on_q and out.q_logits is not None:
            q_halt = (out.q_logits.detach().float().reshape(-1) > 0).cpu()
            if tc.halt_exploration > 0:
                # drawn for the global batch and sharded: the same draws as one process would make
                g = torch.Generator().manual_seed(_seed_for(self.config.seed, self.step, _SALT_EXPLORE))
                n_global = len(c.segments) * self.dist_env.world_size
                explore = dist.shard(torch.rand(n_global, generator=g) < tc.halt_exploration)
                min_segments = dist.shard(torch.randint(2, tc.max_segments + 1, (n_global,), generator=g))
                q_halt = q_halt & (c.segments >= torch.where(explore, min_segments, torch.zeros_like(min_segments)))
            halted = halted | q_halt
        if tc.halt_on_converged and out.loop is not None:
            halted = halted | out.loop.converged.detach().cpu().reshape(-1)
        c.halted = halted

    # ------------------------------------------------------------------------------------------
    # evaluation
    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def exact_eval(self, dataset: TokenDataset, rows: np.ndarray | None = None, loop: LoopConfig | None = None) -> dict:
        """Label-based accuracy of the current weights: token_acc, exact_acc, loop_steps, n.

        Runs ``eval.segments`` chained forward calls (the state carried), as TRM / HRM evaluate.
        Under DDP each rank evaluates its share of the rows and the counts are summed over ranks
        (FSDP: every rank evaluates all rows, since each forward gathers the weights on all ranks).
        With ``train.sync_halting`` every forward ends on the same global loop count on all ranks.
        """
        ec = self.config.eval
        loop = loop or self.loop_eval
        rows = np.arange(len(dataset)) if rows is None else np.asarray(rows)
        if ec.max_examples:
            rows = rows[: ec.max_examples]
        sharded = dist.is_distributed() and not dist.is_fsdp(self.model)
        local = rows[dist.eval_shard(len(rows))] if sharded else rows
        segments = max(1, ec.segments)
        lockstep = dist.LockstepHalting(self.sync_halting)
        n_batches = math.ceil(len(local) / ec.batch_size)
        if lockstep.enabled:  # a rank with fewer batches answers the others' lockstep all-reduces
            n_batches = int(dist.all_reduce_max(n_batches))
        was_training = self.model.training
        self.model.eval()
        generator = torch.Generator(device=self.device).manual_seed(self.config.seed)
        right = count = exact = steps = 0.0
        try:
            for start in range(0, n_batches * ec.batch_size, ec.batch_size):
                if start >= len(local):
                    for _ in range(segments):
                        lockstep.drain()
                    continue
                b: Batch = make_batch(dataset, local[start : start + ec.batch_size], self.device)
                state = None
                seg_steps = torch.zeros(len(b.index))
                for _ in range(segments):
                    with autocast(self.device, self.config.bf16):
                        out = self.model(
                            b.inputs, loop=loop, state=state, puzzle_ids=b.puzzle_ids, generator=generator,
                            callback=lockstep.callback if lockstep.enabled else None,
                        )
                    lockstep.drain()
                    state = out.state
                    if out.loop is not None:
                        seg_steps += out.loop.steps.float().cpu()
                acc = accuracy(out.logits, b.labels)
                right += float(acc.token_correct.sum())
                count += float(acc.token_count.sum())
                exact += float(acc.exact.sum())
                steps += float(seg_steps.sum())
        finally:
            self.model.train(was_training)
        if sharded:
            right, count, exact, steps = dist.all_reduce_sum([right, count, exact, steps])
        n = len(rows)
        return {
            "n": n,
            "token_acc": right / max(count, 1.0),
            "exact_acc": exact / max(n, 1),
            "loop_steps": steps / max(n, 1),
        }

    def evaluate(self) -> dict[str, Any]:
        """Evaluate on the held-out set (EMA weights when ``eval.use_ema`` and an EMA exists)."""
        if self.eval_data is None or len(self.eval_data) == 0:
            return {}
        ec = self.config.eval
        use_ema = self.ema is not None and ec.use_ema
        ctx = self.ema.applied(self.model) if use_ema else contextlib.nullcontext()
        with ctx:
            if self.task is not None and ec.segments <= 1 and (ec.check or not self.has_validator):
                # under DDP rank 0 evaluates and shares the result; under FSDP all ranks run it
                one_rank = dist.is_distributed() and not dist.is_fsdp(self.model)
                result = self._task_eval() if self.dist_env.is_main or not one_rank else None
                if one_rank:
                    result = dist.broadcast_object(result)
            else:
                result = self.exact_eval(self.eval_data)
        result["weights"] = "ema" if use_ema else "model"
        return result

    def _task_eval(self) -> dict[str, Any]:
        """``loopformer.eval.evaluate`` on the held-out set (the task's own validator); a task without
        a validator (text) gets ``evaluate_lm``: loss (nats per token) and bits per byte."""
        from loopformer.eval.evaluate import evaluate, evaluate_lm

        ec = self.config.eval
        data = self.eval_data
        if ec.max_examples:
            data = data.subset(slice(0, ec.max_examples))
        if not self.has_validator:
            lm = evaluate_lm(self.model, self.task, data, loop=self.loop_eval, batch_size=ec.batch_size,
                             device=self.device, seed=self.config.seed)
            return {"n": lm.n, "loss": lm.loss, "bits_per_byte": lm.bits_per_byte, "token_acc": lm.token_accuracy,
                    "exact_acc": lm.exact_accuracy, "loop_steps": lm.mean_steps}
        res = evaluate(
            self.model, self.task, data, loop=self.loop_eval, batch_size=ec.batch_size,
            device=self.device, seed=self.config.seed,
        )
        return {
            "n": res.n,
            "token_acc": res.token_accuracy,
            "exact_acc": res.exact_accuracy,
            "valid_acc": res.valid_accuracy,
            "loop_steps": res.mean_steps,
            "converged": res.converged_fraction,
        }

    def _curriculum_check(self) -> None:
        cur, cc = self.curriculum, self.config.data.curriculum
        dataset = None
        if cc.source == "eval" and self.eval_data is not None:
            rows = cur.current_rows(self.eval_data.difficulty)
            dataset = self.eval_data if len(rows) else None
        if dataset is None:
            dataset = self.train_data
            rows = cur.current_rows(self.train_data.difficulty)
            if len(rows) == 0:
                rows = cur.eligible()
        if len(rows) > cc.sample:
            rng = np.random.default_rng([self.config.seed, self.step, _SALT_CURRICULUM])
            rows = np.sort(rng.choice(rows, size=cc.sample, replace=False))
        acc = self.exact_eval(dataset, rows)["exact_acc"]
        if cur.update(acc, self.step):
            self.stream.set_eligible(cur.eligible())
            log.info("curriculum: level %s passed (%.3f), now training up to %s", cur.level - cur.step, acc, cur.level)

    # ------------------------------------------------------------------------------------------
    # the loop
    # ------------------------------------------------------------------------------------------
    def _elapsed(self) -> float:
        return time.perf_counter() - self._t0 if hasattr(self, "_t0") else 0.0

    def _write_metrics(self, record: dict[str, Any]) -> None:
        if not self.dist_env.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")
        if getattr(self, "_tb", None) is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, record.get("step", self.step))

    def _prepare_run_dir(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(self.config, self.run_dir)
        metrics = self.run_dir / "metrics.jsonl"
        if self.resumed_from is not None and metrics.is_file():  # drop lines the killed run wrote after it
            kept = [
                line for line in metrics.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= self.step
            ]
            metrics.write_text("".join(line + "\n" for line in kept))
        elif self.resumed_from is None:  # a fresh run owns its folder: no stale metrics or checkpoints
            if metrics.is_file():
                metrics.unlink()
            stale = step_dirs(self.ckpt_dir)
            if stale:
                log.warning("fresh run in %s: removing %d old checkpoints (use train.resume=true to continue)",
                            self.run_dir, len(stale))
            for folder in stale:
                shutil.rmtree(folder)
            (self.ckpt_dir / "latest").unlink(missing_ok=True)
        self._tb = None
        if self.config.train.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                log.warning("train.tensorboard is on but tensorboard is not installed (pip install tensorboard)")
            else:
                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def fit(self) -> dict[str, Any]:
        """Train to ``train.steps`` optimiser steps (continuing a resumed run); returns a summary."""
        tc = self.config.train
        if self.dist_env.is_main:
            self._prepare_run_dir()
        else:
            self._tb = None
        dist.barrier()  # rank 0 has cleared a fresh run's folder before anyone writes to it
        self._t0 = time.perf_counter()
        progress = _progress_bar(tc.progress and self.dist_env.is_main, tc.steps, self.step)
        try:
            with progress as bar:
                task_id = bar.add_task("train", total=tc.steps, completed=self.step, info="") if bar else None
                while self.step < tc.steps:
                    metrics = self.train_step()
                    self.step += 1
                    metrics["time"] = round(self.elapsed_before + self._elapsed(), 3)
                    self.last_metrics = metrics
                    if self.step % tc.log_every == 0 or self.step == tc.steps:
                        self._write_metrics(metrics)
                    cc = self.config.data.curriculum
                    if self.curriculum is not None and not self.curriculum.done and self.step % cc.check_every == 0:
                        self._curriculum_check()
                    if tc.eval_every and self.step % tc.eval_every == 0 and self.step < tc.steps:
                        self.last_eval = self.evaluate()
                        self._write_metrics({"step": self.step, **{f"eval_{k}": v for k, v in self.last_eval.items()}})
                    if tc.checkpoint_every and self.step % tc.checkpoint_every == 0 and self.step < tc.steps:
                        self.save()
                    if bar:
                        bar.update(task_id, completed=self.step, info=_bar_info(metrics))
            self.save()  # before the final evaluation: an evaluation error never loses the trained weights
            self.last_eval = self.evaluate()
            if self.last_eval:
                self._write_metrics({"step": self.step, **{f"eval_{k}": v for k, v in self.last_eval.items()}})
        finally:
            if getattr(self, "_tb", None) is not None:
                self._tb.close()
            if self._owns_group:  # the process group this trainer created (torchrun) ends with the run
                dist.shutdown()
                self._owns_group = False
        summary = {
            "steps": self.step,
            "run_dir": str(self.run_dir),
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "train": self.last_metrics,
            "eval": self.last_eval,
            "curriculum_level": self.curriculum.level if self.curriculum else None,
            "wall_time": round(self.elapsed_before + self._elapsed(), 3),
            "parameters": self.model.num_parameters() if hasattr(self.model, "num_parameters") else None,
        }
        if self.dist_env.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def _bar_info(m: dict[str, Any]) -> str:
    parts = [f"loss {m['loss']:.4f}", f"acc {m['token_acc']:.3f}/{m['exact_acc']:.3f}"]
    if "loop_steps" in m:
        parts.append(f"loops {m['loop_steps']:.1f}")
    if "level" in m:
        parts.append(f"level {m['level']:g}")
    return "  ".join(parts)


def _progress_bar(enabled: bool, total: int, start: int) -> Any:
    if not enabled:
        return _NoBar()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
    )


class _NoBar:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
