"""FPRM on small Sudoku vs a plain transformer, TRM and UT + ACT at equal parameters and equal training FLOPs.

Reproduces, at CPU scale, arXiv 2606.18206's Sudoku claims (issue 7, item 2):
- exact accuracy on held-out puzzles, judged by the task's independent validator (``SudokuTask.check``
  re-checks every row / column / box and the givens, without the label), against the baselines of
  TRM arXiv 2510.04871, HRM arXiv 2506.21734 at (nearly) equal parameter counts;
- *equal training compute = equal training FLOPs*: FPRM trains ``recipes/default_800steps.yaml``'s step count;
  every baseline's step count is FPRM's total training FLOPs divided by the baseline's FLOPs per step, both
  counted by ``torch.utils.flop_counter.FlopCounterMode`` over real training steps (forward + backward);
- adaptive compute: loop steps to convergence vs the number of blanks (Spearman rho and p-value);
- the damped patience solver (Algorithm 1, gamma 0.99) vs plain Picard iteration at evaluation: accuracy,
  steps, how many examples fail to converge and how many of those oscillate.

Usage: ``python experiments/fprm_sudoku.py [--quick] [--out docs/figures/fprm_sudoku]``; writes
``results.json``, ``steps_vs_blanks.png`` and ``residual_traces.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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

RECIPE = REPO / "recipes" / "default_800steps.yaml"
SHARED = "d_model: 64, n_heads: 4, n_layers: 2"
# baselines: the FPRM recipe with the model table replaced (equal width / heads / layers -> equal parameters)
BASELINES: dict[str, list[str]] = {
    "transformer": [f"model={{name: transformer, {SHARED}}}", "train.mode=simple", "loop_train={}", "loop_eval={}"],
    "trm": [f"model={{name: trm, {SHARED}, n_inner: 3}}", "train.halt_on_q=true", "train.halt_exploration=0.1",
            "loop_train={}", "loop_eval={}"],
    "ut_act": [f"model={{name: ut_act, {SHARED}}}", "train.mode=simple", "loop_train={}", "loop_eval={}"],
}


def eval_loop(name: str, trainer: Any) -> Any:
    """The evaluation loop of each family: FPRM its damped fixed-point loop; TRM all max_segments
    segments chained (T cycles each, no halting at evaluation, TRM arXiv 2510.04871, HRM arXiv 2506.21734); UT its ACT loop."""
    loop = trainer.loop_eval
    if name == "trm":
        loop = dataclasses.replace(loop, max_steps=loop.max_steps * trainer.config.train.max_segments)
    return loop


def main() -> None:
    parser = script_parser(__doc__, "fprm_sudoku", "fprm_sudoku4")
    parser.add_argument("--only", default="", help="comma-separated subset of fprm,transformer,trm,ut_act")
    parser.add_argument("--steps", type=int, default=0,
                        help="train the --only models for this many steps instead of the FLOPs-matched count")
    parser.add_argument("--tag", default="", help="suffix for the results key and run folder, e.g. _matched")
    args = parser.parse_args()
    torch.set_num_threads(1)
    quick = ["train.steps=4", "data.train_size=96", "data.eval_size=24", "train.batch_size=16",
             "loop_eval.max_steps=8", "eval.batch_size=24"] if args.quick else []
    t_start = time.perf_counter()

    cfgs = {"fprm": make_config(RECIPE, [*quick, f"out_dir={args.runs / 'fprm'}"])}
    for name, over in BASELINES.items():
        cfgs[name] = make_config(RECIPE, [*quick, *over, f"out_dir={args.runs / name}"])  # over wins

    only = [s for s in args.only.split(",") if s] or list(cfgs)
    # -- equal training FLOPs (the probe is cached in the run folder: it is deterministic per config) -----
    cache = args.runs / "flops_per_step.json"
    flops = json.loads(cache.read_text()) if cache.is_file() and not args.quick else {}
    for name, cfg in cfgs.items():
        if name not in flops:
            flops[name] = flops_per_step(cfg, steps=2 if args.quick else 3, out_dir=args.runs / "probe")
    if not args.quick:
        write_json(cache, flops)
    budget = flops["fprm"] * cfgs["fprm"].train.steps
    for name, cfg in cfgs.items():
        cfg.train.steps = max(1, round(budget / flops[name]))
        if args.steps and name in only:
            cfg.train.steps = args.steps
        if args.tag and name in only:
            cfg.out_dir = str(args.runs / f"{name}{args.tag}")
    print({n: (f"{f / 1e9:.2f} GFLOP/step", cfgs[n].train.steps) for n, f in flops.items()}, flush=True)

    out_json = args.out / "results.json"
    results: dict[str, Any] = {}
    if args.only and out_json.is_file():  # a partial rerun keeps the other models' results
        results = json.loads(out_json.read_text()).get("results", {})
    fprm_extra: dict[str, Any] = {}
    for name in only:
        cfg = cfgs[name]
        trainer, summary = train(cfg)
        task, data = trainer.task, trainer.eval_data
        with ema_weights(trainer) as model:
            loop = eval_loop(name, trainer)
            ev = run_eval(model, task, data, loop, batch_size=cfg.eval.batch_size, seed=cfg.seed)
            entry = {
                "parameters": trainer.model.num_parameters(),
                "train_steps": cfg.train.steps,
                "gflops_per_step": flops[name] / 1e9,
                "train_tflops": flops[name] * cfg.train.steps / 1e12,
                "train_wall_time_s": summary["wall_time"],
                "final_train_metrics": summary["train"],
                "eval_loop": dataclasses.asdict(loop),
                **ev.summary(),
            }
            if name == "fprm":
                stats = steps_vs_difficulty(ev.difficulty, ev.steps, ev.valid)
                entry["steps_vs_blanks"] = stats.to_dict()
                entry["easy_hard_steps"] = easy_hard_steps(ev.difficulty, ev.steps)
                entry["oscillation"] = oscillation_stats(ev.residuals, loop.tol)
                fprm_extra["damped"] = ev
                solver_cmp = {}
                for label, change in (("picard", {"solver": "picard"}),
                                      ("picard_cap256", {"solver": "picard", "max_steps": 8 if args.quick else 256}),
                                      ("damped_gamma0.9", {"plugins": {"damped": {"gamma": 0.9}}})):
                    lp = dataclasses.replace(loop, **change)
                    e2 = run_eval(model, task, data, lp, batch_size=cfg.eval.batch_size, seed=cfg.seed)
                    s2 = steps_vs_difficulty(e2.difficulty, e2.steps, e2.valid)
                    solver_cmp[label] = {
                        **e2.summary(), "max_steps": lp.max_steps,
                        "oscillation": oscillation_stats(e2.residuals, lp.tol),
                        "spearman_rho": s2.spearman_rho, "spearman_p": s2.spearman_p,
                        "valid_among_not_converged": float(e2.valid[~e2.converged].mean()) if (~e2.converged).any()
                        else None,
                    }
                    fprm_extra[label] = e2
                entry["solver_comparison"] = solver_cmp
        if args.steps:
            entry["steps_override"] = args.steps
        results[f"{name}{args.tag}"] = entry
        write_json(out_json, {**payload_head(args, cfgs), "results": results,
                                                "flops_per_step": flops})
        print(name, {k: entry[k] for k in ("valid_accuracy", "mean_steps", "train_steps", "train_wall_time_s")},
              flush=True)

    payload = {**payload_head(args, cfgs), "results": results, "flops_per_step": flops,
               "wall_time_s": round(time.perf_counter() - t_start, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "results.json", payload)
    if "damped" in fprm_extra:
        plot_steps(fprm_extra, args.out / "steps_vs_blanks.png")
        plot_traces(fprm_extra, args.out / "residual_traces.png", cfgs["fprm"].loop_eval.get("tol", 0.1))
    print(f"wrote {args.out / 'results.json'} ({payload['wall_time_s']} s)")


def payload_head(args: argparse.Namespace, cfgs: dict[str, Any]) -> dict[str, Any]:
    dc = cfgs["fprm"].data
    return {
        "command": "python experiments/fprm_sudoku.py" + (" --quick" if args.quick else "")
        + (f" --only {args.only}" if args.only else "") + (f" --steps {args.steps}" if args.steps else "")
        + (f" --tag {args.tag}" if args.tag else ""),
        "recipe": str(RECIPE.relative_to(REPO)),
        "compute_matching": "equal training FLOPs (FlopCounterMode, forward + backward, mean of measured steps)",
        "baseline_overrides": BASELINES,
        "task": {"name": "sudoku", "options": dc.options, "train": {"n": dc.train_size, **dc.train_generate},
                 "eval": {"n": dc.eval_size, **dc.eval_generate}},
        "machine": MACHINE,
    }


def plot_steps(evals: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for label, style in (("damped", "o-"), ("picard", "s--"), ("picard_cap256", "^:")):
        if label not in evals:
            continue
        ev = evals[label]
        xs = np.unique(ev.difficulty)
        mean = [ev.steps[ev.difficulty == x].mean() for x in xs]
        acc = [ev.valid[ev.difficulty == x].mean() for x in xs]
        axes[0].plot(xs, mean, style, label=label, markersize=4)
        axes[1].plot(xs, acc, style, label=label, markersize=4)
    ev = evals["damped"]
    jitter = np.random.default_rng(0).uniform(-0.2, 0.2, len(ev.difficulty))
    axes[0].scatter(ev.difficulty + jitter, ev.steps, s=4, alpha=0.25, color="C0")
    axes[0].set_xlabel("blanks")
    axes[0].set_ylabel("loop steps (evaluation)")
    axes[0].set_yscale("log")
    axes[0].set_title("FPRM: steps to fixed point vs blanks", fontsize=9)
    axes[1].set_xlabel("blanks")
    axes[1].set_ylabel("valid accuracy")
    axes[1].set_ylim(-0.02, 1.02)
    axes[1].set_title("held-out accuracy vs blanks", fontsize=9)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_traces(evals: dict[str, Any], path: Path, tol: float) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for ax, label in zip(axes, ("damped", "picard_cap256")):
        if label not in evals:
            continue
        for tr in evals[label].residuals[:40]:
            ax.plot(range(1, len(tr) + 1), tr, linewidth=0.6, alpha=0.6)
        ax.axhline(tol, color="k", linestyle="--", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xscale("log")
        ax.set_xlabel("iteration")
        ax.set_title(f"{label}: relative sup-norm residual (40 puzzles)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("residual")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
