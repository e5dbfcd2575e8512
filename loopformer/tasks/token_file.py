"""Token files: a text corpus as one memory-mapped array of token ids, streamed by the text task.

The Attractor paper (arXiv 2605.12466) trains its 140M language models on one pass over 11.2B FineWeb-Edu
tokens (github jacobfa/Attractor ``launch_configs/attractor-small-140m.yaml``: ``max_tokens``), read as a
stream of documents (``recpre/huggingface_dataset.py`` ``ParquetStreamPure``), never held in memory.
``loopformer data prepare text`` writes a corpus once into this layout; the text task
(``loopformer.tasks.text``) maps it and reads each training window from it when a batch needs it::

    OUT/tokens.bin    the ids, little-endian, in the narrowest unsigned type that holds the vocabulary:
                      uint8 (bytes, vocabulary 256), uint16 (up to 65536: the authors' 32768-token BPE),
                      uint32 above
    OUT/tokens.json   {"format": "loopformer-tokens", "version": 1, "file": "tokens.bin", "dtype", "tokens",
                      "vocab_size", "max_id", "tokens_per_byte", "documents", "separator", "source",
                      "shuffle", "seed", "bytes", "sha256"}

``bytes`` and ``sha256`` identify the file's content (``TokenFile.fingerprint``: what a run records of the
data it trained on).

Sources (``iter_chunks``): the built-in corpus (CPython's documentation topics, one document each), a text
file (one document, read in pieces), a folder of ``.txt`` / ``.md`` files (one document per file, sorted
path order), a ``.parquet`` file with a text column (one document per non-empty row, one row group at a
time), or a ``.npy`` of token ids (an already tokenized corpus, e.g. FineWeb-Edu through the authors' BPE
tokenizer: ``vocab_size`` and ``tokens_per_byte`` given). Byte-level documents are joined with ``"\\n\\n"``;
``read_corpus`` reads a source the same way into memory (what the text task trains on when it is given the
source itself), so the token file of a source holds the bytes the text task would read from it. ``shuffle``: documents in an order seeded by ``seed`` (a folder's files;
a parquet file's row groups and the rows inside each, as ``ParquetStreamPure`` shuffles its files and each
row group's rows), in bounded memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loopformer.files import atomic_write_json, atomic_writer, read_json, regular_file
from loopformer.tasks.base import TaskDataError

TOKENS_BIN = "tokens.bin"
TOKENS_JSON = "tokens.json"
FORMAT = "loopformer-tokens"
SEPARATOR = b"\n\n"  # between byte-level documents
TEXT_SUFFIXES = (".txt", ".md")
CHUNK = 1 << 24  # bytes / tokens written per piece: memory stays bounded whatever the corpus
DTYPES = ("uint8", "uint16", "uint32")


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest little-endian unsigned type that holds ids ``0 .. vocab_size - 1``."""
    if not 1 <= vocab_size <= 1 << 32:
        raise TaskDataError(f"vocab_size must be in [1, 2^32], got {vocab_size}")
    name = "uint8" if vocab_size <= 1 << 8 else "uint16" if vocab_size <= 1 << 16 else "uint32"
    return np.dtype(name).newbyteorder("<")


def is_token_folder(path: str | Path | None) -> bool:
    """Whether ``path`` is a folder ``data prepare text`` wrote (it holds ``tokens.json``)."""
    return path is not None and (Path(path) / TOKENS_JSON).is_file()


@dataclass
class TokenFile:
    """An opened token folder: ``tokens`` (a read-only ``np.memmap``) and its ``tokens.json`` record."""

    folder: Path
    tokens: np.ndarray
    meta: dict[str, Any]

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def fingerprint(self) -> dict[str, Any]:
        """What identifies the data: the file's name, size in bytes and SHA-256, and its token count."""
        return {k: self.meta[k] for k in ("file", "bytes", "sha256", "tokens")}


def open_token_file(folder: str | Path) -> TokenFile:
    """Map ``folder``'s token file (nothing is read until a window needs it); TaskDataError naming the
    problem (missing or malformed record, unknown dtype, a file whose size is not the record's)."""
    folder = Path(folder)
    meta = read_json(folder / TOKENS_JSON, TaskDataError)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise TaskDataError(
            f"{folder / TOKENS_JSON}: not a {FORMAT} record (write it with loopformer data prepare text)"
        )
    for key in ("file", "dtype", "tokens", "vocab_size", "max_id", "tokens_per_byte", "bytes", "sha256"):
        if key not in meta:
            raise TaskDataError(f"{folder / TOKENS_JSON}: missing {key!r}")
    if meta["dtype"] not in DTYPES:
        raise TaskDataError(
            f"{folder / TOKENS_JSON}: dtype {meta['dtype']!r} is not one of {', '.join(DTYPES)}"
        )
    if Path(meta["file"]).name != meta["file"]:
        raise TaskDataError(f"{folder / TOKENS_JSON}: file {meta['file']!r} must be a name inside the folder")
    path, dtype, n = folder / meta["file"], np.dtype(meta["dtype"]).newbyteorder("<"), int(meta["tokens"])
    regular_file(path, TaskDataError)
    if n < 1 or path.stat().st_size != n * dtype.itemsize or int(meta["bytes"]) != path.stat().st_size:
        raise TaskDataError(
            f"{path}: {path.stat().st_size:,} bytes, but {TOKENS_JSON} records {n:,} tokens of {dtype.name} "
            f"({int(meta['bytes']):,} bytes): truncated or replaced; prepare it again"
        )
    if not 0 <= int(meta["max_id"]) < int(meta["vocab_size"]):
        raise TaskDataError(
            f"{folder / TOKENS_JSON}: max_id {meta['max_id']} does not fit vocab_size {meta['vocab_size']}"
        )
    return TokenFile(folder, np.memmap(path, dtype=dtype, mode="r", shape=(n,)), meta)


