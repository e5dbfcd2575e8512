"""Shared pieces of the benchmarks: results, side-by-side timing, machine description, sizes.

Every figure is a ratio of two (or more) variants measured *side by side in one run*: the
variants' repetitions are interleaved (A B, B A, A B, ...) and the figure is the median of the
per-pair ratios, so a load spike hits both members of a pair and cancels (the development machine
is shared and noisy). Absolute medians are kept in the details.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

REQUIRED_FIELDS = ("benchmark", "name", "value", "unit", "target", "met")


@dataclass
class Result:
    """One figure of results.json: ``met`` is True / False, or None when there is no target or it was skipped."""

    benchmark: str  # the group (--only NAME)
    name: str
    value: float | None
    unit: str
    target: str | None  # human-readable target, e.g. "<= 1.10"; None = informational
    met: bool | None
    reason: str = ""  # why a target was missed, skipped or what the figure means
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self, quick: bool) -> dict[str, Any]:
        value = None if self.value is None else float(self.value)
        return {
            "benchmark": self.benchmark,
            "name": self.name,
            "value": value,
            "unit": self.unit,
            "target": self.target,
            "met": self.met,
            "reason": self.reason,
            "quick": quick,
            "load_average": round(os.getloadavg()[0], 2),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "details": _jsonable(self.details),
        }


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return _jsonable(obj.tolist())
    if isinstance(obj, float):
        return obj if obj == obj and abs(obj) != float("inf") else None
    if isinstance(obj, (int, str, bool)) or obj is None:
        return obj
    return str(obj)


def timed(fn: Callable[[], Any], clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of one call by ``clock`` (wall time by default; ``time.process_time`` gives this
    process's CPU seconds, steadier than wall time for one-thread work on a shared machine)."""
    start = clock()
    fn()
    return clock() - start


def side_by_side(
    variants: dict[str, Callable[[], Any]],
    repeats: int,
    warmup: int = 1,
    budget_s: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Run each variant ``warmup`` times, then ``repeats`` interleaved rounds; the order of the
    variants rotates every round so none always runs first. With ``budget_s``, no new round starts
    once that many seconds have passed (at least one round always runs). Returns times per variant
    (by ``clock``, wall time by default)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(variants)
    start = time.perf_counter()
    for _ in range(warmup):
        for name in names:
            variants[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        if r and budget_s is not None and time.perf_counter() - start > budget_s:
            break
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(timed(variants[name], clock))
    return times


def paired_ratio(times: dict[str, list[float]], num: str, den: str) -> float:
    """Median over rounds of times[num][i] / times[den][i] (the round-i pair ran back to back)."""
    return statistics.median(a / b for a, b in zip(times[num], times[den]))


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def summary(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Median / min / max seconds per variant, for the details."""
    return {
        name: {
            "median_s": round(median(ts), 6),
            "min_s": round(min(ts), 6),
            "max_s": round(max(ts), 6),
            "n": len(ts),
        }
        for name, ts in times.items()
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """What the numbers were measured on (rendered into docs/performance.md)."""
    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.cuda.is_available(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit in ("x", "fraction"):
        return f"{value:.3f}"
    if unit == "bytes":
        return f"{value / 2**20:.2f} MiB"
    if unit in ("lines", "modules"):
        return f"{value:,.0f}"
    return f"{value:.4g}"


# ------------------------------------------------------------------------------------------------
# The shared workload: an FPRM training step (arXiv 2606.18206) on Sudoku-shaped tokens
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepSize:
    """Size of the FPRM training-step workload."""

    d_model: int
    n_heads: int
    grid: int  # grid side: seq_len = grid * grid tokens (9 = Sudoku 9x9)
    batch: int
    loops: int  # iterations per training call
    grad_steps: int  # differentiable final iterations (truncated BPTT)

    @property
    def seq_len(self) -> int:
        return self.grid * self.grid


FULL_STEP = StepSize(d_model=128, n_heads=4, grid=9, batch=16, loops=16, grad_steps=6)
QUICK_STEP = StepSize(d_model=32, n_heads=2, grid=4, batch=4, loops=4, grad_steps=2)


def make_fprm(size: StepSize, seed: int = 0):
    """A fresh FPRM (pre-norm, tied residual scaling, 2-D grid conv) of the given size."""
    from loopformer.models.fprm import FPRM, FPRMConfig

    torch.manual_seed(seed)
    cfg = FPRMConfig(
        vocab_size=11,
        seq_len=size.seq_len,
        d_model=size.d_model,
        n_heads=size.n_heads,
        n_layers=2,
        grid=(size.grid, size.grid),
        conv="grid2d",
        q_head=False,  # no Q-head: the benchmarks compare loops, not heads
    )
    return FPRM(cfg)


def make_batch(size: StepSize, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs [B, T], labels [B, T], z0 [B, T, d]) drawn from a fixed seed."""
    from loopformer.nn import trunc_normal_state

    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, 11, (size.batch, size.seq_len), generator=g)
    labels = torch.randint(1, 11, (size.batch, size.seq_len), generator=g)
    z0 = trunc_normal_state((size.batch, size.seq_len, size.d_model), 6.0, generator=g)
    return inputs, labels, z0


def train_loop_config(size: StepSize, solver: str = "damped"):
    """FPRM's training loop: fixed iteration count, truncated backprop through the last k steps."""
    from loopformer.loop import LoopConfig

    return LoopConfig(
        solver=solver,
        plugins={"damped": {"gamma": 0.9, "patience": 5}},
        halting="fixed",
        max_steps=size.loops,
        residual_norm="rel_sup",
        grad="truncated",
        grad_steps=size.grad_steps,
        trace=False,
    )


def engine_train_step(model, inputs, labels, z0, loop) -> torch.Tensor:
    """Forward through loopformer (LoopedModel.forward -> run_loop) + backward; returns the loss."""
    import torch.nn.functional as F

    model.zero_grad(set_to_none=True)
    out = model(inputs, loop=loop, state=z0)
    loss = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
    loss.backward()
    return loss.detach()
