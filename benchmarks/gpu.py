"""GPU benchmark: the real ``loopformer train`` step of the paper recipes, throughput and MFU (CUDA; ``--device cpu``
runs the same phases on the CPU, for its tests).

    python benchmarks/gpu.py [--recipes paper_sudoku_extreme_fprm,...] [--steps 50] [--warmup 5]
                             [--max-seconds 600] [--peak-tflops 989] [--out benchmarks/gpu.json]
    python benchmarks/gpu.py --device cpu --tiny --recipes paper_sudoku_extreme_fprm --steps 3 --peak-tflops 0.1

For each recipe (default: ``paper_sudoku_extreme_fprm``, ``paper_sudoku_extreme_trm``, ``paper_maze_hard_fprm``)
a ``loopformer.train.Trainer`` is built from the recipe as it stands (paper size, batch 768, bf16, ``compile:
auto`` = the whole step compiled on CUDA, EMA, the deep-supervision carry, the divergence check, device metrics read
every ``train.log_every`` steps), on random tokens of the task's shape (the recipes' data files are not needed:
what a step costs does not depend on the token values). ``--tiny`` shrinks the model (d 32, 2 heads, batch 8) for
a run on the CPU. The phases, each printed to stderr as it ends and written into ``--out`` (the JSON is rewritten
after every phase):

1. ``compile``: the first training step (tracing and code generation happen there), its wall time printed as soon
   as it returns, apart from everything after it;
2. ``warmup``: ``--warmup`` more steps (a recompilation, if any, happens here; its count from dynamo's counters);
3. ``timed``: ``--steps`` steps of ``Trainer.train_step`` + the metrics' accumulation as ``Trainer.fit`` runs them
   (one host read per logged record), synchronised at the ends of chunks of ``--chunk`` steps; each chunk prints
   the steady-state step time and tokens/s so far. It stops early, with what it has, when the budget runs short;
4. ``flops``: one eager step of the same trainer under ``torch.utils.flop_counter.FlopCounterMode``; MFU = FLOPs
   per step / step time / the device's bf16 dense peak (looked up by name, or ``--peak-tflops``);
5. ``plan``: ``--plan``'s peak-memory estimate for the same configuration beside the measured peak (CUDA's
   ``max_memory_allocated`` over the timed steps; on the CPU the process's peak resident set, for the fields only).

``--max-seconds`` bounds the whole run: the timed phase stops early to leave time for the others, and a watchdog
prints the JSON of what was measured (``"cut_off": PHASE``) and exits with status 3 when a phase cannot stop (a
compilation that outlasts the budget); SIGTERM (``timeout``) does the same. One JSON object to stdout and ``--out``.
With ``--device cuda`` (the default) it exits with status 2 and one line when CUDA is not available.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

RECIPES = ("paper_sudoku_extreme_fprm", "paper_sudoku_extreme_trm", "paper_maze_hard_fprm")
# bf16 dense peak TFLOP/s by device name (vendor data sheets; dense, no sparsity)
PEAKS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
         "L40": 181.0, "A10": 125.0, "4090": 165.0, "B200": 2250.0}  # fmt: skip
TINY = ["model.d_model=32", "model.n_heads=2", "train.batch_size=8", "model.puzzle_emb_dim=32"]
RESERVE_S = 0.15  # of --max-seconds, kept for the FLOP count and the plan after the timed steps


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipe names")
    p.add_argument("--steps", type=int, default=50, help="timed training steps per recipe")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps after the first (compiling) one")
    p.add_argument("--chunk", type=int, default=10, help="timed steps between progress lines")
    p.add_argument("--max-seconds", type=float, default=None, help="wall-clock budget of the whole run")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a small model (d 32, batch 8): for a run on the CPU")
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
            f"(torch {torch.__version__}); run the CPU benchmarks with `python -m benchmarks` instead, or this "
            "script's phases on the CPU with --device cpu --tiny.",
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


class Report:
    """What has been measured so far: written to ``--out`` after every phase, printed once at the end (or when
    the budget or a SIGTERM cuts the run off)."""

    def __init__(self, args: argparse.Namespace, start: float) -> None:
        self.args, self.start, self.lock, self.done = args, start, threading.RLock(), False
        cuda = args.device == "cuda"
        self.data: dict[str, Any] = {
            "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
            "cuda": torch.version.cuda, "max_seconds": args.max_seconds, "cut_off": None, "recipes": [],
        }  # fmt: skip

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return float("inf") if self.args.max_seconds is None else self.args.max_seconds - self.elapsed()

    def phase(self, row: dict[str, Any], name: str, **values: Any) -> None:
        """Record a finished phase of ``row`` (in place), say it on stderr, rewrite ``--out``."""
        with self.lock:
            row.update(values)
            row["phases_done"].append(name)
            said = ", ".join(f"{k} {v}" for k, v in values.items() if not isinstance(v, dict | list))
            print(f"[gpu.py {self.elapsed():.0f} s] {row['recipe']}: {name}: {said}", file=sys.stderr, flush=True)
            self._write()

    def _write(self) -> None:
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        self.args.out.write_text(json.dumps(self.data, indent=2) + "\n")

    def finish(self, cut_off: str | None = None) -> None:
        """Print the JSON (once) and write it."""
        with self.lock:
            if self.done:
                return
            self.done = True
            self.data["cut_off"] = cut_off
            self.data["seconds"] = round(self.elapsed(), 1)
            self._write()
            print(json.dumps(self.data), flush=True)

    def cut(self, why: str, status: int) -> None:
        """The budget ran out (or a SIGTERM came) inside a phase that cannot stop: report and exit now."""
        rows = self.data["recipes"]
        where = f"{rows[-1]['recipe']}: after {rows[-1]['phases_done'] or ['build']}" if rows else "start-up"
        print(f"[gpu.py {self.elapsed():.0f} s] {why}; reporting what was measured ({where})", file=sys.stderr,
              flush=True)  # fmt: skip
        self.finish(cut_off=f"{why} ({where})")
        os._exit(status)


def watchdog(report: Report) -> None:
    """Cut the run off at ``--max-seconds`` (a bounded wait; a daemon thread, gone when the run ends)."""
    while not report.done:
        left = report.left()
        if left <= 0:
            report.cut(f"--max-seconds {report.args.max_seconds:g} reached", 3)
        time.sleep(min(left, 1.0))


def bench_recipe(name: str, args: argparse.Namespace, tmp: Path, report: Report) -> dict[str, Any]:
    from torch._dynamo.utils import counters
    from torch.utils.flop_counter import FlopCounterMode

    from loopformer.config import load_config
    from loopformer.runs import run_task
    from loopformer.train import Trainer
    from loopformer.train.plan import make_plan

    cuda = args.device == "cuda"
    common = ["train.progress=false", "train.eval_every=0", "train.checkpoint_every=0", "~data.train_path",
              "~data.eval_path", *(TINY if args.tiny else []), *args.set]  # fmt: skip
    cfg = load_config(name, [f"device={args.device}", *common, f"out_dir={tmp / name}"])
    if args.tiny and "puzzle_emb_dim" not in cfg.model.fields:
        common.remove("model.puzzle_emb_dim=32")
        cfg = load_config(name, [f"device={args.device}", *common, f"out_dir={tmp / name}"])
    task = run_task(cfg.data)
    batch, seq = cfg.train.batch_size, int(task.seq_len)
    row: dict[str, Any] = {"recipe": name, "phases_done": [], "batch": batch, "seq_len": seq, "bf16": cfg.bf16}
    report.data["recipes"].append(row)
    tr = Trainer(cfg, task=task, train_data=random_rows(task, 4 * batch), eval_data=random_rows(task, 8, seed=1))
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def steps(n: int) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(n):
            tr.meter.add(tr.train_step())
            tr.step += 1
            if tr.step % cfg.train.log_every == 0:
                tr.read_metrics()  # the one host read per logged record, as fit() makes it
        sync()
        return time.perf_counter() - start

    try:
        report.phase(row, "build", parameters=tr.model.num_parameters(), compile_setting=cfg.compile,
                     compile_mode=cfg.compile_mode, compiled_whole_step=tr.compiled is not None)  # fmt: skip
        torch._dynamo.reset()
        counters.clear()
        report.phase(row, "compile", compile_s=round(steps(1), 2), compiled_whole_step=tr.compiled is not None)
        warm = steps(args.warmup)
        report.phase(row, "warmup", warmup_steps=args.warmup, warmup_s=round(warm, 2),
                     graphs=int(counters["stats"]["unique_graphs"]), compiled_whole_step=tr.compiled is not None)  # fmt: skip
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        done, seconds = 0, 0.0
        while done < args.steps:
            n = min(args.chunk, args.steps - done)
            per_step = seconds / done if done else 0.0
            if done and report.left() - n * per_step < RESERVE_S * (args.max_seconds or 0):
                break  # the rest of the budget is the FLOP count's and the plan's
            seconds += steps(n)
            done += n
            step_s = seconds / done
            report.phase(row, f"timed {done}", timed_steps=done, step_ms=round(1000 * step_s, 3),
                         tokens_per_s=round(batch * seq / step_s, 1), complete=done >= args.steps)  # fmt: skip
        record = tr.read_metrics()
        row["loss"] = record.get("loss")
        if cuda:
            max_bytes, kind = torch.cuda.max_memory_allocated(), "torch.cuda.max_memory_allocated"
        else:
            import resource

            max_bytes, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak resident set (CPU)"
        row.update(max_memory_gib=round(max_bytes / 2**30, 3), memory_kind=kind)
        compiled, tr.compiled = tr.compiled, None  # one eager step under the FLOP counter (it sees every matmul)
        with FlopCounterMode(display=False) as counter:
            tr.meter.add(tr.train_step())
        tr.step += 1
        tr.compiled = compiled
        flops = int(counter.get_total_flops())
        peak = device_peak(report.data["device"], args.peak_tflops)
        achieved = flops / (row["step_ms"] / 1000) if done else None
        report.phase(row, "flops", flops_per_step=flops, peak_tflops=peak,
                     achieved_tflops=None if achieved is None else round(achieved / 1e12, 4),
                     mfu=None if achieved is None or peak is None else round(achieved / (peak * 1e12), 4))  # fmt: skip
        memory = torch.cuda.get_device_properties(0).total_memory if cuda else 80 * 10**9
        plan, _ = make_plan(load_config(name, [f"device={args.device}", *common]), 1, memory)
        plan_peak = plan.peak(plan.rows_per_gpu)
        report.phase(row, "plan", plan_peak_gib=round(plan_peak / 2**30, 3),
                     memory_over_plan=round(max_bytes / plan_peak, 3))  # fmt: skip
    finally:
        tr.folder.close()
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    start = time.perf_counter()
    args = parse_args(argv)
    if args.device == "cuda":
        require_cuda()
    report = Report(args, start)
    signal.signal(signal.SIGTERM, lambda *_: report.cut("SIGTERM", 143))
    if args.max_seconds is not None:
        threading.Thread(target=watchdog, args=(report,), daemon=True).start()
    with tempfile.TemporaryDirectory() as tmp:
        for name in [r for r in args.recipes.split(",") if r]:
            if report.left() <= 0:
                break
            try:
                bench_recipe(name, args, Path(tmp), report)
            except Exception as err:  # a recipe that fails is reported, the others still run
                rows = report.data["recipes"]
                if not rows or rows[-1]["recipe"] != name:
                    rows.append({"recipe": name, "phases_done": []})
                rows[-1]["error"] = f"{type(err).__name__}: {str(err).strip()[:500]}"
                print(f"[gpu.py] {name}: {rows[-1]['error']}", file=sys.stderr, flush=True)
    report.finish()
    return report.data


if __name__ == "__main__":
    sys.exit(1 if any("error" in r for r in main()["recipes"]) else 0)
