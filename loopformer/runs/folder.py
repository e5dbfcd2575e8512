"""The run folder, one owner: its lock, the one way output folders are replaced, provenance, data
fingerprints, what a resume checks, and the run's summary.

- ``RunLock``: ``<folder>/.loopformer.lock``, locked with ``fcntl.flock`` (exclusive, non-blocking).
  The kernel decides who holds it, so two processes starting at the same instant can never both
  hold it, and a holder that dies (killed, preempted) releases it with its last file descriptor:
  there is no stale lock to detect and take over. The file's content (``LockRecord``), written after the
  lock is held, is for people: the holder's pid, host, purpose (train / resume / eval / convert / push /
  prepare), start time and a random token; a second process is refused with a message naming the
  holder. The holder removes the file while it still holds the lock; a process that locked a file
  which was removed (or replaced) meanwhile sees another inode at the path and tries again, so two
  holders can never sit on two different files. Two more refusals keep the lock safe where
  ``flock`` does not reach: a lock file left with the content of a live process on this host
  that holds no ``flock`` (an older loopformer), and one naming another host (``flock`` on some
  network file systems is local to each machine); for the latter the message says which file to delete.
  The same process locking a folder again (an abandoned ``Trainer`` in one interpreter) takes the
  lock over from its own earlier holder. The lock file is the only file written in place (an OS lock
  lives on one inode).
- ``RunFolder``: what a training process does with its folder. A fresh run (not a resume) into a
  folder that already holds a run (checkpoints, ``metrics.jsonl`` or ``summary.json``) is refused
  with a message naming ``train.resume=true`` and ``--overwrite``. With ``--overwrite``
  (``train.overwrite=true``) the new run is built in a hidden folder beside it,
  ``.<name>.staging-train-overwrite`` (locked too); only after its first checkpoint is safely
  written does ``complete_overwrite`` swap the two folders (``swap_in``) and remove the old run. A kill at
  any instant leaves the folder holding the old run or the new one, whole; the next command clears the
  leftovers. A folder whose run files (``checkpoints``, ``metrics.jsonl``, ``config.*``, ...) are symbolic
  links is refused (``loopformer.files.UnsafePathError`` naming the link): nothing is written through a
  link, and a folder inside another run's folder (``inside_run``: its ``checkpoints/step_N``, say) is refused.
- ``staged_output(folder, purpose, overwrite)``: the folders that commands other than ``train`` write whole
  (``convert --out``, ``push --to-folder``, ``eval -o``, ``data prepare -o``) follow the same rules: refused
  inside a run's ``checkpoints/`` or through a symbolic link (with ``root``, the folder that owns it: no link
  anywhere below ``root``); a folder holding a dataset (``holds_dataset``) only replaced by ``data prepare`` /
  ``data generate``; locked for the whole command; a folder that already holds something refused unless
  ``overwrite``, a training run never replaced (``protect_runs``); the new content is built in a hidden
  staging folder ``.<name>.staging-<purpose>-<id>`` beside ``folder`` (same parent, same file system) and
  swapped in whole when the block ends without error (``swap_in``: one Linux ``renameat2(RENAME_EXCHANGE)``,
  ``loopformer.files.exchange_folders``, so ``folder`` holds the old content or the new at every instant;
  where the OS or file system has none, two renames: ``folder`` to ``.<name>.replaced-<purpose>-<id>``, then
  the staging folder to ``folder``, and a crash between the two leaves the old content in the ``.replaced-``
  folder and the new in the ``.staging-`` one, a failed second rename putting the old content back); the old
  content is then removed. On an error or a kill before the swap the staging folder is dropped (now, or by
  the next command that locks the folder) and the old contents are untouched; an error names the path the
  user gave, never the hidden staging folder (``renamed_error``), and the folders this command created are
  removed again.
- Provenance (``provenance.json``): each training start (a fresh run or a resume) appends one record
  (``collect``, rewritten atomically, earlier records kept): the loopformer / torch / Python versions, the
  platform, the git commit of the repository whose work tree holds the running loopformer source and whether
  its tracked files had uncommitted changes (``git_state``; null when the source lies in no repository: an
  installed copy), the CPU thread count, the device, the world size under torchrun, the command line, the
  working folder, the start time (UTC) and the step the record starts at (0, or the resumed step).
  ``loopformer eval`` quotes the record that trained the evaluated checkpoint (``describe``).
- Fingerprints of a run's data (``data_fingerprint``): where a set came from (``source``: a path, or the
  generator's options and seed) and a digest of the rows themselves (``rows``, ``sha256`` of the token ids,
  labels and puzzle ids), so a data file regenerated in place, another generator setting or another seed all
  give another fingerprint, while the same rows read from a moved file give the same one. Sets above
  ``FULL_HASH_BYTES`` are digested from evenly spaced row blocks (``"sampled": true``). A checkpoint records
  both sets (``training_data``, its ``state.json`` ``data``); every evaluation report records its held-out
  set (``heldout_record``), and ``loopformer compare`` compares reports only when these agree.
- What a resume checks (``resume_folder``, ``check_resume``, ``record_resume``): ``train.resume=true`` where
  every checkpoint is corrupt (or holds non-finite weights) stops with an error naming each file and reason,
  never a silent restart; a folder with no checkpoint starts from step 0 (a run killed before its first
  one) unless it is a branch (``origin.json``: it continues from where it branched, ``branch_origin``). A
  ``train.resume`` path naming another run's checkpoint is refused when this folder holds a run (that run's
  weights would continue under this run's step names); into a folder holding none it is a branch, recorded in
  ``origin.json`` (``check_origin``). The config must describe the same training stream (``config_changes``:
  every dotted key whose value differs, leaving out those that cannot change what is trained,
  ``STREAM_FREE`` and ``_free``) and the data must hold the rows the checkpoint recorded (``data_changes``),
  else the resume is refused with one list of both, unless ``train.allow_config_change=true``
  (``--allow-config-change``), which appends the change (time, step, checkpoint, each key's old and new
  value) to ``config_changes.jsonl`` and goes on.
- The summary (``summary.json``, ``Summary``): ``read_summary``, ``finished_summary`` (its ``checkpoint``
  confined to the run's own ``checkpoints/``: a path read from a file is never followed out of the folder
  that holds it, ``loopformer.files.check_inside``).

Every JSON record read back here is a dataclass (``LockRecord``, ``ProvenanceFile``, ``OriginRecord``,
``Summary``) checked by the configuration's strict loader (``loopformer.config.strict.read_record``).

``fcntl.flock`` rather than the ``filelock`` package: it is the same system call, and not a new
dependency. ``flock`` is POSIX-only; where ``fcntl`` is missing (Windows) locking is refused
with a clear error rather than done unsafely.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import secrets
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loopformer.config import DataConfig, RunConfig, config_to_json, to_dict
from loopformer.config.recipes import CHECKPOINT_META_KEYS, stored_table
from loopformer.config.strict import Record, check_record, read_record
from loopformer.files import (
    Count,
    JSONInt,
    JSONNumber,
    JSONStr,
    ProcessId,
    UnsafePathError,
    WriteError,
    append_line,
    atomic_write_json,
    check_inside,
    exchange_folders,
    fsync_dir,
    missing_parts,
    regular_file,
    remove_empty,
)
from loopformer.loop import LoopConfig
from loopformer.loop.config import plugin_defaults
from loopformer.runs.checkpoint import (
    STEP_DIR,
    CheckpointError,
    StateRecord,
    StoredConfig,
    latest_good_checkpoint,
    resolve_checkpoint,
    step_dirs,
    verify_checkpoint,
)

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("loopformer.train")

LOCK_NAME = ".loopformer.lock"
STAGING = ".overwrite-staging"
# what a run writes at its folder's top level: none of these may be a symbolic link
RUN_FILES = ("checkpoints", "metrics.jsonl", "summary.json", "config.yaml", "config.json", "wandb_id",
             "tensorboard", "provenance.json", "origin.json", "config_changes.jsonl", STAGING, LOCK_NAME)  # fmt: skip

_HELD: dict[tuple[int, int], RunLock] = {}  # (device, inode) of lock files this process holds


@dataclass
class LockRecord(Record):
    """What ``RunLock`` writes into the lock file for people: the holder."""

    pid: ProcessId
    host: JSONStr | None = None
    purpose: JSONStr = "?"
    token: JSONStr = ""
    started: JSONStr | None = None
    time: JSONStr = ""


class RunFolderError(RuntimeError):
    """A run folder that is in use or holds a run this command would destroy."""


def _now() -> str:
    """The time now (UTC) as the run folder's records write it."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _start_time(pid: int) -> str | None:
    """The process' start time in clock ticks since boot (Linux ``/proc``), None elsewhere."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def _python_process(pid: int) -> bool:
    """Whether ``pid`` runs Python (a loopformer lock holder does); True where ``/proc`` cannot tell."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().lower()
    except OSError:
        return True
    return b"python" in command or b"loopformer" in command


