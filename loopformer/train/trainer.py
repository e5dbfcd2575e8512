"""The trainer: one class a reader follows from ``fit`` to ``optimizer.step()``.

``Trainer(config).fit()`` trains ``config``'s model on its task. Read it top to bottom:

- ``__init__`` builds the pieces from the config (``loopformer.train.setup``: data, model, optimiser; the
  strategy, ``loopformer.train.dist``; the training mode, ``loopformer.train.modes``; the run folder,
  ``loopformer.runs.folder``) and continues from ``train.resume``'s checkpoint when asked;
- ``fit`` runs ``train_step`` to ``train.steps``, each followed by ``_after_step`` (the metrics read once per
  ``log_every``, ``loopformer.train.metrics``; the periodic evaluation, ``evaluate`` / ``score``:
  ``loopformer.eval.evaluate``; the curriculum; checkpoints), then the final checkpoint and evaluation;
- ``train_step``: the learning rate of the step, the mode's ``batch`` (``simple``: a fresh batch and a
  step-seeded loop count; ``deep_supervision``: one segment on the carried slots; or a registered mode),
  ``_update`` (or ``_compiled_update``, the whole step as one ``torch.compile``d graph,
  ``loopformer.train.compiled``), the mode's ``after_step``;
- ``_update``: ``_micro_steps`` (forward ``_forward``, ``loss``, backward; ``train.grad_accum_steps``
  micro-batches), the divergence check decided on the device, clipping, ``optimizer.step()``, the EMA.

Checkpoints: the trainer hands run storage what it saves (``save``: the weights and EMA through the
strategy, and ``state_dict()``: optimiser, data stream, curriculum, the mode's carry, RNG states, elapsed
time, the metrics since the last log, the best so far, the data fingerprints) and restores what it reads
back (``load`` / ``load_state_dict``); storage (``loopformer.runs.checkpoint``) never reads the trainer.
Every random draw is a function of (seed, global step), so a resumed run replays bit for bit.

Gradient accumulation (``train.grad_accum_steps = k``, or ``train.micro_batch_size``): each rank's share of
the step's batch -- whatever the mode handed over, the deep-supervision carry after its refill included --
runs as ``k`` contiguous micro-batches of equal size; each runs forward, its loss weighted by ``1 / k`` and
backpropagated at once (one micro-batch's activations alive at a time); then the trainer clips, checks and
steps once. Under DDP the first ``k - 1`` backwards run inside ``no_sync()``, under FSDP2 with
``set_requires_gradient_sync(False)`` (``Strategy.no_sync``). The accumulated step equals the full-batch step
(tests/test_train_accumulate.py checks it in float64 for every mode, to 1e-10): every loss term is a mean
over the rows of equally sized micro-batches, so ``sum_i loss_i / k`` is the full-batch loss and its
gradient; the loop engine treats rows independently; what the mode keeps between steps is fed from the
merged output (``_merge_outputs``: states, Q logits, loop results, solver state in batch order); random draws
the full batch makes with the step's generators are made once and sliced (``initial_states``, the Hutchinson
probes of ``train.jacobian_weight``). A halting rule that couples the rows of a batch (``batch_residual``) is
exact only when its groups (``LoopConfig.halt_group``) divide the micro-batch (``setup.check_loop`` refuses
the rest). Not exact: draws a model makes from the global RNG or inside its forward (dropout masks,
AttractorPuzzle's Jacobian probes) are drawn per micro-batch: the same distribution, other draws.

Around the step: CPU float32 (flush denormals, one thread per physical core) or CUDA with bf16 autocast
(``bf16``); warm-up + constant / cosine lr, clipping, EMA, the difficulty curriculum, periodic evaluation
(the final checkpoint is written before the final evaluation), divergence detection
(``TrainingDivergedError`` before the bad update is applied, the last good checkpoint kept), SIGTERM /
SIGINT (``loopformer.train.stop``). Under ``torchrun`` every rank runs this same trainer on its contiguous
shard of each global batch; files, progress bars and logs come from rank 0 only; ``fit()`` ends a process
group the trainer created itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from loopformer.config import RunConfig
from loopformer.devices import set_cpu_threads
from loopformer.eval.evaluate import evaluate
from loopformer.loop import LoopConfig
from loopformer.loop.engine import LoopResult
from loopformer.loop.samplers import training_sampler
from loopformer.models.base import LoopedModel, ModelOutput
from loopformer.nn import autocast
from loopformer.numerics import nonfinite_names
from loopformer.runs.checkpoint import (
    BestTracker,
    CheckpointError,
    is_sharded,
    load_sharded,
    load_training_state,
    quarantine_after,
    rng_state,
    save_checkpoint,
    save_sharded,
    set_rng_state,
    step_name,
    stored_weights,
)
from loopformer.runs.folder import RunFolder, check_resume, record_resume, resume_folder, training_data
from loopformer.tasks.base import Task, TokenDataset
from loopformer.train import dist
from loopformer.train.data import (
    SALT_CURRICULUM,
    SALT_INIT,
    SALT_JAC,
    Batch,
    make_batch,
    make_curriculum,
    make_stream,
    seed_everything,
    step_generator,
)
from loopformer.train.losses import (
    Accuracy,
    accuracy,
    jacobian_frobenius,
    q_halt_loss,
    q_learning_losses,
    sequence_loss,
    wide,
)
from loopformer.train.metrics import (
    DivergenceCheck,
    RunLog,
    StepMeter,
    StepMetrics,
    TrainProgress,
    loop_metrics,
)
from loopformer.train.modes import SegmentBatch, TrainingMode, make_training_mode
from loopformer.train.optim import EMA, set_lr, skip_step
from loopformer.train.setup import (
    AccumulationError,
    build_data,
    build_run_model,
    check_loop,
    compile_on,
    configure_process,
    fast_cuda_settings,
    lr_for,
    make_optimizer,
    micro_steps,
)
from loopformer.train.stop import EvaluationInterrupted, StopSignals, TrainingInterrupted

if TYPE_CHECKING:
    from loopformer.train.compiled import CompiledStep

log = logging.getLogger("loopformer.train")


class TrainingDivergedError(RuntimeError):
    """Training produced a non-finite or exploding quantity; no update was applied for that step."""

    def __init__(self, step: int, quantity: str, value: float, checkpoint: Path | None) -> None:
        where = f"; the last good checkpoint is {checkpoint}" if checkpoint else "; no checkpoint was written"
        super().__init__(f"training diverged at step {step}: {quantity} = {value}{where}")
        self.step, self.quantity, self.value, self.checkpoint = step, quantity, value, checkpoint


@dataclass
class StepResult:
    """What the forward / backward passes of one optimiser step give the trainer (all detached)."""

    loss: Tensor
    parts: dict[str, Tensor]
    acc: Accuracy
    out: ModelOutput


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
        self.strategy: dist.Strategy = dist.make_strategy(tc, config.device)  # joins torchrun's process group
        self.device = self.strategy.device
        configure_process(tc, self.strategy.env, self.device)
        seed_everything(config.seed)  # before the model is built: its initial weights follow the seed
        self.task, self.train_data, self.eval_data = build_data(config, task, train_data, eval_data, model is not None)
        self.data_record = training_data(config, self.train_data, self.eval_data)  # what checkpoints record
        # the given or the recipe's model on the device (compiled once the optimiser exists, below)
        self.model = (model if model is not None else build_run_model(config, self.task, self.train_data)).to(self.device)
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
        self.accum_steps = micro_steps(tc, self.strategy.env.world_size)  # micro-batches per step
        micro_rows = tc.batch_size // self.strategy.env.world_size // self.accum_steps
        check_loop(self.mode.first_loop(), self.accum_steps, micro_rows)  # refused before any write
        self._init_state_draws: bool | None = None  # whether init_state draws from the generator (found once)
        self.strategy.validate(tc)
        self.forward_model: torch.nn.Module = self.strategy.wrap(self.model, tc, self.probe_unused_parameters)
        # built after wrapping: FSDP2 turns the parameters into shards
        self.optimizer = make_optimizer(self.model, tc)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        fast_cuda_settings(config, self.device)
        self.compiled: CompiledStep | None = self._compile() if compile_on(config, self.device) else None
        self.ema = EMA(self.model, tc.ema, tc.ema_warmup, tc.ema_puzzle_embeddings) if tc.ema > 0 else None
        self.progress = TrainProgress(False, 0, 0, 1)  # fit() replaces it with the run's console output
        # lock the folder; a fresh run never destroys a previous one (loopformer.runs.folder)
        self.folder = RunFolder(Path(config.out_dir), bool(tc.resume), tc.overwrite, self.strategy.is_main)
        self.run_dir, self.ckpt_dir = self.folder.write_dir, self.folder.write_dir / "checkpoints"
        self.log = RunLog(self.run_dir, enabled=self.strategy.is_main)
        self.elapsed_before, self.t0 = 0.0, None  # wall time spent before a resume; when fit() started
        self.last_checkpoint: Path | None = None
        self.resumed_from: Path | None = None
        self.last_metrics: dict[str, Any] = {}
        self.last_eval: dict[str, Any] = {}
        self.best = BestTracker(tc.keep_best, tc.keep_best_mode)
        # the steps' metrics and divergence check stay on the device between reads (loopformer.train.metrics)
        self.meter = StepMeter()
        self.guard = DivergenceCheck(self.device, tc.max_loss, tc.max_state_norm)
        # SIGTERM / SIGINT: finish the step, checkpoint, unlock, say how to resume (loopformer.train.stop);
        # under torchrun every rank installs them and the ranks agree through the step's all-reduce
        self.stop = StopSignals(distributed=self.strategy.env.enabled)
        self._resume_if_asked()

    def _resume_if_asked(self) -> None:
        """Continue from ``train.resume``'s checkpoint when one is asked for (``loopformer.runs.folder``: this
        run's checkpoint, or a branch of another's; the same training stream and data); on any failure
        unlock the folder."""
        try:
            folder = resume_folder(self.config.train.resume, self.ckpt_dir)
            if folder is not None:
                checks = check_resume(folder, self.config, self.run_dir, self.data_record)
                self.load(folder)
                if self.strategy.is_main:  # origin.json / config_changes.jsonl, once it is loaded
                    record_resume(self.run_dir, checks, self.step)
        except BaseException:
            self.folder.close()
            raise

    def _compile(self) -> CompiledStep | None:
        """The whole step compiled (``loopformer.train.compiled``), else the looped body alone (logged why)."""
        from loopformer.train.compiled import CompiledStep, why_not_whole

        why = why_not_whole(self)
        if why is None:
            log.info("torch.compile: the whole training step (loop, loss, optimiser; mode %s)", self.config.compile_mode)
            return CompiledStep(self, self.config.compile_mode)
        log.info("torch.compile: the looped body only (the whole step cannot be compiled with %s)", why)
        self.model.step = torch.compile(self.model.step)  # type: ignore[method-assign]
        return None

    # -- the loop ------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to ``train.steps`` optimiser steps (continuing a resumed run); returns a summary."""
        tc = self.config.train
        try:
            # a resume that found no checkpoint still drops the metrics its killed predecessor wrote
            resumed = self.resumed_from is not None or bool(tc.resume)
            self.log.open(self.config, resumed, self.step, self.device)  # inside: a failed write unlocks
            self.strategy.barrier()  # rank 0 has written the run folder's config before anyone goes on
            self.t0 = time.perf_counter()
            stop = self.stop
            self.progress = TrainProgress(tc.progress and self.strategy.is_main, tc.steps, self.step, tc.log_every)
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
        if improved:  # checkpoints/best names the checkpoint just written
            self.best.mark(self.last_checkpoint, write=self.strategy.is_main)

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
            if self.best.consider(self.last_eval, self.step):  # the final checkpoint, written just above
                self.best.mark(self.last_checkpoint, write=self.strategy.is_main)
        except EvaluationInterrupted as stopped:
            raise TrainingInterrupted(stopped.signum, self.step, self.last_checkpoint) from None
        finally:
            record.update({f"eval_{k}": v for k, v in self.last_eval.items()})
            if self.last_eval:
                record.update(self.best.fields())
            if record and self.last_metrics.get("step") != self.step:  # no step trained here: a resume at the end
                self.log.join_last({"step": self.step, **record}, self.step)
            elif record:
                self.log.write({"step": self.step, **record}, self.step)

    def _stop_on_signal(self, signum: int) -> None:
        """Checkpoint the step just finished (unless it already is) and raise TrainingInterrupted."""
        self.read_metrics(reset=False)  # a step that diverged is never checkpointed
        why_not = None
        if self.last_checkpoint is None or self.last_checkpoint.name != step_name(self.step):
            try:
                self.save()
            except Exception as err:  # any failure (disk full, diverged weights) is reported, not raised
                why_not = " ".join(str(err).split()) or type(err).__name__
        raise TrainingInterrupted(signum, self.step, None if why_not else self.last_checkpoint, why_not)

    def elapsed(self) -> float:
        """Training wall time so far, including the time before a resume."""
        return self.elapsed_before + (time.perf_counter() - self.t0 if self.t0 is not None else 0.0)

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

    # -- one optimiser step --------------------------------------------------------------------
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
        if self.task is not None and not self.task.has_validator:
            del metrics["exact_acc"]  # a language model: a whole window predicted right measures nothing
        if self.curriculum is not None:
            metrics["level"] = self.curriculum.level
        return StepMetrics(metrics)

    def dropout_on(self) -> bool:
        """``train.dropout_schedule``: always, or (``first_epoch``) in the first ``ceil(rows / batch_size)`` steps of
        the run and of the current curriculum stage (rows: the stream's, the curriculum's eligible rows if any)."""
        cur, tc = self.curriculum, self.config.train
        if tc.dropout_schedule == "always":
            return True
        rows = len(cur.eligible()) if cur is not None else len(self.train_data)
        return self.step - (cur.stage_start if cur is not None else 0) < math.ceil(rows / tc.batch_size)

    def _update(self, batch: SegmentBatch) -> tuple[dict[str, Any], ModelOutput]:
        """Forward, backward (as ``train.grad_accum_steps`` micro-batches), the divergence check and the
        optimiser / EMA update, eagerly; no host read."""
        tc = self.config.train
        self.optimizer.zero_grad(set_to_none=True)
        res = self._micro_steps(batch, self.accum_steps)
        state_rms = res.out.state.detach().float().pow(2).flatten(1).mean(1).sqrt().mean()
        # every rank takes the same decision: the loss and state norm averaged over ranks (on the device),
        # with the ranks' stop flags (SIGTERM / SIGINT under torchrun) in the same all-reduce
        voted = self.strategy.mean_tensor(
            torch.stack([res.loss.detach().double(), state_rms.double(), self.stop.flag(self.device)])
        )
        self.stop.vote(voted[2])
        grad_norm = self.strategy.clip_grad_norm(self.params, tc.grad_clip)
        skip = ~self.guard.check(self.step, voted[0], voted[1], grad_norm)
        skip_step(self.optimizer, skip)  # decided on the device: a failed step leaves the weights as they were
        self.optimizer.step()
        if self.ema is not None:
            self.ema.update(self.model, self.step, skip)
        token_acc, exact_acc = res.acc.rates()
        parts = {k: v.detach() for k, v in res.parts.items()}
        return {"loss": voted[0], "parts": parts, "token_acc": token_acc, "exact_acc": exact_acc,
                "grad_norm": grad_norm, "state_norm": state_rms}, res.out  # fmt: skip

    def _micro_steps(self, batch: SegmentBatch, k: int) -> StepResult:
        """Forward and backward of ``batch`` as ``k`` micro-batches (the gradients are left in ``.grad``,
        summed; the caller zeroes them before). ``k == 1``: one forward and backward, as without accumulation."""
        tc = self.config.train
        B = batch.inputs.shape[0]
        b = B // k
        check_loop(batch.loop, k, B // k)
        state = batch.state if batch.state is not None or k == 1 else self.initial_states(batch)
        probe: Tensor | None = None
        segments = self.carry.segments if self.carry is not None else None
        losses, parts_sum, accs, outs = [], {}, [], []
        for i in range(k):
            sl = slice(i * b, (i + 1) * b)
            mb = batch if k == 1 else batch.rows(sl, state, i == 0)
            with self.strategy.no_sync(self.forward_model, sync=i == k - 1):
                out = self._forward(mb)
                if tc.jacobian_weight > 0 and k > 1 and probe is None:
                    probe = self._jacobian_probe(out, B)
                rows = None if segments is None else segments[sl]
                loss, parts, acc = self.loss(out, mb, None if probe is None else probe[sl], rows)
                (loss if k == 1 else loss / k).backward()
            losses.append(loss.detach())
            for name, v in parts.items():
                parts_sum[name] = parts_sum.get(name, 0.0) + v.detach() / (1 if k == 1 else k)
            accs.append(acc)
            outs.append(out if k == 1 else _detached(out))
        total = losses[0] if k == 1 else torch.stack(losses).sum() / k
        return StepResult(total, parts_sum, Accuracy.cat(accs), _merge_outputs(outs))

    def _forward(self, batch: SegmentBatch) -> ModelOutput:
        """The model (through the strategy's wrapper) on ``batch``, under autocast, with the step's generator."""
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

    def loss(
        self,
        out: ModelOutput,
        batch: SegmentBatch,
        jacobian_probe: Tensor | None = None,
        segments: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor], Any]:
        """(total loss, its named parts, accuracy) of ``out`` on ``batch``; ``jacobian_probe``: the
        Hutchinson vector for these rows (drawn from the step's generator when None). With
        ``train.q_learning`` and a mode that carries slots, HRM's Q-learning term (``_q_learning``;
        ``segments``: the segment counts of ``batch``'s slots, default the whole carry's)."""
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
        if tc.q_learning and self.carry is not None:  # HRM: Q-learning over the carried segments
            total = total + self._q_learning(out, batch, acc.exact, parts, segments)
        return total, parts, acc

    def _q_learning(
        self, out: ModelOutput, batch: SegmentBatch, exact: Tensor, parts: dict, segments: Tensor | None
    ) -> Tensor:
        """HRM's Q-learning loss (``losses.q_learning_losses``) for a mode with a carry; the target runs
        one more segment without gradient from this segment's state, as HRM's ACT wrapper does.
        ``segments``: the segment counts of ``batch``'s slots (None: the whole carry's)."""
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

    def initial_states(self, batch: SegmentBatch) -> Tensor | None:
        """The whole batch's initial states when the model draws them from the step's generator (None
        when it draws nothing: its ``init_state`` rows are then the same for any split of the batch), so that
        micro-batches and a compiled step start from the draws the full batch makes eagerly.

        AccumulationError when the draw also depends on the parameters (it could not be detached). Whether
        the model draws is found once (a generator-state comparison) and remembered."""
        model, device = self.model, self.device
        if self._init_state_draws is False:
            return None
        g = self.generator(self.step, SALT_INIT)
        before = g.get_state()
        with torch.no_grad(), autocast(device, self.config.bf16), self.strategy.gathered(model):
            z0 = model.init_state(model.embed(batch.inputs, batch.puzzle_ids), g)
        if self._init_state_draws:
            return z0.detach()
        self._init_state_draws = not torch.equal(g.get_state(), before)
        if not self._init_state_draws:
            return None
        pid = None if batch.puzzle_ids is None else batch.puzzle_ids[:1]
        with autocast(device, self.config.bf16), self.strategy.gathered(model):
            probe = model.init_state(model.embed(batch.inputs[:1], pid), self.generator(0, SALT_INIT))
        if probe.requires_grad:
            raise AccumulationError(
                f"train.grad_accum_steps: {type(model).__name__}.init_state draws random states that also "
                "depend on trainable parameters; they cannot be drawn once for the whole batch and split"
            )
        return z0.detach()

    def _jacobian_probe(self, out: ModelOutput, rows: int) -> Tensor:
        """``train.jacobian_weight``'s probe for the whole batch, as ``jacobian_frobenius`` draws it."""
        g = self.generator(self.step, SALT_JAC)
        return torch.randn((rows, *out.state.shape[1:]), generator=g, device=g.device, dtype=out.state.dtype)

    def _compiled_update(self, batch: SegmentBatch, lr: float) -> tuple[dict[str, Any], ModelOutput]:
        """``_update`` as one compiled region (one process, no accumulation: ``loopformer.train.compiled``)."""
        import torch._dynamo  # only a compiling run pays for importing dynamo

        if batch.state is None:  # a model that draws its initial states: drawn outside the graph, as eagerly
            batch.state = self.initial_states(batch)
        try:
            weight = 0.0 if self.ema is None else 1.0 - self.ema.decay_at(self.step)
            res = self.compiled(batch, lr, self.step, weight)
        except self.compiled.FAILURES as err:
            # tracing, code generation or the recompile limit failed (nothing ran): this run steps eagerly from
            # here on, its looped body compiled; said once
            log.warning("torch.compile of the whole step failed (%s: %s); compiling the looped body only",
                        type(err).__name__, (str(err).strip().splitlines() or [""])[0])  # fmt: skip
            self.compiled = None
            self.model.step = torch.compile(self.model.step)  # type: ignore[method-assign]
            return self._update(batch)
        loop = res["loop"]
        result = None
        if loop is not None:
            result = LoopResult(state=res["state"], steps=loop["steps"], converged=loop["converged"],
                                residuals=loop["residuals"], stats=loop["stats"])  # fmt: skip
        return res, ModelOutput(logits=None, state=res["state"], loop=result, q_logits=res["q_logits"])  # type: ignore[arg-type]

    def diverged(self, quantity: str, value: float, detail: str = "", step: int | None = None) -> None:
        """Record the failed step (``step``, default the current one; the log's ``step`` is the step that
        was attempted: one record per step) and raise, naming the newest checkpoint from before it whose
        weights are finite."""
        step = self.step if step is None else step
        self.optimizer.zero_grad(set_to_none=True)
        self.log.write({"step": step + 1, "diverged": quantity, "value": value,
                        **({"detail": detail} if detail else {})}, step)  # fmt: skip
        good = quarantine_after(self.ckpt_dir, step) if self.strategy.is_main else None
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

    # -- evaluation ----------------------------------------------------------------------------
    def score(
        self,
        dataset: TokenDataset,
        rows: np.ndarray | None = None,
        loop: LoopConfig | None = None,
        check: bool | None = None,
    ) -> dict[str, Any]:
        """The current weights on ``dataset`` (rows ``rows``) through ``loopformer.eval.evaluate``: the
        task's validator (``check``, default ``eval.check``), or loss / bits per byte for a task
        without one; ``eval.segments`` chained calls, ``eval.max_examples`` rows, sharded by the strategy."""
        ec = self.config.eval
        data = dataset if rows is None else dataset.subset(np.asarray(rows))
        if ec.max_examples and ec.max_examples < len(data):
            data = data.subset(slice(0, ec.max_examples))
        kwargs = dict(
            loop=loop or self.loop_periodic,
            batch_size=ec.batch_size,
            device=self.device,
            seed=self.config.seed,
            segments=ec.segments,
            bf16=self.config.bf16,
            comm=self.strategy,
        )
        if self.task is not None and not self.task.has_validator:
            from loopformer.eval.evaluate import evaluate_lm  # a language model: loss and bits per byte

            return evaluate_lm(self.model, self.task, data, **kwargs).summary()
        return evaluate(
            self.model, self.task, data, check=ec.check if check is None else check, **kwargs
        ).summary()

    def score_authors(self, dataset: TokenDataset) -> dict[str, Any]:
        """The Attractor puzzle authors' evaluation (``eval.protocol``, ``loopformer.eval.authors``: their
        ``train_trm_deq.py`` ``_eval``)."""
        from loopformer.eval.authors import evaluate_authors_trm_deq

        ec = self.config.eval
        data = dataset.subset(slice(0, ec.max_examples)) if 0 < ec.max_examples < len(dataset) else dataset
        return evaluate_authors_trm_deq(
            self.model, self.task, data, loop=self.loop_eval, batch_size=ec.batch_size,
            max_batches=ec.authors_max_batches, calls=ec.segments, exploration=self.config.train.halt_exploration,
            device=self.device, seed=self.config.seed, check=ec.check, bf16=self.config.bf16, comm=self.strategy,
        ).summary()  # fmt: skip

    def evaluate(self) -> dict[str, Any]:
        """Evaluate on the held-out set (EMA weights when ``eval.use_ema`` and an EMA exists) under the
        trainer's evaluation loop (``loop_periodic`` over ``loop_eval``) and ``eval.protocol``: the clean
        metrics, the authors' (``authors_trm_deq``), or both (the authors' prefixed ``authors_``)."""
        if self.eval_data is None or len(self.eval_data) == 0:
            return {}
        protocol = self.config.eval.protocol
        use_ema = self.ema is not None and self.config.eval.use_ema
        with self.ema.applied(self.model) if use_ema else contextlib.nullcontext():
            if protocol == "authors_trm_deq":
                result = self.score_authors(self.eval_data)
            else:
                result = self.score(self.eval_data)
                if protocol == "both":
                    authors = self.score_authors(self.eval_data)
                    result.update({f"authors_{k}": v for k, v in authors.items() if k != "protocol"})
        result["weights"] = "ema" if use_ema else "model"
        return result

    def _curriculum_check(self) -> None:
        """Score the current level as the run is evaluated (``loop_eval``, ``eval.segments``;
        ``data.curriculum.max_steps`` caps the loop) and advance the curriculum when it passes."""
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
        loop = self.loop_eval
        if cc.max_steps and cc.max_steps < loop.max_steps:
            loop = dataclasses.replace(loop, max_steps=cc.max_steps, min_steps=min(loop.min_steps, cc.max_steps))
        acc = self.score(dataset, rows, loop, check=False)["exact_acc"]
        if cur.update(acc, self.step):
            self.stream.set_eligible(cur.eligible())
            if cc.restart_optimizer:  # a fresh optimiser for the new stage (the schedule: schedule_step)
                self.optimizer.state.clear()
            log.info("curriculum: level %s passed (%.3f), now training up to %s", cur.level - cur.step, acc, cur.level)

    # -- checkpoints: what the trainer hands run storage, and takes back -------------------------
    def state_dict(self, optimizer: bool = True) -> dict[str, Any]:
        """Everything but the weights that a bit-exact resume needs (collective under FSDP / with a carry);
        ``optimizer`` False: without the optimiser (a sharded checkpoint stores it in the shards)."""
        opt = {
            "optimizer": self.strategy.optimizer_state(self.model, self.optimizer),
            "optimizer_layout": self.strategy.layout,
        }
        return {
            **(opt if optimizer else {}),
            "stream": self.stream.state_dict(),
            "curriculum": self.curriculum.state_dict() if self.curriculum else None,
            "carry": self.mode.state_dict(),
            "rng": rng_state(),
            "elapsed": self.elapsed(),
            "best": self.best.state_dict(),  # train.keep_best's record
            "data": self.data_record,  # the fingerprints of the training and held-out sets
            "meter": self.meter.state_dict(),  # the metrics since the last logged record
        }

    def load_state_dict(self, state: dict[str, Any], folder: Path) -> None:
        """Continue from the training state ``state_dict()`` wrote into the checkpoint ``folder`` (the weights,
        EMA and optimiser are restored by ``load``)."""
        if self.curriculum is not None and state.get("curriculum"):
            self.curriculum.load_state_dict(state["curriculum"])
            self.stream.set_eligible(self.curriculum.eligible())
        self.stream.load_state_dict(state["stream"])
        self.mode.load_state_dict(state.get("carry"), folder)
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.elapsed_before = float(state.get("elapsed", 0.0))
        self.best.load_state_dict(state.get("best"), self.ckpt_dir, self.step)
        self.meter.load_state_dict(state.get("meter"))

    def save(self) -> Path:
        """Checkpoint the current step (every rank must call it under torchrun): rank 0 writes the full
        weights the strategy gathers, or every rank its own shards (``train.checkpoint_format``); atomic, the
        newest ``train.keep_checkpoints`` kept. Weights that are not finite are never written."""
        tc = self.config.train
        if self.strategy.sharded_checkpoints(tc):
            bad = nonfinite_names(dist.local_state(self.model.state_dict()))
            if dist.all_reduce_max(float(bool(bad))) > 0:  # every rank stops, whichever holds the bad shard
                self.diverged("weights", float("nan"), f"non-finite parameter {bad[0]!r}" if bad else "non-finite shard")
            self.last_checkpoint = save_sharded(
                self.ckpt_dir, self.step, self.model, self.optimizer, self.config,
                self.ema.state_dict() if self.ema else None, self.state_dict(optimizer=False),
                tc.keep_checkpoints, self.strategy.is_main,
            )  # fmt: skip
        else:
            state = self.state_dict()
            ema_state = self.strategy.full_ema(self.ema.state_dict() if self.ema else None)
            weights = self.strategy.full_weights(self.model)
            bad = nonfinite_names(weights if weights is not None else self.model.state_dict())
            if bad:  # never write (or call good) a checkpoint of blown-up weights
                self.diverged("weights", float("nan"), f"non-finite parameter {bad[0]!r}")
            self.last_checkpoint = self.ckpt_dir / step_name(self.step)
            if self.strategy.is_main:
                self.last_checkpoint = save_checkpoint(
                    self.ckpt_dir, self.step, self.model, self.config, ema_state=ema_state, training_state=state,
                    keep=tc.keep_checkpoints, weights=weights,
                )  # fmt: skip
        if self.folder.staging is not None:  # --overwrite: the old run is moved aside only now
            self.folder.complete_overwrite()
            self.run_dir, self.ckpt_dir = self.folder.write_dir, self.folder.write_dir / "checkpoints"
            self.log.run_dir = self.run_dir
            self.last_checkpoint = self.ckpt_dir / self.last_checkpoint.name
        self.strategy.barrier()
        return self.last_checkpoint

    def load(self, folder: Path) -> None:
        """Restore weights, EMA, optimiser, data stream, curriculum, mode state and RNG from ``folder``
        (a sharded checkpoint: on any world size and strategy, ``loopformer.runs.checkpoint.load_sharded``)."""
        state = load_training_state(folder)
        if is_sharded(folder):
            load_sharded(folder, self.model, self.optimizer, self.ema.shadow if self.ema else None, state)
        else:
            weights, ema = stored_weights(folder)
            self.strategy.load_weights(self.model, weights, str(folder / "model.safetensors"))
            if self.ema is not None:
                if ema is None:
                    raise CheckpointError(f"{folder} has no ema.safetensors but this run keeps an EMA (train.ema > 0)")
                self.ema.load_state_dict({k: self.strategy.like(self.ema.shadow.get(k), v) for k, v in ema.items()})
            self.strategy.check_layout(state.get("optimizer_layout", "torch"), folder)
            try:
                self.strategy.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
            except (ValueError, KeyError, RuntimeError) as err:
                raise CheckpointError(f"optimizer state in {folder} does not fit this model: {err}") from None
        self.load_state_dict(state, folder)
        self.resumed_from = self.last_checkpoint = folder
        log.info("resumed from %s at step %d", folder, self.step)


