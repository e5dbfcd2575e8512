"""``train.ema_puzzle_embeddings: false``: the EMA leaves the puzzle-embedding table out, as the references'
EMA does (their tables are buffers; ``models/ema.py`` ``EMAHelper`` averages ``named_parameters()`` only)."""

from __future__ import annotations

import pytest
import torch
from test_train_paper_options import PAPER
from test_train_utils import tiny_config, tiny_dataset

from loopformer.runs.checkpoint import load_checkpoint
from loopformer.train import Trainer

TABLE = "embedding.puzzle_emb.weight"


def _run(tmp_path, ema_table: bool) -> tuple[Trainer, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    cfg = tiny_config(
        tmp_path, "model.name=trm", "model.n_inner=2", *PAPER, "train.puzzle_emb_lr=0.05",
        "train.ema=0.9", "train.ema_warmup=false", f"train.ema_puzzle_embeddings={str(ema_table).lower()}",
    )  # fmt: skip
    tr = Trainer(cfg, train_data=tiny_dataset(32), eval_data=tiny_dataset(8, seed=1))
    # the average written out independently: s_0 = the initial weights, s_k = 0.9 s_(k-1) + 0.1 p_k
    expected = {n: p.detach().clone().double() for n, p in tr.model.named_parameters()}
    step = tr.train_step

    def recorded() -> dict:
        metrics = step()
        for n, p in tr.model.named_parameters():
            expected[n] = 0.9 * expected[n] + 0.1 * p.detach().double()
        return metrics

    tr.train_step = recorded  # type: ignore[method-assign]
    tr.fit()
    live = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    return tr, expected, live


def test_ema_leaves_the_puzzle_table_out_and_evaluation_uses_the_live_rows(tmp_path) -> None:
    tr, expected, live = _run(tmp_path, ema_table=False)
    assert TABLE not in tr.ema.shadow
    assert float(live[TABLE].abs().max()) > 0  # sign-SGD moved the table, so the test can tell
    with tr.ema.applied(tr.model):
        applied = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    assert torch.equal(applied[TABLE], live[TABLE])
    others = [n for n in live if n != TABLE]
    assert others
    for n in others:
        torch.testing.assert_close(applied[n].double(), expected[n], rtol=1e-6, atol=1e-6)
    # the checkpoint's EMA weights come back with the live table too
    ckpt = load_checkpoint(tmp_path, use_ema=True)
    loaded = dict(ckpt.model.named_parameters())
    assert ckpt.weights == "ema"
    assert torch.equal(loaded[TABLE].detach(), live[TABLE])
    torch.testing.assert_close(loaded["q_proj.weight"].detach().double(), expected["q_proj.weight"])


def test_default_ema_averages_the_puzzle_table(tmp_path) -> None:
    tr, expected, live = _run(tmp_path, ema_table=True)
    assert TABLE in tr.ema.shadow
    torch.testing.assert_close(tr.ema.shadow[TABLE].double(), expected[TABLE], rtol=1e-6, atol=1e-6)
    assert not torch.equal(tr.ema.shadow[TABLE], live[TABLE])


def test_ema_option_is_a_known_config_key(tmp_path) -> None:
    from loopformer.config import ConfigError

    with pytest.raises(ConfigError):
        tiny_config(tmp_path, "train.ema_puzzle_embedding=false")