def _alive(pid: int, started: str | None) -> bool:
    """Whether ``pid`` is the very process a lock record names: alive, started when the record says, and a
    Python process (pid 1, the init process, or a recycled pid running something else never holds a folder
    for ever)."""
    if pid <= 1:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    now = _start_time(pid)
    if started is not None and now is not None and now != started:
        return False
    return _python_process(pid)


def _parse_lock(text: str, path: Path | None = None) -> dict[str, Any] | None:
    """The lock file's record (``LockRecord``), None when it holds none that is valid (a
    record with a field of the wrong type, a pid that is no process id: logged, then treated as no holder)."""
    try:
        info = json.loads(text)
    except ValueError:
        return None
    try:
        return check_record(info, LockRecord, path or LOCK_NAME, RunFolderError)
    except RunFolderError as err:
        log.warning("%s; the lock file names no holder", err)
        return None


def _in_use(folder: Path, info: dict[str, Any] | None) -> RunFolderError:
    """The refusal of a folder whose lock the process ``info`` (its lock record; None: not written yet) holds."""
    holder = "another process (it is starting: its details are not written yet)"
    if info is not None:
        holder = (f"process {info['pid']} on {info.get('host') or '?'} "
                  f"({info.get('purpose', '?')} since {info.get('time', '?')})")  # fmt: skip
    return RunFolderError(f"run folder {folder} is in use by {holder}; wait for it to finish, or use another folder")


class RunLock:
    """An exclusive OS lock on a folder, held until ``release()`` (also a context manager)."""

    def __init__(self, folder: str | Path, purpose: str) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.purpose = purpose
        self.token = secrets.token_hex(8)
        self.held = False
        self._fd: int | None = None
        self._key: tuple[int, int] | None = None
        self._pid = os.getpid()

    def acquire(self) -> RunLock:
        if fcntl is None:
            raise RunFolderError(f"cannot lock {self.folder}: file locks need a POSIX system (fcntl.flock)")
        if self.held:
            return self
        if self.folder.exists() and not self.folder.is_dir():
            raise RunFolderError(f"{self.folder} is a file, not a folder: name a folder to write into")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RunFolderError(f"cannot create the folder {self.folder}: {err.strerror}") from None
        if self.path.is_symlink():
            raise UnsafePathError(f"{self.path} is a symbolic link; loopformer does not lock through links")
        for _ in range(50):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:  # a read-only folder, a full disk
                raise RunFolderError(f"cannot write into the folder {self.folder}: {err.strerror}") from None
            try:
                locked = self._lock_fd(fd)
            except BaseException:
                os.close(fd)  # closing it also drops a flock taken before a refusal
                raise
            if locked:
                return self
            os.close(fd)
        raise RunFolderError(f"could not lock {self.folder}: {self.path} keeps being replaced")

    def _lock_fd(self, fd: int) -> bool:
        """True when ``fd`` is now locked and holds our record; False to retry with a new file (the
        caller closes ``fd`` then, and when this raises)."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a FIFO or a device where the lock file belongs: named, never read
            regular_file(self.path, RunFolderError)
        key = (st.st_dev, st.st_ino)
        own = _HELD.get(key)
        if own is not None and own is not self and own._pid == os.getpid():
            log.warning("taking over the lock %s left by this process (%s)", self.path, own.purpose)
            own._abandon()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(self.folder, self._holder(fd)) from None
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            now = None
        if now is None or (now.st_dev, now.st_ino) != key:  # the holder removed it as we locked it
            return False
        if os.fstat(fd).st_nlink > 1:  # a hard link shared with another folder (cp -al): a lock file of our own
            self.path.unlink()
            return False
        self._refuse_foreign(os.pread(fd, 1 << 16, 0).decode("utf-8", "replace"))
        pid = os.getpid()
        record = {
            "pid": pid,
            "host": socket.gethostname(),
            "purpose": self.purpose,
            "token": self.token,
            "started": _start_time(pid),
            "time": _now(),
        }
        data = json.dumps(record).encode("utf-8")
        # the one file written in place: an OS lock lives on its inode, which a rename would replace
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        except OSError as err:  # a full disk: no lock without the holder's details
            raise RunFolderError(f"cannot write into the folder {self.folder}: {err.strerror}") from None
        self._fd, self._key, self._pid, self.held = fd, key, pid, True
        _HELD[key] = self
        return True

    def _holder(self, fd: int) -> dict[str, Any] | None:
        """The holder's record; it writes it just after locking, so wait a moment for it."""
        for _ in range(20):
            text = os.pread(fd, 1 << 16, 0).decode("utf-8", "replace")
            info = _parse_lock(text, self.path) if text.strip() else None
            if info is not None:
                return info
            time.sleep(0.01)
        return None

    def _refuse_foreign(self, text: str) -> None:
        """We hold the flock, but the file names a holder flock does not see: a live process on this
        host (an older loopformer's lock) or another host."""
        info = _parse_lock(text, self.path) if text.strip() else None
        if info is None or info.get("token") == self.token:
            return
        host = socket.gethostname()
        if info.get("host") not in (None, host):
            raise RunFolderError(
                f"run folder {self.folder} is locked by process {info['pid']} on host {info.get('host')!r} "
                f"({info.get('purpose', '?')} since {info.get('time', '?')}); if that process is gone, "
                f"delete {self.path}"
            )
        if info["pid"] != os.getpid() and _alive(info["pid"], info.get("started")):
            raise _in_use(self.folder, info)
        if info["pid"] != os.getpid():
            log.info("lock %s was left by process %s, which is gone; it is free", self.path, info["pid"])

    def _abandon(self) -> None:
        """Give up the lock without removing the file (another holder in this process takes over)."""
        if self._fd is not None:
            os.close(self._fd)
        _HELD.pop(self._key, None)
        self._fd, self._key, self.held = None, None, False

    def release(self) -> None:
        if not self.held or self._fd is None:
            return
        if self._pid != os.getpid():  # a forked child: the parent still holds it
            self._fd, self.held = None, False
            return
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._key:
                self.path.unlink()  # while still locked: a waiting process then sees a new inode
        except OSError:
            pass  # already gone, or the folder is read-only: the lock is released all the same
        self._abandon()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def refuse_links(folder: str | Path, names: tuple[str, ...] = RUN_FILES) -> None:
    """``UnsafePathError`` naming the first of ``names`` in ``folder`` (and of the entries of its
    ``checkpoints``) that is a symbolic link: a run never writes through one."""
    folder = Path(folder)
    entries = [folder / name for name in names]
    ckpt = folder / "checkpoints"
    if ckpt.is_dir() and not ckpt.is_symlink():
        entries += sorted(ckpt.iterdir())
    for entry in entries:
        if entry.is_symlink():
            raise UnsafePathError(
                f"{entry} is a symbolic link (to {os.readlink(entry)}); loopformer does not write "
                f"through links inside the run folder {folder}: replace it with a real file or folder"
            )


