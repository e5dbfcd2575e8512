"""The whole training step as one ``torch.compile``d region (``compile: true``; ``auto``: on CUDA).

``CompiledStep`` traces the tensor work of an optimiser step into one graph: the model's forward (the loop
engine's iterations unrolled: a fixed-count training loop, or an adaptive one with ``sync_every: 0``, has no
host read and static shapes), the loss, the gradients (``torch.autograd.grad``, traced with
``torch._dynamo.config.trace_autograd_ops``), clipping, the divergence check, the optimiser update and the
EMA update. Host work stays outside: the data, the learning-rate schedule, the deep-supervision carry, the
logging. The learning rate, the step index and the EMA weight enter as tensors, so a new value does not
recompile; shapes are static (the carry is refilled with ``torch.where``), so ``train.compile_mode:
reduce-overhead`` (CUDA graphs) applies.

The optimiser update inside the graph is written out here (``adamw_update``, ``adam_atan2_update``: the
same formulas as ``torch.optim.AdamW`` and ``optim.AdamATan2``, with their step counts as tensors on the
device and a skipped step selected away with ``torch.where``); the inductor backend fuses each parameter's
update into one kernel. Equal to the eager step within float tolerance (tests/test_train_compiled.py), not
bit for bit: float32 bias corrections on the device, fused arithmetic.

Not compiled whole (the trainer then compiles ``model.step`` alone, as before, and logs why): gradient
accumulation and multi-process strategies (one graph per micro-step / the wrapper's own hooks), the Jacobian
regulariser (a generator-drawn probe), MuonAdamW (its per-step coefficient schedule).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch._dynamo
from torch import Tensor

from loopformer.nn import autocast
from loopformer.train.modes import SegmentBatch
from loopformer.train.optim import AdamATan2, sign_sgd_rows_

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
    if not isinstance(trainer.optimizer, AdamATan2 | torch.optim.AdamW):
        return f"optimizer {type(trainer.optimizer).__name__} (only AdamW and AdamATan2 are written out)"
    return None


def _where(skip: Tensor, old: Tensor, new: Tensor) -> None:
    old.copy_(torch.where(skip, old, new))


def adamw_update(
    opt: torch.optim.Optimizer, pairs: list[tuple[Tensor, Tensor]], lr: Tensor, skip: Tensor
) -> None:
    """``torch.optim.AdamW``'s update of ``pairs`` (parameter, gradient) at the scheduled rate ``lr`` (a tensor),
    every tensor kept as it was where ``skip``; sign-SGD groups (``AdamWSignSGD``) take their row update."""
    grads = {id(p): g for p, g in pairs}
    keep = (~skip).to(torch.float32)
    for group in opt.param_groups:
        b1, b2 = group["betas"]
        rate = lr * group.get("lr_mult", 1.0)
        for p in group["params"]:
            g = grads.get(id(p))
            if g is None:
                continue
            if group.get("sign_sgd"):
                sign_sgd_rows_(p, g, rate * group.get("lr_scale", 1.0), group["weight_decay"], skip)
                continue
            st = opt.state[p]
            t = st["step"] + keep
            m = st["exp_avg"].lerp(g, 1 - b1)
            v = st["exp_avg_sq"] * b2 + (1 - b2) * g * g
            denom = (v / (1 - b2**t)).sqrt() + group["eps"]
            new = p * (1 - rate * group["weight_decay"]) - rate / (1 - b1**t) * m / denom
            st["step"].copy_(t)
            for old, value in ((st["exp_avg"], m), (st["exp_avg_sq"], v), (p, new)):
                _where(skip, old, value)


def adam_atan2_update(opt: AdamATan2, pairs: list[tuple[Tensor, Tensor]], lr: Tensor, skip: Tensor) -> None:
    """``optim.AdamATan2``'s update (and its sign-SGD groups) with tensor step counts; see ``adamw_update``."""
    grads = {id(p): g for p, g in pairs}
    keep = (~skip).to(torch.float32)
    for group in opt.param_groups:
        rate, wd = lr * group["lr_scale"] * group.get("lr_mult", 1.0), group["weight_decay"]
        b1, b2 = group["betas"]
        for p in group["params"]:
            g = grads.get(id(p))
            if g is None:
                continue
            if group["sign_sgd"]:
                sign_sgd_rows_(p, g, rate, wd, skip)
                continue
            st = opt.state[p]
            t = st["step"] + keep
            m = st["exp_avg"].lerp(g, 1 - b1)
            v = st["exp_avg_sq"] * b2 + (1 - b2) * g * g
            new = p * (1 - rate * wd) - rate / (1 - b1**t) * torch.atan2(m, v.sqrt() / (1 - b2**t).sqrt())
            st["step"].copy_(t)
            for old, value in ((st["exp_avg"], m), (st["exp_avg_sq"], v), (p, new)):
                _where(skip, old, value)


