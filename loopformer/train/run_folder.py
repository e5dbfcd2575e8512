"""Run folders: a lock file, and a fresh run that never destroys a previous one.

- ``RunLock``: ``<folder>/.loopformer.lock`` holds the process id, host, purpose (train / resume /
  eval) and a random token. It is created with ``O_CREAT | O_EXCL``; a second process finding a
  live lock is refused with a message naming the holder. A lock is stale (and taken over) when
  its process is gone on this host (``os.kill(pid, 0)``, plus the process start time from
  ``/proc`` so a recycled pid is not mistaken for the holder), when it is unreadable, or when the
  holder is this very process (an abandoned ``Trainer`` in the same interpreter). A lock from
  another host is never taken over automatically: the message says how to remove it.
- ``RunFolder``: what a training process does with its folder. A fresh run (not a resume) into a
  folder that already holds a run (checkpoints, ``metrics.jsonl`` or ``summary.json``) is refused
  with a message naming ``train.resume=true`` and ``--overwrite``. With ``--overwrite``
  (``train.overwrite=true``) the new run writes into a hidden staging folder
  ``<folder>/.overwrite-staging``; only after its first checkpoint is safely written does
  ``complete_overwrite`` move the old contents aside to ``<folder>/.replaced-<UTC time>/`` and
  the new files into place. A run killed before that leaves the old run untouched.
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

log = logging.getLogger("loopformer.train")

LOCK_NAME = ".loopformer.lock"
STAGING = ".overwrite-staging"
RUN_MARKERS = ("metrics.jsonl", "summary.json")


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


def _alive(pid: int, started: str | None) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    now = _start_time(pid)
    return started is None or now is None or now == started


def _read_lock(path: Path) -> dict[str, Any] | None:
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and isinstance(info.get("pid"), int) else None


class RunLock:
    """An exclusive lock on a folder, held until ``release()`` (also a context manager)."""

    def __init__(self, folder: str | Path, purpose: str) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.purpose = purpose
        self.token = secrets.token_hex(8)
        self.held = False

    def acquire(self) -> RunLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        pid = os.getpid()
        record = {
            "pid": pid,
            "host": socket.gethostname(),
            "purpose": self.purpose,
            "token": self.token,
            "started": _start_time(pid),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(json.dumps(record))
            self.held = True
            return self
        raise RunFolderError(f"could not lock {self.folder}: {self.path} keeps reappearing")

    def _take_over_if_stale(self) -> None:
        info = _read_lock(self.path)
        host = socket.gethostname()
        if info is not None and info.get("host") == host and info["pid"] != os.getpid():
            if _alive(info["pid"], info.get("started")):
                raise RunFolderError(
                    f"run folder {self.folder} is in use by process {info['pid']} on {host} "
                    f"({info.get('purpose', '?')} since {info.get('time', '?')}); wait for it to finish, "
                    f"or use another folder"
                )
        elif info is not None and info.get("host") != host:
            raise RunFolderError(
                f"run folder {self.folder} is locked by process {info['pid']} on host {info.get('host')!r} "
                f"({info.get('purpose', '?')} since {info.get('time', '?')}); if that process is gone, "
                f"delete {self.path}"
            )
        why = (
            "unreadable"
            if info is None
            else ("left by this process" if info["pid"] == os.getpid() else f"process {info['pid']} is gone")
        )
        log.warning("taking over the stale lock %s (%s)", self.path, why)
        aside = self.path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.replace(self.path, aside)
            aside.unlink(missing_ok=True)
        except FileNotFoundError:
            pass  # another process took it over first; retry the create

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        info = _read_lock(self.path)
        if info is not None and info.get("token") == self.token:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def holds_run(folder: str | Path) -> bool:
    """Whether ``folder`` holds a training run: checkpoints, ``metrics.jsonl`` or ``summary.json``."""
    folder = Path(folder)
    if any((folder / name).is_file() for name in RUN_MARKERS):
        return True
    ckpt = folder / "checkpoints"
    return ckpt.is_dir() and any(p.name == "latest" or p.name.startswith("step_") for p in ckpt.iterdir())


class RunFolder:
    """The training process' view of its run folder: lock, refusal or staged overwrite."""

    def __init__(self, folder: str | Path, resume: bool, overwrite: bool, is_main: bool = True) -> None:
        self.folder = Path(folder)
        self.resume = resume
        self.is_main = is_main
        self.lock = RunLock(self.folder, "resume" if resume else "train")
        self.staging: Path | None = None
        if is_main:
            self.lock.acquire()
            shutil.rmtree(self.folder / STAGING, ignore_errors=True)  # a killed overwrite's leftovers
        if not resume and holds_run(self.folder):
            if not overwrite:
                self.close()
                raise RunFolderError(
                    f"{self.folder} already holds a training run; continue it with train.resume=true "
                    f"(loopformer train ... --resume), replace it with --overwrite (train.overwrite=true; "
                    f"the old files are moved aside once the new run's first checkpoint is written), "
                    f"or choose another out_dir"
                )
            self.staging = self.folder / STAGING

    @property
    def write_dir(self) -> Path:
        """Where the run writes now: the staging folder until an overwrite completes."""
        return self.staging if self.staging is not None else self.folder

    def complete_overwrite(self) -> Path | None:
        """After the new run's first checkpoint: move the old run aside, the new files into place.

        Returns the folder the old contents went to (None when no overwrite was pending).
        """
        if self.staging is None:
            return None
        staging, self.staging = self.staging, None
        aside = (
            self.folder / f".replaced-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(3)}"
        )
        if not self.is_main:
            return aside
        aside.mkdir()
        for entry in sorted(self.folder.iterdir()):
            if entry.name in (LOCK_NAME, STAGING) or entry.name.startswith(".replaced-"):
                continue
            os.replace(entry, aside / entry.name)
        for entry in sorted(staging.iterdir()):
            os.replace(entry, self.folder / entry.name)
        staging.rmdir()
        log.warning("--overwrite: the previous run in %s was moved to %s", self.folder, aside)
        return aside

    def close(self) -> None:
        """Release the lock; an overwrite that never reached its first checkpoint is discarded."""
        if self.is_main and self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
        self.lock.release()
