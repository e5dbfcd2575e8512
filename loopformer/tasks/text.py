"""Byte-level language modelling over local text (FineWeb-Edu in arXiv 2605.12466, "Language modelling").

The papers train on FineWeb-Edu; nothing is downloaded here. Sources:

* ``path=None``: the built-in corpus, CPython's own documentation topics (``pydoc_data.topics``,
  79 topics, ~0.47 MB of English and code on CPython 3.11), joined in sorted key order;
* a text file (any bytes: a non-UTF-8 file is read as raw bytes all the same);
* a folder: every ``*.txt`` and ``*.md`` below it, in sorted path order;
* a ``.parquet`` file with a text column (needs pyarrow, an optional dependency);
* a ``.npy`` file: an already tokenized corpus, one 1-D integer array of token ids (e.g. FineWeb-Edu
  through the authors' BPE tokenizer of vocabulary 32768, arXiv 2605.12466), memory-mapped, with
  ``vocab_size`` (default: the largest id + 1) and ``tokens_per_byte`` (tokens per byte of the text it
  encodes, required: bits per byte are reported from it). Everything below then holds per token.

Tokens are bytes (vocabulary 256); the task is causal: ``inputs = x[s : s+T]``,
``labels = x[s+1 : s+T+1]``. Train / validation split: the corpus is cut into contiguous blocks
of ``block_bytes`` and every ``round(1 / val_fraction)``-th block (the last of each period) is a
validation block; windows never cross a split boundary, so no validation byte is ever a training
target or context. Language modelling has no validator: models are scored by bits per byte,
``bits_per_byte(mean cross-entropy in nats per byte) = loss / ln 2``; ``check`` raises.
Difficulty is 0 for every window (not meaningful for LM). Files: ``.npz`` windows.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from loopformer.tasks.base import Task, TaskDataError, TokenDataset
from loopformer.tasks.npz_format import load_npz, save_npz

TEXT_SUFFIXES = (".txt", ".md")


def bits_per_byte(mean_nat_loss: float, tokens_per_byte: float = 1.0) -> float:
    """Mean cross-entropy in nats per token -> bits per byte (tokens_per_byte = 1 for byte-level models)."""
    return float(mean_nat_loss) * float(tokens_per_byte) / math.log(2.0)


def builtin_corpus() -> bytes:
    """CPython's documentation topics (``pydoc_data.topics``) as UTF-8 bytes: real English, no download."""
    try:
        from pydoc_data.topics import topics
    except ImportError as error:  # some minimal Python builds drop pydoc_data
        raise TaskDataError(
            "this Python ships without pydoc_data: pass path= to a local text corpus"
        ) from error
    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def read_corpus(path: str | Path | None, text_column: str = "text") -> bytes:
    """The raw bytes of a corpus: built-in (None), one file, a folder of .txt/.md files, or a parquet file."""
    if path is None:
        return builtin_corpus()
    path = Path(path)
    if not path.exists():
        raise TaskDataError(f"{path}: no such file or folder")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise TaskDataError(f"{path}: folder has no {'/'.join(TEXT_SUFFIXES)} files")
        data = b"\n\n".join(p.read_bytes() for p in files)
    elif path.suffix.lower() == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as error:
            raise TaskDataError(
                f"{path}: reading parquet needs pyarrow (pip install pyarrow), or pass a .txt file"
            ) from error
        table = pq.read_table(path)
        if text_column not in table.column_names:
            raise TaskDataError(
                f"{path}: no column {text_column!r} (columns: {', '.join(table.column_names)})"
            )
        data = "\n\n".join(str(s) for s in table.column(text_column).to_pylist() if s).encode("utf-8")
    else:
        data = path.read_bytes()
    if not data:
        raise TaskDataError(f"{path}: the corpus is empty")
    return data


