"""Byte-level text: windows are shifted byte pairs, the train/val split never leaks, bits per byte."""

import importlib.util
import math

import numpy as np
import pytest

from loopformer.tasks.base import TaskDataError
from loopformer.tasks.registry import get_task
from loopformer.tasks.text import TextTask, bits_per_byte


def test_bits_per_byte_closed_forms():
    assert bits_per_byte(math.log(2)) == pytest.approx(1.0)
    assert bits_per_byte(math.log(256)) == pytest.approx(8.0)  # uniform over bytes
    assert bits_per_byte(math.log(2), tokens_per_byte=0.25) == pytest.approx(0.25)


@pytest.fixture
def marked_corpus(tmp_path):
    """40 blocks of 64 bytes: val blocks (every 4th, val_fraction 0.25) are all 'V', train blocks count 'A'..'Z'."""
    blocks = [
        b"V" * 64 if b % 4 == 3 else bytes((65 + (b * 64 + i) % 21) for i in range(64)) for b in range(40)
    ]
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"".join(blocks))
    return path


def test_windows_are_shifted_and_the_split_does_not_leak(marked_corpus):
    task = TextTask(marked_corpus, seq_len=16, val_fraction=0.25, block_bytes=64)
    assert task.split_bytes("train") == 30 * 64 and task.split_bytes("val") == 10 * 64
    corpus = marked_corpus.read_bytes()
    train = task.generate(300, seed=0, split="train")
    assert train.inputs.shape == (300, 16) and task.vocab_size == 256 and task.causal
    assert np.array_equal(train.inputs[:, 1:], train.labels[:, :-1])
    for x, y in zip(train.inputs, train.labels):
        window = bytes(x.tolist()) + bytes(y[-1:].tolist())
        assert window in corpus and b"V" not in window  # a real, contiguous window of train bytes only
    val = task.generate(100, seed=0, split="val")
    assert (val.inputs == ord("V")).all() and (val.labels == ord("V")).all()
    tiles = task.eval_windows("val")
    assert len(tiles) == 10 * 3  # 64-byte blocks: starts 0, 16, 32 fit a 17-byte window
    assert np.array_equal(task.generate(5, 7).inputs, task.generate(5, 7).inputs)


def test_builtin_corpus_and_registry():
    task = get_task("text", seq_len=64)
    assert len(task.data) > 300_000 and task.split_bytes("val") > 0
    data = task.generate(8, seed=1, split="val")
    assert data.inputs.shape == (8, 64) and data.inputs.max() < 256
    assert isinstance(task.render(data.inputs[0]), str)
    with pytest.raises(NotImplementedError, match="bits per byte"):
        task.check(data.inputs[0], data.labels[0])


def test_folder_non_utf8_and_save_load(tmp_path):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.md").write_bytes(b"second " * 20)
    (folder / "a.txt").write_bytes(b"first " * 20)
    (folder / "sub" / "c.txt").write_bytes(bytes([0xFF, 0xFE, 0x80]) * 20)  # not UTF-8: kept as bytes
    (folder / "ignored.json").write_text("{}")
    task = TextTask(folder, seq_len=8, val_fraction=0.0)
    assert bytes(task.data).startswith(b"first ") and bytes([0xFF, 0xFE, 0x80]) in bytes(task.data)
    assert b"{}" not in bytes(task.data)
    data = task.generate(10, seed=0)
    task.save(data, tmp_path / "w.npz")
    assert np.array_equal(task.load(tmp_path / "w.npz").inputs, data.inputs)
    with pytest.raises(TaskDataError, match="split"):
        task.generate(1, 0, split="val")  # val_fraction 0: the val split is empty


def test_errors(tmp_path):
    with pytest.raises(TaskDataError, match="no such"):
        TextTask(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(TaskDataError, match="empty"):
        TextTask(tmp_path / "empty.txt")
    (tmp_path / "tiny.txt").write_bytes(b"abc")
    with pytest.raises(TaskDataError, match="too little"):
        TextTask(tmp_path / "tiny.txt", seq_len=16).generate(1, 0)
    with pytest.raises(TaskDataError, match="no .txt"):
        (tmp_path / "nothing").mkdir()
        TextTask(tmp_path / "nothing")
    if importlib.util.find_spec("pyarrow") is None:
        (tmp_path / "t.parquet").write_bytes(b"PAR1")
        with pytest.raises(TaskDataError, match="pyarrow"):
            TextTask(tmp_path / "t.parquet")