def _cat_trace(rows: list[Tensor]) -> Tensor:
    """[steps_i, b_i] traces side by side, NaN-padded to the longest (NaN: after a sample halted)."""
    n = max(r.shape[0] for r in rows)
    pad = [torch.cat([r, r.new_full((n - r.shape[0], *r.shape[1:]), float("nan"))]) for r in rows]
    return torch.cat(pad, dim=1)


def _detached(out: ModelOutput) -> ModelOutput:
    """What ``_merge_outputs`` keeps of a micro-batch's output: its per-sample results, detached (no
    logits, no graph: the micro-batch's activations are freed before the next one runs)."""

    def d(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.detach()

    lp = out.loop
    loop = None
    if lp is not None:
        loop = LoopResult(
            state=lp.state.detach(), steps=lp.steps, converged=lp.converged, residuals=lp.residuals.detach(),
            ponder_cost=d(lp.ponder_cost), state_norms=d(lp.state_norms),
            stats={k: v.detach() for k, v in lp.stats.items()},
        )  # fmt: skip
    return ModelOutput(logits=None, state=out.state.detach(), loop=loop, q_logits=d(out.q_logits))  # type: ignore[arg-type]


def _merge_outputs(outs: list[ModelOutput]) -> ModelOutput:
    """The micro-batches' outputs as one detached output in batch order (no logits: they are not
    kept; the loss and accuracy were taken per micro-batch)."""
    if len(outs) == 1:
        return outs[0]
    loops = [o.loop for o in outs]

    def cat(ts: list[Tensor | None]) -> Tensor | None:
        return None if any(t is None for t in ts) else torch.cat([t.detach() for t in ts])

    state = cat([o.state for o in outs])
    loop = None
    if all(lp is not None for lp in loops):
        n = [lp.steps.shape[0] for lp in loops]
        keys = [k for k, v in loops[0].stats.items() if v.dim() and v.shape[0] == n[0]]
        loop = LoopResult(
            state=state,
            steps=cat([lp.steps for lp in loops]),
            converged=cat([lp.converged for lp in loops]),
            residuals=_cat_trace([lp.residuals.detach() for lp in loops]),
            ponder_cost=cat([lp.ponder_cost for lp in loops]),
            state_norms=None
            if any(lp.state_norms is None for lp in loops)
            else _cat_trace([lp.state_norms.detach() for lp in loops]),
            stats={k: cat([lp.stats[k] for lp in loops]) for k in keys},
        )
    return ModelOutput(logits=None, state=state, loop=loop, q_logits=cat([o.q_logits for o in outs]))  # type: ignore[arg-type]
