"""The folders that commands other than ``train`` write whole: ``convert --out``, ``push --to-folder``,
``eval -o`` and ``data prepare -o`` follow the rules ``train`` follows for its run folder.

``staged_output(folder, purpose, overwrite)`` is a context manager that:

- refuses a ``folder`` inside a run's ``checkpoints/`` (``inside_run``), or a file;
- locks ``folder`` (``loopformer.train.run_folder.RunLock``) for the whole command, released on
  every exit path;
- refuses a ``folder`` that already holds something (a run, a dataset, a report) unless
  ``overwrite``; a folder holding a training run is never replaced by these commands
  (``protect_runs``), only by ``train --overwrite``;
- yields a hidden staging folder ``<folder>/.staging-<purpose>-<id>`` to build the new content in.
  When the block ends without error the old contents are moved aside to
  ``<folder>/.replaced-<UTC time>-<id>/`` and the new ones renamed into place (renames within one
  folder: no copy, nothing half-written); on an error or a kill the staging folder is dropped
  (now, or by the next command that locks the folder) and the old contents are untouched.

``inside_run(path)`` (``loopformer.train.run_folder``) is also what keeps ``train -o`` out of another run's folder.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loopformer.safe_io import fsync_dir
from loopformer.train.run_folder import LOCK_NAME, STAGING, RunFolderError, RunLock, inside_run, training_run

log = logging.getLogger("loopformer")

STAGING_PREFIX = ".staging-"
REPLACED_PREFIX = ".replaced-"


def refuse_inside_checkpoints(path: str | Path, option: str) -> None:
    """RunFolderError when ``path`` lies inside a run's ``checkpoints/`` folder."""
    found = inside_run(path)
    if found is not None and found[1]:
        raise RunFolderError(
            f"{option} {path} is inside the checkpoints of the run {found[0]}: nothing but that run's "
            f"training writes there; choose a folder outside {found[0] / 'checkpoints'}"
        )


def _contents(folder: Path) -> list[Path]:
    """What ``folder`` holds, leaving out the lock and earlier staging / replaced folders."""
    skip = (LOCK_NAME, STAGING)
    return sorted(
        p
        for p in folder.iterdir()
        if p.name not in skip and not p.name.startswith((STAGING_PREFIX, REPLACED_PREFIX))
    )


@contextmanager
def staged_output(
    folder: str | Path,
    purpose: str,
    overwrite: bool,
    option: str = "--out",
    protect_runs: bool = True,
) -> Iterator[Path]:
    """Lock ``folder``, refuse it when it holds something (unless ``overwrite``), yield a staging
    folder and swap its contents in whole when the block succeeds (see the module docstring)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise RunFolderError(f"{option} {folder} is a file, not a folder: name a folder to write into")
    refuse_inside_checkpoints(folder, option)
    with RunLock(folder, purpose):
        for stale in folder.glob(f"{STAGING_PREFIX}*"):  # a killed command's leftovers: we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        old = _contents(folder)
        if old and protect_runs and training_run(folder):
            raise RunFolderError(
                f"{option} {folder} holds a training run; `{purpose}` never replaces a run: choose another folder"
            )
        if old and not overwrite:
            names = ", ".join(p.name for p in old[:3]) + (" ..." if len(old) > 3 else "")
            raise RunFolderError(
                f"{option} {folder} is not empty ({names}); choose a new or empty folder, or pass --overwrite "
                f"(the old contents are moved aside to {folder}/{REPLACED_PREFIX}<time>/ once the new ones are complete)"
            )
        staging = folder / f"{STAGING_PREFIX}{purpose}-{secrets.token_hex(4)}"
        try:
            staging.mkdir()
        except OSError as err:
            raise RunFolderError(f"cannot write into the folder {folder}: {err.strerror}") from None
        try:
            yield staging
            fsync_dir(staging)
            aside = _swap_in(folder, staging, old)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    if aside is not None:
        log.warning("--overwrite: the previous contents of %s were moved to %s", folder, aside)


def _swap_in(folder: Path, staging: Path, old: list[Path]) -> Path | None:
    aside = None
    if old:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = folder / f"{REPLACED_PREFIX}{stamp}-{secrets.token_hex(3)}"
        aside.mkdir()
        for entry in old:
            os.replace(entry, aside / entry.name)
    for entry in sorted(staging.iterdir()):
        os.replace(entry, folder / entry.name)
    staging.rmdir()
    fsync_dir(folder)
    return aside


__all__ = ["inside_run", "refuse_inside_checkpoints", "staged_output", "training_run"]  # two re-exported
