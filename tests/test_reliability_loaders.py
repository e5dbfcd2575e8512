"""Issue 24, every loader validates what it reads: group-word / generated-task ``.npz`` files, ``dataset.json``
of HRM folders (field types, set names confined to the folder, no links out), knowledge-graph JSON folders,
ARC task JSON and puzzle CSVs. Each class of malformed input is a ``TaskDataError`` naming the file (and the
row / record / field) and the reason, never a crash or a silently wrong dataset; a derandomised byte-level
fuzz of each format allows only success or such an error."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from reliability_common import fails_cleanly

from loopformer.cli import cli
from loopformer.tasks.arc import load_folder
from loopformer.tasks.base import IGNORE_INDEX, TaskDataError
from loopformer.tasks.formats import load_hrm_folder, save_hrm_folder
from loopformer.tasks.groups import GroupTask
from loopformer.tasks.kg_files import KGFilesTask
from loopformer.tasks.sudoku import SudokuTask


def _refused(call, *needles: str) -> str:
    with pytest.raises(TaskDataError) as info:
        call()
    text = str(info.value)
    for needle in needles:
        assert needle in text, f"{needle!r} not in {text!r}"
    return text


def _flips(data: bytes, seed: int, n: int) -> list[bytes]:
    """``n`` derandomised mutations of ``data``: a cut, a flipped byte, a run of random bytes."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        b = bytearray(data)
        at = rng.randrange(len(b))
        if i % 3 == 0:
            b = b[:at]
        elif i % 3 == 1:
            b[at] ^= 1 << rng.randrange(8)
        else:
            b[at : at + 8] = bytes(rng.randrange(256) for _ in range(8))
        out.append(bytes(b))
    return out


# ------------------------------------------------------------------------------------------ .npz
GROUP = GroupTask("S3", length=4)  # vocab_size 7


def _npz(path: Path, **arrays) -> Path:
    good = GROUP.generate(3, seed=0)
    base = {"inputs": good.inputs, "labels": good.labels, "difficulty": good.difficulty,
            "meta": np.array(json.dumps({"task": "groups"}))}  # fmt: skip
    base.update(arrays)
    with open(path, "wb") as fh:
        np.savez(fh, **{k: v for k, v in base.items() if v is not None})
    return path


NPZ_CASES = {
    "float tokens": ({"inputs": np.full((3, 4), 1.5)}, "floats such as 1.5"),
    "negative token": ({"inputs": np.array([[1, 2, -3, 1]] * 3)}, "row 0, column 2: token -3 is negative"),
    "out-of-vocabulary input": (
        {"inputs": np.array([[1, 2, 3, 1], [1, 9, 1, 1], [1] * 4])},
        "row 1, column 1",
    ),
    "out-of-vocabulary label": ({"labels": np.array([[1] * 4, [1] * 4, [1, 1, 1, 70]])}, "row 2, column 3"),
    "negative label": ({"labels": np.array([[1] * 4, [1, -5, 1, 1], [1] * 4])}, "other than IGNORE_INDEX"),
    "ragged shapes": ({"labels": np.ones((3, 5), np.int64)}, "must be equal [N, T] arrays"),
    "1-d inputs": ({"inputs": np.ones(3, np.int64), "labels": np.ones(3, np.int64)}, "must be equal [N, T]"),
    "NaN difficulty": ({"difficulty": np.array([1.0, np.nan, 2.0])}, "'difficulty': row 1"),
    "short difficulty": ({"difficulty": np.ones(2)}, "'difficulty' has shape (2,)"),
    "negative puzzle id": ({"puzzle_ids": np.array([0, -1, 2])}, "'puzzle_ids': row 1"),
    "float puzzle ids": ({"puzzle_ids": np.array([0.5, 1, 2])}, "'puzzle_ids' must be 3 integers"),
    "string array": ({"inputs": np.array([["a"] * 4] * 3)}, "not numbers"),
    "missing labels": ({"labels": None}, "missing array(s) ['labels']"),
    "meta not JSON": ({"meta": np.array("{nope")}, "'meta' is not valid JSON"),
    "meta a list": ({"meta": np.array("[1, 2]")}, "must hold a JSON object"),
    "meta numbers": ({"meta": np.arange(3)}, "'meta' must be one JSON string"),
}


