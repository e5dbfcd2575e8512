"""Every input bounded (issue 48): no hang, no unbounded allocation, no raw error, one rule at a time.

1. One bounded parser for every value a user types (``-t``, data options, overrides, ``translate``): alias
   bombs and deep nesting refused in the configuration's loader; messages quote bounded excerpts.
2. A file the library reads or appends to is a regular file: a FIFO, ``/dev/zero``, a folder are named.
3. Sizes before work: ``--count`` and maze sizes, a stride-0 tensor in a ``.pt``, JSON nested deeply.
4. ``translate`` validates every value it writes; ``convert`` names the authors' key it refuses.
5. Distributed start-up says what it waits for and gives up after ``train.rendezvous_timeout_s``.
6. A checkpoint's aliases only name tied weights; a checkpoint without its manifest is unverified.
7. Console output survives any encoding. 8. A user recipe named like a shipped one can take it as its base.

Each case fails on the code before this work (``docs/reliability.md``, "Bounded inputs").
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from reliability_common import cli_text, fails_cleanly, newest_checkpoint, rewrite_manifest, tiny_recipe
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from loopformer.cli import cli

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "parity"
# 9 ** 8 = 43 million leaves from 400 characters ("billion laughs"), and the small one
BOMB = "[&a [x,x,x,x,x,x,x,x,x], " + ", ".join(
    f"&{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefg", "bcdefgh")
) + "]"
SMALL_BOMB = "[&a [x,x], &b [*a,*a], &c [*b,*b]]"


def run_cli(*args: str) -> tuple[object, float]:
    start = time.perf_counter()
    result = CliRunner().invoke(cli, list(args))
    return result, time.perf_counter() - start


def one_line(result: object, *needles: str, limit: int = 600) -> str:
    """A clear one-line error of bounded length holding every needle (exit 1, or 2 for click's usage errors)."""
    text = cli_text(result)
    if result.exit_code == 2:  # click's usage error: its usage lines, then one error line
        assert "Traceback" not in text and "internal error" not in text and all(n in text for n in needles), text
    else:
        fails_cleanly(result, *needles)
    error = [line for line in text.splitlines() if line.startswith("Error")]
    assert len(error) == 1 and len(error[0]) < limit, text[:2000]
    return error[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bounds")
    recipe = root / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(train={"eval_every": 0})))
    result = CliRunner().invoke(cli, ["train", str(recipe), "-o", str(root / "run")])
    assert result.exit_code == 0, cli_text(result)[-400:]
    return root / "run"


