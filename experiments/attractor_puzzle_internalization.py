"""Attractor puzzle model (TRM-DEQ) on 4x4 Sudoku, CPU-sized: accuracy and inner-solve iterations.

The Attractor paper's puzzle numbers come from ``loopformer.models.attractor_puzzle`` (TRM whose inner
latent recursion is an Anderson solve; github jacobfa/Attractor,
``experiments/attractor_puzzles/trm/trm_deq.py``). Its "equilibrium internalization" claim, read for
this model: the inner solve, warm-started from the carried ``z_L``, needs fewer iterations as training
goes on, and few inner iterations at inference already give peak accuracy.

With the library's own harness (``load_config`` on ``recipes/attractor_puzzle_sudoku4.yaml`` +
``loopformer.train.Trainer``) this script trains the model and records, at every logged step, the inner
solve's mean iteration count and its relative residual at the start and at the end (the differentiable
outer cycle of that step, ``model.last_inner``). After training it evaluates held-out accuracy (exact and
token accuracy over ``eval.segments`` chained segments, EMA weights) with the inner solve capped at 1, 2, 4 iterations
and with the recipe's adaptive solve.

Usage: ``python experiments/attractor_puzzle_internalization.py [--quick] [--steps N] [--set K=V] [--out DIR]`` writes
``DIR/attractor_puzzle_internalization.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling fprm_common.py
from fprm_common import MACHINE, script_parser

from loopformer.config import load_config
from loopformer.models.attractor_puzzle import AttractorPuzzle
from loopformer.train import Trainer

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "attractor_puzzle_sudoku4.yaml"
INNER_BUDGETS = (1, 2, 4)


class InnerTrainer(Trainer):
    """The library's Trainer, plus the inner solve's iteration count and residuals in the metrics."""

    def train_step(self) -> dict[str, Any]:
        metrics = super().train_step()
        inner = self.model.last_inner  # type: ignore[union-attr]
        if inner is not None:
            res = inner.residuals.detach().float()
            metrics["inner_steps"] = float(inner.steps.float().mean())
            metrics["inner_res_first"] = float(torch.nanmean(res[0])) if res.numel() else float("nan")
            metrics["inner_converged"] = float(inner.converged.float().mean())
        return metrics


def with_inner(model: AttractorPuzzle, steps: int | None) -> None:
    """Cap the inner solve at ``steps`` iterations (fixed count), or restore the recipe's (None)."""
    cfg = model.config.inner_loop()
    if steps is not None:
        cfg = dataclasses.replace(cfg, halting="fixed", max_steps=steps, min_steps=0)
    model.solve_loop = cfg


def inference_table(trainer: Trainer) -> list[dict[str, Any]]:
    model, rows = trainer.model, []
    assert isinstance(model, AttractorPuzzle)
    for budget in (*INNER_BUDGETS, None):
        with_inner(model, budget)
        res = trainer.evaluate()  # eval.segments chained segments, EMA weights (label-based accuracy)
        rows.append(
            {
                "inner_iterations": "adaptive" if budget is None else budget,
                "exact_accuracy": res["exact_acc"],
                "token_accuracy": res["token_acc"],
            }
        )
    with_inner(model, None)
    return rows


def main() -> None:
    parser = script_parser(__doc__, "attractor_puzzle", "attractor_puzzle")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override")
    args = parser.parse_args()
    overrides = [f"out_dir={args.runs / 'run'}", "train.progress=false", "train.threads=1", *args.set]
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.quick:
        overrides += [
            "train.steps=4",
            "train.log_every=2",
            "train.eval_every=0",
            "train.checkpoint_every=0",
            "data.train_size=64",
            "data.eval_size=16",
            "train.batch_size=8",
            "eval.segments=2",
            "train.max_segments=2",
            "model.d_model=16",
            "model.n_heads=2",
        ]
    cfg = load_config(RECIPE, overrides)
    torch.manual_seed(cfg.seed)
    load_before = os.getloadavg()
    trainer = InnerTrainer(cfg)
    t0 = time.perf_counter()
    summary = trainer.fit()
    wall = time.perf_counter() - t0
    log = [
        json.loads(line) for line in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines() if line
    ]
    keys = (
        "step",
        "loss",
        "task_loss",
        "ponder",
        "token_acc",
        "exact_acc",
        "inner_steps",
        "inner_res_first",
        "inner_converged",
        "segments",
    )
    history = [{k: r[k] for k in keys if k in r} for r in log if "inner_steps" in r]
    n = len(history)
    windows = [history[: max(1, n // 4)], history[-max(1, n // 4) :]]
    result = {
        "recipe": str(RECIPE.name),
        "overrides": overrides,
        "machine": MACHINE,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "parameters": summary["parameters"],
        "wall_time_s": round(wall, 1),
        "final_eval": summary["eval"],
        "windows": [
            {
                "steps": [w[0]["step"], w[-1]["step"]],
                **{k: float(np.mean([r[k] for r in w])) for k in ("inner_steps", "inner_res_first", "loss")},
            }
            for w in windows
        ],
        "inference": inference_table(trainer),
        "history": history,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "attractor_puzzle_internalization.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(
        json.dumps(
            {k: result[k] for k in ("parameters", "wall_time_s", "final_eval", "windows", "inference")},
            indent=1,
        )
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
