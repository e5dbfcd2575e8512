"""Damped patience solver vs plain Picard iteration at evaluation, over convergence tolerances (issue 7, item 2).

arXiv 2606.18206 (Algorithm 1, Theorem 3): FPRM evaluates with a damped solver whose step eta
shrinks by gamma whenever the relative sup-norm residual has not improved for ``patience`` iterations;
damping removes oscillation around the fixed point when the step's Jacobian has eigenvalues with modulus
>= 1. This loads the FPRM trained by ``experiments/fprm_sudoku.py`` (``runs/fprm_sudoku4/fprm``, EMA
weights) and evaluates the same held-out puzzles with Picard and with damping (gamma 0.99, the paper's
evaluation value, and 0.9, its training value), patience 5, at tolerances 0.1 (the paper's eps), 0.01
and 0.001, step cap 256. Per setting: valid accuracy (independent validator), mean loops, how many
puzzles converge, and how many of the rest oscillate (residual changing direction in at least half of
its last 16 steps) or stall, plus the Jacobian spectral radius at the final iterate for a few puzzles.

Usage: ``python experiments/fprm_solvers.py [--quick] [--run runs/fprm_sudoku4/fprm]``; writes
``docs/figures/fprm_solvers/results.json`` and ``solvers.png``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fprm_common import (
    MACHINE,
    REPO,
    oscillation_stats,
    pyplot,
    run_eval,
    save_figure,
    script_parser,
    write_json,
)

from loopformer.eval.analysis import spectral_radius_at_fixed_point, spectral_radius_summary
from loopformer.eval.budget import steps_vs_difficulty
from loopformer.runs import eval_dataset, load_run

TOLS = (0.1, 0.01, 0.001)
SOLVERS: dict[str, dict[str, Any]] = {
    "picard": {"solver": "picard"},
    "damped_gamma0.99": {"solver": "damped", "plugins": {"damped": {"gamma": 0.99, "patience": 5}}},
    "damped_gamma0.9": {"solver": "damped", "plugins": {"damped": {"gamma": 0.9, "patience": 5}}},
}


def main() -> None:
    parser = script_parser(__doc__, "fprm_solvers", "fprm_solvers",
                           quick_help="a tiny model trained for 2 steps, cap 8 (dry run)")
    parser.add_argument("--run", type=Path, default=REPO / "runs" / "fprm_sudoku4" / "fprm")
    parser.add_argument("--cap", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    run_path, cap = args.run, args.cap
    if args.quick:  # train a throwaway model so the dry run needs no earlier experiment
        from fprm_common import make_config, train

        cfg = make_config(REPO / "recipes" / "default_800steps.yaml",
                          ["train.steps=2", "data.train_size=32", "data.eval_size=16", "train.batch_size=8",
                           f"out_dir={args.runs / 'quick_model'}"])
        train(cfg)
        run_path, cap = args.runs / "quick_model", 8
    run = load_run(run_path, use_ema=True)
    data = eval_dataset(run.task, run.config)
    base = dataclasses.replace(run.loop_eval, max_steps=cap, halting="residual")
    results: dict[str, Any] = {}
    for tol in TOLS:
        for label, change in SOLVERS.items():
            loop = dataclasses.replace(base, tol=tol, **change)
            ev = run_eval(run.model, run.task, data, loop, batch_size=300, seed=run.config.seed)
            stats = steps_vs_difficulty(ev.difficulty, ev.steps, ev.valid)
            not_conv = ~ev.converged
            results[f"{label}@tol{tol:g}"] = {
                "solver": label, "tol": tol, "cap": cap, **ev.summary(),
                "oscillation": oscillation_stats(ev.residuals, tol),
                "valid_among_not_converged": float(ev.valid[not_conv].mean()) if not_conv.any() else None,
                "median_final_residual_not_converged": float(np.median(ev.final_residual[not_conv]))
                if not_conv.any() else None,
                "spearman_rho": stats.spearman_rho, "spearman_p": stats.spearman_p,
            }
            r = results[f"{label}@tol{tol:g}"]
            print(f"{label:18s} tol {tol:<6g} valid {r['valid_accuracy']:.3f} loops {r['mean_steps']:.1f} "
                  f"osc {r['oscillation']}", flush=True)
    # Jacobian spectral radius of the step at the final iterate (damped, tol 0.001): first 64 puzzles, and
    # the puzzles Picard failed to converge on at tol 0.01 (Theorem 3: damping helps when |lambda| >= 1)
    loop = dataclasses.replace(base, tol=0.001, **SOLVERS["damped_gamma0.99"])
    n_spec = min(len(data), 16 if args.quick else 64)
    inputs = torch.as_tensor(data.inputs[:n_spec])
    radii = spectral_radius_at_fixed_point(run.model, inputs, loop=loop, iters=60, seed=run.config.seed)
    spectral = {"first_puzzles": {"n": n_spec, **spectral_radius_summary(radii)}}
    picard_loop = dataclasses.replace(base, tol=0.01, **SOLVERS["picard"])
    ev = run_eval(run.model, run.task, data, picard_loop, batch_size=300, seed=run.config.seed)
    bad = np.flatnonzero(~ev.converged)[:32]
    if len(bad):
        radii_bad = spectral_radius_at_fixed_point(run.model, torch.as_tensor(data.inputs[bad]), loop=loop,
                                                   iters=60, seed=run.config.seed)
        spectral["picard_not_converged_tol0.01"] = {"n": int(len(bad)), **spectral_radius_summary(radii_bad)}
    print("spectral radius", spectral, flush=True)
    payload = {
        "spectral_radius_at_final_iterate": spectral,
        "command": "python experiments/fprm_solvers.py" + (" --quick" if args.quick else ""),
        "checkpoint": str(run.path.relative_to(REPO)) if run.path.is_relative_to(REPO) else str(run.path),
        "weights": run.weights,
        "n": len(data),
        "machine": MACHINE,
        "results": results,
        "wall_time_s": round(time.perf_counter() - t_start, 1),
    }
    write_json(args.out / "results.json", payload)
    plot(results, args.out / "solvers.png")
    print(f"wrote {args.out / 'results.json'}")


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for i, label in enumerate(SOLVERS):
        rows = [results[f"{label}@tol{t:g}"] for t in TOLS]
        axes[0].plot(TOLS, [1 - r["converged_fraction"] for r in rows], "o-", color=f"C{i}", label=label)
        axes[1].plot(TOLS, [r["mean_steps"] for r in rows], "o-", color=f"C{i}", label=label)
        axes[2].plot(TOLS, [r["valid_accuracy"] for r in rows], "o-", color=f"C{i}", label=label)
    titles = ("fraction not converged (cap)", "mean loops", "valid accuracy")
    for ax, title in zip(axes, titles):
        ax.set_xscale("log")
        ax.invert_xaxis()
        ax.set_xlabel("tolerance (relative sup-norm residual)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
