"""Knowledge-graph tasks: answers follow the relations, disjoint splits, no OOD composition in training."""

import numpy as np
import pytest

from loopformer.tasks.base import IGNORE_INDEX, TaskDataError
from loopformer.tasks.kg import KGDepthTask, KGSystematicTask
from loopformer.tasks.registry import get_task


def fact_dict(task, dataset):
    """Independent oracle: {(head token, relation token): tail} read from a dataset of 1-hop rows."""
    facts = {}
    for x, y in zip(dataset.inputs, dataset.labels):
        assert x[1] >= task.num_entities and (len(x) < 3 or x[2] == task.pad)
        facts[(int(x[0]), int(x[1]))] = int(y[1])
    return facts


def follow(facts, pad, row):
    entity, steps = int(row[0]), 0
    for token in row[1:]:
        if token == pad:
            break
        entity = facts[(entity, int(token))]
        steps += 1
    return entity, steps


def as_tuples(dataset):
    return {tuple(row) for row in dataset.inputs.tolist()}


@pytest.fixture(scope="module")
def depth():
    return KGDepthTask(num_entities=50, num_relations=4, max_hops=8, seed=3)


def test_relations_are_bijections_and_atomic_facts_count():
    task = KGDepthTask()  # the paper's size: 200 entities x 10 relations
    assert all(np.array_equal(np.sort(row), np.arange(200)) for row in task.relation_table)
    atomic = task.atomic_facts()
    assert len(atomic) == 2000 and len(as_tuples(atomic)) == 2000
    assert task.vocab_size == 200 + 10 + 1 and task.pad == 210 and task.causal


def test_depth_answers_follow_the_relations(depth):
    facts = fact_dict(depth, depth.atomic_facts())
    data = depth.generate(400, seed=1, min_hops=1, max_hops=8)
    assert data.inputs.shape == (400, 9)
    assert set(np.unique(data.difficulty)) == set(range(1, 9))
    for x, y, d in zip(data.inputs, data.labels, data.difficulty):
        tail, hops = follow(facts, depth.pad, x)
        assert hops == d
        assert (
            y[hops] == tail and (np.delete(y, hops) == IGNORE_INDEX).all()
        )  # loss only at the last query token
        assert (x[hops + 1 :] == depth.pad).all()  # right-padded
        assert depth.check(x, np.where(y == IGNORE_INDEX, 0, y))
        wrong = y.copy()
        wrong[hops] = (tail + 1) % depth.num_entities
        assert not depth.check(x, wrong)
        assert list(depth.path_entities(x)[0, : hops + 1][-1:]) == [tail]


def test_depth_test_paths_are_disjoint_from_training_and_distinct(depth):
    for k in (2, 3, 6):
        train = depth.generate(300, seed=k, hops=k, split="train")
        test = depth.generate(30, seed=100 + k, hops=k, split="test")
        assert len(as_tuples(train)) == 300 and len(as_tuples(test)) == 30
        assert not as_tuples(train) & as_tuples(test)
        assert not depth.is_test_path(
            train.inputs[:, 0], train.inputs[:, 1 : k + 1] - depth.num_entities
        ).any()
        assert depth.is_test_path(test.inputs[:, 0], test.inputs[:, 1 : k + 1] - depth.num_entities).all()
    # the partition is a pure function of the task seed and the path
    heads, rels = np.arange(50).repeat(20), np.random.default_rng(0).integers(0, 4, size=(1000, 3))
    again = KGDepthTask(num_entities=50, num_relations=4, max_hops=8, seed=3)
    assert np.array_equal(depth.is_test_path(heads, rels), again.is_test_path(heads, rels))
    assert 0.0 < depth.is_test_path(heads, rels).mean() < 0.15
    other = KGDepthTask(num_entities=50, num_relations=4, max_hops=8, seed=4)
    assert not np.array_equal(depth.is_test_path(heads, rels), other.is_test_path(heads, rels))
    mix = depth.training_set(max_hops=4, paths_per_hop=200, seed=5)
    assert len(mix) == 200 + 3 * 200  # all atomic facts (50 x 4) + paths per hop
    tests = depth.generate(60, seed=9, min_hops=2, max_hops=4, split="test", pad_to=5)
    assert not as_tuples(mix) & as_tuples(tests)
    # the whole 2-hop space is partitioned: every path is in exactly one split
    space = 50 * 4**2
    n_test = int(
        depth.is_test_path(
            np.repeat(np.arange(50), 16), np.tile(np.indices((4, 4)).reshape(2, -1).T, (50, 1))
        ).sum()
    )
    with pytest.raises(TaskDataError, match="only"):
        depth.generate(n_test + 1, 0, hops=2, split="test")
    assert len(depth.generate(space - n_test, 0, hops=2, split="train")) == space - n_test


def test_depth_errors(depth):
    with pytest.raises(TaskDataError, match="atomic facts"):
        depth.generate(5, 0, hops=1, split="test")
    with pytest.raises(TaskDataError, match="hops"):
        depth.generate(5, 0, hops=9)
    with pytest.raises(TaskDataError, match="not a relation"):
        depth.check(np.array([1, 2, depth.pad]), np.zeros(3))


@pytest.fixture(scope="module")
def systematic():
    return KGSystematicTask(
        num_entities=200, num_relations=20, facts_per_entity=10, inferred_ratio=3.0, ood_fraction=0.1, seed=1
    )


