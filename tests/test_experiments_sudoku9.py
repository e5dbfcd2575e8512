"""The 9x9 head-to-head's evaluation (experiments/sudoku9_h2h.py, issue 32).

The single pass must give what separate evaluations give: the FPRM protocol (batch-wide halting, capped) equals
a direct call of the model under its ``loop_eval``, each matched-compute point equals a per-sample-halting call
capped at that budget, and TRM's protocol (48 cycles) equals a direct call; the seeds of the head-to-head never
train on the held-out puzzles; the paired bootstrap on a known difference. The models are tiny and untrained
(one training step), which is enough: the oracle is the model's own forward, not its accuracy.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "experiments"))

import sudoku9_cpu  # noqa: E402
import sudoku9_h2h as h2h  # noqa: E402

from loopformer.eval.evaluate import batch_tensors, iter_batches  # noqa: E402
from loopformer.runs import load_run  # noqa: E402
from loopformer.tasks.sudoku import SudokuTask  # noqa: E402
from loopformer.train import Trainer  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One-step FPRM and TRM of the head-to-head builds (quick sizes) -> their checkpoint folders."""
    runs = tmp_path_factory.mktemp("h2h")
    cfgs = sudoku9_cpu.configs(runs, True, ["train.steps=1", "train.checkpoint_every=1"], seed=0)
    out = {}
    for name in ("fprm_authors", "trm_authors"):
        torch.set_num_threads(1)
        Trainer(cfgs[name]).fit()
        out[name] = Path(cfgs[name].out_dir)
    return out


def _direct(run, data, loop) -> tuple[np.ndarray, np.ndarray]:
    gen = torch.Generator().manual_seed(0)
    preds, steps = [], []
    with torch.no_grad():
        for index in iter_batches(data, h2h.BATCH):
            x, _, pid = batch_tensors(data, index, "cpu")
            out = run.model(x, loop=loop, puzzle_ids=pid, generator=gen)
            preds.append(out.logits.argmax(-1).numpy())
            steps.append(out.loop.steps.numpy())
    return np.concatenate(preds), np.concatenate(steps)


def test_fprm_single_pass_equals_separate_evaluations(checkpoints, monkeypatch) -> None:
    monkeypatch.setattr(h2h, "FPRM_TRACE", 24)
    monkeypatch.setattr(h2h, "BATCH", 7)  # several batches: the batch-wide rule and the generator run on
    run = load_run(checkpoints["fprm_authors"], use_ema=True)
    run.loop_eval = dataclasses.replace(run.loop_eval, max_steps=10)  # the protocol's cap, below the trace
    data = SudokuTask(9).generate(20, seed=1, min_blanks=20, max_blanks=60)
    tr = h2h.trace_fprm(run, data)
    pred, steps = _direct(run, data, run.loop_eval)
    assert (tr["protocol"] == pred).all() and (tr["protocol_steps"] == steps).all()
    for blocks in (8, 16, 32):  # per-sample halting capped at blocks / 2 steps (within the trace)
        cap = h2h.budget_steps(run.model.blocks_per_step(), blocks)
        # the residual that halts a sample, the damped solver's per-sample state: as the protocol's loop
        per_sample = dataclasses.replace(run.loop_eval, halting="residual", max_steps=cap)
        ref, ref_steps = _direct(run, data, per_sample)
        # a sample that ran to the cap, or halted on its residual, is scored identically; one whose step size
        # ran out first (the damped solver's other halting test) is read at the cap instead: a documented
        # approximation, so it is only required to have run at least as long
        ran = tr["capped_steps"][cap]
        exact = ran == ref_steps
        assert (tr["capped"][cap][exact] == ref[exact]).all()
        assert (ran >= ref_steps).all() and exact.mean() >= 0.5


def test_trm_single_pass_equals_a_direct_call_of_its_protocol(checkpoints) -> None:
    run = load_run(checkpoints["trm_authors"], use_ema=True)
    data = SudokuTask(9).generate(9, seed=1, min_blanks=20, max_blanks=60)
    tr = h2h.trace_trm(run, data)
    cycles = tr["protocol_cycles"]
    pred, _ = _direct(run, data, dataclasses.replace(run.loop_eval, halting="fixed", max_steps=cycles))
    assert (tr["cycles"][cycles] == pred).all()
    pred2, _ = _direct(run, data, dataclasses.replace(run.loop_eval, halting="fixed", max_steps=2))
    assert (tr["cycles"][2] == pred2).all()  # 28 blocks: 2 cycles of 14


