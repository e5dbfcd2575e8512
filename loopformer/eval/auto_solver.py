"""``loopformer eval RUN --auto-solver``: the solver and tolerance that reach the trained solver's
accuracy in the least measured time (map evaluations break ties).

- ``split_rows``: the evaluation set is split once, seeded, into a *search slice* (a fraction of the
  rows, default 25%) and the *report rows* (the rest). The search only looks at the slice; both
  settings are then reported on the report rows, which the search never saw.
- ``search``: every registered solver (``SOLVERS``) at a few tolerances around the run's own
  (``tol x TOL_FACTORS``: the run's tolerance and two tighter ones; one tolerance when the halting rule ignores it) with the run's halting
  rule, step cap and residual norm, evaluated on the slice. A candidate *qualifies* when its accuracy
  (the validator's, else exact match) is at least the trained setting's on the slice minus
  ``accuracy_tolerance``. The qualifying candidates are then timed again on the slice, ``TIMING_ROUNDS``
  interleaved rounds in rotating order (the first pass pays one-off costs), each keeping its fastest;
  ``choose`` takes the fastest, counting candidates within ``TIME_TIE`` (5%) of it as tied, and among those
  the fewest map evaluations per sample (then higher accuracy, then the candidate order): fewer map
  evaluations do not always take less time (a solver's own work per step, the smaller batches of
  compaction: the 1.246 s Broyden vs 1.117 s damped of issue 33). The trained setting is a candidate, so
  one always qualifies. Without times (``seconds`` NaN) ``choose`` falls back to map evaluations.
- map evaluations are counted, not inferred: ``count_map_rows`` wraps the model's ``step`` (the map
  ``run_loop`` iterates) and adds up the rows of every call, so batch-wide halting and masked
  (non-compacting) loops are charged for the rows they recompute. Every registered solver calls the
  map once per iteration (loopformer.loop.solvers), so with per-sample halting and compaction the
  count equals the mean loop steps; both are reported.
- ``compare``: the trained and the chosen setting on the report rows: accuracy, map evaluations per
  sample and wall time (``TIMING_ROUNDS`` interleaved passes, the fastest kept).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from loopformer.eval.evaluate import EvalResult, evaluate
from loopformer.loop import LoopConfig
from loopformer.loop.halting import HALTINGS
from loopformer.loop.solvers import SOLVERS
from loopformer.tasks.base import Task, TokenDataset

# candidate tolerances: the run's tol times these. Never looser than the run's own: a looser tolerance
# halts samples short of where the model was scored, and a search slice of a few hundred rows cannot
# see that cost reliably (benchmarks/bench_inference.py: on the 9x9 FPRM, anderson at 2x the tolerance
# tied the trained accuracy on 100 search puzzles and lost 2.8 points on 250 others)
TOL_FACTORS = (1.0, 0.5, 0.25)
DEFAULT_FRACTION = 0.25  # share of the evaluation set the search uses
TIMING_ROUNDS = 2  # interleaved timing passes of the qualifying candidates (the fastest of each kept)
TIME_TIE = 0.05  # candidates within 5% of the fastest are tied: the fewest map evaluations wins
DEFAULT_SEED = 0


@dataclass
class Trial:
    """One evaluated setting: solver x tolerance on some rows."""

    solver: str
    tol: float
    accuracy: float = float("nan")
    map_evals: float = float("nan")  # map evaluations per sample (counted rows / examples)
    mean_steps: float = float("nan")  # the engine's loop steps per sample
    seconds: float = float("nan")  # wall time of the evaluation pass
    qualifies: bool = False
    error: str = ""  # why the setting could not run (an invalid combination), else ""

    @property
    def label(self) -> str:
        return f"{self.solver} tol={self.tol:g}"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "label": self.label}


@dataclass
class AutoSolverResult:
    """The search (on the slice) and the comparison (on the report rows)."""

    reference: Trial  # the trained setting on the slice
    chosen: Trial
    trials: list[Trial]
    accuracy_tolerance: float
    search_rows: int
    report_rows: int
    fraction: float
    seed: int
    metric: str  # "valid_accuracy" or "exact_accuracy"
    report: dict[str, Trial] = field(default_factory=dict)  # "trained" / "chosen" on the report rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "accuracy_tolerance": self.accuracy_tolerance,
            "search_rows": self.search_rows,
            "report_rows": self.report_rows,
            "fraction": self.fraction,
            "seed": self.seed,
            "reference": self.reference.to_dict(),
            "chosen": self.chosen.to_dict(),
            "trials": [t.to_dict() for t in self.trials],
            "report": {k: v.to_dict() for k, v in self.report.items()},
        }


def split_rows(
    n: int, fraction: float = DEFAULT_FRACTION, seed: int = DEFAULT_SEED
) -> tuple[np.ndarray, np.ndarray]:
    """(search rows, report rows) of an n-row set: a seeded permutation, the first
    ``max(1, round(fraction n))`` rows (sorted) searched, the rest reported (at least one when n >= 2)."""
    if not 0 < fraction < 1:
        raise ValueError(f"--auto-solver-slice must be a fraction in (0, 1), got {fraction!r}")
    if n < 2:
        raise ValueError(
            f"--auto-solver needs at least 2 evaluation examples (a search slice and report rows), got {n}"
        )
    k = min(max(1, round(fraction * n)), n - 1)
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[:k]), np.sort(perm[k:])


def candidate_configs(
    base: LoopConfig, tol_factors: Sequence[float] = TOL_FACTORS
) -> list[tuple[Trial, LoopConfig | None]]:
    """Every registered solver x tolerance, as (trial placeholder, config or None when invalid).

    The halting rule, step cap and residual norm stay the run's; a rule that never stops early
    (``fixed``) gets the run's tolerance only. The trained setting comes first."""
    stops = HALTINGS.get(base.halting).stops_early
    tols = sorted({base.tol * f for f in tol_factors} | {base.tol}, reverse=True) if stops else [base.tol]
    out: list[tuple[Trial, LoopConfig | None]] = [(Trial(base.solver, base.tol), base)]
    for solver in SOLVERS.names():
        for tol in tols:
            if solver == base.solver and tol == base.tol:
                continue
            trial = Trial(solver, tol)
            try:
                cfg = dataclasses.replace(base, solver=solver, tol=tol)
            except ValueError as err:
                trial.error = str(err)
                cfg = None
            out.append((trial, cfg))
    return out


