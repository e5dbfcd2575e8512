"""Files: the one write path (every file loopformer writes goes through this module) and the one reader of
JSON files a user gives. It imports nothing of loopformer, so every layer uses it: tasks write datasets and
read ARC / knowledge-graph JSON with it, run storage (``loopformer.runs``) writes run folders and checkpoints.

- ``atomic_write_bytes`` / ``atomic_write_text`` / ``atomic_write_json`` and the ``atomic_writer``
  context manager (for writers that want a file object: ``np.save``, ``savefig``, ``csv``; ``atomic_path``
  for those that want a file name: ``safetensors``): the
  content goes to a hidden temporary file in the target's own folder, which is flushed and
  ``fsync``-ed, then renamed over the target with ``os.replace`` and the folder ``fsync``-ed. A
  failed write (a full disk, a file-size limit, a read-only folder) removes the temporary file and
  leaves the previous file untouched; readers see the old content or the new, never a mix.
- ``save_npy``: ``np.save`` through ``atomic_writer``; ``atomic_copy``: a file copied the same way.
- ``append_line``: one line appended to a log (``metrics.jsonl``) with ``O_APPEND``. A log that is a
  hard link shared with another folder (a run copied with ``cp -al``) is first given its own copy
  (``unshare``), so an append never changes the other folder's file. Earlier lines are never rewritten; a write that fails part-way is cut back to the size the file had, so the
  log never ends in a torn line. Dropping records (a resume past its checkpoint) writes a new
  file with ``atomic_write_text`` instead.
- ``check_inside(path, root)``: inside a run or data folder ``root``, nothing is written through a
  symbolic link or into a path that resolves outside ``root``. ``UnsafePathError`` names the link.
  ``root`` itself may be a link (a run folder on a scratch disk); only what lies below it is checked.
- ``missing_parts`` / ``remove_empty``: the folders a command is about to create, and removing them again
  (while empty) after it failed, so a failed command leaves no empty folder behind.
- ``WriteError``: an ``OSError`` raised by a failed write, whose message names the file and the
  reason (``No space left on device``, ``File too large``, ``Read-only file system``).
- ``regular_file(path, error)``: every file loopformer reads or appends to (run and data files, recipes,
  checkpoints) is checked first: a regular file (or a link to one), else ``error`` (the caller's exception
  type) saying what it is (missing, a folder, a FIFO, a device): a FIFO blocks a reader, ``/dev/zero`` never
  ends. ``append_line`` checks what it opened (``O_NONBLOCK``: a FIFO never makes it wait).
  ``read_bytes``: a file read whole (JSON, YAML, a log), at most ``MAX_WHOLE_FILE`` bytes.
- ``read_json(path, error)``: a JSON file a user gave, parsed, or ``error`` (the caller's exception type:
  ``TaskDataError`` for data files, ``ValueError`` for run summaries) with one line naming the file and what
  is wrong (not UTF-8 and at which byte, invalid JSON and where, nested deeper than ``MAX_JSON_DEPTH``
  levels, unreadable), never quoting the file's contents.
- JSON kinds (``JSONInt``, ``Count``, ``JSONNumber``, ``JSONStr``, ``ProcessId``, ``json_kind``): the types
  the library's own records are annotated with (dataclasses beside their writers: ``loopformer.runs``,
  ``loopformer.eval.compare``), read and checked by the configuration's strict loader
  (``loopformer.config.from_dict``). A JSON kind takes a value only as JSON holds it (``7`` is never the
  string ``"7"``, ``true`` never the integer 1): a file loopformer wrote holds its own types, so any other is
  a crafted or damaged file, named by the loader with the file and the field
  (``summary.json: steps: expected an integer >= 0, got 'many'``).
- ``exchange_folders(a, b)``: two folders swapped in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``),
  False where the OS or file system cannot (run storage then falls back to two renames).

- ``resolve_source(path_or_id, patterns)``: a local path as it is, or a hub id (``owner/name``,
  ``hf://owner/name``, ``@revision``) downloaded with huggingface_hub's ``snapshot_download`` (its cache;
  ``HF_HUB_OFFLINE=1`` reads the cache only); ``hub_library()`` imports huggingface_hub or says how to install
  it. Run loading (``loopformer.runs``) and ``LoopedModel.from_pretrained`` read hub ids through it.

The only file written in place is the run lock (``loopformer.runs.folder``): an OS lock lives
on one inode, so that file must never be replaced.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import stat
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


class UnsafePathError(RuntimeError):
    """A write inside a run or data folder would go through a symbolic link or leave the folder."""


class WriteError(OSError):
    """A write that failed (disk full, file-size limit, read-only folder); the message names the file."""

    def __str__(self) -> str:
        return f"could not write {self.filename}: {self.strerror}"


def _write_error(err: OSError, path: Path) -> WriteError:
    return WriteError(err.errno, err.strerror or type(err).__name__, str(path))


def fsync_dir(path: str | Path) -> None:
    """``fsync`` a folder so that a rename inside it survives a crash (a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot fsync a folder; the rename itself is still atomic
    finally:
        os.close(fd)


def check_inside(path: str | Path, root: str | Path | None) -> Path:
    """``path`` after checking that no part of it below ``root`` is a symbolic link and that it
    lies inside ``root``; ``UnsafePathError`` naming the link otherwise. ``root`` None: no check."""
    path = Path(path)
    if root is None:
        return path
    target = Path(os.path.abspath(path))  # ".." folded lexically: "run/../elsewhere" is outside
    for base in (Path(os.path.abspath(root)), Path(root).resolve()):
        try:
            rel = target.relative_to(base)
        except ValueError:
            continue
        current = base
        for part in rel.parts:
            current = current / part
            if current.is_symlink():
                raise UnsafePathError(
                    f"{current} is a symbolic link (to {os.readlink(current)}); loopformer does not write "
                    f"through links inside the folder {root}: replace it with a real file or folder"
                )
        return path
    raise UnsafePathError(f"{path} is outside the folder {root}; loopformer writes only inside it")


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}")