# ------------------------------------------------------------------------------------------- sources


def builtin_corpus_topics() -> list[str]:
    """CPython's documentation topics (``pydoc_data.topics``) in sorted key order: real English, no download."""
    try:
        from pydoc_data.topics import topics
    except ImportError as error:  # some minimal Python builds drop pydoc_data
        raise TaskDataError(
            "this Python ships without pydoc_data: pass path= to a local text corpus"
        ) from error
    return [topics[key] for key in sorted(topics)]


def _folder_files(folder: Path) -> list[Path]:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise TaskDataError(f"{folder}: folder has no {'/'.join(TEXT_SUFFIXES)} files")
    return files


def _file_pieces(path: Path) -> Iterator[bytes]:
    with open(regular_file(path, TaskDataError), "rb") as fh:
        while piece := fh.read(CHUNK):
            yield piece


def _parquet_documents(path: Path, column: str, shuffle: bool, seed: int) -> Iterator[bytes]:
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise TaskDataError(
            f"{path}: reading parquet needs pyarrow (pip install pyarrow), or pass a .txt file"
        ) from error
    pf = pq.ParquetFile(path)
    if column not in pf.schema_arrow.names:
        raise TaskDataError(f"{path}: no column {column!r} (columns: {', '.join(pf.schema_arrow.names)})")
    rng = np.random.default_rng([seed, 0x5051])
    groups = rng.permutation(pf.num_row_groups) if shuffle else range(pf.num_row_groups)
    for g in groups:
        rows = [str(s) for s in pf.read_row_group(int(g), columns=[column]).column(column).to_pylist() if s]
        for i in rng.permutation(len(rows)) if shuffle else range(len(rows)):
            yield rows[i].encode("utf-8")


def _documents(path: Path | None, column: str, shuffle: bool, seed: int) -> Iterator[Iterable[bytes]]:
    """Each document of a byte-level source as an iterable of its pieces."""
    if path is None:
        topics = builtin_corpus_topics()
        order = (
            np.random.default_rng([seed, 0x5051]).permutation(len(topics)) if shuffle else range(len(topics))
        )
        yield from ([topics[i].encode("utf-8")] for i in order)
    elif path.is_dir():
        files = _folder_files(path)
        order = (
            np.random.default_rng([seed, 0x5051]).permutation(len(files)) if shuffle else range(len(files))
        )
        yield from (_file_pieces(files[i]) for i in order)
    elif path.suffix.lower() == ".parquet":
        yield from ([doc] for doc in _parquet_documents(path, column, shuffle, seed))
    else:
        yield _file_pieces(path)


def _byte_chunks(
    path: Path | None, column: str, shuffle: bool, seed: int, count: list[int]
) -> Iterator[bytes]:
    """The source's bytes, documents joined with ``SEPARATOR``, in pieces of about ``CHUNK`` bytes
    (``count[0]``: the documents seen so far)."""
    buffer: list[bytes] = []
    size = 0
    for document in _documents(path, column, shuffle, seed):
        if count[0]:
            buffer.append(SEPARATOR)
            size += len(SEPARATOR)
        count[0] += 1
        for piece in document:
            buffer.append(piece)
            size += len(piece)
            if size >= CHUNK:
                yield b"".join(buffer)
                buffer, size = [], 0
    if size:
        yield b"".join(buffer)


def read_corpus(path: str | Path | None, text_column: str = "text") -> bytes:
    """The raw bytes of a byte-level source (built-in (None), one file, a folder of .txt/.md files, or a
    parquet file), documents joined with ``SEPARATOR``: the bytes its token file holds, in memory."""
    source = None if path is None else Path(path)
    if source is not None and not source.exists():
        raise TaskDataError(f"{source}: no such file or folder")
    data = b"".join(_byte_chunks(source, text_column, False, 0, [0]))
    if not data:
        raise TaskDataError(f"{path}: the corpus is empty")
    return data


def _id_chunks(ids: np.ndarray) -> Iterator[np.ndarray]:
    for start in range(0, len(ids), CHUNK):
        yield np.asarray(ids[start : start + CHUNK])


