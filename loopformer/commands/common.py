"""Shared pieces of the ``loopformer`` commands: one-line errors, argument parsing; checkpoint + task
loading (``load_run``) lives in ``loopformer.runs`` (re-exported here, imported on first use: this module
is what ``loopformer --help`` loads, and it must not import torch).

Every command raises ordinary exceptions (``ConfigError``, ``CheckpointError``, ``TaskDataError``,
``KeyError`` from the registries, ``FileNotFoundError``...); ``CleanErrorGroup`` turns any of them
into one line on stderr and exit status 1, unless ``--debug`` (or ``LOOPFORMER_DEBUG=1``) asks for
the traceback.
"""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from loopformer.runs import LoadedRun, eval_dataset, load_run, training_depth

_FROM_RUNS = ("LoadedRun", "eval_dataset", "load_run", "training_depth")

# exceptions whose message is already meant for the user
_USER_ERRORS = ("ConfigError", "CheckpointError", "TaskDataError", "FileNotFoundError", "KeyError",
                "ValueError", "TrainingDivergedError", "PermissionError", "NotADirectoryError",
                "IsADirectoryError", "NotImplementedError", "RunFolderError", "NumericalFaultError",
                "DataFormatError", "WriteError", "UnsafePathError", "TrainingInterrupted", "PluginError")
# OSErrors that say something about the user's files or machine, not about loopformer's code
_ENVIRONMENT_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                       errno.ENOTDIR, errno.EISDIR, errno.ENOENT, errno.EEXIST, errno.ENAMETOOLONG, errno.EIO,
                       errno.EMFILE, errno.ENOTEMPTY, errno.EXDEV, errno.EPIPE)


def one_line(err: BaseException) -> str:
    """The exception as one line: ``KeyError('x')`` -> ``x``; multi-line messages joined."""
    if isinstance(err, KeyError) and err.args:
        text = str(err.args[0])
    else:
        text = str(err) or type(err).__name__
    text = " ".join(part.strip() for part in text.splitlines() if part.strip())
    if isinstance(err, OSError) and err.errno in _ENVIRONMENT_ERRNOS and (
        type(err).__name__ not in _USER_ERRORS
        or (type(err).__module__ == "builtins" and err.filename and err.strerror)
    ):  # the OS's own error as "path: reason" (our own, e.g. WriteError, keep their message)
        where = f"{err.filename}: " if err.filename else ""
        return f"{where}{err.strerror or text}"
    if type(err).__name__ not in _USER_ERRORS:
        text = f"{type(err).__name__}: {text} (internal error; run with --debug for the traceback)"
    return text


def debug_enabled(ctx: click.Context | None) -> bool:
    if os.environ.get("LOOPFORMER_DEBUG", "") not in ("", "0"):
        return True
    while ctx is not None:
        if ctx.params.get("debug"):
            return True
        ctx = ctx.parent
    return False


class CleanErrorGroup(click.Group):
    """A click group that reports errors in one line (no traceback unless --debug)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            if debug_enabled(ctx):
                raise
            click.echo(interrupted_message(ctx.invoked_subcommand), err=True)
            ctx.exit(130)  # 128 + SIGINT, as for a process the signal killed
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except BrokenPipeError:
            raise  # the reader went away (loopformer recipes | head): click exits quietly
        except Exception as err:
            if debug_enabled(ctx):
                raise
            raise click.ClickException(one_line(err)) from None


def interrupted_message(command: str | None) -> str:
    """What a Ctrl-C that reached the command line stopped, instead of click's bare "Aborted!"."""
    name = f"loopformer {command}" if command else "loopformer"
    text = f"interrupted (Ctrl-C): {name} stopped before it finished"
    if command in ("train", "run"):
        return text + (
            "; a training stops cleanly on the first Ctrl-C (it writes a checkpoint and prints the command "
            "that resumes it); this was a second one or came outside the training loop: resume from the last "
            "checkpoint written with train.resume=true"
        )
    return text + "; files are written atomically, so nothing half-written was left behind"


def parse_pairs(pairs: tuple[str, ...] | list[str], what: str) -> dict[str, Any]:
    """``("a=1", "b=[2,3]")`` -> ``{"a": 1, "b": [2, 3]}`` (values parsed as YAML)."""
    import yaml

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise click.BadParameter(f"expected key=value, got {pair!r}", param_hint=what)
        try:
            out[key] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            out[key] = value
    return out


def parse_int_list(text: str | None, what: str) -> list[int]:
    if not text:
        return []
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=what) from None
    if not values:
        raise click.BadParameter(f"no step count in {text!r}", param_hint=what)
    if any(v < 1 for v in values):
        raise click.BadParameter(f"step counts must be >= 1, got {text!r}", param_hint=what)
    return values


def __getattr__(name: str) -> Any:
    """``LoadedRun`` / ``eval_dataset`` / ``load_run`` / ``training_depth`` from ``loopformer.runs``, imported
    on first use (it imports torch)."""
    if name in _FROM_RUNS:
        from loopformer import runs

        return getattr(runs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CleanErrorGroup", "LoadedRun", "eval_dataset", "load_run", "one_line", "parse_int_list",
           "parse_pairs", "training_depth"]