@contextmanager
def atomic_writer(path: str | Path, mode: str = "wb", root: str | Path | None = None,
                  encoding: str | None = "utf-8", newline: str | None = None) -> Iterator[IO[Any]]:  # fmt: skip
    """A file object whose content replaces ``path`` atomically when the block ends without error.

    ``mode``: ``"wb"`` or ``"w"`` (text, ``encoding`` / ``newline`` as for ``open``). ``root``: the
    run or data folder ``path`` must stay inside (``check_inside``). Errors are ``WriteError``s
    naming ``path``; the previous file is untouched and the temporary file removed.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_writer mode must be 'w' or 'wb', not {mode!r}")
    kwargs: dict[str, Any] = {} if mode == "wb" else {"encoding": encoding, "newline": newline}
    with atomic_path(path, root) as tmp, open(tmp, mode, **kwargs) as fh:  # closed before the rename
        yield fh
        fh.flush()


@contextmanager
def atomic_path(path: str | Path, root: str | Path | None = None) -> Iterator[Path]:
    """A temporary path beside ``path`` for writers that need a file name (``safetensors``); when the
    block ends without error the file is fsynced and renamed over ``path``, else removed."""
    path = check_inside(path, root)
    tmp = _tmp_name(path)
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise _write_error(err, path) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes, root: str | Path | None = None) -> Path:
    """Replace ``path`` with ``data`` atomically (see the module docstring); returns ``path``."""
    with atomic_writer(path, "wb", root) as fh:
        fh.write(data)
    return Path(path)


def atomic_write_text(path: str | Path, text: str, root: str | Path | None = None) -> Path:
    """Replace ``path`` with ``text`` (UTF-8) atomically; returns ``path``."""
    return atomic_write_bytes(path, text.encode("utf-8"), root)


def atomic_write_json(path: str | Path, obj: Any, root: str | Path | None = None, indent: int | None = None,
                      sort_keys: bool = False, newline: bool = False) -> Path:  # fmt: skip
    """Replace ``path`` with ``obj`` as JSON atomically (``newline``: end with one); returns ``path``."""
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys) + ("\n" if newline else "")
    return atomic_write_text(path, text, root)


def atomic_copy(src: str | Path, dst: str | Path, root: str | Path | None = None) -> Path:
    """Copy the file ``src`` to ``dst`` atomically (streamed, never whole in memory); returns ``dst``."""
    import shutil

    with open(src, "rb") as source, atomic_writer(dst, "wb", root) as fh:
        shutil.copyfileobj(source, fh, 1 << 20)
    return Path(dst)


def save_npy(path: str | Path, array: Any, root: str | Path | None = None) -> Path:
    """``np.save`` of ``array`` to ``path`` (the exact name: no ``.npy`` appended), atomically."""
    import numpy as np

    with atomic_writer(path, "wb", root) as fh:
        np.save(_PlainWriter(fh), array)  # not a real file: numpy writes through .write, whose errors name errno
    return Path(path)


class _PlainWriter:
    """A file object numpy does not recognise as a real file: ``np.save`` then writes through
    ``write`` (an ``OSError`` with its errno: "File too large") instead of C ``fwrite`` (a bare
    "8192 requested and 0 written")."""

    def __init__(self, fh: IO[bytes]) -> None:
        self._fh = fh

    def write(self, data: bytes) -> int:
        return self._fh.write(data)

    def flush(self) -> None:
        self._fh.flush()


def unshare(path: str | Path) -> None:
    """Give ``path`` an inode of its own when it is a hard link shared with another name (a run folder copied
    with ``cp -al``): its content is copied and renamed over it, so writing into it in place (an append)
    never changes the other copy's file."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if st.st_nlink > 1 and not os.path.islink(path):
        atomic_copy(path, path)


