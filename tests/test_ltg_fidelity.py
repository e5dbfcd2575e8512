"""Loop, Think & Generalize details against OSU-NLP-Group/Loop-Think-Generalize: label smoothing
(``train_systematicity.py``: ``CrossEntropyLoss(label_smoothing=0.1)``), the learned position table of
``gpt_utils_systematicity.py`` (``position_embedding``: an ``nn.Embedding`` added once to the token
embeddings) and the paper recipes ``paper_ltg_kg_depth`` / ``paper_ltg_systematicity`` on a tiny folder
in the reference's file format."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from loopformer.config import ConfigError, build_config, load_config, read_recipe
from loopformer.models.recurrent import RecurrentConfig, RecurrentDepth
from loopformer.tasks.base import IGNORE_INDEX
from loopformer.train.losses import sequence_loss

RECIPES = Path(__file__).resolve().parents[1] / "loopformer" / "recipes"


@pytest.mark.parametrize("kind", ["ce", "stablemax"])
def test_label_smoothing_is_pytorchs_formula(kind: str) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, 7, generator=g, dtype=torch.float64)
    labels = torch.full((4, 5), IGNORE_INDEX)
    labels[:, -1] = torch.randint(0, 7, (4,), generator=g)  # one answer per query, as the KG tasks
    labels[0, 2] = 3  # and a sample with two labelled positions (its own mean first)
    got = sequence_loss(logits, labels, kind, label_smoothing=0.1)
    if kind == "ce":  # the oracle: torch's own label-smoothed cross-entropy, per sample then averaged
        per = [
            F.cross_entropy(logits[b], labels[b], ignore_index=IGNORE_INDEX, label_smoothing=0.1)
            for b in range(4)
        ]
        torch.testing.assert_close(got.double(), torch.stack(per).mean(), rtol=1e-6, atol=0)
    else:  # closed form on stablemax log-probabilities
        x = logits
        s = torch.where(x >= 0, x + 1, 1 / (1 - torch.clamp(x, max=0)))
        logp = (s / s.sum(-1, keepdim=True)).log()
        mask = labels != IGNORE_INDEX
        nll = -logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        tok = torch.where(mask, 0.9 * nll - 0.1 * logp.mean(-1), 0)
        torch.testing.assert_close(got.double(), (tok.sum(1) / mask.sum(1)).mean(), rtol=1e-6, atol=0)
    assert not torch.isclose(got, sequence_loss(logits, labels, kind))


def test_label_smoothing_is_checked_and_reaches_the_trainer(tmp_path: Path) -> None:
    from test_train_utils import TinyLooped, tiny_config, tiny_dataset

    from loopformer.train import Trainer

    with pytest.raises(ConfigError, match="train.label_smoothing"):
        build_config({}, [f"out_dir={tmp_path}", "train.label_smoothing=1.0"])
    cfg = tiny_config(tmp_path, "train.label_smoothing=0.2", "train.q_loss_weight=0")
    tr = Trainer(cfg, model=TinyLooped(seed=0), train_data=tiny_dataset(16), eval_data=None)
    batch = tr.mode.batch(0)
    out = tr._forward(batch)
    total, parts, _ = tr.loss(out, batch)
    torch.testing.assert_close(parts["task_loss"], sequence_loss(out.logits, batch.labels, "ce", 0.2))
    assert not torch.isclose(parts["task_loss"], sequence_loss(out.logits, batch.labels, "ce"))


def test_gpt2_learned_positions_are_the_references_unscaled_normal_table() -> None:
    torch.manual_seed(0)
    cfg = RecurrentConfig(vocab_size=11, seq_len=5, d_model=64, n_heads=4, n_layers=1, block="gpt2",
                          causal=True, rope=False, learned_positions=True, injection="none", tie_embeddings=True)  # fmt: skip
    model = RecurrentDepth(cfg).eval()
    table = model.embedding.positions.table.detach()
    assert table.shape == (5, 64) and 0.85 < float(table.std()) < 1.15 and float(table.abs().max()) > 2.0
    ids = torch.tensor([[1, 4, 2, 0, 0], [3, 3, 3, 3, 3]])
    (e,) = model.embed(ids)[:1]
    torch.testing.assert_close(
        e, model.embedding.tokens.weight[ids] + table[None]
    )  # token + position, unscaled
    short = model.embed(ids[:, :3])[
        0
    ]  # T < seq_len: the table's first T rows (position_embedding(arange(T)))
    torch.testing.assert_close(short, model.embedding.tokens.weight[ids[:, :3]] + table[None, :3])
    with pytest.raises(ValueError, match="at most seq_len = 5"):
        model.embed(torch.ones(1, 6, dtype=torch.long))


E, R = 6, 2


def _reference_folder(root: Path) -> None:
    """getNhopfact.py / create_dataset.py's format: atomic facts + 2- and 3-hop paths, typed test splits."""
    rng = np.random.default_rng(0)
    perms = [rng.permutation(E) for _ in range(R)]
    root.mkdir(parents=True)
    vocab = [f"<e_{i}>" for i in range(E)] + [f"<r_{i}>" for i in range(R)] + ["</a>"]
    (root / "vocab.json").write_text(json.dumps(vocab))

    def rec(h: int, rels: tuple[int, ...], kind: str) -> dict:
        t = h
        for r in rels:
            t = int(perms[r][t])
        text = f"<e_{h}>" + "".join(f"<r_{r}>" for r in rels)
        return {"input_text": text, "target_text": text + f"<e_{t}></a>", "type": kind}

    train = [rec(h, (r,), "atomic") for h in range(E) for r in range(R)]
    train += [rec(h, (0, 1), "2hop_train") for h in range(E)] + [
        rec(h, (0, 0, 1), "3hop_train") for h in range(E)
    ]
    test = [rec(h, (1, 1), "2hop_test") for h in range(E)] + [
        rec(h, (1, 0, 1), "3hop_test") for h in range(E)
    ]
    (root / "train.json").write_text(json.dumps(train))
    (root / "test.json").write_text(json.dumps(test))


