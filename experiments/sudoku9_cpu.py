"""9x9 Sudoku on a CPU: FPRM vs TRM (and a plain transformer) at equal training FLOPs.

What one core of a 2-core CPU learns on the papers' own task shape (81 tokens; FPRM arXiv 2606.18206, TRM
arXiv 2510.04871, HRM arXiv 2506.21734 report Sudoku-Extreme). Two sets of runs:

- **The head-to-head** (``--seeds 0,1,2,3``; runs in ``<runs>/seed<N>/<model>``): ``fprm_authors`` and
  ``trm_authors``, each built with its authors' architecture options scaled to the CPU width (FPRM 398,529
  parameters, TRM 397,825, each counting its one puzzle-embedding row; 398,465 and 397,761 without it, as the
  tables count: ``FPRM_BUILD`` / ``TRM_BUILD`` below say which options) and trained / evaluated
  under its authors' protocol, plus ``fprm_authors_jac``: FPRM with loopformer's contraction term
  (``train.jacobian_weight``), at FPRM's step counts. Seed N: model seed N, training puzzles from seed
  100 + N (never the held-out set's seed).
- **The first rerun** (no ``--seeds``; ``<runs>/<model>``): ``fprm`` (recipes/sudoku9_fprm.yaml), ``transformer``
  and ``trm`` with our protocols (``PROTOCOL``).

Budgets: equal training FLOPs. ``CLOCK`` fixes 15 minutes as 1,628 steps of the first rerun's FPRM (0.553
CPU-seconds a step, measured on one core; ``--phase probe --measure-clock`` measures it again); a model's
15-minute budget is those FLOPs over its own FLOPs per step (``torch.utils.flop_counter.FlopCounterMode``,
forward + backward), 30 and 60 minutes twice and four times that. Budgets are step counts, so results do not
depend on the machine's load; each run records its wall and CPU time.

1. ``--phase probe``: counts each model's FLOPs per step and writes its budgets to ``<runs>/probe.json``
   (the train phase does it when missing).
2. ``--phase train --only NAME [--seeds 0,1,2] [--max-minutes 15|30|60] [--resume]``: one model to its budget,
   a checkpoint at every 15-minute mark; one thread; resumable (``--resume`` continues the newest checkpoint
   bit-identically). Runs of different models can go in parallel processes (pin each with ``taskset``).
3. ``--phase eval``: with ``--seeds``, every head-to-head checkpoint on the held-out set (1,000 generated
   puzzles, 20-60 blanks, 104 needing search) through ``sudoku9_h2h.py``: each model's own protocol, accuracy
   at matched test-time compute (8 to 2,048 blocks per puzzle), the paired bootstrap of FPRM - TRM, seed
   means and ranges -> ``results_h2h.json``, ``table_h2h.md``, ``accuracy_vs_budget_h2h.png``,
   ``contraction_vs_budget.png``; rows are saved per checkpoint (``eval-h2h-<M>min.json``, skipped when
   present), ``--assemble`` only gathers them. Without ``--seeds``: the first rerun's ``results.json``,
   ``table.md``, ``accuracy_vs_blanks.png``. Both are the "9x9 Sudoku on a CPU" section of docs/results.md.
4. ``--phase overlap --train-seeds 1,100,101,102``: how many held-out puzzles a training set from each seed
   holds (0 for the head-to-head's seeds; all 1,000 for seed 1, the earlier second FPRM run's).

Usage: ``python experiments/sudoku9_cpu.py --phase train --only fprm_authors --seeds 0,1,2,3`` (and
``trm_authors``, ``fprm_authors_jac``; one process per model, each pinned to its own core), then ``--phase eval
--seeds 0,1,2,3``. On one core of this 2-core CPU a seed's ``fprm_authors`` run to 60 minutes of budget took
72-78 minutes of wall time, ``fprm_authors_jac`` (1.32x the FLOPs a step) about 2 hours, and scoring one FPRM
checkpoint 22-29 minutes. ``--quick`` is a dry run at tiny size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import sudoku9_h2h as h2h
import torch
from fprm_common import REPO, flops_per_step, make_config, probe_config, pyplot, save_figure, write_json

from loopformer.eval.budget import steps_vs_difficulty
from loopformer.runs import load_run
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
# The head-to-head (issue 32): each model built with its authors' architecture options, scaled to the CPU width
# (d 64, 4 heads, 2 blocks), and trained / evaluated under its authors' protocol.
# - FPRM: the options of nilskiKonjIzDunava/fprm as recipes/paper_sudoku_extreme_fprm.yaml sets them (grid conv
#   that replaces the state, tied-b eps 1e-5, gain-free RMSNorm eps 1e-5, no head norm, Q-head on the first
#   puzzle-embedding position, LeCun init, initial iterate std 6, SwiGLU width rounded to 256, 16 puzzle-embedding
#   tokens, weight decay on vectors) with one change: the MLP token mixer (their arch.mlp_t, which their Sudoku
#   config leaves off; TRM's Sudoku variant uses it) instead of attention, which did not learn 9x9 at this width
#   on a CPU (docs/results.md, "Which FPRM setting").
# - TRM: SamsungSAILMontreal/TinyRecursiveModels as recipes/paper_sudoku_extreme_trm.yaml sets it (MLP mixer, no
#   positions, L_cycles 6 = n_inner, H_cycles 3 per segment, 16 puzzle-embedding tokens, LeCun init, gain-free
#   RMSNorm, SwiGLU width rounded to 256, weight decay on every parameter).
# Parameters: FPRM 398,529, TRM 397,825 (0.2% apart; neither was rescaled: at the same width both builds land
# within 5%). Both train the puzzle embedding by sign-SGD as both authors do. The optimiser, learning rate,
# batch, EMA, data and curriculum are shared (recipes/sudoku9_fprm.yaml): the comparison varies the model and
# its authors' segment / halting / evaluation protocol only (the authors' own optimisers, AdamW 1e-3 for FPRM and
# AdamATan2 1e-4 for TRM, are tuned for 78k-step GPU runs, not for ~1-6k CPU steps).
FPRM_BUILD = (
    "model={name: fprm, d_model: 64, n_heads: 4, n_layers: 2, expansion: 4.0, mixer: mlp, conv: grid2d, "
    "conv_kernel: 3, conv_form: replace, a1_init: 0.75, a2_init: 0.25, tied_eps: 1.0e-5, norm: pre, "
    "state_norm: none, norm_eps: 1.0e-5, norm_gain: false, head_norm: false, q_pool: first, init: lecun, "
    "init_std: 6.0, mlp_multiple: 256, num_puzzle_ids: 1, puzzle_emb_len: 16, puzzle_emb_dim: 64, "
    "decay_vectors: true}"
)
TRM_BUILD = (
    "model={name: trm, d_model: 64, n_heads: 4, n_layers: 2, expansion: 4.0, mixer: mlp, n_inner: 6, "
    "rope: false, num_puzzle_ids: 1, puzzle_emb_len: 16, puzzle_emb_dim: -1, norm_eps: 1.0e-5, "
    "norm_gain: false, mlp_multiple: 256, init: lecun, loop: {max_steps: 3}}"
)
PUZZLE_EMB = [  # both authors: sign-SGD for the puzzle embedding at the model's rate, not in the EMA
    "train.puzzle_emb_optimizer=sign_sgd",
    "train.puzzle_emb_lr=2.0e-3",
    "train.puzzle_emb_weight_decay=1.0e-3",
    "train.ema_puzzle_embeddings=false",
]
# The authors' protocols: FPRM trained as nilskiKonjIzDunava/fprm trains it (a slot halts when its fixed-point
# residual is below fp_thresh or its step size below 1e-3, pretrain.py / FixedPointOptimizer; the damped solver's
# step size / patience / best residual carried across a sample's segments and reset only when it halts;
# arch.max_iter 12 segments; rel_sup residual) and evaluated as its eval loop does (the whole batch stops when its
# largest residual is below 0.1, cap max_iter_eval 1000, step decay 0.997 and patience 10: the model card's Sudoku
# protocol with a cap of 1000 instead of 35,000); TRM as TinyRecursiveModels trains and evaluates it
# (halt_max_steps 16 segments, Q-halting with exploration 0.1; evaluation runs all 16 segments, here as one loop
# of 16 x 3 = 48 cycles, identical without gradient: tests/test_parity_trm.py). The curriculum check scores
# both at the same test-time compute, 126 blocks per puzzle: FPRM 63 steps x 2 blocks, TRM 9 cycles x 14 blocks
# (data.curriculum.max_steps).
FPRM_AUTHORS_EVAL = (
    "loop_eval={solver: damped, damped: {gamma: 0.997, patience: 10, min_step: 1.0e-3}, tol: 0.1, "
    "residual_norm: rel_sup, halting: batch_residual, max_steps: 1000}"
)
# loopformer's addition (not the paper's): a contraction term on FPRM's map, the Hutchinson estimate of
# ||dF/dz||_F^2 / dim at each segment's last iterate (train.jacobian_weight; the Attractor and DEQ papers' term)
JACOBIAN_WEIGHT = 0.1
AUTHORS: dict[str, list[str]] = {
    "fprm_authors": [
        FPRM_BUILD,
        *PUZZLE_EMB,
        "train.halt_on_converged=true",
        "train.carry_solver_state=true",
        "train.max_segments=12",
        "loop_train.residual_norm=rel_sup",
        "loop_train.damped.min_step=1.0e-3",
        FPRM_AUTHORS_EVAL,
        "data.curriculum.max_steps=63",
        # no periodic evaluation: the eval phase scores every budget's checkpoint (it reads no training RNG)
        "train.eval_every=0",
    ],
    "trm_authors": [
        TRM_BUILD,
        *PUZZLE_EMB,
        "train.decay_all=true",
        "train.halt_on_q=true",
        "train.halt_exploration=0.1",
        "train.max_segments=16",
        "loop_train={}",
        "loop_eval={halting: fixed, max_steps: 48}",
        "eval.segments=1",
        "data.curriculum.max_steps=9",
        "train.eval_every=0",
    ],
}
AUTHORS["fprm_authors_jac"] = [*AUTHORS["fprm_authors"], f"train.jacobian_weight={JACOBIAN_WEIGHT}"]
# The head-to-head's controls (issue 46): each arm changes one thing of fprm_authors / trm_authors.
HRM_BUILD = (  # HRM (sapientinc/HRM's Sudoku options) at the CPU width with the MLP mixer the other two use:
    # two H and two L blocks (the authors' equal H and L depths, 4 + 4 at d 512; 452k parameters against FPRM's
    # 398k: one block each would have 226k), 2 L updates per H update, H_cycles 2 per segment, one
    # puzzle-embedding token of d values
    "model={name: hrm, d_model: 64, n_heads: 4, n_layers: 2, l_layers: 2, expansion: 4.0, mixer: mlp, "
    "l_cycles: 2, one_step_grad: true, rope: false, num_puzzle_ids: 1, puzzle_emb_len: 1, puzzle_emb_dim: -1, "
    "norm_eps: 1.0e-5, norm_gain: false, mlp_multiple: 256, init: lecun, loop: {max_steps: 2}}"
)
NO_CURRICULUM = "data.curriculum.enabled=false"  # the full 20-60-blank mix from the first step
# no final evaluation inside training: the eval phase scores every budget's checkpoint (the held-out size changes
# nothing the training draws: same weights, checked)
NO_FINAL_EVAL = "data.eval_size=0"
AUTHORS.update(
    {
        "fprm_nocur": [*AUTHORS["fprm_authors"], NO_CURRICULUM, NO_FINAL_EVAL],
        "trm_nocur": [*AUTHORS["trm_authors"], NO_CURRICULUM, NO_FINAL_EVAL],
        # TRM built for this compute: 3 latent updates a cycle and no puzzle-prefix tokens (the build that
        # reached 89.4% at 60 minutes before the authors' options were adopted)
        "trm_c3": [*(o for o in AUTHORS["trm_authors"] if o not in PUZZLE_EMB), "model.n_inner=3",
                   "model.num_puzzle_ids=0", "model.puzzle_emb_len=0", "model.puzzle_emb_dim=0", NO_FINAL_EVAL],
        "fprm_noconv": [*AUTHORS["fprm_authors"], "model.conv=none", NO_FINAL_EVAL],
        "trm_conv": [*AUTHORS["trm_authors"], "model.grid_conv=true", NO_FINAL_EVAL],
        "hrm_authors": [
            HRM_BUILD,
            *PUZZLE_EMB,
            "train.decay_all=true",
            "train.halt_on_q=true",
            "train.halt_exploration=0.1",
            "train.q_learning=true",
            "train.max_segments=16",
            "loop_train={}",
            "loop_eval={halting: fixed, max_steps: 32}",  # 16 segments x H_cycles 2
            "eval.segments=1",
            "data.curriculum.max_steps=21",  # 126 blocks: 21 steps x (2 L + 1 H) x 2 blocks
            "train.eval_every=0",
            NO_FINAL_EVAL,
        ],
        # the learning-rate check (15 minutes, one seed): the shared AdamW at 1e-3 and 4e-3, and TRM's own
        # optimiser (AdamATan2 1e-4, weight decay 1.0, betas 0.9 / 0.95, no clipping; the shared warm-up)
        "fprm_lr1e-3": [*AUTHORS["fprm_authors"], "train.lr=1.0e-3", "train.puzzle_emb_lr=1.0e-3", NO_FINAL_EVAL],
        "fprm_lr4e-3": [*AUTHORS["fprm_authors"], "train.lr=4.0e-3", "train.puzzle_emb_lr=4.0e-3", NO_FINAL_EVAL],
        "trm_lr1e-3": [*AUTHORS["trm_authors"], "train.lr=1.0e-3", "train.puzzle_emb_lr=1.0e-3", NO_FINAL_EVAL],
        "trm_lr4e-3": [*AUTHORS["trm_authors"], "train.lr=4.0e-3", "train.puzzle_emb_lr=4.0e-3", NO_FINAL_EVAL],
        "trm_atan2": [*AUTHORS["trm_authors"], "train.optimizer=adam_atan2", "train.lr=1.0e-4",
                      "train.weight_decay=1.0", "train.betas=[0.9, 0.95]", "train.grad_clip=0.0",
                      "train.puzzle_emb_lr=1.0e-4", "train.puzzle_emb_weight_decay=1.0", NO_FINAL_EVAL],
    }
)
# what each control isolates: (a, b, the question), a - b reported (experiments/sudoku9_h2h.py, controls)
CONTROLS = [
    ("fprm_authors", "trm_authors", "the head-to-head: authors' builds, shared curriculum"),
    ("fprm_nocur", "trm_nocur", "FPRM vs TRM, no curriculum"),
    ("fprm_authors", "trm_c3", "FPRM vs TRM built for this compute (3 cycles, no prefix)"),
    ("fprm_authors", "hrm_authors", "FPRM vs HRM"),
    ("fprm_noconv", "trm_conv", "convolution swapped: FPRM without it vs TRM with it"),
    ("fprm_authors", "fprm_noconv", "FPRM with vs without its convolution"),
    ("trm_conv", "trm_authors", "TRM with vs without the convolution"),
    ("fprm_nocur", "fprm_authors", "FPRM without vs with the curriculum"),
    ("trm_nocur", "trm_authors", "TRM without vs with the curriculum"),
]
# the head-to-head's own arms; every other arm is a control, whose TRM / HRM checkpoints are traced to 512 blocks
# per puzzle (and their own protocol) instead of 2,048: a third (TRM) to a tenth (HRM) of the scoring cost
HEAD_TO_HEAD = ("fprm_authors", "trm_authors", "fprm_authors_jac")
CONTROLS_TRACE_BLOCKS = 512
# the learning-rate check: each model's arms at other rates (15 minutes, seed 2) against its shared-rate arm
LEARNING_RATES = {
    "fprm_authors": ("fprm_lr1e-3", "fprm_lr4e-3"),
    "trm_authors": ("trm_lr1e-3", "trm_lr4e-3", "trm_atan2"),
}
# models whose budgets are another model's step counts rather than equal training FLOPs (the contraction term's
# cost is reported in time, at the same steps)
SAME_STEPS = {"fprm_authors_jac": "fprm_authors"}
LEGACY = ("fprm", *BASELINES)  # the first rerun's single runs (our protocols)
MODELS = (*LEGACY, *AUTHORS)
PROTOCOL = {
    "fprm": "ours: fixed-length segments (8 per slot, lock-step refill), eval per-sample residual halting, cap 64",
    "transformer": "one pass",
    "trm": "ours: 8 segments, eval 8 segments chained, curriculum check 1 segment",
    "fprm_authors": "authors': halt on convergence, solver state carried, 12 segments; eval batch-wide, "
    "cap 1000, decay 0.997, patience 10",
    "trm_authors": "authors': 16 segments, Q-halting; eval 16 segments chained (48 cycles)",
    "fprm_authors_jac": "fprm_authors + loopformer's contraction term (train.jacobian_weight "
    f"{JACOBIAN_WEIGHT}), same steps",
    "fprm_nocur": "fprm_authors without the curriculum (20-60 blanks from the first step)",
    "trm_nocur": "trm_authors without the curriculum (20-60 blanks from the first step)",
    "trm_c3": "trm_authors with 3 latent updates a cycle and no puzzle-prefix tokens",
    "fprm_noconv": "fprm_authors without its grid convolution",
    "trm_conv": "trm_authors with FPRM's grid convolution before each net call",
    "hrm_authors": "authors': 2 H + 2 L blocks, 2 L updates per H, H_cycles 2; 16 segments, Q-learning halting; "
    "eval 16 segments chained (32 H-cycles)",
    "fprm_lr1e-3": "fprm_authors at learning rate 1e-3",
    "fprm_lr4e-3": "fprm_authors at learning rate 4e-3",
    "trm_lr1e-3": "trm_authors at learning rate 1e-3",
    "trm_lr4e-3": "trm_authors at learning rate 4e-3",
    "trm_atan2": "trm_authors with TRM's optimiser: AdamATan2 1e-4, weight decay 1.0, betas 0.9 / 0.95, no clipping",
}
# The clock of the equal-FLOPs budgets, measured once (experiments/sudoku9_cpu.py --phase probe --measure-clock,
# 2026-11 on one core of the development CPU at load 8.6): the first rerun's FPRM took 0.553 CPU-seconds per
# step at 31.62 GFLOP per step, so 15 minutes = 1,628 steps of it = 5.15e13 FLOPs of training; every model's
# 15-minute budget is that many FLOPs divided by its own FLOPs per step (FlopCounterMode, forward + backward).
CLOCK = {
    "steps_15": 1628,
    "reference": "fprm",
    "reference_flops_per_step": 31619604480.0,
    "fprm_s_per_step": 0.5529184185,
    "threads": 1,
    "load_average": 8.62939453125,
}
MINUTES = (15, 30, 60)
BLANK_BINS = ((20, 29), (30, 39), (40, 49), (50, 60))
# the two real Sudoku-Extreme rows of tests/test_tasks_sudoku.py (sapientinc/sudoku-extreme test split)
EXTREME_ROWS = (
    "5...27..9..41......1..5.3...92.6.8...5......66..7..29.8...7...2.......8...9..36..",
    ".....8..1.6.9..2...4.52.9..4..6......9..45..6....924..9......7........3.35.2..6..",
)


def seed_overrides(seed: int) -> list[str]:
    """Model seed ``seed`` and training data generated from seed ``100 + seed``: never the held-out set's seed
    (``data.eval_seed`` 1): generated sets of one seed share their first rows, so a training seed equal to the
    held-out seed trains on the held-out puzzles (``loopformer`` now refuses that; the earlier second FPRM seed,
    ``data.train_seed=1``, did)."""
    return [f"seed={seed}", f"data.train_seed={100 + seed}"]


def run_dir(runs: Path, name: str, seed: int | None) -> Path:
    """The run folder of ``name``: ``runs/seed<N>/<name>`` for the head-to-head's seeds, ``runs/<name>`` for the
    first rerun's single runs (``seed`` None)."""
    return runs / name if seed is None else runs / f"seed{seed}" / name


