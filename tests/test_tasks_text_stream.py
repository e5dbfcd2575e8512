"""Streamed language-model data (issue 32, item 8): ``loopformer data prepare text`` writes a memory-mapped token
file, the text task reads each training window from it when a batch needs it, and a run makes one pass over
its tokens in bounded memory (the Attractor paper, arXiv 2605.12466: one pass over 11.2B tokens).

Oracles: the text itself (every window read from the token file is the corpus' bytes at that place, the
sequential pass written out from the split rule by hand), ``hashlib`` (the record's SHA-256), the uninterrupted
run (a resumed text run is bit-identical)."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from loopformer.cli import cli
from loopformer.config import ConfigError, build_config, load_config
from loopformer.config.memory import check_memory, memory_terms
from loopformer.tasks.base import TaskDataError
from loopformer.tasks.text import TextTask, uniform_draws
from loopformer.tasks.token_file import open_token_file, prepare_text, token_dtype

T, BLOCK, VAL = 16, 64, 0.1  # every 10th block of 64 bytes is validation


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory):
    """A folder of text (UTF-8 with non-ASCII, and one file that is not UTF-8), its bytes as the text task
    joins them (sorted paths, blank lines between), and its token folder written by the CLI."""
    root = tmp_path_factory.mktemp("stream")
    folder = root / "docs"
    (folder / "sub").mkdir(parents=True)
    rng = np.random.default_rng(0)
    words = ["loop", "fixed", "point", "attractor", "équilibre", "トークン", "solve", "the", "a"]
    texts = {
        "a.txt": " ".join(rng.choice(words, 900)).encode(),
        "b.md": " ".join(rng.choice(words, 700)).encode(),
        "sub/c.txt": bytes(rng.integers(0, 256, 1500, dtype=np.uint8)),  # not UTF-8: read as bytes
    }
    for name, data in texts.items():
        (folder / name).write_bytes(data)
    (folder / "skip.json").write_text("{}")
    text = b"\n\n".join(texts[k] for k in sorted(texts))  # rglob order: a.txt, b.md, sub/c.txt
    out = root / "tokens"
    result = CliRunner().invoke(cli, ["data", "prepare", "text", "--from", str(folder), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return folder, text, out


def _train_runs(text: bytes) -> list[tuple[int, int]]:
    """The training split written out: blocks of BLOCK bytes, every 10th one validation, runs merged."""
    runs: list[tuple[int, int]] = []
    for b in range(math.ceil(len(text) / BLOCK)):
        if b % 10 == 9:
            continue
        start, end = b * BLOCK, min((b + 1) * BLOCK, len(text))
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end)
        else:
            runs.append((start, end))
    return runs


def _window(x: np.ndarray, y: np.ndarray) -> bytes:
    return bytes(np.concatenate([x, y[-1:]]).astype(np.uint8).tolist())


def test_windows_read_from_the_memory_mapped_token_file_are_the_text(corpus) -> None:
    folder, text, out = corpus
    task = TextTask(out, seq_len=T, val_fraction=VAL, block_bytes=BLOCK)
    assert isinstance(task.data, np.memmap) and task.data.dtype == np.uint8 and len(task.data) == len(text)
    assert task.vocab_size == 256 and task.tokens_per_byte == 1.0
    # sequential: the tiling of each training run, written out by hand, then the next pass
    expected = [
        text[s + j * T : s + j * T + T + 1] for s, e in _train_runs(text) for j in range((e - s - 1) // T)
    ]
    expected = [w for w in expected if len(w) == T + 1]
    seq = task.stream(0, seed=3, split="train", order="sequential")
    assert len(seq) == len(expected) == task.pass_windows("train")
    rows = np.arange(len(expected) + 5)  # past one pass: it starts again
    got = [_window(x, y) for x, y in zip(seq.inputs[rows], seq.labels[rows])]
    assert got == expected + expected[:5]
    # random: every window is the text at a training place, the same from the token file as from the text itself
    stream = task.stream(10**9, seed=7)  # a billion rows: nothing is held
    train_text = [text[s:e] for s, e in _train_runs(text)]
    counters = np.array([0, 1, 2, 12_345, 10**12])
    for x, y in zip(stream.inputs[counters], stream.labels[counters]):
        assert np.array_equal(x[1:], y[:-1]) and any(_window(x, y) in run for run in train_text)
    in_memory = TextTask(folder, seq_len=T, val_fraction=VAL, block_bytes=BLOCK).stream(10**9, seed=7)
    assert np.array_equal(in_memory.inputs[counters], stream.inputs[counters])
    assert np.array_equal(
        task.generate(6, seed=7).inputs, stream.inputs[:6]
    )  # generate = the stream's first rows


def test_one_sequential_pass_predicts_every_training_token_at_most_once(corpus) -> None:
    _, text, out = corpus
    task = TextTask(out, seq_len=T, val_fraction=VAL, block_bytes=BLOCK)
    seq = task.stream(0, seed=0, order="sequential")
    offsets = task.window_offsets(np.arange(len(seq)), 0, "train", "sequential", len(seq))
    hits = np.zeros(len(text), dtype=np.int64)
    for s in offsets:
        hits[s + 1 : s + T + 1] += 1  # the targets of the window starting at s
    assert hits.max() == 1
    for s, e in _train_runs(text):  # covered: all but each run's first byte and a tail shorter than a window
        assert hits[s + 1 : s + 1 + ((e - s - 1) // T) * T].all() and hits[s] == 0


def test_token_files_follow_the_vocabulary_and_their_record_identifies_them(tmp_path) -> None:
    assert [token_dtype(v).name for v in (256, 257, 32768, 65536, 70000)] == [
        "uint8",
        "uint16",
        "uint16",
        "uint16",
        "uint32",
    ]
    for vocab, dtype in ((32768, "uint16"), (70000, "uint32")):
        ids = np.random.default_rng(vocab).integers(0, vocab, 4000)
        np.save(tmp_path / f"ids{vocab}.npy", ids)
        out = tmp_path / f"t{vocab}"
        out.mkdir()
        meta = prepare_text(out, tmp_path / f"ids{vocab}.npy", vocab_size=vocab, tokens_per_byte=0.25)
        stored = open_token_file(out)
        assert meta["dtype"] == dtype and np.array_equal(np.asarray(stored.tokens), ids)
        data = (out / "tokens.bin").read_bytes()
        assert meta["bytes"] == len(data) == 4000 * np.dtype(dtype).itemsize
        assert meta["sha256"] == hashlib.sha256(data).hexdigest() == stored.fingerprint["sha256"]
        task = TextTask(out, seq_len=8)
        assert (
            task.vocab_size == vocab
            and task.tokens_per_byte == 0.25
            and task.fingerprint == stored.fingerprint
        )
        assert task.stream(0, 0).meta["fingerprint"]["sha256"] == meta["sha256"]
    (tmp_path / "t70000" / "tokens.bin").write_bytes(data[:-4])  # the last file written above, cut short
    with pytest.raises(TaskDataError, match="truncated or replaced"):
        open_token_file(tmp_path / "t70000")
    with pytest.raises(TaskDataError, match="tokens-per-byte"):
        prepare_text(tmp_path / "t32768", tmp_path / "ids32768.npy", vocab_size=32768)
    with pytest.raises(TaskDataError, match="outside"):
        prepare_text(tmp_path / "t32768", tmp_path / "ids70000.npy", vocab_size=32768, tokens_per_byte=0.25)


def test_shuffled_documents_keep_every_document_whole(corpus, tmp_path) -> None:
    folder, text, _ = corpus
    meta = prepare_text(tmp_path, folder, shuffle=True, seed=1)
    shuffled = bytes(np.asarray(open_token_file(tmp_path).tokens))
    assert meta["documents"] == 3 and shuffled != text
    assert sorted(shuffled.split(b"\n\n")) == sorted(text.split(b"\n\n"))


def test_a_streamed_set_holds_no_rows_and_the_memory_check_counts_its_corpus(corpus) -> None:
    _, _, out = corpus
    stream = TextTask(out, seq_len=T).stream(50_000_000, seed=0)
    assert len(stream) == 50_000_000 and stream.inputs.shape == (50_000_000, T) and stream.streamed
    assert stream.difficulty.strides == (0,)  # a broadcast zero: no 400 MB array
    with pytest.raises(TaskDataError, match="never held"):
        np.asarray(stream.inputs)
    overrides = ["data.train_size=50000000", "data.options.seq_len=1024", "model.d_model=32", "model.n_heads=2",
                 "model.n_layers=1", "train.steps=1", "train.batch_size=2", "data.eval_size=4", "device=cpu"]  # fmt: skip
    cfg = load_config("lm_transformer", overrides, check=False)
    check_memory(cfg)  # today's must-show: it used to need 763 GiB (50M windows of 1024 int64 tokens, twice)
    _, host = memory_terms(cfg)
    assert host[0][1].startswith("data.task=text's streamed") and host[0][0] < 1e6  # the built-in corpus
    cfg = load_config("lm_transformer", [*overrides, f"data.options.path={out}"], check=False)
    assert memory_terms(cfg)[1][0][0] == 0  # memory-mapped: nothing held
    sudoku = build_config(
        {"data": {"task": "sudoku", "train_size": 500_000_000}}, ["device=cpu"], check=False
    )
    with pytest.raises(ConfigError, match="data.train_size=500000000 rows"):
        check_memory(sudoku)  # a set that is generated up front still counts its rows


def test_random_windows_are_uniform_and_a_pure_function_of_seed_and_number() -> None:
    counts = np.bincount(uniform_draws(5, np.arange(40_000), 8), minlength=8)
    assert np.abs(counts - 5_000).max() < 5 * math.sqrt(5_000)  # 5 sigma of a binomial(40000, 1/8)
    a, b = uniform_draws(5, np.array([7, 123_456_789]), 1000), uniform_draws(5, np.array([123_456_789]), 1000)
    assert a[1] == b[0] and not np.array_equal(
        uniform_draws(6, np.arange(50), 1000), uniform_draws(5, np.arange(50), 1000)
    )


def _text_config(out, path, *extra: str):
    raw = {
        "model": {"name": "transformer", "d_model": 16, "n_heads": 2, "n_layers": 1, "expansion": 2.0},
        "data": {"task": "text", "options": {"path": str(path), "seq_len": T, "val_fraction": VAL, "block_bytes": BLOCK},
                 "train_generate": {"split": "train", "order": "random"}, "eval_generate": {"split": "val"},
                 "train_size": 0, "eval_size": 8},
        "train": {"mode": "simple", "steps": 6, "batch_size": 4, "progress": False, "checkpoint_every": 3,
                  "eval_every": 0, "log_every": 1, "threads": 1, "lr": 0.01, "warmup_steps": 1},
        "out_dir": str(out), "device": "cpu",
    }  # fmt: skip
    return build_config(raw, list(extra))


def test_a_resumed_text_run_replays_the_uninterrupted_run_bit_exactly(corpus, tmp_path) -> None:
    from loopformer.train.trainer import Trainer

    _, _, path = corpus
    full = Trainer(_text_config(tmp_path / "full", path))
    full.fit()
    killed = Trainer(_text_config(tmp_path / "killed", path))
    step = killed.train_step

    def dies() -> dict:
        if killed.step == 5:
            raise KeyboardInterrupt("simulated kill")
        return step()

    killed.train_step = dies  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        killed.fit()
    resumed = Trainer(_text_config(tmp_path / "killed", path, "train.resume=true"))
    assert resumed.step == 3 and resumed.stream.drawn == 3 * 4
    resumed.fit()
    for (name, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name
    losses = [
        json.loads(line).get("loss")
        for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    ]
    again = [
        json.loads(line).get("loss")
        for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    ]
    assert losses == again and len([v for v in losses if v is not None]) == 6


def test_prepare_text_errors_are_one_clear_line(tmp_path) -> None:
    import importlib.util

    if importlib.util.find_spec("pyarrow") is None:
        (tmp_path / "t.parquet").write_bytes(b"PAR1")
        with pytest.raises(TaskDataError, match="pyarrow"):
            prepare_text(tmp_path, tmp_path / "t.parquet")
    with pytest.raises(TaskDataError, match="no such file"):
        prepare_text(tmp_path, tmp_path / "missing.txt")
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(TaskDataError, match="apply to a .npy"):
        prepare_text(tmp_path, tmp_path / "a.txt", vocab_size=32768)
    runner = CliRunner()
    result = runner.invoke(cli, ["data", "prepare", "maze-hard", "--shuffle", "--out", str(tmp_path / "m")])
    assert result.exit_code != 0 and "apply to text" in result.output
    result = runner.invoke(
        cli, ["data", "prepare", "maze-hard", "--from", str(tmp_path / "a.txt"), "--out", str(tmp_path / "m")]
    )
    assert result.exit_code != 0 and "must be a folder" in result.output
