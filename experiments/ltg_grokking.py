"""Systematic generalisation on a small "Grokked Transformers" graph (LTG, arXiv 2604.07822).

Claim: on two-hop composition ``h r1 r2 -> t`` a recurrent-depth model with R >= 2 loops generalises
to held-out compositions of seen facts (ID) and, through a late "grokking" stage, to compositions of
facts never composed in training (OOD), while R = 1 stays at chance OOD; the logit lens shows the
bridge entity b (``h r1 -> b``) at intermediate loops.

At CPU scale: ``KGSystematicTask`` with few entities (recipes/ltg_grok_r1.yaml / ltg_grok_r2.yaml:
the same recurrent block looped R = 1 or R = 2 times in training and evaluation). Training runs
through ``loopformer.train.Trainer.train_step`` (the harness' own step, data stream and optimiser);
every EVAL_EVERY steps this script scores the training inferred facts, the ID test facts and the
OOD test facts with ``loopformer.eval.evaluate`` (the grokking curves). At the end
``loopformer.eval.logit_lens`` reads every loop (up to 2R + 2) of the ID and OOD test queries at the
answer position and reports the bridge entity's rank and top-1 rate per loop.

Usage: ``python experiments/ltg_grokking.py [--quick] [--steps N]`` writes
docs/figures/ltg_grokking/{ltg_grokking.json, ltg_grokking.png}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling ltg_common.py, however this is loaded
import ltg_common

RECIPES = {"R=1": "ltg_grok_r1", "R=2": "ltg_grok_r2"}
EVAL_EVERY = 200
EVAL_MAX = 512


def _subset(ds: Any, n: int, seed: int) -> Any:
    if len(ds) <= n:
        return ds
    pick = np.sort(np.random.default_rng(seed).choice(len(ds), n, replace=False))
    return ds.subset(pick)


def train_with_curves(recipe: str, overrides: list[str], log: Any = print) -> dict[str, Any]:
    from loopformer.config import load_config, save_config
    from loopformer.eval.analysis import logit_lens
    from loopformer.eval.evaluate import evaluate
    from loopformer.tasks.registry import get_task
    from loopformer.train.trainer import Trainer

    cfg = load_config(recipe, overrides)
    task = get_task(cfg.data.task, **cfg.data.options)
    splits = task.datasets()
    train = splits["train"]
    probes = {
        "train_inferred": _subset(splits["train_inferred"], EVAL_MAX, 1),
        "test_id": _subset(splits["test_id"], EVAL_MAX, 2),
        "test_ood": _subset(splits["test_ood"], EVAL_MAX, 3),
    }
    trainer = Trainer(cfg, task=task, train_data=train, eval_data=None)
    loop = cfg.loop_config(trainer.model.config.loop, "eval")
    run_dir = Path(cfg.out_dir)
    save_config(cfg, trainer.run_dir)  # where the run writes now (beside the folder until an overwrite's swap)
    every = max(1, min(EVAL_EVERY, cfg.train.steps // 4))
    curves: dict[str, list[float]] = {"step": [], "loss": [], **{k: [] for k in probes}}
    t0 = time.perf_counter()
    losses = []
    while trainer.step < cfg.train.steps:
        metrics = trainer.train_step()
        trainer.step += 1
        losses.append(metrics["loss"])
        if trainer.step % every == 0 or trainer.step == cfg.train.steps:
            curves["step"].append(trainer.step)
            curves["loss"].append(float(np.mean(losses[-every:])))
            for name, ds in probes.items():
                curves[name].append(
                    evaluate(trainer.model, task, ds, loop=loop, batch_size=512).valid_accuracy
                )
            log(
                f"  {recipe} step {trainer.step}: loss {curves['loss'][-1]:.3f} "
                + " ".join(f"{k} {curves[k][-1]:.3f}" for k in probes)
            )
    wall = time.perf_counter() - t0
    trainer.save()
    lens_loops = 2 * loop.max_steps + 2
    lens = {}
    for name in ("test_id", "test_ood"):
        curve = logit_lens(trainer.model, task, probes[name], lens_loops, loop=loop, batch_size=512)
        lens[name] = curve.to_dict()
    info = {
        "recipe": recipe,
        "parameters": trainer.model.num_parameters(),
        "wall_time_s": wall,
        "steps": trainer.step,
        "R": loop.max_steps,
        "curves": curves,
        "logit_lens": lens,
        "split_sizes": {k: len(v) for k, v in splits.items()},
    }
    (run_dir / "ltg_grokking_info.json").write_text(json.dumps(info))
    return info


def run(quick: bool = False, steps: int | None = None) -> dict[str, Any]:
    c = ltg_common
    torch.set_num_threads(1)
    result: dict[str, Any] = {"quick": quick, "models": {}}
    for label, recipe in RECIPES.items():
        overrides = []
        if quick:
            # the dry run's scratch run is replaced each time (a full run's folder is never: it is refused)
            overrides += ["train.steps=8", f"out_dir=runs/ltg_quick/grok_{label[-1]}", "train.overwrite=true"]
        elif steps:
            overrides.append(f"train.steps={steps}")
        result["models"][label] = train_with_curves(recipe, overrides)
    from loopformer.config import load_config

    cfg = load_config(RECIPES["R=2"])
    result["graph"] = dict(cfg.data.options)
    result["split_sizes"] = result["models"]["R=2"]["split_sizes"]
    out = c.figure_dir("ltg_grokking", quick)
    c.write_json(out / "ltg_grokking.json", result)
    plot(result, out / "ltg_grokking.png")
    for label, m in result["models"].items():
        cv = m["curves"]
        print(
            f"{label}: {m['steps']} steps in {m['wall_time_s']:.0f} s; final train-inferred "
            f"{cv['train_inferred'][-1]:.3f} ID {cv['test_id'][-1]:.3f} OOD {cv['test_ood'][-1]:.3f}"
        )
        for name, lens in m["logit_lens"].items():
            print(
                f"   lens {name}: acc {np.round(lens['valid_accuracy'], 3).tolist()} "
                f"bridge top1 {np.round(lens['bridge_top1'], 3).tolist()}"
            )
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    plt = ltg_common.pyplot()
    models = result["models"]
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(5 * (len(models) + 1), 3.8))
    for ax, (label, m) in zip(axes, models.items()):
        cv = m["curves"]
        for key, style in (("train_inferred", "k-"), ("test_id", "b-"), ("test_ood", "r-")):
            ax.plot(cv["step"], cv[key], style, label=key)
        ax.set_title(f"{label}: accuracy over training")
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[-1]
    for (label, m), color in zip(models.items(), ("tab:orange", "tab:green")):
        for name, style in (("test_id", "-"), ("test_ood", "--")):
            lens = m["logit_lens"][name]
            ax.plot(
                lens["loops"], lens["bridge_top1"], style, color=color, label=f"{label} {name}: bridge top-1"
            )
    ax.set_xlabel("loop (logit lens at the answer position)")
    ax.set_ylabel("fraction with the bridge entity on top")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ltg_common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few training steps (dry run)")
    parser.add_argument("--steps", type=int, default=None, help="override train.steps of both recipes")
    args = parser.parse_args(argv)
    run(quick=args.quick, steps=args.steps)


if __name__ == "__main__":
    main()
