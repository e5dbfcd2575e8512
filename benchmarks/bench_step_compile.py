"""Benchmark 14: the whole training step compiled vs eager, on the CPU (issue 33).

For each paper model family at a small size (``benchmarks.paper_small``: tiny width, batch 8, 4x4 Sudoku or a
generated graph), two trainers from the same weights: eager, and ``compile: true`` (``loopformer.train.compiled``:
forward through the loop engine, loss, gradients, clipping, divergence check, optimiser and EMA in one inductor
graph). The compiled one is warmed up (its first steps trace and generate C++; a new loop count or carry
layout traces again), then the two take interleaved steps, one thread, process CPU time per step. Figure:
eager / compiled (above 1: compiling helps), median of the per-round ratios. Informational: what compiling
gains on a CPU at this size says little about a GPU, where it removes kernel launches and (with
``compile_mode: reduce-overhead``) host work per step. The machine is shared and loaded (load average per row).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks.common import Result, paired_ratio, side_by_side, summary
from benchmarks.paper_small import small_trainer

FAMILIES = ("trm", "fprm", "hrm", "attractor_puzzle", "attractor_head", "ltg_recurrent")


def _stepper(tr):
    def one() -> None:
        tr.meter.add(tr.train_step())
        tr.step += 1

    return one


def _family(name: str, tmp: Path, quick: bool) -> Result:
    import torch
    import torch._dynamo

    torch._dynamo.reset()
    eager = small_trainer(name, tmp / "eager")
    compiled = small_trainer(name, tmp / "compiled", "compile=true")
    compiled.model.load_state_dict(eager.model.state_dict())
    details: dict = {"recipe_family": name, "threads": torch.get_num_threads()}
    try:
        start = time.perf_counter()
        for _ in range(2 if quick else 4):  # traces and code generation (a recompile per new input layout)
            _stepper(compiled)()
        details["warmup_s"] = round(time.perf_counter() - start, 1)
        details["compiled_whole"] = compiled.compiled is not None
        times = side_by_side({"eager": _stepper(eager), "compiled": _stepper(compiled)}, repeats=3 if quick else 12,
                             warmup=1, clock=time.process_time)  # fmt: skip
    finally:
        eager.folder.close()
        compiled.folder.close()
    details["times"] = summary(times)
    ratio = paired_ratio(times, "eager", "compiled")
    what = "whole step" if details["compiled_whole"] else "looped body only"
    # the trade: compiling costs the warm-up's time beyond its steps at the compiled rate, and each later step
    # saves (eager - compiled); the break-even step count is their ratio (none when compiling is slower)
    eager_s, compiled_s = details["times"]["eager"]["median_s"], details["times"]["compiled"]["median_s"]
    details["compile_s"] = round(details["warmup_s"] - (2 if quick else 4) * compiled_s, 1)
    saved = eager_s - compiled_s
    details["break_even_steps"] = round(details["compile_s"] / saved) if saved > 0 else None
    pays = (f"pays after {details['break_even_steps']:,} steps" if saved > 0 else "never pays (compiled is slower)")
    return Result("step_compile", f"step_compile.{name}", ratio, "x", None, None,
                  f"informational: eager / compiled ({what}, inductor) step CPU time, small size; compiling took "
                  f"{details['compile_s']:.0f} s of wall time and {pays}", details)  # fmt: skip


def run(quick: bool = False) -> list[Result]:
    import torch

    torch.set_num_threads(1)
    out = []
    for name in FAMILIES[:1] if quick else FAMILIES:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                out.append(_family(name, Path(tmp), quick))
            except Exception as err:  # a compile failure is a finding, recorded with its message
                first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                out.append(Result("step_compile", f"step_compile.{name}", None, "x", None, False,
                                  f"failed: {type(err).__name__}: {first}"))  # fmt: skip
    return out
