"""Provenance: what produced a run, recorded in its folder as ``provenance.json``.

Each training start (a fresh run or a resume) appends one record to the ``records`` list of
``<run>/provenance.json`` (rewritten atomically through ``loopformer.files``, earlier records kept):
the loopformer / torch / Python versions, the platform, the git commit of the loopformer source and
whether its work tree had uncommitted changes (only when loopformer runs from a clone), the CPU
thread count, the device, the world size under torchrun, the command line, the working folder, the
start time (UTC) and the step the record starts at (0, or the resumed step).

``loopformer eval`` quotes the record that trained the evaluated checkpoint (``describe``) in its
report and stores the evaluation's own record in ``metrics.json``.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from loopformer.files import atomic_write_json, read_record

FILE = "provenance.json"
_SOURCE = Path(__file__).resolve().parent.parent  # the clone's root when loopformer runs from one


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git_state(root: Path = _SOURCE) -> dict[str, Any] | None:
    """``{"commit", "dirty"}`` of the clone holding the loopformer source; None when not run from one."""
    if not (root / ".git").exists():
        return None

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        if done.returncode:
            raise subprocess.SubprocessError(done.stderr.strip())
        return done.stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            return None  # an installed copy inside some other repository
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def collect(device: Any = None, step: int = 0, resumed: bool = False) -> dict[str, Any]:
    """A provenance record of this process, now."""
    import torch

    device_name = str(device) if device is not None else None
    if device is not None and getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available():
        device_name = f"{device} ({torch.cuda.get_device_name(device)})"
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
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
    provenance record (``loopformer.runs.records.PROVENANCE``) is a ValueError naming it and the field:
    appending to it would silently drop the run's history."""
    from loopformer.runs.records import PROVENANCE

    path = Path(folder) / FILE
    if not path.is_file():
        return []
    return list(read_record(path, PROVENANCE)["records"])


def append_record(folder: str | Path, record: dict[str, Any]) -> Path:
    """Add ``record`` to ``folder/provenance.json``, keeping the earlier ones (an atomic rewrite)."""
    folder = Path(folder)
    records = [*read_records(folder), record]
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


__all__ = ["FILE", "append_record", "collect", "describe", "git_state", "read_records", "record_for_step"]
