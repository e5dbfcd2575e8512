"""Tiny model and synthetic data shared by the training tests (plus tests of the helpers themselves)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from loopformer.config import RunConfig, build_config
from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel, ModelConfig
from loopformer.tasks.base import IGNORE_INDEX, TokenDataset

VOCAB, SEQ = 8, 6


@dataclass
class TinyConfig(ModelConfig):
    vocab_size: int = VOCAB
    seq_len: int = SEQ
    d_model: int = 16
    q_head: bool = True
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(max_steps=3))


class TinyLooped(LoopedModel):
    """z <- tanh(W z + U x): a dropout-free looped map with a norm, a bias, a gate and a Q head."""

    def __init__(self, config: TinyConfig | None = None, seed: int = 0) -> None:
        super().__init__(config or TinyConfig())
        d, V = self.config.d_model, self.config.vocab_size
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(V, d)
        self.w = nn.Linear(d, d)
        self.u = nn.Linear(d, d, bias=False)
        self.norm = nn.LayerNorm(d)
        self.gate = nn.Parameter(torch.zeros(d, d))  # 2-D, excluded by no_weight_decay()
        self.out = nn.Linear(d, V)
        self.q = nn.Linear(d, 1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def no_weight_decay(self) -> set[str]:
        return {"gate"}

    def embed(self, inputs: Tensor, puzzle_ids: Tensor | None = None) -> tuple[Tensor, ...]:
        return (self.emb(inputs),)

    def init_state(self, ctx: tuple[Tensor, ...], generator: torch.Generator | None = None) -> Tensor:
        x = ctx[0]
        return 0.1 * torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)

    def step(self, z: Tensor, *ctx: Tensor) -> Tensor:
        return torch.tanh(self.w(self.norm(z)) + self.u(ctx[0]) + z @ self.gate)

    def readout(self, z: Tensor, *ctx: Tensor) -> Tensor:
        return self.out(z)

    def q_head(self, z: Tensor, *ctx: Tensor) -> Tensor | None:
        return self.q(z.mean(1)).squeeze(-1) if self.config.q_head else None


def tiny_dataset(n: int = 64, seed: int = 0) -> TokenDataset:
    """label_t = (3 x_t + 1) mod V on the last half of the positions (a per-token map); difficulty 1..4."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, size=(n, SEQ))
    y = (3 * x + 1) % VOCAB
    y[:, : SEQ // 2] = IGNORE_INDEX
    difficulty = rng.integers(1, 5, size=n).astype(float)
    return TokenDataset(x, y, difficulty)


def tiny_config(tmp_path, *overrides: str) -> RunConfig:
    base = [
        f"out_dir={tmp_path}",
        "device=cpu",
        "train.steps=6",
        "train.batch_size=8",
        "train.lr=0.01",
        "train.warmup_steps=2",
        "train.progress=false",
        "train.log_every=1",
        "train.threads=1",
        "eval.batch_size=32",
    ]
    return build_config({}, [*base, *overrides], check=False)


def test_tiny_model_runs_the_engine_for_the_configured_steps() -> None:
    model = TinyLooped()
    data = tiny_dataset(4)
    out = model(torch.from_numpy(data.inputs), loop=LoopConfig(max_steps=5))
    assert out.logits.shape == (4, SEQ, VOCAB)
    assert out.loop.steps.tolist() == [5, 5, 5, 5]
    assert out.q_logits.shape == (4,)


def test_tiny_dataset_is_deterministic_and_masked() -> None:
    a, b = tiny_dataset(8, seed=3), tiny_dataset(8, seed=3)
    assert np.array_equal(a.inputs, b.inputs) and np.array_equal(a.labels, b.labels)
    assert (a.labels[:, : SEQ // 2] == IGNORE_INDEX).all() and (a.labels[:, SEQ // 2 :] >= 0).all()
