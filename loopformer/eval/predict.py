"""Arg-max predictions of a model on a dataset, and ARC's pass@k voted over augmentations."""

from __future__ import annotations

import numpy as np
import torch

from loopformer.eval.evaluate import _EvalPass
from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel
from loopformer.tasks.base import Task, TokenDataset


@torch.no_grad()
def predict(
    model: LoopedModel,
    dataset: TokenDataset,
    loop: LoopConfig | None = None,
    batch_size: int = 64,
    device: torch.device | str | None = None,
    seed: int = 0,
    *,
    segments: int = 1,
) -> np.ndarray:
    """Arg-max predictions [N, T] of ``model`` on every row of ``dataset`` (after ``segments`` chained
    calls carrying the state, as ``evaluate``)."""
    rows = []
    with _EvalPass(model, dataset, loop, device, seed) as run:
        for b in run.batches(batch_size, segments=segments):
            rows.append(b.out.logits.argmax(-1).cpu().numpy())
    return np.concatenate(rows) if rows else np.zeros((0, dataset.inputs.shape[1]), dtype=np.int64)


def arc_pass_at_k(
    model: LoopedModel,
    task: Task,
    dataset: TokenDataset | None = None,
    loop: LoopConfig | None = None,
    k: int = 2,
    batch_size: int = 64,
    device: torch.device | str | None = None,
    seed: int = 0,
    *,
    segments: int = 1,
) -> dict[str, float]:
    """ARC pass@k with voting over augmentations: ``task.evaluate`` of the model's predictions on
    ``dataset`` (default: every test pair under every augmentation version,
    ``task.generate(0, seed, part="test")``). Returns ``ArcTask.evaluate``'s dictionary
    (``score``, ``all_solved``, ``outputs_solved``, ``outputs``, ``tasks``) plus ``k`` and ``rows``.
    ``segments``: chained calls carrying the state per batch (TRM / HRM: 16), as ``evaluate``.
    """
    from loopformer.tasks.arc import ArcTask

    if not isinstance(task, ArcTask):
        raise TypeError(f"arc_pass_at_k needs an ARC task, got {task.name!r}")
    if dataset is None:
        dataset = task.generate(0, seed, part="test")
    if dataset.puzzle_ids is None:
        raise ValueError(
            "ARC pass@k needs puzzle ids on the dataset (task, augmentation version of every row)"
        )
    predictions, q_logits = [], []  # the halting head's logits break vote ties (TRM evaluators/arc.py)
    with torch.no_grad(), _EvalPass(model, dataset, loop, device, seed) as run:
        for b in run.batches(batch_size, segments=segments):
            predictions.append(b.out.logits.argmax(-1).cpu().numpy())
            q_logits.append(None if b.out.q_logits is None else b.out.q_logits.float().cpu().numpy())
    preds = np.concatenate(predictions) if predictions else np.zeros((0, dataset.inputs.shape[1]), dtype=np.int64)
    q = None if not q_logits or any(x is None for x in q_logits) else np.concatenate(q_logits)
    result = task.evaluate(dataset.inputs, dataset.puzzle_ids, preds, k, q_logits=q)
    return {**result, "k": float(k), "rows": float(len(dataset))}