def read_token_ids(path: str | Path, vocab_size: int | None) -> tuple[np.ndarray, int]:
    """A memory-mapped 1-D integer token array and its vocabulary size; TaskDataError naming the problem."""
    path = Path(path)
    if not path.is_file():
        raise TaskDataError(f"{path}: no such file")
    try:
        data = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as error:
        raise TaskDataError(f"{path}: not a readable .npy array ({error})") from error
    if data.ndim != 1 or not np.issubdtype(data.dtype, np.integer):
        raise TaskDataError(f"{path}: expected a 1-D integer array of token ids, got {data.dtype} {data.shape}")
    if data.size == 0:
        raise TaskDataError(f"{path}: the token array is empty")
    lo, hi = int(data.min()), int(data.max())
    if lo < 0:
        raise TaskDataError(f"{path}: token ids must be >= 0, found {lo}")
    if vocab_size is None:
        vocab_size = hi + 1
    elif hi >= vocab_size:
        raise TaskDataError(f"{path}: token id {hi} does not fit vocab_size {vocab_size}")
    return data, int(vocab_size)


class TextTask(Task):
    """Causal LM windows of bytes (or of a tokenized corpus' ids): ``generate(n, seed, split="train" | "val")``."""

    name = "text"
    vocab_size = 256
    causal = True
    has_validator = False  # scored by bits per byte, not by check()

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
        if path is not None and Path(path).suffix.lower() == ".npy":
            self.data, self.vocab_size = read_token_ids(path, vocab_size)
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

    def _window_starts(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """Per region: its start and how many windows (T + 1 bytes) start inside it."""
        regions = self._regions(split)
        starts = np.array([s for s, _ in regions], dtype=np.int64)
        counts = np.array([max(0, e - s - self.seq_len) for s, e in regions], dtype=np.int64)
        if counts.sum() == 0:
            raise TaskDataError(
                f"split {split!r} has {self.split_bytes(split)} bytes: too little for one window of "
                f"{self.seq_len + 1} bytes (lower seq_len, val_fraction, or use a larger corpus)"
            )
        return starts, counts

    def _windows(self, offsets: np.ndarray, split: str) -> TokenDataset:
        index = offsets[:, None] + np.arange(self.seq_len + 1)[None, :]
        tokens = self.data[index].astype(np.int64)
        return TokenDataset(
            inputs=tokens[:, :-1],
            labels=tokens[:, 1:],
            difficulty=np.zeros(len(offsets)),
            meta={"task": self.name, "split": split, "path": self.path, "seq_len": self.seq_len},
        )

    def generate(self, n: int, seed: int, split: str = "train") -> TokenDataset:
        """``n`` windows drawn uniformly (with replacement) from all valid starts of one split."""
        starts, counts = self._window_starts(split)
        rng = np.random.default_rng([seed, 0x5458])
        flat = rng.integers(0, counts.sum(), size=n)
        cumulative = np.cumsum(counts)
        region = np.searchsorted(cumulative, flat, side="right")
        offsets = starts[region] + flat - (cumulative[region] - counts[region])
        out = self._windows(offsets, split)
        out.meta["seed"] = seed
        return out

    def eval_windows(self, split: str = "val", stride: int | None = None) -> TokenDataset:
        """Deterministic windows tiling a split (stride defaults to seq_len: every byte predicted once per region)."""
        stride = self.seq_len if stride is None else int(stride)
        if stride < 1:
            raise TaskDataError(f"stride must be >= 1, got {stride}")
        offsets = [
            np.arange(s, e - self.seq_len, stride, dtype=np.int64)
            for s, e in self._regions(split)
            if e - s > self.seq_len
        ]
        if not offsets:
            self._window_starts(split)  # raises the "too little" error
        return self._windows(np.concatenate(offsets), split)

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

    def save(self, dataset: TokenDataset, path: str | Path) -> None:
        save_npz(dataset, path)

    def load(self, path: str | Path) -> TokenDataset:
        return load_npz(path, self.vocab_size)
