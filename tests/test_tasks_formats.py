"""HRM / TRM on-disk puzzle folders: round trips, a hand-built HRM folder, and clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loopformer.tasks.base import IGNORE_INDEX, TaskDataError, TokenDataset
from loopformer.tasks.formats import METADATA_FIELDS, load_hrm_folder, save_hrm_folder
from loopformer.tasks.maze import MazeTask
from loopformer.tasks.sudoku import SudokuTask


def test_sudoku_round_trip_and_hrm_layout(tmp_path) -> None:
    task = SudokuTask(4)
    ds = task.generate(6, seed=0, workers=1)
    save_hrm_folder(ds, tmp_path, "train", vocab_size=task.vocab_size)
    folder = tmp_path / "train"
    meta = json.loads((folder / "dataset.json").read_text())
    assert set(METADATA_FIELDS) <= set(meta)
    assert meta["vocab_size"] == 6 and meta["seq_len"] == 16 and meta["sets"] == ["all"]
    assert meta["pad_id"] == 0 and meta["ignore_label_id"] == 0 and meta["num_puzzle_identifiers"] == 1
    assert meta["total_groups"] == 6 and meta["mean_puzzle_examples"] == 1.0
    inputs = np.load(folder / "all__inputs.npy")
    assert inputs.dtype == np.uint8 and inputs.shape == (6, 16)
    assert np.load(folder / "all__puzzle_indices.npy").dtype == np.int32
    assert np.load(folder / "all__group_indices.npy").tolist() == list(range(7))
    assert json.loads((tmp_path / "identifiers.json").read_text()) == ["<blank>"]
    back = load_hrm_folder(tmp_path, "train")
    assert np.array_equal(back.inputs, ds.inputs) and np.array_equal(back.labels, ds.labels)
    assert np.array_equal(back.difficulty, ds.difficulty)
    assert back.puzzle_ids.tolist() == [0] * 6


def test_round_trip_with_puzzle_ids_and_ignored_labels(tmp_path) -> None:
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, 12, size=(7, 10))
    labels = rng.integers(1, 12, size=(7, 10))
    labels[:, :3] = IGNORE_INDEX
    ids = np.array([3, 3, 1, 1, 1, 3, 0])
    ds = TokenDataset(inputs, labels, np.arange(7.0), ids)
    save_hrm_folder(ds, tmp_path, "test", vocab_size=12)
    folder = tmp_path / "test"
    assert np.load(folder / "all__puzzle_identifiers.npy").tolist() == [3, 1, 3, 0]
    assert np.load(folder / "all__puzzle_indices.npy").tolist() == [0, 2, 5, 6, 7]
    assert (np.load(folder / "all__labels.npy")[:, :3] == 0).all()
    back = load_hrm_folder(tmp_path, "test")
    assert np.array_equal(back.labels, labels) and np.array_equal(back.puzzle_ids, ids)
    assert np.array_equal(back.inputs, inputs)


def write_hrm_folder(root, inputs, labels, identifiers, puzzle_indices, group_indices, **meta_overrides):
    """A folder as HRM's builders write it (no difficulty file)."""
    folder = root / "train"
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "all__inputs.npy", np.asarray(inputs, dtype=np.uint8))
    np.save(folder / "all__labels.npy", np.asarray(labels, dtype=np.uint8))
    np.save(folder / "all__puzzle_identifiers.npy", np.asarray(identifiers, dtype=np.int32))
    np.save(folder / "all__puzzle_indices.npy", np.asarray(puzzle_indices, dtype=np.int32))
    np.save(folder / "all__group_indices.npy", np.asarray(group_indices, dtype=np.int32))
    meta = {
        "pad_id": 0,
        "ignore_label_id": 0,
        "blank_identifier_id": 0,
        "vocab_size": 6,
        "seq_len": 4,
        "num_puzzle_identifiers": 3,
        "total_groups": len(group_indices) - 1,
        "mean_puzzle_examples": len(inputs) / (len(puzzle_indices) - 1),
        "sets": ["all"],
    }
    meta.update(meta_overrides)
    (folder / "dataset.json").write_text(json.dumps(meta))
    return folder


