"""The folders that commands other than ``train`` write whole: ``convert --out``, ``push --to-folder``,
``eval -o`` and ``data prepare -o`` follow the rules ``train`` follows for its run folder.

``staged_output(folder, purpose, overwrite)`` is a context manager that:

- refuses a ``folder`` inside a run's ``checkpoints/`` (``inside_run``), a file, a ``folder`` that is a
  symbolic link (its target would be emptied and refilled), and with ``root`` (the folder that owns it: a
  sweep's ``compare/``) a ``folder`` with a symbolic link anywhere below ``root``;
- refuses a folder holding a dataset (``holds_dataset``) unless the command is ``data prepare`` /
  ``data generate``;
- locks ``folder`` (``loopformer.runs.folder.RunLock``) for the whole command, released on
  every exit path;
- refuses a ``folder`` that already holds something (a run, a dataset, a report) unless
  ``overwrite``; a folder holding a training run is never replaced by these commands
  (``protect_runs``), only by ``train --overwrite``;
- yields a hidden staging folder ``.<name>.staging-<purpose>-<id>`` beside ``folder`` (in the same
  parent, so on the same file system) to build the new content in. When the block ends without error
  the two folders are swapped in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``, through
  ``ctypes``): at every instant ``folder`` holds the old content or the new, whole. Then the old
  content (now in the staging folder's place) is removed: nothing accumulates. Where the OS or the
  file system has no exchange (not Linux, an old C library, a file system refusing it), two renames
  are used: ``folder`` to ``.<name>.replaced-<purpose>-<id>``, then the staging folder to ``folder``;
  between the two ``folder`` does not exist, and a crash there leaves the old content in the
  ``.replaced-`` folder and the new in the ``.staging-`` one beside it (a failed second rename puts
  the old content back). On an error or a kill before the swap the staging folder is dropped (now,
  or by the next command that locks the folder) and the old contents are untouched. An error names the
  path the user gave, never the hidden staging folder, and the folders this command created for the
  output are removed again.

``inside_run(path)`` (``loopformer.runs.folder``) is also what keeps ``train -o`` out of another run's folder.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loopformer.files import UnsafePathError, WriteError, check_inside, fsync_dir, missing_parts, remove_empty
from loopformer.runs.folder import (
    LOCK_NAME,
    STAGING,
    RunFolderError,
    RunLock,
    inside_run,
    nested_run,
    training_run,
)

log = logging.getLogger("loopformer")

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
    root: str | Path | None = None,
) -> Iterator[Path]:
    """Lock ``folder``, refuse it when it holds something (unless ``overwrite``), yield a staging
    folder and swap its contents in whole when the block succeeds (see the module docstring).
    ``root``: the folder that owns ``folder`` (a sweep's folder for its ``compare/``): no part of
    ``folder`` below it may be a symbolic link, and ``folder`` must lie inside it."""
    folder = Path(folder)
    if root is not None:
        check_inside(folder, root)
    if folder.is_symlink():  # replaced whole: never through a link (its target would be emptied and refilled)
        raise UnsafePathError(
            f"{option} {folder} is a symbolic link (to {os.readlink(folder)}); `{purpose}` replaces its output "
            f"folder whole and never through a link: name the folder itself ({os.path.realpath(folder)})"
        )
    if folder.exists() and not folder.is_dir():
        raise RunFolderError(f"{option} {folder} is a file, not a folder: name a folder to write into")
    refuse_inside_checkpoints(folder, option)
    enclosing = inside_run(folder)
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
            target = Path(os.path.realpath(folder))  # a folder may be a link (a scratch disk): build beside its target
            for stale in [*folder.glob(f"{STAGING_PREFIX}*"), *folder.glob(f"{REPLACED_PREFIX}*"),
                          *target.parent.glob(f".{target.name}{STAGING_PREFIX}*"),
                          *target.parent.glob(f".{target.name}{REPLACED_PREFIX}*")]:  # fmt: skip
                shutil.rmtree(stale, ignore_errors=True)  # a killed command's leftovers: we hold the lock
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


def exchange_folders(a: Path, b: Path) -> bool:
    """Swap the folders ``a`` and ``b`` in one atomic step where the OS can; False (nothing changed) where not."""
    return _exchange(a, b)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the folders ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``);
    False where the OS or file system cannot (then nothing was changed)."""
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
    if _exchange(staging, target):
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


__all__ = ["holds_dataset", "exchange_folders", "refuse_inside_checkpoints", "renamed_error", "staged_output", "swap_in"]