def overwrite_staging(folder: str | Path) -> Path:
    """Where ``train --overwrite`` builds its new run: ``.<name>.staging-train-overwrite`` beside the
    folder (beside its target when it is a link); the same name on every rank."""
    target = Path(os.path.realpath(folder))
    return target.parent / f".{target.name}.staging-train-overwrite"


def holds_run(folder: str | Path) -> bool:
    """Whether ``folder`` holds a training run: its own files (``training_run``), ``summary.json`` or a
    ``checkpoints/latest`` pointer."""
    folder = Path(folder)
    return training_run(folder) or (folder / "summary.json").is_file() or os.path.lexists(folder / "checkpoints" / "latest")


def training_run(folder: Path) -> bool:
    """Whether ``folder`` holds a training run's own files (checkpoints or ``metrics.jsonl``)."""
    if (folder / "metrics.jsonl").is_file():
        return True
    ckpt = folder / "checkpoints"
    return ckpt.is_dir() and any(p.name.startswith("step_") for p in ckpt.iterdir())


def nested_run(folder: str | Path, depth: int = 4, limit: int = 20000) -> Path | None:
    """The first training run in a folder below ``folder`` (``depth`` levels, ``limit`` entries
    looked at; links not followed); None when there is none. A command that writes ``folder`` whole
    (``train``, or ``--overwrite`` of the other commands) would bury or remove it."""
    level, seen = [Path(folder)], 0
    for _ in range(depth):
        below: list[Path] = []
        for parent in level:
            try:
                entries = sorted(os.scandir(parent), key=lambda e: e.name)
            except OSError:
                continue
            for entry in entries:
                seen += 1
                if seen > limit:
                    return None
                if entry.is_dir(follow_symlinks=False) and not entry.name.startswith("."):
                    if training_run(Path(entry.path)):
                        return Path(entry.path)
                    below.append(Path(entry.path))
        level = below
    return None


def inside_run(path: str | Path) -> tuple[Path, bool] | None:
    """(the run folder, whether ``path`` lies in its ``checkpoints/``) for the nearest folder above
    ``path`` that holds a training run; None when there is none."""
    path = Path(os.path.abspath(path))
    for parent in path.parents:
        if training_run(parent):
            in_ckpt = path.relative_to(parent).parts[0] == "checkpoints"
            return parent, in_ckpt
    return None


def run_at_or_above(path: str | Path) -> Path | None:
    """The training run ``path`` is, or the nearest one above it (``inside_run``); None when neither."""
    if training_run(Path(path)):
        return Path(path)
    found = inside_run(path)
    return found[0] if found is not None else None