def configs(
    runs: Path, quick: bool, extra: list[str] | None = None, seed: int | None = None
) -> dict[str, Any]:
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
    q = [*q, *(seed_overrides(seed) if seed is not None else []), *(extra or [])]
    cfgs = {"fprm": make_config(RECIPE, [*q, f"out_dir={run_dir(runs, 'fprm', seed)}"])}
    for name, over in {**BASELINES, **AUTHORS}.items():
        cfgs[name] = make_config(RECIPE, [*over, *q, f"out_dir={run_dir(runs, name, seed)}"])
    return cfgs


def measure_clock(args: argparse.Namespace) -> dict[str, Any]:
    """FPRM's (the first rerun's ``fprm``) s/step at ``args.threads`` threads (median of timed steps after a
    warm-up) and FLOPs per step: a new :data:`CLOCK` (printed; paste it into the script to adopt it)."""
    cfg = configs(args.runs, args.quick, args.set)["fprm"]
    cfg = probe_config(cfg, args.runs / "probe", curriculum=False)
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
    clock = {
        "steps_15": max(4, round(15 * 60 / s_per_step)),
        "reference": "fprm",
        "reference_flops_per_step": flops_per_step(cfg, steps=2, out_dir=args.runs / "probe"),
        "fprm_s_per_step": s_per_step,
        "threads": args.threads,
        "load_average": os.getloadavg()[0],
    }
    print(json.dumps(clock, indent=1), flush=True)
    return clock


