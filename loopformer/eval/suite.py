"""The evaluation report of ``loopformer eval``, ``loopformer run`` and ``loopformer sweep``: what it
computes, from the options (``ReportOptions``, the one options object) to the written report.

``run_suite`` evaluates a main model (and baselines) on a held-out set and writes PNG plots,
``report.md`` and ``metrics.json`` into one folder (``loopformer.eval.report``). For a task with a
validator: validator accuracy, steps vs difficulty (Spearman), the accuracy vs step-budget curve, logit
lens / overthinking past the training depth, signal propagation and the Jacobian spectral radius at the
final state; for each baseline: validator accuracy and steps. For a language model (a task without a
validator): held-out loss and bits per byte, bits per byte at each loop budget (log2 axis), the logit
lens scored as a language model, signal propagation and the spectral radius. A plot over a single value
is not drawn and the report says why. Plot titles name the model and its loop (``describe_loop``), and
``metrics.json["models"]`` holds what ``loopformer compare`` reads per model: its loop, parameters,
blocks per loop step, seconds per example of the evaluation pass and whether it is a baseline.

``evaluate_run`` is the report of one trained run (a ``loopformer.runs.LoadedRun``, duck-typed: this
floor never imports run storage): ARC's pass@2, the authors' protocol (``eval.protocol``), the suite,
and the console lines; loading the run and claiming its report folder are ``loopformer.api``'s.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loopformer.eval import plots
from loopformer.eval.analysis import (
    LMLoopCurve,
    LoopCurve,
    SignalCurve,
    logit_lens,
    signal_propagation,
    spectral_radius_at_fixed_point,
    spectral_radius_summary,
)
from loopformer.eval.budget import (
    BudgetCurve,
    DifficultyStats,
    budget_curve,
    clip_budgets,
    easy_hard_steps,
    steps_vs_difficulty,
)
from loopformer.eval.evaluate import EvalResult, LMEvalResult, arc_pass_at_k, evaluate, evaluate_lm
from loopformer.eval.report import accuracy_table, describe_loop, write_report
from loopformer.files import check_inside
from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel
from loopformer.tasks.base import Task, TokenDataset

Log = Callable[[Any], None]  # where progress and results go: a rich console's print, or nothing


@dataclass
class ReportOptions:
    """How an evaluation report is made. What it computes (every analysis can be switched off: 0 / empty /
    False), and, for a trained run (``loopformer eval``, ``sweep``; ``loopformer.api.evaluate_checkpoint``),
    which weights, rows and loops it evaluates and where the report goes."""

    budgets: list[int] = field(default_factory=list)  # inference step budgets for the compute curve
    budget_mode: str = "capped"  # capped: the model's halting rule with the cap | fixed: exactly b loops
    analyses: bool = True  # the per-loop analyses (logit lens, signal propagation, spectral radius) at all
    lens_loops: int | None = None  # logit lens / overthinking loops (None: 2x the training depth; 0 = off)
    signal_loops: int | None = None  # signal-propagation loops (None: as lens_loops; 0 = off)
    spectral: bool = True  # Jacobian spectral radius at the final state
    analysis_examples: int = 128  # examples used by the per-loop analyses
    batch_size: int = 256  # rows per forward pass (a trained run: its eval.batch_size)
    progress: bool = True
    # accuracies drawn as horizontal lines on the budget plot beside the baselines' (e.g. the baseline of
    # the `loopformer run` job a run belongs to, when `eval` evaluates its model on the same held-out set)
    references: dict[str, float] = field(default_factory=dict)
    # a trained run: its config overrides (data.*, eval.*, loop_eval.*), the first N held-out rows (0: all),
    # its weights, where it runs, the report folder (None: <run>/eval-step<N>-<time>), the loops compared
    # beside its loop_eval (name, overrides: one sub-report each), the --auto-solver search (slice, tolerance)
    overrides: list[str] = field(default_factory=list)
    examples: int = 0
    ema: bool = True
    best: bool = False
    device: str = "auto"
    out_dir: Path | None = None
    overwrite: bool = False
    variants: list[tuple[str, list[str]]] = field(default_factory=list)
    auto_solver: tuple[float, float] | None = None
    verify: bool = False  # refuse a checkpoint without its manifest (loopformer.runs.checkpoint.verified)

    def loops(self, train_depth: int | None) -> tuple[int, int]:
        """(logit-lens loops, signal-propagation loops): 0 without analyses."""
        if not self.analyses:
            return 0, 0
        lens = 2 * (train_depth or 0) if self.lens_loops is None else self.lens_loops
        return lens, lens if self.signal_loops is None else self.signal_loops

    def record(self) -> dict[str, Any]:
        """How the report was made (``metrics.json["evaluation"]``): a sweep re-evaluates one made otherwise."""
        return {"overrides": list(self.overrides), "budgets": list(self.budgets), "budget_mode": self.budget_mode,
                "examples": self.examples, "analyses": self.analyses, "lens_loops": self.lens_loops,
                "ema": self.ema, "best": self.best}  # fmt: skip


@dataclass
class ModelUnderTest:
    label: str
    model: LoopedModel
    loop: LoopConfig
    train_depth: int | None = None
    segments: int = 1  # chained forward calls carrying the state (eval.segments; TRM / HRM: 16)
    seed: int = 0  # the initial iterates' generator (the run's seed, as the trainer's evaluation)

    @classmethod
    def from_run(cls, run: Any, label: str, train_depth: int | None = None) -> ModelUnderTest:
        """A trained run's model under its evaluation loop, segments and seed."""
        return cls(label, run.model, run.loop_eval, train_depth, segments=run.config.eval.segments,
                   seed=run.config.seed)  # fmt: skip


