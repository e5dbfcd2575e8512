"""Language-modelling evaluation: held-out cross-entropy and bits per byte.

For tasks without a validator (``Task.has_validator`` False: text), over the same batch loop as
``loopformer.eval.evaluate.evaluate`` (``_EvalPass``: segments, sharding, lock-step).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from loopformer.eval.evaluate import EvalComm, _EvalPass, _Progress, loop_summary
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
