"""The evaluation suite behind ``loopformer eval`` and ``loopformer run``.

For the main model: validator accuracy on the held-out set, steps vs difficulty (Spearman), the
accuracy vs step-budget curve, logit lens / overthinking past the training depth, signal
propagation and the Jacobian spectral radius at the final state; for each baseline: validator
accuracy and steps. Writes PNG plots, ``report.md`` and ``metrics.json`` into one folder; plot titles
name the model and its loop (``describe_loop``: solver, halting rule, tolerance, cap), and
``metrics.json["models"]`` holds what ``loopformer compare`` reads per model: its loop, parameters,
blocks per loop step, seconds per example of the evaluation pass and whether it is a baseline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loopformer.eval import plots
from loopformer.eval.analysis import (
    LoopCurve,
    SignalCurve,
    logit_lens,
    signal_propagation,
    spectral_radius_at_fixed_point,
)
from loopformer.eval.analysis import spectral_radius_summary as _radius_summary
from loopformer.eval.budget import (
    BudgetCurve,
    DifficultyStats,
    accuracy_vs_budget,
    easy_hard_steps,
    steps_vs_difficulty,
)
from loopformer.eval.evaluate import EvalResult, evaluate
from loopformer.eval.report import _num, describe_loop, write_report
from loopformer.files import check_inside
from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel
from loopformer.tasks.base import Task, TokenDataset


@dataclass
class SuiteOptions:
    """What the suite computes; every analysis can be switched off (0 / empty / False)."""

    budgets: list[int] = field(default_factory=list)  # inference step budgets for the compute curve
    budget_mode: str = "capped"  # capped: the model's halting rule with the cap | fixed: exactly b loops
    lens_loops: int = 0  # logit lens / overthinking loops (0 = off)
    signal_loops: int = 0  # signal-propagation loops (0 = off)
    spectral: bool = False  # Jacobian spectral radius at the final state
    analysis_examples: int = 128  # examples used by the per-loop analyses
    batch_size: int = 256
    progress: bool = False
    # accuracies drawn as horizontal lines on the budget plot beside the baselines' (e.g. the baseline of
    # the `loopformer run` job a run belongs to, when `eval` evaluates its model on the same held-out set)
    references: dict[str, float] = field(default_factory=dict)


@dataclass
class ModelUnderTest:
    label: str
    model: LoopedModel
    loop: LoopConfig
    train_depth: int | None = None
    description: str = ""
    segments: int = 1  # chained forward calls carrying the state (eval.segments; TRM / HRM: 16)
    seed: int = 0  # the initial iterates' generator (the run's seed, as the trainer's evaluation)


def run_suite(
    out_dir: str | Path,
    title: str,
    task: Task,
    dataset: TokenDataset,
    main: ModelUnderTest,
    baselines: Sequence[ModelUnderTest] = (),
    options: SuiteOptions | None = None,
    notes: list[str] | None = None,
    extra: Mapping[str, Any] | None = None,
    log: Callable[[str], None] = lambda _msg: None,
) -> dict[str, Any]:
    """Evaluate ``main`` (and ``baselines``) on ``dataset``; write plots, report.md, metrics.json.

    Returns the metrics dictionary (also in ``metrics.json``) plus ``report`` / ``plots`` paths.
    """
    opts = options or SuiteOptions()
    out = Path(out_dir)
    plot_dir = out / "plots"
    check_inside(plot_dir / "x.png", out)  # never through a link inside the report folder (a plots/ link)
    results: dict[str, EvalResult] = {}
    difficulty: dict[str, DifficultyStats] = {}
    models: dict[str, dict[str, Any]] = {}
    for m in (main, *baselines):
        log(f"evaluating {m.label} on {len(dataset)} held-out examples")
        t0 = time.perf_counter()
        results[m.label] = evaluate(
            m.model,
            task,
            dataset,
            loop=m.loop,
            batch_size=opts.batch_size,
            progress=opts.progress,
            seed=m.seed,
            segments=m.segments,
        )
        models[m.label] = model_info(m, (time.perf_counter() - t0) / max(len(dataset), 1), m is not main)
        difficulty[m.label] = steps_vs_difficulty(
            results[m.label].difficulty, results[m.label].steps, results[m.label].valid
        )
    plot_paths: dict[str, Path] = {}
    skipped: list[str] = []  # plots not drawn, each with the reason (a plot over one value says nothing)
    r_main = results[main.label]
    tt = f"{main.label} · {describe_loop(main.loop)}"  # every plot names the model and its loop
    for name, reason, draw in (
        ("steps histogram", no_histogram_reason, plots.plot_steps_histogram),
        ("steps vs difficulty", no_difficulty_plot_reason, plots.plot_steps_vs_difficulty),
    ):
        why = reason(r_main)
        if why is None:
            file = plot_dir / f"{name.replace(' ', '_')}.png"
            plot_paths[name] = plots.save_figure(draw(r_main, title=tt), file)
        else:
            skipped.append(why)

    budget: dict[str, BudgetCurve] = {}
    small = dataset.subset(slice(0, min(len(dataset), max(opts.analysis_examples, 1))))
    if opts.budgets:
        log(f"accuracy vs step budget {opts.budgets} ({opts.budget_mode})")
        budget[main.label] = accuracy_vs_budget(
            main.model,
            task,
            dataset,
            opts.budgets,
            mode=opts.budget_mode,
            loop=main.loop,
            batch_size=opts.batch_size,
        )
        if len(budget[main.label].points) > 1:
            refs = budget_references(main, r_main, baselines, results, opts.references)
            plot_paths["accuracy vs step budget"] = plots.save_figure(
                plots.plot_budget_curve(budget, title=tt, references=refs),
                plot_dir / "accuracy_vs_budget.png",
            )
        else:
            skipped.append(
                f"No accuracy-vs-budget plot: one step budget ({opts.budgets[0]}) was asked for; the "
                "table above has its accuracy (give several, e.g. --max-steps 1,2,4,8)."
            )
    lens: LoopCurve | None = None
    if opts.lens_loops:
        log(f"logit lens / overthinking over {opts.lens_loops} loops on {len(small)} examples")
        lens = logit_lens(
            main.model,
            task,
            small,
            opts.lens_loops,
            loop=main.loop,
            batch_size=opts.batch_size,
            train_depth=main.train_depth,
        )
        plot_paths["logit lens accuracy per loop"] = plots.save_figure(
            plots.plot_loop_accuracy(lens, title=tt), plot_dir / "logit_lens.png"
        )
        plot_paths["overthinking margin"] = plots.save_figure(
            plots.plot_overthinking(lens, title=tt), plot_dir / "overthinking.png"
        )
        if lens.bridge_rank:
            plot_paths["bridge rank"] = plots.save_figure(
                plots.plot_bridge_rank(lens, title=tt), plot_dir / "bridge_rank.png"
            )
    signal: SignalCurve | None = None
    if opts.signal_loops:
        log(f"signal propagation over {opts.signal_loops} loops")
        signal = signal_propagation(
            main.model,
            small,
            opts.signal_loops,
            loop=main.loop,
            batch_size=min(opts.batch_size, 64),
            max_batches=1,
        )
        plot_paths["state norms"] = plots.save_figure(
            plots.plot_state_norms(signal, title=tt), plot_dir / "state_norms.png"
        )
    spectral: dict[str, float] | None = None
    if opts.spectral:
        log("Jacobian spectral radius at the final state")
        n = min(len(small), 16)
        radii = spectral_radius_at_fixed_point(
            main.model,
            torch.as_tensor(small.inputs[:n]),
            loop=main.loop,
            puzzle_ids=None if small.puzzle_ids is None else torch.as_tensor(small.puzzle_ids[:n]),
            iters=60,
            tol=1e-3,
        )
        spectral = _radius_summary(radii)

    easy_hard = easy_hard_steps(r_main.difficulty, r_main.steps)
    report, metrics_path = write_report(
        out,
        title,
        results,
        budget=budget,
        difficulty=difficulty,
        lens=lens,
        signal=signal,
        spectral=spectral,
        plots=plot_paths,
        notes=notes,
        skipped=skipped,
        extra={"easy_hard_steps": easy_hard, "models": models, **(extra or {})},
    )
    return {
        "results": results,
        "difficulty": difficulty,
        "budget": budget,
        "lens": lens,
        "signal": signal,
        "spectral": spectral,
        "easy_hard": easy_hard,
        "report": report,
        "metrics": metrics_path,
        "plots": plot_paths,
    }


def no_histogram_reason(result: EvalResult) -> str | None:
    """Why the steps histogram would carry no information (every example took the same steps), else None."""
    counts = [k for k, v in result.steps_histogram.items() if v]
    if len(counts) > 1:
        return None
    steps = counts[0] if counts else 0
    return (
        f"No steps histogram: every held-out example took {steps} loop step{'s' if steps != 1 else ''} "
        "(the loop never stopped at another count)."
    )


def no_difficulty_plot_reason(result: EvalResult) -> str | None:
    """Why a steps-vs-difficulty plot would carry no information (one difficulty value, or the same steps
    for every example: no correlation to show), else None."""
    values = np.unique(np.asarray(result.difficulty, dtype=np.float64))
    if len(values) <= 1:
        shown = f"{values[0]:g}" if len(values) else "-"
        return (
            f"No steps-vs-difficulty plot: every held-out example has difficulty {shown}, so steps cannot "
            "be compared across difficulties (a held-out set with a range of difficulties shows it)."
        )
    steps = np.unique(np.asarray(result.steps))
    if len(steps) <= 1:
        return (
            f"No steps-vs-difficulty plot: every example took {int(steps[0]) if len(steps) else 0} loop "
            "steps whatever its difficulty (the table above has the accuracy per difficulty)."
        )
    return None


def budget_references(
    main: ModelUnderTest,
    r_main: EvalResult,
    baselines: Sequence[ModelUnderTest],
    results: Mapping[str, EvalResult],
    extra: Mapping[str, float],
) -> dict[str, float]:
    """The horizontal lines of the budget plot: each baseline (one pass), the main model under its own
    halting rule and cap, and ``extra`` (SuiteOptions.references)."""
    refs = {f"{b.label}, {describe_loop(b.loop)}": results[b.label].valid_accuracy for b in baselines}
    refs.update(extra)
    refs[f"{main.label} at its evaluation loop (cap {main.loop.max_steps})"] = r_main.valid_accuracy
    return refs


def run_job_references(checkpoint: str | Path, same_heldout: bool) -> dict[str, float]:
    """``{"baseline (transformer), one pass": accuracy}`` when ``checkpoint`` is the looped model of a
    ``loopformer run`` job (``<job>/model/...``, its ``summary.json`` beside ``model/`` recording the
    baseline's held-out score) and the evaluation uses the same held-out set (``same_heldout``: no
    ``--set`` / ``-t`` / ``-n``); else ``{}``. Bits per byte for a text job."""
    path = Path(checkpoint)
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path
    summary_path = run_dir.parent / "summary.json"
    if not same_heldout or run_dir.name != "model" or not summary_path.is_file():
        return {}
    from loopformer.files import read_json

    try:
        summary = read_json(summary_path, ValueError)
    except ValueError:
        return {}
    if not isinstance(summary, dict):
        return {}
    name = summary.get("baseline_model") or "baseline"
    if isinstance(summary.get("baseline_accuracy"), float):
        return {f"baseline ({name}) of this run job, one pass": summary["baseline_accuracy"]}
    for label, result in (summary.get("results") or {}).items():  # a text job: bits per byte of each model
        if str(label).startswith("baseline") and isinstance(result, dict) and "bits_per_byte" in result:
            return {f"{label} of this run job": float(result["bits_per_byte"])}
    return {}


def model_info(m: ModelUnderTest, seconds_per_example: float, baseline: bool) -> dict[str, Any]:
    """What ``loopformer compare`` needs of a model beside its accuracy (``metrics.json["models"]``)."""
    import dataclasses

    blocks = getattr(m.model.config, "n_layers", None)
    return {
        "loop": dataclasses.asdict(m.loop),
        "loop_description": describe_loop(m.loop),
        "parameters": m.model.num_parameters(),
        "blocks": int(blocks) if isinstance(blocks, int) else None,  # transformer blocks per loop step
        "segments": m.segments,
        "seconds_per_example": seconds_per_example,
        # no loop to speak of: a single pass (the plain transformer baseline)
        "baseline": bool(baseline or m.loop.max_steps <= 1),
    }


def spearman_text(stats: Any) -> str:
    """``Spearman rho 0.42 (p=0.01)``, or why there is none: a rank correlation with no spread in the
    loop counts or the difficulties is undefined, never a result to print as ``nan``."""
    import math

    if math.isnan(stats.spearman_rho):
        return ("Spearman rho undefined (every example took the same number of loops, or all share one "
                "difficulty: there is nothing to rank)")  # fmt: skip
    return f"Spearman rho {stats.spearman_rho:.2f} (p={stats.spearman_p:.2g})"


def accuracy_table(results: Mapping[str, EvalResult]) -> Any:
    """A rich table of the held-out results."""
    from rich.table import Table

    table = Table(title="held-out evaluation (valid = independent validator)")
    for col in ("model", "examples", "valid", "exact", "token", "mean steps", "converged"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for label, r in results.items():  # rounded as report.md rounds (report._num): 99.7%, never 100% for it
        table.add_row(label, str(r.n), *(_num(x, pct=True) for x in (r.valid_accuracy, r.exact_accuracy,
                                                                     r.token_accuracy)),
                      _num(r.mean_steps), _num(r.converged_fraction, pct=True))  # fmt: skip
    return table
