"""9x9 Sudoku on a CPU: FPRM vs an equal-parameter transformer and TRM at equal training FLOPs.

What a 2-core CPU learns on the papers' own task shape (81 tokens; FPRM arXiv 2606.18206, TRM
arXiv 2510.04871, HRM arXiv 2506.21734 report Sudoku-Extreme):

1. ``--phase probe``: FPRM's seconds per training step with ``--threads`` threads (default 1: one core,
   the other one left to other work; pin the process with ``taskset -c 1`` to keep the figure clean) on
   this machine (with the load average) -> ``steps_15``, the FPRM steps of 15 minutes of training. Budgets are step counts
   from then on (15 / 30 / 60 min = 1 / 2 / 4 x ``steps_15``), so the results do not depend on the
   load during the (long) training runs; each run's own wall time is recorded beside them.
2. ``--phase train --only NAME``: trains one model to its 60-minute budget with a checkpoint at every
   15-minute mark. FPRM trains ``recipes/sudoku9_fprm.yaml``; the baselines are that recipe with the
   model table replaced (same width / heads / layers, so equal parameters up to a head) and their
   step counts set to FPRM's training FLOPs (``torch.utils.flop_counter.FlopCounterMode`` over real
   training steps, forward + backward) divided by their own FLOPs per step. Runs of different models
   can go in parallel processes (one thread each).
3. ``--phase eval``: every checkpoint on one held-out set (generated, seeded apart from training;
   20-60 blanks): valid accuracy by the task's independent validator (rows / columns / boxes / givens
   re-checked without the label) per blanks bin and per solving technique (the exact solver's
   backtrack count: 0 = propagation by naked / hidden singles alone, > 0 = search needed), FPRM's loop
   steps vs blanks (Spearman), and the hidden-difficulty check on the two real Sudoku-Extreme rows.
   Writes ``results.json``, ``accuracy_vs_blanks.png`` and ``table.md`` (the markdown of the
   "9x9 Sudoku on a CPU" section in docs/results.md).

Usage: ``python experiments/sudoku9_cpu.py --phase all [--quick]`` or the phases one by one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fprm_common import REPO, flops_per_step, make_config, pyplot, save_figure, write_json

from loopformer.eval.analysis import trace_loops
from loopformer.eval.budget import steps_vs_difficulty, with_budget
from loopformer.eval.evaluate import evaluate as evaluate_data
from loopformer.eval.evaluate import iter_batches, loop_summary
from loopformer.runs import load_run
from loopformer.tasks.base import TokenDataset
from loopformer.tasks.sudoku import SudokuTask
from loopformer.train.trainer import Trainer

RECIPE = REPO / "recipes" / "sudoku9_fprm.yaml"
SHARED = "d_model: 64, n_heads: 4, n_layers: 2, mixer: mlp"
BASELINES: dict[str, list[str]] = {
    "transformer": [
        f"model={{name: transformer, {SHARED}}}",
        "train.mode=simple",
        "loop_train={}",
        "loop_eval={}",
    ],
    "trm": [
        f"model={{name: trm, {SHARED}, n_inner: 3}}",
        "train.halt_on_q=true",
        "train.halt_exploration=0.1",
        "loop_train={}",
        "loop_eval={}",
    ],
}
# The authors' protocols (second rerun): FPRM trained as nilskiKonjIzDunava/fprm trains it (a slot halts when
# its fixed-point residual is below fp_thresh or its step size below 1e-3, pretrain.py / FixedPointOptimizer;
# the damped solver's step size / patience / best residual carried across a sample's segments and reset only
# when it halts; arch.max_iter 12 segments; rel_sup residual) and evaluated as its eval loop does
# (the whole batch stops when its largest residual is below 0.1, cap max_iter_eval 1000, step decay 0.997 and
# patience 10: the model card's Sudoku protocol); TRM as SamsungSAILMontreal/TinyRecursiveModels trains and
# evaluates it (halt_max_steps 16 segments, Q-halting with exploration 0.1; evaluation runs all 16
# segments). The curriculum check scores each model as it is evaluated (TRM: 16 chained segments; FPRM: the
# authors' solver and halting, its cap bounded at 64 steps for cost: data.curriculum.max_steps).
FPRM_AUTHORS_EVAL = (
    "loop_eval={solver: damped, damp_gamma: 0.997, damp_patience: 10, damp_min_step: 1.0e-3, tol: 0.1, "
    "residual_norm: rel_sup, halting: batch_residual, max_steps: 1000}"
)
AUTHORS: dict[str, list[str]] = {
    "fprm_authors": [
        "train.halt_on_converged=true",
        "train.carry_solver_state=true",
        "train.max_segments=12",
        "loop_train.residual_norm=rel_sup",
        "loop_train.damp_min_step=1.0e-3",
        FPRM_AUTHORS_EVAL,
        "data.curriculum.max_steps=64",
        # no periodic evaluation: the eval phase scores every budget's checkpoint (FPRM's in-run evaluation
        # at cap 1000 took 4 min a time; it reads no training RNG, so the training stream is the same)
        "train.eval_every=0",
    ],
    "trm_authors": [*BASELINES["trm"], "train.max_segments=16", "eval.segments=16", "train.eval_every=0"],
}
MODELS = ("fprm", *BASELINES, *AUTHORS)
PROTOCOL = {
    "fprm": "ours: fixed-length segments (8 per slot, lock-step refill), eval per-sample residual halting, cap 64",
    "transformer": "one pass",
    "trm": "ours: 8 segments, eval 8 segments chained, curriculum check 1 segment",
    "fprm_authors": "authors': halt on convergence, solver state carried, 12 segments; eval batch-wide, "
    "cap 1000, decay 0.997, patience 10",
    "trm_authors": "authors': 16 segments, Q-halting; eval 16 segments chained (curriculum check too)",
}
# test-time compute: transformer blocks applied per loop step (FPRM: its n_layers blocks; TRM: n_inner
# latent updates + 1 answer update, each through its n_layers blocks)
BLOCKS_PER_STEP = {"fprm_authors": 2, "trm_authors": (3 + 1) * 2}
# test-time budgets in loop steps (FPRM: up to 512 steps = 1,024 blocks, past TRM's 384; the authors' cap of
# 1000 is the evaluation row itself; TRM: within its first segment, then whole segments up to all 16)
BUDGETS = {"fprm_authors": [2**k for k in range(10)], "trm_authors": [1, 2, 3, 6, 12, 24, 48]}
MINUTES = (15, 30, 60)
BLANK_BINS = ((20, 29), (30, 39), (40, 49), (50, 60))
# the two real Sudoku-Extreme rows of tests/test_tasks_sudoku.py (sapientinc/sudoku-extreme test split)
EXTREME_ROWS = (
    "5...27..9..41......1..5.3...92.6.8...5......66..7..29.8...7...2.......8...9..36..",
    ".....8..1.6.9..2...4.52.9..4..6......9..45..6....924..9......7........3.35.2..6..",
)


def configs(runs: Path, quick: bool, extra: list[str] | None = None) -> dict[str, Any]:
    q = (
        [
            "data.train_size=64",
            "data.eval_size=16",
            "train.batch_size=8",
            "loop_eval.max_steps=4",
            "eval.batch_size=16",
            "train.eval_every=0",
        ]
        if quick
        else []
    )
    q = [*q, *(extra or [])]  # --set: e.g. a second seed (seed=1 data.train_seed=1) into its own --runs folder
    cfgs = {"fprm": make_config(RECIPE, [*q, f"out_dir={runs / 'fprm'}"])}
    for name, over in {**BASELINES, **AUTHORS}.items():
        cfgs[name] = make_config(RECIPE, [*q, *over, f"out_dir={runs / name}"])
    return cfgs


def probe(args: argparse.Namespace) -> dict[str, Any]:
    """FPRM s/step at ``args.threads`` threads (median of timed steps after a warm-up) and every model's
    FLOPs/step. ``--clock FILE`` keeps an earlier probe's clock (``steps_15``) and FLOPs (a probe.json or a
    results.json holding one) and counts only the models it lacks, so new rows share the old budgets."""
    cfgs = configs(args.runs, args.quick, args.set)
    if args.clock is not None:
        return extend_probe(args, cfgs)
    cfg = dataclasses.replace(cfgs["fprm"], out_dir=str(args.runs / "probe"))
    cfg.data = dataclasses.replace(cfg.data, train_size=4 * cfg.train.batch_size, eval_size=0)
    cfg.data.curriculum = dataclasses.replace(cfg.data.curriculum, enabled=False)
    cfg.train.threads = args.threads
    torch.set_num_threads(args.threads)
    trainer = Trainer(cfg)
    for _ in range(2):
        trainer.train_step()
        trainer.step += 1
    times = []  # process CPU time: with one thread, the wall time of a step on a core of its own
    for _ in range(3 if args.quick else 12):
        t0 = time.process_time()
        trainer.train_step()
        trainer.step += 1
        times.append(time.process_time() - t0)
    s_per_step = float(np.median(times))
    load = os.getloadavg()[0]
    flops = {n: flops_per_step(c, steps=2, out_dir=args.runs / "probe") for n, c in cfgs.items()}
    steps_15 = max(4, round(15 * 60 / s_per_step)) if not args.quick else 4
    payload = {
        "fprm_s_per_step": s_per_step,
        "threads": args.threads,
        "load_average": load,
        "steps_15": steps_15,
    }
    return _save_probe(args, payload, flops, list(cfgs))


def _save_probe(
    args: argparse.Namespace, payload: dict[str, Any], flops: dict[str, float], names: list[str]
) -> dict[str, Any]:
    """``payload`` with the FLOPs and every model's budgets (15 / 30 / 60 minutes = 1 / 2 / 4 x its
    15-minute step count at FPRM's FLOPs: equal training FLOPs), written to ``runs/probe.json``."""
    steps_15 = payload["steps_15"]
    payload = {
        **payload,
        "flops_per_step": flops,
        "budget_steps": {
            n: [k * max(1, round(steps_15 * flops["fprm"] / flops[n])) for k in (1, 2, 4)] for n in names
        },
    }
    write_json(args.runs / "probe.json", payload)
    print(json.dumps(payload, indent=1), flush=True)
    return payload


