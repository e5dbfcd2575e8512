"""Issue 16, config and input files: every value is checked when the config is built (the key named),
duplicate YAML keys and alias bombs are refused, and non-UTF-8 / structurally wrong recipe, ARC and
Kaggle files get errors naming the file (and line or key), never their contents."""

from __future__ import annotations

import json
import time

import pytest
import torch

from loopformer.config import ConfigError, build_config, load_config, load_config_file, read_recipe
from loopformer.tasks.arc import load_folder, load_kaggle
from loopformer.tasks.base import TaskDataError

GOOD_GRID = [[1, 2], [3, 4]]
GOOD_TASK = {"train": [{"input": GOOD_GRID, "output": GOOD_GRID}], "test": [{"input": GOOD_GRID}]}


BAD_VALUES = [
    ("eval.batch_size=0", "eval.batch_size"),
    ("eval.max_examples=-1", "eval.max_examples"),
    ("eval.segments=0", "eval.segments"),
    ("model.d_model=0", "model.d_model"),
    ("model.n_heads=0", "model.n_heads"),
    ("model.d_model=30", "divisible by model.n_heads"),
    ("model.expansion=-1", "model.expansion"),
    ("data.options={no_such_option: 1}", "data.options.no_such_option"),
    ("data.train_generate={bogus: 1}", "data.train_generate.bogus"),
    ("data.task=sudokoo", "data.task"),
    ("train.threads=100000", "train.threads"),
    ("train.lr=1e39", "train.lr"),
    ("train.lr=.nan", "train.lr"),
    ("train.weight_decay=-0.1", "train.weight_decay"),
    ("train.grad_clip=-1", "train.grad_clip"),
    ("train.betas=[0.9, 1.5]", "train.betas[1]"),
    ("train.eps=0", "train.eps"),
    ("train.min_lr_ratio=2", "train.min_lr_ratio"),
    ("train.max_loss=.nan", "train.max_loss"),
    ("train.loop_sampler=poisson", "train.loop_sampler"),
    ("train.loop_sampler_options={mean: 4, nope: 1}", "train.loop_sampler"),
    ("data.curriculum.threshold=1.5", "data.curriculum.threshold"),
    ("data.curriculum.step=0", "data.curriculum.step"),
    ("data.train_size=-5", "data.train_size"),
    ("seed=-1", "seed"),
]


@pytest.mark.parametrize(("override", "key"), BAD_VALUES, ids=[o for o, _ in BAD_VALUES])
def test_bad_values_are_refused_when_the_config_is_built(override: str, key: str) -> None:
    extra = ["train.loop_sampler_options={}"] if override == "train.loop_sampler=poisson" else []
    if override == "train.loop_sampler=poisson":
        extra = ["train.loop_sampler_options={mean: 4, low: 9, high: 2}"]
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        build_config({}, [override, *extra])


def test_good_values_still_build() -> None:
    cfg = build_config(
        {},
        [
            "model.d_model=32",
            "model.n_heads=4",
            "train.lr=3e-4",
            "train.threads=1",
            "eval.max_examples=0",
            "data.options={size: 4}",
        ],
    )
    assert cfg.train.lr == 3e-4


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_device_cuda_without_cuda_is_refused() -> None:
    with pytest.raises(ConfigError, match="device=cuda.*no CUDA"):
        build_config({}, ["device=cuda"])


def test_duplicate_yaml_keys_are_errors_naming_file_and_line(tmp_path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  lr: 0.1\n  steps: 3\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=r"r\.yaml: line 4: duplicate key 'lr' \(first given on line 2\)"):
        read_recipe(recipe)
    with pytest.raises(ConfigError, match="duplicate key"):
        build_config({}, ["train.loop_sampler_options={mean: 1, mean: 2}"])


def test_an_alias_bomb_is_refused_quickly(tmp_path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 7):  # 10^6 values once expanded
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]")
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text("\n".join(lines) + "\n")
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="bomb.yaml: line .*aliases"):
        read_recipe(recipe)
    assert time.perf_counter() - t0 < 2.0
    small = tmp_path / "ok.yaml"
    small.write_text("x: &v 3\ntrain: {steps: *v}\n")
    assert read_recipe(small)["train"] == {"steps": 3}


def test_a_recursive_alias_is_refused(tmp_path) -> None:
    from loopformer.config import parse_override

    with pytest.raises(ConfigError, match="recursive"):
        parse_override("train.loop_sampler_options=&a [*a]")
    recipe = tmp_path / "loop.yaml"
    recipe.write_text("a: &x {b: *x}\n")
    with pytest.raises(ConfigError, match=r"loop\.yaml: line 1: .*recursive"):
        read_recipe(recipe)


def test_yaml_errors_name_line_and_never_quote_the_file(tmp_path) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("train:\n  steps: 3\n secret_token_123: [\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml is not valid YAML: .* at line \d+") as info:
        read_recipe(recipe)
    assert "secret_token_123" not in str(info.value)


