"""Matplotlib figures for evaluations and loop analyses.

One function per figure; each takes the result objects of ``loopformer.eval.evaluate`` /
``loopformer.eval.analysis`` (or their ``to_dict()`` form) and returns a ``matplotlib.figure.Figure``
(shown inline in a notebook); with ``path`` it also writes the PNG there (``save_figure`` does the same
for a figure in hand); ``title`` (e.g. ``"fprm · damped solver · residual halting tol 0.1 · cap 64"``)
is written above the plot.  Figures are built with the object-oriented API, never through pyplot, so the
matplotlib backend (and a notebook's state) is left alone.
Several series (e.g. the looped model and its baseline) can be drawn on one figure by passing a
``{label: result}`` mapping.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from loopformer.eval.analysis import LMLoopCurve, LoopCurve, SignalCurve
from loopformer.eval.budget import BudgetCurve, LMBudgetPoint, steps_vs_difficulty
from loopformer.eval.evaluate import EvalResult


def _series(x: Any) -> Mapping[str, Any]:
    return x if isinstance(x, Mapping) else {"": x}


def figure(figsize: tuple[float, float], ncols: int = 1) -> tuple[Figure, Any]:
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(1, ncols)


def save_figure(fig: Figure, path: str | Path | None = None) -> Figure:
    """Write ``fig`` as a PNG at ``path`` (folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from loopformer.files import atomic_writer

    with atomic_writer(path, "wb", root=path.parent) as fh:  # the format from the name, not the temp file's
        fig.savefig(fh, dpi=110, format=path.suffix.lstrip(".").lower() or "png")
    return path


def finish(fig: Figure, path: str | Path | None, title: str = "") -> Figure:
    if title:  # the run and its loop (report.describe_loop): solver, halting, tolerance, cap
        fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path)
    return fig


def _legend(ax: Any, labels: Mapping[str, Any]) -> None:
    if any(labels):
        ax.legend(frameon=False)


def log2_axis(ax: Any, values: Any, label: str = "inference step budget (max loops, log2)") -> None:
    """A log2 x-axis with a labelled tick at every power of two spanning ``values`` (at least 1, 2, 4),
    written as integers (1, 2, 4, ... not 2^0, 2^1, ...), so one point or a short range still reads."""
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    finite = [float(v) for v in values if v is not None and np.isfinite(v) and v > 0]
    low = 2 ** int(np.floor(np.log2(min(finite)))) if finite else 1
    high = 2 ** int(np.ceil(np.log2(max(finite)))) if finite else 4
    ticks = [2**k for k in range(int(np.log2(low)), int(np.log2(max(high, 4 * low))) + 1)]
    ax.set_xscale("log", base=2)
    ax.set_xlim(ticks[0] / 1.25, ticks[-1] * 1.25)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(label)


def reference_lines(
    ax: Any, lines: Mapping[str, float] | None, scale: float = 100.0, unit: str = "%"
) -> None:
    """Horizontal dashed lines at ``{label: value}``: the models without a loop budget (a plain
    transformer baseline, the model under its own halting rule), labelled with their value."""
    styles = ("--", ":", "-.")
    for i, (label, value) in enumerate((lines or {}).items()):
        if value is None or not np.isfinite(value):
            continue
        shown = f"{scale * value:.1f}{unit}" if unit == "%" else f"{value:.3f}{unit}"
        ax.axhline(scale * value, color="gray", ls=styles[i % len(styles)], lw=1.2, label=f"{label}: {shown}")


