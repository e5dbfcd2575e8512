"""Benchmark 12: inference at equal accuracy, loopformer's best setting vs the FPRM authors' evaluation.

Two trained FPRMs, each evaluated on the same held-out puzzles two ways:

- ``authors``: loopformer's emulation of the FPRM authors' evaluation procedure (nilskiKonjIzDunava/fprm,
  ``FixedPointOptimizer``): damped solver, residual tolerance 0.1 (relative sup norm), every sample of a
  batch halting at the first step where *all* of them are below it. What differs from running their code:
  it is loopformer's engine (``halting: batch_residual`` + ``damped``), not theirs, and it runs in float32
  where theirs keeps the iterate in bf16; the ratio is therefore loopformer's per-sample evaluation vs
  loopformer's emulation of theirs, on the same weights;
- ``loopformer``: per-sample residual halting with compaction and the solver / tolerance that
  ``loopformer eval --auto-solver``'s search (loopformer.eval.auto_solver) picks on a *separate* set
  of puzzles: every registered solver at a few tolerances; of those whose accuracy on that set is at
  least the authors' setting's, the fastest by measured time (``time_trials``; within 5%, the fewest
  map evaluations).

The models:

- ``inference.fprm_vs_reference.seed<N>``: the 9x9 FPRMs of the FPRM vs TRM head-to-head (arXiv 2606.18206's
  Sudoku recipe built with its authors' options at CPU size, trained 60 CPU-minutes of FLOPs under their
  protocol: ``experiments/sudoku9_cpu.py``, seeds 0, 2 and 3; seed 1's run folder was lost before its
  checkpoint was shipped), evaluated under that protocol's evaluation
  (``loop_eval``: gamma 0.997, patience 10, cap 1000, 250 puzzles a batch) on their held-out puzzles: 250
  timed, 100 others for the search. The checkpoint is ``runs/sudoku9/seed<N>/fprm_authors`` when it is there,
  else the 60-minute EMA weights shipped in ``benchmarks/checkpoints/`` (so a clean clone runs the rows);
  each row says how to rebuild its checkpoint and how long that takes.
- ``inference.fprm_vs_reference_sudoku4``: the halting benchmark's small FPRM on 4x4 Sudoku
  (recipes/sudoku4_fprm.yaml shortened to ``bench_halting.TRAIN_STEPS`` steps), 256 timed puzzles, 128
  for the search. Its step is so cheap that Python overhead, not the map, sets the time.

History: the issue-26 row (0.039x at 94.4% vs 93.6%) measured a second FPRM seed trained with
``data.train_seed=1``, the held-out set's own seed: generated sets of one seed share their first rows, so
that model had trained on the puzzles it was timed on (loopformer now refuses that configuration). The
first run of the 9x9 row (2026-12-02) also tried 2x the authors' tolerance; anderson at tol
0.2 tied the authors' 94% on the 100 search puzzles with the fewest map evaluations and then reached 90.8%
vs 93.6% on the 250 timed ones (0.016x the time, target missed on accuracy). The search (here and in
``loopformer eval --auto-solver``) no longer loosens the tolerance.

Figure: wall time loopformer / authors over the timed puzzles (median of interleaved pairs; runs
repeat until two consecutive runs agree within 10%), with both accuracies and map evaluations per
sample (counted rows of the map). Target <= 0.5 at equal or better accuracy on the timed puzzles.

    python -m benchmarks --only inference
    LOOPFORMER_INFERENCE_ROWS=sudoku4 python -m benchmarks --only inference   # the 4x4 row only (the 9x9 rows
                                                                              # take 20-40 minutes each); the
                                                                              # other rows are kept as they were
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import torch

from benchmarks.common import Result, paired_ratio, side_by_side, summary

TARGET = 0.5
TARGET_TEXT = f"<= {TARGET} x the authors' evaluation time at equal or better accuracy"
# the search's tolerances, x the authors' 0.1: batch-wide halting runs every puzzle until the slowest
# converges, so per-sample halting may need a tighter tolerance to match its accuracy; never a looser one
# (loopformer.eval.auto_solver.TOL_FACTORS says why)
SEARCH_TOL_FACTORS = (1.0, 0.5, 0.25, 0.1, 0.03, 0.01)
AGREE, MAX_RUNS = 0.10, 4
ROWS_ENV = "LOOPFORMER_INFERENCE_ROWS"  # "sudoku4": the 4x4 row only
MERGE_BY_NAME = True  # a run of some rows keeps the others (python -m benchmarks' merge)


def _evaluate(model, inputs: torch.Tensor, labels: torch.Tensor, loop, batch: int) -> dict:
    """Exact accuracy, map evaluations per sample (counted) and mean loop steps of ``loop``."""
    from loopformer.eval.auto_solver import count_map_rows
    from loopformer.train.losses import accuracy

    right, steps = 0.0, 0.0
    with torch.no_grad(), count_map_rows(model) as rows:
        for i in range(0, len(inputs), batch):
            out = model(inputs[i : i + batch], loop=loop, generator=torch.Generator().manual_seed(i))
            right += float(accuracy(out.logits, labels[i : i + batch]).exact_acc) * len(out.logits)
            steps += float(out.loop.steps.double().sum())
    n = len(inputs)
    return {"exact_acc": right / n, "map_evals_per_sample": rows[0] / n, "steps_mean": steps / n}


def _map_share(model, inputs: torch.Tensor, loop, batch: int, repeats: int) -> dict:
    """Where one evaluation's time goes: seconds of the whole forward pass over ``inputs`` and of the map calls in it
    (each call of ``model.step`` timed; the fastest of ``repeats`` passes, outside the row's timed pairs)."""
    best: dict = {}
    spent, rows, original = [0.0], [0], model.step

    def timed(z: torch.Tensor, *ctx) -> torch.Tensor:
        start = time.perf_counter()
        out = original(z, *ctx)
        spent[0] += time.perf_counter() - start
        rows[0] += int(z.shape[0])
        return out

    for _ in range(repeats):
        spent[0], rows[0] = 0.0, 0
        model.step = timed  # the instance attribute shadows the method for this pass only
        try:
            start = time.perf_counter()
            with torch.no_grad():
                for i in range(0, len(inputs), batch):
                    model(inputs[i : i + batch], loop=loop, generator=torch.Generator().manual_seed(i))
            total = time.perf_counter() - start
        finally:
            del model.step
        if not best or total < best["total_s"]:
            best = {"total_s": total, "map_s": spent[0], "map_rows": rows[0], "map_share": spent[0] / total,
                    "ms_per_map_row": 1e3 * spent[0] / rows[0]}  # fmt: skip
    return best


def _search(model, data, seed: int, authors, batch: int, tol_factors) -> tuple[object, dict]:
    """The auto-solver search on its own puzzles (``data``) against the authors' accuracy there."""
    from loopformer.eval.auto_solver import Trial, candidate_configs, choose, time_trials

    inputs, labels = torch.as_tensor(data.inputs), torch.as_tensor(data.labels)
    ref = _evaluate(model, inputs, labels, authors, batch)
    per_sample = dataclasses.replace(authors, halting="residual", compaction=True)
    trials: list[Trial] = []
    configs = {}
    for trial, cfg in candidate_configs(per_sample, tol_factors):
        if cfg is None:
            trials.append(trial)
            continue
        ev = _evaluate(model, inputs, labels, cfg, batch)
        trial.accuracy, trial.map_evals, trial.mean_steps = (
            ev["exact_acc"],
            ev["map_evals_per_sample"],
            ev["steps_mean"],
        )
        trials.append(trial)
        configs[(trial.solver, trial.tol)] = cfg
    try:
        choose(trials, ref["exact_acc"])  # marks the qualifying ones; then, as the product's search does, the
        # fastest of them by measured time on these puzzles (within TIME_TIE: the fewest map evaluations)
        time_trials(model, None, data, [(t, configs[(t.solver, t.tol)]) for t in trials if t.qualifies],
                    {"batch_size": batch})  # fmt: skip
        chosen = choose(trials, ref["exact_acc"])
        reached = True
    except RuntimeError:
        # no per-sample setting reached the authors' accuracy: the most accurate one, and the row says so
        chosen = max((t for t in trials if t.error is None), key=lambda t: (t.accuracy, -t.map_evals))
        reached = False
    record = {
        "reached_authors_accuracy": reached,
        "n": len(inputs),
        "seed": seed,
        "authors": ref,
        "chosen": chosen.to_dict(),
        "candidates": [t.to_dict() for t in trials],
    }
    return configs[(chosen.solver, chosen.tol)], record


SUDOKU9_SEEDS = (0, 2, 3)  # seed 1's run folder was lost (2026-12-04) before its checkpoint was shipped
# the head-to-head's 60-minute FPRM checkpoints: a run folder made here, or the EMA weights shipped with the
# repository (experiments/sudoku9_cpu.py --phase ship: 1.6 MB a seed)
SUDOKU9_RUN = "runs/sudoku9/seed{seed}/fprm_authors"
SUDOKU9_SHIPPED = "benchmarks/checkpoints/sudoku9_fprm_seed{seed}"
SUDOKU9_MAKE = (
    "python experiments/sudoku9_cpu.py --phase train --only fprm_authors --seeds {seed} (one thread; 3,016 steps "
    "at 2.2-3 s a step on the 2-core development machine: 2-2.5 hours; seed 0's last 1,366 steps took 57 min)"
)
SUDOKU9_TOL_FACTORS = (1.0, 0.5, 0.25)  # the 9x9 candidates cost seconds each: fewer tolerances


def run(quick: bool = False) -> list[Result]:
    from benchmarks.bench_halting import TRAIN_STEPS, trained_model
    from loopformer.tasks.registry import get_task

    rows = os.environ.get(ROWS_ENV, "")
    if rows not in ("", "sudoku4"):
        raise ValueError(f"{ROWS_ENV}={rows!r}: the only row selection is 'sudoku4' (unset: every row)")
    start = time.perf_counter()
    model, cfg, trained_now, train_seconds = trained_model(quick)
    task = get_task("sudoku", size=4)
    authors = dataclasses.replace(cfg.loop_config(model.config.loop, "eval"), halting="batch_residual")
    n_search, n = (32, 32) if quick else (128, 256)
    small = _compare(
        "inference.fprm_vs_reference_sudoku4",
        model,
        authors,
        task.generate(n_search, seed=2024, min_blanks=4, max_blanks=10),
        2024,
        task.generate(n, seed=4242, min_blanks=4, max_blanks=10),
        cfg.eval.batch_size,
        SEARCH_TOL_FACTORS,
        (1, 3, 1) if quick else (MAX_RUNS, 7, 1),
        f"recipes/sudoku4_fprm.yaml, {'quick' if quick else f'{TRAIN_STEPS} training steps'}",
        quick,
    )
    small.details.update(trained_now=trained_now, train_seconds=train_seconds,
                         row_seconds=round(time.perf_counter() - start, 1))  # fmt: skip
    return [small] if rows else [*(_sudoku9(quick, seed) for seed in SUDOKU9_SEEDS), small]


def sudoku9_checkpoint(seed: int):
    """(the 60-minute FPRM checkpoint of head-to-head seed ``seed``, what it is) or (None, why not): the run folder
    ``runs/sudoku9/seed<N>/fprm_authors`` first, else the shipped EMA weights."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    run = repo / SUDOKU9_RUN.format(seed=seed)
    probe = run.parent.parent / "probe.json"  # the experiment's budgets: the 60-minute step is the last
    if probe.is_file():
        import json

        step = json.loads(probe.read_text())["budget_steps"]["fprm_authors"][-1]
        checkpoint = run / "checkpoints" / f"step_{step:08d}"  # never `latest`: a stopped run has others
        if checkpoint.is_dir():
            return checkpoint, f"{SUDOKU9_RUN.format(seed=seed)} (60-minute checkpoint, EMA weights)"
    shipped = repo / SUDOKU9_SHIPPED.format(seed=seed)
    if shipped.is_dir():
        return (
            shipped,
            f"{SUDOKU9_SHIPPED.format(seed=seed)} (the 60-minute checkpoint's EMA weights, shipped)",
        )
    return None, f"no checkpoint of seed {seed}; make it with: {SUDOKU9_MAKE.format(seed=seed)}"


def _sudoku9(quick: bool, seed: int) -> Result:
    """Head-to-head FPRM seed ``seed`` under its authors' evaluation (skipped without a checkpoint or in --quick)."""
    from loopformer.runs import eval_dataset, load_run

    name = f"inference.fprm_vs_reference.seed{seed}"
    folder, what = sudoku9_checkpoint(seed)
    if quick or folder is None:
        why = "quick mode" if quick else what
        return Result("inference", name, None, "x", TARGET_TEXT, None, f"skipped: {why}")
    start = time.perf_counter()
    run = load_run(folder, use_ema=True)
    data = eval_dataset(run.task, run.config)
    if len(data) < 350:
        raise RuntimeError(f"{folder}: {len(data)} held-out puzzles, need 350 (250 timed + 100 search)")
    res = _compare(name, run.model, run.loop_eval, data.subset(slice(250, 350)), run.config.data.eval_seed,
                   data.subset(slice(0, 250)), 250, SUDOKU9_TOL_FACTORS, (5, 1, 0),
                   f"{what}, the run's held-out puzzles", quick)  # fmt: skip
    res.details["row_seconds"] = round(time.perf_counter() - start, 1)
    res.details["rebuild"] = SUDOKU9_MAKE.format(seed=seed)
    return res


def _compare(
    name, model, authors, search_data, search_seed, timed, batch, tol_factors, timing, what, quick
) -> Result:
    """One row: search on ``search_data``, then time authors vs the chosen setting on ``timed``;
    ``timing`` = (most runs, interleaved rounds per run, warm-up calls)."""
    best, search = _search(model, search_data, search_seed, authors, batch, tol_factors)
    inputs, labels = torch.as_tensor(timed.inputs), torch.as_tensor(timed.labels)
    n = len(inputs)
    evals: dict[str, dict] = {}

    def go(key, loop):
        def call() -> None:  # the timed call is the scored evaluation itself (one pass, not two)
            evals[key] = _evaluate(model, inputs, labels, loop, batch)

        return call

    max_runs, repeats, warmup = timing
    runs, loads, times = [], [], {}
    for _ in range(max_runs):
        calls = {"authors": go("authors", authors), "loopformer": go("loopformer", best)}
        times = side_by_side(calls, repeats=repeats, warmup=warmup)
        runs.append(paired_ratio(times, "loopformer", "authors"))
        loads.append(round(os.getloadavg()[0], 2))
        if len(runs) >= 2 and abs(runs[-1] - runs[-2]) <= AGREE * min(runs[-1], runs[-2]):
            break
    ratio = runs[-1]
    equal = evals["loopformer"]["exact_acc"] >= evals["authors"]["exact_acc"]
    met = ratio <= TARGET and equal
    # where the time goes (after the timed pairs, not part of the ratio): the map's share of each evaluation; the
    # floor is loopformer's map calls alone over the authors' whole evaluation (nothing else left to remove)
    share = {k: _map_share(model, inputs, loop, batch, 1 if quick else 3)
             for k, loop in (("authors", authors), ("loopformer", best))}  # fmt: skip
    floor = share["loopformer"]["map_s"] / share["authors"]["total_s"]
    map_ratio = evals["loopformer"]["map_evals_per_sample"] / evals["authors"]["map_evals_per_sample"]
    fewest = min((t["map_evals"] for t in search["candidates"] if t["qualifies"]), default=math.nan)
    search_ratio = fewest / search["authors"]["map_evals_per_sample"]
    reasons = []
    if ratio > TARGET:
        reasons.append(
            f"map evaluations per sample {evals['loopformer']['map_evals_per_sample']:.1f} vs "
            f"{evals['authors']['map_evals_per_sample']:.1f} ({map_ratio:.2f}x; on the search puzzles the fewest at "
            f"the authors' accuracy {search_ratio:.2f}x); the map takes {100 * share['loopformer']['map_share']:.0f}% "
            f"of loopformer's evaluation and {100 * share['authors']['map_share']:.0f}% of the authors' "
            f"({share['loopformer']['ms_per_map_row']:.3f} vs {share['authors']['ms_per_map_row']:.3f} ms a map "
            f"row): loopformer's map calls alone are {floor:.2f}x the authors' evaluation, the floor at this "
            "setting without fewer map evaluations"
        )
    if not equal:
        reasons.append(
            f"accuracy on the timed puzzles {evals['loopformer']['exact_acc']:.3f} < authors' "
            f"{evals['authors']['exact_acc']:.3f} (the search set's choice did not carry over)"
        )
    if not search["reached_authors_accuracy"]:
        reasons.append(
            f"no per-sample setting reached the authors' accuracy on the search puzzles "
            f"({100 * search['authors']['exact_acc']:.1f}%); the most accurate one was timed"
        )
    if quick:
        reasons.append("quick mode: model trained for 20 steps only")
    note = (
        f"{best.solver} tol {best.tol:g} per-sample: {100 * evals['loopformer']['exact_acc']:.1f}% in "
        f"{evals['loopformer']['map_evals_per_sample']:.1f} map evals vs authors' (emulated: batch_residual + "
        f"damped) {100 * evals['authors']['exact_acc']:.1f}% in {evals['authors']['map_evals_per_sample']:.1f}"
    )
    details = {
        "reference": "loopformer's emulation of the authors' evaluation (halting batch_residual, damped solver)",
        "authors_loop": {
            "solver": authors.solver,
            "halting": authors.halting,
            "tol": authors.tol,
            "residual_norm": authors.residual_norm,
            "max_steps": authors.max_steps,
            "gamma": authors.options_for("damped").gamma,
            "patience": authors.options_for("damped").patience,
        },  # fmt: skip
        "loopformer_loop": {"solver": best.solver, "halting": best.halting, "tol": best.tol},
        "n_timed": n,
        "batch_size": batch,
        "evals": evals,
        "search": search,
        "runs": runs,
        "run_load_averages": loads,
        "map_share": share,
        "map_evals_ratio": map_ratio,
        "search_map_evals_ratio": search_ratio,
        "floor_map_calls_only": floor,
        "times": summary(times),
        "model": what,
        "threads": torch.get_num_threads(),
    }
    return Result("inference", name, ratio, "x", TARGET_TEXT, met, "; ".join(reasons + [note]), details)