def extend_probe(args: argparse.Namespace, cfgs: dict[str, Any]) -> dict[str, Any]:
    """The probe of ``args.clock`` with the FLOPs and budgets of the models it does not hold."""
    held = json.loads(args.clock.read_text())
    plan = dict(held.get("probe", held))
    flops = dict(plan["flops_per_step"])
    for n, c in cfgs.items():
        if n not in flops:
            flops[n] = flops_per_step(c, steps=2, out_dir=args.runs / "probe")
    clock = str(args.clock.relative_to(REPO) if args.clock.is_relative_to(REPO) else args.clock)
    return _save_probe(args, {**plan, "clock_from": clock}, flops, list(cfgs))


def train_one(args: argparse.Namespace, name: str) -> None:
    plan = json.loads((args.runs / "probe.json").read_text())
    cfg = configs(args.runs, args.quick, args.set)[name]
    budgets = [b for b, m in zip(plan["budget_steps"][name], MINUTES) if m <= args.max_minutes]
    first, last = budgets[0], budgets[-1]
    cfg.train.steps = last
    cfg.train.checkpoint_every = first
    cfg.train.resume = bool(args.resume)  # continue a shorter budget's run (bit-identical to one long run)
    cfg.train.keep_checkpoints = 8
    torch.set_num_threads(1)
    t0, c0 = time.perf_counter(), time.process_time()
    summary = Trainer(cfg).fit()
    record = args.runs / name / "experiment.json"
    earlier = json.loads(record.read_text()) if args.resume and record.is_file() else None
    write_json(
        record,
        {
            "earlier_part": earlier,  # the shorter budget's run this one continued (--resume)
            "steps": cfg.train.steps,
            "checkpoint_every": first,
            "wall_time_s": round(time.perf_counter() - t0, 1),
            "cpu_time_s": round(time.process_time() - c0, 1),
            "load_average_end": os.getloadavg()[0],
            "final_train": summary.get("train", {}),
        },
    )