def probe(args: argparse.Namespace, names: list[str] | None = None) -> dict[str, Any]:
    """Every model's FLOPs per training step and its budgets at :data:`CLOCK` (15 / 30 / 60 minutes = 1 / 2 / 4 x
    its 15-minute step count at the reference's FLOPs: equal training FLOPs; :data:`SAME_STEPS` models take
    another model's steps), written to ``<runs>/probe.json``. Models already counted there are kept; FLOPs
    per step do not depend on the seed. ``--quick``: 4 / 8 / 16 steps."""
    path = args.runs / "probe.json"
    held = json.loads(path.read_text()) if path.is_file() else {}
    if held and held.get("clock") != CLOCK and not args.quick:
        raise SystemExit(
            f"{path} was made with another clock ({held.get('clock')}); use another --runs folder"
        )
    cfgs = configs(args.runs, args.quick, args.set)
    flops = dict(held.get("flops_per_step", {}))
    for n in names or list(cfgs):
        if n not in flops:
            print(f"counting the training FLOPs of {n} ...", flush=True)
            flops[n] = flops_per_step(cfgs[n], steps=2, out_dir=args.runs / "probe")
    budgets: dict[str, list[int]] = {}
    for n in flops:
        if args.quick:
            budgets[n] = [4, 8, 16]
            continue
        ref = SAME_STEPS.get(n)
        per = CLOCK["steps_15"] * CLOCK["reference_flops_per_step"] / flops[ref or n]
        budgets[n] = [k * max(1, round(per)) for k in (1, 2, 4)]
    payload = {"clock": CLOCK, "flops_per_step": flops, "budget_steps": budgets, "quick": bool(args.quick)}
    args.runs.mkdir(parents=True, exist_ok=True)
    write_json(path, payload)
    print(json.dumps(payload, indent=1), flush=True)
    return payload


