"""Evaluation and loop analyses: validator accuracy, test-time compute, adaptivity, logit lens,
overthinking, signal propagation, Jacobian spectral radius; plots and reports."""

from loopformer.eval.analysis import (
    LoopCurve,
    SignalCurve,
    logit_lens,
    logit_margin,
    overthinking,
    signal_propagation,
    spectral_radius,
    spectral_radius_at_fixed_point,
    trace_loops,
)
from loopformer.eval.budget import (
    BudgetCurve,
    DifficultyStats,
    accuracy_vs_budget,
    steps_vs_difficulty,
    with_budget,
)
from loopformer.eval.evaluate import EvalResult, evaluate

__all__ = [
    "BudgetCurve",
    "DifficultyStats",
    "EvalResult",
    "LoopCurve",
    "SignalCurve",
    "accuracy_vs_budget",
    "evaluate",
    "logit_lens",
    "logit_margin",
    "overthinking",
    "signal_propagation",
    "spectral_radius",
    "spectral_radius_at_fixed_point",
    "steps_vs_difficulty",
    "trace_loops",
    "with_budget",
]
