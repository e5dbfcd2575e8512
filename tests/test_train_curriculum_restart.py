"""``data.curriculum.restart_optimizer``: a fresh optimiser and learning-rate schedule at every
curriculum level-up, as OSU-NLP-Group/Loop-Think-Generalize ``train_extrapolation.py`` builds a new
AdamW and a new ``get_linear_schedule_with_warmup`` in ``train_model`` for every stage."""

from __future__ import annotations

import json

import pytest
import torch
from test_train_utils import TinyLooped, tiny_config, tiny_dataset

from loopformer.train import Trainer

LR, WARMUP, BETAS = 0.01, 4, (0.9, 0.95)
# threshold 0: the curriculum advances at every check (after steps 3, 6, 9: levels 2, 3, 4)
CURRICULUM = (
    "data.curriculum.enabled=true",
    "data.curriculum.start=1",
    "data.curriculum.max_level=4",
    "data.curriculum.threshold=0.0",
    "data.curriculum.check_every=3",
    f"train.warmup_steps={WARMUP}",
    f"train.lr={LR}",
    "train.betas=[0.9, 0.95]",
    "train.steps=10",
)


def _trainer(tmp_path, *overrides: str, seed: int = 0) -> Trainer:
    cfg = tiny_config(tmp_path, "train.mode=simple", *CURRICULUM, *overrides)
    return Trainer(cfg, model=TinyLooped(seed=seed), train_data=tiny_dataset(64), eval_data=None)


def _run(tr: Trainer, until: int | None = None) -> list[dict]:
    """Train to the end (or raise KeyboardInterrupt at step ``until``), recording each step's learning
    rate and, after every step, the optimiser's state and gradients of the model's parameters."""
    records: list[dict] = []
    original = tr.train_step

    def recording() -> dict:
        if tr.step == until:
            raise KeyboardInterrupt("simulated kill")
        metrics = original()
        params = [p for p in tr.model.parameters() if p.grad is not None]
        records.append({
            "lr": metrics["lr"],
            "level": tr.curriculum.level,
            "state": [{k: v.clone() for k, v in tr.optimizer.state[p].items()} for p in params],
            "grad": [p.grad.clone() for p in params],
        })  # fmt: skip
        return metrics

    tr.train_step = recording
    tr.fit()
    return records


def test_a_level_up_restarts_the_optimiser_state_and_the_warm_up(tmp_path) -> None:
    records = _run(_trainer(tmp_path, "data.curriculum.restart_optimizer=true"))
    # the level each step trained at: it rose after 3, 6 and 9 steps
    assert [r["level"] for r in records] == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4]
    # warm-up lr (t + 1) / WARMUP from every stage's first step (hand computation)
    expected = [LR * (t + 1) / WARMUP for t in (0, 1, 2, 0, 1, 2, 0, 1, 2, 0)]
    assert [r["lr"] for r in records] == pytest.approx(expected, rel=1e-12)
    for step in (0, 3, 6, 9):  # a stage's first step: AdamW from zero moments (closed form)
        for state, grad in zip(records[step]["state"], records[step]["grad"]):
            assert float(state["step"]) == 1.0
            torch.testing.assert_close(state["exp_avg"], (1 - BETAS[0]) * grad, rtol=1e-6, atol=1e-9)
            torch.testing.assert_close(state["exp_avg_sq"], (1 - BETAS[1]) * grad**2, rtol=1e-6, atol=1e-12)
    assert [float(s["step"]) for s in (records[5]["state"][0], records[7]["state"][0])] == [3.0, 2.0]


def test_without_the_option_one_optimiser_and_schedule_span_the_stages(tmp_path) -> None:
    records = _run(_trainer(tmp_path))
    assert [r["level"] for r in records] == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4]
    assert [r["lr"] for r in records] == pytest.approx([LR * 0.25, LR * 0.5, LR * 0.75] + [LR] * 7, rel=1e-12)
    state, grad = records[3]["state"][0], records[3]["grad"][0]
    assert float(state["step"]) == 4.0
    assert (state["exp_avg"] - (1 - BETAS[0]) * grad).abs().max() > 1e-6


@pytest.mark.parametrize("checkpoint_every", [3, 4], ids=["at_a_level_up", "inside_a_stage"])
def test_resume_with_restarts_is_bit_exact(tmp_path, checkpoint_every: int) -> None:
    common = ("data.curriculum.restart_optimizer=true", f"train.checkpoint_every={checkpoint_every}")
    full = _trainer(tmp_path / "full", *common)
    full_records = _run(full)
    with pytest.raises(KeyboardInterrupt):
        _run(_trainer(tmp_path / "killed", *common), until=checkpoint_every + 1)
    resumed = _trainer(tmp_path / "killed", *common, "train.resume=true", seed=123)
    assert resumed.step == checkpoint_every and resumed.curriculum.stage_start == 3
    records = _run(resumed)
    assert [r["lr"] for r in records] == [r["lr"] for r in full_records[checkpoint_every:]]
    for (name, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name
    for a, b in zip(full_records[-1]["state"], records[-1]["state"]):
        assert all(torch.equal(a[k], b[k]) for k in a)
    logged = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [m["lr"] for m in logged if "lr" in m] == [r["lr"] for r in full_records]