@contextmanager
def count_map_rows(model: torch.nn.Module) -> Iterator[list[int]]:
    """Count the rows of every call of ``model.step`` (the map the engine iterates): yields a
    one-element list holding the running total. The instance attribute shadows the method while the
    block runs and is removed afterwards."""
    if "step" in vars(model):
        raise RuntimeError(
            "count_map_rows: the model already has an instance attribute 'step' (nested counting?)"
        )
    original = model.step
    total = [0]

    def counted(z: torch.Tensor, *ctx: Any) -> torch.Tensor:
        total[0] += int(z.shape[0])
        return original(z, *ctx)

    model.step = counted  # type: ignore[method-assign]
    try:
        yield total
    finally:
        del model.step


def accuracy_of(result: EvalResult) -> tuple[float, str]:
    """(the headline accuracy, its name): the validator's when it ran, else exact match."""
    if not math.isnan(result.valid_accuracy):
        return result.valid_accuracy, "valid_accuracy"
    return result.exact_accuracy, "exact_accuracy"


def run_trial(model: Any, task: Task | None, dataset: TokenDataset, trial: Trial, cfg: LoopConfig,
              eval_kwargs: dict[str, Any]) -> str:  # fmt: skip
    """Evaluate ``cfg`` on ``dataset`` and fill in ``trial``; returns the accuracy's name."""
    with count_map_rows(model) as rows:
        start = time.perf_counter()
        result = evaluate(model, task, dataset, loop=cfg, **eval_kwargs)
        trial.seconds = time.perf_counter() - start
    trial.accuracy, metric = accuracy_of(result)
    trial.map_evals = rows[0] / max(len(dataset), 1) if rows[0] else result.mean_steps
    trial.mean_steps = result.mean_steps
    return metric


