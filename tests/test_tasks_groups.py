"""Group word problems: group orders and axioms, labels against independent permutation composition."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loopformer.tasks.base import TaskDataError
from loopformer.tasks.groups import GroupTask, group_elements, is_even
from loopformer.tasks.registry import get_task


def apply_then(first, second):
    """Independent oracle: the permutation 'first, then second' as a tuple of images."""
    return tuple(second[first[x]] for x in range(len(first)))


@pytest.mark.parametrize(
    "name, order",
    [
        ("Z1", 1),
        ("Z7", 7),
        ("C5", 5),
        ("D4", 8),
        ("D5", 10),
        ("S3", 6),
        ("A4", 12),
        ("S4", 24),
        ("A5", 60),
        ("S5", 120),
    ],
)
def test_group_orders(name, order):
    task = GroupTask(name, length=4)
    assert task.order == order
    assert task.vocab_size == order + 1
    assert len(set(task.elements)) == order
    assert task.elements[0] == tuple(range(len(task.elements[0])))  # identity first


def test_alternating_is_the_even_half_of_symmetric():
    s5, a5 = set(group_elements("S5")), set(group_elements("A5"))
    assert a5 < s5 and len(s5) == 2 * len(a5)
    # independent parity: count inversions
    for p in s5:
        inversions = sum(1 for i, j in itertools.combinations(range(5), 2) if p[i] > p[j])
        assert (p in a5) == (inversions % 2 == 0) == is_even(p)


@pytest.mark.parametrize("name", ["Z6", "D4", "S3", "A4", "A5"])
def test_group_axioms(name):
    task = GroupTask(name)
    table, n = task.table, task.order
    # closure + Latin square: every row and column is a permutation of the elements
    assert all(sorted(row) == list(range(n)) for row in table)
    assert all(sorted(col) == list(range(n)) for col in table.T)
    assert np.array_equal(table[0], np.arange(n)) and np.array_equal(table[:, 0], np.arange(n))  # identity
    assert all((table[a] == 0).sum() == 1 for a in range(n))  # unique inverses
    # associativity over all triples: (a b) c == a (b c)
    assert np.array_equal(
        table[table[:, :, None], np.arange(n)[None, None, :]],
        table[np.arange(n)[:, None, None], table[None, :, :]],
    )


def test_s3_is_not_abelian_and_the_convention_is_first_element_applied_first():
    task = GroupTask("S3", length=2)
    swap01, swap12 = (1, 0, 2), (0, 2, 1)
    inputs = np.array([task.index[swap01] + 1, task.index[swap12] + 1])
    # p_1 = g_1 o g_0: x -> swap12[swap01[x]]: 0 -> 1 -> 2, 1 -> 0 -> 0, 2 -> 2 -> 1
    expected = (2, 0, 1)
    labels = np.array([task.index[swap01] + 1, task.index[expected] + 1])
    assert task.check(inputs, labels)
    wrong = np.array([labels[0], task.index[apply_then(swap12, swap01)] + 1])
    assert not task.check(inputs, wrong)


@settings(max_examples=15, deadline=None)
@given(
    name=st.sampled_from(["S3", "A4", "A5", "S5", "D6", "Z9"]),
    seed=st.integers(0, 2**31),
    length=st.integers(1, 40),
)
def test_labels_are_running_products_by_direct_composition(name, seed, length):
    task = GroupTask(name, length=length)
    data = task.generate(8, seed)
    assert data.inputs.shape == (8, length) and data.inputs.min() >= 1 and data.inputs.max() <= task.order
    for x, y in zip(data.inputs, data.labels):
        state = task.elements[0]
        for token, label in zip(x, y):
            state = apply_then(state, task.elements[token - 1])
            assert task.elements[label - 1] == state
        assert task.check(x, y)


def test_check_rejects_a_single_wrong_position_and_prefix_accuracy_marks_it():
    task = GroupTask("A5", length=32)
    data = task.generate(20, seed=3)
    rng = np.random.default_rng(0)
    for x, y in zip(data.inputs, data.labels):
        i = int(rng.integers(32))
        bad = y.copy()
        bad[i] = bad[i] % task.order + 1  # a different valid element
        assert not task.check(x, bad)
        prefix = task.prefix_correct(x, bad)
        assert prefix[:i].all() and not prefix[i:].any()
    assert not task.check(data.inputs[0], np.zeros(32, dtype=np.int64))  # PAD is not an element


def test_generate_is_seeded_and_allows_longer_test_words(tmp_path):
    task = GroupTask("S5", length=16)
    a, b = task.generate(10, seed=1), task.generate(10, seed=1)
    assert np.array_equal(a.inputs, b.inputs) and not np.array_equal(
        a.inputs, task.generate(10, seed=2).inputs
    )
    long = task.generate(5, seed=1, length=128)
    assert long.inputs.shape == (5, 128) and (long.difficulty == 128).all()
    assert all(task.check(x, y) for x, y in zip(long.inputs, long.labels))
    task.save(long, tmp_path / "s5.npz")
    back = task.load(tmp_path / "s5.npz")
    assert np.array_equal(back.inputs, long.inputs) and np.array_equal(back.labels, long.labels)
    assert back.meta["group"] == "S5"


def test_registry_and_errors():
    task = get_task("groups", group="a5", length=8)
    assert task.causal and task.vocab_size == 61 and task.seq_len == 8
    with pytest.raises(TaskDataError, match="unknown group"):
        GroupTask("Q8")
    with pytest.raises(TaskDataError, match="too large"):
        GroupTask("S9")
    with pytest.raises(TypeError, match="unknown options"):
        task.generate(2, 0, lenght=4)
    assert "(" in task.render(task.generate(1, 0).inputs[0])


def test_pad_to_stores_the_same_words_at_the_test_width():
    """FPRM's builder stores its length-32 training words at 128 positions (PAD 0, label ignored)."""
    from loopformer.tasks.base import IGNORE_INDEX

    task = GroupTask("A5", length=32)
    plain = task.generate(6, seed=3)
    padded = task.generate(6, seed=3, pad_to=128)
    assert padded.inputs.shape == padded.labels.shape == (6, 128)
    assert np.array_equal(padded.inputs[:, :32], plain.inputs)
    assert np.array_equal(padded.labels[:, :32], plain.labels)
    assert (padded.inputs[:, 32:] == 0).all() and (padded.labels[:, 32:] == IGNORE_INDEX).all()
    assert (padded.difficulty == 32).all() and padded.meta["width"] == 128
    assert all(task.difficulty(x) == 32 for x in padded.inputs)
    # the validator skips PAD positions: the true products are accepted, a wrong word position is not
    assert all(task.check(x, y) for x, y in zip(padded.inputs, np.where(padded.labels < 0, 0, padded.labels)))
    bad = np.where(padded.labels < 0, 0, padded.labels)[0].copy()
    bad[31] = bad[31] % 60 + 1
    assert not task.check(padded.inputs[0], bad)
    with pytest.raises(TaskDataError, match="pad_to"):
        task.generate(2, 0, pad_to=16)