@pytest.mark.parametrize("case", sorted(NPZ_CASES))
def test_npz_loader_refuses_each_class_naming_file_and_row(tmp_path, case) -> None:
    arrays, needle = NPZ_CASES[case]
    path = _npz(tmp_path / "d.npz", **arrays)
    _refused(lambda: GROUP.load(path), str(path), needle)


def test_npz_loader_refuses_files_that_are_no_archive(tmp_path) -> None:
    np.save(tmp_path / "a.npy", np.ones((2, 2), np.int64))
    _refused(lambda: GROUP.load(tmp_path / "a.npy"), "a single .npy array")
    with open(tmp_path / "obj.npz", "wb") as fh:
        np.savez(
            fh, inputs=np.array([[1, None]], dtype=object), labels=np.ones((1, 2)), difficulty=np.ones(1)
        )
    _refused(lambda: GROUP.load(tmp_path / "obj.npz"), "without pickle")
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04 not really a zip" * 3)
    _refused(lambda: GROUP.load(tmp_path / "junk.npz"), "not a readable .npz")


def test_npz_loader_accepts_what_save_writes(tmp_path) -> None:
    data = GROUP.generate(5, seed=1)
    GROUP.save(data, tmp_path / "ok.npz")
    back = GROUP.load(tmp_path / "ok.npz")
    assert np.array_equal(back.inputs, data.inputs) and np.array_equal(back.labels, data.labels)
    assert (back.labels == IGNORE_INDEX).sum() == (data.labels == IGNORE_INDEX).sum()


def test_npz_fuzz_gives_a_dataset_or_a_clear_error(tmp_path) -> None:
    GROUP.save(GROUP.generate(6, seed=2), tmp_path / "ok.npz")
    clear = 0
    for i, blob in enumerate(_flips((tmp_path / "ok.npz").read_bytes(), 24, 90)):
        path = tmp_path / f"m{i}.npz"
        path.write_bytes(blob)
        try:
            data = GROUP.load(path)
        except TaskDataError as err:
            assert str(path) in str(err)
            clear += 1
            continue
        assert data.inputs.min() >= 0 and data.inputs.max() < GROUP.vocab_size
    assert clear > 30


# ------------------------------------------------------------------------------------------ dataset.json
@pytest.fixture
def hrm_folder(tmp_path) -> Path:
    task = SudokuTask(4)
    save_hrm_folder(
        task.generate(4, seed=0, min_blanks=2, max_blanks=4), tmp_path / "ds", "train", vocab_size=6
    )
    return tmp_path / "ds"


META_CASES = {
    "vocab_size a string": ({"vocab_size": "12"}, "'vocab_size' must be an integer, got str"),
    "vocab_size a float": ({"vocab_size": 6.5}, "'vocab_size' must be an integer, got float"),
    "vocab_size a bool": ({"vocab_size": True}, "'vocab_size' must be an integer, got bool"),
    "vocab_size null": ({"vocab_size": None}, "'vocab_size' must be an integer, got null"),
    "seq_len zero": ({"seq_len": 0}, "'seq_len' must be >= 1"),
    "seq_len a list": ({"seq_len": [16]}, "'seq_len' must be an integer"),
    "ids negative": ({"num_puzzle_identifiers": -1}, "'num_puzzle_identifiers' must be >= 0"),
    "ignore a string": ({"ignore_label_id": "0"}, "'ignore_label_id' must be an integer"),
    "mean a string": ({"mean_puzzle_examples": "1"}, "'mean_puzzle_examples' must be a finite number"),
    "sets a string": ({"sets": "all"}, "'sets' must be a non-empty list"),
    "sets empty": ({"sets": []}, "'sets' must be a non-empty list"),
    "set a number": ({"sets": [1]}, "set name must be a string"),
    "set parent": ({"sets": ["../x"]}, "'../x' is not a plain name"),
    "set absolute": ({"sets": ["/etc/passwd"]}, "is not a plain name"),
    "set nested": ({"sets": ["sub/all"]}, "is not a plain name"),
    "set hidden": ({"sets": [".all"]}, "is not a plain name"),
    "set twice": ({"sets": ["all", "all"]}, "lists 'all' twice"),
    "field missing": ({"seq_len": "<drop>"}, "missing field(s) ['seq_len']"),
}


