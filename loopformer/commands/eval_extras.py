"""The pieces of ``loopformer eval`` beside its one evaluation path (``loopformer.commands.train_eval``):
the ``--auto-solver`` search on a slice of the held-out set, and the report's notes on segments and on
the solver the search chose."""

from __future__ import annotations

from typing import Any

import click


def auto_solver_search(run: Any, dataset: Any, auto: tuple[float, float]) -> tuple[Any, Any, dict[str, Any]]:
    """The solver search on a slice of ``dataset``: (the run with the chosen loop_eval, the report rows,
    the search's record for metrics.json); prints the comparison."""
    import dataclasses

    from rich.console import Console

    from loopformer.eval.auto_solver import compare, format_report, search

    if not run.task.has_validator:
        raise click.UsageError("--auto-solver needs a task scored by accuracy (this one is scored by loss)")
    console = Console(highlight=False)
    kwargs = {
        "batch_size": run.config.eval.batch_size,
        "seed": run.config.seed,
        "segments": run.config.eval.segments,
    }
    console.print(f"auto-solver: searching from {run.loop_eval.solver} tol={run.loop_eval.tol:g}")
    result, chosen, rows = search(run.model, run.task, dataset, run.loop_eval, fraction=auto[0],
                                  accuracy_tolerance=auto[1], log=lambda m: console.print(f"  {m}"), **kwargs)  # fmt: skip
    result.report = compare(run.model, run.task, rows, {"trained": run.loop_eval, "chosen": chosen}, **kwargs)
    for line in format_report(result):
        console.print(line)
    return dataclasses.replace(run, loop_eval=chosen), rows, result.to_dict()


def segment_note(segments: int) -> list[str]:
    if segments <= 1:
        return []
    return [
        f"Accuracy and steps: {segments} chained segments carrying the state (eval.segments); the step "
        "budgets and the per-loop analyses run one segment."
    ]


def auto_note(record: dict[str, Any] | None) -> list[str]:
    if record is None:
        return []
    c, r = record["chosen"], record["reference"]
    return [
        f"Solver: {c['label']} chosen by --auto-solver on {record['search_rows']} held-out examples not in this "
        f"report, the fastest at the trained accuracy ({c['seconds']:.3f} s, {c['map_evals']:.2f} map evaluations per "
        f"sample at {100 * c['accuracy']:.1f}% vs the trained {r['label']}: {r['seconds']:.3f} s, {r['map_evals']:.2f} "
        f"at {100 * r['accuracy']:.1f}%); metrics.json auto_solver has every candidate."
    ]
