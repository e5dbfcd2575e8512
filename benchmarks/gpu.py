"""GPU benchmark: the real ``loopformer train`` step of the paper recipes, throughput and MFU (CUDA only).

    python benchmarks/gpu.py [--recipes paper_sudoku_extreme_fprm,...] [--steps 200] [--warmup 20]
                             [--peak-tflops 989] [--out benchmarks/gpu.json]

For each recipe (default: ``paper_sudoku_extreme_fprm``, ``paper_sudoku_extreme_trm``, ``paper_maze_hard_fprm``)
a ``loopformer.train.Trainer`` is built from the recipe as it stands (paper size, batch 768, bf16, ``compile:
auto`` = the whole step compiled, EMA, the deep-supervision carry, the divergence check, device metrics read
every ``train.log_every`` steps), on random tokens of the task's shape (the recipes' data files are not needed:
what a step costs does not depend on the token values). It times ``--steps`` calls of ``Trainer.train_step`` +
the step metrics' accumulation, as ``Trainer.fit`` runs them, after ``--warmup`` steps (compilation happens
there), synchronising only at the ends (host reads as in a real run: one per logged record). FLOPs per step
are measured with ``torch.utils.flop_counter.FlopCounterMode`` on one eager step of the same trainer; MFU =
FLOPs per step / step time / the device's bf16 dense peak (looked up by name, or ``--peak-tflops``). Also
reported: tokens/s, the compile and warm-up time, the peak memory beside ``--plan``'s estimate. One JSON
object to stdout and ``--out``. Exits with status 2 and one line when CUDA is not available.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

RECIPES = ("paper_sudoku_extreme_fprm", "paper_sudoku_extreme_trm", "paper_maze_hard_fprm")
# bf16 dense peak TFLOP/s by device name (vendor data sheets; dense, no sparsity)
PEAKS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
         "L40": 181.0, "A10": 125.0, "4090": 165.0, "B200": 2250.0}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipe names")
    p.add_argument("--steps", type=int, default=200, help="timed training steps per recipe")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first (compilation happens here)")
    p.add_argument(
        "--peak-tflops", type=float, default=None, help="bf16 dense peak (default: by device name)"
    )
    p.add_argument("--set", action="append", default=[], help="extra KEY=VALUE overrides for every recipe")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().with_name("gpu.json"))
    return p.parse_args(argv)


def require_cuda() -> None:
    if not torch.cuda.is_available():
        print(
            "benchmarks/gpu.py needs a CUDA GPU: torch.cuda.is_available() is False on this machine "
            f"(torch {torch.__version__}); run the CPU benchmarks with `python -m benchmarks` instead.",
            file=sys.stderr,
        )
        raise SystemExit(2)


def device_peak(name: str, given: float | None) -> float | None:
    if given is not None:
        return given
    return next((v for k, v in PEAKS.items() if k in name), None)


def random_rows(task, rows: int, seed: int = 0):
    """``rows`` examples of ``task``'s shape with random tokens (labels: random non-pad tokens)."""
    import numpy as np

    from loopformer.tasks.base import TokenDataset

    rng = np.random.default_rng(seed)
    T, V = int(task.seq_len), int(task.vocab_size)
    inputs = rng.integers(0, V, size=(rows, T))
    labels = rng.integers(1, V, size=(rows, T))
    pids = np.zeros(rows, dtype=np.int64) if getattr(task, "num_puzzle_ids", 0) else None
    return TokenDataset(inputs, labels, np.zeros(rows), puzzle_ids=pids)


def bench_recipe(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    from loopformer.config import load_config
    from loopformer.runs import run_task
    from loopformer.train import Trainer
    from loopformer.train.plan import make_plan

    over = ["device=cuda", "train.progress=false", "train.eval_every=0", "train.checkpoint_every=0",
            "~data.train_path", "~data.eval_path", f"out_dir={tmp / name}", *args.set]  # fmt: skip
    cfg = load_config(name, over)
    task = run_task(cfg.data)
    batch = cfg.train.batch_size
    tr = Trainer(
        cfg, task=task, train_data=random_rows(task, 4 * batch), eval_data=random_rows(task, 8, seed=1)
    )
    compiled = tr.compiled
    tr.compiled = None  # one eager step under the FLOP counter (it sees every matmul, attention, conv)
    with FlopCounterMode(display=False) as counter:
        tr.meter.add(tr.train_step())
    tr.step += 1
    flops = int(counter.get_total_flops())
    tr.compiled = compiled

    def steps(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            tr.meter.add(tr.train_step())
            tr.step += 1
            if tr.step % cfg.train.log_every == 0:
                tr.read_metrics()  # the one host read per logged record, as fit() makes it
        torch.cuda.synchronize()
        return time.perf_counter() - start

    warmup_s = steps(args.warmup)
    torch.cuda.reset_peak_memory_stats()
    seconds = steps(args.steps)
    record = tr.read_metrics()
    tr.folder.close()
    step_s = seconds / args.steps
    peak = device_peak(torch.cuda.get_device_name(0), args.peak_tflops)
    plan, _ = make_plan(load_config(name, ["~data.train_path", "~data.eval_path"]), 1,
                        torch.cuda.get_device_properties(0).total_memory)  # fmt: skip
    return {
        "recipe": name, "batch": batch, "seq_len": int(task.seq_len), "parameters": tr.model.num_parameters(),
        "compiled_whole_step": compiled is not None, "compile_mode": cfg.compile_mode,
        "warmup_steps": args.warmup, "warmup_s": round(warmup_s, 1), "timed_steps": args.steps,
        "step_ms": round(1000 * step_s, 3), "tokens_per_s": round(batch * int(task.seq_len) / step_s, 1),
        "flops_per_step": flops, "achieved_tflops": round(flops / step_s / 1e12, 2), "peak_tflops": peak,
        "mfu": None if peak is None else round(flops / step_s / (peak * 1e12), 4),
        "max_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "plan_peak_gib": round(plan.peak(plan.rows_per_gpu) / 2**30, 2), "loss": record.get("loss"),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    require_cuda()
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
              "recipes": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for name in [r for r in args.recipes.split(",") if r]:
            try:
                row = bench_recipe(name, args, Path(tmp))
            except Exception as err:  # a recipe that fails is reported, the others still run
                row = {"recipe": name, "error": f"{type(err).__name__}: {str(err).strip()[:500]}"}
            result["recipes"].append(row)
            print(json.dumps(row), flush=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")  # written as it goes
    return result


if __name__ == "__main__":
    main()