def append_line(path: str | Path, line: str, root: str | Path | None = None, fsync: bool = False) -> None:
    """Append ``line`` (a newline is added) to ``path``: never rewrites what is there, and a write
    that fails part-way is cut back to the previous size (no torn last line). ``WriteError`` on failure."""
    path = check_inside(path, root)
    data = (line.rstrip("\n") + "\n").encode("utf-8")
    unshare(path)
    try:  # O_NONBLOCK: a FIFO without a reader is ENXIO at once, never a wait; any other non-file: below
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
    except OSError as err:
        why = "it is a FIFO (named pipe), not a regular file" if err.errno == errno.ENXIO else err.strerror
        raise WriteError(err.errno, why or type(err).__name__, str(path)) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise WriteError(errno.EINVAL, f"it is {_kind(info.st_mode)}, not a regular file", str(path))
        size = info.st_size
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        except OSError as err:
            try:
                os.ftruncate(fd, size)  # shrinking never needs the space or the size limit that failed
            except OSError:
                pass  # the torn line stays; a resume drops it (loopformer.train.metrics._step_of)
            raise _write_error(err, path) from None
    finally:
        os.close(fd)


def missing_parts(folder: str | Path) -> list[Path]:
    """``folder`` and the folders above it that do not exist yet, innermost first (what a command that
    creates ``folder`` creates; ``remove_empty`` takes them away again after a failure)."""
    folder = Path(os.path.abspath(folder))
    missing = []
    for part in (folder, *folder.parents):
        if part.exists() or part.is_symlink():
            break
        missing.append(part)
    return missing