def seeds_of(args: argparse.Namespace) -> list[int | None]:
    """The seeds the phases run: ``--seeds`` (the head-to-head's folders) or None (the first rerun's)."""
    return [int(t) for t in args.seeds.split(",") if t] if args.seeds else [None]


def train_one(args: argparse.Namespace, name: str, seed: int | None) -> None:
    path = args.runs / "probe.json"
    plan = json.loads(path.read_text()) if path.is_file() else {}
    if name not in plan.get("budget_steps", {}):
        plan = probe(args, [name, *SAME_STEPS.get(name, "").split()])
    cfg = configs(args.runs, args.quick, args.set, seed)[name]
    budgets = [b for b, m in zip(plan["budget_steps"][name], MINUTES) if m <= args.max_minutes]
    first, last = budgets[0], budgets[-1]
    cfg.train.steps = last
    cfg.train.checkpoint_every = first
    # continue this run from its newest checkpoint (bit-identical to one uninterrupted run)
    folder = Path(cfg.out_dir)
    cfg.train.resume = bool(args.resume) and (folder / "checkpoints").is_dir()
    cfg.train.keep_checkpoints = 8
    torch.set_num_threads(1)
    t0, c0 = time.perf_counter(), time.process_time()
    summary = Trainer(cfg).fit()
    record = folder / "experiment.json"
    earlier = json.loads(record.read_text()) if cfg.train.resume and record.is_file() else None
    write_json(
        record,
        {
            "earlier_part": earlier,  # the part of this run before the resume (--resume)
            "seed": seed,
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


def _frac(mask: np.ndarray) -> float | None:
    return float(mask.mean()) if len(mask) else None


def _only(args: argparse.Namespace) -> list[str]:
    return [n for n in args.only.split(",") if n]


def held_out(args: argparse.Namespace) -> tuple[Any, Any, np.ndarray]:
    """(the FPRM config, the held-out set: 1,000 generated puzzles with 20-60 blanks from ``data.eval_seed``,
    each puzzle's exact-solver backtrack count)."""
    cfg = configs(args.runs, args.quick, args.set)["fprm"]
    eval_set = SudokuTask(9).generate(
        16 if args.quick else args.eval_size, seed=cfg.data.eval_seed, min_blanks=20, max_blanks=60
    )
    return cfg, eval_set, np.asarray(eval_set.meta["backtracks"])


def held_out_in_training(data: Any, train_seed: int, eval_set: Any) -> tuple[int, int]:
    """(held-out puzzles, held-out solutions) found in the training set that ``data`` (a config's ``data``
    section) generates from ``train_seed``, regenerated as the trainer does."""
    train = SudokuTask(9).generate(data.train_size, seed=train_seed, **data.train_generate)
    inputs = {row.tobytes() for row in train.inputs}
    labels = {row.tobytes() for row in train.labels}
    return (
        int(sum(row.tobytes() in inputs for row in eval_set.inputs)),
        int(sum(row.tobytes() in labels for row in eval_set.labels)),
    )


def train_overlap(args: argparse.Namespace, seed: int, eval_set: Any) -> int:
    """How many held-out puzzles (inputs) are in seed ``seed``'s training set."""
    cfg = configs(args.runs, args.quick, args.set, seed)["fprm_authors"]
    return held_out_in_training(cfg.data, cfg.data.train_seed, eval_set)[0]


def overlap(args: argparse.Namespace) -> None:
    """``--phase overlap --train-seeds 1,100``: how many held-out puzzles (and their solutions) lie in a training
    set generated from each seed as the trainer generates it. The head-to-head's seeds use 100 + N; 1 is the
    earlier second FPRM run's ``data.train_seed``, equal to ``data.eval_seed`` (config validation now refuses
    that run: ``loopformer.config.validate``)."""
    cfg, eval_set, _ = held_out(args)
    for train_seed in args.train_seeds:
        puzzles, solutions = held_out_in_training(cfg.data, train_seed, eval_set)
        print(json.dumps({
            "train_seed": train_seed, "eval_seed": cfg.data.eval_seed,
            "held_out": len(eval_set), "train_size": cfg.data.train_size,
            "held_out_puzzles_in_training": puzzles, "held_out_solutions_in_training": solutions,
        }), flush=True)  # fmt: skip


def evaluate_h2h(args: argparse.Namespace) -> None:
    """Every checkpoint of the head-to-head's seeds (``--seeds``, ``--only`` among AUTHORS, ``--minutes``) through
    ``sudoku9_h2h.evaluate_checkpoint`` into ``<runs>/seed<N>/<model>/eval-h2h-<M>min.json`` (skipped when it
    exists), then ``results_h2h.json``, ``table_h2h.md`` and ``accuracy_vs_budget_h2h.png`` from every saved row."""
    seeds = [s for s in seeds_of(args) if s is not None]
    names = [n for n in (_only(args) or AUTHORS) if n in AUTHORS]
    plan = probe(args, names)
    cfg, eval_set, backtracks = held_out(args)
    deadline = time.monotonic() + args.watch
    while True:
        pending = 0
        for seed in [] if args.assemble else seeds:
            for name in names:
                folder = run_dir(args.runs, name, seed)
                for minutes, step in zip(MINUTES, plan["budget_steps"][name]):
                    saved = folder / f"eval-h2h-{minutes}min.json"
                    ckpt = folder / "checkpoints" / f"step_{step:08d}"  # written atomically: there = complete
                    if minutes not in args.minutes or saved.is_file():
                        continue
                    if not ckpt.is_dir():
                        pending += 1
                        continue
                    family = "fprm" if name.startswith("fprm") else "trm"  # TRM and HRM: chained cycles
                    row = h2h.evaluate_checkpoint(
                        name, family, ckpt, eval_set, backtracks, list(EXTREME_ROWS), args.device,
                        h2h.BLOCK_BUDGETS[-1] if name in HEAD_TO_HEAD else CONTROLS_TRACE_BLOCKS,
                    )
                    row.update(seed=seed, minutes=minutes, train_time_s=_train_times(folder).get(step))
                    write_json(saved, row)
                    print(
                        name, seed, minutes, {k: row["protocol"][k] for k in ("valid", "mean_blocks")}, flush=True
                    )
        if not pending or time.monotonic() >= deadline:
            if pending:
                print(f"--watch: {pending} checkpoint(s) still missing after {args.watch:.0f} s", flush=True)
            break
        time.sleep(5.0)  # --watch: score each checkpoint as its training writes it
    rows = h2h.load_rows(args.runs, seeds, list(AUTHORS), list(MINUTES))
    earlier: dict[str, Any] = {}
    if args.earlier_summary:  # seeds whose run folders are gone: their seed-level numbers (no per-puzzle bits)
        earlier = json.loads(args.earlier_summary.read_text())
        for name, by_minutes in h2h.rows_from_summary(earlier["summary"]).items():
            for m, by_seed in by_minutes.items():
                for seed, row in by_seed.items():
                    if seed in seeds:
                        rows.setdefault(name, {}).setdefault(m, {}).setdefault(seed, row)
    rebuilt = sorted(
        {f"{n} seed {s} {m} min" for n, bm in rows.items() for m, bs in bm.items() for s, r in bs.items()
         if r.get("from_summary")}
    )  # fmt: skip
    summary = h2h.summarise(
        {n: r for n, r in rows.items() if n in ("fprm_authors", "trm_authors")}, "fprm_authors", "trm_authors"
    )
    # the contraction term against FPRM on the seeds that have contraction-term rows
    jac = (
        h2h.summarise(h2h.with_partner_seeds(rows, "fprm_authors_jac", "fprm_authors"), "fprm_authors_jac",
                      "fprm_authors")
        if rows.get("fprm_authors_jac")
        else {}  # no contraction-term row scored yet: no section of FPRM alone under its label
    )
    labels = {"fprm_authors": "FPRM", "trm_authors": "TRM", "fprm_authors_jac": "FPRM + contraction term"}
    payload = {
        "command": shlex.join(["python", "experiments/sudoku9_cpu.py", *sys.argv[1:]]),  # as this file was written
        "probe": plan,
        "protocols": {n: PROTOCOL[n] for n in AUTHORS},
        "eval_set": {"n": len(eval_set), "blanks": [20, 60], "seed": cfg.data.eval_seed,
                     "needs_search": int((backtracks > 0).sum())},
        "train_overlap": {str(s): train_overlap(args, s, eval_set) for s in seeds},
        "summary": summary,
        "contraction": jac,
        "rows_from_earlier_summary": {"file": str(args.earlier_summary or ""), "rows": rebuilt},
        "train": {
            n: {
                str(s): _experiment(run_dir(args.runs, n, s), earlier.get("train", {}).get(n, {}).get(str(s)))
                for s in seeds
            }
            for n in AUTHORS
        },
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    text = h2h.markdown(summary, labels)
    if jac:
        text += "\nloopformer's contraction term (same steps as FPRM):\n\n" + h2h.markdown(
            jac, labels, ("FPRM + contraction", "FPRM")
        )
    controls = assemble_controls(rows, args.runs, eval_set)
    payload["controls"] = controls
    write_json(args.out / "results_h2h.json", payload)
    (args.out / "table_h2h.md").write_text(text)
    if controls["arms"]:
        (args.out / "table_h2h_controls.md").write_text(controls_markdown(controls))
        plot_arms(controls["arms"], args.out / "controls_vs_budget.png")
    if summary:
        h2h.plot(summary, labels, args.out / "accuracy_vs_budget_h2h.png", pyplot, save_figure)
    if jac:
        h2h.plot(
            jac, labels, args.out / "contraction_vs_budget.png", pyplot, save_figure,
            "FPRM with and without loopformer's contraction term, same steps",
        )
    print(text)


LABELS = {
    "fprm_authors": "FPRM (authors' build, curriculum)",
    "trm_authors": "TRM (authors' build, curriculum)",
    "fprm_authors_jac": "FPRM + contraction term",
    "fprm_nocur": "FPRM, no curriculum",
    "trm_nocur": "TRM, no curriculum",
    "trm_c3": "TRM, 3 cycles, no prefix",
    "hrm_authors": "HRM (authors' protocol)",
    "fprm_noconv": "FPRM without its convolution",
    "trm_conv": "TRM with FPRM's convolution",
}


def assemble_controls(rows: dict[str, Any], runs: Path, eval_set: Any) -> dict[str, Any]:
    """The controls of issue 46 from the scored rows that keep per-puzzle validity: every arm by budget
    (``sudoku9_h2h.arms_summary``), each pair of ``CONTROLS`` on the seeds both arms have (seed-pair differences,
    paired bootstrap, matched test-time compute: ``sudoku9_h2h.summarise``) and where its gap lies by blanks, and
    the learning-rate check (``LEARNING_RATES``)."""
    scored = {
        n: {m: {s: r for s, r in bs.items() if h2h.has_bits(r)} for m, bs in bm.items()} for n, bm in rows.items()
    }
    scored = {n: {m: bs for m, bs in bm.items() if bs} for n, bm in scored.items()}
    scored = {n: bm for n, bm in scored.items() if bm}
    arms = h2h.arms_summary(scored, runs)
    pairs = []
    for a, b, question in CONTROLS:
        if not (scored.get(a) and scored.get(b)):
            continue
        both = h2h.with_partner_seeds(scored, a, b)
        both[a] = {m: {s: r for s, r in bs.items() if s in both[b].get(m, {})} for m, bs in both[a].items()}
        summary = h2h.summarise(both, a, b)
        gaps = {
            str(m): h2h.by_blanks_gap(both[a][m], both[b][m], eval_set.difficulty)
            for m in both[a] if both[a][m] and both[b].get(m)
        }  # fmt: skip
        pairs.append({"a": a, "b": b, "question": question, "summary": summary, "by_blanks": gaps})
    lr = []
    for base, others in LEARNING_RATES.items():
        for arm in others:
            for s, r in scored.get(arm, {}).get(15, {}).items():
                ref = scored.get(base, {}).get(15, {}).get(s)
                lr.append({
                    "arm": arm, "base": base, "seed": s, "protocol": PROTOCOL[arm], "valid": r["protocol"]["valid"],
                    "base_valid": None if ref is None else ref["protocol"]["valid"],
                    "level": h2h.curriculum_level(run_dir(runs, arm, s) / "metrics.jsonl", r["step"]),
                })  # fmt: skip
    return {"arms": arms, "pairs": pairs, "learning_rates": lr}


def gap_share(gap: dict[str, Any], lowest: int) -> str:
    """The share of a pair's gap (``sudoku9_h2h.by_blanks_gap``) on puzzles with at least ``lowest`` blanks."""
    shares = [b["share_of_gap"] for k, b in gap.get("bins", {}).items() if int(k.split("-")[0]) >= lowest]
    return "-" if not shares or None in shares else f"{100 * sum(shares):.0f}%"


def controls_markdown(controls: dict[str, Any]) -> str:
    """``table_h2h_controls.md``: the arms table, the comparisons, the learning-rate check."""
    minutes = sorted({int(m) for by_m in controls["arms"].values() for m in by_m})
    text = "Arms by training budget (own protocols; held-out valid accuracy, mean (range) over seeds):\n\n"
    text += h2h.arms_markdown(controls["arms"], LABELS, minutes)
    text += (
        "\nEach control's comparison, a - b on the seeds both arms have (own protocols; paired bootstrap over the "
        "1,000 puzzles, 95% interval; matched test-time compute: the block budgets 8-2,048 where a is ahead; "
        "share of the gap on puzzles with >= 30 and >= 40 blanks):\n\n| question | a - b | budget (min) | seeds | a - b "
        "per seed (points) | bootstrap, own protocols | matched budgets with a ahead | gap share at >= 30 blanks | "
        ">= 40 blanks |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    for pair in controls["pairs"]:
        for m, entry in pair["summary"].items():
            if "seed_differences" not in entry:
                continue
            diffs = ", ".join(f"{s}: {100 * d:+.1f}" for s, d in entry["seed_differences"].items())
            boot = entry.get("fprm_minus_trm", {}).get("own protocols")
            boot_text = "-" if boot is None else (
                f"{100 * boot['mean']:+.1f} ({100 * boot['low']:+.1f} .. {100 * boot['high']:+.1f})"
            )
            gap = pair["by_blanks"].get(m, {})
            share = {lo: gap_share(gap, lo) for lo in (30, 40)}
            text += (
                f"| {pair['question']} | {LABELS.get(pair['a'], pair['a'])} - {LABELS.get(pair['b'], pair['b'])} | "
                f"{m} | {', '.join(str(s) for s in entry['bootstrap_seeds']) or '-'} | {diffs} | {boot_text} | "
                f"{entry.get('matched_points_fprm_ahead', '-')} | {share[30]} | {share[40]} |\n"
            )
    if controls["learning_rates"]:
        text += (
            "\nLearning-rate check (15 minutes; the arms' shared optimiser is AdamW 2e-3):\n\n| arm | setting | "
            "seed | valid | same seed at the shared rate | curriculum level |\n|---|---|---|---|---|---|\n"
        )
        for r in controls["learning_rates"]:
            base = "-" if r["base_valid"] is None else f"{100 * r['base_valid']:.1f}%"
            level = "-" if r["level"] is None else f"{r['level']:.0f}"
            text += (
                f"| {r['arm']} | {r['protocol']} | {r['seed']} | {100 * r['valid']:.1f}% | {base} | {level} |\n"
            )
    return text


def plot_arms(arms: dict[str, Any], path: Path) -> None:
    """Each arm's own-protocol accuracy against training budget (mean over seeds; bars: the seeds' range)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    for i, (name, by_m) in enumerate(arms.items()):
        ms = sorted(int(m) for m in by_m)
        ys = [by_m[str(m)]["valid"] for m in ms]
        mean = np.asarray([np.mean(y) for y in ys])
        err = np.asarray([[mu - min(y), max(y) - mu] for mu, y in zip(mean, ys)]).T
        style = "-o" if name.startswith("fprm") else "--s"
        ax.errorbar(ms, mean, yerr=err, fmt=style, ms=4, capsize=3, color=f"C{i % 10}",
                    label=f"{LABELS.get(name, name)} (n={len(by_m[str(ms[0])]['seeds'])})")  # fmt: skip
    ax.set_xlabel("training budget (minutes of the head-to-head's clock = equal training FLOPs)")
    ax.set_ylabel("held-out valid accuracy, own protocol")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="upper left")
    ax.set_title("9x9 Sudoku head-to-head and its controls (1,000 held-out puzzles)", fontsize=9)
    save_figure(fig, path)


def ship(args: argparse.Namespace) -> None:
    """``--phase ship --seeds 0,1,2``: each seed's 60-minute ``fprm_authors`` checkpoint's EMA weights as a
    checkpoint of its own (weights, config, manifest; no optimiser state: 1.6 MB) in
    ``benchmarks/checkpoints/sudoku9_fprm_seed<N>/``, so ``python -m benchmarks --only inference`` runs from a
    clean clone (benchmarks/bench_inference.py)."""
    from loopformer.runs.checkpoint import save_checkpoint

    plan = probe(args, ["fprm_authors"])
    for seed in [s for s in seeds_of(args) if s is not None]:
        step = plan["budget_steps"]["fprm_authors"][-1]
        ckpt = run_dir(args.runs, "fprm_authors", seed) / "checkpoints" / f"step_{step:08d}"
        run = load_run(ckpt, use_ema=True)
        if run.weights != "ema":
            raise SystemExit(f"{ckpt} keeps no EMA weights")
        dest = REPO / "benchmarks" / "checkpoints" / f"sudoku9_fprm_seed{seed}"
        if dest.exists():
            raise SystemExit(f"{dest} exists: remove it to ship seed {seed} again")
        folder = save_checkpoint(dest / "checkpoints", step, run.model, run.config)
        print(f"seed {seed}: {ckpt} (EMA) -> {folder}", flush=True)


def _experiment(folder: Path, earlier: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's ``experiment.json`` (wall / CPU time); else ``earlier`` (the same record in an earlier
    ``results_h2h.json``, ``--earlier-summary``); else ``{"unfinished": True}``."""
    record = folder / "experiment.json"
    if record.is_file():
        return json.loads(record.read_text())
    return earlier if earlier else {"unfinished": True}


def evaluate(args: argparse.Namespace) -> None:
    """The first rerun's single runs (``<runs>/<model>``, our protocols): ``results.json`` / ``table.md``."""
    plan = probe(args, [n for n in LEGACY if n in (_only(args) or LEGACY)])
    cfg, eval_set, backtracks = held_out(args)
    only = [n for n in _only(args) if n in LEGACY]
    # rows of models not evaluated now (--only, or no run folder here) stay as the earlier eval wrote them
    earlier = args.out / "results.json"
    results: dict[str, Any] = json.loads(earlier.read_text())["results"] if earlier.is_file() else {}
    for name in only or LEGACY:
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
    results = {n: results[n] for n in LEGACY if n in results}
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
    print((args.out / "table.md").read_text())


def _train_times(run_dir: Path) -> dict[int, float]:
    """Training-loop seconds at each logged step (metrics.jsonl ``time``); {} before the run has logged one (a
    checkpoint scored with ``--watch`` can be written before the first record, e.g. with ``--quick``)."""
    out: dict[int, float] = {}
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "time" in rec and "step" in rec:
            out[int(rec["step"])] = float(rec["time"])
    return out


def markdown(payload: dict[str, Any]) -> str:
    """The first rerun's table (our protocols)."""
    return _table(payload["results"], compute=False)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=("probe", "train", "eval", "ship", "overlap", "all"), default="all")
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
        "--seeds",
        default="",
        help="comma-separated seeds of the head-to-head (runs in <runs>/seed<N>/<model>), e.g. 0,1,2; "
        "without it the first rerun's single runs (<runs>/<model>)",
    )
    parser.add_argument(
        "--measure-clock",
        action="store_true",
        help="--phase probe: time the reference FPRM's steps and print a new CLOCK instead of counting FLOPs",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for every model's config (repeatable), e.g. --set seed=1 --set data.train_seed=1",
    )
    parser.add_argument(
        "--train-seeds",
        type=lambda t: [int(m) for m in t.split(",")],
        default=[100, 101, 102],
        help="--phase overlap: the training-data seeds to check against the held-out set",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="--phase eval: where the head-to-head's checkpoints are scored (cpu, or cuda in float32, TF32 off)",
    )
    parser.add_argument(
        "--watch",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="--phase eval with --seeds: keep scoring checkpoints as training writes them, until every one of "
        "--minutes is scored or SECONDS have passed",
    )
    parser.add_argument(
        "--earlier-summary",
        type=Path,
        default=None,
        metavar="JSON",
        help="--phase eval with --seeds: an earlier results_h2h.json whose per-seed numbers stand in for seeds "
        "with no saved rows under --runs (docs/figures/sudoku9/results_h2h_seeds01.json: seeds 0-1, whose run "
        "folders were lost); they count in means, ranges and the sign test, not in the per-puzzle bootstrap",
    )
    parser.add_argument("--runs", type=Path, default=REPO / "runs" / "sudoku9")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "figures" / "sudoku9")
    args = parser.parse_args()
    only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(only) - set(MODELS))
    if unknown:
        parser.error(f"--only: unknown model(s) {', '.join(unknown)} (known: {', '.join(MODELS)})")
    if args.phase in ("probe", "all"):
        measure_clock(args) if args.measure_clock else probe(args, only or None)
    if args.phase in ("train", "all"):
        for seed in seeds_of(args):
            for name in only or MODELS:
                train_one(args, name, seed)
    if args.phase in ("eval", "all"):
        evaluate_h2h(args) if args.seeds else evaluate(args)
    if args.phase == "ship":
        ship(args)
    if args.phase == "overlap":
        overlap(args)


if __name__ == "__main__":
    main()