def run_suite(
    out_dir: str | Path,
    title: str,
    task: Task,
    dataset: TokenDataset,
    main: ModelUnderTest,
    baselines: Sequence[ModelUnderTest] = (),
    options: ReportOptions | None = None,
    notes: list[str] | None = None,
    extra: Mapping[str, Any] | None = None,
    log: Log = lambda _msg: None,
) -> dict[str, Any]:
    """Evaluate ``main`` (and ``baselines``) on ``dataset``; write plots, report.md, metrics.json.

    Returns the metrics (``results``, ``difficulty``, ``budget``, ``lens``, ``signal``, ``spectral``,
    ``easy_hard``; the last two and ``difficulty`` empty for a language model) plus the ``report`` /
    ``metrics`` / ``plots`` paths.
    """
    opts = options or ReportOptions()
    out = Path(out_dir)
    plot_dir = out / "plots"
    check_inside(plot_dir / "x.png", out)  # never through a link inside the report folder (a plots/ link)
    lm = task is not None and not task.has_validator  # scored by bits per byte
    results: dict[str, EvalResult | LMEvalResult] = {}
    difficulty: dict[str, DifficultyStats] = {}
    models: dict[str, dict[str, Any]] = {}
    for m in (main, *baselines):
        log(f"  evaluating {m.label} on {len(dataset)} held-out {'windows' if lm else 'examples'}")
        t0 = time.perf_counter()
        score = evaluate_lm if lm else evaluate
        r = score(m.model, task, dataset, loop=m.loop, batch_size=opts.batch_size, progress=opts.progress,
                  seed=m.seed, segments=m.segments)  # fmt: skip
        results[m.label] = r
        models[m.label] = model_info(m, r, (time.perf_counter() - t0) / max(len(dataset), 1), m is not main)
        if isinstance(r, EvalResult):
            difficulty[m.label] = steps_vs_difficulty(r.difficulty, r.steps, r.valid)
    plot_paths: dict[str, Path] = {}
    skipped: list[str] = []  # plots not drawn, each with the reason (a plot over one value says nothing)
    r_main = results[main.label]
    tt = f"{main.label} · {describe_loop(main.loop)}"  # every plot names the model and its loop
    if isinstance(r_main, EvalResult):
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
    if opts.budgets:
        budgets, clipped = clip_budgets(opts.budgets, opts.budget_mode, int(main.loop.max_steps))
        if clipped:
            notes = [*(notes or []), clipped]
            log(f"  {clipped}")
        log(f"  {'bits per byte vs loop' if lm else 'accuracy vs step'} budget {budgets} ({opts.budget_mode})")
        # the accuracy curve has always drawn its initial iterates with seed 0 (kept: reports stay comparable)
        budget[main.label] = budget_curve(main.model, task, dataset, budgets, mode=opts.budget_mode,
                                          loop=main.loop, batch_size=opts.batch_size, seed=main.seed if lm else 0)  # fmt: skip
        caption, file = ("bits per byte vs loop budget", "bpb_vs_budget.png") if lm else (
            "accuracy vs step budget", "accuracy_vs_budget.png")  # fmt: skip
        if len(budget[main.label].points) > 1:
            refs = budget_references(main, baselines, results, opts.references)
            plot_paths[caption] = plots.save_figure(
                plots.plot_budget_curve(budget, title=tt, references=refs), plot_dir / file
            )
        else:
            skipped.append(
                f"No {'bits-per-byte' if lm else 'accuracy'}-vs-budget plot: one {'loop' if lm else 'step'} budget "
                f"({budgets[0]}) was evaluated; the table above has {'it' if lm else 'its accuracy'} (give "
                "several, e.g. --max-steps 1,2,4,8)."
            )
    lens_loops, signal_loops = opts.loops(main.train_depth)
    small = dataset.subset(slice(0, min(len(dataset), max(opts.analysis_examples, 1))))
    lens: LoopCurve | LMLoopCurve | None = None
    if lens_loops:
        log(f"  logit lens{'' if lm else ' / overthinking'} over {lens_loops} loops on {len(small)} "
            f"{'windows' if lm else 'examples'}")  # fmt: skip
        # a validator's lens has always drawn its initial iterates with seed 0, as the accuracy curve
        lens = logit_lens(main.model, task, small, lens_loops, loop=main.loop, batch_size=opts.batch_size,
                          train_depth=main.train_depth, seed=main.seed if lm else 0)  # fmt: skip
    if isinstance(lens, LMLoopCurve) and len(lens.loops) > 1:
        plot_paths["logit lens per loop"] = plots.save_figure(plots.plot_lm_lens(lens, title=tt),
                                                              plot_dir / "logit_lens.png")  # fmt: skip
    elif isinstance(lens, LoopCurve):
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
    if signal_loops:
        log(f"  signal propagation over {signal_loops} loops")
        signal = signal_propagation(main.model, small, signal_loops, loop=main.loop,
                                    batch_size=min(opts.batch_size, 64), max_batches=1)  # fmt: skip
        plot_paths["state norms"] = plots.save_figure(
            plots.plot_state_norms(signal, title=tt), plot_dir / "state_norms.png"
        )
    spectral: dict[str, float] | None = None
    if opts.analyses and opts.spectral:
        log("  Jacobian spectral radius at the final state")
        n = min(len(small), 16)
        radii = spectral_radius_at_fixed_point(
            main.model,
            torch.as_tensor(small.inputs[:n]),
            loop=main.loop,
            puzzle_ids=None if small.puzzle_ids is None else torch.as_tensor(small.puzzle_ids[:n]),
            iters=60,
            tol=1e-3,
        )
        spectral = spectral_radius_summary(radii)

    easy_hard = {} if lm else easy_hard_steps(r_main.difficulty, r_main.steps)  # type: ignore[union-attr]
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
        extra={**({} if lm else {"easy_hard_steps": easy_hard}), "models": models, **(extra or {})},
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