class RunFolder:
    """The training process' view of its run folder: lock, refusal or staged overwrite."""

    def __init__(self, folder: str | Path, resume: bool, overwrite: bool, is_main: bool = True) -> None:
        self.folder = Path(folder)
        self.resume, self.overwrite = resume, overwrite
        self.is_main = is_main
        self.lock = RunLock(self.folder, "resume" if resume else "train")
        self.staging: Path | None = None
        self.staging_lock: RunLock | None = None
        self.created = missing_parts(self.folder) if is_main else []  # removed by close() while still empty
        enclosing = inside_run(self.folder)
        if enclosing is not None:  # e.g. another run's checkpoints/step_N: its files would mix with ours
            raise RunFolderError(
                f"{self.folder} is inside the folder of another run, {enclosing[0]}; a run never writes "
                f"into another run's folder: choose an out_dir outside it"
            )
        nested = None if holds_run(self.folder) else nested_run(self.folder)
        if nested is not None:  # e.g. -o . in a folder of runs: this run's files would mix with theirs
            raise RunFolderError(
                f"{self.folder} holds another run's folder, {nested}; a run is written into a folder of "
                f"its own: choose a new or empty out_dir"
            )
        if is_main:
            self.lock.acquire()
            try:
                refuse_links(self.folder)
            except UnsafePathError:
                self.lock.release()
                raise
            try:
                clear_leftovers(self.folder)
            except BaseException:
                self.lock.release()
                raise
        if not resume and holds_run(self.folder):
            if not overwrite:
                self.close()
                raise RunFolderError(
                    f"{self.folder} already holds a training run; continue it with train.resume=true "
                    f"(loopformer train ... --resume), replace it with --overwrite (train.overwrite=true; "
                    f"the old run is replaced whole once the new run's first checkpoint is written), "
                    f"or choose another out_dir"
                )
            self.staging = overwrite_staging(self.folder)
            if is_main:
                self._start_staging()

    def _start_staging(self) -> None:
        """Create and lock the folder the new run is built in, beside the old one."""
        assert self.staging is not None
        cwd, target = Path.cwd().resolve(), Path(os.path.realpath(self.folder))
        if target in cwd.parents:
            self.close()
            raise RunFolderError(
                f"--overwrite would replace {self.folder}, which holds the current folder {cwd}; "
                f"run the command from outside it"
            )
        try:
            self.staging.mkdir()
            self.staging_lock = RunLock(self.staging, "train").acquire()
        except (OSError, RunFolderError) as err:
            self.close()
            reason = err.strerror if isinstance(err, OSError) else str(err)
            raise RunFolderError(f"--overwrite: cannot build the new run beside {self.folder}: {reason}") from None

    @property
    def write_dir(self) -> Path:
        """Where the run writes now: the staging folder until an overwrite completes."""
        return self.staging if self.staging is not None else self.folder

    def complete_overwrite(self) -> Path | None:
        """After the new run's first checkpoint: swap the new run in for the old one, whole.

        The new run was built in ``overwrite_staging(folder)``, beside the folder; one
        ``renameat2(RENAME_EXCHANGE)`` swaps the two (``swap_in``), so the
        folder holds the old run or the new one at every instant, and only then is the old run,
        now in the staging folder's place, removed. Returns where the old run was (None when no
        overwrite was pending).
        """
        if self.staging is None:
            return None
        staging, self.staging = self.staging, None
        if not self.is_main:
            return staging
        target = Path(os.path.realpath(self.folder))
        in_target = Path.cwd().resolve() == target
        swap_in(self.folder, staging, [target])
        if in_target:  # the shell's folder was the old run: follow the name to the new one
            os.chdir(target)
        self.lock.release()  # the old run's lock file went with it (the path now names the new one)
        self.lock, self.staging_lock = self.staging_lock, None
        self.lock.folder, self.lock.path = self.folder, self.folder / LOCK_NAME
        log.warning("--overwrite: the previous run in %s was replaced", self.folder)
        return staging

    def user_error(self, err: Exception) -> Exception:
        """``err`` naming the run folder the user gave where it names the hidden overwrite staging folder."""
        return renamed_error(err, overwrite_staging(self.folder), self.folder) if self.overwrite else err

    def close(self) -> None:
        """Release the lock; an overwrite that never reached its first checkpoint is discarded."""
        if self.is_main and self.staging is not None:
            if self.staging_lock is not None:
                self.staging_lock.release()
                self.staging_lock = None
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None
        self.lock.release()
        remove_empty(self.created)  # a run that failed before writing anything leaves no empty folder


# --------------------------------------------------------------------------------------------
# Output folders other commands write whole (eval -o, convert --out, push --to-folder, data prepare -o)
# --------------------------------------------------------------------------------------------
STAGING_PREFIX = ".staging-"
REPLACED_PREFIX = ".replaced-"
DATASET_WRITERS = ("prepare", "generate")  # the purposes that may replace a dataset folder


DATASET_MARKERS = ("dataset.json", "prepare.json")  # an HRM / TRM split, a `data prepare` folder


def holds_dataset(folder: str | Path) -> bool:
    """Whether ``folder`` holds a dataset: an HRM / TRM split or ``data prepare`` output (``dataset.json``
    or ``prepare.json`` in it or in one of its sub-folders). Only ``data prepare`` / ``data generate``
    replace one."""
    folder = Path(folder)
    if any((folder / name).is_file() for name in DATASET_MARKERS):
        return True
    try:
        children = [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return False
    return any((child / "dataset.json").is_file() for child in children)


def clear_leftovers(folder: Path) -> None:
    """Remove what a killed command left of its work on ``folder`` (the caller holds the folder's lock, which
    that command held too): the staging and replaced folders beside it (beside its target when it is a link:
    ``staged_output``, ``train --overwrite``) and, from older versions, inside it."""
    target = Path(os.path.realpath(folder))
    for stale in [folder / STAGING, *folder.glob(f"{STAGING_PREFIX}*"), *folder.glob(f"{REPLACED_PREFIX}*"),
                  *target.parent.glob(f".{target.name}{STAGING_PREFIX}*"),
                  *target.parent.glob(f".{target.name}{REPLACED_PREFIX}*")]:  # fmt: skip
        shutil.rmtree(stale, ignore_errors=True)


def _contents(folder: Path) -> list[Path]:
    """What ``folder`` holds, leaving out the lock and earlier staging / replaced folders."""
    skip = (LOCK_NAME, STAGING)
    return sorted(
        p
        for p in folder.iterdir()
        if p.name not in skip and not p.name.startswith((STAGING_PREFIX, REPLACED_PREFIX))
    )


def output_folder(folder: Path, option: str, purpose: str) -> None:
    """Refuse a folder that ``purpose`` (a command) would write whole (``option``: where the user named it)
    when it is a symbolic link (its target would be emptied and refilled) or a file."""
    if folder.is_symlink():
        raise UnsafePathError(
            f"{option} {folder} is a symbolic link (to {os.readlink(folder)}); `{purpose}` writes its output "
            f"folder whole and never through a link: name the folder itself ({os.path.realpath(folder)})"
        )
    if folder.exists() and not folder.is_dir():
        raise RunFolderError(f"{option} {folder} is a file, not a folder: name a folder to write into")


@contextmanager
def staged_output(
    folder: str | Path,
    purpose: str,
    overwrite: bool,
    option: str = "--out",
    protect_runs: bool = True,
    root: str | Path | None = None,
) -> Iterator[Path]:
    """Lock ``folder``, refuse it when it holds something (unless ``overwrite``), yield a staging
    folder and swap its contents in whole when the block succeeds (see the module docstring).
    ``root``: the folder that owns ``folder`` (a sweep's folder for its ``compare/``): no part of
    ``folder`` below it may be a symbolic link, and ``folder`` must lie inside it."""
    folder = Path(folder)
    if root is not None:
        check_inside(folder, root)
    output_folder(folder, option, purpose)
    enclosing = inside_run(folder)
    if enclosing is not None and enclosing[1]:
        raise RunFolderError(
            f"{option} {folder} is inside the checkpoints of the run {enclosing[0]}: nothing but that run's "
            f"training writes there; choose a folder outside {enclosing[0] / 'checkpoints'}"
        )
    if enclosing is not None:  # a report inside a run: not through a link there (nor out of the run)
        check_inside(folder, enclosing[0])
    if protect_runs and purpose not in DATASET_WRITERS and holds_dataset(folder):
        raise RunFolderError(
            f"{option} {folder} holds a dataset; `{purpose}` never replaces one (only `data prepare` and "
            f"`data generate` do): choose another folder"
        )
    created = missing_parts(folder)  # the folders this command creates, removed again on a failure
    try:
        with RunLock(folder, purpose):
            clear_leftovers(folder)
            target = Path(os.path.realpath(folder))  # a folder may be a link (a scratch disk): build beside its target
            old = _contents(folder)
            if old and protect_runs and training_run(folder):
                raise RunFolderError(
                    f"{option} {folder} holds a training run; `{purpose}` never replaces a run: choose another folder"
                )
            nested = nested_run(folder) if old and protect_runs else None
            if nested is not None:  # --overwrite would remove it with the rest
                raise RunFolderError(
                    f"{option} {folder} holds the training run {nested}; `{purpose}` never replaces a run: "
                    f"choose another folder"
                )
            if old and not overwrite:
                names = ", ".join(p.name for p in old[:3]) + (" ..." if len(old) > 3 else "")
                raise RunFolderError(
                    f"{option} {folder} is not empty ({names}); choose a new or empty folder, or pass --overwrite "
                    f"(the new contents replace the old in one step once they are complete)"
                )
            staging = target.parent / f".{target.name}{STAGING_PREFIX}{purpose}-{secrets.token_hex(4)}"
            try:
                staging.mkdir()
            except OSError as err:
                raise RunFolderError(f"cannot write beside the folder {folder}: {err.strerror}") from None
            try:
                yield staging
                aside = swap_in(folder, staging, old)
            except Exception as err:  # named by the folder the user gave, not the hidden staging one
                shutil.rmtree(staging, ignore_errors=True)
                renamed = renamed_error(err, staging, folder)
                if renamed is err:
                    raise
                raise renamed from None
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)  # after a swap it holds the old content: gone too
                raise
    except BaseException:
        remove_empty(created)  # folders this command made and left empty go again
        raise
    if aside is not None:
        log.warning("--overwrite: the previous contents of %s were replaced", folder)


