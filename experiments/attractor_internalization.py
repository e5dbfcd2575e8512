"""Equilibrium internalization (Attractor Models, arXiv 2605.12466), CPU-sized.

The claim: because the backbone's proposal ``c`` is both the solver's start ``y0 = c`` and the
injected signal in ``f(y, c) = c + Delta(y + c)``, training pulls ``c`` toward the equilibrium
``y*``; the solver's iteration count per training step falls to its minimum, and at inference 0 or 1
solver iterations already give peak accuracy. A DEQ-style model without the proposal (``y0 = 0``,
injection ``E(x)``; ``AttractorConfig.proposal=False``) has no such pressure.

What this script does, with the library's own harness (``loopformer.config.load_config`` on
``recipes/attractor_sudoku4.yaml`` + ``loopformer.train.Trainer``):
- trains the Attractor and the DEQ ablation (``model.proposal=false``, same head, same data, steps,
  batch, solver: Anderson m 5, residual halting tol 3e-4, 4..12 iterations, one-term Neumann IFT);
  deep supervision with ``max_segments=1``, so every optimiser step is one adaptive solve on a fresh
  batch and ``metrics.jsonl``'s ``loop_steps`` is the solver's iteration count per training step;
- every ``train.log_every`` steps it also records, on a fixed probe of held-out puzzles:
  ``gap`` = ``Attractor.internalization_gap`` (relative residual at ``y0``, ``||f(y0) - y0|| / ||f(y0)||``),
  ``dist`` = ``||y* - y0|| / ||y*||`` (the proposal's distance to the solved equilibrium),
  ``iters_probe`` (solver iterations on the probe with min_steps 1, so the count can reach 1)
  and the token / exact accuracy of the readout at 0 iterations (``readout(y0)``);
- after training, held-out accuracy (exact, and valid by the task's independent Sudoku checker)
  at 0 iterations, at exactly 1, 2, 4, 8 iterations, and with the full adaptive solve.

Usage: ``python experiments/attractor_internalization.py [--quick] [--steps N] [--out DIR]`` writes
``DIR/attractor_internalization.json`` and three PNG plots (default DIR docs/figures/attractor_internalization).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling fprm_common.py
from fprm_common import MACHINE, pyplot, save_figure, script_parser

from loopformer.config import RunConfig, load_config
from loopformer.eval.budget import with_budget
from loopformer.eval.evaluate import evaluate, score_predictions
from loopformer.models.attractor import Attractor
from loopformer.tasks.base import TokenDataset
from loopformer.train import Trainer

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "attractor_sudoku4.yaml"
VARIANTS = {"attractor": ["model.proposal=true"], "deq": ["model.proposal=false"]}
FIXED_BUDGETS = (1, 2, 4, 8)


class InternalizationTrainer(Trainer):
    """The library's Trainer, plus probe measurements written into the logged metrics."""

    probe: TokenDataset

    def train_step(self) -> dict[str, Any]:
        metrics = super().train_step()
        if (self.step + 1) % self.config.train.log_every == 0 or self.step + 1 == self.config.train.steps:
            metrics.update(probe_metrics(self.model, self.probe, self.loop_eval))  # type: ignore[arg-type]
        return metrics


@torch.no_grad()
def probe_metrics(model: Attractor, probe: TokenDataset, loop_eval: Any) -> dict[str, float]:
    """Internalization gap, proposal-to-equilibrium distance, solver iterations and 0-iteration accuracy."""
    was_training = model.training
    model.eval()
    try:
        inputs = torch.as_tensor(probe.inputs)
        labels = torch.as_tensor(probe.labels)
        gap = model.internalization_gap(inputs)
        loop = dataclasses.replace(loop_eval, min_steps=1, grad="bptt")
        out = model(inputs, loop=loop)
        ctx = model.embed(inputs)
        y0 = model.init_state(ctx)
        y_star = out.state
        B = len(inputs)
        dist = (y_star - y0).reshape(B, -1).norm(dim=1) / y_star.reshape(B, -1).norm(dim=1).clamp_min(1e-8)
        pred0 = model.readout(y0, *ctx).argmax(-1)
        mask = labels != -100
        token0 = float(((pred0 == labels) & mask).sum() / mask.sum())
        exact0 = float(((pred0 == labels) | ~mask).all(dim=1).float().mean())
    finally:
        model.train(was_training)
    return {
        "gap": float(gap.mean()),
        "dist": float(dist.mean()),
        "iters_probe": float(out.loop.steps.float().mean()),
        "token_acc_0": token0,
        "exact_acc_0": exact0,
    }