def eval_loop(name: str, run: Any) -> Any:
    """FPRM: its damped fixed-point loop (cap 64); TRM: all max_segments segments chained (T cycles
    each, no halting at evaluation, as TRM / HRM evaluate); the transformer: one pass."""
    loop = run.loop_eval
    if name == "trm":
        loop = dataclasses.replace(loop, max_steps=loop.max_steps * run.config.train.max_segments)
    return loop


@torch.no_grad()
def evaluate_checkpoint(name: str, path: Path, eval_set: Any, backtracks: np.ndarray) -> dict[str, Any]:
    run = load_run(path, use_ema=True)
    loop = eval_loop(name, run)
    task: SudokuTask = run.task  # type: ignore[assignment]
    valid, steps = [], []
    for start in range(0, len(eval_set), 250):
        x = torch.as_tensor(eval_set.inputs[start : start + 250], dtype=torch.long)
        out = run.model(x, loop=loop, generator=torch.Generator().manual_seed(0))
        pred = out.logits.argmax(-1).numpy()
        valid += [task.check(a, b) for a, b in zip(eval_set.inputs[start : start + 250], pred)]
        steps.append(out.loop.steps.numpy())
    v = np.asarray(valid, dtype=bool)
    s = np.concatenate(steps).astype(np.float64)
    blanks = eval_set.difficulty
    by_bin = {f"{lo}-{hi}": _frac(v[(blanks >= lo) & (blanks <= hi)]) for lo, hi in BLANK_BINS}
    stats = steps_vs_difficulty(blanks, s, v)
    extreme = []
    for text in EXTREME_ROWS:
        x = torch.as_tensor(task.parse_grid(text)[None], dtype=torch.long)
        out = run.model(x, loop=loop, generator=torch.Generator().manual_seed(0))
        extreme.append(
            {
                "valid": bool(task.check(x[0].numpy(), out.logits.argmax(-1)[0].numpy())),
                "steps": int(out.loop.steps[0]),
                "converged": bool(out.loop.converged[0]),
            }
        )
    return {
        "step": run.step,
        "weights": run.weights,
        "n": int(len(v)),
        "valid": float(v.mean()),
        "valid_30plus": _frac(v[blanks >= 30]),
        "by_blanks": by_bin,
        "propagation_only": _frac(v[backtracks == 0]),
        "needs_search": _frac(v[backtracks > 0]),
        "n_needs_search": int((backtracks > 0).sum()),
        "mean_steps": float(s.mean()),
        "steps_vs_blanks_spearman": stats.spearman_rho,
        "spearman_p": stats.spearman_p,
        "extreme": extreme,
        "loop_max_steps": loop.max_steps,
    }