def test_budget_steps_and_blocks() -> None:
    from loopformer.models import build_model

    fprm = build_model("fprm", vocab_size=11, seq_len=81, n_layers=2)
    trm = build_model("trm", vocab_size=11, seq_len=81, n_layers=2, n_inner=6)
    hrm = build_model("hrm", vocab_size=11, seq_len=81, n_layers=1, l_layers=1, l_cycles=2)
    assert (fprm.blocks_per_step(), trm.blocks_per_step(), hrm.blocks_per_step()) == (2, 14, 3)
    assert [h2h.budget_steps(2, b) for b in (8, 2048)] == [4, 1024]
    assert [h2h.budget_steps(14, b) for b in (8, 16, 2048)] == [0, 1, 146]  # a TRM cycle is 14 blocks


def test_paired_bootstrap_on_a_known_difference() -> None:
    a = np.array([1.0] * 60 + [0.0] * 40)
    b = np.array([1.0] * 50 + [0.0] * 50)
    same = h2h.paired_bootstrap(a, a)
    assert same["mean"] == same["low"] == same["high"] == 0.0 and same["p_le_0"] == 1.0
    t = h2h.paired_bootstrap(a, b, draws=4000)
    assert t["mean"] == pytest.approx(0.10)
    assert 0.03 < t["low"] < 0.10 < t["high"] < 0.17  # the 10 differing puzzles of 100: +-6 points
    assert t["p_le_0"] < 0.01


def test_sign_test_and_seed_t_test_closed_forms() -> None:
    assert h2h.sign_test(4, 4) == 1 / 16 and h2h.sign_test(3, 4) == 5 / 16 and h2h.sign_test(0, 3) == 1.0
    assert h2h.seed_t_test([0.2]) is None and h2h.seed_t_test([0.1, 0.1]) is None
    # d = (1, 2, 3): mean 2, sd 1, t = 2 / (1 / sqrt 3) = 3.464 on 2 degrees of freedom: p = 0.0742
    assert h2h.seed_t_test([1.0, 2.0, 3.0]) == pytest.approx(0.0742, abs=1e-4)


def _row(seed: int, valid: float, bits: str, curve_valid: float) -> dict:
    protocol = {"valid": valid, "valid_30plus": valid / 2, "needs_search": 0.0, "converged": None,
                "mean_blocks": 672.0, "valid_bits": bits}  # fmt: skip
    return {"model": "m", "seed": seed, "step": 402, "parameters": 10, "protocol": protocol,
            "curve": [{"budget_blocks": 16, "valid": curve_valid, "valid_bits": bits}],
            "extreme": [{"valid": True}, {"valid": False}]}  # fmt: skip


def test_rows_rebuilt_from_a_summary_give_the_same_summary_but_no_bootstrap() -> None:
    rows = {
        "fprm": {15: {0: _row(0, 0.75, "1110", 0.5), 1: _row(1, 0.5, "1100", 0.25)}},
        "trm": {15: {0: _row(0, 0.25, "1000", 0.25), 1: _row(1, 0.5, "0110", 0.5)}},
    }
    full = h2h.summarise(rows, "fprm", "trm")
    assert full["15"]["bootstrap_seeds"] == [0, 1] and full["15"]["seed_pairs_fprm_ahead"] == "1 of 2"
    assert full["15"]["seed_differences"] == {"0": 0.5, "1": 0.0}
    rebuilt = h2h.rows_from_summary(full)
    assert all(r["from_summary"] and not h2h.has_bits(r) for m in rebuilt.values() for r in m[15].values())
    again = h2h.summarise(rebuilt, "fprm", "trm")
    for name in ("fprm", "trm"):  # every seed-level number survives the round trip
        for key in ("seeds", "valid", "valid_30plus", "mean_blocks", "extreme_valid", "curve", "step"):
            assert again["15"]["models"][name][key] == full["15"]["models"][name][key], (name, key)
    assert again["15"]["seed_differences"] == full["15"]["seed_differences"]
    assert again["15"]["bootstrap_seeds"] == [] and again["15"]["fprm_minus_trm"] == {}  # no bits, no bootstrap
    mixed = {n: {15: {1: rows[n][15][1], 0: rebuilt[n][15][0]}} for n in rows}  # loaded out of seed order
    again = h2h.summarise(mixed, "fprm", "trm")
    assert again["15"]["bootstrap_seeds"] == [1]
    assert again["15"]["models"]["fprm"]["valid"] == full["15"]["models"]["fprm"]["valid"]  # in "seeds" order


