"""Language-modelling evaluation: held-out cross-entropy and bits per byte.

For tasks without a validator (``Task.has_validator`` False: text), over the same batch loop as
``loopformer.eval.evaluate.evaluate`` (``_EvalPass``: segments, sharding, lock-step).

- ``evaluate_lm``: mean cross-entropy per labelled token, bits per byte, token accuracy, mean loops.
- ``lm_budget_curve``: bits per byte at each inference loop budget (``fixed``: exactly b loops;
  ``capped``: the model's halting rule with the cap b): the test-time compute curve of a looped LM.
- ``lm_logit_lens``: every loop's state read through the model's own head (arXiv 2604.07822's logit
  lens), scored as a language model: bits per byte, token accuracy and the logit margin per loop.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from loopformer.eval.analysis import _eval_mode, _fixed, _ratio, logit_margin, trace_loops
from loopformer.eval.budget import BUDGET_MODES, with_budget
from loopformer.eval.evaluate import EvalComm, _EvalPass, _Progress, batch_tensors, iter_batches, loop_summary
from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel
from loopformer.tasks.base import IGNORE_INDEX, Task, TokenDataset


@dataclass
class LMEvalResult:
    """Held-out language-modelling metrics: mean cross-entropy per labelled token and bits per byte."""

    task: str
    n: int  # examples (windows)
    tokens: int  # labelled tokens scored
    loss: float  # nats per token
    bits_per_byte: float
    token_accuracy: float
    exact_accuracy: float
    mean_steps: float
    loop: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> dict[str, Any]:
        """The short metric names the trainer logs."""
        return {
            "n": self.n,
            "loss": self.loss,
            "bits_per_byte": self.bits_per_byte,
            "token_acc": self.token_accuracy,
            "exact_acc": self.exact_accuracy,
            "loop_steps": self.mean_steps,
        }


@torch.no_grad()
def evaluate_lm(
    model: LoopedModel,
    task: Task,
    dataset: TokenDataset,
    loop: LoopConfig | None = None,
    batch_size: int = 64,
    max_batches: int | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
    seed: int = 0,
    *,
    segments: int = 1,
    bf16: bool = False,
    comm: EvalComm | None = None,
) -> LMEvalResult:
    """Mean cross-entropy (nats per labelled token, summed in float64) and bits per byte of ``model`` on
    ``dataset`` (``loopformer.tasks.text.bits_per_byte`` with the task's ``tokens_per_byte``, 1 for bytes)."""
    from loopformer.tasks.text import bits_per_byte

    if len(dataset) == 0:
        raise ValueError("cannot evaluate on an empty dataset")
    nll = right = count = exact = steps = n = 0.0
    with _EvalPass(model, dataset, loop, device, seed, comm) as run:
        with _Progress(progress, math.ceil(len(dataset) / max(batch_size, 1)), f"eval {task.name}") as bar:
            for b in run.batches(batch_size, max_batches, segments, bf16):
                logits, labels = b.out.logits.float(), b.labels
                mask = labels != IGNORE_INDEX
                token_nll = F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]),
                    labels.reshape(-1),
                    ignore_index=IGNORE_INDEX,
                    reduction="none",
                )
                nll += float(token_nll.double().sum())
                hit = (logits.argmax(-1) == labels) & mask
                right += float(hit.sum())
                count += float(mask.sum())
                exact += float((hit.sum(1) == mask.sum(1)).sum())
                steps += float(b.steps.sum())
                n += len(b.rows)
                bar.advance()
    nll, right, count, exact, steps, n = run.comm.sum([nll, right, count, exact, steps, n])
    loss = nll / count if count else float("nan")
    return LMEvalResult(
        task=task.name,
        n=int(n),
        tokens=int(count),
        loss=loss,
        bits_per_byte=bits_per_byte(loss, float(task.tokens_per_byte)),
        token_accuracy=right / count if count else float("nan"),
        exact_accuracy=exact / max(n, 1),
        mean_steps=steps / max(n, 1),
        loop=loop_summary(run.cfg),
    )


@dataclass
class LMBudgetPoint:
    budget: int
    bits_per_byte: float
    loss: float
    token_accuracy: float
    mean_steps: float