class CompiledStep:
    """One optimiser step's tensor work as a compiled function (see the module docstring). What it uses of the
    trainer: ``model``, ``loss()``, ``params``, ``guard``, ``optimizer``, ``ema``, ``config`` and ``device``."""

    def __init__(self, trainer: Trainer, mode: str = "default", backend: str = "inductor") -> None:
        self.tr = trainer
        self.update = adam_atan2_update if isinstance(trainer.optimizer, AdamATan2) else adamw_update
        torch._dynamo.config.trace_autograd_ops = True  # torch.autograd.grad inside the graph
        self.fn = torch.compile(self.step, fullgraph=True, dynamic=False, backend=backend,
                                mode=None if mode == "default" or backend != "inductor" else mode)  # fmt: skip
        self.ready = False

    def prepare(self) -> None:
        """Optimiser state for every parameter (the step counts as float32 tensors on the parameters' device),
        once, before the first compiled step."""
        opt = self.tr.optimizer
        for group in opt.param_groups:
            if group.get("sign_sgd"):
                continue
            for p in group["params"]:
                st = opt.state[p]
                if not st:
                    st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                    st["step"] = torch.zeros((), dtype=torch.float32)
                st["step"] = st["step"].to(device=p.device, dtype=torch.float32)
        if isinstance(opt, AdamATan2):
            opt.reread_step_counts()  # the eager path re-reads the (moved) counts if it runs again
        self.ready = True

    def __call__(self, batch: SegmentBatch, lr: float, step: int, ema_weight: float) -> dict[str, Any]:
        if not self.ready:
            self.prepare()
        device = self.tr.device
        scalars = torch.tensor([lr, step, ema_weight], dtype=torch.float64).to(device, non_blocking=True)
        return self.fn(batch.inputs, batch.labels, batch.puzzle_ids, batch.state, batch.solver_state or {},
                       batch.loop, scalars)  # fmt: skip

    def step(self, inputs: Tensor, labels: Tensor, puzzle_ids: Tensor | None, state: Tensor | None,
             solver_state: dict[str, Tensor], loop: Any, scalars: Tensor) -> dict[str, Any]:  # fmt: skip
        tr, tc = self.tr, self.tr.config.train
        batch = SegmentBatch(inputs, labels, puzzle_ids, state, loop, {}, solver_state or None)
        with autocast(tr.device, tr.config.bf16):
            out = tr.model(inputs, loop=loop, state=state, puzzle_ids=puzzle_ids,
                           **({"solver_state": solver_state} if solver_state else {}))  # fmt: skip
        loss, parts, acc = tr.loss(out, batch)  # with HRM's Q-learning term when the run has one
        params = tr.params
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        pairs = [(p, g) for p, g in zip(params, grads) if g is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for _, g in pairs]))
        if tc.grad_clip > 0:
            coef = torch.clamp(tc.grad_clip / (norm + 1e-6), max=1.0)
            pairs = [(p, g * coef.to(g.dtype)) for p, g in pairs]
        rms = out.state.detach().float().pow(2).flatten(1).mean(1).sqrt().mean()
        skip = ~tr.guard.check_tensor(scalars[1], loss.detach().double(), rms.double(), norm)
        with torch.no_grad():
            self.update(tr.optimizer, pairs, scalars[0].float(), skip)
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


__all__ = ["MODES", "CompiledStep", "adam_atan2_update", "adamw_update", "why_not_whole"]