TINY = ["model.d_model=16", "model.n_heads=2", "model.n_layers=1", "train.batch_size=4", "train.warmup_steps=2",
        "train.progress=false", "train.threads=1", "train.log_every=1", "train.eval_every=0",
        "train.checkpoint_every=0", "eval.batch_size=8", "bf16=false", "device=cpu"]  # fmt: skip


def test_paper_ltg_depth_recipe_trains_with_the_references_curriculum(tmp_path: Path) -> None:
    from loopformer.train import Trainer

    cfg = load_config(RECIPES / "paper_ltg_kg_depth.yaml")
    cc, tc = cfg.data.curriculum, cfg.train
    # train_extrapolation.py's default --pred_pos last_token at --max_len 50, pad keys masked, halting there
    assert cfg.data.options["pred_pos"] == "last" and cfg.data.options["width"] == 50
    m = cfg.model.fields
    assert (m["halt_position"], m["pad_mask"], m["pad_id"]) == ("last", True, 0)
    assert (cc.start, cc.threshold, cc.source, cc.restart_optimizer) == (2.0, 0.95, "eval", True)
    assert (tc.lr, tc.weight_decay, tc.warmup_steps, tc.grad_clip, tc.batch_size) == (
        1e-4,
        0.01,
        2000,
        0.0,
        128,
    )
    _reference_folder(tmp_path / "multi_hop")
    cfg = build_config(read_recipe(RECIPES / "paper_ltg_kg_depth.yaml"), [*TINY, f"data.options.path={tmp_path / 'multi_hop'}", "train.steps=4",
                             "data.curriculum.check_every=2", "data.curriculum.threshold=0.0",
                             f"out_dir={tmp_path / 'run'}"])  # fmt: skip
    tr = Trainer(cfg)
    lrs = []
    original = tr.train_step
    tr.train_step = lambda: lrs.append(original()["lr"]) or {"lr": lrs[-1]}
    summary = tr.fit()
    assert summary["curriculum_level"] == 3.0 and tr.curriculum.stage_start == 2
    assert lrs == pytest.approx([1e-4 * 0.5, 1e-4, 1e-4 * 0.5, 1e-4])  # the warm-up restarted at the level-up


def test_paper_ltg_systematicity_recipe_trains(tmp_path: Path) -> None:
    from loopformer.train import Trainer

    cfg = load_config(RECIPES / "paper_ltg_systematicity.yaml")
    assert cfg.train.label_smoothing == 0.1 and cfg.model.fields.get("learned_positions") is True
    _reference_folder(tmp_path / "composition")
    cfg = build_config(read_recipe(RECIPES / "paper_ltg_systematicity.yaml"), [*TINY, f"data.options.path={tmp_path / 'composition'}", "train.steps=2",
                             f"out_dir={tmp_path / 'run'}"])  # fmt: skip
    tr = Trainer(cfg)
    assert tr.model.embedding.positions is not None and tr.model.embedding.positions.scale == 1.0
    summary = tr.fit()
    assert summary["steps"] == 2 and summary["eval"]["n"] == 2 * E
