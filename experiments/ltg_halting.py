"""Adaptive halting on the knowledge graph (Loop, Think & Generalize, arXiv 2604.07822; FPRM's halting, arXiv 2606.18206).

Claim: halting each query at the first loop t where ``KL(p_t || p_{t-1}) < 1e-3`` AND
``H(p_t) < 3.0`` nats (LTG's rule, cap 16 loops) keeps the accuracy of running many fixed loops
while spending fewer loops on shallow queries, so compute follows the hop count.

Compared on the Poisson-R and fixed-R models of experiments/ltg_depth.py (reused from runs/ltg/),
per held-out hop count k = 2..8, all through the library's engine (``loopformer.eval.evaluate`` with
a ``LoopConfig``; halted samples leave the batch, so saved loops are saved compute):
- ``fixed R``: exactly R loops, R = 1..CAP (accuracy per R from one logit-lens pass);
- ``kl_entropy``: LTG's rule, KL 1e-3 and entropy 3.0 nats (the paper's thresholds), cap CAP;
- ``kl_entropy variant``: the paper's variant, KL < 0.5 and entropy < 3 + 12 / query length;
- ``residual``: FPRM-style fixed-point halting, relative sup-norm residual
  ``max_t ||z_t - F(z_t)||_inf / ||F(z_t)||_inf < tol`` (arXiv 2606.18206), cap CAP, for a few tol.
"Compute saved at equal accuracy": for each adaptive rule, the smallest fixed R whose accuracy is
at least the rule's accuracy minus 1 point (R_eq, the cheapest fixed budget that matches it), and
``1 - mean loops / R_eq``; also the saving against the cap (running every query CAP loops). Pooled
over all hop counts (one fixed R must serve every query) and over the in-distribution ones (k <= 4).

Usage: ``python experiments/ltg_halting.py [--quick] [--retrain]`` writes
docs/figures/ltg_halting/{ltg_halting.json, ltg_halting.png}.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling ltg_common.py, however this is loaded
import ltg_common

CAP = 16
RESIDUAL_TOLS = (0.05, 0.1, 0.2)
EQUAL_ACC_SLACK = 0.01


def rules(cap: int, length: int) -> dict[str, Any]:
    """The adaptive rules for queries of ``length`` tokens (the LTG variant's entropy bound depends on it)."""
    from loopformer.loop import LoopConfig

    out = {
        "kl_entropy": LoopConfig(
            solver="picard",
            halting="kl_entropy",
            max_steps=cap,
            plugins={"kl_entropy": {"kl_threshold": 1e-3, "entropy_threshold": 3.0}},
            grad="bptt",
        ),
        "kl_entropy variant": LoopConfig(
            solver="picard",
            halting="kl_entropy",
            max_steps=cap,
            plugins={"kl_entropy": {"kl_threshold": 0.5, "entropy_threshold": 3.0 + 12.0 / length}},
            grad="bptt",
        ),
    }
    for tol in RESIDUAL_TOLS:
        out[f"residual tol={tol}"] = LoopConfig(
            solver="picard", halting="residual", max_steps=cap, tol=tol, residual_norm="rel_sup", grad="bptt"
        )
    return out


def equal_accuracy_budget(fixed_acc: list[float], acc: float, slack: float = EQUAL_ACC_SLACK) -> int | None:
    """The smallest fixed R (1-based) whose accuracy >= acc - slack; None when no R reaches it."""
    for r, a in enumerate(fixed_acc, start=1):
        if a >= acc - slack:
            return r
    return None


def run(quick: bool = False, retrain: bool = False) -> dict[str, Any]:
    from loopformer.eval.analysis import logit_lens
    from loopformer.eval.evaluate import evaluate

    c = ltg_common
    task, models = c.train_kg_models(("fixed", "poisson"), quick=quick, retrain=retrain)
    sets = c.kg_test_sets(task, c.TEST_HOPS, 40 if quick else c.TEST_PER_HOP, seed=12345)
    cap = 4 if quick else CAP
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "cap": cap,
        "equal_accuracy_slack": EQUAL_ACC_SLACK,
        "hops": list(c.TEST_HOPS),
        "k_train": c.K_TRAIN,
        "quick": quick,
        "models": {},
    }
    for name, (model, _info) in models.items():
        entry: dict[str, Any] = {"label": c.KG_MODELS[name][1], "per_hop": {}}
        for k, ds in sets.items():
            lens = logit_lens(
                model, task, ds, cap, halting="fixed", batch_size=512, bridge_tokens=np.full(len(ds), -1)
            )
            fixed_acc = lens.valid_accuracy
            row: dict[str, Any] = {
                "n": len(ds),
                "fixed_accuracy": fixed_acc,
                "fixed_best_R": int(np.argmax(fixed_acc)) + 1,
                "fixed_best_accuracy": max(fixed_acc),
                "fixed_cap_accuracy": fixed_acc[-1],
            }
            for rule, loop in rules(cap, ds.inputs.shape[1]).items():
                t1 = time.perf_counter()
                res = evaluate(model, task, ds, loop=loop, batch_size=512)
                r_eq = equal_accuracy_budget(fixed_acc, res.valid_accuracy)
                row[rule] = {
                    "accuracy": res.valid_accuracy,
                    "mean_loops": res.mean_steps,
                    "converged_fraction": res.converged_fraction,
                    "steps_histogram": {str(a): b for a, b in res.steps_histogram.items()},
                    "R_equal_accuracy": r_eq,
                    "saving_vs_equal_fixed": (1 - res.mean_steps / r_eq) if r_eq else None,
                    "saving_vs_cap": 1 - res.mean_steps / cap,
                    "wall_s": time.perf_counter() - t1,
                }
            entry["per_hop"][k] = row
        entry["overall"] = overall(entry["per_hop"], cap)
        entry["overall_in_distribution"] = overall(
            {k: v for k, v in entry["per_hop"].items() if k <= c.K_TRAIN}, cap
        )
        result["models"][name] = entry
    result["eval_wall_time_s"] = time.perf_counter() - t0
    out = c.figure_dir("ltg_halting", quick)
    c.write_json(out / "ltg_halting.json", result)
    plot(result, out / "ltg_halting.png")
    for name, m in result["models"].items():
        for k, row in m["per_hop"].items():
            kl = row["kl_entropy"]
            print(
                f"{name} k={k}: fixed best {row['fixed_best_accuracy']:.3f}@{row['fixed_best_R']} cap "
                f"{row['fixed_cap_accuracy']:.3f} | KL+H {kl['accuracy']:.3f} in {kl['mean_loops']:.2f} loops "
                f"(R_eq {kl['R_equal_accuracy']}) | "
                + " ".join(
                    f"{r}: {row[r]['accuracy']:.3f}/{row[r]['mean_loops']:.2f}"
                    for r in row
                    if r.startswith("residual")
                )
            )
        for scope in ("overall", "overall_in_distribution"):
            print(name, scope, {r: v for r, v in m[scope].items() if r != "fixed_accuracy"})
    return result