@torch.no_grad()
def accuracy_at_zero(model: Attractor, task: Any, data: TokenDataset) -> dict[str, float]:
    """Held-out accuracy of ``readout(y0)``: no solver iteration at all."""
    model.eval()
    inputs = torch.as_tensor(data.inputs)
    ctx = model.embed(inputs)
    pred = model.readout(model.init_state(ctx), *ctx).argmax(-1).numpy()
    exact, valid, right, count = score_predictions(task, data.inputs, data.labels, pred)
    return {
        "iterations": 0,
        "exact_accuracy": float(exact.mean()),
        "valid_accuracy": float(valid.mean()),
        "token_accuracy": float(right.sum() / max(count.sum(), 1)),
        "mean_steps": 0.0,
    }


def inference_table(trainer: Trainer) -> list[dict[str, Any]]:
    """Accuracy at 0, exactly b (FIXED_BUDGETS) and the full adaptive number of solver iterations."""
    model, task, data = trainer.model, trainer.task, trainer.eval_data
    rows = [accuracy_at_zero(model, task, data)]  # type: ignore[arg-type]
    for b in FIXED_BUDGETS:
        res = evaluate(model, task, data, loop=with_budget(trainer.loop_eval, b, "fixed"), batch_size=512)
        rows.append({"iterations": b, "exact_accuracy": res.exact_accuracy, "valid_accuracy": res.valid_accuracy,
                     "token_accuracy": res.token_accuracy, "mean_steps": res.mean_steps})
    res = evaluate(model, task, data, loop=trainer.loop_eval, batch_size=512)
    rows.append({"iterations": "full", "exact_accuracy": res.exact_accuracy, "valid_accuracy": res.valid_accuracy,
                 "token_accuracy": res.token_accuracy, "mean_steps": res.mean_steps,
                 "converged": res.converged_fraction})
    return rows


def run_variant(name: str, overrides: list[str], out_root: Path, probe_size: int) -> dict[str, Any]:
    cfg: RunConfig = load_config(RECIPE, [*VARIANTS[name], *overrides, f"out_dir={out_root / name}",
                                          "train.progress=false"])
    torch.manual_seed(cfg.seed)
    trainer = InternalizationTrainer(cfg)
    trainer.probe = trainer.eval_data.subset(slice(0, probe_size))  # type: ignore[union-attr]
    t0 = time.perf_counter()
    summary = trainer.fit()
    wall = time.perf_counter() - t0
    log = [json.loads(line) for line in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines() if line]
    history = [r for r in log if "loop_steps" in r and "eval_n" not in r]
    keys = ("step", "loss", "token_acc", "loop_steps", "residual", "converged", "gap", "dist", "iters_probe",
            "token_acc_0", "exact_acc_0")
    return {
        "variant": name,
        "overrides": [*VARIANTS[name], *overrides],
        "parameters": summary["parameters"],
        "wall_time_s": round(wall, 1),
        "history": [{k: r[k] for k in keys if k in r} for r in history],
        "final_eval": summary["eval"],
        "inference": inference_table(trainer),
    }


