"""The trainer's evaluations: held-out scoring, the Attractor puzzle authors' protocol, the curriculum check.

``TrainerEvaluation`` is a mixin of ``loopformer.train.trainer.Trainer`` (it reads the trainer's model,
EMA, data, loops and strategy):

- ``score``: the current weights on a dataset through ``loopformer.eval.evaluate`` (the task's validator)
  or ``evaluate_lm`` (loss / bits per byte), ``eval.segments`` chained calls, sharded by rank;
- ``score_authors``: the Attractor puzzle authors' ``train_trm_deq.py`` ``_eval`` (``eval.protocol``,
  ``loopformer.eval.authors``);
- ``evaluate``: the periodic / final evaluation (EMA weights when kept) under ``eval.protocol``;
- ``_curriculum_check``: scores the current level as the run is evaluated (``loop_eval``,
  ``eval.segments``; ``data.curriculum.max_steps`` caps the loop) and advances the curriculum.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

import numpy as np

from loopformer.eval.authors import evaluate_authors_trm_deq
from loopformer.eval.evaluate import evaluate, evaluate_lm
from loopformer.loop import LoopConfig
from loopformer.tasks.base import TokenDataset
from loopformer.train.seeding import SALT_CURRICULUM

log = logging.getLogger("loopformer.train")


class TrainerEvaluation:
    """Evaluation methods of the Trainer (see the module docstring)."""

    config: Any
    model: Any
    ema: Any
    task: Any
    device: Any
    strategy: Any
    loop_eval: LoopConfig
    loop_periodic: LoopConfig
    eval_data: TokenDataset | None
    train_data: TokenDataset
    curriculum: Any
    stream: Any
    optimizer: Any
    step: int

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
            return evaluate_lm(self.model, self.task, data, **kwargs).summary()
        return evaluate(
            self.model, self.task, data, check=ec.check if check is None else check, **kwargs
        ).summary()

    def score_authors(self, dataset: TokenDataset) -> dict[str, Any]:
        """The Attractor puzzle authors' evaluation (``eval.protocol``, ``loopformer.eval.authors``)."""
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
            loop = dataclasses.replace(
                loop, max_steps=cc.max_steps, min_steps=min(loop.min_steps, cc.max_steps)
            )
        acc = self.score(dataset, rows, loop, check=False)["exact_acc"]
        if cur.update(acc, self.step):
            self.stream.set_eligible(cur.eligible())
            if cc.restart_optimizer:  # a fresh optimiser for the new stage (the schedule: schedule_step)
                self.optimizer.state.clear()
            log.info(
                "curriculum: level %s passed (%.3f), now training up to %s",
                cur.level - cur.step,
                acc,
                cur.level,
            )