def renamed_error(err: Exception, staging: Path, folder: Path) -> Exception:
    """``err`` with a path inside ``staging`` given as the same path inside ``folder`` (an OSError's file
    name, or the text of an error whose one argument is its message); ``err`` itself when it names none."""
    if isinstance(err, OSError):
        name = str(err.filename or "")
        if not name.startswith(str(staging)):
            return err
        shown = str(folder) + name[len(str(staging)) :]
        if isinstance(err, WriteError):
            return WriteError(err.errno, err.strerror, shown)
        return OSError(err.errno, err.strerror, shown)
    if len(err.args) == 1 and isinstance(err.args[0], str) and str(staging) in err.args[0]:
        try:
            return type(err)(err.args[0].replace(str(staging), str(folder)))
        except TypeError:  # an exception type built from other arguments: keep it as it is
            return err
    return err


def swap_in(folder: Path, staging: Path, old: list[Path]) -> Path | None:
    """Put ``staging``'s content in place of ``folder``'s, then delete the old content.

    ``staging`` is a sibling of ``folder``. Where the OS can, one ``renameat2(RENAME_EXCHANGE)``
    swaps the two folders: at every instant ``folder`` holds the old content or the new, whole.
    Elsewhere two renames (``folder`` aside, ``staging`` in) leave a window in which ``folder``
    does not exist; a crash inside it leaves the old content in the aside folder and the new in the
    staging folder, both beside ``folder`` (named in the module docstring). The old content is
    removed only once the new one is in place. Returns where the old content was (now removed), or
    None when ``folder`` held nothing.
    """
    target = Path(os.path.realpath(folder))  # a run folder may be a link (a scratch disk): swap its target
    fsync_dir(staging)
    if exchange_folders(staging, target):
        aside = staging  # it now holds the old content
    else:
        aside = staging.with_name(staging.name.replace(STAGING_PREFIX, REPLACED_PREFIX, 1))
        os.replace(target, aside)
        try:
            os.replace(staging, target)
        except OSError:
            os.replace(aside, target)  # put the old content back: the folder is never left missing
            raise
    fsync_dir(target.parent)
    shutil.rmtree(aside, ignore_errors=True)  # only now: the new content is in place
    return aside if old else None




# --------------------------------------------------------------------------------------------
# Provenance: what produced a run (provenance.json)
# --------------------------------------------------------------------------------------------
FILE = "provenance.json"
PACKAGE = Path(__file__).resolve().parent.parent  # the loopformer package folder (loopformer/)


@dataclass
class _GitRecord(Record):
    commit: JSONStr
    dirty: bool


@dataclass
class ProvenanceRecord(Record):
    """One training start in ``provenance.json`` (``collect`` writes more fields; these are read back)."""

    step: Count = 0
    started: JSONStr | None = None
    resumed: bool = False
    command: JSONStr | None = None
    git: _GitRecord | None = None


@dataclass
class ProvenanceFile(Record):
    records: list[ProvenanceRecord]


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git_state(source: Path = PACKAGE) -> dict[str, Any] | None:
    """``{"commit": the 40-hex commit, "dirty": uncommitted changes to tracked files}`` of the git repository
    whose work tree holds the running loopformer source ``source`` (found as git finds it, walking up from
    the package: a clone, or a worktree whose ``.git`` is a file); None when the source lies in no repository
    that tracks it (an installed copy, also one in a virtual environment inside some other project)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(source), *args], capture_output=True, text=True, timeout=10)
        if done.returncode:
            raise subprocess.SubprocessError(done.stderr.strip())
        return done.stdout.strip()

    try:
        git("ls-files", "--error-unmatch", "__init__.py")  # the repository tracks this very source
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):  # no git, no repository, or the source untracked in it
        return None
    return {"commit": commit, "dirty": dirty}


def collect(device: Any = None, step: int = 0, resumed: bool = False) -> dict[str, Any]:
    """A provenance record of this process, now."""
    import torch

    device_name = str(device) if device is not None else None
    if device is not None and getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available():
        device_name = f"{device} ({torch.cuda.get_device_name(device)})"
    return {
        "started": _now(),
        "step": int(step),
        "resumed": bool(resumed),
        "loopformer": _version("loopformer"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git": git_state(),
        "threads": torch.get_num_threads(),
        "device": device_name,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "command": _command_line(),
        "cwd": os.getcwd(),
    }


def _command_line() -> str:
    """``sys.argv`` as a shell line; ``python -m loopformer`` shows as ``loopformer``."""
    if not sys.argv:
        return ""
    program = Path(sys.argv[0]).name
    return shlex.join(["loopformer" if program == "__main__.py" else program, *sys.argv[1:]])


def read_records(folder: str | Path) -> list[dict[str, Any]]:
    """The records of ``folder/provenance.json`` (oldest first); [] when there is none. A file that is no
    provenance record (``ProvenanceFile``) is a ValueError naming it and the field: appending to it would
    silently drop the run's history."""
    path = Path(folder) / FILE
    if not path.is_file():
        return []
    return list(read_record(path, ProvenanceFile)["records"])


