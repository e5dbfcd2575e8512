"""Shared pieces of the out-of-tree plug-in tests (tests/test_extending_*.py): a float64 linear
map with a closed-form fixed point, and a tiny FPRM training run through the real Trainer."""

from __future__ import annotations

import torch

from loopformer.config import build_config
from loopformer.train import Trainer

DT = torch.float64


def linear_problem(d: int = 12, b: int = 3, lo: float = -0.9, hi: float = 0.5, seed: int = 0):
    """f(z) = z W^T + x with symmetric W (eigenvalues in [lo, hi]); returns (W, x, z* = (I - W)^-1 x)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=DT))
    eigs = torch.linspace(lo, hi, d, dtype=DT)
    w = q @ torch.diag(eigs) @ q.T
    x = torch.randn(b, d, generator=g, dtype=DT)
    z_star = torch.linalg.solve(torch.eye(d, dtype=DT) - w, x.T).T
    return w, x, z_star


def train_tiny_fprm(tmp_path, *overrides: str) -> dict:
    """Two optimiser steps of a tiny FPRM on 4x4 Sudoku through ``Trainer(build_config(...))``."""
    cfg = build_config(
        {},
        [
            f"out_dir={tmp_path}",
            "device=cpu",
            "model.name=fprm",
            "data.task=sudoku",
            "data.options={size: 4}",
            "data.train_generate={min_blanks: 4, max_blanks: 8}",
            "data.eval_generate={min_blanks: 4, max_blanks: 8}",
            "model.d_model=16",
            "model.n_heads=2",
            "model.n_layers=1",
            "data.train_size=6",
            "data.eval_size=2",
            "train.steps=2",
            "train.batch_size=2",
            "train.lr=0.01",
            "train.warmup_steps=0",
            "train.progress=false",
            "train.threads=1",
            "eval.batch_size=2",
            "train.loop_sampler=none",
            *overrides,
        ],
    )
    trainer = Trainer(cfg)
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    summary = trainer.fit()
    after = trainer.model.state_dict()
    assert summary["steps"] == 2
    assert all(torch.isfinite(v).all() for v in after.values() if v.is_floating_point())
    assert any(not torch.equal(before[k], after[k]) for k in before), "two optimiser steps changed nothing"
    return summary