def authors_eval(run: Any) -> tuple[Any, int]:
    """(loop, chained segments) of a run as its authors evaluate it: ``loop_eval`` with ``eval.segments``
    chained calls."""
    return run.loop_eval, run.config.eval.segments


def score_authors(run: Any, eval_set: Any) -> Any:
    """``loopformer.eval.evaluate`` of ``run``'s weights (EMA) under :func:`authors_eval` (250 a batch)."""
    loop, segments = authors_eval(run)
    return evaluate_data(run.model, run.task, eval_set, loop=loop, batch_size=250, seed=0, segments=segments)


@torch.no_grad()
def budget_curve(name: str, run: Any, eval_set: Any) -> list[dict[str, Any]]:
    """Valid accuracy after exactly b loop steps for each b of ``BUDGETS[name]``, read in one pass per batch
    (``loopformer.eval.analysis.trace_loops`` reads the model's head at every step; TRM's steps count on
    across its chained segments, as it is evaluated): the test-time compute curve."""
    loop, segments = run.loop_eval, run.config.eval.segments
    budgets = BUDGETS[name]
    if segments == 1:
        loop = with_budget(loop, max(budgets), "fixed")
    elif max(budgets) != loop.max_steps * segments:
        raise ValueError(
            f"{name}: budgets must end at the chained evaluation's {loop.max_steps * segments} steps"
        )
    preds = {b: np.zeros_like(eval_set.inputs) for b in budgets}
    run.model.eval()
    gen = torch.Generator().manual_seed(0)
    for index in iter_batches(eval_set, 250):
        inputs = torch.as_tensor(eval_set.inputs[index], dtype=torch.long)

        def observe(t: int, z: Any, logits: Any, index: Any = index) -> None:
            if t in preds:
                preds[t][index] = logits.argmax(-1).numpy()

        trace_loops(run.model, inputs, loop, observe, generator=gen, segments=segments)
    points = []
    for b in budgets:
        valid = np.asarray([run.task.check(x, y) for x, y in zip(eval_set.inputs, preds[b])], dtype=bool)
        points.append(
            {
                "budget_steps": b,
                "blocks": b * BLOCKS_PER_STEP[name],
                "valid": float(valid.mean()),
                "mode": "exactly b steps",
            }
        )
        print(name, "budget", points[-1], flush=True)
    return points


