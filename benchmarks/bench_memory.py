"""Benchmark 3: training memory vs loop count for every gradient mode.

The memory a training step keeps alive between forward and backward is the set of tensors
autograd saves for backward. ``torch.autograd.graph.saved_tensors_hooks`` sees every one of them;
counting each distinct storage once (weights saved by many matmuls count once) gives the exact
activation memory of the step, independent of allocator noise. Measured for an FPRM forward
(arXiv 2606.18206) at 4, 16 and 64 loops with fixed halting, per gradient mode
(loopformer/loop/grad.py, engine.py):

- ``bptt`` unrolls every loop: memory must grow linearly (checked: the per-loop increment from 4 to
  16 loops matches the one from 16 to 64 within 10%);
- ``truncated`` (fixed k = 4 differentiable loops; ``truncated_adaptive`` is the same gradient
  through the engine's adaptive-halting path: damped solver, residual halting that never fires,
  a k+1-slot ring buffer and a replay of the last k steps), ``onestep``, ``neumann`` (k = 4) and ``ift``
  keep a constant number of loops' worth: growth from 4 to 64 loops must be at most 1.15x.

The peak of the process's resident memory is not used: it only grows and mixes in everything else.
"""

from __future__ import annotations

import torch

from benchmarks.common import Result, StepSize, make_batch, make_fprm

LOOPS = (4, 16, 64)
MODES = ("bptt", "truncated", "truncated_adaptive", "onestep", "neumann", "ift")
FLAT_TARGET = 1.15
FULL = StepSize(d_model=64, n_heads=4, grid=9, batch=4, loops=0, grad_steps=4)
QUICK = StepSize(d_model=16, n_heads=2, grid=4, batch=2, loops=0, grad_steps=4)


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn`` runs."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def measure_mode(model, inputs, labels, z0, mode: str, loops: int, k: int) -> int:
    from loopformer.loop import LoopConfig

    adaptive = mode == "truncated_adaptive"
    mode = "truncated" if adaptive else mode
    loop = LoopConfig(
        solver="damped" if adaptive else "picard",
        halting="residual" if adaptive else "fixed",
        tol=1e-30,  # adaptive: residual halting that never fires, so every loop runs
        max_steps=loops,
        grad=mode,
        grad_steps=k if mode in ("truncated", "neumann") else 1,
        trace=False,
    )

    def forward():
        out = model(inputs, loop=loop, state=z0)
        return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())

    return saved_bytes(forward)


def run(quick: bool = False) -> list[Result]:
    size = QUICK if quick else FULL
    model = make_fprm(size)
    inputs, labels, z0 = make_batch(size)
    results = []
    for mode in MODES:
        mem = {n: measure_mode(model, inputs, labels, z0, mode, n, size.grad_steps) for n in LOOPS}
        growth = mem[LOOPS[-1]] / mem[LOOPS[0]]
        details = {"saved_bytes": mem, "size": size.__dict__, "loops": list(LOOPS)}
        if mode == "bptt":
            inc1 = (mem[16] - mem[4]) / 12
            inc2 = (mem[64] - mem[16]) / 48
            linearity = inc2 / inc1 if inc1 > 0 else float("inf")
            met = abs(linearity - 1) <= 0.10 and growth > 4
            details.update(bytes_per_loop=inc2, increment_ratio=linearity)
            target = "linear in loops (per-loop increment 4->16 vs 16->64 within 10%)"
            reason = "" if met else f"per-loop increments differ by {abs(linearity - 1):.0%}"
        else:
            met = growth <= FLAT_TARGET
            target = f"<= {FLAT_TARGET:.2f}"
            reason = "" if met else f"saved memory grows {growth:.2f}x from {LOOPS[0]} to {LOOPS[-1]} loops"
        results.append(
            Result(
                benchmark="memory",
                name=f"memory_growth.{mode}",
                value=growth,
                unit="x",
                target=target,
                met=met,
                reason=reason,
                details=details,
            )
        )
    return results
