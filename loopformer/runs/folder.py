"""Run folders: an OS lock, and a fresh run that never destroys a previous one.

- ``RunLock``: ``<folder>/.loopformer.lock``, locked with ``fcntl.flock`` (exclusive, non-blocking).
  The kernel decides who holds it, so two processes starting at the same instant can never both
  hold it, and a holder that dies (killed, preempted) releases it with its last file descriptor:
  there is no stale lock to detect and take over. The file's content, written after the lock is
  held, is for people: the holder's pid, host, purpose (train / resume / eval / convert / push /
  prepare), start time and a random token; a second process is refused with a message naming the
  holder. The holder removes the file while it still holds the lock; a process that locked a file
  which was removed (or replaced) meanwhile sees another inode at the path and tries again, so two
  holders can never sit on two different files. Two more refusals keep the lock safe where
  ``flock`` does not reach: a lock file left with the content of a live process on this host
  that holds no ``flock`` (an older loopformer), and one naming another host (``flock`` on some
  network file systems is local to each machine); for the latter the message says which file to delete.
  The same process locking a folder again (an abandoned ``Trainer`` in one interpreter) takes the
  lock over from its own earlier holder.
- ``RunFolder``: what a training process does with its folder. A fresh run (not a resume) into a
  folder that already holds a run (checkpoints, ``metrics.jsonl`` or ``summary.json``) is refused
  with a message naming ``train.resume=true`` and ``--overwrite``. With ``--overwrite``
  (``train.overwrite=true``) the new run is built in a hidden folder beside it,
  ``.<name>.staging-train-overwrite`` (locked too); only after its first checkpoint is safely
  written does ``complete_overwrite`` swap the two folders in one ``renameat2(RENAME_EXCHANGE)``
  (``loopformer.runs.outputs.swap_in``) and remove the old run. A kill at any instant leaves the
  folder holding the old run or the new one, whole; the next command clears the leftovers. A folder whose
  run files (``checkpoints``, ``metrics.jsonl``, ``config.*``, ...) are symbolic links is refused
  (``loopformer.files.UnsafePathError`` naming the link): nothing is written through a link, and a
  folder inside another run's folder (``inside_run``: its ``checkpoints/step_N``, say) is refused.

``fcntl.flock`` rather than the ``filelock`` package: it is the same system call, and not a new
dependency. ``flock`` is POSIX-only; where ``fcntl`` is missing (Windows) locking is refused
with a clear error rather than done unsafely.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from loopformer.files import UnsafePathError, check_record, missing_parts, remove_empty

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("loopformer.train")

LOCK_NAME = ".loopformer.lock"
STAGING = ".overwrite-staging"
RUN_MARKERS = ("metrics.jsonl", "summary.json")
# what a run writes at its folder's top level: none of these may be a symbolic link
RUN_FILES = ("checkpoints", "metrics.jsonl", "summary.json", "config.yaml", "config.json", "wandb_id",
             "tensorboard", "provenance.json", "origin.json", "config_changes.jsonl", STAGING, LOCK_NAME)  # fmt: skip

_HELD: dict[tuple[int, int], RunLock] = {}  # (device, inode) of lock files this process holds


class RunFolderError(RuntimeError):
    """A run folder that is in use or holds a run this command would destroy."""


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
    """The lock file's record (``loopformer.runs.records.LOCK``), None when it holds none that is valid (a
    record with a field of the wrong type, a pid that is no process id: logged, then treated as no holder)."""
    from loopformer.runs.records import LOCK

    try:
        info = json.loads(text)
    except ValueError:
        return None
    try:
        return check_record(info, LOCK, str(path or LOCK_NAME), RunFolderError)
    except RunFolderError as err:
        log.warning("%s; the lock file names no holder", err)
        return None


def _describe(info: dict[str, Any] | None) -> str:
    if info is None:
        return "another process (it is starting: its details are not written yet)"
    return (
        f"process {info['pid']} on {info.get('host', '?')} "
        f"({info.get('purpose', '?')} since {info.get('time', '?')})"
    )


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
        key = (st.st_dev, st.st_ino)
        own = _HELD.get(key)
        if own is not None and own is not self and own._pid == os.getpid():
            log.warning("taking over the lock %s left by this process (%s)", self.path, own.purpose)
            own._abandon()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = self._holder(fd)
            raise RunFolderError(
                f"run folder {self.folder} is in use by {_describe(info)}; wait for it to finish, "
                f"or use another folder"
            ) from None
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
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
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
            raise RunFolderError(
                f"run folder {self.folder} is in use by process {info['pid']} on {host} "
                f"({info.get('purpose', '?')} since {info.get('time', '?')}); wait for it to finish, "
                f"or use another folder"
            )
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


def _replaced_name(target: Path) -> str:
    return f".{target.name}.replaced-train-overwrite"  # where the fallback's first rename puts the old run


def holds_run(folder: str | Path) -> bool:
    """Whether ``folder`` holds a training run: checkpoints, ``metrics.jsonl`` or ``summary.json``."""
    folder = Path(folder)
    if any((folder / name).is_file() for name in RUN_MARKERS):
        return True
    ckpt = folder / "checkpoints"
    return ckpt.is_dir() and any(p.name == "latest" or p.name.startswith("step_") for p in ckpt.iterdir())


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
                self._clear_leftovers()
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

    def _clear_leftovers(self) -> None:
        """Remove what a killed overwrite left (we hold the folder's lock, which it needed)."""
        target = Path(os.path.realpath(self.folder))
        shutil.rmtree(self.folder / STAGING, ignore_errors=True)  # the in-folder staging of older versions
        for name in (overwrite_staging(self.folder).name, _replaced_name(target)):
            if (target.parent / name).is_dir():
                shutil.rmtree(target.parent / name, ignore_errors=True)

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
        ``renameat2(RENAME_EXCHANGE)`` swaps the two (``loopformer.runs.outputs.swap_in``), so the
        folder holds the old run or the new one at every instant, and only then is the old run,
        now in the staging folder's place, removed. Returns where the old run was (None when no
        overwrite was pending).
        """
        if self.staging is None:
            return None
        staging, self.staging = self.staging, None
        if not self.is_main:
            return staging
        from loopformer.runs.outputs import swap_in

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
        from loopformer.runs.outputs import renamed_error

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
