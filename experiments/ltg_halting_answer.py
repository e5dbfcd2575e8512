"""LTG's KL + entropy halting read at the answer position, as the reference reads it (CPU scale).

The reference (github OSU-NLP-Group/Loop-Think-Generalize, ``gpt_utils_extrapolation.py:
forward_adapative``) computes KL(p_t || p_{t-1}) and H(p_t) at one position (the prediction position) and
first tests after 2 loops. experiments/ltg_halting.py (docs/results.md, LTG section 3) read every position
(max over positions), so a query halted only when every position had settled. This script reuses the
Poisson-R knowledge-graph model of experiments/ltg_depth.py (trained or reused through
``ltg_common.train_kg_models``) and evaluates, per held-out hop count k = 2..8 and pooled, with a cap of
16 loops: the every-position rule (``halt_position="all"``, ``min_steps`` 1 as before) and the reference's
(``halt_position="answer"``, ``min_steps`` 2), both at KL 1e-3 / H 3.0 nats, against fixed loop counts
from one logit-lens pass. "R_eq" is the cheapest fixed R within 1 point of the rule's accuracy.

Usage: ``python experiments/ltg_halting_answer.py [--quick] [--retrain]`` writes
docs/figures/ltg_halting_answer/ltg_halting_answer.json.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ltg_common
from ltg_halting import equal_accuracy_budget

CAP = 16


def _rule(position: str, cap: int) -> Any:
    from loopformer.loop import LoopConfig

    return LoopConfig(solver="picard", halting="kl_entropy", max_steps=cap, min_steps=2 if position == "answer" else 1,
                      plugins={"kl_entropy": {"kl_threshold": 1e-3, "entropy_threshold": 3.0}}, grad="bptt")


def _pooled(rows: dict[int, dict[str, Any]], rule: str) -> dict[str, float]:
    n = sum(r["n"] for r in rows.values())
    acc = sum(r[rule]["accuracy"] * r["n"] for r in rows.values()) / n
    loops = sum(r[rule]["mean_loops"] * r["n"] for r in rows.values()) / n
    fixed = [sum(r["fixed_accuracy"][i] * r["n"] for r in rows.values()) / n
             for i in range(len(next(iter(rows.values()))["fixed_accuracy"]))]
    r_eq = equal_accuracy_budget(fixed, acc)
    return {"accuracy": acc, "mean_loops": loops, "R_equal_accuracy": r_eq,
            "cap_accuracy": fixed[-1], "saving_vs_cap": 1 - loops / len(fixed)}


def run(quick: bool = False, retrain: bool = False) -> dict[str, Any]:
    from loopformer.eval.analysis import logit_lens
    from loopformer.eval.evaluate import evaluate

    c = ltg_common
    load0 = os.getloadavg()
    task, models = c.train_kg_models(("poisson",), quick=quick, retrain=retrain)
    model, info = models["poisson"]
    sets = c.kg_test_sets(task, c.TEST_HOPS, 40 if quick else c.TEST_PER_HOP, seed=12345)
    cap = 4 if quick else CAP
    t0 = time.perf_counter()
    rows: dict[int, dict[str, Any]] = {}
    for k, ds in sets.items():
        lens = logit_lens(model, task, ds, cap, halting="fixed", batch_size=512, bridge_tokens=np.full(len(ds), -1))
        row: dict[str, Any] = {"n": len(ds), "fixed_accuracy": lens.valid_accuracy}
        for position in ("all", "answer"):
            model.config.halt_position, model.config.pad_id = position, task.pad
            res = evaluate(model, task, ds, loop=_rule(position, cap), batch_size=512)
            row[position] = {"accuracy": res.valid_accuracy, "mean_loops": res.mean_steps,
                             "R_equal_accuracy": equal_accuracy_budget(lens.valid_accuracy, res.valid_accuracy)}
        model.config.halt_position = "all"
        rows[k] = row
    result = {
        "cap": cap, "hops": list(c.TEST_HOPS), "k_train": c.K_TRAIN, "quick": quick,
        "model": "poisson", "training": {k: info[k] for k in ("wall_time", "steps", "parameters", "reused") if k in info},
        "per_hop": rows,
        "pooled_all_hops": {p: _pooled(rows, p) for p in ("all", "answer")},
        "pooled_in_distribution": {p: _pooled({k: v for k, v in rows.items() if k <= c.K_TRAIN}, p)
                                   for p in ("all", "answer")},
        "eval_wall_time_s": time.perf_counter() - t0,
        "loadavg_start": load0, "loadavg_end": os.getloadavg(),
    }
    c.write_json(c.figure_dir("ltg_halting_answer", quick) / "ltg_halting_answer.json", result)
    return result


def main(argv: list[str] | None = None) -> None:
    ltg_common.run_from_command_line(run, __doc__, argv)


if __name__ == "__main__":
    main()
