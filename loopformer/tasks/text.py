"""Byte-level language modelling over local text (FineWeb-Edu in arXiv 2605.12466, "Language modelling").

The papers train on FineWeb-Edu; nothing is downloaded here. Sources (``path``):

* ``None``: the built-in corpus, CPython's own documentation topics (``pydoc_data.topics``,
  79 topics, ~0.47 MB of English and code on CPython 3.11), joined in sorted key order;
* a text file (any bytes: a non-UTF-8 file is read as raw bytes all the same);
* a folder: every ``*.txt`` and ``*.md`` below it, in sorted path order;
* a ``.parquet`` file with a text column (needs pyarrow, an optional dependency);
* a token folder written by ``loopformer data prepare text`` (``loopformer.tasks.token_file``: ``tokens.bin``
  + ``tokens.json``), memory-mapped: its vocabulary and tokens per byte come from its record, nothing is read
  until a window needs it. This is how a corpus larger than memory is trained on;
* a ``.npy`` file: an already tokenized corpus, one 1-D integer array of token ids (e.g. FineWeb-Edu
  through the authors' BPE tokenizer of vocabulary 32768, arXiv 2605.12466), memory-mapped, with
  ``vocab_size`` (default: the largest id + 1) and ``tokens_per_byte`` (tokens per byte of the text it
  encodes, required: bits per byte are reported from it). Everything below then holds per token.

The first four are read into memory as bytes (vocabulary 256). The task is causal: ``inputs = x[s : s+T]``,
``labels = x[s+1 : s+T+1]``. Train / validation split: the corpus is cut into contiguous blocks
of ``block_bytes`` and every ``round(1 / val_fraction)``-th block (the last of each period) is a
validation block; windows never cross a split boundary, so no validation byte is ever a training
target or context.

Which windows (``order``): window number ``c`` of a set is

* ``random``: the start ``splitmix64(seed, c) mod S`` among the split's ``S`` valid starts: uniform, with
  replacement, a pure function of ``(seed, c)``;
* ``sequential``: the ``(c mod P)``-th window of the split's tiling, windows of ``T + 1`` tokens starting
  every ``T`` tokens in file order (each token is a target once), ``P`` its number of windows (or ``n`` when
  smaller): one pass over the split, then the next.

``generate(n, seed, split, order)`` holds windows ``0 .. n-1`` as int64 arrays (validation sets).
``stream(n, seed, split, order)`` is the training set (``streams``): ``n`` rows (0: ``P``) of which nothing
is held; the trainer draws window numbers ``0, 1, 2, ...`` in order (``loopformer.train.data.WindowStream``)
and each batch reads its windows from the corpus, so a run makes one pass over a token file in bounded
memory (the paper's one pass over 11.2B tokens) and a resumed run, which restores the count, replays
exactly. Language modelling has no validator: models are scored by bits per byte,
``bits_per_byte(mean cross-entropy in nats per byte) = loss / ln 2``; ``check`` raises.
Difficulty is 0 for every window (not meaningful for LM). Files: ``.npz`` windows.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from loopformer.tasks.base import TaskDataError, TokenDataset, splitmix64
from loopformer.tasks.formats import NpzTask
from loopformer.tasks.token_file import (
    TEXT_SUFFIXES,
    builtin_corpus_topics,
    is_token_folder,
    open_token_file,
    read_corpus,
    read_ids,
)

ORDERS = ("random", "sequential")
_SALT = np.uint64(0x5458)  # "TX": the text task's draws


def bits_per_byte(mean_nat_loss: float, tokens_per_byte: float = 1.0) -> float:
    """Mean cross-entropy in nats per token -> bits per byte (tokens_per_byte = 1 for byte-level models)."""
    return float(mean_nat_loss) * float(tokens_per_byte) / math.log(2.0)


def uniform_draws(seed: int, counters: np.ndarray, total: int) -> np.ndarray:
    """Per window number in ``counters``, a uniform integer in ``[0, total)``, a pure function of
    ``(seed, number)``: any window of a run can be drawn without drawing the ones before it."""
    key = splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64) ^ _SALT)
    h = splitmix64(np.asarray(counters, dtype=np.int64).astype(np.uint64) ^ key)
    return (h % np.uint64(total)).astype(np.int64)


class TextTask(NpzTask):
    """Causal LM windows of bytes (or of a tokenized corpus' ids): ``generate`` / ``stream`` (module docstring)."""

    name = "text"
    vocab_size = 256
    causal = True
    has_validator = False  # scored by bits per byte, not by check()
    streams = True  # the training set is read window by window (stream)

    def __init__(
        self,
        path: str | Path | None = None,
        seq_len: int = 256,
        val_fraction: float = 0.05,
        block_bytes: int | None = None,
        text_column: str = "text",
        vocab_size: int | None = None,
        tokens_per_byte: float | None = None,
    ) -> None:
        if seq_len < 1:
            raise TaskDataError(f"seq_len must be >= 1, got {seq_len}")
        if not 0.0 <= val_fraction < 1.0:
            raise TaskDataError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.path = None if path is None else str(path)
        self.seq_len = seq_len
        self.val_fraction = val_fraction
        self.fingerprint: dict[str, Any] | None = None  # a token folder's file, size and SHA-256
        self._max_id: int | None = None
        if is_token_folder(path):
            self._open_token_folder(Path(str(path)), vocab_size, tokens_per_byte)
        elif path is not None and Path(path).suffix.lower() == ".npy":
            self.data, self.vocab_size = read_ids(path, vocab_size)
            if tokens_per_byte is None or not tokens_per_byte > 0:
                raise TaskDataError(
                    f"{path}: a tokenized corpus needs data.options.tokens_per_byte > 0 (tokens per byte of "
                    f"the text it encodes, e.g. its token count / its UTF-8 size), got {tokens_per_byte!r}"
                )
            self.tokens_per_byte = float(tokens_per_byte)
        else:
            if vocab_size not in (None, 256) or tokens_per_byte not in (None, 1.0):
                raise TaskDataError(
                    "vocab_size / tokens_per_byte apply to a tokenized corpus (a .npy of token ids); "
                    f"{path or 'the built-in corpus'} is read as bytes (vocabulary 256)"
                )
            self.data = np.frombuffer(read_corpus(path, text_column), dtype=np.uint8)
        self.block_bytes = int(block_bytes) if block_bytes is not None else 16 * (seq_len + 1)
        if self.block_bytes < seq_len + 1:
            raise TaskDataError(f"block_bytes {self.block_bytes} must be >= seq_len + 1 = {seq_len + 1}")
        self.regions = self._split_regions()

    def _open_token_folder(self, folder: Path, vocab_size: int | None, tokens_per_byte: float | None) -> None:
        tokens = open_token_file(folder)
        if vocab_size is not None and vocab_size <= int(tokens.meta["max_id"]):
            raise TaskDataError(
                f"{folder}: token id {tokens.meta['max_id']} does not fit vocab_size {vocab_size}"
            )
        self.data, self.fingerprint = tokens.tokens, tokens.fingerprint
        self.vocab_size = int(vocab_size) if vocab_size is not None else tokens.vocab_size
        self.tokens_per_byte = float(
            tokens_per_byte if tokens_per_byte is not None else tokens.meta["tokens_per_byte"]
        )
        self._max_id = int(tokens.meta["max_id"])

    @property
    def max_token_id(self) -> int:
        """The largest id in the corpus (a token folder's record says it; else computed once)."""
        if self._max_id is None:
            self._max_id = int(self.data.max())
        return self._max_id

    @classmethod
    def resident_bytes(cls, options: dict[str, Any]) -> int:
        """Bytes of host memory the training set holds: the corpus when it is read into memory (the built-in
        corpus, a text file, a folder's text files, a parquet file's size as a lower bound), 0 when it is
        memory-mapped (a token folder or a ``.npy`` of ids: the OS pages it in and out)."""
        path = options.get("path")
        if path is None:
            return sum(len(t.encode("utf-8")) + 2 for t in builtin_corpus_topics())
        p = Path(str(path))
        if is_token_folder(p) or p.suffix.lower() == ".npy" or not p.exists():
            return 0
        if p.is_dir():
            return sum(
                f.stat().st_size for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES
            )
        return p.stat().st_size

    def _split_regions(self) -> dict[str, list[tuple[int, int]]]:
        """Contiguous [start, end) byte ranges of each split (runs of adjacent train blocks merged)."""
        n = len(self.data)
        num_blocks = math.ceil(n / self.block_bytes)
        period = round(1.0 / self.val_fraction) if self.val_fraction > 0 else 0
        regions: dict[str, list[tuple[int, int]]] = {"train": [], "val": []}
        for b in range(num_blocks):
            split = "val" if period and b % period == period - 1 else "train"
            start, end = b * self.block_bytes, min((b + 1) * self.block_bytes, n)
            runs = regions[split]
            if runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], end)
            else:
                runs.append((start, end))
        return regions

    def split_bytes(self, split: str) -> int:
        return sum(end - start for start, end in self._regions(split))

    def _regions(self, split: str) -> list[tuple[int, int]]:
        if split not in self.regions:
            raise TaskDataError(f"split must be 'train' or 'val', got {split!r}")
        return self.regions[split]

    def _window_starts(self, split: str, stride: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Per region: its start and how many windows (T + 1 tokens) start inside it every ``stride`` tokens."""
        regions = self._regions(split)
        starts = np.array([s for s, _ in regions], dtype=np.int64)
        counts = np.array(
            [max(0, (e - s - self.seq_len - 1) // stride + 1) for s, e in regions], dtype=np.int64
        )
        if counts.sum() == 0:
            raise TaskDataError(
                f"split {split!r} has {self.split_bytes(split)} bytes: too little for one window of "
                f"{self.seq_len + 1} bytes (lower seq_len, val_fraction, or use a larger corpus)"
            )
        return starts, counts

    def pass_windows(self, split: str = "train") -> int:
        """Windows in one pass over ``split`` (``order: sequential``: a window every ``seq_len`` tokens)."""
        return int(self._window_starts(split, self.seq_len)[1].sum())

    def window_offsets(self, counters: np.ndarray, seed: int, split: str, order: str, n: int) -> np.ndarray:
        """The start of window number ``c`` for each ``c`` in ``counters`` (module docstring)."""
        if order not in ORDERS:
            raise TaskDataError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
        counters = np.asarray(counters, dtype=np.int64)
        if counters.size and counters.min() < 0:
            raise TaskDataError(f"window numbers must be >= 0, got {int(counters.min())}")
        stride = 1 if order == "random" else self.seq_len
        starts, counts = self._window_starts(split, stride)
        total = int(counts.sum())
        if order == "random":
            flat = uniform_draws(seed, counters, total)
        else:
            flat = counters % (min(n, total) if n > 0 else total)
        cumulative = np.cumsum(counts)
        region = np.searchsorted(cumulative, flat, side="right")
        return starts[region] + (flat - (cumulative[region] - counts[region])) * stride

    def read_windows(self, offsets: np.ndarray) -> np.ndarray:
        """int64 [k, T + 1]: the tokens of the windows starting at ``offsets``."""
        index = np.asarray(offsets, dtype=np.int64)[:, None] + np.arange(self.seq_len + 1)[None, :]
        return np.asarray(self.data[index], dtype=np.int64)

    def _windows(self, offsets: np.ndarray, split: str) -> TokenDataset:
        tokens = self.read_windows(offsets)
        return TokenDataset(
            inputs=tokens[:, :-1],
            labels=tokens[:, 1:],
            difficulty=np.zeros(len(offsets)),
            meta={"task": self.name, "split": split, "path": self.path, "seq_len": self.seq_len},
        )

    def generate(self, n: int, seed: int, split: str = "train", order: str = "random") -> TokenDataset:
        """Windows ``0 .. n-1`` of ``split`` in ``order`` (module docstring), held in memory."""
        out = self._windows(self.window_offsets(np.arange(n), seed, split, order, n), split)
        out.meta.update(seed=seed, order=order)
        return out

    def stream(self, n: int, seed: int, split: str = "train", order: str = "random") -> StreamedWindows:
        """The same windows as ``generate``, read when a batch indexes them (module docstring); ``n`` 0:
        the windows of one pass over ``split``."""
        self.window_offsets(np.zeros(0, dtype=np.int64), seed, split, order, n)  # errors now, not at step 1
        return StreamedWindows(self, n if n > 0 else self.pass_windows(split), seed, split, order)

    def eval_windows(self, split: str = "val", stride: int | None = None) -> TokenDataset:
        """Deterministic windows tiling a split (stride defaults to seq_len: every byte predicted once per region)."""
        stride = self.seq_len if stride is None else int(stride)
        if stride < 1:
            raise TaskDataError(f"stride must be >= 1, got {stride}")
        starts, counts = self._window_starts(split, stride)  # raises the "too little" error
        return self._windows(np.concatenate([s + stride * np.arange(c) for s, c in zip(starts, counts)]), split)

    def check(self, inputs: np.ndarray, prediction: np.ndarray) -> bool:
        raise NotImplementedError(
            "language modelling has no validator: score a model by bits per byte "
            "(loopformer.tasks.text.bits_per_byte of the mean cross-entropy on eval_windows('val'))"
        )

    def render(self, inputs: np.ndarray, prediction: np.ndarray | None = None) -> str:
        tokens = np.asarray(inputs if prediction is None else prediction).reshape(-1)
        if self.vocab_size != 256:  # token ids: no tokenizer here to decode them
            return " ".join(str(int(t)) for t in tokens)
        return bytes(int(t) & 0xFF for t in tokens).decode("utf-8", errors="replace")


class WindowColumn:
    """The inputs (``shift`` 0) or labels (``shift`` 1) of a ``StreamedWindows``: indexing reads the rows'
    windows from the corpus; the whole column is never formed."""

    ndim = 2
    dtype = np.dtype(np.int64)

    def __init__(self, owner: StreamedWindows, shift: int) -> None:
        self.owner, self.shift = owner, shift

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.owner), self.owner.task.seq_len)

    def __len__(self) -> int:
        return len(self.owner)

    def __getitem__(self, index: Any) -> np.ndarray:
        rows, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        if isinstance(rows, slice):
            counters = np.arange(*rows.indices(len(self.owner)), dtype=np.int64)
        else:
            counters = np.asarray(rows, dtype=np.int64)
            counters = np.where(counters < 0, counters + len(self.owner), counters)
        windows = self.owner.windows(counters.reshape(-1))
        out = (windows[:, :-1] if self.shift == 0 else windows[:, 1:]).reshape(*counters.shape, -1)
        return out[(slice(None),) * counters.ndim + rest] if rest else out

    def max(self) -> int:
        return self.owner.task.max_token_id

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise TaskDataError(
            f"a streamed training set of {len(self.owner):,} windows is read a batch at a time, never held "
            "whole: index its rows (data.train_size counts windows, not rows in memory)"
        )


class StreamedWindows(TokenDataset):
    """``TextTask.stream``: ``n`` windows of which nothing is held; row ``c`` (any ``c >= 0``: the trainer's
    window numbers run past ``n`` into the next pass) is window number ``c`` of ``order``."""

    streamed = True

    def __init__(self, task: TextTask, n: int, seed: int, split: str, order: str) -> None:
        self.task, self.n, self.seed, self.split, self.order = task, int(n), int(seed), split, order
        self.inputs, self.labels = WindowColumn(self, 0), WindowColumn(self, 1)  # type: ignore[assignment]
        self.difficulty = np.broadcast_to(np.zeros((), dtype=np.float64), (self.n,))
        self.puzzle_ids = None
        self.meta = {"task": task.name, "split": split, "path": task.path, "seq_len": task.seq_len,
                     "seed": seed, "order": order, "streamed": True, "fingerprint": task.fingerprint}  # fmt: skip
        self._last: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.n

    def windows(self, counters: np.ndarray) -> np.ndarray:
        """int64 [k, T + 1] of window numbers ``counters`` (the last call's answer is reused: a batch reads
        its inputs and then its labels)."""
        if self._last is not None and np.array_equal(self._last[0], counters):
            return self._last[1]
        offsets = self.task.window_offsets(counters, self.seed, self.split, self.order, self.n)
        self._last = (counters.copy(), self.task.read_windows(offsets))
        return self._last[1]
