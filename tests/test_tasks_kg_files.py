"""The LTG / Grokked-Transformers knowledge-graph JSON files, read as the reference writes them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from loopformer.tasks.base import IGNORE_INDEX, TaskDataError
from loopformer.tasks.registry import get_task

E, R = 6, 2


def _write_folder(root: Path) -> dict[tuple[int, int], int]:
    """A tiny graph in getNhopfact.py / create_dataset.py's format (relations are permutations)."""
    rng = np.random.default_rng(0)
    perms = [rng.permutation(E) for _ in range(R)]
    facts = {(h, r): int(perms[r][h]) for h in range(E) for r in range(R)}
    vocab = (
        [f"<e_{i}>" for i in range(E)] + [f"<r_{i}>" for i in range(R)] + ["<mask>", "<sep>", "<a>", "</a>"]
    )
    (root / "vocab.json").write_text(json.dumps(vocab))

    def rec(h: int, rels: list[int], kind: str) -> dict:
        t = h
        for r in rels:
            t = facts[(t, r)]
        text = f"<e_{h}>" + "".join(f"<r_{r}>" for r in rels)
        return {"input_text": text, "target_text": text + f"<e_{t}></a>", "type": kind}

    train = [rec(h, [r], "atomic") for h in range(E) for r in range(R)]
    train += [rec(h, [0, 1], "2hop_train") for h in range(E)]
    test = [rec(h, [1, 0, 1], "3hop_test") for h in range(E)] + [
        rec(h, [1, 1], "2hop_test") for h in range(E)
    ]
    (root / "train.json").write_text(json.dumps(train))
    (root / "test.json").write_text(json.dumps(test))
    return facts


def test_reads_the_reference_format_and_checks_by_the_facts(tmp_path: Path) -> None:
    facts = _write_folder(tmp_path)
    task = get_task("kg_files", path=str(tmp_path))
    assert task.vocab_size == E + R + 4 + 1 and task.pad == 0  # <pad> prepended, as load_vocab does
    ds = task.load("test.json")
    assert ds.inputs.shape == (12, 4) and ds.difficulty.tolist() == [3.0] * 6 + [2.0] * 6
    assert ds.meta["types"][:1] == ["3hop_test"]
    for row, lab in zip(ds.inputs, ds.labels):
        pos = int(np.flatnonzero(lab != IGNORE_INDEX)[0])
        assert pos == int(np.flatnonzero(row != 0)[-1])  # the answer sits at the last query token
        assert task.check(row, lab)  # the label is right by the facts
        wrong = lab.copy()
        wrong[pos] = (lab[pos] % E) + 1  # another entity id (ids 1..E are entities)
        assert not task.check(row, wrong)
    # the tail the facts give for the first test query (<e_0><r_1><r_0><r_1>)
    t = 0
    for r in (1, 0, 1):
        t = facts[(t, r)]
    assert task.tokens[int(ds.labels[0][3])] == f"<e_{t}>"
    only = get_task("kg_files", path=str(tmp_path), types=["2hop_test"]).load("test.json")
    assert len(only) == 6


def test_round_trip_and_errors(tmp_path: Path) -> None:
    _write_folder(tmp_path)
    task = get_task("kg_files", path=str(tmp_path))
    ds = task.load("train.json")
    task.save(ds, tmp_path / "again.json")
    again = task.load(tmp_path / "again.json")
    assert np.array_equal(again.inputs, ds.inputs) and np.array_equal(again.labels, ds.labels)
    (tmp_path / "bad.json").write_text(json.dumps([{"input_text": "<e_0><r_9>", "target_text": "<e_1></a>"}]))
    with pytest.raises(TaskDataError, match=r"bad.json record 0: unknown tokens \['<r_9>'\]"):
        task.load("bad.json")
    with pytest.raises(TaskDataError, match="data.train_path"):
        task.generate(4, seed=0)


