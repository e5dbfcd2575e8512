"""Benchmark 2: arithmetic efficiency of a training step.

FLOPs of one FPRM training step (forward + backward, truncated backprop, SYSTEMS.md section 1) are
counted by ``torch.utils.flop_counter.FlopCounterMode`` (matmuls, attention, convolutions: the
dense work; elementwise ops are not counted, as in the usual MFU convention). The achieved FLOP/s
of the step is divided by this machine's dense float32 matmul FLOP/s, measured side by side (a
large square matmul, ``2 n^3`` FLOPs, interleaved with the training steps). Informational: no
target (a small looped model on CPU spends much of its time outside matmuls).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import (
    FULL_STEP,
    QUICK_STEP,
    Result,
    engine_train_step,
    make_batch,
    make_fprm,
    median,
    side_by_side,
    summary,
    train_loop_config,
)


def count_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def run(quick: bool = False) -> list[Result]:
    size = QUICK_STEP if quick else FULL_STEP
    n = 256 if quick else 1024
    repeats = 3 if quick else 11
    model = make_fprm(size)
    inputs, labels, z0 = make_batch(size)
    loop = train_loop_config(size)

    def step() -> None:
        engine_train_step(model, inputs, labels, z0, loop)

    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g)
    b = torch.randn(n, n, generator=g)
    matmuls = 4 if quick else 8

    def matmul() -> None:
        for _ in range(matmuls):
            torch.mm(a, b)

    step_flops = count_flops(step)
    mm_flops = 2 * n**3 * matmuls
    times = side_by_side({"step": step, "matmul": matmul}, repeats=repeats)
    fractions = [(step_flops / ts) / (mm_flops / tm) for ts, tm in zip(times["step"], times["matmul"])]
    fraction = median(fractions)
    step_rate = step_flops / median(times["step"])
    peak = mm_flops / median(times["matmul"])
    return [
        Result(
            benchmark="flops",
            name="arithmetic_efficiency",
            value=fraction,
            unit="fraction",
            target=None,
            met=None,
            reason="informational: achieved FLOP/s of a training step / measured dense matmul FLOP/s",
            details={
                "size": size.__dict__,
                "step_flops": step_flops,
                "step_gflops_per_s": step_rate / 1e9,
                "matmul_n": n,
                "matmul_gflops_per_s": peak / 1e9,
                "times": summary(times),
            },
        )
    ]
