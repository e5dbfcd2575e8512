"""The text task on an already tokenized corpus (a .npy of token ids, e.g. FineWeb-Edu through the
Attractor paper's BPE tokenizer of vocabulary 32768): windows, vocabulary, bits per byte, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from loopformer.config import build_config
from loopformer.eval.evaluate import evaluate_lm
from loopformer.runs import eval_dataset, load_run
from loopformer.tasks.base import TaskDataError
from loopformer.tasks.text import TextTask


@pytest.fixture
def token_file(tmp_path):
    ids = np.random.default_rng(0).integers(0, 700, size=5000).astype(np.uint16)
    path = tmp_path / "corpus.npy"
    np.save(path, ids)
    return path, ids


def test_windows_are_the_token_ids_shifted(token_file) -> None:
    path, ids = token_file
    task = TextTask(path, seq_len=16, vocab_size=1000, tokens_per_byte=0.25, val_fraction=0.1)
    assert task.vocab_size == 1000 and task.tokens_per_byte == 0.25
    data = task.generate(20, seed=1)
    assert data.inputs.max() < 1000
    for x, y in zip(data.inputs, data.labels):
        np.testing.assert_array_equal(x[1:], y[:-1])
    windows = np.lib.stride_tricks.sliding_window_view(ids.astype(np.int64), 17)
    rows = {tuple(w) for w in windows}
    assert all(tuple(np.concatenate([x, y[-1:]])) in rows for x, y in zip(data.inputs, data.labels))
    assert TextTask(path, seq_len=16, tokens_per_byte=0.25).vocab_size == int(ids.max()) + 1  # inferred
    assert task.render(np.array([5, 17])) == "5 17"


def test_bad_token_corpora_are_named(tmp_path, token_file) -> None:
    path, _ = token_file
    with pytest.raises(TaskDataError, match="tokens_per_byte"):
        TextTask(path, seq_len=16)
    with pytest.raises(TaskDataError, match="does not fit vocab_size 500"):
        TextTask(path, seq_len=16, vocab_size=500, tokens_per_byte=0.25)
    np.save(tmp_path / "flat.npy", np.zeros((4, 4), dtype=np.int32))
    with pytest.raises(TaskDataError, match="1-D integer array"):
        TextTask(tmp_path / "flat.npy", seq_len=2, tokens_per_byte=0.25)
    np.save(tmp_path / "floats.npy", np.zeros(100))
    with pytest.raises(TaskDataError, match="1-D integer array"):
        TextTask(tmp_path / "floats.npy", seq_len=2, tokens_per_byte=0.25)
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    with pytest.raises(TaskDataError, match="not a readable .npy"):
        TextTask(tmp_path / "junk.npy", seq_len=2, tokens_per_byte=0.25)
    (tmp_path / "a.txt").write_text("some text " * 50)
    with pytest.raises(TaskDataError, match="tokenized corpus"):
        TextTask(tmp_path / "a.txt", seq_len=8, vocab_size=32768)


def test_a_model_trains_at_the_corpus_vocabulary_and_reports_bits_per_byte(tmp_path, token_file) -> None:
    from loopformer.train.trainer import Trainer

    path, _ = token_file
    raw = {
        "model": {"name": "transformer", "d_model": 16, "n_heads": 2, "n_layers": 1, "expansion": 2.0},
        "data": {"task": "text", "options": {"path": str(path), "seq_len": 16, "vocab_size": 1000,
                                             "tokens_per_byte": 0.25, "val_fraction": 0.1},
                 "train_generate": {"split": "train"}, "eval_generate": {"split": "val"},
                 "train_size": 64, "eval_size": 16},
        "train": {"mode": "simple", "steps": 2, "batch_size": 8, "progress": False},
        "out_dir": str(tmp_path / "run"),
    }  # fmt: skip
    Trainer(build_config(raw)).fit()
    run = load_run(tmp_path / "run")
    assert run.model.embedding.tokens.weight.shape[0] == 1000
    lm = evaluate_lm(run.model, run.task, eval_dataset(run.task, run.config), batch_size=8)
    assert lm.bits_per_byte == pytest.approx(lm.loss * 0.25 / math.log(2), rel=1e-9)
    assert lm.loss == pytest.approx(math.log(1000), rel=0.1)  # 2 steps from init: near uniform over 1000
    assert torch.isfinite(torch.tensor(lm.loss))
