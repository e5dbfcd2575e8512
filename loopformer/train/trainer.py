"""The trainer: one optimiser step at a time, in a pluggable training mode and distributed strategy.

``Trainer(config).fit()`` trains ``config``'s model on its task. The pieces it composes, each
behind its own interface:

- the training mode (``train.mode``, ``loopformer.train.modes``): what each step feeds the
  model and what it carries between steps (``simple``: a fresh batch and a step-seeded loop count;
  ``deep_supervision``: one segment on a carried batch of slots; or a registered out-of-tree mode);
- the distributed strategy (``loopformer.train.strategy``): one process, DDP or FSDP2 under
  ``torchrun``, which wraps the model, shards evaluation, reduces metrics and lays out checkpoints;
- seeding (``loopformer.train.seeding``): every random draw is a function of (seed, global step),
  so a resumed run replays exactly;
- checkpoints and resume (``loopformer.train.resume``), the run folder's logs and progress bar
  (``loopformer.train.metrics``), the one evaluation path (``loopformer.eval.evaluate.evaluate``:
  the task's validator, or loss and bits per byte for a task without one such as text).

Around the step: CPU float32 (flush denormals, one thread per physical core) or CUDA with bf16
autocast (``bf16``), optionally a ``torch.compile``d step; warm-up + constant / cosine lr,
clipping, EMA, the difficulty curriculum, periodic evaluation (the final checkpoint is written
before the final evaluation), divergence detection (``TrainingDivergedError`` before the bad
update is applied, the last good checkpoint kept). Under ``torchrun`` every rank runs this same
trainer on its contiguous shard of each global batch; files, progress bars and logs come from rank
0 only; ``fit()`` ends a process group the trainer created itself.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from loopformer.config import RunConfig
from loopformer.devices import set_cpu_threads
from loopformer.loop import LoopConfig
from loopformer.loop.samplers import training_sampler
from loopformer.models.base import LoopedModel, ModelOutput
from loopformer.nn import autocast
from loopformer.runs.best import BestTracker
from loopformer.runs.fingerprint import training_data
from loopformer.runs.folder import RunFolder
from loopformer.tasks.base import Task, TokenDataset
from loopformer.train import accumulate, dist, resume
from loopformer.train.data import Batch, make_batch, make_stream
from loopformer.train.evaluation import TrainerEvaluation
from loopformer.train.losses import (
    accuracy,
    jacobian_frobenius,
    q_halt_loss,
    q_learning_losses,
    sequence_loss,
    wide,
)
from loopformer.train.metrics import RunLog
from loopformer.train.modes import SegmentBatch, TrainingMode, make_training_mode
from loopformer.train.optim import EMA, set_lr
from loopformer.train.progress import TrainProgress
from loopformer.train.seeding import SALT_INIT, SALT_JAC, seed_everything, step_generator
from loopformer.train.setup import (
    build_data,
    compile_on,
    configure_process,
    fast_cuda_settings,
    lr_for,
    make_curriculum,
    make_optimizer,
    prepare_model,
)
from loopformer.train.step_metrics import DivergenceCheck, StepMeter, StepMetrics, loop_metrics
from loopformer.train.stop import EvaluationInterrupted, StopSignals, TrainingInterrupted
from loopformer.train.strategy import Strategy, make_strategy
from loopformer.train.update import TrainerUpdate

log = logging.getLogger("loopformer.train")


class TrainingDivergedError(RuntimeError):
    """Training produced a non-finite or exploding quantity; no update was applied for that step."""

    def __init__(self, step: int, quantity: str, value: float, checkpoint: Path | None) -> None:
        where = f"; the last good checkpoint is {checkpoint}" if checkpoint else "; no checkpoint was written"
        super().__init__(f"training diverged at step {step}: {quantity} = {value}{where}")
        self.step, self.quantity, self.value, self.checkpoint = step, quantity, value, checkpoint


class Trainer(TrainerEvaluation, TrainerUpdate):
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
        self.strategy: Strategy = make_strategy(tc, config.device)  # joins torchrun's process group
        self.device = self.strategy.device
        configure_process(tc, self.strategy.env, self.device)
        seed_everything(config.seed)  # before the model is built: its initial weights follow the seed
        self.task, self.train_data, self.eval_data = build_data(config, task, train_data, eval_data, model is not None)
        self.data_record = training_data(config, self.train_data, self.eval_data)  # what checkpoints record
        self.model = prepare_model(config, model, self.task, self.train_data, self.device)
        self.threads = set_cpu_threads(tc.threads, self.device, self.model, self.strategy.env)
        self.loop_train: LoopConfig = config.loop_config(self.model.config.loop, "train")
        self.loop_eval: LoopConfig = config.loop_config(self.model.config.loop, "eval")
        # the trainer's own evaluations (periodic, final; they choose train.keep_best): loop_periodic over loop_eval
        self.loop_periodic: LoopConfig = config.loop_config(self.model.config.loop, "periodic")
        self.sampler = training_sampler(
            tc.loop_sampler, tc.loop_sampler_options, self.loop_train.max_steps, config.seed
        )
        self.curriculum = make_curriculum(config.data.curriculum, self.train_data)
        self.stream = make_stream(self.train_data, config.seed, self.curriculum)
        self.step = 0
        self.mode: TrainingMode = make_training_mode(tc.mode, self)
        self.accum_steps = accumulate.micro_steps(tc, self.strategy.env.world_size)  # micro-batches per step
        micro_rows = tc.batch_size // self.strategy.env.world_size // self.accum_steps
        accumulate.check_loop(self.mode.first_loop(), self.accum_steps, micro_rows)  # refused before any write
        self.strategy.validate(tc)
        self.forward_model: torch.nn.Module = self.strategy.wrap(self.model, tc, self.probe_unused_parameters)
        # built after wrapping: FSDP2 turns the parameters into shards
        self.optimizer = make_optimizer(self.model, tc)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        fast_cuda_settings(config, self.device)
        self.compiled = self._compile() if compile_on(config, self.device) else None
        self.ema = EMA(self.model, tc.ema, tc.ema_warmup, tc.ema_puzzle_embeddings) if tc.ema > 0 else None
        # lock the folder; a fresh run never destroys a previous one (loopformer.runs.folder)
        self.progress = TrainProgress(False, 0, 0, 1)  # fit() replaces it with the run's console output
        self.folder = RunFolder(Path(config.out_dir), bool(tc.resume), tc.overwrite, self.strategy.is_main)
        self.run_dir, self.ckpt_dir = self.folder.write_dir, self.folder.write_dir / "checkpoints"
        self.log = RunLog(self.run_dir, enabled=self.strategy.is_main)
        self.elapsed_before, self.t0 = 0.0, None  # wall time spent before a resume; when fit() started
        self.last_checkpoint: Path | None = None
        self.resumed_from: Path | None = None
        self.resumed_origin: Path | None = None  # the other run a resume branched from (origin.json)
        self.config_changes: dict[str, Any] = {}  # what --allow-config-change let differ (config_changes.jsonl)
        self.last_metrics: dict[str, Any] = {}
        self.last_eval: dict[str, Any] = {}
        self.best = BestTracker(tc.keep_best, tc.keep_best_mode)
        # the steps' metrics and divergence check stay on the device between reads (step_metrics.py)
        self.meter = StepMeter()
        self.guard = DivergenceCheck(self.device, tc.max_loss, tc.max_state_norm)
        # SIGTERM / SIGINT: finish the step, checkpoint, unlock, say how to resume (loopformer.train.stop);
        # under torchrun every rank installs them and the ranks agree through the step's all-reduce
        self.stop = StopSignals(distributed=self.strategy.env.enabled)
        self._resume_if_asked(tc)

    def _resume_if_asked(self, tc: Any) -> None:
        """Continue from ``train.resume``'s checkpoint when one is asked for; on any failure unlock the folder."""
        try:
            folder = resume.resume_folder(tc.resume, self.ckpt_dir)
            if folder is not None:
                resume.check(self, folder)  # this run's checkpoint, and the same training stream
                resume.restore(self, folder)
                resume.record(self, folder)  # origin.json / config_changes.jsonl, once it is loaded
        except BaseException:
            self.folder.close()
            raise

    # -- the pieces a training mode uses -------------------------------------------------------
    @property
    def carry(self) -> Any:
        """The training mode's carried slots (deep supervision), else None."""
        return self.mode.carry

    def generator(self, step: int, salt: int) -> torch.Generator:
        """Seeded by (seed, step, salt), plus the rank under torchrun (independent draws per rank)."""
        return step_generator(self.device, self.config.seed, step, salt, self.strategy.rank)

    def next_batch(self) -> Batch:
        """This rank's share of the next global batch of ``train.batch_size`` rows of the stream."""
        return make_batch(
            self.train_data, dist.shard(self.stream.take(self.config.train.batch_size)), self.device
        )

    def fresh_states(self, inputs: Tensor, puzzle_ids: Tensor | None, step: int) -> Tensor:
        """Detached ``init_state`` rows for ``inputs``, drawn from the (step, rank) stream."""
        with torch.no_grad(), autocast(self.device, self.config.bf16), self.strategy.gathered(self.model):
            ctx = self.model.embed(inputs, puzzle_ids)
            return self.model.init_state(ctx, self.generator(step, SALT_INIT)).detach()

    # -- checkpoints ---------------------------------------------------------------------------
    def elapsed(self) -> float:
        """Training wall time so far, including the time before a resume."""
        return self.elapsed_before + (time.perf_counter() - self.t0 if self.t0 is not None else 0.0)

    def save(self) -> Path:
        """Checkpoint the current step (every rank must call it under torchrun; rank 0 writes)."""
        return resume.save(self)

    def load(self, folder: Path) -> None:
        """Restore weights, EMA, optimiser, data stream, curriculum, mode state and RNG from ``folder``."""
        resume.restore(self, folder)

    # -- one optimiser step --------------------------------------------------------------------
    def loss(
        self, out: ModelOutput, batch: SegmentBatch, jacobian_probe: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor], Any]:
        """(total loss, its named parts, accuracy) of ``out`` on ``batch``; ``jacobian_probe``: the
        Hutchinson vector for these rows (drawn from the step's generator when None)."""
        tc = self.config.train
        task_loss = sequence_loss(out.logits, batch.labels, tc.loss, tc.label_smoothing)
        acc = accuracy(out.logits, batch.labels)
        parts = {"task_loss": task_loss}
        total = task_loss
        if out.q_logits is not None and tc.q_loss_weight > 0 and not tc.q_learning:
            parts["q_loss"] = q_halt_loss(out.q_logits, acc.exact)
            total = total + tc.q_loss_weight * parts["q_loss"]
        if out.aux_loss is not None and tc.ponder_weight > 0:
            parts["ponder"] = wide(out.aux_loss)
            total = total + tc.ponder_weight * parts["ponder"]
        if tc.jacobian_weight > 0:
            with autocast(self.device, self.config.bf16):
                ctx = self.model.embed(batch.inputs, batch.puzzle_ids)
                parts["jacobian"] = jacobian_frobenius(
                    self.model.step,
                    out.state,
                    ctx,
                    self.generator(self.step, SALT_JAC),
                    probes=None if jacobian_probe is None else [jacobian_probe],
                )
            total = total + tc.jacobian_weight * parts["jacobian"]
        return total, parts, acc

    def dropout_on(self) -> bool:
        """``train.dropout_schedule``: always, or (``first_epoch``) in the first ``ceil(rows / batch_size)`` steps of
        the run and of the current curriculum stage (rows: the stream's, the curriculum's eligible rows if any)."""
        cur, tc = self.curriculum, self.config.train
        if tc.dropout_schedule == "always":
            return True
        rows = len(cur.eligible()) if cur is not None else len(self.train_data)
        return self.step - (cur.stage_start if cur is not None else 0) < math.ceil(rows / tc.batch_size)

    def _q_learning(
        self,
        out: ModelOutput,
        batch: SegmentBatch,
        exact: Tensor,
        parts: dict,
        segments: Tensor | None = None,
    ) -> Tensor:
        """HRM's Q-learning loss (``losses.q_learning_losses``) for a mode with a carry; the target runs
        one more segment without gradient from this segment's state, as HRM's ACT wrapper does.
        ``segments``: the segment counts of ``batch``'s slots (default: the whole carry's)."""
        tc = self.config.train
        q_values = getattr(self.model, "q_values", None)
        if q_values is None:
            raise ValueError(
                f"train.q_learning needs a model with q_values(); {type(self.model).__name__} has none"
            )
        q = q_values(out.state)
        with torch.no_grad():
            nxt = self.model(
                batch.inputs, loop=batch.loop, state=out.state.detach(), puzzle_ids=batch.puzzle_ids
            )
            q_next = q_values(nxt.state)
        segments = self.carry.segments if segments is None else segments
        is_last = (segments + 1 >= tc.max_segments).to(q.device)
        parts["q_loss"], parts["q_continue_loss"] = q_learning_losses(q, q_next, exact, is_last)
        return tc.q_loss_weight * (parts["q_loss"] + parts["q_continue_loss"])

    def diverged(self, quantity: str, value: float, detail: str = "", step: int | None = None) -> None:
        """Record the failed step (``step``, default the current one; the log's ``step`` is the step that
        was attempted: one record per step) and raise, naming the newest checkpoint from before it whose
        weights are finite."""
        step = self.step if step is None else step
        self.optimizer.zero_grad(set_to_none=True)
        self.log.write({"step": step + 1, "diverged": quantity, "value": value,
                        **({"detail": detail} if detail else {})}, step)  # fmt: skip
        good = resume.quarantine_after(self.ckpt_dir, step) if self.strategy.is_main else None
        raise TrainingDivergedError(step, quantity if not detail else f"{quantity} ({detail})", value, good)

    def read_metrics(self, reset: bool = True) -> dict[str, Any]:
        """The device metrics since the last logged record (reduced over ranks) and the divergence check,
        in one host read; raises ``TrainingDivergedError`` naming the first failed step, if one failed."""
        record, first = self.meter.read(self.guard.first, reset)
        failed = DivergenceCheck.failure(first)
        if failed is not None:
            step, quantity, value = failed
            self.diverged(quantity, value, step=step)
        if record.get("ift_capped", 0.0) > 0:  # the implicit gradient's backward solve hit its cap
            ift = self.loop_train.options_for("ift")
            log.warning("the implicit gradient's backward solve stopped at its cap (ift.max_steps=%d) for %.1f%% "
                        "of the samples before reaching ift.tol=%s (last residual up to %.2g); raise "
                        "loop_train.ift.max_steps or loosen loop_train.ift.tol", ift.max_steps,
                        100 * record["ift_capped"], ift.tol, record.get("ift_residual", float("nan")))  # fmt: skip
        return self.strategy.reduce_metrics(record)

    def _forward(self, batch: SegmentBatch) -> ModelOutput:
        lockstep = dist.LockstepHalting(self.strategy.sync_halting)
        with autocast(self.device, self.config.bf16):
            out = self.forward_model(
                batch.inputs,
                loop=batch.loop,
                state=batch.state,
                puzzle_ids=batch.puzzle_ids,
                generator=self.generator(self.step, SALT_INIT),
                callback=lockstep.callback if lockstep.enabled else None,
                **({"solver_state": batch.solver_state} if batch.solver_state else {}),
            )
        lockstep.drain()
        return out

    def train_step(self) -> StepMetrics:
        """One optimiser step (one segment in deep supervision); returns its metrics: device tensors, read
        by ``read_metrics`` when the trainer logs (no host read here), and host values."""
        tc = self.config.train
        self.model.train(self.dropout_on())
        lr = lr_for(self.curriculum.schedule_step(self.step) if self.curriculum else self.step, tc)
        set_lr(self.optimizer, lr)
        batch = self.mode.batch(self.step)
        res, out = self._compiled_update(batch, lr) if self.compiled is not None else self._update(batch)
        metrics: dict[str, Any] = {
            "step": self.step + 1,
            "loss": res["loss"],
            **res["parts"],
            "token_acc": res["token_acc"],
            "exact_acc": res["exact_acc"],
            "lr": lr,
            "grad_norm": res["grad_norm"],
            "state_norm": res["state_norm"],
            **loop_metrics(out),
            **batch.metrics,
            **self.mode.after_step(batch, out, self.step),
        }
        if self.curriculum is not None:
            metrics["level"] = self.curriculum.level
        return StepMetrics(metrics)

    def probe_unused_parameters(self, rows: int = 2) -> list[str]:
        """Parameters that one training forward / backward of the real loss leaves without gradient.

        Uses the first ``rows`` training examples in the mode's ``probe_batch`` (the loop of step 0;
        deep supervision: fresh initial states); the RNG, the data stream and every ``.grad`` are
        left as they were. A non-empty answer makes DDP run with ``find_unused_parameters=True``.
        """
        rows_ = make_batch(self.train_data, np.arange(min(rows, len(self.train_data))), self.device)
        batch = self.mode.probe_batch(rows_)

        def loss_of() -> Tensor:
            with autocast(self.device, self.config.bf16):
                out = self.model(
                    batch.inputs,
                    loop=batch.loop,
                    state=batch.state,
                    puzzle_ids=batch.puzzle_ids,
                    generator=self.generator(0, SALT_INIT),
                )
            return self.loss(out, batch)[0]

        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            return dist.unused_parameters(self.model, loss_of)

    # -- evaluation ----------------------------------------------------------------------------
    # -- the loop ------------------------------------------------------------------------------
    def _after_step(self, metrics: StepMetrics) -> None:
        """Curriculum, logging, periodic evaluation and checkpoints after step ``self.step`` (one
        metrics record per step: a periodic evaluation joins the step's training record). The step's device
        metrics are read only at the steps that need them (``read_metrics``: one host read)."""
        tc, cc = self.config.train, self.config.data.curriculum
        self.meter.add(metrics)
        log_due = self.step % tc.log_every == 0 or self.step == tc.steps
        eval_due = bool(tc.eval_every) and self.step % tc.eval_every == 0 and self.step < tc.steps
        save_due = bool(tc.checkpoint_every) and self.step % tc.checkpoint_every == 0 and self.step < tc.steps
        curriculum_due = (
            self.curriculum is not None and not self.curriculum.done and self.step % cc.check_every == 0
        )
        if not (log_due or eval_due or save_due or curriculum_due):
            return
        read = self.read_metrics(reset=log_due)  # raises TrainingDivergedError before any save or evaluation
        read["time"] = round(self.elapsed(), 3)
        self.last_metrics = read
        if curriculum_due:
            self._curriculum_check()
        record = read if log_due else {}
        improved = False
        if eval_due:
            self.last_eval = self.evaluate()
            self.progress.evaluation(self.step, self.last_eval)
            improved = self.best.consider(self.last_eval, self.step)
            record = {**record, "step": self.step, **{f"eval_{k}": v for k, v in self.last_eval.items()},
                      **self.best.fields()}  # fmt: skip
        if record and self.step < tc.steps:
            self.log.write(record, self.step)
        if save_due or improved:  # a new best is checkpointed at its step
            self.save()
        if improved:
            self._mark_best()

    def _mark_best(self) -> None:
        """Point ``checkpoints/best`` at the checkpoint just written (the best evaluation's step)."""
        self.best.mark(self.last_checkpoint)
        if self.strategy.is_main:
            self.best.write(self.ckpt_dir)

    def _finish(self) -> None:
        """Final checkpoint (before the final evaluation: an evaluation error never loses the trained
        weights), evaluation, and the last step's one metrics record (training + eval)."""
        record = dict(self.last_metrics) if self.last_metrics.get("step") == self.step else {}
        self.save()
        self.last_eval = {}
        try:
            with self.stop.interruptible():  # a signal here: the checkpoint above is what a resume evaluates
                self.last_eval = self.evaluate()
            self.progress.evaluation(self.step, self.last_eval, final=True)
            if self.best.consider(self.last_eval, self.step):
                self._mark_best()  # the final checkpoint, written just above
        except EvaluationInterrupted as stopped:
            raise TrainingInterrupted(stopped.signum, self.step, self.last_checkpoint) from None
        finally:
            record.update({f"eval_{k}": v for k, v in self.last_eval.items()})
            if self.last_eval:
                record.update(self.best.fields())
            if (
                record and self.last_metrics.get("step") != self.step
            ):  # no step trained here: a resume at the end
                self.log.join_last({"step": self.step, **record}, self.step)
            elif record:
                self.log.write({"step": self.step, **record}, self.step)

    def _stop_on_signal(self, signum: int) -> None:
        """Checkpoint the step just finished (unless it already is) and raise TrainingInterrupted."""
        self.read_metrics(reset=False)  # a step that diverged is never checkpointed
        why_not = None
        if self.last_checkpoint is None or self.last_checkpoint.name != f"step_{self.step:08d}":
            try:
                self.save()
            except Exception as err:  # any failure (disk full, diverged weights) is reported, not raised
                why_not = " ".join(str(err).split()) or type(err).__name__
        raise TrainingInterrupted(signum, self.step, None if why_not else self.last_checkpoint, why_not)

    def fit(self) -> dict[str, Any]:
        """Train to ``train.steps`` optimiser steps (continuing a resumed run); returns a summary."""
        tc = self.config.train
        try:
            # a resume that found no checkpoint still drops the metrics its killed predecessor wrote
            resumed = self.resumed_from is not None or bool(tc.resume)
            self.log.open(
                self.config, self.ckpt_dir, resumed, self.step, self.device
            )  # inside: a failed write unlocks
            self.strategy.barrier()  # rank 0 has written the run folder's config before anyone goes on
            self.t0 = time.perf_counter()
            stop = self.stop
            self.progress = TrainProgress(
                tc.progress and self.strategy.is_main, tc.steps, self.step, tc.log_every
            )
            with stop, self.progress:
                while self.step < tc.steps:
                    metrics = self.train_step()
                    self.step += 1
                    self._after_step(metrics)
                    self.progress.update(self.step, self.last_metrics)
                    signum = stop.agreed()
                    if signum is not None and self.step < tc.steps:
                        self._stop_on_signal(signum)
                self._finish()
        finally:
            self.folder.close()
            self.log.close()
            # the DDP wrapper's reducer holds the process group: drop it first, so the group's threads
            # are joined when it is destroyed here, not by a destructor at interpreter exit
            self.forward_model = self.model
            self.strategy.shutdown(sync=sys.exc_info()[0] is None)
        return self.summary()

    def summary(self) -> dict[str, Any]:
        """The run's summary (written to ``summary.json`` by rank 0)."""
        summary = {
            "steps": self.step,
            "run_dir": str(self.run_dir),
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "train": self.last_metrics,
            "eval": self.last_eval,  # the final checkpoint's evaluation (loop_periodic over loop_eval)
            "eval_label": f"final (step {self.step})",
            # train.keep_best: the best evaluation's checkpoint, metric, value, step and its label
            # "best (by eval_<metric>, step N)"; None without keep_best
            "best": self.best.summary(self.ckpt_dir),
            "curriculum_level": self.curriculum.level if self.curriculum else None,
            "wall_time": round(self.elapsed(), 3),
            "parameters": self.model.num_parameters(),
        }
        self.log.write_summary(summary)
        return summary
