"""Benchmark 16: how often an evaluation loop with adaptive halting asks the host (``LoopConfig.sync_every``).

Halting decided on the device with a host read every k iterations gives the same results for every k (the
finished rows are frozen; tests/test_loop_sync.py) but carries a finished row, and computes its step, until
the next read (with compaction it leaves then). So k trades host reads (a GPU stall each) for wasted map
evaluations. Counted, not timed (deterministic): for each problem and k, the rows the map evaluates (with
compaction) relative to k = 1, and the host reads per loop (``HostReads``):

- ``fprm_sudoku4``: the FPRM evaluation loop of recipes/sudoku4_fprm.yaml (damped, gamma 0.99, residual
  halting at 0.1, cap 64) on 200 held-out 4x4 puzzles, with the halting benchmark's trained weights;
- ``linear_rho0.9`` / ``linear_rho0.99``: the solver benchmark's symmetric linear maps (anderson, tol 1e-6).

The default for a GPU (``loopformer.loop.config.SYNC_EVERY_CUDA``) is the largest k whose extra map evaluations
stay within ``TARGET_EXTRA`` (10%) on every problem; on the CPU a host read costs nothing, so ``auto`` keeps
k = 1 there.
"""

from __future__ import annotations

import dataclasses

import torch

from benchmarks.common import Result

KS = (1, 2, 4, 8, 16)
TARGET_EXTRA = 0.10


def _count(step, z0, ctx, cfg) -> tuple[int, int]:
    from loopformer.devices import HostReads
    from loopformer.loop import run_loop

    rows = [0]

    def counted(z, *c):
        rows[0] += z.shape[0]
        return step(z, *c)

    with torch.no_grad(), HostReads() as reads:
        run_loop(counted, z0, cfg, ctx=ctx)
    return rows[0], reads.total


def _problems(quick: bool) -> dict:
    from benchmarks.bench_halting import trained_model
    from benchmarks.bench_solvers import DT, linear_problem
    from loopformer.config import load_config
    from loopformer.loop import LoopConfig
    from loopformer.runs import run_task, task_dataset

    out = {}
    for rho in (0.9, 0.99):
        w, x, *_ = linear_problem(32 if quick else 128, 8, rho)
        out[f"linear_rho{rho}"] = (lambda z, xx, w=w: z @ w.T + xx, torch.zeros(x.shape, dtype=DT), (x,),
                                   LoopConfig(solver="anderson", halting="residual", tol=1e-6, max_steps=2000))  # fmt: skip
    model, cfg, *_ = trained_model(quick)
    run = load_config("sudoku4_fprm", ["data.eval_size=64" if quick else "data.eval_size=200"])
    data = task_dataset(run_task(run.data), run.data, "eval")
    inputs = torch.as_tensor(data.inputs)
    ctx = model.embed(inputs)
    z0 = model.init_state(ctx, torch.Generator().manual_seed(0))
    loop = cfg.loop_config(model.config.loop, "eval")
    out["fprm_sudoku4"] = (model.step, z0, ctx, loop)
    return out


def run(quick: bool = False) -> list[Result]:
    from loopformer.loop.config import SYNC_EVERY_CUDA

    torch.set_num_threads(1)
    results, extra_by_k = [], {k: 0.0 for k in KS}
    for name, (step, z0, ctx, cfg) in _problems(quick).items():
        base_rows, base_reads = _count(step, z0, ctx, dataclasses.replace(cfg, sync_every=1))
        for k in KS[1:]:
            rows, reads = _count(step, z0, ctx, dataclasses.replace(cfg, sync_every=k))
            extra = rows / base_rows - 1
            extra_by_k[k] = max(extra_by_k[k], extra)
            results.append(Result("sync", f"sync.{name}.k{k}", extra, "fraction", None, None,
                                  f"extra map evaluations with a host read every {k} iterations; host reads per loop "
                                  f"{reads} (k = 1: {base_reads})",
                                  {"rows": rows, "rows_k1": base_rows, "reads": reads, "reads_k1": base_reads}))  # fmt: skip
    chosen = max((k for k in KS if extra_by_k[k] <= TARGET_EXTRA), default=1)
    results.append(Result("sync", "sync.default_cuda", SYNC_EVERY_CUDA, "iterations", f"= the largest k within "
                          f"{TARGET_EXTRA:.0%} extra map evaluations ({chosen})", SYNC_EVERY_CUDA == chosen,
                          f"worst extra map evaluations by k: {({k: round(v, 3) for k, v in extra_by_k.items()})}",
                          {"extra_by_k": extra_by_k, "chosen": chosen}))  # fmt: skip
    return results
