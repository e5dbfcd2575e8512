"""Deterministic, resumable index stream and the difficulty curriculum."""

from __future__ import annotations

import numpy as np
import pytest
from test_train_utils import tiny_dataset

from loopformer.train.data import Curriculum, IndexStream, make_batch


def test_each_epoch_is_a_permutation_seeded_by_seed_and_epoch() -> None:
    stream = IndexStream(10, seed=4)
    first, second = stream.take(10), stream.take(10)
    assert sorted(first) == list(range(10)) and sorted(second) == list(range(10))
    assert not np.array_equal(first, second)
    expected = np.random.default_rng([4, 1]).permutation(10)
    assert np.array_equal(second, expected)
    assert not np.array_equal(IndexStream(10, seed=5).take(10), first)


def test_resumed_stream_replays_exactly() -> None:
    a = IndexStream(13, seed=0)
    continuous = np.concatenate([a.take(4) for _ in range(9)])
    b = IndexStream(13, seed=0)
    head = np.concatenate([b.take(4) for _ in range(4)])
    c = IndexStream(13, seed=0)
    c.load_state_dict(b.state_dict())
    tail = np.concatenate([c.take(4) for _ in range(5)])
    assert np.array_equal(np.concatenate([head, tail]), continuous)


def test_eligible_subset_and_new_epoch_on_change() -> None:
    stream = IndexStream(10, seed=1, eligible=np.array([2, 5, 7]))
    assert set(stream.take(6)) == {2, 5, 7}
    stream.take(1)
    stream.set_eligible(np.array([1, 2, 3, 4]))
    assert stream.state_dict()["position"] == 0
    assert set(stream.take(4)) == {1, 2, 3, 4}
    with pytest.raises(ValueError, match="no training example is eligible"):
        stream.set_eligible(np.array([], dtype=np.int64))


def test_curriculum_levels_rows_and_advance() -> None:
    difficulty = np.array([1, 2, 2, 3, 4, 4, 5], dtype=float)
    cur = Curriculum(difficulty, start=2, step=1, threshold=0.95)
    assert list(cur.eligible()) == [0, 1, 2] and list(cur.current_rows(difficulty)) == [1, 2]
    assert not cur.update(0.9, 10) and cur.level == 2
    assert cur.update(0.95, 20) and cur.level == 3 and list(cur.eligible()) == [0, 1, 2, 3]
    cur.update(1.0, 30)
    cur.update(1.0, 40)
    assert cur.level == 5 and cur.done and not cur.update(1.0, 50)
    restored = Curriculum(difficulty, start=2)
    restored.load_state_dict(cur.state_dict())
    assert restored.level == 5 and restored.history == cur.history
    with pytest.raises(ValueError, match="below every training difficulty"):
        Curriculum(difficulty, start=0.5)


def test_make_batch_selects_rows() -> None:
    data = tiny_dataset(10)
    batch = make_batch(data, np.array([3, 1]))
    assert np.array_equal(batch.inputs.numpy(), data.inputs[[3, 1]])
    assert np.array_equal(batch.labels.numpy(), data.labels[[3, 1]]) and batch.puzzle_ids is None
    assert batch.index.tolist() == [3, 1]
