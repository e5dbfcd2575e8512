"""Evaluation reports: ``report.md`` (tables, links to the PNG plots) and ``metrics.json``.

``write_report(out_dir, title, results, ...)`` takes any of the result objects of
``loopformer.eval`` (evaluations per model, a budget curve, difficulty statistics, loop curves,
signal curves, spectral radii) and writes what it was given; missing pieces are skipped. A language
model's results (``LMEvalResult``: a task without a validator) are reported by held-out loss and bits
per byte, their budget curve and logit lens likewise; their ``metrics.json`` holds ``kind: "lm"`` and,
at the top level, the first model's metrics (``bits_per_byte``, ``loss``, ...) as earlier versions
wrote them. ``describe_loop`` is the loop description (solver, halting rule, tolerance, cap) that
report and plot titles carry; ``md_table`` (markdown) and ``console_table`` (rich) lay out the same
rows, so the console rounds as report.md does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loopformer.eval.analysis import LMLoopCurve, LoopCurve, SignalCurve
from loopformer.eval.budget import BudgetCurve, DifficultyStats, LMBudgetPoint
from loopformer.eval.evaluate import EvalResult, LMEvalResult
from loopformer.files import atomic_write_text

# halting rules that stop on a tolerance (the others ignore loop.tol)
TOL_HALTINGS = ("residual", "kl_entropy", "act")
LM_KIND = "lm"  # metrics.json["kind"] of a language model's report


def describe_loop(loop: Any) -> str:
    """``"damped solver · residual halting tol 0.001 · cap 64"``: the solver, halting rule, tolerance and
    cap of a ``LoopConfig`` (or its ``to_dict()`` form), as every report and plot title names them;
    ``"one pass"`` for a loop capped at one step (a plain transformer: no solver or halting rule acts)."""
    get = loop.get if isinstance(loop, Mapping) else lambda key, default=None: getattr(loop, key, default)
    cap = get("max_steps")
    if isinstance(cap, int | float) and cap <= 1:  # no loop to speak of: solver and halting never act
        return "one pass"
    halting = str(get("halting", "?"))
    tol = get("tol")
    if halting in TOL_HALTINGS and tol is not None:
        halt = f"{halting} halting tol {float(tol):g}"
    else:
        halt = f"{halting} halting (no tolerance)"
    return f"{get('solver', '?')} solver · {halt} · cap {get('max_steps', '?')}"


def num(x: Any, pct: bool = False, digits: int = 2) -> str:
    if x is None:
        return "-"
    try:
        f = float(x)
    except (TypeError, ValueError):
        return str(x)
    if not math.isfinite(f):
        return "-"
    return f"{100 * f:.1f}%" if pct else f"{f:.{digits}f}"


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out + [""]


def to_jsonable(x: Any) -> Any:
    """Result objects, numpy scalars / arrays and non-finite floats -> plain JSON values (nan -> null)."""
    if hasattr(x, "to_dict"):
        return to_jsonable(x.to_dict())
    if isinstance(x, Mapping):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [to_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return to_jsonable(x.tolist())
    if isinstance(x, np.generic):
        return to_jsonable(x.item())
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Path):
        return str(x)
    return x


def write_json(path: str | Path, data: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(to_jsonable(data), indent=2) + "\n", root=path.parent)
    return path


def _shown_loops(loops: list[int]) -> list[int]:
    """Indices of the loops a per-loop table shows: 1..12, every 4th, and the last."""
    return [i for i, t in enumerate(loops) if t <= 12 or t % 4 == 0 or i == len(loops) - 1]


# the held-out table's columns, in report.md and on the console: a model with a validator, a language model
RESULT_COLUMNS = ("model", "examples", "valid", "exact", "token", "mean steps", "converged")
LM_RESULT_COLUMNS = ("model", "windows", "tokens", "loss (nats/token)", "bits per byte", "token accuracy",
                     "mean loops")  # fmt: skip


def result_rows(results: Mapping[str, EvalResult | LMEvalResult]) -> list[list[str]]:
    """The held-out table's rows (``RESULT_COLUMNS``, or ``LM_RESULT_COLUMNS`` for language models),
    rounded as report.md rounds them: 99.7%, never 100% for it."""
    rows = []
    for label, r in results.items():
        if isinstance(r, LMEvalResult):
            rows.append([label, str(r.n), str(r.tokens), num(r.loss, digits=4), num(r.bits_per_byte, digits=4),
                         num(r.token_accuracy, True), num(r.mean_steps)])  # fmt: skip
        else:
            rows.append([label, str(r.n), num(r.valid_accuracy, True), num(r.exact_accuracy, True),
                         num(r.token_accuracy, True), num(r.mean_steps), num(r.converged_fraction, True)])  # fmt: skip
    return rows


def console_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[str] = ()) -> Any:
    """A rich table of ``rows`` (the console's form of ``md_table``); the columns in ``left`` (and the first)
    are left-aligned, the others right-aligned."""
    from rich.table import Table

    out = Table(title=title)
    for i, col in enumerate(header):
        out.add_column(col, justify="left" if i == 0 or col in left else "right")
    for row in rows:
        out.add_row(*row)
    return out


def accuracy_table(results: Mapping[str, EvalResult]) -> Any:
    """A rich table of the held-out results (the console's copy of report.md's)."""
    return console_table("held-out evaluation (valid = independent validator)", RESULT_COLUMNS, result_rows(results))


def _results_section(results: Mapping[str, EvalResult | LMEvalResult], lm: bool) -> list[str]:
    if lm:
        return ["## Held-out bits per byte", "", *md_table(list(LM_RESULT_COLUMNS), result_rows(results)),
                "Lower is better; bits per byte = loss x tokens per byte / ln 2.", ""]  # fmt: skip
    header = ["model", "examples", "valid (validator)", *RESULT_COLUMNS[3:]]
    return [
        "## Held-out accuracy",
        "",
        *md_table(header, result_rows(results)),
        "`valid` is judged by the task's independent validator, not by the labels.",
        "",
    ]


def _difficulty_section(label: str, stats: DifficultyStats) -> list[str]:
    def span(b: Any) -> str:
        low = num(b.low, digits=0)
        return low if b.low == b.high else f"{low}-{num(b.high, digits=0)}"

    rows = [[span(b), str(b.count), num(b.mean_steps), num(b.valid_accuracy, True)] for b in stats.buckets]
    return [
        f"## Steps vs difficulty: {label}",
        "",
        *md_table(["difficulty", "examples", "mean steps", "valid"], rows),
        _spearman_line(stats),
        "",
    ]


def _spearman_line(stats: DifficultyStats) -> str:
    """The rank correlation between difficulty and steps, or why there is none (one difficulty value, or
    the same steps for every example: Spearman's rho is undefined, never printed as nan)."""
    if math.isfinite(stats.spearman_rho):
        return f"Spearman rho = {num(stats.spearman_rho, digits=3)} (p = {stats.spearman_p:.2g})"
    if len(stats.buckets) <= 1:
        return "No rank correlation: the examples have one difficulty value."
    return "No rank correlation: every example took the same number of steps."


def _budget_section(label: str, curve: BudgetCurve) -> list[str]:
    if curve.points and isinstance(curve.points[0], LMBudgetPoint):
        rows = [[str(p.budget), num(p.bits_per_byte, digits=4), num(p.loss, digits=4), num(p.token_accuracy, True),
                 num(p.mean_steps)] for p in curve.points]  # fmt: skip
        return [f"## Bits per byte vs loop budget: {label} ({curve.mode})", "",
                *md_table(["budget", "bits per byte", "loss", "token accuracy", "mean loops"], rows)]  # fmt: skip
    rows = [
        [str(p.budget), num(p.valid_accuracy, True), num(p.exact_accuracy, True), num(p.mean_steps)]
        for p in curve.points
    ]
    return [
        f"## Accuracy vs step budget: {label} ({curve.mode})",
        "",
        *md_table(["budget", "valid", "exact", "mean steps"], rows),
    ]


def _lens_section(lens: LoopCurve | LMLoopCurve) -> list[str]:
    if isinstance(lens, LMLoopCurve):
        rows = [[str(lens.loops[i]), num(lens.bits_per_byte[i], digits=4), num(lens.token_accuracy[i], True),
                 num(lens.margin[i])] for i in _shown_loops(lens.loops)]  # fmt: skip
        lines = ["## Logit lens (every loop's readout scored as a language model)", "",
                 *md_table(["loop", "bits per byte", "token accuracy", "margin"], rows)]  # fmt: skip
    else:
        has_bridge = bool(lens.bridge_rank)
        header = ["loop", "valid", "token", "margin"] + (["bridge rank"] if has_bridge else [])
        rows = []
        for i in _shown_loops(lens.loops):
            row = [
                str(lens.loops[i]),
                num(lens.valid_accuracy[i], True),
                num(lens.token_accuracy[i], True),
                num(lens.margin[i]),
            ]
            if has_bridge:
                row.append(num(lens.bridge_rank[i]))
            rows.append(row)
        lines = ["## Logit lens / overthinking (readout of every loop state)", "", *md_table(header, rows)]
    if lens.train_depth:
        lines += [f"Training depth: {lens.train_depth} loops per training forward call.", ""]
    return lines


def _signal_section(signal: SignalCurve) -> list[str]:
    rows = [
        [
            str(signal.loops[i]),
            num(signal.state_rms[i], digits=3),
            num(signal.update_norm[i], digits=3),
            f"{signal.relative_update[i]:.2e}",
        ]
        for i in _shown_loops(signal.loops)
    ]
    return [
        "## Signal propagation",
        "",
        *md_table(["loop", "state RMS", "update norm", "relative update"], rows),
    ]


def _plots_section(out: Path, plots: Mapping[str, str | Path], skipped: list[str] | None = None) -> list[str]:
    lines = ["## Plots", ""]
    for why in skipped or []:
        lines += [why, ""]
    for caption, p in plots.items():
        path = Path(p)
        inside = path.resolve().is_relative_to(out.resolve())
        rel = path.resolve().relative_to(out.resolve()) if inside else path
        lines += [f"![{caption}]({rel.as_posix()})", ""]
    return lines


def write_report(
    out_dir: str | Path,
    title: str,
    results: Mapping[str, EvalResult | LMEvalResult],
    budget: Mapping[str, BudgetCurve] | None = None,
    difficulty: Mapping[str, DifficultyStats] | None = None,
    lens: LoopCurve | LMLoopCurve | None = None,
    signal: SignalCurve | None = None,
    spectral: Mapping[str, float] | None = None,
    plots: Mapping[str, str | Path] | None = None,
    notes: list[str] | None = None,
    extra: Mapping[str, Any] | None = None,
    skipped: list[str] | None = None,
) -> tuple[Path, Path]:
    """Write ``out_dir/report.md`` and ``out_dir/metrics.json``; returns both paths.

    ``results`` maps a model label (e.g. ``"fprm"``, ``"baseline transformer"``) to its evaluation.
    ``plots`` maps a caption to a PNG path (linked relative to ``out_dir``); ``skipped`` says, one
    sentence each, which plots were not drawn and why (a plot over a single value).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lm = any(isinstance(r, LMEvalResult) for r in results.values())
    lines = [f"# {title}", ""]
    for note in notes or []:
        lines += [note, ""]
    if results:
        lines += _results_section(results, lm)
    for label, stats in (difficulty or {}).items():
        lines += _difficulty_section(label, stats)
    for label, curve in (budget or {}).items():
        lines += _budget_section(label, curve)
    if lens is not None:
        lines += _lens_section(lens)
    if signal is not None:
        lines += _signal_section(signal)
    if spectral:
        lines += ["## Jacobian spectral radius at the final state", ""]
        lines += md_table(list(spectral), [[num(v, digits=3) for v in spectral.values()]])
    if plots or skipped:
        lines += _plots_section(out, plots or {}, skipped)
    report = out / "report.md"
    atomic_write_text(report, "\n".join(lines), root=out)
    # what metrics.json holds: every piece given, as plain values
    metrics: dict[str, Any] = {"title": title, "results": {k: v.to_dict() for k, v in results.items()}}
    if lm:  # the first model's metrics at the top level, as earlier versions wrote them
        metrics = {**next(iter(results.values())).to_dict(), "title": title, "kind": LM_KIND, **metrics}
    for key, value in (("budget", budget), ("difficulty", difficulty)):
        if value:
            metrics[key] = {k: v.to_dict() for k, v in value.items()}
    if lens is not None:
        metrics["logit_lens"] = lens.to_dict()
    if signal is not None:
        metrics["signal"] = signal.to_dict()
    if spectral:
        metrics["spectral_radius"] = dict(spectral)
    if plots:
        metrics["plots"] = {k: str(v) for k, v in plots.items()}
    if skipped:
        metrics["plots_skipped"] = list(skipped)
    metrics.update(extra or {})
    return report, write_json(out / "metrics.json", metrics)
