"""State tracking: group word problems, length generalisation with more loops (arXiv 2606.18206).

Claim (FPRM): a fixed-point looped model trained on words of one length tracks the running product
on much longer words when it is given more inference loops, while a fixed-depth transformer of
equal parameters fails beyond its training length (for A5 / S5 the problem is NC1-complete).

At CPU scale: words over S3 (recipes/groups_s3_fprm.yaml and groups_s3_transformer.yaml), trained
at length L through ``loopformer.train.Trainer``, then evaluated on fresh words of length 4L: the
sequence accuracy at every prefix length i (all running products 0..i right, scored by the task's
independent ``prefix_correct``, which composes the permutations itself). FPRM is run with its own
fixed-point halting (damped solver, relative sup-norm residual < 0.1) capped at several loop
budgets, and with exactly that many loops; the transformer is applied once.

Usage: ``python experiments/state_tracking.py [--quick] [--retrain] [--recipe R] [--baseline R|none]
[--test-length N]`` writes docs/figures/state_tracking/{state_tracking.json, state_tracking.png}.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling ltg_common.py, however this is loaded
import ltg_common

BUDGETS = (4, 16, 32, 64, 128)
N_TEST = 256
QUICK = ("train.steps=20", "train.log_every=10", "data.train_size=500", "data.eval_size=32")


@torch.no_grad()
def prefix_accuracy(model: Any, task: Any, data: Any, loop: Any, batch_size: int = 128) -> dict[str, Any]:
    """Sequence accuracy at every prefix length (fraction of words whose first i products are all right)
    and the mean loops the engine ran."""
    model.eval()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    correct, steps = [], []
    generator = torch.Generator(device=device).manual_seed(0)
    for start in range(0, len(data), batch_size):
        inputs = torch.as_tensor(data.inputs[start : start + batch_size], device=device)
        out = model(inputs, loop=loop, generator=generator)
        pred = out.logits.argmax(-1).cpu().numpy()
        for x, p in zip(data.inputs[start : start + batch_size], pred):
            correct.append(task.prefix_correct(x, p))
        if out.loop is not None:
            steps.append(out.loop.steps.float().cpu().numpy())
    acc = np.mean(np.stack(correct), axis=0)
    return {
        "prefix_accuracy": acc.tolist(),
        "mean_loops": float(np.concatenate(steps).mean()) if steps else 1.0,
    }


def run(
    quick: bool = False,
    retrain: bool = False,
    recipe: str = "groups_s3_fprm",
    baseline: str | None = "groups_s3_transformer",
    test_length: int | None = None,
) -> dict[str, Any]:
    from loopformer.config import load_config
    from loopformer.eval.budget import with_budget
    from loopformer.tasks.registry import get_task

    c = ltg_common
    torch.set_num_threads(1)
    overrides = list(QUICK) if quick else []
    names = {"fprm": recipe} | ({"transformer": baseline} if baseline else {})
    trained = {}
    for name, rec in names.items():
        extra = overrides + ([f"out_dir=runs/ltg_quick/state_{name}"] if quick else [])
        trained[name] = c.train_or_load(rec, extra, None, None, retrain=retrain)
    cfg = load_config(recipe, overrides)
    task = get_task(cfg.data.task, **cfg.data.options)
    train_length = int(cfg.data.train_generate.get("length", cfg.data.options.get("length", 32)))
    length = test_length or 4 * train_length
    data = task.generate(32 if quick else N_TEST, seed=777, length=length)
    budgets = (2, 4) if quick else BUDGETS
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "group": task.group,
        "train_length": train_length,
        "test_length": length,
        "n_test": len(data),
        "quick": quick,
        "models": {},
    }
    model, info = trained["fprm"]
    loop_eval = cfg.loop_config(model.config.loop, "eval")
    entry: dict[str, Any] = {
        "recipe": recipe,
        "parameters": info["parameters"],
        "train_wall_time_s": info["wall_time"],
        "train_steps": info["steps"],
        "train_final": info["train_final"],
        "loop_eval": dataclasses.asdict(loop_eval),
        "capped": {},
        "fixed": {},
    }
    for b in budgets:
        entry["capped"][b] = prefix_accuracy(model, task, data, with_budget(loop_eval, b, "capped"))
        entry["fixed"][b] = prefix_accuracy(model, task, data, with_budget(loop_eval, b, "fixed"))
    result["models"]["fprm"] = entry
    if "transformer" in trained:
        model, info = trained["transformer"]
        result["models"]["transformer"] = {
            "recipe": baseline,
            "parameters": info["parameters"],
            "train_wall_time_s": info["wall_time"],
            "train_steps": info["steps"],
            "train_final": info["train_final"],
            "single_pass": prefix_accuracy(model, task, data, None),
        }
    result["table"] = table(result)
    result["eval_wall_time_s"] = time.perf_counter() - t0
    out = c.figure_dir("state_tracking", quick)
    c.write_json(out / "state_tracking.json", result)
    plot(result, out / "state_tracking.png")
    for row in result["table"]:
        print(row)
    return result


def table(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Sequence accuracy at prefix lengths L/2, L, 2L, 3L, 4L for every model / budget."""
    L, T = result["train_length"], result["test_length"]
    points = sorted({p for p in (L // 2, L, 2 * L, 3 * L, 4 * L, T) if 1 <= p <= T})
    rows = []
    fprm = result["models"]["fprm"]
    for mode in ("capped", "fixed"):
        for b, r in fprm[mode].items():
            rows.append(
                {
                    "model": "fprm",
                    "loops": f"{'halting, cap' if mode == 'capped' else 'exactly'} {b}",
                    "mean_loops": r["mean_loops"],
                    **{f"len{p}": r["prefix_accuracy"][p - 1] for p in points},
                }
            )
    if "transformer" in result["models"]:
        r = result["models"]["transformer"]["single_pass"]
        rows.append(
            {
                "model": "transformer",
                "loops": "1 pass",
                "mean_loops": 1.0,
                **{f"len{p}": r["prefix_accuracy"][p - 1] for p in points},
            }
        )
    return rows


def plot(result: dict[str, Any], path: Path) -> None:
    plt = ltg_common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    x = np.arange(1, result["test_length"] + 1)
    fprm = result["models"]["fprm"]
    colors = plt.cm.viridis(np.linspace(0, 0.85, len(fprm["capped"])))
    for color, (b, r) in zip(colors, fprm["capped"].items()):
        ax.plot(
            x, r["prefix_accuracy"], color=color, label=f"FPRM, halting cap {b} (mean {r['mean_loops']:.1f})"
        )
    if "transformer" in result["models"]:
        ax.plot(
            x,
            result["models"]["transformer"]["single_pass"]["prefix_accuracy"],
            "r--",
            label="transformer (equal params)",
        )
    ax.axvline(result["train_length"], color="gray", ls=":", lw=1)
    ax.set_xlabel(f"prefix length (training length {result['train_length']}, dotted)")
    ax.set_ylabel("sequence accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{result['group']} word problem: prefix accuracy up to {result['test_length']}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    ltg_common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = ltg_common.script_parser(__doc__)
    parser.add_argument("--recipe", default="groups_s3_fprm", help="the looped model's recipe")
    parser.add_argument("--baseline", default="groups_s3_transformer", help="baseline recipe, or 'none'")
    parser.add_argument(
        "--test-length", type=int, default=None, help="test word length (default 4x training)"
    )
    args = parser.parse_args(argv)
    run(
        quick=args.quick,
        retrain=args.retrain,
        recipe=args.recipe,
        baseline=None if args.baseline == "none" else args.baseline,
        test_length=args.test_length,
    )


if __name__ == "__main__":
    main()