def read_ids(path: str | Path, vocab_size: int | None = None) -> tuple[np.ndarray, int]:
    """A memory-mapped 1-D integer array of token ids (a ``.npy``) and its vocabulary size (``vocab_size``,
    by default the largest id + 1); TaskDataError naming the problem."""
    path = regular_file(path, TaskDataError)
    try:
        ids = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as error:
        raise TaskDataError(f"{path}: not a readable .npy array ({error})") from error
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise TaskDataError(f"{path}: expected a 1-D integer array of token ids, got {ids.dtype} {ids.shape}")
    if ids.size == 0:
        raise TaskDataError(f"{path}: the token array is empty")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0:
        raise TaskDataError(f"{path}: token ids must be >= 0, found {lo}")
    if vocab_size is None:
        vocab_size = hi + 1
    elif hi >= vocab_size:
        raise TaskDataError(
            f"{path}: token id {hi} does not fit vocab_size {vocab_size} (it is outside [0, {vocab_size}))"
        )
    return ids, int(vocab_size)


# ------------------------------------------------------------------------------------------- writing


def write_token_file(
    out: str | Path,
    chunks: Iterable[np.ndarray],
    vocab_size: int,
    record: dict[str, Any],
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Write ``chunks`` (integer arrays of ids in ``[0, vocab_size)``) as ``out``'s token file and its record
    (``record`` adds the source's description); returns the record. Hashes the file as it is written."""
    out = Path(out)
    dtype, digest = token_dtype(vocab_size), hashlib.sha256()
    n, hi = 0, -1
    with atomic_writer(out / TOKENS_BIN, "wb", root=out) as fh:
        for chunk in chunks:
            if chunk.size == 0:
                continue
            lo, top = int(chunk.min()), int(chunk.max())
            if lo < 0 or top >= vocab_size:
                raise TaskDataError(
                    f"token id {lo if lo < 0 else top} is outside [0, vocab_size={vocab_size})"
                )
            data = np.ascontiguousarray(chunk, dtype=dtype).tobytes()
            digest.update(data)
            fh.write(data)
            n, hi = n + int(chunk.size), max(hi, top)
            if progress is not None:
                progress(n)
    if n == 0:
        (out / TOKENS_BIN).unlink()
        raise TaskDataError(f"{record.get('source')}: the corpus is empty")
    meta = {"format": FORMAT, "version": 1, "file": TOKENS_BIN, "dtype": dtype.name, "tokens": n,
            "vocab_size": int(vocab_size), "max_id": hi, **record, "bytes": n * dtype.itemsize,
            "sha256": digest.hexdigest()}  # fmt: skip
    atomic_write_json(out / TOKENS_JSON, meta, root=out, indent=2)
    return meta


def prepare_text(
    out: str | Path,
    source: str | Path | None,
    *,
    shuffle: bool = False,
    seed: int = 0,
    text_column: str = "text",
    vocab_size: int | None = None,
    tokens_per_byte: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """``loopformer data prepare text``: ``source`` (module docstring; None: the built-in corpus) into ``out``'s
    token file; returns its record."""
    path = None if source is None else Path(source)
    if path is not None and not path.exists():
        raise TaskDataError(f"{path}: no such file or folder")
    base = {
        "source": "builtin:pydoc_data.topics" if path is None else str(path),
        "shuffle": shuffle,
        "seed": seed,
    }
    if path is not None and path.suffix.lower() == ".npy":
        if shuffle:
            raise TaskDataError(f"{path}: a token array has no documents to shuffle (drop --shuffle)")
        if tokens_per_byte is None or not tokens_per_byte > 0:
            raise TaskDataError(
                f"{path}: a tokenized corpus needs --tokens-per-byte > 0 (its token count / the UTF-8 size "
                f"of the text it encodes), got {tokens_per_byte!r}"
            )
        ids, vocab = read_ids(path, vocab_size)
        record = {**base, "tokens_per_byte": float(tokens_per_byte), "documents": None, "separator": None}
        return write_token_file(out, _id_chunks(ids), vocab, record, progress)
    if vocab_size not in (None, 256) or tokens_per_byte not in (None, 1.0):
        raise TaskDataError(
            f"{base['source']} is text, tokenized here as bytes (vocabulary 256, 1 token per byte); "
            "--vocab-size / --tokens-per-byte apply to a .npy of token ids"
        )
    count = [0]
    record = {**base, "tokens_per_byte": 1.0, "separator": SEPARATOR.decode(), "text_column": text_column}
    chunks = (np.frombuffer(c, dtype=np.uint8) for c in _byte_chunks(path, text_column, shuffle, seed, count))
    meta = write_token_file(out, chunks, 256, record, progress)
    meta["documents"] = count[0]  # known once every document was read
    atomic_write_json(Path(out) / TOKENS_JSON, meta, root=out, indent=2)
    return meta


__all__ = [
    "DTYPES",
    "TOKENS_BIN",
    "TOKENS_JSON",
    "TokenFile",
    "builtin_corpus_topics",
    "is_token_folder",
    "open_token_file",
    "prepare_text",
    "read_corpus",
    "read_ids",
    "token_dtype",
    "write_token_file",
]
