"""Shared pieces of the FPRM reproduction scripts (experiments/fprm_*.py; arXiv 2606.18206; TRM arXiv 2510.04871, HRM arXiv 2506.21734).

Everything goes through the library's harness: recipes are read with ``loopformer.config``
(``read_recipe`` + ``build_config``), models are trained by ``loopformer.train.Trainer`` and scored with
the task's independent validator (``loopformer.eval.evaluate.score_predictions``). What lives here:

- ``make_config``: a recipe plus ``key=value`` overrides, forced to one CPU thread, no progress bar;
- ``train``: a Trainer run that returns the trainer (weights in memory) and its summary;
- ``probe_config``: a config cut down to probe its training steps;
- ``flops_per_step``: forward + backward FLOPs of one training step, counted by
  ``torch.utils.flop_counter.FlopCounterMode`` (matmuls, attention, convolutions), averaged over a few
  steps (adaptive models such as UT + ACT change their loop count from step to step);
- ``saved_bytes_per_step``: bytes autograd saves for backward in one training step
  (``torch.autograd.graph.saved_tensors_hooks`` sees every saved tensor: the activation memory that
  differs between gradient modes);
- ``run_eval``: one pass of a model over a dataset with a loop config, keeping per-example steps,
  convergence, validity and the residual trace (for the damped-vs-Picard oscillation count);
- ``plot`` helpers that keep PNGs small.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from loopformer.config import RunConfig, build_config, read_recipe
from loopformer.eval.evaluate import batch_tensors, iter_batches, score_predictions
from loopformer.files import atomic_write_text
from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel
from loopformer.tasks.base import Task, TokenDataset
from loopformer.train.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent
MACHINE = "2-core CPU shared with other jobs, torch float32, 1 thread"


def script_parser(
    doc: str, figures: str, runs: str, quick_help: str = "a few steps at tiny size (dry run)"
) -> argparse.ArgumentParser:
    """The FPRM scripts' command line: ``--quick`` (dry run), ``--out`` (default docs/figures/<figures>)
    and ``--runs`` (default runs/<runs>); the description is the first line of the docstring ``doc``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "figures" / figures)
    parser.add_argument("--runs", type=Path, default=REPO / "runs" / runs)
    return parser


