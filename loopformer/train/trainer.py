"""The trainer: simple looped training and deep supervision, with exact resume.

Two modes (``train.mode``):

- ``simple`` (Loop, Think & Generalize, arXiv 2604.07822): every step draws a fresh batch,
  a loop count ``R`` from ``loopformer.loop.make_sampler`` seeded by the global step (fixed,
  Poisson(4) clipped to [2, 8], log-normal Poisson), runs one forward with ``max_steps = R``
  and fixed halting (an ACT model keeps its learned halting with ``R`` as the cap), and steps.
  ``train.loop_sampler: none`` runs the training loop as configured instead (its own halting,
  e.g. an Attractor's Anderson solve to tolerance, capped at ``loop_train.max_steps``).
- ``deep_supervision`` (TRM / HRM / FPRM, arXiv 2606.18206; TRM arXiv 2510.04871, HRM arXiv 2506.21734): each optimiser step
  runs ONE segment on a carried batch of slots (``loopformer.train.carry``), takes the loss on
  that segment's output (plus the Q-head BCE against "the answer is exactly right"), steps,
  carries the detached state and replaces halted slots.

Around both: CPU float32 (flush denormals, one thread per physical core) or CUDA with bf16
autocast (``bf16``), optionally a ``torch.compile``d step; warm-up + constant / cosine lr, clipping, EMA, the difficulty curriculum, periodic
evaluation (``loopformer.eval.evaluate`` when a task is known, loss and bits per byte for a task
without a validator such as text, else exact-match on the labels; the final checkpoint is written first),
metrics as JSONL (+ optional TensorBoard), a rich progress bar (``loopformer.train.metrics``), divergence detection
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
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from loopformer.config import RunConfig
from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel, ModelOutput
from loopformer.nn import autocast
from loopformer.tasks.base import Task, TokenDataset
from loopformer.train import dist
from loopformer.train.carry import (
    SALT_CURRICULUM,
    SALT_INIT,
    SALT_JAC,
    Carry,
    advance_carry,
    carry_from_checkpoint,
    global_carry_state,
    refill_carry,
    seed_for,
)
from loopformer.train.checkpoint import (
    CheckpointError,
    check_weights,
    latest_good_checkpoint,
    load_training_state,
    load_weights,
    load_weights_into,
    nonfinite_tensors,
    quarantine_after,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from loopformer.train.data import Curriculum, IndexStream, make_batch
from loopformer.train.losses import (
    accuracy,
    jacobian_frobenius,
    q_halt_loss,
    q_learning_losses,
    sequence_loss,
)
from loopformer.train.metrics import (
    bar_info,
    exact_eval,
    last_finite,
    prepare_run_dir,
    progress_bar,
    reduce_metrics,
    task_eval,
    write_metrics,
)
from loopformer.train.optim import EMA, build_optimizer, clip_grad_norm, lr_at, set_lr
from loopformer.train.run_folder import RunFolder
from loopformer.train.setup import build_run_model, loop_sampler, physical_cores, resolve_device, task_dataset

log = logging.getLogger("loopformer.train")


class TrainingDivergedError(RuntimeError):
    """Training produced a non-finite or exploding quantity; no update was applied for that step."""

    def __init__(self, step: int, quantity: str, value: float, checkpoint: Path | None) -> None:
        where = f"; the last good checkpoint is {checkpoint}" if checkpoint else "; no checkpoint was written"
        super().__init__(f"training diverged at step {step}: {quantity} = {value}{where}")
        self.step, self.quantity, self.value, self.checkpoint = step, quantity, value, checkpoint


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
        self.train_data = train_data if train_data is not None else task_dataset(self.task, dc, "train")
        self.eval_data = eval_data if eval_data is not None else task_dataset(self.task, dc, "eval")
        if len(self.train_data) == 0:
            raise ValueError("the training set is empty")
        # decided once: a task whose check raises NotImplementedError (text) is scored by loss / bits per byte

        self.has_validator = self.task is None or self.task.has_validator

        # -- model ------------------------------------------------------------------------------
        if model is None:
            model = build_run_model(self.config, self.task, self.train_data)
        self.model = model.to(self.device)
        if config.compile:  # compile the looped body (the hot path); the engine's loop stays eager
            self.model.step = torch.compile(self.model.step)  # type: ignore[method-assign]
        self.loop_train: LoopConfig = config.loop_config(self.model.config.loop, "train")
        self.loop_eval: LoopConfig = config.loop_config(self.model.config.loop, "eval")
        self.sampler = loop_sampler(tc, self.loop_train, config.seed)

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
        puzzle = (tc.puzzle_emb_lr, tc.puzzle_emb_weight_decay) if tc.puzzle_emb_optimizer == "sign_sgd" else None
        self.optimizer = build_optimizer(self.model, tc.lr, tc.weight_decay, tuple(tc.betas), tc.eps,
                                         tc.decay_embeddings, tc.optimizer, tc.decay_all, puzzle)
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
        # lock the folder; a fresh run never destroys a previous one (loopformer.train.run_folder)
        self.folder = RunFolder(self.run_dir, bool(tc.resume), tc.overwrite, self.dist_env.is_main)
        self.run_dir, self.ckpt_dir = self.folder.write_dir, self.folder.write_dir / "checkpoints"
        try:
            self._resume()
        except BaseException:
            self.folder.close()
            raise

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
            "carry": global_carry_state(self.carry, self.dist_env.enabled),
            "rng": rng_state(),
            "elapsed": self.elapsed_before + self._elapsed(),
        }

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
        bad = nonfinite_tensors(weights if weights is not None else self.model.state_dict())
        if bad:  # never write (or call good) a checkpoint of blown-up weights
            self._diverged("weights", float("nan"), f"non-finite parameter {bad[0]!r}")
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
        if self.folder.staging is not None:  # --overwrite: the old run is moved aside only now
            self.folder.complete_overwrite()
            self.run_dir, self.ckpt_dir = self.folder.write_dir, self.folder.write_dir / "checkpoints"
            self.last_checkpoint = self.ckpt_dir / self.last_checkpoint.name
        dist.barrier()
        return self.last_checkpoint

    def _resume(self) -> None:
        resume = self.config.train.resume
        if resume is False or resume == "":
            return
        if resume is True:
            folder, skipped = latest_good_checkpoint(self.ckpt_dir)
            for reason in skipped:
                log.warning("resume: skipped %s", reason)
            if folder is None:
                log.info("resume: no usable checkpoint in %s, starting from scratch", self.ckpt_dir)
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
        self.carry = carry_from_checkpoint(state.get("carry"), self.config.train.batch_size, folder,
                                           self.dist_env.enabled, self.device)
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
        return torch.Generator(device=self.device).manual_seed(seed_for(self.config.seed, step, salt, rank))

    def _fresh_states(self, inputs: Tensor, puzzle_ids: Tensor | None, step: int) -> Tensor:
        with torch.no_grad(), autocast(self.device, self.config.bf16), dist.gathered(self.model):
            ctx = self.model.embed(inputs, puzzle_ids)
            return self.model.init_state(ctx, self._generator(step, SALT_INIT)).detach()

    def _refill(self) -> None:
        """Deep supervision: give halted (or all, at the start) slots new examples and fresh states."""
        self.carry = refill_carry(
            self.carry, self.train_data, self.stream.take,
            lambda inputs, puzzle_ids: self._fresh_states(inputs, puzzle_ids, self.step),
            self.config.train.batch_size, self.dist_env.world_size, self.dist_env.rank, self.device,
        )

    def _loss(self, out: ModelOutput, batch_inputs: Tensor, labels: Tensor, puzzle_ids: Tensor | None) -> tuple:
        tc = self.config.train
        task_loss = sequence_loss(out.logits, labels, tc.loss)
        acc = accuracy(out.logits, labels)
        parts = {"task_loss": task_loss}
        total = task_loss
        if out.q_logits is not None and tc.q_loss_weight > 0 and not tc.q_learning:
            parts["q_loss"] = q_halt_loss(out.q_logits, acc.exact)
            total = total + tc.q_loss_weight * parts["q_loss"]
        if out.aux_loss is not None and tc.ponder_weight > 0:
            parts["ponder"] = out.aux_loss.float()
            total = total + tc.ponder_weight * parts["ponder"]
        if tc.jacobian_weight > 0:
            with autocast(self.device, self.config.bf16):
                ctx = self.model.embed(batch_inputs, puzzle_ids)
                parts["jacobian"] = jacobian_frobenius(
                    self.model.step, out.state, ctx, self._generator(self.step, SALT_JAC)
                )
            total = total + tc.jacobian_weight * parts["jacobian"]
        return total, parts, acc

    def _q_learning(self, out: ModelOutput, inputs: Tensor, puzzle_ids: Tensor | None, loop: LoopConfig,
                    exact: Tensor, parts: dict) -> Tensor:
        """HRM's Q-learning loss (``losses.q_learning_losses``); the target runs one more segment without
        gradient from this segment's state, as HRM's ACT wrapper does."""
        tc = self.config.train
        q_values = getattr(self.model, "q_values", None)
        if q_values is None:
            raise ValueError(f"train.q_learning needs a model with q_values(); {type(self.model).__name__} has none")
        q = q_values(out.state)
        with torch.no_grad():
            nxt = self.model(inputs, loop=loop, state=out.state.detach(), puzzle_ids=puzzle_ids)
            q_next = q_values(nxt.state)
        is_last = (self.carry.segments + 1 >= tc.max_segments).to(q.device)
        parts["q_loss"], parts["q_continue_loss"] = q_learning_losses(q, q_next, exact, is_last)
        return tc.q_loss_weight * (parts["q_loss"] + parts["q_continue_loss"])

    def _check(self, quantity: str, value: float, limit: float | None = None) -> None:
        if not math.isfinite(value) or (limit is not None and value > limit):
            self._diverged(quantity, value)

    def _diverged(self, quantity: str, value: float, detail: str = "") -> None:
        """Record the failed step (``step`` = the step that was attempted: one record per step) and
        raise, naming the newest checkpoint from before it whose weights are finite."""
        self.optimizer.zero_grad(set_to_none=True)
        self._write_metrics({"step": self.step + 1, "diverged": quantity, "value": value,
                             **({"detail": detail} if detail else {})})
        good = quarantine_after(self.ckpt_dir, self.step) if self.dist_env.is_main else None
        raise TrainingDivergedError(self.step, quantity if not detail else f"{quantity} ({detail})", value, good)

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
                inputs, loop=loop, state=state, puzzle_ids=puzzle_ids, generator=self._generator(self.step, SALT_INIT),
                callback=lockstep.callback if lockstep.enabled else None,
            )
        lockstep.drain()
        loss, parts, acc = self._loss(out, inputs, labels, puzzle_ids)
        if tc.q_learning and tc.mode == "deep_supervision":
            loss = loss + self._q_learning(out, inputs, puzzle_ids, loop, acc.exact, parts)
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
                metrics["residual"] = float(torch.nanmean(last_finite(out.loop.residuals.detach().float())))
            metrics["converged"] = float(out.loop.converged.float().mean())
        if tc.mode == "simple":
            if R is not None:
                metrics["loops"] = R
        else:
            advance_carry(self.carry, out, tc.max_segments, tc.halt_on_q, tc.halt_exploration,
                          tc.halt_on_converged, self.config.seed, self.step, self.dist_env.world_size)
            metrics["segments"] = float(self.carry.segments.float().mean())
            metrics["halted"] = int(self.carry.halted.sum())
        if self.curriculum is not None:
            metrics["level"] = self.curriculum.level
        return reduce_metrics(metrics, self.dist_env.world_size) if self.dist_env.enabled else metrics

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
                                 generator=self._generator(0, SALT_INIT))
            return self._loss(out, batch.inputs, batch.labels, batch.puzzle_ids)[0]

        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            return dist.unused_parameters(self.model, loss_of)

    # ------------------------------------------------------------------------------------------
    # evaluation
    # ------------------------------------------------------------------------------------------
    def exact_eval(self, dataset: TokenDataset, rows: np.ndarray | None = None, loop: LoopConfig | None = None) -> dict:
        """Label-based accuracy of the current weights: token_acc, exact_acc, loop_steps, n
        (``loopformer.train.metrics.exact_eval`` over ``eval.segments`` chained forward calls)."""
        return exact_eval(self.model, dataset, rows, loop or self.loop_eval, self.config.eval, self.device,
                          self.config.seed, self.config.bf16, self.sync_halting)

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
                result = (task_eval(self.model, self.task, self.eval_data, self.has_validator, self.loop_eval, ec,
                                     self.device, self.config.seed)
                          if self.dist_env.is_main or not one_rank else None)
                if one_rank:
                    result = dist.broadcast_object(result)
            else:
                result = self.exact_eval(self.eval_data)
        result["weights"] = "ema" if use_ema else "model"
        return result

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
            rng = np.random.default_rng([self.config.seed, self.step, SALT_CURRICULUM])
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
        write_metrics(self.run_dir, record, getattr(self, "_tb", None), self.step)

    def _prepare_run_dir(self) -> None:
        # a resume that found no checkpoint still drops the metrics its killed predecessor wrote
        resumed = self.resumed_from is not None or bool(self.config.train.resume)
        self._tb = prepare_run_dir(self.config, self.run_dir, self.ckpt_dir, resumed, self.step)

    def _finish(self) -> None:
        """Final checkpoint (before the final evaluation: an evaluation error never loses the trained
        weights), evaluation, and the last step's one metrics record (training + eval)."""
        record = dict(self.last_metrics) if self.last_metrics.get("step") == self.step else {}
        self.save()
        self.last_eval = {}
        try:
            self.last_eval = self.evaluate()
        finally:
            record.update({f"eval_{k}": v for k, v in self.last_eval.items()})
            if record:
                self._write_metrics({"step": self.step, **record})

    def fit(self) -> dict[str, Any]:
        """Train to ``train.steps`` optimiser steps (continuing a resumed run); returns a summary."""
        tc = self.config.train
        if self.dist_env.is_main:
            self._prepare_run_dir()
        else:
            self._tb = None
        dist.barrier()  # rank 0 has cleared a fresh run's folder before anyone writes to it
        self._t0 = time.perf_counter()
        progress = progress_bar(tc.progress and self.dist_env.is_main, tc.steps, self.step)
        try:
            with progress as bar:
                task_id = bar.add_task("train", total=tc.steps, completed=self.step, info="") if bar else None
                while self.step < tc.steps:
                    metrics = self.train_step()
                    self.step += 1
                    metrics["time"] = round(self.elapsed_before + self._elapsed(), 3)
                    self.last_metrics = metrics
                    cc = self.config.data.curriculum
                    if self.curriculum is not None and not self.curriculum.done and self.step % cc.check_every == 0:
                        self._curriculum_check()
                    record = metrics if self.step % tc.log_every == 0 or self.step == tc.steps else {}
                    if tc.eval_every and self.step % tc.eval_every == 0 and self.step < tc.steps:
                        self.last_eval = self.evaluate()  # one metrics record per step: eval joins it
                        record = {**record, "step": self.step, **{f"eval_{k}": v for k, v in self.last_eval.items()}}
                    if record and self.step < tc.steps:
                        self._write_metrics(record)
                    if tc.checkpoint_every and self.step % tc.checkpoint_every == 0 and self.step < tc.steps:
                        self.save()
                    if bar:
                        bar.update(task_id, completed=self.step, info=bar_info(metrics))
            self._finish()
        finally:
            self.folder.close()
            if getattr(self, "_tb", None) is not None:
                self._tb.close()
            if self._owns_group:  # the process group this trainer created (torchrun) ends with the run
                dist.shutdown(sync=sys.exc_info()[0] is None)
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

