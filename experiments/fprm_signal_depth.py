"""Signal propagation after training, and accuracy vs training depth (issue 7, item 1; arXiv 2606.18206).

FPRM's claim: a looped pre-norm block without residual scaling lets the state grow with the number of
loops, post-norm keeps it bounded but propagates signal badly over many loops, and pre-norm with FPRM's
tied residual scaling is bounded *and* trains well when looped deeply. ``experiments/signal_propagation.py``
shows the at-initialisation half; this script trains the three on the same small task and measures:

- held-out accuracy (independent validator) and token accuracy at the training depth R, for R = 2, 4, 8
  loops per forward (``train.mode=simple``, fixed R, BPTT through every loop, Picard iteration);
- after training, the state RMS and the relative update ``||z_t - z_{t-1}|| / ||z_{t-1}||`` per loop up
  to 64 loops (``loopformer.eval.analysis.signal_propagation``), also measured on the same model before
  training;
- effective-depth usage: token accuracy read out at every loop (logit lens,
  ``loopformer.eval.analysis.logit_lens``) and ``loops_used`` = the first loop whose token accuracy is
  within 0.01 of the accuracy at loop R (R means every loop contributes; less means later loops are idle).

Variants, same width / heads / layers (d 64, 4 heads, 2 blocks), no convolution:
``pre-norm`` = ``recurrent`` with additive re-injection ``h <- Block_pre(h + x)``, output projections at
full scale (no scaling); ``post-norm`` = the same with post-norm blocks; ``fprm`` = FPRM's scaled pre-norm
(learned a1 / a2, tied b's, init a1 0.75 a2 0.25).

Usage: ``python experiments/fprm_signal_depth.py [--quick]``; writes
``docs/figures/fprm_signal_depth/results.json`` and ``signal_depth.png``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fprm_common import (
    MACHINE,
    REPO,
    ema_weights,
    make_config,
    pyplot,
    run_eval,
    save_figure,
    script_parser,
    train,
    write_json,
)

from loopformer.eval.analysis import logit_lens, signal_propagation

RECIPE = REPO / "recipes" / "fprm_signal_depth.yaml"
SHARED = "d_model: 64, n_heads: 4, n_layers: 2"
VARIANTS: dict[str, str] = {
    "pre-norm": f"model={{name: recurrent, {SHARED}, injection: add, norm: pre, out_init_scale: 1.0}}",
    "post-norm": f"model={{name: recurrent, {SHARED}, injection: add, norm: post, out_init_scale: 1.0}}",
    "fprm": f"model={{name: fprm, {SHARED}, conv: none}}",
}
DEPTHS = (2, 4, 8)


def loops_used(token_acc: list[float], depth: int, slack: float = 0.01) -> int:
    """First loop t <= depth whose token accuracy is within ``slack`` of the accuracy at loop ``depth``."""
    target = token_acc[depth - 1] - slack
    for t in range(1, depth + 1):
        if token_acc[t - 1] >= target:
            return t
    return depth


def main() -> None:
    parser = script_parser(__doc__, "fprm_signal_depth", "fprm_signal_depth")
    parser.add_argument("--analysis-loops", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    quick = ["train.steps=3", "data.train_size=64", "data.eval_size=16", "train.batch_size=8"] if args.quick else []
    depths = (2, 4) if args.quick else DEPTHS
    n_loops = 8 if args.quick else args.analysis_loops
    t_start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for name, model_over in VARIANTS.items():
        results[name] = {}
        for depth in depths:
            loop = f"{{solver: picard, halting: fixed, max_steps: {depth}, grad: bptt}}"
            over = [model_over, f"loop_train={loop}", f"loop_eval={loop}", *quick,
                    f"out_dir={args.runs / name.replace('-', '_')}_R{depth}"]
            cfg = make_config(RECIPE, over)
            from loopformer.train.trainer import Trainer  # for the before-training signal measurement

            init_trainer = Trainer(cfg)
            init_signal = signal_propagation(init_trainer.model, init_trainer.eval_data, n_loops,
                                             loop=init_trainer.loop_eval, batch_size=64, seed=cfg.seed)
            del init_trainer
            trainer, summary = train(cfg)
            with ema_weights(trainer) as model:
                ev = run_eval(model, trainer.task, trainer.eval_data, trainer.loop_eval, cfg.eval.batch_size, cfg.seed)
                sig = signal_propagation(model, trainer.eval_data, n_loops, loop=trainer.loop_eval, batch_size=64,
                                         seed=cfg.seed)
                lens = logit_lens(model, trainer.task, trainer.eval_data, min(n_loops, 4 * depth),
                                  loop=trainer.loop_eval, batch_size=cfg.eval.batch_size, train_depth=depth,
                                  seed=cfg.seed)
            entry = {
                "parameters": trainer.model.num_parameters(),
                "train_steps": cfg.train.steps,
                "train_wall_time_s": summary["wall_time"],
                "s_per_step": summary["s_per_step"],
                "final_train_loss": summary["train"].get("loss"),
                "token_accuracy_at_R": lens.token_accuracy[depth - 1],
                "loops_used": loops_used(lens.token_accuracy, depth),
                "state_rms_trained": sig.state_rms,
                "relative_update_trained": sig.relative_update,
                "state_rms_init": init_signal.state_rms,
                "relative_update_init": init_signal.relative_update,
                "lens_token_accuracy": lens.token_accuracy,
                "lens_valid_accuracy": lens.valid_accuracy,
                **ev.summary(),
            }
            results[name][str(depth)] = entry
            print(name, depth, {k: entry[k] for k in ("valid_accuracy", "token_accuracy_at_R", "loops_used",
                                                      "s_per_step")},
                  f"rms@R={sig.state_rms[depth - 1]:.3g} rms@{n_loops}={sig.state_rms[-1]:.3g}", flush=True)
    payload = {
        "command": "python experiments/fprm_signal_depth.py" + (" --quick" if args.quick else ""),
        "recipe": str(RECIPE.relative_to(REPO)),
        "variants": VARIANTS,
        "depths": list(depths),
        "analysis_loops": n_loops,
        "machine": MACHINE,
        "results": results,
        "wall_time_s": round(time.perf_counter() - t_start, 1),
    }
    write_json(args.out / "results.json", payload)
    plot(results, list(depths), args.out / "signal_depth.png")
    print(f"wrote {args.out / 'results.json'}")


def plot(results: dict[str, dict[str, Any]], depths: list[int], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.3))
    deep = str(max(depths))
    for i, (name, by_depth) in enumerate(results.items()):
        e = by_depth[deep]
        xs = np.arange(1, len(e["state_rms_trained"]) + 1)
        axes[0].plot(xs, e["state_rms_trained"], "-", color=f"C{i}", label=f"{name} trained")
        axes[0].plot(xs, e["state_rms_init"], ":", color=f"C{i}", label=f"{name} init")
        axes[1].plot(xs, e["relative_update_trained"], "-", color=f"C{i}", label=name)
        lx = np.arange(1, len(e["lens_token_accuracy"]) + 1)
        axes[2].plot(lx, e["lens_token_accuracy"], "-", color=f"C{i}", label=name)
        axes[3].plot(depths, [by_depth[str(d)]["valid_accuracy"] for d in depths], "o-", color=f"C{i}",
                     label=f"{name} valid")
        axes[3].plot(depths, [by_depth[str(d)]["token_accuracy_at_R"] for d in depths], "s--", color=f"C{i}",
                     alpha=0.6, label=f"{name} token")
    axes[0].set(xscale="log", yscale="log", xlabel="loop", ylabel="state RMS")
    axes[0].set_title(f"state RMS (trained at R={deep})", fontsize=9)
    axes[1].set(xscale="log", yscale="log", xlabel="loop", ylabel="||dz|| / ||z||")
    axes[1].set_title("relative update per loop (trained)", fontsize=9)
    axes[2].axvline(int(deep), color="k", linestyle="--", linewidth=0.8)
    axes[2].set(xlabel="loop", ylabel="token accuracy (logit lens)")
    axes[2].set_title(f"readout per loop (trained at R={deep})", fontsize=9)
    axes[3].set(xlabel="training depth R (loops)", ylabel="held-out accuracy", xscale="log")
    axes[3].set_xticks(depths, [str(d) for d in depths])
    axes[3].set_title("accuracy vs training depth", fontsize=9)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    save_figure(fig, path, dpi=85)


if __name__ == "__main__":
    main()