WINDOWS = ((1, 50), (51, 200), (201, 400), (401, 600), (601, 800))


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Per run, means of the logged history over step windows (the tables in docs/results.md (Attractor section))."""
    keys = ("loop_steps", "converged", "gap", "dist", "token_acc_0", "loss")
    for run in results["runs"].values():
        last = max(r["step"] for r in run["history"])
        windows = [(a, b) for a, b in WINDOWS if a <= last] or [(1, last)]
        run["windows"] = []
        for a, b in windows:
            rows = [r for r in run["history"] if a <= r["step"] <= b]
            run["windows"].append({"steps": [a, b], **{k: float(np.mean([r[k] for r in rows])) for k in keys}})
    return results


def plot(results: dict[str, Any], out: Path) -> list[str]:
    plt = pyplot()
    paths = []
    colours = {"attractor": "tab:blue", "deq": "tab:red"}
    labels = {"attractor": "Attractor (proposal, y0 = c)", "deq": "DEQ ablation (no proposal, y0 = 0)"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, res in results["runs"].items():
        h = res["history"]
        steps = [r["step"] for r in h]
        axes[0].plot(steps, [r["loop_steps"] for r in h], color=colours[name], label=f"{labels[name]}: training")
        axes[0].plot(steps, [r["iters_probe"] for r in h], color=colours[name], ls="--",
                     label=f"{labels[name]}: probe, min 1")
        axes[1].semilogy(steps, [r["gap"] for r in h], color=colours[name], label=f"{labels[name]}: gap at y0")
        axes[1].semilogy(steps, [r["dist"] for r in h], color=colours[name], ls="--",
                         label=f"{labels[name]}: ||y*-y0||/||y*||")
    axes[0].axhline(4, color="gray", lw=0.8, ls=":")
    axes[0].set(xlabel="training step", ylabel="solver iterations", title="Solver iterations per step")
    axes[1].set(xlabel="training step", ylabel="relative residual / distance", title="Internalization gap")
    for ax in axes:
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    paths.append(save_figure(fig, out / "attractor_iterations.png"))

    fig, ax = plt.subplots(figsize=(5, 3.4))
    for name, res in results["runs"].items():
        rows = res["inference"]
        xs = [str(r["iterations"]) for r in rows]
        ax.plot(xs, [r["valid_accuracy"] for r in rows], "o-", color=colours[name], label=labels[name])
    ax.set(xlabel="solver iterations at inference", ylabel="held-out valid accuracy", ylim=(-0.02, 1.02),
           title="Accuracy vs inference iterations")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    paths.append(save_figure(fig, out / "attractor_inference_iterations.png"))

    fig, ax = plt.subplots(figsize=(5, 3.4))
    for name, res in results["runs"].items():
        h = res["history"]
        ax.plot([r["step"] for r in h], [r["token_acc_0"] for r in h], color=colours[name], label=labels[name])
    ax.set(xlabel="training step", ylabel="probe token accuracy of readout(y0)", title="0-iteration accuracy")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    paths.append(save_figure(fig, out / "attractor_zero_iteration_accuracy.png"))
    return paths


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = script_parser(__doc__, "attractor_internalization", "attractor_internalization")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--summarize", action="store_true",
                        help="only recompute the window summaries and plots of an existing JSON in --out")
    args = parser.parse_args(argv)
    if args.summarize:
        path = args.out / "attractor_internalization.json"
        results = summarize(json.loads(path.read_text()))
        results["plots"] = plot(results, args.out)
        path.write_text(json.dumps(results, indent=1))
        return results
    overrides = [f"train.steps={args.steps}"]
    probe = 128
    if args.quick:
        overrides = ["train.steps=6", "train.log_every=2", "train.warmup_steps=2", "model.d_model=16",
                     "model.n_heads=2", "data.train_size=64", "data.eval_size=16", "train.batch_size=8"]
        probe = 8
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "command": "python experiments/attractor_internalization.py" + (" --quick" if args.quick else "")
        + (f" --steps {args.steps}" if not args.quick and args.steps != 800 else ""),
        "recipe": str(RECIPE.relative_to(RECIPE.parent.parent)),
        "machine": MACHINE,
        "torch": torch.__version__,
        "probe_size": probe,
        "runs": {},
    }
    for name in args.variants:
        results["runs"][name] = run_variant(name, overrides, args.runs, probe)
        print(name, json.dumps({k: results["runs"][name][k] for k in ("parameters", "wall_time_s", "inference")}))
    results = summarize(results)
    results["plots"] = plot(results, args.out)
    (args.out / "attractor_internalization.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
