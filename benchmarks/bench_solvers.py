"""Benchmark 5: fixed-point solvers, loopformer vs TorchDEQ, on the same maps and tolerances.

Problems:
- closed-form linear maps ``f(z) = z W^T + x`` (float64) with ``W = Q diag(eigs) Q^T``, spectral
  radius exactly 0.9 and 0.99, tolerance 1e-6 on the relative residual ``||f(z) - z|| / ||f(z)||``;
  the fixed point ``(I - W)^-1 x`` and the implicit gradient ``d<w, z*>/dx = (I - W)^-T w`` are known,
  so each method's IFT gradient error is reported against the closed form;
- a trained FPRM's real fixed points (the 4x4 Sudoku model of the halting benchmark, float32,
  tolerance 1e-4: float32 cannot certify 1e-6 on a 1024-number state).

loopformer: ``run_loop`` with picard / damped / anderson (relative regulariser) / broyden (bounded
memory: m = 16 by default, and m = 128), per-sample residual halting with compaction, ``grad="ift"``.
TorchDEQ 0.1.0 (``get_deq(f_solver=..., b_solver=..., ift=True, f_stop_mode="rel")``, its solvers
``fixed_point_iter``, ``anderson``, ``broyden`` with their default settings).
Wall time of the forward solve (with gradient tracking on, as in training), median of interleaved
repetitions. Figure: loopformer's best median time / TorchDEQ's best. Target: <= 0.3, and
loopformer's best iteration count no more than TorchDEQ's best. Without TorchDEQ installed
(``pip install torchdeq==0.1.0``) the comparison is recorded as skipped (met = null).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from benchmarks.common import Result, median, side_by_side

DT = torch.float64
TARGET_TIME = 0.3
LF_SOLVERS = {"picard": {}, "damped": {}, "anderson": {}, "broyden": {}, "broyden_m128": {"broyden_m": 128}}
TDQ_SOLVERS = ("fixed_point_iter", "anderson", "broyden")


def torchdeq_version() -> str | None:
    try:
        import torchdeq
    except ImportError:
        return None
    return getattr(torchdeq, "__version__", "0.1.0")


def linear_problem(d: int, b: int, rho: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=DT))
    eigs = (torch.rand(d, generator=g, dtype=DT) * 2 - 1) * rho
    eigs[0] = rho
    w = q @ torch.diag(eigs) @ q.T
    x = torch.randn(b, d, generator=g, dtype=DT)
    v = torch.randn(b, d, generator=g, dtype=DT)
    eye = torch.eye(d, dtype=DT)
    z_star = torch.linalg.solve(eye - w, x.T).T
    grad_x = torch.linalg.solve((eye - w).T, v.T).T
    return w, x, v, z_star, grad_x


def lf_solve(step: Callable, z0: torch.Tensor, x: torch.Tensor, solver: str, tol: float, max_steps: int):
    """One loopformer solve; returns (state, max iterations)."""
    from loopformer.loop import LoopConfig, run_loop

    extra = LF_SOLVERS[solver]
    cfg = LoopConfig(
        solver="broyden" if solver.startswith("broyden") else solver,
        halting="residual",
        tol=tol,
        residual_norm="rel_l2",
        max_steps=max_steps,
        grad="ift",
        ift_tol=tol,
        ift_max_steps=max_steps,
        **extra,
    )
    res = run_loop(step, z0, cfg, ctx=(x,))
    return res.state, int(res.steps.max()), bool(res.converged.all())


def tdq_solve(step: Callable, z0: torch.Tensor, x: torch.Tensor, solver: str, tol: float, max_steps: int):
    from torchdeq import get_deq

    deq = get_deq(
        f_solver=solver,
        b_solver=solver,
        f_max_iter=max_steps,
        b_max_iter=max_steps,
        f_tol=tol,
        b_tol=tol,
        f_stop_mode="rel",
        b_stop_mode="rel",
        ift=True,
    )
    deq.train()
    zs, info = deq(lambda z: step(z, x), z0)
    return zs[-1], int(info["nstep"].max()), bool((info["rel_lowest"] < tol).all())


def compare(problem: str, step, z0, x, tol, max_steps, repeats, have_tdq, grad_check=None) -> Result:
    variants: dict[str, Callable] = {}
    stats: dict[str, dict] = {}
    for s in LF_SOLVERS:
        variants[f"loopformer.{s}"] = lambda s=s: lf_solve(step, z0, x, s, tol, max_steps)
    if have_tdq:
        for s in TDQ_SOLVERS:
            variants[f"torchdeq.{s}"] = lambda s=s: tdq_solve(step, z0, x, s, tol, max_steps)
    for name, fn in variants.items():
        z, iters, ok = fn()
        stats[name] = {"iterations": iters, "converged": ok}
        if grad_check is not None:
            stats[name].update(grad_check(z))
    times = side_by_side(variants, repeats=repeats, warmup=0)
    for name, ts in times.items():
        stats[name]["median_s"] = median(ts)

    def best(prefix: str) -> tuple[str, float, int]:
        cand = {k: v for k, v in stats.items() if k.startswith(prefix) and v["converged"]}
        if not cand:
            cand = {k: v for k, v in stats.items() if k.startswith(prefix)}
        name = min(cand, key=lambda k: cand[k]["median_s"])
        return name, cand[name]["median_s"], min(v["iterations"] for v in cand.values())

    lf_name, lf_time, lf_iters = best("loopformer.")
    details = {"problem": problem, "tol": tol, "solvers": stats, "loopformer_best": lf_name}
    if not have_tdq:
        return Result(
            "solvers",
            f"solvers.{problem}",
            None,
            "x",
            f"<= {TARGET_TIME} x TorchDEQ best",
            None,
            "skipped: torchdeq is not importable (pip install torchdeq==0.1.0)",
            details,
        )
    tdq_name, tdq_time, tdq_iters = best("torchdeq.")
    ratio = lf_time / tdq_time
    details.update(
        torchdeq_best=tdq_name, loopformer_best_iterations=lf_iters, torchdeq_best_iterations=tdq_iters
    )
    met = ratio <= TARGET_TIME and lf_iters <= tdq_iters
    reasons = []
    if ratio > TARGET_TIME:
        reasons.append(f"{lf_name} takes {ratio:.2f}x the time of {tdq_name}")
    if lf_iters > tdq_iters:
        reasons.append(f"fewest iterations {lf_iters} (loopformer) vs {tdq_iters} (TorchDEQ)")
    return Result(
        "solvers",
        f"solvers.{problem}",
        ratio,
        "x",
        f"<= {TARGET_TIME} x TorchDEQ best time, iterations <= its best",
        met,
        "; ".join(reasons),
        details,
    )


def linear_results(quick: bool, have_tdq: bool) -> list[Result]:
    d, b = (16, 2) if quick else (128, 8)
    out = []
    for rho in (0.9, 0.99):
        w, x, v, z_star, grad_x = linear_problem(d, b, rho)
        xg = x.clone().requires_grad_(True)

        def step(z, x_, w=w):
            return z @ w.T + x_

        def grad_check(z, v=v, z_star=z_star, grad_x=grad_x, xg=xg):
            (g,) = torch.autograd.grad((z * v).sum(), xg)
            return {
                "state_rel_err": float((z.detach() - z_star).norm() / z_star.norm()),
                "grad_rel_err": float((g - grad_x).norm() / grad_x.norm()),
            }

        tol = 1e-3 if quick else 1e-6  # quick: the smoke test only exercises the code
        out.append(
            compare(
                f"linear_rho{rho}",
                step,
                torch.zeros(b, d, dtype=DT),
                xg,
                tol,
                5000,
                2 if quick else 5,
                have_tdq,
                grad_check,
            )
        )
    return out


def model_result(quick: bool, have_tdq: bool) -> Result:
    from benchmarks.bench_halting import trained_model
    from loopformer.tasks.registry import get_task

    model, _, _, _ = trained_model(quick)
    data = get_task("sudoku", size=4).generate(8 if quick else 32, seed=777, min_blanks=4, max_blanks=10)
    inputs = torch.as_tensor(data.inputs, dtype=torch.long)
    with torch.no_grad():
        (x,) = model.embed(inputs)
        z0 = model.init_state((x,), generator=torch.Generator().manual_seed(0))
    x = x.detach()
    return compare(
        "fprm_sudoku4", model.step, z0, x, 1e-4, 100 if quick else 300, 1 if quick else 3, have_tdq
    )


def run(quick: bool = False) -> list[Result]:
    have_tdq = torchdeq_version() is not None
    results = linear_results(quick, have_tdq)
    results.append(model_result(quick, have_tdq))
    for r in results:
        r.details["torchdeq"] = torchdeq_version()
        if r.value is not None and not math.isfinite(r.value):
            r.value = None
    return results