@pytest.mark.parametrize("case", sorted(META_CASES))
def test_dataset_json_fields_are_checked_by_type_and_range(hrm_folder, case) -> None:
    change, needle = META_CASES[case]
    path = hrm_folder / "train" / "dataset.json"
    meta = json.loads(path.read_text())
    for key, value in change.items():
        meta.pop(key) if value == "<drop>" else meta.__setitem__(key, value)
    path.write_text(json.dumps(meta))
    _refused(lambda: load_hrm_folder(hrm_folder, "train"), str(path), needle)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"vocab_size": 6, "vocab_size": 7}', "given twice"),
        ("[1, 2]", "expected a JSON object"),
        ('{"vocab_size": ', "not valid JSON (line 1"),
        ("[" * 100000, "nested too deeply"),
    ],  # fmt: skip
)
def test_dataset_json_that_is_no_object_is_refused(hrm_folder, text, needle) -> None:
    path = hrm_folder / "train" / "dataset.json"
    path.write_text(text)
    _refused(lambda: load_hrm_folder(hrm_folder, "train"), str(path), needle)
    path.write_bytes(b'{"vocab_size": "\xff"}')
    _refused(lambda: load_hrm_folder(hrm_folder, "train"), "not UTF-8")


def test_dataset_arrays_linked_outside_the_folder_are_refused(hrm_folder, tmp_path) -> None:
    outside = tmp_path / "elsewhere.npy"
    target = hrm_folder / "train" / "all__inputs.npy"
    os.replace(target, outside)
    target.symlink_to(outside)
    _refused(lambda: load_hrm_folder(hrm_folder, "train"), "all__inputs.npy", "outside the dataset folder")
    target.unlink()
    os.replace(outside, hrm_folder / "train" / "real.npy")
    target.symlink_to("real.npy")  # a link that stays inside the folder is fine
    assert len(load_hrm_folder(hrm_folder, "train")) == 4


