"""A model family defined outside the package, registered, trained by ``Trainer`` from a config
and evaluated (the worked example of docs/extending.md, "a model family").

The family is a gated recurrent cell looped by the engine: ``embed`` returns the token embedding
as the context, ``init_state`` zeros, ``step`` one GRU-style update ``z <- (1 - g) z + g tanh(W z + U x)``
per position, ``readout`` a linear head. Nothing in the package is edited: ``register_model`` makes
``model.name=gated_cell_test`` a valid recipe key, the trainer builds it from the config (vocabulary
and sequence length filled in from the data), checkpoints record the family and reload it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from test_train_utils import VOCAB, tiny_config, tiny_dataset
from torch import Tensor, nn

from loopformer.eval.evaluate import evaluate
from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel, ModelConfig
from loopformer.models.registry import MODELS, register_model
from loopformer.runs.checkpoint import load_checkpoint
from loopformer.train import Trainer


@dataclass
class GatedCellConfig(ModelConfig):
    d_model: int = 24
    loop: LoopConfig = field(default_factory=lambda: LoopConfig(max_steps=3))


class GatedCell(LoopedModel):
    """z <- (1 - g) z + g tanh(W z + U x), g = sigmoid(G [z, x]); logits = H z."""

    def __init__(self, config: GatedCellConfig) -> None:
        super().__init__(config)
        d = config.d_model
        self.emb = nn.Embedding(config.vocab_size, d)
        self.w = nn.Linear(d, d)
        self.u = nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(2 * d, d)
        self.head = nn.Linear(d, config.vocab_size)

    def embed(self, inputs: Tensor, puzzle_ids: Tensor | None = None) -> tuple[Tensor, ...]:
        return (self.emb(inputs),)

    def init_state(self, ctx: tuple[Tensor, ...], generator: torch.Generator | None = None) -> Tensor:
        return torch.zeros_like(ctx[0])

    def step(self, z: Tensor, *ctx: Tensor) -> Tensor:
        x = ctx[0]
        g = torch.sigmoid(self.gate(torch.cat([z, x], dim=-1)))
        return (1 - g) * z + g * torch.tanh(self.w(z) + self.u(x))

    def readout(self, z: Tensor, *ctx: Tensor) -> Tensor:
        return self.head(z)


@pytest.fixture(autouse=True, scope="module")
def registered() -> Iterator[None]:
    """Register the family for this module's tests (undone afterwards: other tests see the built-ins)."""
    register_model("gated_cell_test", GatedCell, GatedCellConfig)
    yield
    MODELS.pop("gated_cell_test")


def test_registered_family_trains_from_a_config_and_evaluates(tmp_path) -> None:
    assert MODELS["gated_cell_test"].endswith(":GatedCell:GatedCellConfig")
    cfg = tiny_config(
        tmp_path,
        "model.name=gated_cell_test",
        "model.d_model=24",
        f"model.vocab_size={VOCAB}",
        "train.steps=60",
        "train.lr=0.03",
        "train.batch_size=32",
        "train.log_every=60",
    )
    held_out = tiny_dataset(64, seed=1)
    trainer = Trainer(
        cfg, train_data=tiny_dataset(256), eval_data=held_out
    )  # the model comes from the registry
    assert isinstance(trainer.model, GatedCell)
    # the recipe's fields, the sequence length from the data; the resolved config is recorded
    assert trainer.model.config.vocab_size == VOCAB and trainer.model.config.seq_len == 6
    assert cfg.model.fields["d_model"] == 24
    summary = trainer.fit()
    assert summary["train"]["task_loss"] < 0.3  # ln(8) = 2.08 at the start
    assert summary["eval"]["exact_acc"] > 0.9  # the held-out rows follow the same per-token map

    # the checkpoint names the family and rebuilds it from the registry; the evaluation path agrees
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.family == "gated_cell_test" and isinstance(ckpt.model, GatedCell)
    result = evaluate(ckpt.model, None, held_out, loop=trainer.loop_eval, batch_size=32)
    assert result.exact_accuracy == summary["eval"]["exact_acc"]
    assert result.mean_steps == 3.0