def _headline(result: EvalResult | LMEvalResult) -> float:
    """What the budget plot draws of a result: validator accuracy, or bits per byte for a language model."""
    return result.bits_per_byte if isinstance(result, LMEvalResult) else result.valid_accuracy


def budget_references(
    main: ModelUnderTest,
    baselines: Sequence[ModelUnderTest],
    results: Mapping[str, EvalResult | LMEvalResult],
    extra: Mapping[str, float],
) -> dict[str, float]:
    """The horizontal lines of the budget plot: each baseline (one pass), the main model under its own
    halting rule and cap, and ``extra`` (``ReportOptions.references``)."""
    refs = {f"{b.label}, {describe_loop(b.loop)}": _headline(results[b.label]) for b in baselines}
    refs.update(extra)
    refs[f"{main.label} at its evaluation loop (cap {main.loop.max_steps})"] = _headline(results[main.label])
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


def model_info(m: ModelUnderTest, result: EvalResult | LMEvalResult, seconds_per_example: float,
               baseline: bool) -> dict[str, Any]:  # fmt: skip
    """What ``loopformer compare`` needs of a model beside its accuracy (``metrics.json["models"]``); its
    test-time compute is the result's ``mean_blocks``, counted by the model (``LoopedModel.blocks_per_step``)."""
    measured = result.mean_steps > 0 and math.isfinite(result.mean_blocks)
    return {
        "loop": dataclasses.asdict(m.loop),
        "loop_description": describe_loop(m.loop),
        "parameters": m.model.num_parameters(),
        # transformer blocks per loop step as the evaluation counted them (an inner solve's vary)
        "blocks": result.mean_blocks / result.mean_steps if measured else float(m.model.blocks_per_step()),
        "segments": m.segments,
        "seconds_per_example": seconds_per_example,
        # no loop to speak of: a single pass (the plain transformer baseline)
        "baseline": bool(baseline or m.loop.max_steps <= 1),
    }


def spearman_text(stats: Any) -> str:
    """``Spearman rho 0.42 (p=0.01)``, or why there is none: a rank correlation with no spread in the
    loop counts or the difficulties is undefined, never a result to print as ``nan``."""
    if math.isnan(stats.spearman_rho):
        return ("Spearman rho undefined (every example took the same number of loops, or all share one "
                "difficulty: there is nothing to rank)")  # fmt: skip
    return f"Spearman rho {stats.spearman_rho:.2f} (p={stats.spearman_p:.2g})"


