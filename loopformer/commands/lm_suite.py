"""The evaluation suite of a language model (a task without a validator, scored by bits per byte), behind
``loopformer eval`` on a text run: the analogue of ``loopformer.commands.suite.run_suite``.

Held-out loss and bits per byte; with budgets, bits per byte at each loop budget (``--max-steps``: the
test-time compute curve of a looped LM, on a log2 axis); with lens loops, the logit lens (every loop's
readout scored as a language model) past the training depth; signal propagation and the Jacobian
spectral radius at the final state. Writes PNG plots, ``report.md`` and ``metrics.json``
(``loopformer.eval.lm_report``) into one folder; a plot over a single value is not drawn and the report
says why.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loopformer.commands.suite import ModelUnderTest, SuiteOptions, model_info
from loopformer.eval import plots
from loopformer.eval.analysis import (
    signal_propagation,
    spectral_radius_at_fixed_point,
    spectral_radius_summary,
)
from loopformer.eval.lm import evaluate_lm, lm_budget_curve, lm_logit_lens
from loopformer.eval.lm_report import write_lm_report
from loopformer.eval.report import describe_loop
from loopformer.tasks.base import Task, TokenDataset


def run_lm_suite(
    out_dir: str | Path,
    title: str,
    task: Task,
    dataset: TokenDataset,
    main: ModelUnderTest,
    options: SuiteOptions,
    notes: list[str] | None = None,
    extra: dict[str, Any] | None = None,
    log: Callable[[str], None] = lambda _msg: None,
) -> dict[str, Any]:
    """Evaluate the language model ``main`` on ``dataset`` and write the report; returns the results,
    the curves and the paths written (``report``, ``metrics``, ``plots``)."""
    out, opts = Path(out_dir), options
    log(f"evaluating {main.label} on {len(dataset)} held-out windows")
    t0 = time.perf_counter()
    result = evaluate_lm(main.model, task, dataset, loop=main.loop, batch_size=opts.batch_size,
                         progress=opts.progress, seed=main.seed, segments=main.segments)  # fmt: skip
    info = model_info(main, (time.perf_counter() - t0) / max(len(dataset), 1), False)
    tt = f"{main.label} · {describe_loop(main.loop)}"  # every plot names the model and its loop
    plot_paths: dict[str, Path] = {}
    skipped: list[str] = []
    budget = {}
    if opts.budgets:
        log(f"bits per byte vs loop budget {opts.budgets} ({opts.budget_mode})")
        budget[main.label] = lm_budget_curve(main.model, task, dataset, opts.budgets, mode=opts.budget_mode,
                                             loop=main.loop, batch_size=opts.batch_size, seed=main.seed)  # fmt: skip
        if len(budget[main.label].points) > 1:
            refs = {**opts.references, f"{main.label} at its evaluation loop (cap {main.loop.max_steps})":
                    result.bits_per_byte}  # fmt: skip
            figure = plots.plot_lm_budget_curve(budget, title=tt, references=refs)
            plot_paths["bits per byte vs loop budget"] = plots.save_figure(
                figure, out / "plots" / "bpb_vs_budget.png"
            )
        else:
            skipped.append(f"No bits-per-byte-vs-budget plot: one loop budget ({opts.budgets[0]}) was asked for; "
                           "the table above has it (give several, e.g. --max-steps 1,2,4,8).")  # fmt: skip
    small = dataset.subset(slice(0, min(len(dataset), max(opts.analysis_examples, 1))))
    lens = None
    if opts.lens_loops:
        log(f"logit lens over {opts.lens_loops} loops on {len(small)} windows")
        lens = lm_logit_lens(main.model, task, small, opts.lens_loops, loop=main.loop, batch_size=opts.batch_size,
                             train_depth=main.train_depth, seed=main.seed)  # fmt: skip
        if len(lens.loops) > 1:
            plot_paths["logit lens per loop"] = plots.save_figure(plots.plot_lm_lens(lens, title=tt),
                                                                  out / "plots" / "logit_lens.png")  # fmt: skip
    signal = None
    if opts.signal_loops:
        log(f"signal propagation over {opts.signal_loops} loops")
        signal = signal_propagation(main.model, small, opts.signal_loops, loop=main.loop,
                                    batch_size=min(opts.batch_size, 64), max_batches=1)  # fmt: skip
        plot_paths["state norms"] = plots.save_figure(plots.plot_state_norms(signal, title=tt),
                                                      out / "plots" / "state_norms.png")  # fmt: skip
    spectral = None
    if opts.spectral:
        log("Jacobian spectral radius at the final state")
        radii = spectral_radius_at_fixed_point(main.model, torch.as_tensor(small.inputs[: min(len(small), 16)]),
                                               loop=main.loop, iters=60, tol=1e-3)  # fmt: skip
        spectral = spectral_radius_summary(radii)
    report, metrics = write_lm_report(out, title, {main.label: result}, budget=budget, lens=lens, signal=signal,
                                      spectral=spectral, plots=plot_paths, notes=notes, skipped=skipped,
                                      extra={"models": {main.label: info}, **(extra or {})})  # fmt: skip
    return {"result": result, "budget": budget, "lens": lens, "signal": signal, "spectral": spectral,
            "report": report, "metrics": metrics, "plots": plot_paths}  # fmt: skip


__all__ = ["run_lm_suite"]


def evaluate_text_run(run: Any, dataset: TokenDataset, out: Path, final: Path, options: SuiteOptions,
                      train_depth: int, notes: list[str], extra: dict[str, Any]) -> None:  # fmt: skip
    """``loopformer eval`` on a run without a validator: the LM suite into ``out`` (files named by where
    they end up, ``final``), the held-out numbers and the report's path on the console."""
    from rich.console import Console

    console = Console(highlight=False)
    label = run.family or run.config.model.name
    console.print(f"{run.label}: {run.path} ({run.weights} weights)")
    title = f"{label} · {describe_loop(run.loop_eval)}: evaluation of {run.path} ({run.label}, {run.weights} weights)"
    main = ModelUnderTest(label, run.model, run.loop_eval, train_depth, segments=run.config.eval.segments,
                          seed=run.config.seed)  # fmt: skip
    compat = {"checkpoint": str(run.path), "step": run.step, "weights": run.weights, "label": run.label}
    suite = run_lm_suite(out, title, run.task, dataset, main, options, notes=notes, extra={**extra, **compat},
                         log=lambda m: console.print(f"  {m}"))  # fmt: skip
    lm = suite["result"]
    console.print(f"held-out ({lm.n} windows, {lm.tokens} tokens): loss {lm.loss:.4f} nats/token, "
                  f"bits per byte {lm.bits_per_byte:.4f}, token accuracy {100 * lm.token_accuracy:.1f}%, "
                  f"mean steps {lm.mean_steps:.2f}")  # fmt: skip
    for curve in suite["budget"].values():
        points = ", ".join(f"{p.budget}: {p.bits_per_byte:.4f}" for p in curve.points)
        console.print(f"bits per byte vs loop budget ({curve.mode}): {points}")
    console.print(
        f"report: {final / Path(suite['report']).relative_to(out)}  metrics: {final / 'metrics.json'}"
    )