def plot_budget_curve(
    curves: BudgetCurve | Mapping[str, BudgetCurve],
    path: str | Path | None = None,
    title: str = "",
    references: Mapping[str, float] | None = None,
) -> Figure:
    """The test-time compute curve on a log2 axis: validator accuracy vs inference step budget, or held-out
    bits per byte vs loop budget (lower is better) for a language model's curve (``LMBudgetPoint``);
    ``references`` ({label: accuracy in [0, 1], or bits per byte}: the baseline, the model under its own
    halting rule) are drawn as horizontal lines."""
    curves = _series(curves)
    lm = any(isinstance(p, LMBudgetPoint) for c in curves.values() for p in c.points)
    fig, ax = figure((5.5, 3.8))
    budgets: list[int] = []
    for label, c in curves.items():
        b = [p.budget for p in c.points]
        budgets += b
        ys = [p.bits_per_byte if lm else 100 * p.valid_accuracy for p in c.points]
        ax.plot(b, ys, marker="o", label=label or None)
    mode = next(iter(curves.values())).mode if curves else ""
    if lm:
        reference_lines(ax, references, scale=1.0, unit=" bits/byte")
        log2_axis(ax, budgets, "inference loop budget (max loops, log2)")
        ax.set_ylabel("held-out bits per byte (lower is better)")
        ax.set_title(f"bits per byte vs loop budget ({mode})")
    else:
        reference_lines(ax, references)
        log2_axis(ax, budgets)
        ax.set_ylabel("valid accuracy (%)")
        ax.set_ylim(-2, 102)
        ax.set_title(f"accuracy vs step budget ({mode})")
    ax.grid(alpha=0.3)
    if any(curves) or references:
        ax.legend(frameon=False, fontsize=7)
    return finish(fig, path, title)


def plot_lm_lens(curve: LMLoopCurve, path: str | Path | None = None, title: str = "") -> Figure:
    """Logit lens of a language model: bits per byte (left axis) and token accuracy (right axis) of every
    loop's readout; the training depth marked."""
    fig, ax = figure((5.5, 3.8))
    ax.plot(curve.loops, curve.bits_per_byte, color="tab:blue", marker=".", label="bits per byte")
    ax.set_xlabel("loop")
    ax.set_ylabel("bits per byte (lower is better)", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(curve.loops, [100 * a for a in curve.token_accuracy], color="tab:green", ls="--")
    ax2.set_ylabel("token accuracy (%)", color="tab:green")
    if curve.train_depth:
        ax.axvline(curve.train_depth, color="gray", ls=":", lw=1)
        ax.text(curve.train_depth, ax.get_ylim()[1], " train depth", va="top", fontsize=8, color="gray")
    ax.set_title("logit lens: every loop's readout")
    ax.grid(alpha=0.3)
    return finish(fig, path, title)


def plot_steps_histogram(result: EvalResult, path: str | Path | None = None, title: str = "") -> Figure:
    """How many loop steps examples took."""
    fig, ax = figure((5, 3.5))
    ks = sorted(result.steps_histogram)
    ax.bar(ks, [result.steps_histogram[k] for k in ks], width=0.8, color="tab:blue")
    ax.set_xlabel("loop steps")
    ax.set_ylabel("examples")
    ax.set_title(f"steps per example (mean {result.mean_steps:.2f})")
    return finish(fig, path, title)


def plot_steps_vs_difficulty(result: EvalResult, path: str | Path | None = None, title: str = "") -> Figure:
    """Scatter of (difficulty, steps) per example with the mean per difficulty bucket."""
    d, s = result.difficulty, result.steps.astype(float)
    stats = steps_vs_difficulty(d, s, result.valid)
    rng = np.random.default_rng(0)
    jitter = (rng.random(len(d)) - 0.5) * 0.3 * (np.ptp(d) / max(1, len(np.unique(d))) if len(d) else 0)
    fig, ax = figure((5, 3.5))
    ok = result.valid
    ax.scatter((d + jitter)[ok], s[ok], s=8, alpha=0.35, color="tab:green", label="valid")
    ax.scatter((d + jitter)[~ok], s[~ok], s=8, alpha=0.35, color="tab:red", label="invalid")
    centers = [(b.low + b.high) / 2 for b in stats.buckets]
    ax.plot(centers, [b.mean_steps for b in stats.buckets], color="black", marker="o", label="mean")
    ax.set_xlabel("difficulty")
    ax.set_ylabel("loop steps")
    rho = stats.spearman_rho
    ax.set_title(
        f"steps vs difficulty (Spearman rho {rho:.2f})" if np.isfinite(rho) else "steps vs difficulty"
    )
    ax.legend(frameon=False, fontsize=8)
    return finish(fig, path, title)


def plot_loop_accuracy(
    curves: LoopCurve | Mapping[str, LoopCurve], path: str | Path | None = None, title: str = ""
) -> Figure:
    """Logit lens: accuracy of the readout of each loop's state."""
    curves = _series(curves)
    fig, ax = figure((5, 3.5))
    for label, c in curves.items():
        prefix = f"{label} " if label else ""
        ax.plot(c.loops, [100 * a for a in c.valid_accuracy], marker=".", label=f"{prefix}valid")
        ax.plot(c.loops, [100 * a for a in c.token_accuracy], ls="--", label=f"{prefix}token")
        if c.train_depth:
            ax.axvline(c.train_depth, color="gray", ls=":", lw=1)
    ax.set_xlabel("loop")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(-2, 102)
    ax.set_title("logit lens: accuracy per loop")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=8)
    return finish(fig, path, title)