def remove_empty(folders: list[Path]) -> None:
    """Remove ``folders`` (innermost first) while they are empty: a failed command leaves no empty folder."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


MAX_WHOLE_FILE = 1 << 30  # bytes of a file read whole (JSON, YAML, a log)
MAX_JSON_DEPTH = 100  # nesting of a JSON document: loopformer's own files nest a few levels


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))  # fmt: skip
    return next((name for test, name in kinds if test(mode)), "no regular file")


def regular_file(path: str | Path, error: type[Exception] = ValueError, what: str = "") -> Path:
    """``path`` when it names a regular file (or a link to one); ``error`` naming it (``what``: "recipe",
    "checkpoint file") and saying what it is otherwise: missing, a folder, a FIFO, a device (module docstring)."""
    name = f"{what} {path}" if what else str(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise error(f"{name} does not exist") from None
    except OSError as err:
        raise error(f"{name}: cannot read ({err.strerror or type(err).__name__})") from None
    if not stat.S_ISREG(mode):
        raise error(f"{name} is {_kind(mode)}, not a regular file")
    return Path(path)


def read_bytes(path: str | Path, error: type[Exception] = ValueError, what: str = "") -> bytes:
    """The content of the regular file ``path`` (``regular_file``), at most ``MAX_WHOLE_FILE`` bytes; ``error``
    naming the file otherwise."""
    regular_file(path, error, what)
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_WHOLE_FILE + 1) if os.fstat(fh.fileno()).st_size <= MAX_WHOLE_FILE else None
    except OSError as err:
        raise error(f"{what} {path}: cannot read ({err.strerror or type(err).__name__})".lstrip()) from None
    if data is None or len(data) > MAX_WHOLE_FILE:
        raise error(f"{what} {path} holds more than the {MAX_WHOLE_FILE:,} bytes read whole".lstrip())
    return data


def read_json(
    path: Path,
    error: type[Exception] = ValueError,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
) -> Any:
    """The parsed UTF-8 JSON file ``path``; ``error`` naming the file and position otherwise."""
    deep = f"{path}: JSON nested too deeply (more than {MAX_JSON_DEPTH} levels)"
    try:
        data = json.loads(read_bytes(path, error).decode("utf-8"), object_pairs_hook=object_pairs_hook)
    except UnicodeDecodeError as err:
        raise error(f"{path}: not UTF-8 text (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise error(f"{path}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None
    except RecursionError:  # deeper than the interpreter's recursion limit
        raise error(deep) from None
    level = [data] if isinstance(data, dict | list) else []
    for _ in range(MAX_JSON_DEPTH):  # the lists and objects one level down, level by level (no recursion)
        level = [c for n in level for c in (n.values() if isinstance(n, dict) else n) if isinstance(c, (dict, list))]
    if level:
        raise error(deep)
    return data


class _JSONKind(type):
    """The metaclass of a JSON kind: ``isinstance(value, kind)`` is the kind's ``test``; the class's name is
    what the loader's error says the value must be ("an integer >= 0")."""

    def __instancecheck__(cls, value: Any) -> bool:
        return bool(cls.test(value))


def json_kind(what: str, test: Callable[[Any], bool]) -> type:
    """A type for a record's field that holds the values passing ``test`` as JSON holds them (``what``: "an
    integer >= 0"); the strict loader (``loopformer.config.coerce``) takes such a value as it is and refuses
    any other, converting nothing."""
    return _JSONKind(what, (), {"test": staticmethod(test)})


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


JSONInt = json_kind("an integer", _integer)
Count = json_kind("an integer >= 0", lambda v: _integer(v) and v >= 0)
JSONNumber = json_kind("a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool))
JSONStr = json_kind("a string", lambda v: isinstance(v, str))
ProcessId = json_kind("a process id (1 .. 4194303)", lambda v: _integer(v) and 0 < v < 1 << 22)


def exchange_folders(a: Path, b: Path) -> bool:
    """Swap the folders ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``, through
    ``ctypes``); False where the OS or file system cannot (then nothing was changed)."""
    global _RENAMEAT2
    if _RENAMEAT2 is None:
        _RENAMEAT2 = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                func = libc.renameat2
                func.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                func.restype = ctypes.c_int
                _RENAMEAT2 = func
            except (OSError, AttributeError):  # an old C library without renameat2
                _RENAMEAT2 = False
    if _RENAMEAT2 is False:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):  # not on this file system
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


