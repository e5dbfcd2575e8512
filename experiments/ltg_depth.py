"""Depth extrapolation on a knowledge graph (Loop, Think & Generalize, arXiv 2604.07822).

Claim: a recurrent-depth transformer trained on queries of up to k_train hops answers deeper queries
when it is given more inference loops, and dynamic recurrence (R ~ Poisson(4) in [2, 8] per step)
extrapolates better than a fixed R; a plain transformer of equal parameters cannot.

Three models, trained once each through ``loopformer.train.Trainer`` with the hop curriculum
(recipes/ltg_kg_fixed.yaml, ltg_kg_poisson.yaml, ltg_kg_transformer.yaml; graph of 40 entities and
4 bijective relations, k_train = 4), then evaluated on held-out (test-split) k-hop paths,
k = 2..8, with exactly R = 1..MAX_LOOPS inference loops (``loopformer.eval.logit_lens`` reads the
head at every loop, so one pass gives every R). The plain transformer is applied once.

Usage: ``python experiments/ltg_depth.py [--quick] [--retrain]`` writes
docs/figures/ltg_depth/{ltg_depth.json, ltg_depth.png} (training runs go to runs/ltg/).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling ltg_common.py, however this is loaded
import ltg_common

MAX_LOOPS = 16


def per_hop_curves(
    model: Any, task: Any, sets: dict[int, Any], loops: int
) -> dict[int, dict[str, list[float]]]:
    """Per hop count: validator accuracy and mean logit margin after each of 1..loops fixed loops."""
    from loopformer.eval.analysis import logit_lens

    out = {}
    for k, ds in sets.items():
        curve = logit_lens(
            model, task, ds, loops, halting="fixed", batch_size=512, bridge_tokens=np.full(len(ds), -1)
        )
        out[k] = {
            "n": len(ds),
            "loops": curve.loops,
            "accuracy": curve.valid_accuracy,
            "margin": curve.margin,
        }
    return out


def single_pass(model: Any, task: Any, sets: dict[int, Any]) -> dict[int, dict[str, float]]:
    from loopformer.eval.evaluate import evaluate

    return {
        k: {"n": len(ds), "accuracy": evaluate(model, task, ds, batch_size=512).valid_accuracy}
        for k, ds in sets.items()
    }


def run(quick: bool = False, retrain: bool = False) -> dict[str, Any]:
    c = ltg_common
    t0 = time.perf_counter()
    task, models = c.train_kg_models(("fixed", "poisson", "transformer"), quick=quick, retrain=retrain)
    sets = c.kg_test_sets(task, c.TEST_HOPS, 40 if quick else c.TEST_PER_HOP, seed=12345)
    loops = 4 if quick else MAX_LOOPS
    result: dict[str, Any] = {
        "k_train": c.K_TRAIN,
        "test_hops": list(c.TEST_HOPS),
        "max_loops": loops,
        "quick": quick,
        "graph": {
            "entities": task.num_entities,
            "relations": task.num_relations,
            "test_fraction": task.test_fraction,
        },
        "models": {},
    }
    for name, (model, info) in models.items():
        entry = {
            "label": c.KG_MODELS[name][1],
            "recipe": c.KG_MODELS[name][0],
            "parameters": info["parameters"],
            "train_wall_time_s": info["wall_time"],
            "train_steps": info["steps"],
            "curriculum_level": info["curriculum_level"],
            "curriculum_advances": info["curriculum_advances"],
        }
        if name == "transformer":
            entry["per_hop"] = single_pass(model, task, sets)
        else:
            entry["per_hop"] = per_hop_curves(model, task, sets, loops)
        result["models"][name] = entry
    result["table"] = summary_table(result)
    result["eval_wall_time_s"] = (
        time.perf_counter() - t0 - sum(0 if m[1]["reused"] else m[1]["wall_time"] for m in models.values())
    )
    out = c.figure_dir("ltg_depth", quick)
    c.write_json(out / "ltg_depth.json", result)
    plot(result, out / "ltg_depth.png")
    print_table(result)
    return result


def summary_table(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per hop count: transformer accuracy; each recurrent model at its training depth and at its best R."""
    rows = []
    train_depth = {"fixed": 4, "poisson": 8}
    for k in result["test_hops"]:
        row: dict[str, Any] = {
            "k": k,
            "transformer": result["models"]["transformer"]["per_hop"][k]["accuracy"],
        }
        for name in ("fixed", "poisson"):
            curve = result["models"][name]["per_hop"][k]
            acc = curve["accuracy"]
            best = int(np.argmax(acc))
            r = min(train_depth[name], len(acc))
            row[f"{name}_at_train_R"] = acc[r - 1]
            row[f"{name}_train_R"] = r
            row[f"{name}_best"] = acc[best]
            row[f"{name}_best_R"] = curve["loops"][best]
            row[f"{name}_at_max_R"] = acc[-1]
        rows.append(row)
    return rows


def print_table(result: dict[str, Any]) -> None:
    print("k | transformer | fixed@4 | fixed best (R) | poisson@8 | poisson best (R)")
    for r in result["table"]:
        print(
            f"{r['k']} | {r['transformer']:.3f} | {r['fixed_at_train_R']:.3f} | {r['fixed_best']:.3f} "
            f"({r['fixed_best_R']}) | {r['poisson_at_train_R']:.3f} | {r['poisson_best']:.3f} ({r['poisson_best_R']})"
        )


def plot(result: dict[str, Any], path: Path) -> None:
    plt = ltg_common.pyplot()
    hops = result["test_hops"]
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(hops)))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, name in zip(axes[:2], ("fixed", "poisson")):
        m = result["models"][name]
        for color, k in zip(colors, hops):
            curve = m["per_hop"][k]
            style = "-" if k <= result["k_train"] else "--"
            ax.plot(curve["loops"], curve["accuracy"], style, color=color, label=f"k={k}")
        ax.set_title(m["label"])
        ax.set_xlabel("inference loops R")
        ax.set_ylabel("held-out accuracy")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, title="hops (dashed: > k_train)", title_fontsize=7)
    ax = axes[2]
    for name, marker in (("transformer", "s"), ("fixed", "o"), ("poisson", "^")):
        m = result["models"][name]
        if name == "transformer":
            ys = [m["per_hop"][k]["accuracy"] for k in hops]
        else:
            ys = [max(m["per_hop"][k]["accuracy"]) for k in hops]
        ax.plot(hops, ys, marker=marker, label=m["label"] + ("" if name == "transformer" else " (best R)"))
    ax.axvline(result["k_train"] + 0.5, color="gray", ls=":", lw=1)
    ax.set_xlabel("hops k (dotted line: k_train)")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("equal parameters: accuracy per hop count")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    ltg_common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ltg_common.run_from_command_line(run, __doc__, argv)


if __name__ == "__main__":
    main()
