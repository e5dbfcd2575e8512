"""Benchmark 6: torch.compile and CPU thread settings for a training step.

The FPRM training step of benchmark 1 (engine, damped solver, truncated backprop) is timed:

- ``compile``: eager vs ``torch.compile`` of the looped body ``model.step`` (what the trainer does
  with ``compile: true``; the engine's Python loop stays eager). Full runs use the default inductor
  backend, which generates C++ and needs a compiler (gcc); ``--quick`` uses the ``eager``
  backend (Dynamo traces the graph, no code generation) so the smoke test stays fast.
  A compile failure is recorded with its message, not raised.
- ``threads``: one thread vs one per physical core (the trainer's default), eager.
Figures: time(eager) / time(compiled) and time(1 thread) / time(N threads), medians of interleaved
pairs; > 1 means the setting helps. Informational (no target): on a shared, loaded machine more
threads can be much slower (OpenMP threads wait on each other), which is what this measures.
"""

from __future__ import annotations

import time

import torch
import torch._dynamo

from benchmarks.common import (
    FULL_STEP,
    QUICK_STEP,
    Result,
    engine_train_step,
    make_batch,
    make_fprm,
    paired_ratio,
    side_by_side,
    summary,
    train_loop_config,
)


def physical_cores() -> int:
    from loopformer.devices import physical_cores as cores

    return cores()


def compile_result(quick: bool) -> Result:
    size = QUICK_STEP if quick else FULL_STEP
    backend = "eager" if quick else "inductor"
    eager = make_fprm(size)
    compiled = make_fprm(size)
    compiled.load_state_dict(eager.state_dict())
    inputs, labels, z0 = make_batch(size)
    loop = train_loop_config(size)
    details: dict = {"size": size.__dict__, "backend": backend, "threads": torch.get_num_threads()}
    try:
        torch._dynamo.reset()
        compiled.step = torch.compile(compiled.step, backend=backend)  # type: ignore[method-assign]
        start = time.perf_counter()
        loss_c = engine_train_step(compiled, inputs, labels, z0, loop)
        engine_train_step(compiled, inputs, labels, z0, loop)
        details["compile_s"] = time.perf_counter() - start
    except Exception as err:
        message = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        details["error"] = message[:500]
        return Result(
            "compile",
            "compile.speedup",
            None,
            "x",
            None,
            None,
            f"torch.compile ({backend}) failed on this machine: {message[:200]}",
            details,
        )
    loss_e = engine_train_step(eager, inputs, labels, z0, loop)
    details["loss_abs_diff"] = float((loss_c - loss_e).abs())
    times = side_by_side(
        {
            "eager": lambda: engine_train_step(eager, inputs, labels, z0, loop),
            "compiled": lambda: engine_train_step(compiled, inputs, labels, z0, loop),
        },
        repeats=2 if quick else 9,
        budget_s=60.0,
    )
    speedup = paired_ratio(times, "eager", "compiled")
    details["times"] = summary(times)
    return Result(
        "compile",
        "compile.speedup",
        speedup,
        "x",
        None,
        None,
        f"informational: eager time / compiled ({backend}) time of a training step",
        details,
    )


def threads_result(quick: bool) -> Result:
    size = QUICK_STEP if quick else FULL_STEP
    model = make_fprm(size)
    inputs, labels, z0 = make_batch(size)
    loop = train_loop_config(size)
    before = torch.get_num_threads()
    n = max(2, physical_cores())

    def with_threads(k: int):
        def go() -> None:
            torch.set_num_threads(k)
            engine_train_step(model, inputs, labels, z0, loop)

        return go

    try:
        # quick: one round, no warm-up (under load a multi-threaded step can take seconds)
        times = side_by_side(
            {"1": with_threads(1), str(n): with_threads(n)},
            repeats=1 if quick else 9,
            warmup=0 if quick else 1,
            budget_s=60.0,  # on a loaded machine a multi-threaded step can take tens of seconds
        )
    finally:
        torch.set_num_threads(before)
    speedup = paired_ratio(times, "1", str(n))
    return Result(
        "compile",
        "threads.speedup",
        speedup,
        "x",
        None,
        None,
        f"informational: time with 1 thread / time with {n} threads (eager)",
        {"size": size.__dict__, "threads": [1, n], "times": summary(times)},
    )


def run(quick: bool = False) -> list[Result]:
    return [compile_result(quick), threads_result(quick)]