def test_systematic_split_sizes_and_ratio(systematic):
    sets = systematic.datasets()
    n_atomic = 200 * 10
    n_id_atomic = int((~systematic.is_ood[systematic.atomic_heads]).sum())
    assert len(sets["atomic"]) == n_atomic and len(as_tuples(sets["atomic"])) == n_atomic
    assert len(systematic.ood_entities) == 20 and n_id_atomic == 1800
    assert len(sets["train_inferred"]) == round(3.0 * n_id_atomic)  # phi = inferred / ID atomic
    assert len(sets["train"]) == n_atomic + len(sets["train_inferred"])
    assert len(sets["test_ood"]) > 0 and len(sets["test_id"]) > 0
    assert not as_tuples(sets["train"]) & as_tuples(sets["test_id"])
    assert not as_tuples(sets["train"]) & as_tuples(sets["test_ood"])
    assert set(np.unique(sets["train"].difficulty)) == {1.0, 2.0}


def test_systematic_answers_follow_the_graph_and_ood_is_never_composed_in_training(systematic):
    sets = systematic.datasets()
    facts = fact_dict(systematic, sets["atomic"])
    ood = set(systematic.ood_entities.tolist())
    # every atomic fact, OOD ones included, is a training row
    assert as_tuples(sets["atomic"]) <= as_tuples(sets["train"])
    for split in ("train_inferred", "test_id", "test_ood"):
        data = sets[split]
        for x, y, b in zip(data.inputs, data.labels, data.meta["bridge"]):
            bridge = facts[(int(x[0]), int(x[1]))]
            assert bridge == b
            assert y[2] == facts[(bridge, int(x[2]))] and y[0] == y[1] == IGNORE_INDEX
            entities = {int(x[0]), bridge}
            if split == "test_ood":
                assert entities <= ood  # both atomic facts have OOD heads
            else:
                assert not entities & ood  # compositions of ID facts only
        assert np.array_equal(systematic.bridges(data.inputs), np.asarray(data.meta["bridge"]))
    sample = sets["test_ood"]
    assert all(systematic.check(x, np.where(y < 0, 0, y)) for x, y in zip(sample.inputs, sample.labels))
    bad = sample.labels[0].copy()
    bad[2] = (bad[2] + 1) % systematic.num_entities
    assert not systematic.check(sample.inputs[0], bad)


def test_systematic_generate_subsamples_a_fixed_split(systematic, tmp_path):
    a = systematic.generate(50, seed=4, split="test_id")
    b = systematic.generate(50, seed=4, split="test_id")
    assert np.array_equal(a.inputs, b.inputs) and as_tuples(a) <= as_tuples(systematic.dataset("test_id"))
    assert np.array_equal(systematic.bridges(a.inputs), np.asarray(a.meta["bridge"]))
    systematic.save(a, tmp_path / "kg.npz")
    back = systematic.load(tmp_path / "kg.npz")
    assert np.array_equal(back.labels, a.labels) and back.meta["bridge"] == a.meta["bridge"]
    with pytest.raises(TaskDataError, match="unknown split"):
        systematic.generate(5, 0, split="valid")


def test_systematic_ratio_too_large_and_registry():
    with pytest.raises(TaskDataError, match="inferred_ratio"):
        KGSystematicTask(num_entities=50, num_relations=5, facts_per_entity=2, inferred_ratio=10.0)
    task = get_task("kg_systematic", num_entities=100, num_relations=10, facts_per_entity=10)
    assert task.vocab_size == 111 and task.seq_len == 3
    assert get_task("kg_depth", max_hops=3).seq_len == 4


def test_a_hop_with_too_few_paths_gives_them_all_and_the_others_take_the_rest() -> None:
    """The ltg_kg_* recipes' held-out set: 360 test paths over 2-4 hops of a 40 x 4 graph, whose 2-hop test
    split holds only 122 paths (a third would be 120, a multinomial draw asked 130): all 122 are taken,
    every row is a distinct test path, and the total is what the recipe asks."""
    task = KGDepthTask(num_entities=40, num_relations=4, max_hops=8, seed=0, test_fraction=0.2)
    assert task.path_count(2, "test") == 122 and task.path_count(1, "train") == 160
    data = task.generate(360, 1, min_hops=2, max_hops=4, split="test", pad_to=9)
    hops, counts = np.unique(data.difficulty, return_counts=True)
    assert len(data) == 360 and dict(zip(hops.tolist(), counts.tolist()))[2.0] == 122
    assert len({row.tobytes() for row in data.inputs}) == 360
    for row, label in zip(data.inputs, data.labels):
        head, rels = task.parse(row)
        assert task.is_test_path(np.array([head]), np.array([rels]))[0]  # the held-out split only
        assert task.check(row, np.where(label >= 0, label, 0))  # the labels follow the graph
    assert KGDepthTask.fit_counts(np.array([3, 4]), [10, None], "x").tolist() == [3, 4]  # fits: unchanged
    assert KGDepthTask.fit_counts(np.array([7, 1, 0]), [2, 3, None], "x").tolist() == [2, 3, 3]
    with pytest.raises(TaskDataError, match="only 8 distinct x paths exist, 9 requested"):
        KGDepthTask.fit_counts(np.array([7, 1, 1]), [2, 3, 3], "x")