def test_trains_a_gpt2_recurrent_model_on_the_files(tmp_path: Path) -> None:
    from loopformer.config import build_config
    from loopformer.train import Trainer

    _write_folder(tmp_path)
    cfg = build_config(
        {
            "model": {
                "name": "recurrent",
                "block": "gpt2",
                "d_model": 16,
                "n_heads": 2,
                "n_layers": 1,
                "causal": True,
                "rope": False,
                "tie_embeddings": True,
                "injection": "none",
                "halt_position": "answer",
                "pad_id": 0,
            },
            "data": {
                "task": "kg_files",
                "options": {"path": str(tmp_path)},
                "train_path": "train.json",
                "eval_path": "test.json",
            },
            "train": {
                "steps": 2,
                "batch_size": 4,
                "warmup_steps": 1,
                "progress": False,
                "threads": 1,
                "loop_sampler": "poisson",
                "loop_sampler_options": {"mean": 4, "low": 2, "high": 8},
                "betas": [0.9, 0.999],
                "decay_all": True,
                "grad_clip": 0.0,
            },
            "loop_eval": {"halting": "kl_entropy", "max_steps": 16, "min_steps": 2},
            "out_dir": str(tmp_path / "run"),
            "device": "cpu",
        }
    )
    summary = Trainer(cfg).fit()
    assert summary["steps"] == 2 and summary["eval"]["n"] == 12


def test_pred_pos_last_puts_the_label_at_the_padded_rows_last_position(tmp_path: Path) -> None:
    """--pred_pos last_token: the label at width - 1 (a pad position for shorter queries); check, render and
    save read the prediction there."""
    _write_folder(tmp_path)
    task = get_task("kg_files", path=str(tmp_path), width=6, pred_pos="last")
    ds = task.load("test.json")
    ref = get_task("kg_files", path=str(tmp_path)).load("test.json")
    assert ds.inputs.shape == (12, 6)
    for row, lab, ref_lab in zip(ds.inputs, ds.labels, ref.labels):
        assert np.flatnonzero(lab != IGNORE_INDEX).tolist() == [5] and row[5] == task.pad
        assert lab[5] == ref_lab[ref_lab != IGNORE_INDEX][0]  # the same answer, at the last position
        assert task.check(row, lab)
        shifted = np.roll(lab, -1)  # the answer one position earlier: wrong for pred_pos last
        assert not task.check(row, shifted)
        assert task.render(row, lab).endswith(task.tokens[int(lab[5])])
    task.save(ds, tmp_path / "again.json")
    again = task.load(tmp_path / "again.json")
    assert np.array_equal(again.labels, ds.labels)
    with pytest.raises(TaskDataError, match="pred_pos 'middle'"):
        get_task("kg_files", path=str(tmp_path), pred_pos="middle")


def test_trains_with_pred_pos_last_pad_mask_and_halting_there(tmp_path: Path) -> None:
    from loopformer.config import build_config
    from loopformer.train import Trainer

    _write_folder(tmp_path)
    cfg = build_config({
        "model": {"name": "recurrent", "block": "gpt2", "d_model": 16, "n_heads": 2, "n_layers": 1,
                  "causal": True, "rope": False, "tie_embeddings": True, "injection": "none",
                  "halt_position": "last", "pad_id": 0, "pad_mask": True},
        "data": {"task": "kg_files", "options": {"path": str(tmp_path), "pred_pos": "last", "width": 6},
                 "train_path": "train.json", "eval_path": "test.json"},
        "train": {"steps": 2, "batch_size": 4, "warmup_steps": 1, "progress": False, "threads": 1,
                  "betas": [0.9, 0.999], "decay_all": True, "grad_clip": 0.0},
        "loop_eval": {"halting": "kl_entropy", "max_steps": 16, "min_steps": 2},
        "out_dir": str(tmp_path / "run"), "device": "cpu",
    })  # fmt: skip
    tr = Trainer(cfg)
    summary = tr.fit()
    assert summary["steps"] == 2 and summary["eval"]["n"] == 12
    ids = torch.as_tensor(tr.task.load("test.json").inputs[:2])
    ctx = tr.model.embed(ids)
    assert ctx[1].nonzero()[:, 1].tolist() == [5, 5]  # KL + entropy halting monitors position width - 1
    assert torch.equal(ctx[-1], ids != 0)  # pad_mask: real tokens are the attended keys


def test_halt_position_must_follow_pred_pos(tmp_path: Path) -> None:
    from loopformer.config import ConfigError, build_config

    _write_folder(tmp_path)
    base = {"model": {"name": "recurrent", "block": "gpt2", "d_model": 16, "n_heads": 2, "n_layers": 1,
                      "halt_position": "answer", "pad_id": 0},
            "data": {"task": "kg_files", "options": {"path": str(tmp_path), "pred_pos": "last"}},
            "out_dir": str(tmp_path / "run")}  # fmt: skip
    with pytest.raises(ConfigError, match="set model.halt_position=last"):
        build_config(base)
    base["model"]["halt_position"] = "last"
    assert build_config(base).model.fields["halt_position"] == "last"