def test_seeds_never_train_on_the_held_out_puzzles(tmp_path: Path) -> None:
    assert [o for s in (0, 1, 2) for o in sudoku9_cpu.seed_overrides(s)] == [
        "seed=0", "data.train_seed=100", "seed=1", "data.train_seed=101", "seed=2", "data.train_seed=102",
    ]  # fmt: skip
    cfg = sudoku9_cpu.configs(tmp_path, True, seed=1)["fprm_authors"]
    assert cfg.data.train_seed != cfg.data.eval_seed
    # the trap the seeds avoid: one seed, one generator, the held-out rows are the training set's first rows
    task = SudokuTask(9)
    held = task.generate(12, seed=cfg.data.eval_seed, min_blanks=20, max_blanks=60)
    same_seed = task.generate(30, seed=cfg.data.eval_seed, min_blanks=20, max_blanks=60)
    assert (same_seed.inputs[:12] == held.inputs).all()
    train = task.generate(30, seed=cfg.data.train_seed, min_blanks=20, max_blanks=60)
    assert not ({r.tobytes() for r in train.inputs} & {r.tobytes() for r in held.inputs})


def test_a_variant_is_compared_on_its_own_seeds_only() -> None:
    """A variant run on seed 0 only (as the contraction term first was): FPRM's seed 1 must not enter that comparison
    (its means or its pairs), and the tables name the pair compared."""
    rows = {
        "jac": {15: {0: _row(0, 0.25, "1000", 0.25)}},
        "fprm": {15: {0: _row(0, 0.75, "1110", 0.5), 1: _row(1, 0.5, "1100", 0.25)}, 30: {1: _row(1, 1.0, "1111", 1)}},
    }
    both = h2h.with_partner_seeds(rows, "jac", "fprm")
    assert both["fprm"] == {15: {0: rows["fprm"][15][0]}}  # no 30-minute budget: the variant has none
    out = h2h.summarise(both, "jac", "fprm")
    assert list(out) == ["15"]
    assert out["15"]["models"]["fprm"]["seeds"] == [0] and out["15"]["models"]["fprm"]["valid"] == [0.75]
    assert out["15"]["seed_pairs_fprm_ahead"] == "0 of 1" and out["15"]["seed_differences"] == {"0": -0.5}
    text = h2h.markdown(out, {"jac": "FPRM + contraction term", "fprm": "FPRM"}, ("FPRM + contraction", "FPRM"))
    assert "| FPRM + contraction - FPRM |" in text and "with FPRM + contraction ahead" in text
    assert "TRM" not in text


def test_the_gpu_seeds_script_trains_and_scores_the_models_it_is_given(tmp_path: Path) -> None:
    """experiments/sudoku9_gpu_seeds.sh as a CPU dry run (DEVICE=cpu QUICK=1, this checkout as the pinned code):
    MODELS=fprm_authors_jac trains that model alone for the seed and scores its three checkpoints."""
    import os
    import subprocess

    runs = tmp_path / "runs"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    probe = [sys.executable, "experiments/sudoku9_cpu.py", "--phase", "probe", "--quick", "--runs", str(runs)]
    subprocess.run(probe, cwd=REPO, env=env, check=True, capture_output=True, timeout=300)
    env.update(DEVICE="cpu", QUICK="1", MODELS="fprm_authors_jac", PINNED=str(REPO), PYTHON=sys.executable)
    done = subprocess.run(["bash", "experiments/sudoku9_gpu_seeds.sh", "5", str(runs)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert sorted(p.name for p in (runs / "seed5").iterdir() if p.is_dir()) == ["fprm_authors_jac"]
    rows = sorted(p.name for p in (runs / "seed5" / "fprm_authors_jac").glob("eval-h2h-*min.json"))
    assert rows == ["eval-h2h-15min.json", "eval-h2h-30min.json", "eval-h2h-60min.json"]


def test_the_gap_by_blanks_adds_up_to_the_whole_gap() -> None:
    """issue 46's confound check: the bins' shares of a pair's gap are their accuracy differences weighted by their
    share of the puzzles, so over all bins they add up to 1 (the whole gap), and the >= 30 / >= 40 columns are the
    sums of the bins above; worked by hand on four puzzles, one per bin."""
    blanks = np.array([25, 35, 45, 55])
    per_bin_a = {"20-29": 1.0, "30-39": 1.0, "40-49": 1.0, "50-60": 0.0}  # 3 of 4 puzzles solved
    per_bin_b = {"20-29": 1.0, "30-39": 0.0, "40-49": 0.0, "50-60": 0.0}  # 1 of 4
    a = {2: {"protocol": {"valid": 0.75, "by_blanks": per_bin_a}}}
    b = {2: {"protocol": {"valid": 0.25, "by_blanks": per_bin_b}}}
    gap = h2h.by_blanks_gap(a, b, blanks)
    assert gap["gap"] == pytest.approx(0.5)
    shares = {k: v["share_of_gap"] for k, v in gap["bins"].items()}
    assert shares == pytest.approx({"20-29": 0.0, "30-39": 0.5, "40-49": 0.5, "50-60": 0.0})
    assert sudoku9_cpu.gap_share(gap, 30) == "100%" and sudoku9_cpu.gap_share(gap, 40) == "50%"
    assert sudoku9_cpu.gap_share({}, 40) == "-"