@torch.no_grad()
def evaluate_authors(
    name: str, path: Path, eval_set: Any, backtracks: np.ndarray, curve: bool
) -> dict[str, Any]:
    """One checkpoint of an authors'-protocol model: accuracy as its authors evaluate it, test-time compute
    (loop steps x blocks per step), the Sudoku-Extreme rows, and with ``curve`` accuracy vs loop budget."""
    run = load_run(path, use_ema=True)
    res = score_authors(run, eval_set)
    v, s = res.valid, res.steps.astype(np.float64)
    blanks = eval_set.difficulty
    stats = steps_vs_difficulty(blanks, s, v)
    loop, segments = authors_eval(run)
    extreme = []
    for text in EXTREME_ROWS:
        grid = run.task.parse_grid(text)[None].astype(np.int64)
        one = TokenDataset(grid, grid.copy(), np.zeros(1))  # the validator scores it; the label is unused
        r = evaluate_data(run.model, run.task, one, loop=loop, batch_size=1, seed=0, segments=segments)
        extreme.append(
            {
                "valid": bool(r.records[0].valid),
                "steps": int(r.steps[0]),
                "converged": bool(r.records[0].converged),
                "protocol": PROTOCOL[name],
            }
        )
    row: dict[str, Any] = {
        "step": run.step,
        "weights": run.weights,
        "protocol": PROTOCOL[name],
        "loop": {**loop_summary(loop), "segments": segments},
        "n": int(len(v)),
        "valid": float(v.mean()),
        "valid_30plus": _frac(v[blanks >= 30]),
        "by_blanks": {f"{lo}-{hi}": _frac(v[(blanks >= lo) & (blanks <= hi)]) for lo, hi in BLANK_BINS},
        "propagation_only": _frac(v[backtracks == 0]),
        "needs_search": _frac(v[backtracks > 0]),
        "n_needs_search": int((backtracks > 0).sum()),
        "mean_steps": float(s.mean()),
        "blocks_per_step": BLOCKS_PER_STEP[name],
        "mean_blocks": float(s.mean()) * BLOCKS_PER_STEP[name],
        "converged": float(res.converged_fraction),
        "steps_vs_blanks_spearman": stats.spearman_rho,
        "spearman_p": stats.spearman_p,
        "extreme": extreme,
    }
    if curve:
        points = budget_curve(name, run, eval_set)
        row["budget_curve"] = points
    return row


def _frac(mask: np.ndarray) -> float | None:
    return float(mask.mean()) if len(mask) else None