_RENAMEAT2: Any = None  # the C library's renameat2, False where there is none (found on first use)
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


__all__ = [
    "Count",
    "JSONInt",
    "JSONNumber",
    "JSONStr",
    "ProcessId",
    "exchange_folders",
    "json_kind",
    "read_json",
    "read_bytes",
    "regular_file",
    "UnsafePathError",
    "WriteError",
    "append_line",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "atomic_copy",
    "atomic_path",
    "atomic_writer",
    "check_inside",
    "unshare",
    "fsync_dir",
    "missing_parts",
    "remove_empty",
    "save_npy",
]


def reserved_memmap(path: Path, shape: tuple[int, int]) -> Any:
    """A uint8 ``.npy`` memory map whose disk blocks are allocated up front: on a full disk a write into a
    sparse map's page kills the process with SIGBUS, so the space is claimed first (``posix_fallocate``)
    and a shortage is an ``OSError`` naming the file and the bytes it needs."""
    import numpy as np  # only the dataset writers need it

    array = np.lib.format.open_memmap(path, "w+", np.uint8, shape)
    size = path.stat().st_size
    try:
        if hasattr(os, "posix_fallocate"):
            with open(path, "r+b") as fh:
                os.posix_fallocate(fh.fileno(), 0, size)
        elif shutil.disk_usage(path.parent).free < size:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as err:
        del array
        path.unlink(missing_ok=True)
        raise OSError(err.errno, f"{path}: cannot reserve {size:,} bytes ({err.strerror or err})") from None
    return array


# --------------------------------------------------------------------------------------------
# Files on the Hugging Face Hub
# --------------------------------------------------------------------------------------------
HUB_ID = re.compile(r"^(?:hf://)?(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")


def hub_library() -> Any:
    """The ``huggingface_hub`` module, or a RuntimeError saying how to install it."""
    try:
        import huggingface_hub
    except ImportError:
        raise RuntimeError(
            "sharing through the Hugging Face Hub needs huggingface_hub: pip install 'loopformer[hub]'"
        ) from None
    return huggingface_hub


def parse_hub_id(text: str) -> tuple[str, str | None] | None:
    """(repo_id, revision) when ``text`` reads as a hub id, else None."""
    match = HUB_ID.match(str(text))
    return (match["repo"], match["rev"]) if match else None


def resolve_source(path_or_id: str | Path, patterns: list[str], cache_dir: str | Path | None = None,
                   what: str = "run folder") -> Path:  # fmt: skip
    """A local path as it is; an ``owner/name`` that exists nowhere here is downloaded from the hub (the files
    matching ``patterns``, cached). A local-looking path (``./``, ``/``, an existing first part) is never sent
    to the hub: it comes back as it is, for the caller to report missing."""
    path = Path(path_or_id)
    if path.exists():
        return path
    parsed = parse_hub_id(str(path_or_id))
    local_looking = str(path_or_id).startswith(("./", "../", "/", "~")) or Path(path.parts[0]).is_dir()
    if parsed is None or local_looking:
        return path
    repo_id, revision = parsed
    try:
        hub = hub_library()
    except RuntimeError:
        raise FileNotFoundError(
            f"{path_or_id}: no such {what} (to read it as a hub id, pip install 'loopformer[hub]')"
        ) from None
    try:
        local = hub.snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=patterns)
    except Exception as err:  # the hub's own errors (offline, not found, gated): one clear line
        raise FileNotFoundError(
            f"{path_or_id!r} is neither a local {what} nor a downloadable hub model: {type(err).__name__}: {err}"
        ) from None
    return Path(local)
