"""How a training step's tensors are updated: eagerly, or as one compiled region.

``TrainerUpdate`` is a mixin of ``loopformer.train.trainer.Trainer``: ``_update`` runs the forward and backward
(as ``train.grad_accum_steps`` micro-batches, ``loopformer.train.accumulate``), the divergence check decided on
the device (``step_metrics.DivergenceCheck``), clipping and the optimiser / EMA update without a host read;
``_compiled_update`` does the same through ``loopformer.train.compiled.CompiledStep`` when ``compile`` is on
and the whole step can be compiled (``_compile`` decides, else it compiles the looped body alone).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch._dynamo

from loopformer.loop import LoopResult
from loopformer.models.base import ModelOutput
from loopformer.train import accumulate
from loopformer.train.compiled import CompiledStep, ema_weight, why_not_whole
from loopformer.train.modes import SegmentBatch
from loopformer.train.optim import skip_step

log = logging.getLogger("loopformer.train")


class TrainerUpdate:
    """The update methods of the Trainer (see the module docstring)."""

    config: Any
    model: Any
    optimizer: Any
    ema: Any
    strategy: Any
    guard: Any
    stop: Any
    params: list
    device: Any
    step: int
    accum_steps: int
    compiled: CompiledStep | None

    def _compile(self) -> CompiledStep | None:
        """The whole step compiled (``loopformer.train.compiled``), else the looped body alone (logged why)."""
        why = why_not_whole(self)
        if why is None:
            log.info(
                "torch.compile: the whole training step (loop, loss, optimiser; mode %s)",
                self.config.compile_mode,
            )
            return CompiledStep(self, self.config.compile_mode)
        log.info("torch.compile: the looped body only (the whole step cannot be compiled with %s)", why)
        self.model.step = torch.compile(self.model.step)  # type: ignore[method-assign]
        return None

    def _update(self, batch: SegmentBatch) -> tuple[dict[str, Any], ModelOutput]:
        """Forward, backward (as ``train.grad_accum_steps`` micro-batches, ``loopformer.train.accumulate``),
        the divergence check and the optimiser / EMA update, eagerly; no host read."""
        tc = self.config.train
        self.optimizer.zero_grad(set_to_none=True)
        res = accumulate.run_micro_steps(self, batch, self.accum_steps)
        state_rms = res.out.state.detach().float().pow(2).flatten(1).mean(1).sqrt().mean()
        # every rank takes the same decision: the loss and state norm averaged over ranks (on the device),
        # with the ranks' stop flags (SIGTERM / SIGINT under torchrun) in the same all-reduce
        voted = self.strategy.mean_tensor(
            torch.stack([res.loss.detach().double(), state_rms.double(), self.stop.flag(self.device)])
        )
        self.stop.vote(voted[2])
        grad_norm = self.strategy.clip_grad_norm(self.params, tc.grad_clip)
        skip = ~self.guard.check(self.step, voted[0], voted[1], grad_norm)
        skip_step(
            self.optimizer, skip
        )  # decided on the device: a failed step leaves the weights as they were
        self.optimizer.step()
        if self.ema is not None:
            self.ema.update(self.model, self.step, skip)
        token_acc, exact_acc = res.acc.rates()
        parts = {k: v.detach() for k, v in res.parts.items()}
        return {"loss": voted[0], "parts": parts, "token_acc": token_acc, "exact_acc": exact_acc,
                "grad_norm": grad_norm, "state_norm": state_rms}, res.out  # fmt: skip

    def _compiled_update(self, batch: SegmentBatch, lr: float) -> tuple[dict[str, Any], ModelOutput]:
        """``_update`` as one compiled region (one process, no accumulation: ``loopformer.train.compiled``)."""
        if batch.state is None:  # a model that draws its initial states: drawn outside the graph, as eagerly
            batch.state = accumulate.initial_states(self, batch)
        try:
            res = self.compiled(batch, lr, self.step, ema_weight(self))
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.BackendCompilerFailed) as err:
            # tracing failed (nothing ran): this run steps eagerly from here on, its looped body compiled
            log.warning("torch.compile of the whole step failed (%s); compiling the looped body only",
                        str(err).strip().splitlines()[0])  # fmt: skip
            self.compiled = None
            self.model.step = torch.compile(self.model.step)  # type: ignore[method-assign]
            return self._update(batch)
        loop = res["loop"]
        result = None
        if loop is not None:
            result = LoopResult(state=res["state"], steps=loop["steps"], converged=loop["converged"],
                                residuals=loop["residuals"], stats=loop["stats"])  # fmt: skip
        return res, ModelOutput(logits=None, state=res["state"], loop=result, q_logits=res["q_logits"])  # type: ignore[arg-type]