def make_config(recipe: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """RunConfig of ``recipe`` (the ``run:`` table of ``loopformer run`` recipes dropped) + overrides,
    on one CPU thread with no progress bar (experiments share a loaded 2-core machine)."""
    raw = read_recipe(recipe)
    raw.pop("run", None)
    forced = ["train.threads=1", "train.progress=false", "device=cpu"]
    return build_config(raw, [*overrides, *forced])


def train(cfg: RunConfig) -> tuple[Trainer, dict[str, Any]]:
    """Train ``cfg`` with the library's Trainer; the summary gains ``wall_time`` (s, all of it),
    ``train_loop_time`` and ``s_per_step`` (optimiser steps only)."""
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    summary = trainer.fit()
    summary["wall_time"] = round(time.perf_counter() - t0, 2)
    # time inside the training loop only (no data generation, model construction or final evaluation)
    loop_time = summary.get("train", {}).get("time", summary["wall_time"])
    summary["train_loop_time"] = loop_time
    summary["s_per_step"] = loop_time / max(1, cfg.train.steps)
    return trainer, summary


def probe_config(cfg: RunConfig, out_dir: str | Path, *, curriculum: bool = True) -> RunConfig:
    """``cfg`` cut down to probe its training steps (FLOPs, time): written under ``out_dir``, a training
    set of four batches, no evaluation; ``curriculum=False`` also switches the curriculum off (its checks
    would evaluate). The FLOPs counts, the head-to-head clock and the contraction benchmark share it."""
    probe = dataclasses.replace(cfg, out_dir=str(out_dir))
    probe.data = dataclasses.replace(
        cfg.data, train_size=min(cfg.data.train_size, 4 * cfg.train.batch_size), eval_size=0
    )
    if not curriculum:
        probe.data.curriculum = dataclasses.replace(probe.data.curriculum, enabled=False)
    return probe


def flops_per_step(cfg: RunConfig, steps: int = 3, out_dir: str | Path = "runs/fprm_probe") -> float:
    """Mean forward + backward FLOPs of one training step of ``cfg`` (after one warm-up step)."""
    probe = probe_config(cfg, out_dir)
    torch.set_num_threads(1)
    trainer = Trainer(probe)
    try:
        trainer.train_step()
        trainer.step += 1
        total = 0
        for _ in range(steps):
            with FlopCounterMode(display=False) as counter:
                trainer.train_step()
            trainer.step += 1
            total += counter.get_total_flops()
    finally:
        trainer.folder.close()  # the probe's run-folder lock, which fit() would release
    return total / steps


def saved_bytes_per_step(trainer: Trainer) -> int:
    """Bytes of the tensors autograd saves for backward during one training step of ``trainer``."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[id(t)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.train_step()
    trainer.step += 1
    return int(sum(seen.values()))


@dataclasses.dataclass
class EvalPass:
    """Per-example results of ``run_eval``."""

    difficulty: np.ndarray
    steps: np.ndarray
    converged: np.ndarray
    valid: np.ndarray
    exact: np.ndarray
    final_residual: np.ndarray
    residuals: list[np.ndarray]  # per example, its residual trace (finite part)

    def summary(self) -> dict[str, float]:
        return {
            "n": int(len(self.valid)),
            "valid_accuracy": float(self.valid.mean()),
            "exact_accuracy": float(self.exact.mean()),
            "mean_steps": float(self.steps.mean()),
            "converged_fraction": float(self.converged.mean()),
        }


@torch.no_grad()
def run_eval(
    model: LoopedModel,
    task: Task,
    dataset: TokenDataset,
    loop: LoopConfig,
    batch_size: int = 256,
    seed: int = 0,
) -> EvalPass:
    """Evaluate ``model`` with ``loop`` (initial iterate from a generator seeded with ``seed``)."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    diff, steps, conv, valid, exact, final, traces = [], [], [], [], [], [], []
    for index in iter_batches(dataset, batch_size):
        inputs, labels, puzzle_ids = batch_tensors(dataset, index, "cpu")
        out = model(inputs, loop=loop, puzzle_ids=puzzle_ids, generator=gen)
        pred = out.logits.argmax(-1).numpy()
        ex, va, _, _ = score_predictions(task, dataset.inputs[index], dataset.labels[index], pred)
        res = out.loop.residuals.float().numpy()  # [steps_run, B]
        for j in range(res.shape[1]):
            col = res[:, j]
            col = col[np.isfinite(col)]
            traces.append(col)
            final.append(float(col[-1]) if len(col) else float("nan"))
        diff.append(dataset.difficulty[index])
        steps.append(out.loop.steps.numpy())
        conv.append(out.loop.converged.numpy())
        valid.append(va)
        exact.append(ex)
    cat = np.concatenate
    return EvalPass(
        cat(diff), cat(steps), cat(conv).astype(bool), cat(valid), cat(exact), np.asarray(final), traces
    )


def oscillation_stats(traces: list[np.ndarray], tol: float, window: int = 16) -> dict[str, Any]:
    """Classify residual traces that never fell below ``tol``.

    A trace *oscillates* when, over its last ``window`` steps, the residual changes direction at least
    ``window // 2`` times (up-down-up...) and never drops below tol; it *stalls* when it is above tol
    but moves monotonically / slowly. Counts only; ``converged`` is trace[-1] < tol.
    """
    n_conv = n_osc = n_stall = 0
    for tr in traces:
        if len(tr) and tr[-1] < tol:
            n_conv += 1
            continue
        tail = tr[-window:]
        d = np.sign(np.diff(tail))
        flips = int((d[1:] * d[:-1] < 0).sum()) if len(d) > 1 else 0
        if flips >= window // 2:
            n_osc += 1
        else:
            n_stall += 1
    return {"converged": n_conv, "oscillating": n_osc, "not_converged_other": n_stall, "n": len(traces)}


def write_json(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)

    def default(o: Any) -> Any:
        if isinstance(o, np.integer):
            return int(o)
        if isinstance(o, np.floating):
            return float(o)
        if isinstance(o, np.ndarray):
            return o.tolist()
        if isinstance(o, Path):
            return str(o)
        raise TypeError(f"cannot serialise {type(o).__name__}")

    atomic_write_text(path, json.dumps(payload, indent=1, default=default) + "\n")


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int = 90) -> str:
    """Lay out ``fig``, write it to ``path`` and close it; returns the file's name."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path.name


@contextlib.contextmanager
def ema_weights(trainer: Trainer):
    """The trainer's model with its EMA weights applied (the papers evaluate the EMA)."""
    if trainer.ema is not None and trainer.config.eval.use_ema:
        with trainer.ema.applied(trainer.model):
            yield trainer.model
    else:
        yield trainer.model