@dataclass
class LMBudgetCurve:
    """Bits per byte at each loop budget (``mode``: fixed | capped)."""

    mode: str
    points: list[LMBudgetPoint]

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "points": [dataclasses.asdict(p) for p in self.points]}


def lm_budget_curve(
    model: LoopedModel,
    task: Task,
    dataset: TokenDataset,
    budgets: list[int],
    mode: str = "capped",
    loop: LoopConfig | None = None,
    batch_size: int = 64,
    seed: int = 0,
) -> LMBudgetCurve:
    """``evaluate_lm`` at each loop budget b (one segment): ``fixed`` runs exactly b loops, ``capped`` the
    loop's own halting rule with the cap b (``loopformer.eval.budget.with_budget``)."""
    if not budgets:
        raise ValueError("give at least one loop budget")
    if mode not in BUDGET_MODES:
        raise ValueError(f"unknown budget mode {mode!r} (known: {', '.join(BUDGET_MODES)})")
    base = loop if loop is not None else model.config.loop
    points = []
    for b in sorted({int(b) for b in budgets}):
        r = evaluate_lm(
            model, task, dataset, loop=with_budget(base, b, mode), batch_size=batch_size, seed=seed
        )
        points.append(LMBudgetPoint(b, r.bits_per_byte, r.loss, r.token_accuracy, r.mean_steps))
    return LMBudgetCurve(mode, points)


@dataclass
class LMLoopCurve:
    """Per-loop language-modelling metrics of the logit lens (index 0 is loop 1)."""

    loops: list[int]
    bits_per_byte: list[float]
    loss: list[float]  # nats per labelled token
    token_accuracy: list[float]
    margin: list[float]  # mean (correct logit - best other logit) at the labelled positions
    train_depth: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@torch.no_grad()
def lm_logit_lens(
    model: LoopedModel,
    task: Task,
    dataset: TokenDataset,
    loops: int,
    loop: LoopConfig | None = None,
    batch_size: int = 64,
    max_batches: int | None = None,
    device: torch.device | str | None = None,
    train_depth: int | None = None,
    seed: int = 0,
) -> LMLoopCurve:
    """Every loop state t = 1..``loops`` (exactly ``loops`` fixed loops) read through the model's head:
    cross-entropy (float64 sums) as bits per byte, token accuracy and the logit margin per loop."""
    from loopformer.tasks.text import bits_per_byte

    if loops < 1:
        raise ValueError(f"loops must be >= 1, got {loops}")
    sums = {k: np.zeros(loops) for k in ("nll", "right", "count", "margin", "margin_n")}
    with _eval_mode(model, device) as device:
        cfg = _fixed(model, loop, loops, "fixed")
        generator = torch.Generator(device=device).manual_seed(seed)
        for index in iter_batches(dataset, batch_size, max_batches):
            inputs, labels, puzzle_ids = batch_tensors(dataset, index, device)

            def observe(t: int, z: Tensor, logits: Tensor, labels: Tensor = labels) -> None:
                if t > loops:
                    return
                k, logits = t - 1, logits.double()
                mask = labels != IGNORE_INDEX
                sums["nll"][k] += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                        ignore_index=IGNORE_INDEX, reduction="sum"))  # fmt: skip
                sums["right"][k] += float(((logits.argmax(-1) == labels) & mask).sum())
                sums["count"][k] += float(mask.sum())
                m = logit_margin(logits, labels)
                sums["margin"][k] += float(m[mask].sum())
                sums["margin_n"][k] += float(mask.sum())

            trace_loops(model, inputs, cfg, observe, puzzle_ids, generator)
    loss = _ratio(sums["nll"], sums["count"])
    per_byte = float(task.tokens_per_byte)
    return LMLoopCurve(
        loops=list(range(1, loops + 1)),
        bits_per_byte=[bits_per_byte(x, per_byte) if math.isfinite(x) else float("nan") for x in loss],
        loss=loss,
        token_accuracy=_ratio(sums["right"], sums["count"]),
        margin=_ratio(sums["margin"], sums["margin_n"]),
        train_depth=train_depth,
    )