def segment_note(segments: int) -> list[str]:
    if segments <= 1:
        return []
    return [
        f"Accuracy and steps: {segments} chained segments carrying the state (eval.segments); the step "
        "budgets and the per-loop analyses run one segment."
    ]


def evaluate_run(run: Any, dataset: TokenDataset, out: Path, final: Path, options: ReportOptions, train_depth: int,
                 notes: list[str], extra: dict[str, Any], log: Log = lambda _msg: None) -> dict[str, Any]:  # fmt: skip
    """The report of the trained run ``run`` (a ``LoadedRun``, trained ``train_depth`` loops deep) on
    ``dataset``, written into ``out`` and naming its files by where they end up (``final``); ``notes`` and
    ``extra`` (what it was evaluated on and how, provenance) go into it. ARC also gets pass@2, voting over
    augmentations; ``eval.protocol`` ``authors_trm_deq`` / ``both`` adds the Attractor puzzle authors'
    evaluation. Returns the suite's metrics; the results and the report's path go to ``log``."""
    from loopformer.tasks.arc import ArcTask

    def shown(path: str | Path) -> Path:
        return final / Path(path).relative_to(out)

    ec, batch_size = run.config.eval, options.batch_size
    extra = dict(extra)
    if run.task.has_validator:
        extra["checkpoint"] = {"path": str(run.path), "step": run.step, "label": run.label, "best": run.best}
    else:  # a language model's metrics.json names its checkpoint as earlier versions did
        extra.update(checkpoint=str(run.path), step=run.step, weights=run.weights, label=run.label)
    if isinstance(run.task, ArcTask):  # pass@2 over every test pair x augmentation version
        extra["arc_pass_at_2"] = arc_pass_at_k(run.model, run.task, loop=run.loop_eval, k=2, batch_size=batch_size,
                                               seed=run.config.data.eval_seed, segments=ec.segments)  # fmt: skip
    if ec.protocol != "clean" and run.task.has_validator:  # the Attractor puzzle authors' _eval, beside the clean metrics
        from loopformer.eval.authors import evaluate_authors_trm_deq

        extra["authors_trm_deq"] = evaluate_authors_trm_deq(
            run.model, run.task, dataset, loop=run.loop_eval, batch_size=batch_size,
            max_batches=ec.authors_max_batches, calls=ec.segments, exploration=run.config.train.halt_exploration,
            seed=run.config.seed, check=ec.check,
        ).summary()  # fmt: skip
    label = run.family or run.config.model.name
    log(f"{run.label}: {run.path} ({run.weights} weights)")
    title = f"{label} · {describe_loop(run.loop_eval)}: evaluation of {run.path} ({run.label}, {run.weights} weights)"
    suite = run_suite(out, title, run.task, dataset, ModelUnderTest.from_run(run, label, train_depth),
                      (), options, notes=notes, log=log, extra=extra)  # fmt: skip
    result = suite["results"][label]
    if isinstance(result, LMEvalResult):
        log(f"held-out ({result.n} windows, {result.tokens} tokens): loss {result.loss:.4f} nats/token, "
            f"bits per byte {result.bits_per_byte:.4f}, token accuracy {100 * result.token_accuracy:.1f}%, "
            f"mean steps {result.mean_steps:.2f}")  # fmt: skip
        for curve in suite["budget"].values():
            points = ", ".join(f"{p.budget}: {p.bits_per_byte:.4f}" for p in curve.points)
            log(f"bits per byte vs loop budget ({curve.mode}): {points}")
    else:
        log(accuracy_table(suite["results"]))
        if "arc_pass_at_2" in extra:
            arc = extra["arc_pass_at_2"]
            log(f"ARC pass@2 (voting over {run.task.versions} augmentation versions): {100 * arc['score']:.1f}% "
                f"of {int(arc['tasks'])} tasks ({int(arc['outputs_solved'])}/{int(arc['outputs'])} test outputs)"
                if arc["tasks"] else "ARC pass@2: not scored (no task has every test output known)")  # fmt: skip
        if "authors_trm_deq" in extra:
            a = extra["authors_trm_deq"]
            log(f"authors' evaluation (eval.protocol, train_trm_deq.py _eval: training mode, Q halting with "
                f"exploration, {ec.segments} calls): exact {100 * a['exact_acc']:.1f}% of the {a['n']} examples "
                f"halted at the last call ({a['evaluated']} evaluated)")  # fmt: skip
        log(f"steps vs difficulty: {spearman_text(suite['difficulty'][label])}")
    log(f"report: {shown(suite['report'])}  metrics: {shown(suite['metrics'])}")
    return suite


__all__ = ["ModelUnderTest", "ReportOptions", "evaluate_run", "run_job_references", "run_suite", "spearman_text"]