def evaluate(args: argparse.Namespace) -> None:
    plan = json.loads((args.runs / "probe.json").read_text())
    cfg = configs(args.runs, args.quick, args.set)["fprm"]
    task = SudokuTask(9)
    eval_set = task.generate(
        16 if args.quick else args.eval_size, seed=cfg.data.eval_seed, min_blanks=20, max_blanks=60
    )
    backtracks = np.asarray(eval_set.meta["backtracks"])
    only = [n for n in args.only.split(",") if n]
    unknown = sorted(set(only) - set(MODELS))
    if unknown:
        raise SystemExit(f"--only: unknown model(s) {', '.join(unknown)} (known: {', '.join(MODELS)})")
    # rows of models not evaluated now (--only, or no run folder here) stay as the earlier eval wrote them
    earlier = args.out / "results.json"
    results: dict[str, Any] = json.loads(earlier.read_text())["results"] if earlier.is_file() else {}
    for name in only or MODELS:
        run_dir = args.runs / name
        if not (run_dir / "checkpoints").is_dir():
            print(f"{name}: no checkpoints in {run_dir}, skipped", flush=True)
            continue
        record = run_dir / "experiment.json"  # written when the training process finishes
        exp = json.loads(record.read_text()) if record.is_file() else {"unfinished": True}
        times = _train_times(run_dir)
        rows = []
        for minutes, step in zip(MINUTES, plan["budget_steps"][name]):
            saved = run_dir / f"eval-{minutes}min.json"  # one file per checkpoint: parallel evals never race
            ckpt = run_dir / "checkpoints" / f"step_{step:08d}"
            if minutes in args.minutes and not args.assemble:
                if not ckpt.is_dir():
                    print(f"{name}: no checkpoint {ckpt}", flush=True)
                    continue
                if name in AUTHORS:
                    row = evaluate_authors(name, ckpt, eval_set, backtracks, curve=minutes == MINUTES[-1])
                else:
                    row = evaluate_checkpoint(name, ckpt, eval_set, backtracks)
                row.update(minutes=minutes, train_time_s=times.get(step))
                write_json(saved, row)
                print(
                    name,
                    minutes,
                    {k2: row[k2] for k2 in ("valid", "valid_30plus", "by_blanks", "mean_steps")},
                    flush=True,
                )
            if saved.is_file():
                rows.append(json.loads(saved.read_text()))
        results[name] = {
            "protocol": PROTOCOL[name],
            "checkpoints": rows,
            "train": exp,
            "gflops_per_step": plan["flops_per_step"][name] / 1e9,
        }
    results = {n: results[n] for n in MODELS if n in results}
    payload = {
        "command": "python experiments/sudoku9_cpu.py --phase eval [--only NAME,...]",
        "probe": plan,
        "eval_set": {
            "n": len(eval_set),
            "blanks": [20, 60],
            "seed": cfg.data.eval_seed,
            "needs_search": int((backtracks > 0).sum()),
        },
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "results.json", payload)
    (args.out / "table.md").write_text(markdown(payload))
    plot(payload, args.out / "accuracy_vs_blanks.png")
    if any("budget_curve" in r for res in results.values() for r in res["checkpoints"]):
        plot_budget(payload, args.out / "accuracy_vs_budget.png")
    print((args.out / "table.md").read_text())


