"""The checkpoints shipped for the inference benchmark (benchmarks/checkpoints/sudoku9_fprm_seed<N>, issue 32).

Each must be what the head-to-head scored: the manifest verifies (``load_run``), it is FPRM seed N's EMA weights
at the 60-minute step of the committed probe, with the committed parameter count, the benchmark finds it in a
clean clone, and it gives the committed matched-compute points at 8 and 16 blocks per puzzle on all 1,000
held-out puzzles (docs/figures/sudoku9/results_h2h.json, written from the run folders' own checkpoints) within
2 points. Seed 0 not exactly: it was scored with loopformer at cc22f56, and since issue 33 FPRM's random
initial iterate is drawn by inverse CDF (same law, other draws), which moves a few puzzles at small budgets
(this code: 45.5% / 62.8% against the recorded 44.4% / 62.6%); seeds 2 and 3 were scored with this code. Seed 0's
30-minute checkpoint scores 39.0% / 53.7%, so a wrong checkpoint fails.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SEEDS = (0, 2, 3)  # seed 1's run folder was lost before its checkpoint was shipped
RESULTS = json.loads((REPO / "docs" / "figures" / "sudoku9" / "results_h2h.json").read_text())
sys.path.insert(0, str(REPO / "experiments"))

import sudoku9_h2h as h2h  # noqa: E402

from benchmarks import bench_inference  # noqa: E402
from loopformer.runs import load_run  # noqa: E402
from loopformer.tasks.sudoku import SudokuTask  # noqa: E402


def _folder(seed: int | str) -> Path:
    """Seed ``seed``'s shipped checkpoint folder, where the benchmark looks for it (``"*"``: a glob pattern)."""
    return REPO / bench_inference.SUDOKU9_SHIPPED.format(seed=seed)


SHIPPED = _folder(0)


def _committed(minutes: str, model: str) -> dict:
    return RESULTS["summary"][minutes]["models"][model]


def test_the_benchmark_reads_the_shipped_checkpoint_without_a_run_folder(monkeypatch, tmp_path) -> None:
    fake = tmp_path / "benchmarks" / "bench_inference.py"  # a clone without runs/: only the shipped folder
    (tmp_path / "benchmarks" / "checkpoints").mkdir(parents=True)
    (tmp_path / "benchmarks" / "checkpoints" / "sudoku9_fprm_seed0").symlink_to(SHIPPED)
    monkeypatch.setattr(bench_inference, "__file__", str(fake))
    folder, what = bench_inference.sudoku9_checkpoint(0)
    assert folder == tmp_path / "benchmarks" / "checkpoints" / "sudoku9_fprm_seed0" and "shipped" in what
    folder, what = bench_inference.sudoku9_checkpoint(1)
    assert folder is None and "--seeds 1" in what  # no checkpoint: the row names the training command


@pytest.fixture(scope="module")
def held_out():
    return SudokuTask(9).generate(RESULTS["eval_set"]["n"], seed=RESULTS["eval_set"]["seed"], min_blanks=20,
                                  max_blanks=60)  # fmt: skip


def _shipped(seed: int):
    torch.set_num_threads(1)
    return load_run(_folder(seed), use_ema=True)  # verifies the manifest's hashes before reading anything


def test_the_benchmark_covers_every_shipped_seed() -> None:
    assert bench_inference.SUDOKU9_SEEDS == SEEDS
    assert sorted(REPO.glob(str(_folder("*").relative_to(REPO)))) == sorted(_folder(s) for s in SEEDS)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_shipped_checkpoint_is_its_seed_at_its_60_minute_step(seed: int) -> None:
    shipped = _shipped(seed)
    assert shipped.step == RESULTS["probe"]["budget_steps"]["fprm_authors"][-1] == 3016
    assert shipped.config.model.name == "fprm" and shipped.config.seed == seed
    assert shipped.config.data.train_seed == 100 + seed  # seed N trains on 100 + N
    assert shipped.config.data.eval_seed == RESULTS["eval_set"]["seed"]
    assert shipped.model.num_parameters() == _committed("60", "fprm_authors")["parameters"] == 398_465


@pytest.mark.parametrize("seed", SEEDS)
def test_the_shipped_weights_reproduce_the_committed_8_and_16_block_points(seed: int, held_out, monkeypatch) -> None:
    """Per-sample fixed-point halting capped at 4 and 8 steps (8 and 16 blocks), the head-to-head's own pass
    (``sudoku9_h2h.trace_fprm``) cut at 8 steps, over the 1,000 held-out puzzles."""
    shipped = _shipped(seed)
    monkeypatch.setattr(h2h, "FPRM_TRACE", 8)
    short = dataclasses.replace(shipped, loop_eval=dataclasses.replace(shipped.loop_eval, max_steps=8))
    trace = h2h.trace_fprm(short, held_out)
    committed = _committed("60", "fprm_authors")
    at = committed["seeds"].index(seed)
    for blocks in (8, 16):
        steps = h2h.budget_steps(shipped.model.blocks_per_step(), blocks)
        valid = np.asarray([shipped.task.check(x, y) for x, y in zip(held_out.inputs, trace["capped"][steps])])
        assert float(valid.mean()) == pytest.approx(committed["curve"][str(blocks)][at], abs=0.02), blocks
