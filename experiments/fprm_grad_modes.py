"""Gradient modes in practice: FPRM trained with bptt / truncated / onestep / neumann / ift (issue 7, item 4).

arXiv 2606.18206: FPRM trains each deep-supervision segment with K = 6 differentiable iterations
(truncated BPTT = a truncated Neumann series of (I - J)^-1); DEQ / Attractor (sections 2 and 4) use
implicit (IFT) or one-step / phantom gradients. Here the same FPRM, data, optimiser and number of
optimiser steps are trained once per gradient mode (``loop_train.grad``), every segment running exactly
6 damped iterations forward:

- ``bptt``: backprop through all 6 iterations;
- ``truncated``: through the last 2 (``grad_steps=2``);
- ``onestep``: one recomputed step at the (detached) final iterate;
- ``neumann``: one step plus 5 terms of the Neumann series of J^T;
- ``ift``: the implicit-function-theorem adjoint solved by Anderson (tol 1e-4, at most 30 iterations).

Measured per mode: held-out valid / token accuracy (independent validator, damped evaluation loop),
wall time per optimiser step, and activation memory = bytes autograd saves for backward in one step
(``saved_tensors_hooks``; CPU has no allocator peak counter, and these bytes are what differs).

Usage: ``python experiments/fprm_grad_modes.py [--quick] [--steps 300]``; writes
``docs/figures/fprm_grad_modes/results.json`` and ``grad_modes.png``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from fprm_common import (
    MACHINE,
    REPO,
    ema_weights,
    make_config,
    pyplot,
    run_eval,
    save_figure,
    saved_bytes_per_step,
    script_parser,
    train,
    write_json,
)

from loopformer.config import to_dict

RECIPE = REPO / "recipes" / "fprm_grad_modes.yaml"
MODES: dict[str, list[str]] = {
    "bptt": ["loop_train.grad=bptt"],
    "truncated_k2": ["loop_train.grad=truncated", "loop_train.grad_steps=2"],
    "onestep": ["loop_train.grad=onestep"],
    "neumann_k5": ["loop_train.grad=neumann", "loop_train.grad_steps=5"],
    "ift": ["loop_train.grad=ift", "loop_train.ift.solver=anderson", "loop_train.ift.tol=1e-4",
            "loop_train.ift.max_steps=30"],
}


def main() -> None:
    parser = script_parser(__doc__, "fprm_grad_modes", "fprm_grad_modes")
    parser.add_argument("--steps", type=int, default=0, help="optimiser steps per mode (0 = the recipe's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    quick = ["train.steps=3", "data.train_size=64", "data.eval_size=16", "train.batch_size=8",
             "loop_eval.max_steps=8"] if args.quick else []
    if args.steps:
        quick.append(f"train.steps={args.steps}")
    t_start = time.perf_counter()
    results: dict[str, Any] = {}
    for mode, over in MODES.items():
        cfg = make_config(RECIPE, [*over, *quick, f"out_dir={args.runs / mode}"])
        trainer, summary = train(cfg)
        with ema_weights(trainer) as model:
            ev = run_eval(model, trainer.task, trainer.eval_data, trainer.loop_eval, cfg.eval.batch_size, cfg.seed)
        # token accuracy of the EMA model from the trainer's own final evaluation
        token_acc = summary["eval"].get("token_acc")
        t0 = time.perf_counter()
        saved = saved_bytes_per_step(trainer)
        one_step_s = time.perf_counter() - t0
        results[mode] = {
            "loop_train": to_dict(cfg.loop_train),
            "train_steps": cfg.train.steps,
            "train_wall_time_s": summary["wall_time"],
            "s_per_step": summary["s_per_step"],
            "saved_bytes_per_step": saved,
            "saved_mib_per_step": saved / 2**20,
            "probe_step_s": one_step_s,
            "token_accuracy": token_acc,
            "final_train_loss": summary["train"].get("loss"),
            **ev.summary(),
        }
        print(mode, {k: results[mode][k] for k in ("valid_accuracy", "token_accuracy", "s_per_step",
                                                    "saved_mib_per_step")}, flush=True)
    payload = {
        "command": "python experiments/fprm_grad_modes.py" + (" --quick" if args.quick else "")
        + (f" --steps {args.steps}" if args.steps else ""),
        "recipe": str(RECIPE.relative_to(REPO)),
        "machine": MACHINE,
        "memory_measure": "bytes of tensors saved for backward in one training step (saved_tensors_hooks)",
        "results": results,
        "wall_time_s": round(time.perf_counter() - t_start, 1),
    }
    write_json(args.out / "results.json", payload)
    plot(results, args.out / "grad_modes.png")
    print(f"wrote {args.out / 'results.json'}")


def plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
    panels = (("valid_accuracy", "held-out valid accuracy"), ("s_per_step", "wall time per step (s)"),
              ("saved_mib_per_step", "saved activations per step (MiB)"))
    for ax, (key, title) in zip(axes, panels):
        vals = [results[n][key] or 0.0 for n in names]
        ax.bar(range(len(names)), vals, color=[f"C{i}" for i in range(len(names))])
        ax.set_xticks(range(len(names)), names, rotation=30, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