def overall(per_hop: dict[int, dict[str, Any]], cap: int) -> dict[str, Any]:
    """Pooled over hop counts (each k weighted by its examples): accuracy and mean loops per rule,
    and the pooled fixed-R accuracy for every R."""
    ns = np.array([row["n"] for row in per_hop.values()], dtype=float)
    fixed = np.array([row["fixed_accuracy"] for row in per_hop.values()])
    pooled_fixed = (ns[:, None] * fixed).sum(0) / ns.sum()
    out: dict[str, Any] = {"fixed_accuracy": pooled_fixed.tolist()}
    first = next(iter(per_hop.values()))
    for rule in (r for r in first if r.startswith(("kl_entropy", "residual"))):
        acc = float(sum(row["n"] * row[rule]["accuracy"] for row in per_hop.values()) / ns.sum())
        loops = float(sum(row["n"] * row[rule]["mean_loops"] for row in per_hop.values()) / ns.sum())
        r_eq = equal_accuracy_budget(pooled_fixed.tolist(), acc)
        out[rule] = {
            "accuracy": acc,
            "mean_loops": loops,
            "R_equal_accuracy": r_eq,
            "saving_vs_equal_fixed": (1 - loops / r_eq) if r_eq else None,
            "saving_vs_cap": 1 - loops / cap,
        }
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    plt = ltg_common.pyplot()
    hops = result["hops"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for col, name in enumerate(("poisson", "fixed")):
        m = result["models"][name]
        ph = m["per_hop"]
        rules_ = [r for r in ph[hops[0]] if r.startswith(("kl_entropy", "residual"))]
        ax = axes[0, col]
        ax.plot(hops, [ph[k]["fixed_cap_accuracy"] for k in hops], "k-s", label=f"fixed R={result['cap']}")
        ax.plot(hops, [ph[k]["fixed_best_accuracy"] for k in hops], "k:", label="fixed, best R per k")
        for rule in rules_:
            ax.plot(hops, [ph[k][rule]["accuracy"] for k in hops], marker="o", label=rule)
        ax.set_title(m["label"])
        ax.set_ylabel("held-out accuracy")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        ax = axes[1, col]
        ax.plot(hops, [result["cap"]] * len(hops), "k-s", label=f"fixed R={result['cap']}")
        ax.plot(
            hops,
            [ph[k]["kl_entropy"]["R_equal_accuracy"] or np.nan for k in hops],
            "k:",
            label="fixed R matching KL+H accuracy",
        )
        for rule in rules_:
            ax.plot(hops, [ph[k][rule]["mean_loops"] for k in hops], marker="o", label=rule)
        ax.set_xlabel("hops k")
        ax.set_ylabel("mean loops per query")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle("adaptive halting: accuracy and loops per hop count", fontsize=10)
    ltg_common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ltg_common.run_from_command_line(run, __doc__, argv)


if __name__ == "__main__":
    main()
