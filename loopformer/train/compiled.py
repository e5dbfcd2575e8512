"""The whole training step as one ``torch.compile``d region (``compile: true``; ``auto``: on CUDA).

``CompiledStep`` traces the tensor work of an optimiser step into one graph: the model's forward (the loop
engine's iterations unrolled: a fixed-count training loop, or an adaptive one with ``sync_every: 0``, has no
host read and static shapes), the loss, the gradients (``torch.autograd.grad``, traced with
``torch._dynamo.config.trace_autograd_ops``), clipping, the divergence check, the optimiser update and the
EMA update. Host work stays outside: the data, the learning-rate schedule, the deep-supervision carry, the
logging, the random draws (``LoopedModel.training_draws``: the Attractor puzzle model's Jacobian probes, from the
step's generator as eagerly). Every value that changes from step to step enters as a tensor: the learning rate,
the step index, the EMA weight, MuonAdamW's momentum and weight decay (``[lr, step, ema weight, momentum, weight
decay, ...]``), so a warm-up or a schedule never recompiles; the optimiser's groups are read on the host
(``optim.tensor_groups``), never ``param_groups`` inside the graph (Dynamo guards every value it reads there).
Shapes are static (the carry is refilled with ``torch.where``), so ``train.compile_mode: reduce-overhead`` (CUDA
graphs) applies. The loop is unrolled, so each loop count a sampler draws is its own graph (the recompile limit is
raised to the sampler's range); any compile failure, the recompile limit's included, falls back to the eager step
with the looped body compiled, its reason logged once.

The optimiser update inside the graph is the eager optimisers' own (``optim.tensor_update_``: ``adam_``,
``sign_sgd_rows_``, ``muon_update_`` with tensor scalars; step counts as tensors on the device, a skipped step
selected away with ``torch.where``). Equal to the eager step within float tolerance (tests/test_train_compiled.py),
not bit for bit: float32 bias corrections on the device, ``torch.optim.AdamW``'s fused kernel eagerly, fused
arithmetic.

Not compiled whole (the trainer then compiles ``model.step`` alone, as before, and logs why): gradient
accumulation and multi-process strategies (one graph per micro-step / the wrapper's own hooks), the trainer's
Jacobian regulariser ``train.jacobian_weight`` (a generator-drawn probe).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch._dynamo
from torch import Tensor

from loopformer.nn import autocast
from loopformer.train.data import SALT_INIT
from loopformer.train.modes import SegmentBatch
from loopformer.train.optim import AdamATan2, MuonAdamW, TensorGroup, tensor_groups, tensor_update_

if TYPE_CHECKING:
    from loopformer.train.trainer import Trainer

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def why_not_whole(trainer: Trainer) -> str | None:
    """Why ``trainer``'s step cannot be compiled as one region (None: it can)."""
    tc = trainer.config.train
    if not hasattr(torch._dynamo.config, "trace_autograd_ops"):
        return f"torch {torch.__version__} (tracing torch.autograd.grad into the graph needs torch >= 2.11)"
    if trainer.strategy.env.enabled:
        return "a multi-process strategy (DDP / FSDP wrap the model with their own hooks)"
    if trainer.accum_steps > 1:
        return "gradient accumulation"
    if tc.jacobian_weight > 0:
        return "train.jacobian_weight (the Hutchinson probe is drawn from a generator)"
    return None