def choose(trials: Sequence[Trial], reference_accuracy: float, accuracy_tolerance: float = 0.0) -> Trial:
    """Mark the qualifying trials (accuracy >= reference - tolerance) and return the fastest (``seconds``;
    within ``TIME_TIE`` of it: the fewest map evaluations, then higher accuracy, then the earlier trial);
    by map evaluations alone when a qualifying trial has no time."""
    for trial in trials:
        trial.qualifies = (
            not trial.error and trial.accuracy >= reference_accuracy - accuracy_tolerance - 1e-12
        )
    good = [t for t in trials if t.qualifies]
    if not good:
        raise RuntimeError(
            f"auto-solver: no candidate reached the reference accuracy {reference_accuracy:.4f} "
            f"(minus {accuracy_tolerance:g}); the trained setting itself failed: {trials[0].error or 'see trials'}"
        )
    if all(math.isfinite(t.seconds) for t in good):
        fastest = min(t.seconds for t in good)
        good = [t for t in good if t.seconds <= fastest * (1 + TIME_TIE)]
    best = good[0]
    for trial in good[1:]:
        if trial.map_evals < best.map_evals or (
            trial.map_evals == best.map_evals and trial.accuracy > best.accuracy
        ):
            best = trial
    return best


def time_trials(model: Any, task: Task | None, dataset: TokenDataset, pairs: Sequence[tuple[Trial, LoopConfig]],
                eval_kwargs: dict[str, Any], rounds: int = TIMING_ROUNDS) -> None:  # fmt: skip
    """Each trial's ``seconds``: the fastest of ``rounds`` interleaved evaluations of its config on
    ``dataset`` (the order rotates every round, so no candidate always runs first)."""
    best = {id(t): math.inf for t, _ in pairs}
    for r in range(rounds):
        shift = r % max(len(pairs), 1)
        for trial, cfg in [*pairs[shift:], *pairs[:shift]]:
            start = time.perf_counter()
            evaluate(model, task, dataset, loop=cfg, **eval_kwargs)
            best[id(trial)] = min(best[id(trial)], time.perf_counter() - start)
    for trial, _ in pairs:
        trial.seconds = best[id(trial)]


def search(model: Any, task: Task | None, dataset: TokenDataset, base: LoopConfig, *,
           fraction: float = DEFAULT_FRACTION, seed: int = DEFAULT_SEED, accuracy_tolerance: float = 0.0,
           tol_factors: Sequence[float] = TOL_FACTORS, log: Any = None,
           **eval_kwargs: Any) -> tuple[AutoSolverResult, LoopConfig, TokenDataset]:  # fmt: skip
    """Search on a seeded slice of ``dataset`` and return (the result, the chosen config, the report
    rows). ``eval_kwargs`` go to ``evaluate`` (batch_size, seed, segments, ...)."""
    if not accuracy_tolerance >= 0:
        raise ValueError(f"--auto-solver-tolerance must be >= 0, got {accuracy_tolerance!r}")
    search_rows, report_rows = split_rows(len(dataset), fraction, seed)
    part = dataset.subset(search_rows)
    candidates = candidate_configs(base, tol_factors)
    metric = "exact_accuracy"
    for trial, cfg in candidates:
        if cfg is None:
            continue
        metric = run_trial(model, task, part, trial, cfg, eval_kwargs)
        if log is not None:
            log(f"{trial.label}: accuracy {100 * trial.accuracy:.1f}%, {trial.map_evals:.2f} map evaluations")
    trials = [t for t, _ in candidates]
    reference = trials[0]
    choose(trials, reference.accuracy, accuracy_tolerance)  # marks the qualifying ones
    time_trials(model, task, part, [(t, c) for t, c in candidates if t.qualifies], eval_kwargs)
    if log is not None:
        log("timed: " + ", ".join(f"{t.label} {t.seconds:.3f} s" for t in trials if t.qualifies))
    chosen = choose(trials, reference.accuracy, accuracy_tolerance)
    configs = {id(t): c for t, c in candidates}
    result = AutoSolverResult(reference, chosen, trials, accuracy_tolerance, len(search_rows), len(report_rows),
                              fraction, seed, metric)  # fmt: skip
    return result, configs[id(chosen)], dataset.subset(report_rows)


