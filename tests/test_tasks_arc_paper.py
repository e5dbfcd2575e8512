"""TRM / HRM's ARC protocol: Kaggle-combined subsets read as they are, the training set (demonstrations of
every task + test pairs outside the held-out subset), labels without PAD loss, the evaluators' crop and
the vote with ties broken by mean Q."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loopformer.tasks.arc import ArcTask, crop_grid, encode_grid, rank_votes
from loopformer.tasks.base import IGNORE_INDEX, TaskDataError


def task_json(seed: int, n_train: int = 2) -> dict:
    rng = np.random.default_rng(seed)

    def pair() -> dict:
        g = rng.integers(0, 10, size=(int(rng.integers(1, 4)), int(rng.integers(1, 4))))
        return {"input": g.tolist(), "output": ((g + 1) % 10).tolist()}

    return {"train": [pair() for _ in range(n_train)], "test": [pair()]}


def write_combined(folder, subsets=("training", "evaluation", "concept")) -> str:
    """Files named as TRM's kaggle/combined/arc-agi_{subset}_challenges.json / _solutions.json."""
    folder.mkdir(parents=True, exist_ok=True)
    for s, subset in enumerate(subsets):
        tasks = {f"{subset[:2]}{i}": task_json(10 * s + i) for i in range(2)}
        sols = {tid: [t["test"][0].pop("output")] for tid, t in tasks.items()}
        (folder / f"arc-agi_{subset}_challenges.json").write_text(json.dumps(tasks))
        (folder / f"arc-agi_{subset}_solutions.json").write_text(json.dumps(sols))
    return str(folder / "arc-agi")


def test_crop_grid_is_the_evaluators_crop() -> None:
    grid = np.arange(6).reshape(2, 3)
    tokens = encode_grid(grid)
    np.testing.assert_array_equal(crop_grid(tokens), grid)
    junk = tokens.copy()
    junk[29 * 30 + 29] = 7  # a stray colour far away does not change the crop
    junk[2 * 30 + 0] = 5  # a colour under the grid where the EOS row was: a taller, narrower block
    np.testing.assert_array_equal(crop_grid(junk), grid)  # 2x3 = 6 > 3x1 = 3
    assert crop_grid(np.zeros(900, dtype=np.int64)).shape == (0, 0)
    full = np.full(900, 4)
    assert crop_grid(full).shape == (30, 30)


def test_rank_votes_breaks_ties_by_mean_q() -> None:
    a, b, c = np.array([[1]]), np.array([[2]]), np.array([[3]])
    ranked = rank_votes([a, b, b, a, c, None], [0.2, 0.9, 0.7, 0.4, 0.99, 1.0])
    assert [(g.item(), n) for g, n, _ in ranked] == [(2, 2), (1, 2), (3, 1)]
    assert ranked[0][2] == pytest.approx(0.8) and ranked[1][2] == pytest.approx(0.3)
    ranked = rank_votes([a, b], [0.1, 0.5])
    assert [g.item() for g, _, _ in ranked] == [2, 1]  # one vote each: higher q first


def test_combined_subsets_protocol(tmp_path) -> None:
    prefix = write_combined(tmp_path / "combined")
    task = ArcTask(
        prefix,
        subsets=["training", "evaluation", "concept"],
        test_subset="evaluation",
        augmentations=2,
        ignore_pad=True,
        decode="crop",
        keep_one_untranslated=True,
    )
    assert len(task.puzzles) == 6 and len(task.held_out) == 2
    train = task.generate(0, seed=0, part="train")
    test = task.generate(0, seed=0, part="test")
    # train: 2 demos of every task + the test pair of the 4 non-held-out tasks, per version (3)
    assert len(train) == 3 * (6 * 2 + 4) and len(test) == 3 * 2
    held = {task.puzzles[i].id for i in task.held_out}
    assert set(task.solutions()) == held
    assert {task.puzzles[task.task_version(p)[0]].id for p in test.puzzle_ids} == held
    assert (train.labels == 0).sum() == 0 and (train.labels == IGNORE_INDEX).any()  # PAD carries no loss
    # one untranslated row per (task, version): it sits at the top-left corner
    top_left = [x.reshape(30, 30)[0, 0] >= 2 for x in train.inputs]
    assert sum(top_left) >= 6 * 3
    # the evaluation: labels as predictions are right after de-augmenting and voting
    preds = np.where(test.labels == IGNORE_INDEX, 0, test.labels)
    assert task.evaluate(test.inputs, test.puzzle_ids, preds)["score"] == 1.0


def test_vote_predictions_uses_q_for_ties(tmp_path) -> None:
    prefix = write_combined(tmp_path / "combined", subsets=("training", "evaluation"))
    task = ArcTask(prefix, subsets=["training", "evaluation"], augmentations=1)
    test = task.generate(0, seed=0, part="test")
    t0 = [i for i, p in enumerate(test.puzzle_ids) if task.task_version(p)[0] == sorted(task.held_out)[0]]
    assert len(t0) == 2  # two versions of the first held-out task: one right, one wrong
    preds = test.labels.copy()
    t, v = task.task_version(test.puzzle_ids[t0[1]])
    preds[t0[1]] = encode_grid(task.augmentation(t, v).apply(np.array([[9, 9, 9]])))
    tid = task.puzzles[t].id
    q = np.zeros(len(test))
    q[t0[0]], q[t0[1]] = -3.0, 3.0
    first = task.vote_predictions(test.inputs, test.puzzle_ids, preds, k=1, q_logits=q)[tid][0][0]
    assert first.tolist() == [[9, 9, 9]]
    q[t0[0]], q[t0[1]] = 3.0, -3.0
    first = task.vote_predictions(test.inputs, test.puzzle_ids, preds, k=1, q_logits=q)[tid][0][0]
    assert first.tolist() != [[9, 9, 9]]


def test_subset_errors_name_the_files(tmp_path) -> None:
    prefix = write_combined(tmp_path / "combined", subsets=("training",))
    with pytest.raises(TaskDataError, match="test_subset 'evaluation'"):
        ArcTask(prefix, subsets=["training"])
    with pytest.raises(TaskDataError, match="arc-agi_nope_challenges.json"):
        ArcTask(prefix, subsets=["training", "nope"], test_subset="training")
    with pytest.raises(TaskDataError, match="decode"):
        ArcTask(prefix, subsets=["training"], test_subset="training", decode="fuzzy")
