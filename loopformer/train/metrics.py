"""Evaluation during training, metrics and the run's logs.

- ``exact_eval``: label-based accuracy (token / exact match) of the current weights, over
  ``eval.segments`` chained forward calls as TRM / HRM evaluate (arXiv 2606.18206; TRM arXiv 2510.04871, HRM arXiv 2506.21734),
  sharded over ranks under DDP.
- ``task_eval``: ``loopformer.eval.evaluate`` with the task's own validator, or, for a task
  without one (text), ``evaluate_lm``'s loss and bits per byte.
- ``reduce_metrics``: per-rank training metrics averaged over ranks; ``last_finite`` for the
  loop's residual traces.
- the run folder's logs: ``prepare_run_dir`` (config, stale metrics / checkpoints, TensorBoard),
  ``write_metrics`` (one JSONL line, mirrored to TensorBoard) and the rich progress bar.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from loopformer.config import EvalConfig, RunConfig, save_config
from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel
from loopformer.nn import autocast
from loopformer.tasks.base import Task, TokenDataset
from loopformer.train import dist
from loopformer.train.data import Batch, make_batch
from loopformer.train.losses import accuracy

log = logging.getLogger("loopformer.train")


def last_finite(rows: Tensor) -> Tensor:
    """Per column, the last non-NaN value of a [steps, B] trace (NaN when none)."""
    finite = ~torch.isnan(rows)
    if rows.numel() == 0:
        return rows.new_full(rows.shape[1:], float("nan"))
    last = (finite.cumsum(0) == finite.sum(0, keepdim=True)) & finite
    vals = torch.where(last, rows, torch.zeros_like(rows)).sum(0)
    return torch.where(finite.any(0), vals, torch.full_like(vals, float("nan")))


# ----------------------------------------------------------------------------------------------
# evaluation
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def exact_eval(
    model: LoopedModel,
    dataset: TokenDataset,
    rows: np.ndarray | None,
    loop: LoopConfig,
    ec: EvalConfig,
    device: torch.device,
    seed: int,
    bf16: bool,
    sync_halting: bool,
) -> dict:
    """Label-based accuracy of ``model``: token_acc, exact_acc, loop_steps, n.

    Runs ``ec.segments`` chained forward calls (the state carried), as TRM / HRM evaluate.
    Under DDP each rank evaluates its share of the rows and the counts are summed over ranks
    (FSDP: every rank evaluates all rows, since each forward gathers the weights on all ranks).
    With ``sync_halting`` every forward ends on the same global loop count on all ranks.
    """
    rows = np.arange(len(dataset)) if rows is None else np.asarray(rows)
    if ec.max_examples:
        rows = rows[: ec.max_examples]
    sharded = dist.is_distributed() and not dist.is_fsdp(model)
    local = rows[dist.eval_shard(len(rows))] if sharded else rows
    segments = max(1, ec.segments)
    lockstep = dist.LockstepHalting(sync_halting)
    n_batches = math.ceil(len(local) / ec.batch_size)
    if lockstep.enabled:  # a rank with fewer batches answers the others' lockstep all-reduces
        n_batches = int(dist.all_reduce_max(n_batches))
    was_training = model.training
    model.eval()
    generator = torch.Generator(device=device).manual_seed(seed)
    right = count = exact = steps = 0.0
    try:
        for start in range(0, n_batches * ec.batch_size, ec.batch_size):
            if start >= len(local):
                for _ in range(segments):
                    lockstep.drain()
                continue
            b: Batch = make_batch(dataset, local[start : start + ec.batch_size], device)
            state = None
            seg_steps = torch.zeros(len(b.index))
            for _ in range(segments):
                with autocast(device, bf16):
                    out = model(
                        b.inputs, loop=loop, state=state, puzzle_ids=b.puzzle_ids, generator=generator,
                        callback=lockstep.callback if lockstep.enabled else None,
                    )
                lockstep.drain()
                state = out.state
                if out.loop is not None:
                    seg_steps += out.loop.steps.float().cpu()
            acc = accuracy(out.logits, b.labels)
            right += float(acc.token_correct.sum())
            count += float(acc.token_count.sum())
            exact += float(acc.exact.sum())
            steps += float(seg_steps.sum())
    finally:
        model.train(was_training)
    if sharded:
        right, count, exact, steps = dist.all_reduce_sum([right, count, exact, steps])
    n = len(rows)
    return {
        "n": n,
        "token_acc": right / max(count, 1.0),
        "exact_acc": exact / max(n, 1),
        "loop_steps": steps / max(n, 1),
    }


def task_eval(
    model: LoopedModel,
    task: Task,
    data: TokenDataset,
    has_validator: bool,
    loop: LoopConfig,
    ec: EvalConfig,
    device: torch.device,
    seed: int,
) -> dict[str, Any]:
    """``loopformer.eval.evaluate`` on ``data`` (the task's own validator); a task without a
    validator (text) gets ``evaluate_lm``: loss (nats per token) and bits per byte."""
    from loopformer.eval.evaluate import evaluate, evaluate_lm

    if ec.max_examples:
        data = data.subset(slice(0, ec.max_examples))
    if not has_validator:
        lm = evaluate_lm(model, task, data, loop=loop, batch_size=ec.batch_size, device=device, seed=seed)
        return {"n": lm.n, "loss": lm.loss, "bits_per_byte": lm.bits_per_byte, "token_acc": lm.token_accuracy,
                "exact_acc": lm.exact_accuracy, "loop_steps": lm.mean_steps}
    res = evaluate(model, task, data, loop=loop, batch_size=ec.batch_size, device=device, seed=seed)
    return {
        "n": res.n,
        "token_acc": res.token_accuracy,
        "exact_acc": res.exact_accuracy,
        "valid_acc": res.valid_accuracy,
        "loop_steps": res.mean_steps,
        "converged": res.converged_fraction,
    }


def reduce_metrics(metrics: dict[str, Any], world_size: int) -> dict[str, Any]:
    """Per-rank metrics -> their mean over ranks ("halted": the total); shared values kept."""
    shared = ("step", "lr", "grad_norm", "loops", "level")
    keys = [k for k, v in metrics.items()
            if k not in shared and isinstance(v, int | float) and not isinstance(v, bool)]
    mean = dist.all_reduce_mean({k: metrics[k] for k in keys})
    out = {**metrics, **mean}
    if "halted" in out:
        out["halted"] = int(round(mean["halted"] * world_size))
    return out


# ----------------------------------------------------------------------------------------------
# the run folder's logs
# ----------------------------------------------------------------------------------------------
def prepare_run_dir(config: RunConfig, run_dir: Path, ckpt_dir: Path, resumed: bool, step: int) -> Any:
    """Write the config; a resumed run drops the metrics its killed predecessor wrote past ``step``.

    Returns the run's ``loopformer.tracking.Trackers`` (TensorBoard, W&B) when any is on, else None.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, run_dir)
    metrics = run_dir / "metrics.jsonl"
    if resumed and metrics.is_file():  # drop lines the killed run wrote after it
        kept = [line for line in metrics.read_text(errors="replace").splitlines() if _step_of(line) <= step]
        metrics.write_text("".join(line + "\n" for line in kept))
    # a fresh run never deletes anything: loopformer.train.run_folder refused a folder holding a run
    # (or, with --overwrite, made this a staging folder that replaces the old run at the first checkpoint)
    from loopformer.tracking import open_trackers

    return open_trackers(config, run_dir)  # TensorBoard / W&B when asked


def _step_of(line: str) -> float:
    """A metrics line's step; infinity for a line a killed run left torn (dropped on resume)."""
    try:
        record = json.loads(line)
        return float(record.get("step", 0))
    except (ValueError, AttributeError, TypeError):
        return math.inf


def write_metrics(run_dir: Path, record: dict[str, Any], tb: Any, step: int) -> None:
    """Append ``record`` to ``metrics.jsonl`` (and its numbers to TensorBoard ``tb`` when given)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps(record) + "\n")
    if tb is not None:
        numbers = {k: v for k, v in record.items()
                   if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)}  # fmt: skip
        tb.log(numbers, record.get("step", step))


def bar_info(m: dict[str, Any]) -> str:
    """The progress bar's text for one step's metrics."""
    parts = [f"loss {m['loss']:.4f}", f"acc {m['token_acc']:.3f}/{m['exact_acc']:.3f}"]
    if "loop_steps" in m:
        parts.append(f"loops {m['loop_steps']:.1f}")
    if "level" in m:
        parts.append(f"level {m['level']:g}")
    return "  ".join(parts)


def progress_bar(enabled: bool, total: int, start: int) -> Any:
    """A rich progress bar (a context manager yielding None when disabled)."""
    if not enabled:
        return _NoBar()
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
    )


class _NoBar:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