def test_reads_hand_built_hrm_folder_with_groups(tmp_path) -> None:
    inputs = np.arange(20).reshape(5, 4) % 6
    labels = np.array([[0, 1, 2, 3]] * 5)
    # puzzles: [0,2) id 1, [2,3) id 2, [3,5) id 1 ; groups: puzzles [0,2) and [2,3)
    write_hrm_folder(tmp_path, inputs, labels, [1, 2, 1], [0, 2, 3, 5], [0, 2, 3])
    ds = load_hrm_folder(tmp_path, "train", task=MazeTaskStub())
    assert ds.puzzle_ids.tolist() == [1, 1, 2, 1, 1]
    assert ds.meta["group_ids"] == [0, 0, 0, 1, 1]
    assert (ds.labels[:, 0] == IGNORE_INDEX).all() and (ds.labels[:, 1:] == [1, 2, 3]).all()
    assert ds.difficulty.tolist() == [float(x.sum()) for x in inputs]


class MazeTaskStub(MazeTask):
    name = "maze_stub"  # a stand-in task for its difficulty only (not a real maze: no maze agreement check)
    label_rule = ""

    def __init__(self) -> None:
        super().__init__(3)

    def difficulty(self, inputs: np.ndarray) -> float:
        return float(np.sum(inputs))


def test_errors_name_the_file(tmp_path) -> None:
    inputs, labels = np.ones((3, 4)), np.ones((3, 4))
    base = dict(
        inputs=inputs,
        labels=labels,
        identifiers=[0, 0, 0],
        puzzle_indices=[0, 1, 2, 3],
        group_indices=[0, 1, 2, 3],
    )

    def build(name, **changes):
        root = tmp_path / name
        args = dict(base)
        meta = changes.pop("meta", {})
        args.update(changes)
        return root, write_hrm_folder(root, **args, **meta)

    with pytest.raises(TaskDataError, match="missing split folder"):
        load_hrm_folder(tmp_path / "nothing", "train")

    root, folder = build("nolabels")
    (folder / "all__labels.npy").unlink()
    with pytest.raises(TaskDataError, match=r"all__labels\.npy does not exist"):
        load_hrm_folder(root)

    root, folder = build("truncated")
    raw = (folder / "all__inputs.npy").read_bytes()
    (folder / "all__inputs.npy").write_bytes(raw[: len(raw) - 5])
    with pytest.raises(TaskDataError, match=r"all__inputs\.npy: unreadable or truncated"):
        load_hrm_folder(root)

    root, folder = build("garbage")
    (folder / "all__group_indices.npy").write_bytes(b"not an npy file at all")
    with pytest.raises(TaskDataError, match=r"all__group_indices\.npy: unreadable"):
        load_hrm_folder(root)

    root, _ = build("shape", labels=np.ones((2, 4)))
    with pytest.raises(TaskDataError, match=r"all__labels\.npy: shape \(2, 4\) differs"):
        load_hrm_folder(root)

    root, _ = build("seqlen", meta={"seq_len": 5})
    with pytest.raises(TaskDataError, match="seq_len 5"):
        load_hrm_folder(root)

    root, _ = build("nonmonotone", puzzle_indices=[0, 2, 1, 3])
    with pytest.raises(TaskDataError, match=r"all__puzzle_indices\.npy: puzzle offsets are not monotone"):
        load_hrm_folder(root)

    root, _ = build("badend", group_indices=[0, 1, 2])
    with pytest.raises(TaskDataError, match=r"all__group_indices\.npy: group offsets end at 2, expected 3"):
        load_hrm_folder(root)

    root, _ = build("ids", identifiers=[0, 0])
    with pytest.raises(TaskDataError, match=r"all__puzzle_identifiers\.npy: shape"):
        load_hrm_folder(root)

    root, _ = build("vocab", meta={"vocab_size": 1})
    with pytest.raises(TaskDataError, match="tokens outside"):
        load_hrm_folder(root)

    root, folder = build("json")
    (folder / "dataset.json").write_text("{not json")
    with pytest.raises(TaskDataError, match=r"dataset\.json: not valid JSON"):
        load_hrm_folder(root)


def test_save_rejects_tokens_outside_vocab(tmp_path) -> None:
    ds = TokenDataset(np.full((2, 3), 7), np.full((2, 3), 1), np.zeros(2))
    with pytest.raises(TaskDataError, match="vocab_size=5"):
        save_hrm_folder(ds, tmp_path, vocab_size=5)