def _train_times(run_dir: Path) -> dict[int, float]:
    """Training-loop seconds at each logged step (metrics.jsonl ``time``)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "time" in rec and "step" in rec:
            out[int(rec["step"])] = float(rec["time"])
    return out


def markdown(payload: dict[str, Any]) -> str:
    """The first rerun's table (our protocol), then the authors'-protocol table with test-time compute,
    then the accuracy-vs-budget points."""
    ours = {n: r for n, r in payload["results"].items() if n not in AUTHORS}
    theirs = {n: r for n, r in payload["results"].items() if n in AUTHORS}
    text = _table(ours, compute=False)
    if theirs:
        text += (
            "\nUnder the authors' protocols (" + "; ".join(f"{n}: {PROTOCOL[n]}" for n in theirs) + "):\n\n"
        )
        text += _table(theirs, compute=True)
        curves = [(n, r) for n, res in theirs.items() for r in res["checkpoints"] if "budget_curve" in r]
        if curves:
            text += "\nAccuracy vs test-time compute (60-minute checkpoints; blocks = loop steps x blocks per step):\n\n"
            text += "| model | loop steps (exactly) | blocks | valid |\n|---|---|---|---|\n"
            for n, r in curves:
                for p in r["budget_curve"]:
                    text += f"| {n} | {p['budget_steps']} | {p['blocks']} | {_pct(p['valid'])} |\n"
    return text


def _table(results: dict[str, Any], compute: bool) -> str:
    head = "| model | budget (min) | steps | " + " | ".join(f"{lo}-{hi} blanks" for lo, hi in BLANK_BINS)
    head += " | all | >= 30 blanks | propagation only | needs search | mean loops | rho(loops, blanks) |"
    if compute:
        head += " test-time blocks per puzzle | converged | Sudoku-Extreme rows (valid, steps, converged) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, res in results.items():
        for row in res["checkpoints"]:
            cells = [name, str(row["minutes"]), str(row["step"])]
            cells += [_pct(row["by_blanks"][f"{lo}-{hi}"]) for lo, hi in BLANK_BINS]
            cells += [
                _pct(row["valid"]),
                _pct(row["valid_30plus"]),
                _pct(row["propagation_only"]),
                _pct(row["needs_search"]),
                f"{row['mean_steps']:.1f}",
                "-"
                if row["steps_vs_blanks_spearman"] is None or np.isnan(row["steps_vs_blanks_spearman"])
                else f"{row['steps_vs_blanks_spearman']:.2f}",
            ]
            if compute:
                cells += [
                    f"{row['mean_blocks']:.0f}",
                    _pct(row["converged"]),
                    "; ".join(
                        f"{'valid' if e['valid'] else 'invalid'}, {e['steps']}, "
                        f"{'converged' if e['converged'] else 'not converged'}"
                        for e in row["extreme"]
                    ),
                ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def plot(payload: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    centres = [(lo + hi) / 2 for lo, hi in BLANK_BINS]
    for i, (name, res) in enumerate(payload["results"].items()):
        for row, style in zip(res["checkpoints"], (":", "--", "-")):
            ys = [row["by_blanks"][f"{lo}-{hi}"] for lo, hi in BLANK_BINS]
            ax.plot(
                centres,
                [np.nan if y is None else y for y in ys],
                style,
                marker="o",
                color=f"C{i}",
                markersize=3,
                label=f"{name} {row['minutes']} min",
            )
    ax.set_xlabel("blanks")
    ax.set_ylabel("valid accuracy (held-out)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=3)
    ax.set_title("9x9 Sudoku, one CPU core: equal training FLOPs per budget", fontsize=9)
    save_figure(fig, path)


def plot_budget(payload: dict[str, Any], path: Path) -> None:
    """Held-out valid accuracy vs test-time compute (transformer blocks applied per puzzle, log2 axis) of
    the authors'-protocol 60-minute checkpoints; each model's own evaluation (its authors' protocol) as a
    marker."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, (name, res) in enumerate(payload["results"].items()):
        for row in res["checkpoints"]:
            if "budget_curve" not in row:
                continue
            pts = row["budget_curve"]
            ax.plot(
                [p["blocks"] for p in pts],
                [p["valid"] for p in pts],
                "-",
                marker="o",
                markersize=3,
                color=f"C{i}",
                label=f"{name}, exactly b loop steps",
            )
            ax.plot(
                [max(row["mean_blocks"], 1.0)],
                [row["valid"]],
                "*",
                markersize=10,
                color=f"C{i}",
                label=f"{name}, authors' evaluation ({row['mean_blocks']:.0f} blocks used)",
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("test-time compute: blocks applied per puzzle (loop steps x blocks per step)")
    ax.set_ylabel("valid accuracy (held-out, 1,000)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    ax.set_title(
        "9x9 Sudoku, 60 min on one CPU core, equal training FLOPs: accuracy vs test-time compute", fontsize=8
    )
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=("probe", "train", "eval", "all"), default="all")
    parser.add_argument("--only", default="", help="comma-separated models for --phase train / eval")
    parser.add_argument("--quick", action="store_true", help="a few steps at tiny size (dry run)")
    parser.add_argument("--threads", type=int, default=1, help="threads of the probe (the budgets' clock)")
    parser.add_argument("--max-minutes", type=int, default=60, help="train to this budget (15, 30 or 60)")
    parser.add_argument("--resume", action="store_true", help="continue each run from its last checkpoint")
    parser.add_argument("--eval-size", type=int, default=1000)
    parser.add_argument(
        "--minutes",
        type=lambda t: [int(m) for m in t.split(",")],
        default=list(MINUTES),
        help="--phase eval: the budgets' checkpoints to score, e.g. 30 or 15,60 (one process each can run in parallel)",
    )
    parser.add_argument(
        "--assemble",
        action="store_true",
        help="--phase eval: score nothing, gather the saved rows into the outputs",
    )
    parser.add_argument(
        "--clock",
        type=Path,
        default=None,
        help="keep this probe's clock and FLOPs (probe.json or results.json)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for every model's config (repeatable), e.g. --set seed=1 --set data.train_seed=1",
    )
    parser.add_argument("--runs", type=Path, default=REPO / "runs" / "sudoku9")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "figures" / "sudoku9")
    args = parser.parse_args()
    if args.phase in ("probe", "all"):
        probe(args)
    if args.phase in ("train", "all"):
        for name in [s for s in args.only.split(",") if s] or MODELS:
            train_one(args, name)
    if args.phase in ("eval", "all"):
        evaluate(args)


if __name__ == "__main__":
    main()