def append_record(folder: str | Path, *added: dict[str, Any]) -> Path:
    """Add the records ``added`` to ``folder/provenance.json``, keeping the earlier ones (an atomic rewrite)."""
    folder = Path(folder)
    records = [*read_records(folder), *added]
    return atomic_write_json(folder / FILE, {"records": records}, root=folder, indent=2, newline=True)


def record_for_step(folder: str | Path, step: int) -> dict[str, Any] | None:
    """The record of the training that reached ``step``: the last one starting before it."""
    records = [r for r in read_records(folder) if int(r.get("step", 0)) < max(step, 1)]
    return records[-1] if records else None


def describe(record: dict[str, Any]) -> str:
    """One line for a report: versions, commit, threads, device, start time and command line."""
    git = record.get("git")
    commit = (
        f"commit {git['commit'][:10]}{' (dirty)' if git.get('dirty') else ''}" if git else "no git commit"
    )
    return (
        f"loopformer {record.get('loopformer')}, torch {record.get('torch')}, Python {record.get('python')}, "
        f"{commit}, threads {record.get('threads')}, device {record.get('device')}, "
        f"started {record.get('started')}: `{record.get('command')}`"
    )




# --------------------------------------------------------------------------------------------
# Fingerprints of a run's data: what decides "the same data"
# --------------------------------------------------------------------------------------------
FULL_HASH_BYTES = 1 << 30
SAMPLE_BLOCKS = 4096


def _update(h: Any, array: np.ndarray, sampled: bool) -> None:
    """Feed ``array`` (rows first) to ``h``: every row, or ``SAMPLE_BLOCKS`` evenly spaced row blocks."""
    h.update(f"{array.dtype.str}{array.shape}".encode())
    n = len(array)
    if n == 0:
        return
    if not sampled:
        step = max(1, (64 << 20) // max(array[:1].nbytes, 1))  # about 64 MiB at a time
        for start in range(0, n, step):
            h.update(np.ascontiguousarray(array[start : start + step]).tobytes())
        return
    block = max(1, n // (SAMPLE_BLOCKS * 64))
    for start in np.linspace(0, max(n - block, 0), SAMPLE_BLOCKS).astype(np.int64):
        h.update(np.ascontiguousarray(array[start : start + block]).tobytes())


def dataset_digest(dataset: Any) -> dict[str, Any]:
    """``{"rows", "sha256"[, "sampled"]}`` of a data set's token ids, labels and puzzle ids; a streamed set
    (``tasks.text.StreamedWindows``, read from its token file a batch at a time) by what draws its windows:
    the token file's own fingerprint (size, SHA-256), the split, window length, order and seed."""
    if getattr(dataset, "streamed", False):
        keys = ("fingerprint", "split", "seq_len", "order", "seed")
        what = json.dumps({k: dataset.meta.get(k) for k in keys}, sort_keys=True, default=str)
        return {"rows": len(dataset), "sha256": hashlib.sha256(what.encode()).hexdigest(), "streamed": True}
    arrays = [dataset.inputs, dataset.labels]
    if getattr(dataset, "puzzle_ids", None) is not None:
        arrays.append(dataset.puzzle_ids)
    sampled = sum(int(a.nbytes) for a in arrays) > FULL_HASH_BYTES
    h = hashlib.sha256()
    for array in arrays:
        _update(h, np.asarray(array), sampled)
    out: dict[str, Any] = {"rows": int(len(dataset.inputs)), "sha256": h.hexdigest()}
    if sampled:
        out["sampled"] = True
    return out


def source(data: DataConfig, split: str) -> dict[str, Any]:
    """Where a run's ``split`` ("train" | "eval") set comes from: a path, or the generator's settings."""
    path = data.train_path if split == "train" else data.eval_path
    if path:
        return {"path": os.path.abspath(path)}
    return {
        "generate": dict(data.train_generate if split == "train" else data.eval_generate),
        "seed": data.train_seed if split == "train" else data.eval_seed,
        "size": data.train_size if split == "train" else data.eval_size,
    }


def data_fingerprint(data: DataConfig, split: str, dataset: Any) -> dict[str, Any] | None:
    """The fingerprint of a run's ``split`` set (None when there is none)."""
    if dataset is None:
        return None
    return {"source": source(data, split), **dataset_digest(dataset)}


def training_data(config: RunConfig, train: Any, held_out: Any) -> dict[str, Any]:
    """What a checkpoint records of the data it was trained and evaluated on."""
    return {
        "task": config.data.task,
        "train": data_fingerprint(config.data, "train", train),
        "eval": data_fingerprint(config.data, "eval", held_out),
    }


def _described(fp: Any) -> str:
    if not isinstance(fp, dict):
        return "none"
    where = fp.get("source") or {}
    origin = where.get("path") or f"generated (seed {where.get('seed')}, {where.get('generate') or {}})"
    return f"{fp.get('rows')} rows of {origin}, sha256 {str(fp.get('sha256'))[:12]}"


def data_changes(saved: Any, current: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"data.<split> (rows)": {"old": description, "new": description}}`` for each set whose rows differ
    between a checkpoint's record ``saved`` (None for a checkpoint written before data was recorded: nothing
    to compare) and ``current``."""
    if not isinstance(saved, dict):
        return {}
    changes = {}
    for split in ("train", "eval"):
        old, new = saved.get(split), current.get(split)
        key = lambda fp: (fp.get("rows"), fp.get("sha256")) if isinstance(fp, dict) else None  # noqa: E731
        if key(old) != key(new):
            changes[f"data.{split} (rows)"] = {"old": _described(old), "new": _described(new)}
    return changes


def heldout_record(config: RunConfig, dataset: Any) -> dict[str, Any]:
    """What an evaluation report records about its held-out set: task, task options, fingerprint."""
    unscored = int((getattr(dataset, "meta", None) or {}).get("unscored_rows", 0))
    return {"task": config.data.task, "options": dict(config.data.options),
            **(data_fingerprint(config.data, "eval", dataset) or {}), "unscored_rows": unscored}  # fmt: skip




# --------------------------------------------------------------------------------------------
# What a resume checks before it loads a checkpoint, and records after
# --------------------------------------------------------------------------------------------
CHANGES = "config_changes.jsonl"
ORIGIN = "origin.json"

# keys that never change the training stream (what is logged, evaluated or kept, and where)
STREAM_FREE = frozenset(
    {
        "out_dir",
        "device",
        "compile",
        "tf32",  # the hardware's float32 arithmetic on CUDA, as device and compile
        "train.resume",
        "train.overwrite",
        "train.allow_config_change",
        "train.log_every",
        "train.eval_every",
        "train.checkpoint_every",
        "train.keep_checkpoints",
        "train.checkpoint_format",  # how checkpoints are stored (full or sharded), not what is trained
        "train.keep_best",
        "train.keep_best_mode",
        "train.max_state_norm",
        "train.max_loss",
        "train.progress",
        "train.tensorboard",
        "train.wandb",
        "train.wandb_project",
        "train.wandb_mode",
        "train.threads",
        "train.strategy",
        "train.find_unused_parameters",
    }
)
_MISSING = object()


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"train.lr": 0.001, ...}``: nested mappings as dotted keys (lists are values)."""
    if not isinstance(data, dict) or (prefix and not data):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _free(key: str, current: dict[str, Any]) -> bool:
    """Whether ``key`` may change on a resume of a run whose (flat) config is ``current``.

    ``train.steps`` is free only under a constant schedule without Muon's weight-decay taper (a
    cosine / trapezoid schedule or the taper is a function of it); the evaluation settings
    (``eval.*``, ``loop_eval``, ``loop_periodic``) only without a curriculum, whose level-ups
    depend on an evaluation.
    """
    if key in STREAM_FREE:
        return True
    if key == "train.steps":
        taper = current.get("train.optimizer") == "muon_adamw" and current.get(
            "train.muon_weight_decay_taper"
        )
        return current.get("train.schedule") == "constant" and not taper
    if key.startswith(("eval.", "loop_eval", "loop_periodic")):
        return not current.get("data.curriculum.enabled")
    return False


def config_changes(saved: dict[str, Any], current: RunConfig) -> dict[str, dict[str, Any]]:
    """``{key: {"old": ..., "new": ...}}`` for the stream-changing keys where the checkpoint's
    ``config.json`` (``saved``) and ``current`` differ; a key one side lacks compares with its default."""
    # family / step / plugins: what the checkpoint records beside the config (StoredConfig)
    old = _flat(stored_table({k: v for k, v in saved.items() if k not in CHECKPOINT_META_KEYS}))
    new = _flat(json.loads(config_to_json(current)))
    default = _flat(to_dict(RunConfig()))
    # the model's resolved loop: a field added since the checkpoint was written compares with its default, a
    # plug-in's options an earlier version listed for every plug-in with the plug-in's defaults
    loop_defaults = {**to_dict(LoopConfig()), **to_dict(plugin_defaults())}
    default.update({f"model.loop.{k}": v for k, v in _flat(loop_defaults).items()})
    changes = {}
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, default.get(key, _MISSING)), new.get(key, default.get(key, _MISSING))
        if a != b and not _free(key, new):
            changes[key] = {"old": None if a is _MISSING else a, "new": None if b is _MISSING else b}
    return changes


