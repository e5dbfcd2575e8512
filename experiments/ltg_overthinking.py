"""Overthinking on the knowledge graph (Loop, Think & Generalize, arXiv 2604.07822).

Claim: past some inference depth the logit margin (correct logit minus the best other logit) of a
recurrent-depth model decays and its accuracy falls ("overthinking"); dynamic recurrence in training
(R ~ Poisson(4) in [2, 8]) makes the model more robust to extra loops than a fixed R.

The fixed-R and Poisson-R models of experiments/ltg_depth.py (trained once each, reused from
runs/ltg/) are run for exactly R = 1..MAX_LOOPS loops on held-out k-hop paths; the model's own head
reads every loop (``loopformer.eval.overthinking``): mean margin at the answer position and accuracy.
Per model and k: the best R, the accuracy and margin there, and at MAX_LOOPS.

Usage: ``python experiments/ltg_overthinking.py [--quick] [--retrain]`` writes
docs/figures/ltg_overthinking/{ltg_overthinking.json, ltg_overthinking.png}.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling ltg_common.py, however this is loaded
import ltg_common

MAX_LOOPS = 48
HOPS = (2, 4, 6, 8)


def summarize(loops: list[int], acc: list[float], margin: list[float]) -> dict[str, Any]:
    best = int(np.argmax(acc))
    peak_margin = int(np.nanargmax(margin))
    return {
        "best_R": loops[best],
        "best_accuracy": acc[best],
        "margin_at_best": margin[best],
        "peak_margin_R": loops[peak_margin],
        "peak_margin": margin[peak_margin],
        "final_R": loops[-1],
        "final_accuracy": acc[-1],
        "final_margin": margin[-1],
        "accuracy_drop": acc[best] - acc[-1],
        "margin_drop": margin[peak_margin] - margin[-1],
    }


def run(quick: bool = False, retrain: bool = False) -> dict[str, Any]:
    from loopformer.eval.analysis import logit_lens

    c = ltg_common
    task, models = c.train_kg_models(("fixed", "poisson"), quick=quick, retrain=retrain)
    sets = c.kg_test_sets(task, HOPS, 40 if quick else c.TEST_PER_HOP, seed=12345)
    loops = 6 if quick else MAX_LOOPS
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "k_train": c.K_TRAIN,
        "hops": list(HOPS),
        "max_loops": loops,
        "quick": quick,
        "models": {},
    }
    for name, (model, _info) in models.items():
        entry: dict[str, Any] = {
            "label": c.KG_MODELS[name][1],
            "train_depth": 4 if name == "fixed" else "2-8",
            "per_hop": {},
        }
        for k, ds in sets.items():
            curve = logit_lens(model, task, ds, loops, batch_size=512)
            entry["per_hop"][k] = {
                "n": len(ds),
                "loops": curve.loops,
                "accuracy": curve.valid_accuracy,
                "margin": curve.margin,
                **summarize(curve.loops, curve.valid_accuracy, curve.margin),
            }
        result["models"][name] = entry
    result["eval_wall_time_s"] = time.perf_counter() - t0
    out = c.figure_dir("ltg_overthinking", quick)
    c.write_json(out / "ltg_overthinking.json", result)
    plot(result, out / "ltg_overthinking.png")
    for name, m in result["models"].items():
        for k, s in m["per_hop"].items():
            print(
                f"{name} k={k}: best R {s['best_R']} acc {s['best_accuracy']:.3f} margin {s['margin_at_best']:.2f}"
                f" | R={s['final_R']} acc {s['final_accuracy']:.3f} margin {s['final_margin']:.2f}"
            )
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    plt = ltg_common.pyplot()
    hops = result["hops"]
    colors = plt.cm.plasma(np.linspace(0, 0.85, len(hops)))
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for col, name in enumerate(("fixed", "poisson")):
        m = result["models"][name]
        for color, k in zip(colors, hops):
            curve = m["per_hop"][k]
            axes[0, col].plot(curve["loops"], curve["margin"], color=color, label=f"k={k}")
            axes[1, col].plot(curve["loops"], curve["accuracy"], color=color, label=f"k={k}")
        axes[0, col].set_title(m["label"])
        axes[0, col].axhline(0, color="gray", lw=0.8)
        axes[0, col].set_ylabel("logit margin (correct - best other)")
        axes[1, col].set_ylabel("held-out accuracy")
        axes[1, col].set_ylim(-0.02, 1.02)
        axes[1, col].set_xlabel("inference loops R")
        if name == "fixed":
            for ax in axes[:, col]:
                ax.axvline(4, color="gray", ls=":", lw=1)
        else:
            for ax in axes[:, col]:
                ax.axvspan(2, 8, color="gray", alpha=0.12)
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
    axes[1, 0].legend(fontsize=8)
    fig.suptitle("overthinking: margin and accuracy vs inference loops (grey: training depth)", fontsize=10)
    ltg_common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ltg_common.run_from_command_line(run, __doc__, argv)


if __name__ == "__main__":
    main()