def plot_overthinking(curve: LoopCurve, path: str | Path | None = None, title: str = "") -> Figure:
    """Logit margin (left axis) and validator accuracy (right axis) vs inference loops."""
    fig, ax = figure((5, 3.5))
    ax.plot(curve.loops, curve.margin, color="tab:purple", marker=".", label="logit margin")
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xlabel("inference loops")
    ax.set_ylabel("correct - best other logit", color="tab:purple")
    ax2 = ax.twinx()
    ax2.plot(curve.loops, [100 * a for a in curve.valid_accuracy], color="tab:green", label="valid accuracy")
    ax2.set_ylabel("valid accuracy (%)", color="tab:green")
    ax2.set_ylim(-2, 102)
    if curve.train_depth:
        ax.axvline(curve.train_depth, color="gray", ls=":", lw=1)
        ax.text(curve.train_depth, ax.get_ylim()[1], " train depth", va="top", fontsize=8, color="gray")
    ax.set_title("overthinking: margin and accuracy vs loops")
    return finish(fig, path, title)


def plot_bridge_rank(curve: LoopCurve, path: str | Path | None = None, title: str = "") -> Figure:
    """Logit lens on knowledge-graph queries: mean rank of the bridge entity per loop."""
    fig, ax = figure((5, 3.5))
    ax.plot(curve.loops, curve.bridge_rank, marker=".")
    ax.set_xlabel("loop")
    ax.set_ylabel("mean bridge rank (0 = top)")
    ax.set_title("logit lens: bridge entity rank")
    ax.grid(alpha=0.3)
    return finish(fig, path, title)


def plot_state_norms(
    curves: SignalCurve | Mapping[str, SignalCurve], path: str | Path | None = None, title: str = ""
) -> Figure:
    """Signal propagation: state RMS and update norm per loop (log scale)."""
    curves = _series(curves)
    fig, (a1, a2) = figure((8, 3.5), 2)
    for label, c in curves.items():
        a1.plot([0, *c.loops], [c.state_rms0, *c.state_rms], marker=".", label=label or None)
        a2.plot(c.loops, c.relative_update, marker=".", label=label or None)
    a1.set_xlabel("loop")
    a1.set_ylabel("state RMS")
    a1.set_yscale("log")
    a1.set_title("state norm")
    a2.set_xlabel("loop")
    a2.set_ylabel("||z_t - z_(t-1)|| / ||z_(t-1)||")
    a2.set_yscale("log")
    a2.set_title("relative update")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        _legend(a, curves)
    return finish(fig, path, title)
