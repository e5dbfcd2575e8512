"""Why FPRM's 9x9 accuracy falls between its 30- and 60-minute checkpoints (the authors'-protocol rerun).

``experiments/sudoku9_cpu.py`` trains ``fprm_authors`` (FPRM arXiv 2606.18206 trained as
nilskiKonjIzDunava/fprm ``pretrain.py`` trains it) in one run and scores its 15 / 30 / 60-minute checkpoints
under the authors' evaluation (``FixedPointOptimizer`` in the reference: the whole batch iterates until its
largest relative residual is below 0.1, cap 1000 steps, step decay 0.997, patience 10). This script scores
EVERY checkpoint of such a run (the 45-minute one too) on the same 1000 held-out puzzles and splits the
accuracy by whether each puzzle's iterate converged:

- ``valid``: the puzzles the task's independent validator accepts (the rerun's headline);
- ``converged``: the fraction whose own relative residual fell below the tolerance within the cap
  (per-sample, read from the loop's output, although the batch stops as a whole);
- ``valid_if_converged`` / ``valid_if_not``: accuracy on each part: if a converged iterate is almost
  always right and a non-converged one rarely, the accuracy curve is the convergence curve;
- the same with the live (non-EMA) weights, to tell the averaged weights from the trained ones;
- the training curriculum level and the training-batch convergence at each checkpoint's step, read from
  the run's ``metrics.jsonl``.

Usage: ``python experiments/sudoku9_fprm_diagnosis.py --runs runs/sudoku9 [--runs runs/sudoku9_seed1]``
(one core each; 4-18 minutes a checkpoint and weights, by load; ``--steps`` scores only some checkpoints,
``--assemble`` none: it gathers the rows saved so far). Writes ``diagnosis.json`` into each run's folder
and ``--out`` (default docs/figures/sudoku9/diagnosis.json + diagnosis.md).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fprm_common import REPO, write_json
from sudoku9_cpu import BLANK_BINS, _frac, configs, score_authors

from loopformer.files import atomic_write_text
from loopformer.runs import load_run
from loopformer.tasks.sudoku import SudokuTask

NAME = "fprm_authors"


def training_at(metrics: list[dict[str, Any]], step: int, window: int = 400) -> dict[str, Any]:
    """The curriculum level at ``step`` and the mean training-batch convergence / exact accuracy over the
    logged records of the ``window`` steps before it."""
    rows = [r for r in metrics if step - window < r["step"] <= step and "converged" in r]
    if not rows:
        return {}
    return {
        "level": rows[-1].get("level"),
        "train_converged": float(np.mean([r["converged"] for r in rows])),
        "train_exact_acc": float(np.mean([r["exact_acc"] for r in rows])),
        "train_residual": float(np.mean([r["residual"] for r in rows])),
    }


def score(path: Path, eval_set: Any, use_ema: bool) -> dict[str, Any]:
    run = load_run(path, use_ema=use_ema)
    t0 = time.perf_counter()
    res = score_authors(run, eval_set)
    valid = np.asarray(res.valid, dtype=bool)
    conv = np.asarray([r.converged for r in res.records], dtype=bool)
    blanks = eval_set.difficulty
    return {
        "step": run.step,
        "weights": run.weights,
        "valid": float(valid.mean()),
        "converged": float(conv.mean()),
        "valid_if_converged": _frac(valid[conv]),
        "valid_if_not": _frac(valid[~conv]),
        "by_blanks": {f"{lo}-{hi}": _frac(valid[(blanks >= lo) & (blanks <= hi)]) for lo, hi in BLANK_BINS},
        "converged_by_blanks": {
            f"{lo}-{hi}": _frac(conv[(blanks >= lo) & (blanks <= hi)]) for lo, hi in BLANK_BINS
        },
        "mean_steps": float(np.asarray(res.steps, dtype=np.float64).mean()),
        "seconds": round(time.perf_counter() - t0, 1),
        "load_average": os.getloadavg()[0],
    }


def diagnose(
    runs: Path, eval_size: int, live_steps: set[int], steps: set[int] | None = None, assemble: bool = False
) -> dict[str, Any]:
    run_dir = runs.resolve() / NAME
    cfg = configs(runs, False)[NAME]
    eval_set = SudokuTask(9).generate(eval_size, seed=cfg.data.eval_seed, min_blanks=20, max_blanks=60)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    saved = run_dir / "diagnosis.json"
    done = json.loads(saved.read_text()) if saved.is_file() else {"rows": []}
    have = {(r["step"], r["weights"]) for r in done["rows"]}
    rows = list(done["rows"])
    torch.set_num_threads(1)
    for ckpt in sorted((run_dir / "checkpoints").glob("step_*")):
        step = int(ckpt.name.split("_")[1])
        if assemble or (steps is not None and step not in steps):
            continue
        for use_ema in (True, False):
            if not use_ema and step not in live_steps:
                continue
            if (step, "ema" if use_ema else "live") in have:
                continue
            row = {**score(ckpt, eval_set, use_ema), **training_at(metrics, step)}
            print(json.dumps(row), flush=True)
            rows.append(row)
            rows.sort(key=lambda r: (r["step"], r["weights"]))
            write_json(saved, {"run": str(run_dir.relative_to(REPO)), "eval_size": eval_size, "rows": rows})
    return {"run": str(run_dir.relative_to(REPO)), "eval_size": eval_size, "rows": rows}


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| run | step | weights | valid | converged | valid if converged | valid if not | "
        "train level | train batch converged |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        for r in res["rows"]:
            cells = [
                res["run"],
                str(r["step"]),
                r["weights"],
                *(
                    "-" if r.get(k) is None else f"{100 * r[k]:.1f}%"
                    for k in ("valid", "converged", "valid_if_converged", "valid_if_not")
                ),
                "-" if r.get("level") is None else f"{r['level']:.0f}",
                "-" if r.get("train_converged") is None else f"{100 * r['train_converged']:.0f}%",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, action="append", help="a sudoku9_cpu.py --runs folder")
    parser.add_argument("--eval-size", type=int, default=1000)
    parser.add_argument(
        "--live-steps",
        default="3256,6512",
        help="checkpoints also scored with their live (non-EMA) weights (comma-separated steps)",
    )
    parser.add_argument("--steps", default="", help="score only these checkpoints (comma-separated steps)")
    parser.add_argument("--assemble", action="store_true", help="score nothing: gather the saved rows")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "figures" / "sudoku9")
    args = parser.parse_args()
    live = {int(s) for s in args.live_steps.split(",") if s}
    only = {int(s) for s in args.steps.split(",") if s} or None
    results = [
        diagnose(r, args.eval_size, live, only, args.assemble)
        for r in args.runs or [REPO / "runs" / "sudoku9"]
    ]
    write_json(args.out / "diagnosis.json", {"results": results})
    atomic_write_text(args.out / "diagnosis.md", markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
