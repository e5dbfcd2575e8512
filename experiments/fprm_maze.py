"""FPRM on small mazes vs a plain transformer at equal parameters and equal training FLOPs (issue 7, item 3).

arXiv 2606.18206 reports FPRM on Maze-Hard (30x30, shortest path > 110); at CPU scale this uses
``recipes/fprm_maze7.yaml``: 7x7 character mazes, shortest path >= 4 moves. Measured:
- held-out accuracy judged by ``MazeTask.check`` (any *shortest* S->G path counts; recomputed by BFS from
  the input alone, the label is not trusted), against a plain 2-block transformer of equal width;
- equal training compute = equal training FLOPs (``FlopCounterMode`` over real training steps, as in
  ``experiments/fprm_sudoku.py``);
- loop steps to convergence vs shortest-path length (Spearman rho, p-value) and the damped solver vs
  Picard iteration at evaluation.

Usage: ``python experiments/fprm_maze.py [--quick]``; writes ``docs/figures/fprm_maze/results.json`` and
``steps_vs_path.png``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fprm_common import (
    MACHINE,
    REPO,
    ema_weights,
    flops_per_step,
    make_config,
    oscillation_stats,
    pyplot,
    run_eval,
    save_figure,
    script_parser,
    train,
    write_json,
)

from loopformer.eval.budget import easy_hard_steps, steps_vs_difficulty

RECIPE = REPO / "recipes" / "fprm_maze7.yaml"
BASELINE = [
    "model={name: transformer, d_model: 64, n_heads: 4, n_layers: 2}",
    "train.mode=simple",
    "loop_train={}",
    "loop_eval={}",
]


def main() -> None:
    parser = script_parser(__doc__, "fprm_maze", "fprm_maze7")
    parser.add_argument("--steps", type=int, default=0, help="FPRM optimiser steps (0 = the recipe's)")
    parser.add_argument(
        "--recipe", type=Path, default=RECIPE, help="FPRM recipe (default recipes/fprm_maze7.yaml)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for the FPRM run (repeatable), e.g. train.halt_on_converged=true",
    )
    args = parser.parse_args()
    recipe = args.recipe
    torch.set_num_threads(1)
    quick = (
        [
            "train.steps=3",
            "data.train_size=64",
            "data.eval_size=16",
            "train.batch_size=8",
            "eval.batch_size=16",
        ]
        if args.quick
        else []
    )
    if args.steps:
        quick.append(f"train.steps={args.steps}")
    t_start, load_start = time.perf_counter(), os.getloadavg()
    cfgs = {
        "fprm": make_config(recipe, [*args.overrides, *quick, f"out_dir={args.runs / 'fprm'}"]),
        "transformer": make_config(RECIPE, [*quick, *BASELINE, f"out_dir={args.runs / 'transformer'}"]),
    }
    flops = {n: flops_per_step(c, steps=2, out_dir=args.runs / "probe") for n, c in cfgs.items()}
    budget = flops["fprm"] * cfgs["fprm"].train.steps
    for name, cfg in cfgs.items():
        cfg.train.steps = max(1, round(budget / flops[name]))
    print({n: (f"{f / 1e9:.2f} GFLOP/step", cfgs[n].train.steps) for n, f in flops.items()}, flush=True)

    results: dict[str, Any] = {}
    evals: dict[str, Any] = {}
    for name, cfg in cfgs.items():
        trainer, summary = train(cfg)
        with ema_weights(trainer) as model:
            loop = trainer.loop_eval
            ev = run_eval(model, trainer.task, trainer.eval_data, loop, cfg.eval.batch_size, cfg.seed)
            entry: dict[str, Any] = {
                "parameters": trainer.model.num_parameters(),
                "train_steps": cfg.train.steps,
                "gflops_per_step": flops[name] / 1e9,
                "train_tflops": flops[name] * cfg.train.steps / 1e12,
                "train_wall_time_s": summary["wall_time"],
                "s_per_step": summary["s_per_step"],
                "final_train_metrics": summary["train"],
                "token_accuracy": summary["eval"].get("token_acc"),
                # token accuracy of predicting the input unchanged (the path cells are the only change)
                "copy_token_accuracy": float((trainer.eval_data.labels == trainer.eval_data.inputs).mean()),
                **ev.summary(),
            }
            if name == "fprm":
                evals["damped"] = ev
                stats = steps_vs_difficulty(ev.difficulty, ev.steps, ev.valid)
                entry["steps_vs_path_length"] = stats.to_dict()
                entry["easy_hard_steps"] = easy_hard_steps(ev.difficulty, ev.steps)
                entry["oscillation"] = oscillation_stats(ev.residuals, loop.tol)
                lp = dataclasses.replace(loop, solver="picard")
                e2 = run_eval(model, trainer.task, trainer.eval_data, lp, cfg.eval.batch_size, cfg.seed)
                s2 = steps_vs_difficulty(e2.difficulty, e2.steps, e2.valid)
                entry["picard"] = {
                    **e2.summary(),
                    "oscillation": oscillation_stats(e2.residuals, lp.tol),
                    "spearman_rho": s2.spearman_rho,
                    "spearman_p": s2.spearman_p,
                }
                evals["picard"] = e2
        results[name] = entry
        print(
            name,
            {k: entry[k] for k in ("valid_accuracy", "token_accuracy", "mean_steps", "train_steps")},
            flush=True,
        )
    dc = cfgs["fprm"].data
    payload = {
        "command": "python experiments/fprm_maze.py"
        + (" --quick" if args.quick else "")
        + (f" --steps {args.steps}" if args.steps else "")
        + (f" --recipe {recipe}" if recipe != RECIPE else "")
        + "".join(f" --set {o}" for o in args.overrides),
        "recipe": str(recipe if recipe != RECIPE else RECIPE.relative_to(REPO)),
        "compute_matching": "equal training FLOPs (FlopCounterMode, forward + backward, mean of 2 measured steps)",
        "baseline_overrides": BASELINE,
        "task": {
            "name": "maze",
            "options": dc.options,
            "train": {"n": dc.train_size, **dc.train_generate},
            "eval": {"n": dc.eval_size, **dc.eval_generate},
        },
        "machine": MACHINE,
        "flops_per_step": flops,
        "results": results,
        "wall_time_s": round(time.perf_counter() - t_start, 1),
        "load_average": {"start": list(load_start), "end": list(os.getloadavg())},
    }
    write_json(args.out / "results.json", payload)
    plot(evals, args.out / "steps_vs_path.png")
    print(f"wrote {args.out / 'results.json'}")


def plot(evals: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for label, style in (("damped", "o-"), ("picard", "s--")):
        ev = evals[label]
        xs = np.unique(ev.difficulty)
        axes[0].plot(xs, [ev.steps[ev.difficulty == x].mean() for x in xs], style, markersize=3, label=label)
        axes[1].plot(xs, [ev.valid[ev.difficulty == x].mean() for x in xs], style, markersize=3, label=label)
    axes[0].set(xlabel="shortest path length (moves)", ylabel="mean loop steps")
    axes[0].set_title("FPRM: steps to fixed point vs path length", fontsize=9)
    axes[1].set(xlabel="shortest path length (moves)", ylabel="valid accuracy", ylim=(-0.02, 1.02))
    axes[1].set_title("held-out accuracy vs path length", fontsize=9)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