# ------------------------------------------------------------------------------------------ KG JSON folders
def _kg(root: Path, vocab=None, train=None, extra: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    vocab = ["<e_0>", "<e_1>", "<r_0>", "</a>"] if vocab is None else vocab
    train = [{"input_text": "<e_0><r_0>", "target_text": "<e_0><r_0><e_1></a>", "type": "atomic"}] if train is None \
        else train  # fmt: skip
    (root / "vocab.json").write_text(json.dumps(vocab) if not isinstance(vocab, bytes) else "")
    if isinstance(vocab, bytes):
        (root / "vocab.json").write_bytes(vocab)
    (root / "train.json").write_text(json.dumps(train))
    for name, value in (extra or {}).items():
        (root / name).write_text(value)
    return root


def _rec(inp, tgt, kind="2hop"):
    return [{"input_text": inp, "target_text": tgt, "type": kind}]


KG_CASES = {
    "vocab repeats": (
        {"vocab": ["<e_0>", "<e_1>", "<e_0>", "<r_0>"]},
        "vocab.json: entry 2 '<e_0>' repeats entry 0",
    ),
    "vocab number": ({"vocab": ["<e_0>", 3]}, "vocab.json: entry 1 is int"),
    "vocab not a token": ({"vocab": ["<e_0>", "e_1"]}, "entry 1 'e_1' is not one <...> token"),
    "vocab an object": ({"vocab": {"<e_0>": 0}}, "must be a JSON list of token strings"),
    "vocab not utf-8": ({"vocab": b'["\xff"]'}, "not UTF-8"),
    "input not a string": (
        {"train": [{"input_text": 5, "target_text": "<e_1>"}]},
        "record 0: 'input_text' is int",
    ),
    "type not a string": ({"train": _rec("<e_0><r_0>", "<e_1>", kind=["a"])}, "'type' is list"),
    "query one token": ({"train": _rec("<e_0>", "<e_0><e_1>")}, "a query is an entity and relations"),
    "pad inside query": ({"train": _rec("<e_0><pad><r_0>", "<e_1>")}, "holds <pad>"),
    "target not the query": (
        {"train": _rec("<e_0><r_0>", "<e_1><r_0><e_1></a>")},
        "neither is the answer alone",
    ),
    "unknown token": ({"train": _rec("<e_0><r_9>", "<e_1>")}, "unknown tokens ['<r_9>']"),
    "no answer": ({"train": _rec("<e_0><r_0>", "</a>")}, "target_text has no answer token"),
    "records an object": ({"train": {"a": 1}}, "must hold a JSON list of records"),
    "record a list": ({"train": [["<e_0>"]]}, "record 0: needs 'input_text'"),
}


@pytest.mark.parametrize("case", sorted(KG_CASES))
def test_kg_folder_loader_refuses_each_class_naming_file_and_record(tmp_path, case) -> None:
    change, needle = KG_CASES[case]
    root = _kg(tmp_path / "kg", **change)

    def load():
        return KGFilesTask(root).load("train.json")

    _refused(load, str(root), needle)


@pytest.mark.parametrize(("options", "needle"), [({"width": -1}, "width must be an integer >= 0"),
                                                 ({"types": "2hop"}, "types must be a list"),
                                                 ({"width": 1.5}, "width must be an integer")])  # fmt: skip
def test_kg_folder_options_are_checked(tmp_path, options, needle) -> None:
    _refused(lambda: KGFilesTask(_kg(tmp_path / "kg"), **options), needle)


def test_kg_folder_loads_and_a_width_error_names_the_file_record(tmp_path) -> None:
    recs = [
        *_rec("<e_0><r_0>", "<e_1>", "atomic"),
        *_rec("<e_0><r_0><r_0>", "<e_0><r_0><r_0><e_1></a>", "2hop"),
    ]
    root = _kg(tmp_path / "kg", train=recs)
    data = KGFilesTask(root).load("train.json")
    assert data.inputs.shape == (2, 3) and data.labels[0, 1] == KGFilesTask(root).vocab["<e_1>"]
    _refused(
        lambda: KGFilesTask(root, width=2, types=["2hop"]).load("train.json"),
        "record 1",
        "do not fit width 2",
    )


def test_kg_fuzz_gives_a_dataset_or_a_clear_error(tmp_path) -> None:
    recs = [*_rec("<e_0><r_0>", "<e_0><r_0><e_1></a>", "atomic")] * 4
    root = _kg(tmp_path / "kg", train=recs)
    good = (root / "train.json").read_bytes()
    for i, blob in enumerate(_flips(good, 7, 60) + _flips((root / "vocab.json").read_bytes(), 8, 30)):
        name = "train.json" if i < 60 else "vocab.json"
        (root / "train.json").write_bytes(good)
        (root / name).write_bytes(blob)
        try:
            KGFilesTask(root).load("train.json")
        except TaskDataError as err:
            assert str(root) in str(err)
        (root / "vocab.json").write_text(json.dumps(["<e_0>", "<e_1>", "<r_0>", "</a>"]))


# ------------------------------------------------------------------------------------------ ARC JSON
GRID = [[1, 2], [3, 4]]
ARC_CASES = {
    "ragged grid": ({"train": [{"input": [[1, 2], [3]], "output": GRID}]}, "ragged grid, row 1"),
    "colour 10": ({"train": [{"input": [[1, 10]], "output": GRID}]}, "row 0 column 1 holds 10"),
    "negative colour": ({"train": [{"input": [[-1]], "output": GRID}]}, "holds -1"),
    "float colour": ({"train": [{"input": [[1.5]], "output": GRID}]}, "holds 1.5"),
    "bool colour": ({"train": [{"input": [[True]], "output": GRID}]}, "holds True"),
    "31 rows": ({"train": [{"input": [[1]] * 31, "output": GRID}]}, "31 rows, more than 30"),
    "31 columns": ({"test": [{"input": [[1] * 31]}]}, "row 0 has 31 cells"),
    "empty grid": ({"train": [{"input": [], "output": GRID}]}, "non-empty list of rows"),
    "no train": ({"train": "<drop>"}, "expected an object with 'train' and 'test'"),
    "no test": ({"test": "<drop>"}, "expected an object with 'train' and 'test'"),
    "empty test": ({"test": []}, "at least one train and one test pair"),
    "train output missing": ({"train": [{"input": GRID}]}, "train pair 0 has no 'output'"),
    "test not a list": ({"test": {"input": GRID}}, "'test' must be a list of pairs"),
}


@pytest.mark.parametrize("case", sorted(ARC_CASES))
def test_arc_task_files_refuse_each_class_naming_file_and_pair(tmp_path, case) -> None:
    change, needle = ARC_CASES[case]
    task = {"train": [{"input": GRID, "output": GRID}], "test": [{"input": GRID, "output": GRID}]}
    for key, value in change.items():
        task.pop(key) if value == "<drop>" else task.__setitem__(key, value)
    (tmp_path / "t1.json").write_text(json.dumps(task))
    _refused(lambda: load_folder(tmp_path), str(tmp_path / "t1.json"), needle)


# ------------------------------------------------------------------------------------------ CSV
SUDOKU4 = SudokuTask(4)


def _csv(path: Path, header: str, rows: int = 2) -> Path:
    data = SUDOKU4.generate(rows, seed=0, min_blanks=2, max_blanks=4)
    lines = [header] + [
        f"s,{SUDOKU4.format_grid(q)},{SUDOKU4.format_grid(a)},1" for q, a in zip(data.inputs, data.labels)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("header", ["source,question,answer,question", "source,question,answer,answer",
                                    "rating,question,answer,rating"])  # fmt: skip
def test_csv_with_a_duplicated_column_is_refused(tmp_path, header) -> None:
    path = _csv(tmp_path / "d.csv", header)
    text = _refused(lambda: SUDOKU4.load(path), str(path), "line 1 (the header)", "appears twice")
    fails_cleanly(CliRunner().invoke(cli, ["data", "stats", "sudoku", str(path)]), "appears twice")
    assert "fields" in text


@pytest.mark.parametrize(("row", "needle"), [("s,1.5.............,1234341221434321,1", "line 2"),
                                             ("s,1234341221434321,1234341221434329,1", "line 2"),
                                             ("s,12 34,1234341221434321,1", "line 2")])  # fmt: skip
def test_csv_rows_with_foreign_tokens_are_refused_with_the_line(tmp_path, row, needle) -> None:
    path = tmp_path / "d.csv"
    path.write_text(f"source,question,answer,rating\n{row}\n")
    _refused(lambda: SUDOKU4.load(path), str(path), needle)


def test_generated_dataset_files_through_the_cli_never_crash(tmp_path) -> None:
    GROUP.save(GROUP.generate(4, seed=0), tmp_path / "ok.npz")
    for i, blob in enumerate(_flips((tmp_path / "ok.npz").read_bytes(), 3, 12)):
        path = tmp_path / f"m{i}.npz"
        path.write_bytes(blob)
        result = CliRunner().invoke(cli, ["data", "stats", "groups", str(path), "-t", "group=S3"])
        text = result.output + ("" if result.exception is None or isinstance(result.exception, SystemExit)
                                else repr(result.exception))  # fmt: skip
        assert "internal error" not in text and "Traceback" not in text, text