def compare(model: Any, task: Task | None, rows: TokenDataset, settings: dict[str, LoopConfig],
            **eval_kwargs: Any) -> dict[str, Trial]:  # fmt: skip
    """Each named setting evaluated on ``rows`` (accuracy, map evaluations, wall time)."""
    out: dict[str, Trial] = {}
    for name, cfg in settings.items():
        trial = Trial(cfg.solver, cfg.tol)
        run_trial(model, task, rows, trial, cfg, eval_kwargs)
        out[name] = trial
    time_trials(model, task, rows, [(out[name], cfg) for name, cfg in settings.items()], eval_kwargs)
    return out


def format_report(result: AutoSolverResult) -> list[str]:
    """Console lines: the search's choice and both settings on the report rows."""
    ref, chosen = result.reference, result.chosen
    lines = [
        f"auto-solver: {len(result.trials)} candidates on a search slice of {result.search_rows} examples "
        f"({100 * result.fraction:g}%, seed {result.seed}); reference {ref.label}: "
        f"{100 * ref.accuracy:.1f}% {result.metric}, {ref.map_evals:.2f} map evaluations per sample",
        f"  chosen {chosen.label}: {100 * chosen.accuracy:.1f}% in {chosen.seconds:.3f} s with "
        f"{chosen.map_evals:.2f} map evaluations (the fastest at >= the reference's accuracy, accuracy "
        f"tolerance {100 * result.accuracy_tolerance:g} points; reference {ref.seconds:.3f} s)",
        f"  on the {result.report_rows} report examples (not searched):",
    ]
    for name, t in result.report.items():
        lines.append(
            f"    {name:8s} {t.label:24s} {100 * t.accuracy:5.1f}%  {t.map_evals:7.2f} map evals/sample  "
            f"{t.seconds:.3f} s"
        )
    return lines


def search_run(run: Any, dataset: TokenDataset, fraction: float, accuracy_tolerance: float,
               log: Any = print) -> tuple[Any, TokenDataset, dict[str, Any]]:  # fmt: skip
    """``loopformer eval --auto-solver`` on the trained run ``run`` (a ``LoadedRun``): the search on a slice of
    ``dataset``, then the trained and the chosen setting compared on the other rows. Returns (the run with the
    chosen loop_eval, the report rows, the search's record for metrics.json); the comparison goes to ``log``."""
    if not run.task.has_validator:
        raise ValueError("--auto-solver needs a task scored by accuracy (this one is scored by loss)")
    kwargs = {"batch_size": run.config.eval.batch_size, "seed": run.config.seed, "segments": run.config.eval.segments}
    log(f"auto-solver: searching from {run.loop_eval.solver} tol={run.loop_eval.tol:g}")
    result, chosen, rows = search(run.model, run.task, dataset, run.loop_eval, fraction=fraction,
                                  accuracy_tolerance=accuracy_tolerance, log=lambda m: log(f"  {m}"), **kwargs)  # fmt: skip
    result.report = compare(run.model, run.task, rows, {"trained": run.loop_eval, "chosen": chosen}, **kwargs)
    for line in format_report(result):
        log(line)
    return dataclasses.replace(run, loop_eval=chosen), rows, result.to_dict()


def auto_note(record: dict[str, Any] | None) -> list[str]:
    """The report's note on the solver the search chose (``record``: ``search_run``'s), or none."""
    if record is None:
        return []
    c, r = record["chosen"], record["reference"]
    return [
        f"Solver: {c['label']} chosen by --auto-solver on {record['search_rows']} held-out examples not in this "
        f"report, the fastest at the trained accuracy ({c['seconds']:.3f} s, {c['map_evals']:.2f} map evaluations per "
        f"sample at {100 * c['accuracy']:.1f}% vs the trained {r['label']}: {r['seconds']:.3f} s, {r['map_evals']:.2f} "
        f"at {100 * r['accuracy']:.1f}%); metrics.json auto_solver has every candidate."
    ]
