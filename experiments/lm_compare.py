"""Attractor vs plain transformer vs Parcae-style recurrent depth on byte-level LM (arXiv 2605.12466, with its Parcae baseline; FineWeb-Edu in the paper).

The paper's claim (arXiv 2605.12466): at equal parameters, validation perplexity Transformer > Parcae >
Attractor (140M: 21.48 / 19.06 / 18.30 on FineWeb-Edu) with 25-31% fewer training FLOPs (unverified),
and training memory constant in the number of refinement steps (implicit gradients).

CPU-sized reproduction with the library's harness (``loopformer.config.load_config`` +
``loopformer.train.Trainer``) on the built-in corpus (CPython's pydoc_data topics, bytes):
recipes ``recipes/lm_transformer.yaml``, ``lm_parcae.yaml``, ``lm_attractor.yaml`` (same width, 4 blocks'
worth of parameters each, same data, steps, batch and optimiser). Measured:

- validation bits per byte on every validation byte (``TextTask.eval_windows('val')``, stride = context),
  ``bits_per_byte(mean CE)``; for the looped models also at other inference loop counts (Parcae: 1..8
  loops; Attractor: 0 iterations = ``readout(c)``, 1 iteration, the full adaptive solve);
- training FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` over one forward + backward of a training
  batch (attention through SDPA's math backend so its matmuls are counted), times the steps. The
  Attractor's per-step cost depends on its solver iterations n: FLOPs(n) = a + b n is measured at two
  values of n and summed over the per-step counts in metrics.jsonl (``loop_steps``, logged every step);
  exact for n > Anderson's history m (the Gram matrix stops growing; the recipe's min_steps 6 > m 5);
- memory vs loops: bytes of the tensors autograd saves for backward (``saved_tensors_hooks``, unique
  storages) in one training forward with exactly 2 / 4 / 8 / 16 loops per gradient mode (Parcae: bptt,
  truncated k=1; Attractor: bptt, neumann k=1, onestep, ift).

Usage: ``python experiments/lm_compare.py [--quick] [--steps N] [--out DIR]`` writes
``DIR/lm_compare.json`` and PNG plots (default DIR docs/figures/lm_compare).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling fprm_common.py
from fprm_common import MACHINE, pyplot, save_figure, script_parser

from loopformer.config import load_config
from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel
from loopformer.tasks.text import TextTask, bits_per_byte
from loopformer.train import Trainer
from loopformer.train.losses import sequence_loss

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {name: ROOT / "recipes" / f"lm_{name}.yaml" for name in ("transformer", "parcae", "attractor")}
MEMORY_LOOPS = (2, 4, 8, 16)
MEMORY_GRADS = {"parcae": ("bptt", "truncated"), "attractor": ("bptt", "neumann", "onestep", "ift")}


# ------------------------------------------------------------------------------------------------
# measurements
# ------------------------------------------------------------------------------------------------
@torch.no_grad()
def val_bits_per_byte(model: LoopedModel, task: TextTask, loop: LoopConfig | None, batch_size: int = 64,
                      zero_iterations: bool = False) -> dict[str, float]:
    """Mean CE over every validation byte -> bits per byte; ``zero_iterations``: readout of the initial state."""
    model.eval()
    data = task.eval_windows("val")
    total, count, steps = 0.0, 0, 0.0
    for start in range(0, len(data), batch_size):
        x = torch.as_tensor(data.inputs[start : start + batch_size])
        y = torch.as_tensor(data.labels[start : start + batch_size])
        if zero_iterations:
            ctx = model.embed(x)
            logits = model.readout(model.init_state(ctx), *ctx)
        else:
            out = model(x, loop=loop)
            logits = out.logits
            steps += float(out.loop.steps.float().sum()) if out.loop is not None else 0.0
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), reduction="sum"))
        count += y.numel()
    model.train()
    return {"bpb": bits_per_byte(total / count), "mean_steps": steps / len(data), "bytes": count}


def step_flops(model: LoopedModel, x: torch.Tensor, y: torch.Tensor, loop: LoopConfig, loss: str) -> int:
    """FLOPs of one training forward + backward (a copy of the model; attention via the math backend)."""
    m = copy.deepcopy(model)
    m.train()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = m(x, loop=loop)
        sequence_loss(out.logits, y, loss).backward()
    return int(counter.get_total_flops())


def saved_tensor_bytes(model: LoopedModel, x: torch.Tensor, loop: LoopConfig) -> int:
    """Bytes of the unique storages autograd saves for backward during one training forward."""
    storages: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[(s.data_ptr(), s.nbytes())] = s.nbytes()
        return t

    m = copy.deepcopy(model)
    m.train()
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = m(x, loop=loop)
        loss = out.logits.float().logsumexp(-1).mean()
    del loss, out
    return sum(n for (ptr, _), n in storages.items() if ptr not in params)


def fixed_loop(base: LoopConfig, n: int, grad: str | None = None) -> LoopConfig:
    changes: dict[str, Any] = {"halting": "fixed", "max_steps": n, "min_steps": min(base.min_steps, n)}
    if grad is not None:
        changes["grad"] = grad
        changes["grad_steps"] = 1
    return dataclasses.replace(base, **changes)


# ------------------------------------------------------------------------------------------------
# one model
# ------------------------------------------------------------------------------------------------
def run_variant(name: str, overrides: list[str], runs: Path, memory_batch: int) -> dict[str, Any]:
    cfg = load_config(RECIPES[name], [*overrides, f"out_dir={runs / name}", "train.progress=false",
                                      "train.log_every=1"])
    torch.manual_seed(cfg.seed)
    trainer = Trainer(cfg)
    model, task, loop_train, loop_eval = trainer.model, trainer.task, trainer.loop_train, trainer.loop_eval
    assert isinstance(task, TextTask)
    B = cfg.train.batch_size
    x = torch.as_tensor(trainer.train_data.inputs[:B])
    y = torch.as_tensor(trainer.train_data.labels[:B])

    # FLOPs per training step (before training: the count does not depend on the weights)
    if name == "attractor":
        lo, hi = loop_train.min_steps, loop_train.max_steps
        f_lo = step_flops(model, x, y, fixed_loop(loop_train, lo), cfg.train.loss)
        f_hi = step_flops(model, x, y, fixed_loop(loop_train, hi), cfg.train.loss)
        per_iter = (f_hi - f_lo) / (hi - lo)
        flops_model = {"a": f_lo - per_iter * lo, "b_per_iteration": per_iter, "measured_at": [lo, hi]}
    else:
        sampled = int(trainer.sampler.sample(0)) if cfg.train.mode == "simple" else loop_train.max_steps
        loop = dataclasses.replace(loop_train, max_steps=sampled, min_steps=min(loop_train.min_steps, sampled))
        flops_model = {"a": step_flops(model, x, y, loop, cfg.train.loss), "b_per_iteration": 0.0}

    t0 = time.perf_counter()
    summary = trainer.fit()
    wall = time.perf_counter() - t0
    log = [json.loads(line) for line in (Path(cfg.out_dir) / "metrics.jsonl").read_text().splitlines() if line]
    history = [r for r in log if "loss" in r]
    iters = [float(r.get("loop_steps", 1.0)) for r in history]
    total_flops = sum(flops_model["a"] + flops_model["b_per_iteration"] * n for n in iters)

    # validation bits per byte, at the trained loop and at other inference loop counts
    bpb = val_bits_per_byte(model, task, loop_eval)
    inference: list[dict[str, Any]] = []
    if name == "parcae":
        for n in (1, 2, 4, 8):
            inference.append({"loops": n, **val_bits_per_byte(model, task, fixed_loop(loop_eval, n))})
    elif name == "attractor":
        inference.append({"loops": 0, **val_bits_per_byte(model, task, None, zero_iterations=True)})
        for n in (1, 2):
            inference.append({"loops": n, **val_bits_per_byte(model, task, fixed_loop(loop_eval, n))})
        inference.append({"loops": "full", **bpb})

    # saved-tensor memory vs loops per gradient mode (untrained copy is fine: sizes only)
    memory: dict[str, dict[str, int]] = {}
    xm = x[:memory_batch]
    if name in MEMORY_GRADS:
        for grad in MEMORY_GRADS[name]:
            memory[grad] = {str(n): saved_tensor_bytes(model, xm, fixed_loop(loop_train, n, grad))
                            for n in MEMORY_LOOPS}
    else:
        memory["bptt (1 pass)"] = {str(n): saved_tensor_bytes(model, xm, loop_train) for n in MEMORY_LOOPS}

    return {
        "variant": name,
        "recipe": str(RECIPES[name].relative_to(ROOT)),
        "parameters": summary["parameters"],
        "steps": summary["steps"],
        "tokens_seen": summary["steps"] * B * int(x.shape[1]),
        "wall_time_s": round(wall, 1),
        "final_train_loss": history[-1]["loss"],
        "val_bpb": bpb["bpb"],
        "val_mean_steps": bpb["mean_steps"],
        "val_bytes": bpb["bytes"],
        "inference": inference,
        "flops_per_step_model": flops_model,
        "train_flops": total_flops,
        "mean_train_iterations": float(np.mean(iters)),
        "memory_batch": memory_batch,
        "saved_bytes": memory,
        "history": [{"step": r["step"], "loss": r["loss"], **({"loop_steps": r["loop_steps"]} if "loop_steps" in r
                     else {})} for r in history[:: max(1, len(history) // 100)]],
    }


def plot(results: dict[str, Any], out: Path) -> list[str]:
    plt = pyplot()
    runs = results["runs"]
    names = []
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, r in runs.items():
        h = r["history"]
        axes[0].plot([p["step"] for p in h], [p["loss"] / math.log(2) for p in h], label=f"{name} ({r['parameters']:,} p)")
        axes[1].scatter([r["train_flops"]], [r["val_bpb"]], label=name, s=30)
    axes[0].set(xlabel="training step", ylabel="train loss (bits/byte)", title="Training curves")
    axes[1].set(xlabel="training FLOPs", ylabel="validation bits/byte", title="Val bpb vs training FLOPs",
                xscale="log")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    names.append(save_figure(fig, out / "lm_bpb_flops.png"))

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name, r in runs.items():
        for grad, series in r["saved_bytes"].items():
            xs = [int(k) for k in series]
            ax.plot(xs, [v / 2**20 for v in series.values()], "o-", label=f"{name}: {grad}")
    ax.set(xlabel="loops (fixed)", ylabel="saved-for-backward MiB", title="Training memory vs loops", xscale="log")
    ax.set_xticks(list(MEMORY_LOOPS), [str(n) for n in MEMORY_LOOPS])
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    names.append(save_figure(fig, out / "lm_memory_vs_loops.png"))
    return names


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = script_parser(__doc__, "lm_compare", "lm_compare")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--variants", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    args = parser.parse_args(argv)
    overrides = [f"train.steps={args.steps}"]
    memory_batch = 8
    if args.quick:
        overrides = ["train.steps=3", "train.warmup_steps=1", "model.d_model=16", "model.n_heads=2",
                     "data.options.seq_len=16", "data.train_size=64", "train.batch_size=4"]
        memory_batch = 2
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "command": "python experiments/lm_compare.py" + (" --quick" if args.quick else "")
        + (f" --steps {args.steps}" if not args.quick and args.steps != 1200 else ""),
        "machine": MACHINE,
        "torch": torch.__version__,
        "corpus": "built-in (pydoc_data.topics), byte-level",
        "runs": {},
    }
    for name in args.variants:
        results["runs"][name] = run_variant(name, overrides, args.runs, memory_batch)
        r = results["runs"][name]
        print(name, json.dumps({k: r[k] for k in ("parameters", "val_bpb", "train_flops", "wall_time_s",
                                                   "inference", "saved_bytes")}))
    results["plots"] = plot(results, args.out)
    (args.out / "lm_compare.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