def record_changes(run_dir: Path, folder: Path, step: int, changes: dict[str, dict[str, Any]]) -> None:
    """Append the allowed change to ``run_dir/config_changes.jsonl`` (time, step, checkpoint, each key's
    old and new value)."""
    if changes:
        record = {"time": _now(), "step": step, "checkpoint": str(folder), "changes": changes}
        append_line(run_dir / CHANGES, json.dumps(record), root=run_dir, fsync=True)


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def check_origin(folder: Path, ckpt_dir: Path, run_dir: Path) -> Path | None:
    """None for a checkpoint of this run; for another run's: refused when ``run_dir`` holds a run (of
    its own: not the same branch started again before its first checkpoint), else its run folder
    (``record_origin`` writes ``origin.json`` once the checkpoint is loaded)."""
    if _real(folder).is_relative_to(_real(ckpt_dir)):
        return None
    source = folder.parent.parent if folder.parent.name == "checkpoints" else folder.parent
    # the same branch started again before its first checkpoint (killed early) may go on
    origin = read_origin(run_dir)
    again = origin is not None and origin["checkpoint"] == str(_real(folder)) and not step_dirs(ckpt_dir)
    if step_dirs(ckpt_dir) or (holds_run(run_dir) and not again):
        raise CheckpointError(
            f"train.resume names {folder}, a checkpoint of another run ({source}), but {run_dir} holds a "
            f"run of its own; resuming would write that run's weights under this run's step names. Resume "
            f"this run with train.resume=true, or continue the other one in a new, empty out_dir"
        )
    return source


def record_origin(run_dir: Path, folder: Path, source: Path, step: int) -> None:
    """``run_dir/origin.json``: the checkpoint this branch started from, its run folder, step and time."""
    record = {"checkpoint": str(_real(folder)), "run": str(_real(source)), "step": step, "time": _now()}
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / ORIGIN, record, root=run_dir, indent=1)
    if not (run_dir / FILE).is_file():  # the branch's history starts with the trainings that led to its weights
        try:
            earlier = [{**r, "run": str(_real(source))} for r in read_records(source) if r.get("step", 0) < step]
        except ValueError as err:  # the other run's file is malformed: the branch starts its own history
            log.warning("%s; the branch's provenance starts here", err)
            earlier = []
        if earlier:
            append_record(run_dir, *earlier)


@dataclass
class OriginRecord(Record):
    """``origin.json``: the checkpoint a branch started from, its run folder, its step and when."""

    checkpoint: JSONStr
    run: JSONStr
    step: Count
    time: JSONStr = ""


def read_origin(run_dir: Path) -> dict[str, Any] | None:
    """``run_dir/origin.json`` (``OriginRecord``), None when there is none; CheckpointError naming the file
    and field when it is malformed."""
    path = run_dir / ORIGIN
    if not path.is_file():
        return None
    return read_record(path, OriginRecord, CheckpointError)


