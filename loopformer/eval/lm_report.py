"""The report of a language model's evaluation: ``report.md`` and ``metrics.json`` for a task scored by
held-out loss and bits per byte (no validator), as ``loopformer.eval.report`` writes them for a task
with a validator.

``write_lm_report(out_dir, title, results, ...)`` writes the held-out table (windows, tokens, loss in
nats per token, bits per byte, token accuracy, mean loops), the bits per byte at each loop budget, the
logit lens (every loop's readout scored as a language model), signal propagation, the Jacobian spectral
radius and the plots. ``metrics.json`` holds ``kind: "lm"``, ``results`` / ``models`` / ``budget`` per
model (what ``loopformer compare`` reads) and, at the top level, the first model's metrics
(``bits_per_byte``, ``loss``, ...) as earlier versions wrote them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loopformer.eval.analysis import SignalCurve
from loopformer.eval.lm import LMBudgetCurve, LMEvalResult, LMLoopCurve
from loopformer.eval.report import _num, _plots_section, _shown_loops, _signal_section, _table, write_json
from loopformer.files import atomic_write_text

LM_KIND = "lm"  # metrics.json["kind"] of a language model's report


def _results_section(results: Mapping[str, LMEvalResult]) -> list[str]:
    rows = [
        [label, str(r.n), str(r.tokens), _num(r.loss, digits=4), _num(r.bits_per_byte, digits=4),
         _num(r.token_accuracy, True), _num(r.mean_steps)]
        for label, r in results.items()
    ]  # fmt: skip
    header = [
        "model",
        "windows",
        "tokens",
        "loss (nats/token)",
        "bits per byte",
        "token accuracy",
        "mean loops",
    ]
    return ["## Held-out bits per byte", "", *_table(header, rows),
            "Lower is better; bits per byte = loss x tokens per byte / ln 2.", ""]  # fmt: skip


def _budget_section(label: str, curve: LMBudgetCurve) -> list[str]:
    rows = [
        [str(p.budget), _num(p.bits_per_byte, digits=4), _num(p.loss, digits=4), _num(p.token_accuracy, True),
         _num(p.mean_steps)]
        for p in curve.points
    ]  # fmt: skip
    return [
        f"## Bits per byte vs loop budget: {label} ({curve.mode})",
        "",
        *_table(["budget", "bits per byte", "loss", "token accuracy", "mean loops"], rows),
    ]


def _lens_section(lens: LMLoopCurve) -> list[str]:
    rows = [
        [str(lens.loops[i]), _num(lens.bits_per_byte[i], digits=4), _num(lens.token_accuracy[i], True),
         _num(lens.margin[i])]
        for i in _shown_loops(lens.loops)
    ]  # fmt: skip
    lines = ["## Logit lens (every loop's readout scored as a language model)", "",
             *_table(["loop", "bits per byte", "token accuracy", "margin"], rows)]  # fmt: skip
    if lens.train_depth:
        lines += [f"Training depth: {lens.train_depth} loops per training forward call.", ""]
    return lines


def write_lm_report(
    out_dir: str | Path,
    title: str,
    results: Mapping[str, LMEvalResult],
    budget: Mapping[str, LMBudgetCurve] | None = None,
    lens: LMLoopCurve | None = None,
    signal: SignalCurve | None = None,
    spectral: Mapping[str, float] | None = None,
    plots: Mapping[str, str | Path] | None = None,
    notes: list[str] | None = None,
    skipped: list[str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Write ``out_dir/report.md`` and ``out_dir/metrics.json`` of a language model; returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# {title}", ""]
    for note in notes or []:
        lines += [note, ""]
    lines += _results_section(results)
    for label, curve in (budget or {}).items():
        lines += _budget_section(label, curve)
    if lens is not None:
        lines += _lens_section(lens)
    if signal is not None:
        lines += _signal_section(signal)
    if spectral:
        lines += ["## Jacobian spectral radius at the final state", ""]
        lines += _table(list(spectral), [[_num(v, digits=3) for v in spectral.values()]])
    if plots or skipped:
        lines += _plots_section(out, plots or {}, skipped)
    report = out / "report.md"
    atomic_write_text(report, "\n".join(lines), root=out)
    first = next(iter(results.values()))
    metrics: dict[str, Any] = {**first.to_dict(), "title": title, "kind": LM_KIND,
                               "results": {k: v.to_dict() for k, v in results.items()}}  # fmt: skip
    if budget:
        metrics["budget"] = {k: v.to_dict() for k, v in budget.items()}
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


__all__ = ["LM_KIND", "write_lm_report"]
