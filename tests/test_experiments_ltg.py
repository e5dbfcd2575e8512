"""LTG / state-tracking experiment scripts: helper oracles (fast) and --quick dry runs (slow)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from loopformer.tasks.kg import KGDepthTask

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"


def load(name: str):
    path = EXPERIMENTS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"exp_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kg_path_count_matches_brute_force() -> None:
    common = load("ltg_common")
    task = KGDepthTask(num_entities=5, num_relations=3, max_hops=4, seed=1, test_fraction=0.3)
    for k in (2, 3):
        heads, rels = [], []
        for h in range(5):
            for combo in np.ndindex(*(3,) * k):
                heads.append(h)
                rels.append(combo)
        test = task.is_test_path(np.array(heads), np.array(rels))
        assert common.kg_path_count(task, k, "test") == int(test.sum())
        assert common.kg_path_count(task, k, "train") == int((~test).sum())
        assert int(test.sum()) + int((~test).sum()) == 5 * 3**k


def test_kg_training_set_holds_all_atomic_facts_and_no_test_path() -> None:
    common = load("ltg_common")
    task = KGDepthTask(num_entities=6, num_relations=2, max_hops=5, seed=0, test_fraction=0.25)
    train = common.kg_training_set(task, 3, paths_per_hop=1000, seed=0, width=6)
    counts = {k: int((train.difficulty == k).sum()) for k in (1, 2, 3)}
    assert counts == {
        1: 12,
        2: common.kg_path_count(task, 2, "train"),
        3: common.kg_path_count(task, 3, "train"),
    }
    for row, label in zip(train.inputs, train.labels):
        head, rels = task.parse(row)
        if len(rels) >= 2:
            assert not task.is_test_path(np.array([head]), np.array([rels]))[0]
        assert label[len(rels)] == task.follow(head, rels)[-1]  # the label is the followed tail
    tests = common.kg_test_sets(task, (2, 4), n=10, seed=3)
    assert tests[2].inputs.shape[1] == 3 and tests[4].inputs.shape[1] == 5  # unpadded
    for ds in tests.values():
        heads = ds.inputs[:, 0]
        rels = ds.inputs[:, 1:] - task.num_entities
        assert task.is_test_path(heads, rels).all()


def test_equal_accuracy_budget_and_overall() -> None:
    halting = load("ltg_halting")
    fixed = [0.1, 0.5, 0.9, 0.95, 0.94]
    assert halting.equal_accuracy_budget(fixed, 0.93, slack=0.01) == 4
    assert halting.equal_accuracy_budget(fixed, 0.905, slack=0.01) == 3
    assert halting.equal_accuracy_budget(fixed, 0.99, slack=0.01) is None
    per_hop = {
        2: {"n": 100, "fixed_accuracy": [0.5, 1.0], "kl_entropy": {"accuracy": 1.0, "mean_loops": 1.5}},
        3: {"n": 300, "fixed_accuracy": [0.0, 0.6], "kl_entropy": {"accuracy": 0.6, "mean_loops": 2.0}},
    }
    out = halting.overall(per_hop, cap=2)
    assert out["fixed_accuracy"] == pytest.approx([0.125, 0.7])
    assert out["kl_entropy"]["accuracy"] == pytest.approx(0.7)
    assert out["kl_entropy"]["mean_loops"] == pytest.approx(1.875)
    assert out["kl_entropy"]["R_equal_accuracy"] == 2
    assert out["kl_entropy"]["saving_vs_cap"] == pytest.approx(1 - 1.875 / 2)


def test_overthinking_summary() -> None:
    ot = load("ltg_overthinking")
    s = ot.summarize([1, 2, 3, 4], [0.2, 0.9, 0.7, 0.5], [0.1, 2.0, 3.0, -1.0])
    assert (s["best_R"], s["peak_margin_R"], s["final_R"]) == (2, 3, 4)
    assert s["accuracy_drop"] == pytest.approx(0.4)
    assert s["margin_drop"] == pytest.approx(4.0)


def test_state_tracking_prefix_accuracy_with_an_oracle_model() -> None:
    """A stand-in model that predicts the true running products except at one position: the prefix
    accuracy must be 1 before that position and 0 from it on."""
    import torch

    from loopformer.tasks.groups import GroupTask

    st = load("state_tracking")
    task = GroupTask("S3", length=8)
    data = task.generate(5, seed=0)

    class Oracle(torch.nn.Module):
        def forward(self, inputs, loop=None, generator=None):
            labels = task.running_products(inputs.numpy() - 1) + 1
            labels[:, 5] = labels[:, 5] % task.order + 1  # a wrong element at position 5
            logits = torch.nn.functional.one_hot(torch.as_tensor(labels), task.vocab_size).float()
            return type("Out", (), {"logits": logits, "loop": None})()

    res = st.prefix_accuracy(Oracle(), task, data, loop=None, batch_size=2)
    assert res["prefix_accuracy"] == [1.0] * 5 + [0.0] * 3


SCRIPTS = ["ltg_depth", "ltg_overthinking", "ltg_halting", "state_tracking", "ltg_grokking"]


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_script_quick_dry_run(script: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXPERIMENTS / f"{script}.py"), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = "state_tracking" if script == "state_tracking" else script
    out = ROOT / "runs" / "ltg_quick" / "figures" / name
    data = json.loads((out / f"{name}.json").read_text())
    assert data["quick"] is True
    assert (out / f"{name}.png").stat().st_size > 1000


def test_config_key_ignores_out_dir_and_tells_recipes_apart() -> None:
    common = load("ltg_common")
    key = common.config_key("ltg_kg_poisson", [])
    assert key == common.config_key("ltg_kg_poisson", ["out_dir=elsewhere"])
    assert key != common.config_key("ltg_kg_fixed", [])
    assert key != common.config_key("ltg_kg_poisson", ["train.steps=10"])
