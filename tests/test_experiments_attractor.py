"""Tests of the Attractor / LM experiment scripts (experiments/attractor_internalization.py, lm_compare.py).

Fast: the measurement helpers against oracles (the DEQ ablation's gap at y0 = 0 is exactly 1; FLOPs
of a fixed-iteration Attractor step are affine in the iteration count, which lm_compare's a + b n
FLOP model relies on; saved-for-backward bytes grow linearly in the loops for BPTT and stay constant
for the implicit gradients). Slow: each script end to end with --quick (a dry run).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from loopformer.loop import LoopConfig
from loopformer.models.attractor import Attractor, AttractorConfig
from loopformer.models.recurrent import RecurrentConfig, RecurrentDepth

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def lm():
    return _script("lm_compare")


@pytest.fixture(scope="module")
def internalization():
    return _script("attractor_internalization")


def _attractor(proposal: bool = True, causal: bool = True) -> Attractor:
    torch.manual_seed(0)
    return Attractor(AttractorConfig(vocab_size=11, seq_len=8, d_model=16, n_heads=2, n_backbone=1, n_layers=1,
                                     causal=causal, proposal=proposal))


def test_probe_gap_is_one_for_the_deq_ablation_and_below_one_with_a_proposal(internalization) -> None:
    from loopformer.tasks.base import TokenDataset

    x = torch.randint(1, 11, (4, 8))
    probe = TokenDataset(x.numpy(), x.numpy(), torch.zeros(4).numpy())
    loop = LoopConfig(solver="anderson", halting="residual", tol=1e-3, min_steps=1, max_steps=30)
    deq = internalization.probe_metrics(_attractor(proposal=False, causal=False), probe, loop)
    assert deq["gap"] == pytest.approx(1.0, abs=1e-6)  # ||f(0) - 0|| / ||f(0)||
    assert deq["dist"] == pytest.approx(1.0, abs=1e-6)  # ||y* - 0|| / ||y*||
    att = internalization.probe_metrics(_attractor(proposal=True, causal=False), probe, loop)
    assert 0.0 < att["gap"] < 1.0
    assert 1 <= att["iters_probe"] <= 30


def test_attractor_step_flops_are_affine_in_iterations(lm) -> None:
    model = _attractor()
    x = torch.randint(0, 11, (2, 8))
    base = LoopConfig(solver="anderson", plugins={"anderson": {"m": 5}}, halting="residual", min_steps=1, max_steps=12,
                      grad="neumann", grad_steps=1)
    f = {n: lm.step_flops(model, x, x, lm.fixed_loop(base, n), "ce") for n in (1, 2, 6, 7, 8, 10)}
    per_iter = f[7] - f[6]
    assert per_iter > 0
    assert f[8] - f[7] == per_iter  # once Anderson's history is full (n > m), every iteration costs the same
    assert f[10] - f[6] == 4 * per_iter
    assert f[2] - f[1] < per_iter  # before that, the mixing (Gram matrix) is cheaper: lm_compare measures at n >= m


def test_saved_bytes_linear_for_bptt_constant_for_implicit_gradients(lm) -> None:
    torch.manual_seed(0)
    parcae = RecurrentDepth(RecurrentConfig(vocab_size=11, seq_len=8, d_model=16, n_heads=2, n_layers=1,
                                            causal=True, injection="parcae"))
    x = torch.randint(0, 11, (2, 8))
    bptt = LoopConfig(halting="fixed", max_steps=2, grad="bptt")
    m = {n: lm.saved_tensor_bytes(parcae, x, dataclasses.replace(bptt, max_steps=n)) for n in (2, 4, 8)}
    assert m[4] - m[2] > 0
    assert m[8] - m[4] == 2 * (m[4] - m[2])  # every loop saves the same activations
    trunc = {n: lm.saved_tensor_bytes(parcae, x, dataclasses.replace(bptt, max_steps=n, grad="truncated"))
             for n in (2, 8)}
    assert trunc[2] == trunc[8] < m[2]
    model = _attractor()
    base = LoopConfig(solver="anderson", halting="fixed", max_steps=2, grad="neumann", grad_steps=1)
    for grad in ("neumann", "onestep", "ift"):
        sizes = {n: lm.saved_tensor_bytes(model, x, lm.fixed_loop(base, n, grad)) for n in (2, 16)}
        assert sizes[2] == sizes[16] > 0, grad


@pytest.mark.slow
def test_attractor_internalization_quick(internalization, tmp_path: Path) -> None:
    res = internalization.main(["--quick", "--out", str(tmp_path / "fig"), "--runs", str(tmp_path / "runs")])
    saved = json.loads((tmp_path / "fig" / "attractor_internalization.json").read_text())
    assert set(saved["runs"]) == {"attractor", "deq"}
    for run in saved["runs"].values():
        assert run["history"] and all("gap" in h and "loop_steps" in h for h in run["history"])
        assert [r["iterations"] for r in run["inference"]] == [0, 1, 2, 4, 8, "full"]
    assert all(h["gap"] == pytest.approx(1.0, abs=1e-5) for h in saved["runs"]["deq"]["history"])
    assert all("windows" in run for run in saved["runs"].values())
    assert res["plots"] and all((tmp_path / "fig" / p).is_file() for p in res["plots"])


@pytest.mark.slow
def test_lm_compare_quick(lm, tmp_path: Path) -> None:
    lm.main(["--quick", "--out", str(tmp_path / "fig"), "--runs", str(tmp_path / "runs")])
    saved = json.loads((tmp_path / "fig" / "lm_compare.json").read_text())
    runs = saved["runs"]
    assert set(runs) == {"transformer", "parcae", "attractor"}
    for r in runs.values():
        assert 0 < r["val_bpb"] < 9 and r["train_flops"] > 0
    bptt = runs["parcae"]["saved_bytes"]["bptt"]
    assert bptt["16"] > bptt["8"] > bptt["4"] > bptt["2"]
    ift = runs["attractor"]["saved_bytes"]["ift"]
    assert len(set(ift.values())) == 1
    assert all((tmp_path / "fig" / p).is_file() for p in saved["plots"])
