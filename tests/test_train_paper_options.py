"""The TRM / HRM training options through the real trainer: AdamATan2, sign-SGD on the puzzle table,
weight decay on every parameter, HRM's Q-learning loss (q_halt + bootstrapped q_continue)."""

from __future__ import annotations

import math

import torch
from test_train_utils import tiny_config, tiny_dataset

from loopformer.train import Trainer

PAPER = (
    "train.mode=deep_supervision",
    "train.max_segments=2",
    "train.halt_on_q=true",
    "train.optimizer=adam_atan2",
    "train.decay_all=true",
    "train.puzzle_emb_optimizer=sign_sgd",
    "train.puzzle_emb_lr=0.01",
    "train.grad_clip=0",
    "model.num_puzzle_ids=1",
    "model.puzzle_emb_len=2",
    "model.puzzle_emb_dim=16",
    "model.d_model=16",
    "model.n_heads=2",
    "model.n_layers=1",
    "model.vocab_size=8",
    "train.steps=3",
)


def test_hrm_q_learning_and_paper_optimisers_train(tmp_path) -> None:
    cfg = tiny_config(tmp_path, "model.name=hrm", "train.q_learning=true", *PAPER)
    tr = Trainer(cfg, train_data=tiny_dataset(32), eval_data=tiny_dataset(8, seed=1))
    emb0 = tr.model.embedding.puzzle_emb.weight.detach().clone()
    m = tr.fit()["train"]
    assert math.isfinite(m["loss"]) and "q_continue_loss" in m and "q_loss" in m
    assert type(tr.optimizer).__name__ == "AdamATan2"
    # sign-SGD moves each used entry by at most puzzle_emb_lr per step (+ decay of a zero row: nothing)
    moved = (tr.model.embedding.puzzle_emb.weight.detach() - emb0).abs()
    assert 0 < float(moved.max()) <= 3 * 0.01 + 1e-9


def test_trm_paper_optimisers_train(tmp_path) -> None:
    cfg = tiny_config(tmp_path, "model.name=trm", "model.n_inner=2", *PAPER)
    tr = Trainer(cfg, train_data=tiny_dataset(32), eval_data=tiny_dataset(8, seed=1))
    m = tr.fit()["train"]
    assert math.isfinite(m["loss"]) and "q_continue_loss" not in m
    groups = tr.optimizer.param_groups
    assert [bool(g["sign_sgd"]) for g in groups] == [False, True]
    assert all(g["weight_decay"] > 0 for g in groups[:1]) and torch.is_tensor(groups[0]["params"][0])