class CompiledStep:
    """One optimiser step's tensor work as a compiled function (see the module docstring). What it uses of the
    trainer: ``model``, ``loss()``, ``params``, ``guard``, ``optimizer``, ``ema``, ``sampler``, ``generator()``,
    ``config`` and ``device``."""

    FAILURES = (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit)

    def __init__(self, trainer: Trainer, mode: str = "default", backend: str = "inductor") -> None:
        self.tr = trainer
        torch._dynamo.config.trace_autograd_ops = True  # torch.autograd.grad inside the graph
        sampler = trainer.sampler  # one graph per loop count a sampler draws (the loop is unrolled)
        if sampler is not None and sampler.constant_depth is None:
            depths = sampler.high - sampler.low + 1
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, depths + 2)
        self.fn = torch.compile(self.step, fullgraph=True, dynamic=False, backend=backend,
                                mode=None if mode == "default" or backend != "inductor" else mode)  # fmt: skip
        self.groups: list[TensorGroup] = []
        self._state: tuple[int, int] = (0, -1)  # the optimiser state the groups hold (its id, its size)

    def arguments(self, batch: SegmentBatch, lr: float, step: int, ema_weight: float) -> tuple:
        """The compiled function's arguments for step ``step``, made on the host: the optimiser's groups (read
        again after a load or a reset), the per-step values as one tensor (MuonAdamW's schedule advanced), the
        model's random draws from the step's generator."""
        tr, opt = self.tr, self.tr.optimizer
        if self._state != (id(opt.state), len(opt.state)):  # first call, a load or a reset optimiser
            self.groups = tensor_groups(opt, tr.params)
            self._state = (id(opt.state), len(opt.state))
        muon = opt.advance_schedules() if isinstance(opt, MuonAdamW) else []
        scalars = torch.tensor([lr, step, ema_weight, *muon], dtype=torch.float64).to(tr.device, non_blocking=True)
        draws = tr.model.training_draws(batch.inputs, tr.generator(step, SALT_INIT))
        return (batch.inputs, batch.labels, batch.puzzle_ids, batch.state, batch.solver_state or {}, batch.loop,
                scalars, draws)  # fmt: skip

    def __call__(self, batch: SegmentBatch, lr: float, step: int, ema_weight: float) -> dict[str, Any]:
        opt = self.tr.optimizer
        counts = [g.get("t") for g in opt.param_groups]
        try:
            return self.fn(*self.arguments(batch, lr, step, ema_weight))
        except self.FAILURES:  # nothing ran: the eager step takes over from the optimiser's state as it is
            for g, t in zip(opt.param_groups, counts):
                if t is not None:
                    g["t"] = t
            if isinstance(opt, AdamATan2 | MuonAdamW):
                opt.reread_step_counts()  # compiled steps moved the counts to the device and advanced them
            raise

    def step(self, inputs: Tensor, labels: Tensor, puzzle_ids: Tensor | None, state: Tensor | None,
             solver_state: dict[str, Tensor], loop: Any, scalars: Tensor, draws: dict[str, Tensor]) -> dict[str, Any]:  # fmt: skip
        tr, tc = self.tr, self.tr.config.train
        batch = SegmentBatch(inputs, labels, puzzle_ids, state, loop, {}, solver_state or None)
        with autocast(tr.device, tr.config.bf16):
            out = tr.model(inputs, loop=loop, state=state, puzzle_ids=puzzle_ids, **draws,
                           **({"solver_state": solver_state} if solver_state else {}))  # fmt: skip
        loss, parts, acc = tr.loss(out, batch)  # with HRM's Q-learning term when the run has one
        params = tr.params
        grads = list(torch.autograd.grad(loss, params, allow_unused=True))
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads if g is not None]))
        if tc.grad_clip > 0:
            coef = torch.clamp(tc.grad_clip / (norm + 1e-6), max=1.0)
            grads = [None if g is None else g * coef.to(g.dtype) for g in grads]
        rms = out.state.detach().float().pow(2).flatten(1).mean(1).sqrt().mean()
        skip = ~tr.guard.check_tensor(scalars[1], loss.detach().double(), rms.double(), norm)
        with torch.no_grad():
            tensor_update_(self.groups, params, grads, scalars[0], scalars[3:], skip)
            if tr.ema is not None:
                tr.ema.update_weighted(tr.model, scalars[2], skip)
        token_acc, exact_acc = acc.rates()
        lp = out.loop
        loop = None if lp is None else {"steps": lp.steps, "converged": lp.converged, "residuals": lp.residuals,
                                         "stats": {k: v.detach() for k, v in lp.stats.items()}}  # fmt: skip
        q = None if out.q_logits is None else out.q_logits.detach()
        return {"loss": loss.detach(), "parts": {k: v.detach() for k, v in parts.items()}, "token_acc": token_acc,
                "exact_acc": exact_acc, "grad_norm": norm, "state_norm": rms, "state": out.state.detach(),
                "q_logits": q, "loop": loop}  # fmt: skip


__all__ = ["MODES", "CompiledStep", "why_not_whole"]