def branch_origin(run_dir: Path) -> Path | None:
    """For ``train.resume=true`` in a run folder without a checkpoint: the checkpoint its ``origin.json``
    names (a branch killed before its first checkpoint continues from where it branched, never from step 0),
    None without an ``origin.json``; CheckpointError naming ``origin.json`` when that checkpoint is gone or
    does not verify."""
    record = read_origin(run_dir)
    if record is None:
        return None
    folder = Path(record["checkpoint"])
    why = verify_checkpoint(folder)
    if why is None:
        log.info("resume: %s is a branch of %s (%s) with no checkpoint of its own: continuing from there",
                 run_dir, folder, ORIGIN)  # fmt: skip
        return folder
    raise CheckpointError(
        f"resume: {run_dir} is a branch of {folder} ({run_dir / ORIGIN}) with no checkpoint of its own, and that "
        f"checkpoint cannot be used ({why}); restore it, or start afresh with --overwrite"
    )


def resume_folder(resume: bool | str, ckpt_dir: Path) -> Path | None:
    """The checkpoint ``train.resume`` asks for: None (a fresh run), the run's newest good one (``true``: by
    its manifest and finite weights; a branch without a checkpoint of its own: where it branched from), or
    the one named. Only corrupt checkpoints: an error naming each, never a silent restart from step 0."""
    if resume is False or resume == "":
        return None
    if resume is not True:
        return resolve_checkpoint(resume)
    folder, skipped = latest_good_checkpoint(ckpt_dir)
    if folder is None and skipped:  # every checkpoint is unusable
        raise CheckpointError(
            f"resume: no usable checkpoint in {ckpt_dir}; every one is corrupt: {'; '.join(skipped)}. Nothing was "
            f"loaded or overwritten; repair or remove them (or start afresh with --overwrite, without --resume)"
        )
    for reason in skipped:
        log.warning("resume: skipped %s", reason)
    if folder is None:  # a branch killed before its first checkpoint goes on from where it branched
        folder = branch_origin(ckpt_dir.parent)
    if folder is None:
        log.info("resume: no usable checkpoint in %s, starting from scratch", ckpt_dir)
    return folder


@dataclass
class ResumeChecks:
    """What ``check_resume`` found before a checkpoint is loaded; ``record_resume`` writes it afterwards."""

    folder: Path  # the checkpoint resumed from
    origin: Path | None  # the other run this one branches from (origin.json), None for its own checkpoint
    changes: dict[str, dict[str, Any]]  # what --allow-config-change let differ (config_changes.jsonl)


def check_resume(folder: Path, config: RunConfig, run_dir: Path, data: dict[str, Any]) -> ResumeChecks:
    """Before loading ``folder`` into the run in ``run_dir``: it is this run's checkpoint (or this run is a new
    branch of it, ``check_origin``), ``config`` trains the same stream as the checkpoint's ``config.json``
    (``config_changes``) and the data holds the rows its ``state.json`` recorded (``data_changes``; ``data``: this
    run's ``training_data``; a checkpoint written before data was recorded has nothing to compare). A difference
    is refused (CheckpointError listing each) unless ``train.allow_config_change`` (``record_resume`` then
    writes it once the checkpoint is loaded)."""
    origin = check_origin(folder, run_dir / "checkpoints", run_dir)
    changes = config_changes(read_record(folder / "config.json", StoredConfig, CheckpointError), config)
    state = folder / "state.json"
    saved = read_record(state, StateRecord, CheckpointError).get("data") if state.is_file() else None
    changes.update(data_changes(saved, data))
    if changes and not config.train.allow_config_change:
        listed = "; ".join(f"{k}: {v['old']!r} -> {v['new']!r}" for k, v in changes.items())
        raise CheckpointError(
            f"resume: this config or data differs from what checkpoint {folder} was trained with in "
            f"{', '.join(changes)} ({listed}); a resume continues the same training on the same rows, so these must "
            f"match. Resume with the run's config and data, or pass --allow-config-change "
            f"(train.allow_config_change=true) to continue with the change (recorded in {run_dir / CHANGES})"
        )
    return ResumeChecks(folder, origin, changes)


def record_resume(run_dir: Path, checks: ResumeChecks, step: int) -> None:
    """After the checkpoint is loaded (rank 0): a branch's ``origin.json`` and the allowed changes."""
    if checks.origin is not None:
        record_origin(run_dir, checks.folder, checks.origin, step)
    record_changes(run_dir, checks.folder, step, checks.changes)


# --------------------------------------------------------------------------------------------
# A run's summary (summary.json)
# --------------------------------------------------------------------------------------------
SUMMARY_FILE = "summary.json"


@dataclass
class _BestSummary(Record):
    label: JSONStr
    metric: JSONStr
    value: JSONNumber
    step: Count = 0
    checkpoint: JSONStr = ""


@dataclass
class Summary(Record):
    """What the trainer writes (``loopformer.train.trainer.Trainer.summary``) and ``loopformer run`` writes
    (``loopformer.commands.run``) as ``summary.json``: every field optional, each of its type when present."""

    steps: Count = 0
    checkpoint: JSONStr | None = None
    run_dir: JSONStr | None = None
    resumed_from: JSONStr | None = None
    train: dict | None = None
    eval: dict[str, JSONNumber | JSONStr | bool | dict | list | None] | None = None
    eval_label: JSONStr | None = None
    best: _BestSummary | None = None
    wall_time: JSONNumber | None = None
    parameters: JSONInt | dict[str, JSONInt | None] | None = None
    mean_steps_by_difficulty: dict[str, JSONNumber | None] | None = None
    recipe: JSONStr | None = None
    overrides: list[JSONStr] | None = None


def read_summary(run: str | Path) -> dict[str, Any] | None:
    """``run/summary.json`` checked against ``Summary`` (ValueError naming the file and field); None when
    there is none."""
    path = Path(run) / SUMMARY_FILE
    if not path.is_file():
        return None
    return read_record(path, Summary)


def finished_summary(run: str | Path, steps: int) -> dict[str, Any] | None:
    """``run``'s summary when its training reached ``steps`` and wrote a checkpoint, else None; its
    ``checkpoint`` is this run's own ``checkpoints/<step folder>`` (the recorded path is read as a name,
    never followed out of the run folder)."""
    run = Path(run)
    summary = read_summary(run)
    if summary is None or int(summary.get("steps") or 0) < steps or not summary.get("checkpoint"):
        return None
    name = Path(str(summary["checkpoint"])).name
    where = f"{run / SUMMARY_FILE}: 'checkpoint'"
    if STEP_DIR.match(name) is None:
        raise CheckpointError(
            f"{where} names {summary['checkpoint']!r}, which is not a step_N checkpoint folder"
        )
    folder = check_inside(run / "checkpoints" / name, run)  # never through a link out of the run folder
    if not folder.is_dir():
        return None  # pruned or removed: the run is not finished as far as this command can see
    return {**summary, "checkpoint": str(folder)}