def copy_run(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return newest_checkpoint(dest)


# ----------------------------------------------------------------------------------- 1. one bounded parser
@pytest.mark.parametrize("bomb", [SMALL_BOMB, BOMB], ids=["small", "43M-leaves"])
def test_an_alias_bomb_in_a_task_option_is_one_short_line(run: Path, bomb: str) -> None:
    result, seconds = run_cli("eval", str(run), "-t", f"min_blanks={bomb}")
    line = one_line(result, "min_blanks")
    assert "expected an integer" in line or "100,000 values through aliases" in line
    result, _ = run_cli("data", "generate", "sudoku", "-t", f"size={bomb}", "-o", str(run.parent / "x.csv"))
    assert "size" in one_line(result) and not (run.parent / "x.csv").exists()


def test_every_typed_value_goes_through_the_bounded_loader() -> None:
    from loopformer.commands.common import parse_pairs
    from loopformer.config import ConfigError, parse_override
    from loopformer.convert.translate import translate

    deep = "[" * 5000 + "]" * 5000
    for value in (BOMB, deep):
        with pytest.raises(ConfigError, match="aliases|nested too deeply"):
            parse_pairs([f"size={value}"], "-t")
        with pytest.raises(ConfigError, match="aliases|nested too deeply"):
            parse_override(f"train.steps={value}")
        with pytest.raises(ConfigError, match="aliases|nested too deeply"):
            translate("hrm", [f"arch.L_cycles={value}"])
    assert parse_pairs(["box=[2,3]", "name=abc", "x="], "-t") == {"box": [2, 3], "name": "abc", "x": ""}


def test_a_huge_key_or_value_is_quoted_as_a_bounded_excerpt(tmp_path: Path) -> None:
    recipe = tmp_path / "k.yaml"
    recipe.write_text("base: sudoku4_fprm\n? " + "k" * 1_000_000 + "\n: 1\n")  # an explicit key: any length
    result, _ = run_cli("train", str(recipe), "-o", str(tmp_path / "r"))
    assert "unknown config key" in one_line(result)
    result, _ = run_cli("train", "sudoku4_fprm", "train.steps=" + "9" * 100_000 + "x", "-o", str(tmp_path / "r"))
    assert "train.steps" in one_line(result)


# ----------------------------------------------------------------------------------- 2. regular files only
def test_data_show_and_stats_name_a_fifo_or_a_device(tmp_path: Path) -> None:
    fifo = tmp_path / "f.csv"
    os.mkfifo(fifo)
    result, _ = run_cli("data", "stats", "sudoku", str(fifo))
    assert "FIFO" in one_line(result, str(fifo))
    if Path("/dev/zero").exists():
        result, _ = run_cli("data", "show", "sudoku", "/dev/zero")
        assert "character device" in one_line(result, "/dev/zero")
    result, _ = run_cli("train", "sudoku4_fprm", f"data.train_path={fifo}", "-o", str(tmp_path / "r"))
    assert "FIFO" in one_line(result, str(fifo)) and "no such file" not in result.output


def test_run_files_recipes_and_json_must_be_regular_files(run: Path, tmp_path: Path) -> None:
    from loopformer.config import ConfigError, read_recipe
    from loopformer.files import WriteError, append_line, read_json

    fifo = tmp_path / "metrics.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(WriteError, match="FIFO"):  # a FIFO without a reader: opened at once, refused
        append_line(fifo, "{}")
    with pytest.raises(ConfigError, match="FIFO"):
        read_recipe(fifo)
    with pytest.raises(ValueError, match="is a folder"):
        read_json(tmp_path)
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    (resumed / "metrics.jsonl").unlink()
    os.mkfifo(resumed / "metrics.jsonl")
    result, _ = run_cli("train", str(run.parent / "tiny.yaml"), "-o", str(resumed), "--resume", "train.steps=3")
    assert "FIFO" in one_line(result, "metrics.jsonl")


def test_a_data_file_line_is_bounded_before_the_reader_sizes_the_task(tmp_path: Path) -> None:
    from loopformer.tasks.puzzle_csv import MAX_LINE_BYTES, first_question

    long_line = tmp_path / "long.csv"
    long_line.write_bytes(b"x" * (MAX_LINE_BYTES + 10))
    with pytest.raises(ValueError, match="longer than"):
        first_question(long_line)


# ----------------------------------------------------------------------------------- 3. sizes before work
def test_generation_counts_and_maze_sizes_are_bounded(tmp_path: Path) -> None:
    result, _ = run_cli("data", "generate", "sudoku", "--count", str(10**15), "-o", str(tmp_path / "c.csv"))
    assert "RAM" in one_line(result, "--count")
    result, _ = run_cli("data", "generate", "maze", "-t", "size=4001", "--count", "1", "-o", str(tmp_path / "m.csv"))
    assert "maze size must be in [3, 100]" in one_line(result)


def test_a_stride_0_tensor_in_a_pt_file_is_refused_before_it_is_materialised(tmp_path: Path) -> None:
    big = tmp_path / "big.pt"  # 400 GB when materialised, a few hundred bytes on disk
    torch.save({"model.inner.embed_tokens.embedding_weight": torch.zeros(1).expand(100_000, 1_000_000)}, big)
    assert big.stat().st_size < 10_000
    result, _ = run_cli("convert", "hrm", str(big), "--allow-defaults", "-o", str(tmp_path / "c"))
    assert "storage" in one_line(result, "embed_tokens.embedding_weight")


def test_a_safetensors_header_larger_than_its_data_or_the_model_is_refused(run: Path, tmp_path: Path) -> None:
    import struct

    folder = copy_run(run, tmp_path / "huge")  # a header claiming 400 GB over 4 bytes of data
    name = sorted(load_file(folder / "model.safetensors"))[0]
    header = json.dumps({name: {"dtype": "F32", "shape": [100_000, 1_000_000], "data_offsets": [0, 4]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    rewrite_manifest(folder)
    result, _ = run_cli("eval", str(tmp_path / "huge"), "-o", str(tmp_path / "r1"))
    assert "corrupt or truncated" in one_line(result, "model.safetensors")
    folder = copy_run(run, tmp_path / "shape")  # well-formed, but a shape the model does not have
    tensors = load_file(folder / "model.safetensors")
    with safe_open(folder / "model.safetensors", "pt") as handle:
        meta = handle.metadata()
    tensors[name] = torch.zeros(*tensors[name].shape, 3)
    save_file(tensors, folder / "model.safetensors", metadata=meta)
    rewrite_manifest(folder)
    result, _ = run_cli("eval", str(tmp_path / "shape"), "-o", str(tmp_path / "r2"))
    assert "in the checkpoint but" in one_line(result, name, "shape")


def test_json_from_disk_has_a_depth_bound(run: Path, tmp_path: Path) -> None:
    from loopformer.files import MAX_JSON_DEPTH, read_json

    for depth in (MAX_JSON_DEPTH + 1, 100_000):
        path = tmp_path / f"deep{depth}.json"
        path.write_text("[" * depth + "]" * depth)
        with pytest.raises(ValueError, match="nested too deeply"):
            read_json(path)
    path.write_text("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)
    assert isinstance(read_json(path), list)  # exactly the bound: read
    folder = copy_run(run, tmp_path / "deep")
    (folder / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    result, _ = run_cli("eval", str(tmp_path / "deep"))
    assert "nested too deeply" in one_line(result, "manifest.json")


# ----------------------------------------------------------------------------------- 4. translate / convert
@pytest.mark.parametrize(
    "word, refused",
    [("arch.L_cycles=.inf", "arch.L_cycles"), ("arch.hidden_size=-64", "arch.hidden_size"),
     ("arch.num_heads=0", "arch.num_heads"), ("arch.expansion=abc", "arch.expansion"),
     ("global_batch_size=0", "train.batch_size"), ("lr=.nan", "train.lr")],
)  # fmt: skip
def test_translate_refuses_values_train_would_refuse_naming_the_key_typed(word: str, refused: str) -> None:
    result, _ = run_cli("translate", "hrm", word)
    line = one_line(result, word.split("=")[0], refused)
    assert "loopformer train" not in result.output and "internal error" not in line
    assert "OverflowError" not in line and "could not convert" not in line  # the kind of value, checked first


def test_translate_accepts_values_valid_only_together() -> None:
    result, _ = run_cli("translate", "hrm", "arch.hidden_size=96", "arch.num_heads=3")
    assert result.exit_code == 0, cli_text(result)
    result, _ = run_cli("translate", "hrm", "arch.expansion=2.5")  # a number where the authors' default is 4
    assert result.exit_code == 0 and "model.expansion=2.5" in result.output, cli_text(result)


def test_convert_names_the_authors_key_it_refuses(tmp_path: Path) -> None:
    source = tmp_path / "hrm"
    shutil.copytree(FIXTURES / "hrm", source)
    config = yaml.safe_load((source / "all_config.yaml").read_text())
    config["arch"]["H_cycles"] = -3
    (source / "all_config.yaml").write_text(yaml.safe_dump(config))
    result, _ = run_cli("convert", "hrm", str(source / "step_1"), "-o", str(tmp_path / "out"))
    assert "-3" in one_line(result, "arch.H_cycles", "all_config.yaml")


# ----------------------------------------------------------------------------------- 5. distributed start-up
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_half_set_world_size_says_what_it_waits_for_and_gives_up(tmp_path: Path, monkeypatch, caplog) -> None:
    from loopformer.train.dist import DistEnv, rendezvous

    port = free_port()
    environ = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    start = time.perf_counter()
    with caplog.at_level("INFO", logger="loopformer.train"), pytest.raises(ValueError) as err:
        rendezvous(DistEnv(0, 2), 1.0, environ)
    assert time.perf_counter() - start < 120  # bounded by the timeout, not torch's 30 minutes
    assert f"WORLD_SIZE=2 RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT={port}" in str(err.value)
    assert f"waiting up to 1 s for 2 processes at 127.0.0.1:{port}" in caplog.text
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", **environ}.items():
        monkeypatch.setenv(key, value)
    result, _ = run_cli("train", "sudoku4_fprm", "train.rendezvous_timeout_s=1", "-o", str(tmp_path / "r"))
    assert "unset WORLD_SIZE" in one_line(result, "WORLD_SIZE=2", "train.rendezvous_timeout_s")
    monkeypatch.delenv("MASTER_ADDR")
    result, _ = run_cli("train", "sudoku4_fprm", "-o", str(tmp_path / "r"))
    one_line(result, "MASTER_ADDR")


# ----------------------------------------------------------------------------------- 6. aliases and manifests
def set_aliases(folder: Path, aliases: dict[str, str], drop: tuple[str, ...] = ()) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    with safe_open(path, "pt") as handle:
        meta = handle.metadata()
    meta["aliases"] = json.dumps(aliases)
    save_file({k: v for k, v in tensors.items() if k not in drop}, path, metadata=meta)
    rewrite_manifest(folder)  # the manifest verifies: only the alias rule can refuse it


def test_an_alias_only_names_a_tied_weight(run: Path, tmp_path: Path) -> None:
    names = sorted(load_file(newest_checkpoint(run) / "model.safetensors"))
    same = [(a, b) for a in names for b in names if a < b and
            load_file(newest_checkpoint(run) / "model.safetensors")[a].shape ==
            load_file(newest_checkpoint(run) / "model.safetensors")[b].shape]  # fmt: skip
    a, b = same[0]
    folder = copy_run(run, tmp_path / "stored")
    set_aliases(folder, {a: b})  # an alias replacing a stored tensor with another
    result, _ = run_cli("eval", str(tmp_path / "stored"), "-o", str(tmp_path / "r1"))
    assert "is a stored tensor itself" in one_line(result, a)
    folder = copy_run(run, tmp_path / "missing")
    set_aliases(folder, {a: "no.such.tensor"}, drop=(a,))
    result, _ = run_cli("eval", str(tmp_path / "missing"), "-o", str(tmp_path / "r2"))
    assert "does not hold" in one_line(result, a, "no.such.tensor")


def test_a_checkpoint_without_its_manifest_is_unverified(run: Path, tmp_path: Path, caplog) -> None:
    import loopformer

    folder = copy_run(run, tmp_path / "nomanifest")
    (folder / "manifest.json").unlink()
    with caplog.at_level("WARNING", logger="loopformer"):
        loopformer.load(tmp_path / "nomanifest", device="cpu")
    assert "UNVERIFIED" in caplog.text and "manifest.json" in caplog.text
    from loopformer.runs.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="no manifest.json"):
        loopformer.load(tmp_path / "nomanifest", device="cpu", verify=True)
    result, _ = run_cli("eval", str(tmp_path / "nomanifest"), "--verify", "-o", str(tmp_path / "r"))
    one_line(result, "manifest.json", "--verify")


# ----------------------------------------------------------------------------------- 7. encodings, 8. recipes
def test_console_output_survives_an_ascii_encoding(tmp_path: Path) -> None:
    out = tmp_path / "résumé.csv"
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    cmd = [sys.executable, "-m", "loopformer", "data", "generate", "sudoku", "-t", "size=4", "--count", "2", "-o"]
    proc = subprocess.run([*cmd, str(out)], env=env, capture_output=True, text=True, errors="replace")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-800:]
    assert "r?sum?.csv" in proc.stdout + proc.stderr and out.is_file()


def test_a_user_recipe_named_like_a_shipped_one_can_take_it_as_its_base(tmp_path: Path, monkeypatch) -> None:
    from loopformer.config import RECIPE_DIR, ConfigError, read_recipe

    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "sudoku4_fprm.yaml").write_text("base: sudoku4_fprm\ntrain: {steps: 7}\n")
    shipped = read_recipe(RECIPE_DIR / "sudoku4_fprm.yaml")
    mine = read_recipe("sudoku4_fprm")
    assert mine["train"]["steps"] == 7 and mine["model"] == shipped["model"]
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):  # a real cycle is still one
        read_recipe(tmp_path / "a.yaml")
