"""Test-time compute and adaptivity: accuracy at each step budget, steps against difficulty.

- ``budget_curve``: the test-time compute curve. The loop is run with ``max_steps`` set to each
  budget, either with the halting rule forced to ``fixed`` (exactly ``b`` loops) or with the model's
  own halting rule capped at ``b`` (FPRM halts at a fixed point or at the cap). Each point is one
  ``loopformer.eval.evaluate.evaluate`` pass (validator accuracy, ``BudgetPoint``), or one
  ``evaluate_lm`` pass for a task without a validator (bits per byte, ``LMBudgetPoint``: the curve of
  a looped language model). ``clip_budgets``: ``capped`` budgets above the model's cap give way to
  the cap, with a note.
- ``steps_vs_difficulty``: mean steps per difficulty bucket and the Spearman rank correlation
  between difficulty and steps (FPRM: "more iterations for puzzles with more blanks").
- ``easy_hard_steps``: mean steps on the easier and the harder half of a dataset.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from loopformer.eval.evaluate import evaluate, evaluate_lm
from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel
from loopformer.tasks.base import Task, TokenDataset

BUDGET_MODES = ("fixed", "capped")


def with_budget(cfg: LoopConfig, budget: int, mode: str = "fixed") -> LoopConfig:
    """``cfg`` with the step cap set to ``budget``; ``fixed`` also forces exactly ``budget`` loops."""
    if budget < 1:
        raise ValueError(f"a step budget must be >= 1, got {budget}")
    if mode not in BUDGET_MODES:
        raise ValueError(f"unknown budget mode {mode!r} (known: {', '.join(BUDGET_MODES)})")
    changes: dict[str, Any] = {"max_steps": int(budget)}
    if mode == "fixed":
        changes["halting"] = "fixed"
    if cfg.min_steps > budget:
        changes["min_steps"] = int(budget)
    return dataclasses.replace(cfg, **changes)


# ------------------------------------------------------------------------------------------------
# test-time compute
# ------------------------------------------------------------------------------------------------


@dataclass
class BudgetPoint:
    budget: int
    valid_accuracy: float
    exact_accuracy: float
    token_accuracy: float
    mean_steps: float
    converged_fraction: float


@dataclass
class LMBudgetPoint:
    budget: int
    bits_per_byte: float
    loss: float
    token_accuracy: float
    mean_steps: float


@dataclass
class BudgetCurve:
    """The metrics at each step budget (``mode``: fixed | capped); ``LMBudgetPoint`` points for a
    language model."""

    mode: str
    points: list[BudgetPoint] | list[LMBudgetPoint]

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "points": [dataclasses.asdict(p) for p in self.points]}


def clip_budgets(budgets: Sequence[int], mode: str, cap: int) -> tuple[list[int], str | None]:
    """(the budgets a curve evaluates, the note saying which were clipped): under ``capped`` a budget above
    the evaluation loop's own cap is no budget of that model, so those give way to the cap itself; ``fixed``
    budgets (exactly b loops: the overthinking curve) are kept as they are."""
    kept = sorted({int(b) for b in budgets})
    above = [b for b in kept if b > cap]
    if mode != "capped" or not above:
        return kept, None
    note = (f"Step budgets {', '.join(map(str, above))} exceed the evaluation loop's cap ({cap} steps): the "
            "budget table stops at the cap (raise loop_eval.max_steps, or --budget-mode fixed, to go past it).")  # fmt: skip
    return sorted({b for b in kept if b <= cap} | {int(cap)}), note


def budget_curve(
    model: LoopedModel,
    task: Task,
    dataset: TokenDataset,
    budgets: Sequence[int],
    mode: str = "fixed",
    loop: LoopConfig | None = None,
    batch_size: int = 64,
    max_batches: int | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
    seed: int = 0,
) -> BudgetCurve:
    """The metrics at each inference step budget (``fixed``: exactly b loops; ``capped``: halting rule,
    cap b), one segment per example: validator accuracy, or bits per byte when ``task`` has no validator."""
    if not budgets:
        raise ValueError("give at least one step budget")
    if mode not in BUDGET_MODES:
        raise ValueError(f"unknown budget mode {mode!r} (known: {', '.join(BUDGET_MODES)})")
    base = loop if loop is not None else model.config.loop
    points: list[Any] = []
    for b in sorted({int(b) for b in budgets}):
        kwargs = {"loop": with_budget(base, b, mode), "batch_size": batch_size, "max_batches": max_batches,
                  "device": device, "progress": progress, "seed": seed}  # fmt: skip
        if task is not None and not task.has_validator:
            lm = evaluate_lm(model, task, dataset, **kwargs)
            points.append(LMBudgetPoint(b, lm.bits_per_byte, lm.loss, lm.token_accuracy, lm.mean_steps))
            continue
        res = evaluate(model, task, dataset, **kwargs)
        points.append(BudgetPoint(b, res.valid_accuracy, res.exact_accuracy, res.token_accuracy, res.mean_steps,
                                  res.converged_fraction))  # fmt: skip
    return BudgetCurve(mode, points)


# ------------------------------------------------------------------------------------------------
# adaptivity: steps vs difficulty
# ------------------------------------------------------------------------------------------------


@dataclass
class DifficultyBucket:
    low: float
    high: float
    count: int
    mean_steps: float
    valid_accuracy: float


@dataclass
class DifficultyStats:
    buckets: list[DifficultyBucket]
    spearman_rho: float
    spearman_p: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "spearman_rho": self.spearman_rho,
            "spearman_p": self.spearman_p,
            "buckets": [dataclasses.asdict(b) for b in self.buckets],
        }

    def mean_steps_by_difficulty(self) -> dict[str, float]:
        """``{"low-high": mean steps}`` (``"d"`` when a bucket holds one difficulty value)."""
        out = {}
        for b in self.buckets:
            key = _fmt(b.low) if b.low == b.high else f"{_fmt(b.low)}-{_fmt(b.high)}"
            out[key] = b.mean_steps
        return out


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.3g}"


def steps_vs_difficulty(
    difficulty: Sequence[float] | np.ndarray,
    steps: Sequence[float] | np.ndarray,
    valid: Sequence[bool] | np.ndarray | None = None,
    max_buckets: int = 8,
) -> DifficultyStats:
    """Mean steps per difficulty bucket (one per distinct value, or quantile buckets beyond
    ``max_buckets`` values) and Spearman's rho between difficulty and steps (nan when either is constant)."""
    d = np.asarray(difficulty, dtype=np.float64)
    s = np.asarray(steps, dtype=np.float64)
    v = np.zeros(len(d), dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
    if d.shape != s.shape or d.ndim != 1 or len(d) == 0:
        raise ValueError(f"difficulty {d.shape} and steps {s.shape} must be equal non-empty 1-D arrays")
    values = np.unique(d)
    if len(values) <= max_buckets:
        edges = [(x, x) for x in values]
        members = [d == x for x in values]
    else:
        qs = np.unique(np.quantile(d, np.linspace(0, 1, max_buckets + 1)))
        edges, members = [], []
        for k in range(len(qs) - 1):
            lo, hi = qs[k], qs[k + 1]
            m = (d >= lo) & ((d < hi) if k < len(qs) - 2 else (d <= hi))
            if m.any():
                edges.append((float(d[m].min()), float(d[m].max())))
                members.append(m)
    buckets = [
        DifficultyBucket(float(lo), float(hi), int(m.sum()), float(s[m].mean()), float(v[m].mean()))
        for (lo, hi), m in zip(edges, members)
    ]
    if len(d) < 3 or np.all(d == d[0]) or np.all(s == s[0]):
        rho, p = float("nan"), float("nan")
    else:
        from scipy import stats  # here only: importing the evaluation must not load scipy

        r = stats.spearmanr(d, s)
        rho, p = float(r.statistic), float(r.pvalue)
    return DifficultyStats(buckets, rho, p)


def easy_hard_steps(difficulty: np.ndarray, steps: np.ndarray) -> dict[str, float]:
    """Mean steps on the easier and the harder half (split at the median difficulty)."""
    d = np.asarray(difficulty, dtype=np.float64)
    s = np.asarray(steps, dtype=np.float64)
    med = float(np.median(d))
    easy, hard = d <= med, d > med
    if not hard.any():  # all at or below the median: split strictly below instead
        easy, hard = d < med, d >= med
    return {
        "easy_mean_steps": float(s[easy].mean()) if easy.any() else float("nan"),
        "hard_mean_steps": float(s[hard].mean()) if hard.any() else float("nan"),
        "split_difficulty": med,
    }