def test_non_utf8_recipe_and_config_files_name_the_file(tmp_path) -> None:
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes("train: {steps: 3}  # caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.yaml is not UTF-8 text \(byte 24 is 0xe9\)"):
        load_config(recipe)
    cfg = tmp_path / "config.json"
    cfg.write_bytes(b'{"seed": 1, "x": "\xff"}')
    with pytest.raises(ConfigError, match=r"config\.json: not UTF-8 text \(byte 18\)"):
        load_config_file(cfg)
    cfg.write_text('{"seed": 1,\n "secret_abc": }')
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON \(line 2") as info:
        load_config_file(cfg)
    assert "secret_abc" not in str(info.value)


def _task_file(folder, name: str, content: bytes | str) -> None:
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"train": [], "test": [\xff]}', r"t\.json: not UTF-8 text \(byte 23\)"),
        ('{"train": [\n{"input": [[1]], "output": [[1]]},\n', r"t\.json: not valid JSON \(line 3"),
        (json.dumps({"train": 5, "test": []}), r"t\.json: task t: 'train' must be a list of pairs, got int"),
        (json.dumps({"train": {"a": 1}, "test": []}), r"'train' must be a list"),
        (
            json.dumps(
                {"train": [{"input": [[1, "x"]], "output": GOOD_GRID}], "test": [{"input": GOOD_GRID}]}
            ),
            r"t\.json: task t train pair 0 input: row 0 column 1",
        ),
        (json.dumps([1, 2]), r"t\.json: task t: expected an object"),
        ("[" * 100000, r"t\.json: (JSON nested too deeply|not valid JSON)"),
    ],
    ids=["non-utf8", "bad-json", "train-int", "train-object", "bad-cell", "not-an-object", "deep-nesting"],
)
def test_wrong_arc_task_files_name_file_and_place(tmp_path, content, message) -> None:
    _task_file(tmp_path / "arc", "t.json", content)
    with pytest.raises(TaskDataError, match=message):
        load_folder(tmp_path / "arc")


@pytest.mark.parametrize(
    ("challenges", "solutions", "message"),
    [
        ({"t1": GOOD_TASK}, [1, 2], r"expected an object mapping task id"),
        ({"t1": GOOD_TASK}, {"t1": {"a": 1}}, r"c\.json: task t1: solutions must be a list"),
        ({"t1": GOOD_TASK}, {"t1": []}, r"task t1: solutions hold 0 grids"),
        ({"t1": {"train": 3, "test": []}}, {}, r"c\.json: task t1: 'train' must be a list"),
        ([GOOD_TASK], {}, r"c\.json: expected an object mapping task id"),
    ],
    ids=["solutions-a-list", "solutions-not-grids", "solutions-empty", "train-int", "challenges-a-list"],
)
def test_wrong_kaggle_files_name_file_and_key(tmp_path, challenges, solutions, message) -> None:
    (tmp_path / "c.json").write_text(json.dumps(challenges))
    (tmp_path / "s.json").write_text(json.dumps(solutions))
    with pytest.raises(TaskDataError, match=message):
        load_kaggle(tmp_path / "c.json", tmp_path / "s.json")


def test_non_utf8_kaggle_files_name_the_file(tmp_path) -> None:
    (tmp_path / "c.json").write_bytes(b"\x80{}")
    (tmp_path / "s.json").write_text("{}")
    with pytest.raises(TaskDataError, match=r"c\.json: not UTF-8"):
        load_kaggle(tmp_path / "c.json", tmp_path / "s.json")
    (tmp_path / "c.json").write_text(json.dumps({"t1": GOOD_TASK}))
    (tmp_path / "s.json").write_bytes(b'{"t1": "\xff"}')
    with pytest.raises(TaskDataError, match=r"s\.json: not UTF-8"):
        load_kaggle(tmp_path / "c.json", tmp_path / "s.json")


def test_a_data_path_from_a_config_never_has_its_first_line_quoted(tmp_path) -> None:
    from loopformer.tasks.sudoku import SudokuTask

    secret = tmp_path / "secret.csv"
    secret.write_text("root:x:0:0:secret-token-xyz:/root:/bin/bash\n")
    with pytest.raises(TaskDataError, match=r"line 1 \(the header\) lacks column") as info:
        SudokuTask(4).load(secret)
    assert "secret-token-xyz" not in str(info.value)


def test_a_corrupt_npy_header_is_a_clear_error(tmp_path) -> None:
    from loopformer.tasks.formats import load_hrm_folder, save_hrm_folder
    from loopformer.tasks.sudoku import SudokuTask

    task = SudokuTask(4)
    save_hrm_folder(
        task.generate(4, 0, min_blanks=4, max_blanks=6), tmp_path, "train", vocab_size=task.vocab_size
    )
    path = tmp_path / "train" / "all__inputs.npy"
    data = path.read_bytes()
    # an unbalanced header: numpy's parser raised tokenize.TokenError, which escaped before
    path.write_bytes(data[:10] + b"{'descr': '<i8', 'fortran_order': (" + data[40:])
    with pytest.raises(TaskDataError, match=r"all__inputs\.npy: unreadable or truncated \.npy file"):
        load_hrm_folder(tmp_path, "train", task=task)
