"""Shared pieces of the ``loopformer`` commands: one-line errors, argument parsing, the options several
commands take (declared once here: ``out_option``, ``overwrite_option``, ``device_option``, ...), and the
comparison table on the console (this module is what ``loopformer --help`` loads: it must not import torch).

The console survives any locale / encoding: standard output and error replace what they cannot encode
(``PYTHONIOENCODING=ascii`` and a non-ASCII folder name print ``?``, never a ``UnicodeEncodeError``).

Every command raises ordinary exceptions (``ConfigError``, ``CheckpointError``, ``TaskDataError``,
``KeyError`` from the registries, ``FileNotFoundError``...); ``CleanErrorGroup`` turns any of them
into one line on stderr and exit status 1, unless ``--debug`` (or ``LOOPFORMER_DEBUG=1``) asks for
the traceback.
"""

from __future__ import annotations

import errno
import io
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import click

# exceptions whose message is already meant for the user
_USER_ERRORS = ("ConfigError", "CheckpointError", "TaskDataError", "FileNotFoundError", "KeyError",
                "ValueError", "TrainingDivergedError", "PermissionError", "NotADirectoryError",
                "IsADirectoryError", "NotImplementedError", "RunFolderError", "NumericalFaultError",
                "DataFormatError", "WriteError", "UnsafePathError", "TrainingInterrupted", "PluginError")
# OSErrors that say something about the user's files or machine, not about loopformer's code
_ENVIRONMENT_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                       errno.ENOTDIR, errno.EISDIR, errno.ENOENT, errno.EEXIST, errno.ENAMETOOLONG, errno.EIO,
                       errno.EMFILE, errno.ENOTEMPTY, errno.EXDEV, errno.EPIPE)


MAX_MESSAGE = 4000  # characters of an error line; a longer one is cut in the middle


def one_line(err: BaseException) -> str:
    """The exception as one line: ``KeyError('x')`` -> ``x``; multi-line messages joined; at most
    ``MAX_MESSAGE`` characters (a message quoting a huge value or key is cut, its length said)."""
    if isinstance(err, KeyError) and err.args:
        text = str(err.args[0])
    else:
        text = str(err) or type(err).__name__
    if len(text) > MAX_MESSAGE:
        text = f"{text[: MAX_MESSAGE // 2]} [... {len(text) - MAX_MESSAGE:,} characters cut ...] {text[-MAX_MESSAGE // 2 :]}"
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


class WholeHelpGroup(click.Group):
    """A click group whose ``--help`` lists each subcommand's whole first sentence, wrapped to the
    terminal instead of cut with '...' (click's default)."""

    def command_summary(self, ctx: click.Context, name: str) -> str | None:
        """The first sentence of subcommand ``name``'s help; None for a hidden or unknown one."""
        cmd = self.get_command(ctx, name)
        if cmd is None or cmd.hidden:
            return None
        return cmd.get_short_help_str(limit=10_000)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, text) for name in self.list_commands(ctx)
                if (text := self.command_summary(ctx, name)) is not None]  # fmt: skip
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


class CleanErrorGroup(WholeHelpGroup):
    """A click group that reports errors in one line (no traceback unless --debug)."""

    def invoke(self, ctx: click.Context) -> Any:
        for stream in (sys.stdout, sys.stderr):  # any locale / encoding: "?" for what it cannot show, no traceback
            if isinstance(stream, io.TextIOWrapper):
                stream.reconfigure(errors="replace")
        previous = _catch_sigterm()
        try:
            return super().invoke(ctx)
        except Terminated:
            if debug_enabled(ctx):
                raise
            click.echo(interrupted_message(ctx.invoked_subcommand, "SIGTERM"), err=True)
            ctx.exit(143)  # 128 + SIGTERM, as for a process the signal killed
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
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)


class Terminated(KeyboardInterrupt):
    """A SIGTERM outside a training loop (which checkpoints on it): unwinds like Ctrl-C, so every lock
    is released and no temporary file is left, instead of the default, silent death."""


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated


def _catch_sigterm() -> Any:
    """Turn SIGTERM into ``Terminated`` while a command runs (main thread, default handler only);
    returns the handler to put back, or None when nothing was changed."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, _terminate)


def resume_hint(err: Any, command: list[str]) -> None:
    """Print a stopped training's message and the command that continues it; exit 128 + the signal."""
    import shlex

    click.echo(f"{err}; resume with: {shlex.join(command)}", err=True)
    click.get_current_context().exit(err.exit_code)


def interrupted_message(command: str | None, how: str = "Ctrl-C") -> str:
    """What a Ctrl-C (or SIGTERM) that reached the command line stopped, instead of click's "Aborted!"."""
    name = f"loopformer {command}" if command else "loopformer"
    text = f"interrupted ({how}): {name} stopped before it finished"
    if command in ("train", "run", "sweep"):
        return text + (
            f"; a training stops cleanly on the first {how} (it writes a checkpoint and prints the command "
            "that resumes it); this was a second one or came outside the training loop: resume from the last "
            "checkpoint written with train.resume=true" + ("" if command == "train" else " (--resume)")
        )
    return text + "; files are written atomically, so nothing half-written was left behind"


class PathParam(click.ParamType):
    """A path a user typed (``-o``, ``--out``, ``--config`` ...): a ``Path`` as given, never parsed as a
    config value (``-o "exp #2"``, ``-o 0001``, ``-o 2024-01-01``, a name holding a newline stay what they
    are); empty text, which names no folder, is refused."""

    name = "path"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        if isinstance(value, Path):
            return value
        text = os.fsdecode(value) if isinstance(value, bytes) else str(value)
        if not text.strip():
            self.fail("an empty path names no file or folder", param, ctx)
        return Path(text)


PATH = PathParam()


def parse_pairs(pairs: tuple[str, ...] | list[str], what: str) -> dict[str, Any]:
    """``("a=1", "box=[2,3]", "min-blanks=4")`` -> ``{"a": 1, "box": [2, 3], "min_blanks": 4}``: keyword
    arguments (``-`` read as ``_``), values read by the configuration's one parser of typed values
    (``loopformer.config.strict.parse_value``: alias and node limits)."""
    from loopformer.config.strict import excerpt, parse_value

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key.isidentifier():
            raise click.BadParameter(f"expected key=value, got {excerpt(pair)}", param_hint=what)
        out[key] = parse_value(value, f"{what} {key}")
    return out


def parse_variants(variants: tuple[str, ...] | list[str]) -> list[tuple[str, list[str]]]:
    """``("loop_eval.solver=anderson loop_eval.tol=0.01", ...)`` -> [(name, overrides)]: each variant's
    overrides (loop_eval.* / eval.* keys only) and a name made of them, without the ``loop_eval.`` prefix."""
    import shlex

    parsed = []
    for text in variants:
        parts = shlex.split(text)
        if not parts:
            raise click.BadParameter("a variant needs at least one KEY=VALUE", param_hint="--variant")
        for part in parts:
            deletes = part.startswith("~") and "=" not in part  # ~loop_eval.tol: the model's default again
            if not (deletes or "=" in part) or not part.lstrip("~").startswith(("loop_eval.", "eval.")):
                raise click.BadParameter(
                    f"{part!r}: a variant changes loop_eval.* or eval.* keys (KEY=VALUE)", param_hint="--variant"
                )
        name = ",".join(p[: p.startswith("~")] + p.lstrip("~").removeprefix("loop_eval.") for p in parts)
        parsed.append((name, parts))
    return parsed


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


def check_job_folder(out: Path, job: str, earlier: bool, own: tuple[str, ...] = ()) -> None:
    """Refuse, before anything is created, the ``--out`` of a job that writes a folder of its own (``job``:
    "`loopformer run`", "sweep"): a file, a folder that is or lies in a training run's folder, one holding
    a training run in a sub-folder not in ``own`` (``()``: not checked, a sweep's points are runs), or one that
    is not empty and holds no ``earlier`` run of the job."""
    from loopformer.runs.folder import LOCK_NAME, RunFolderError, nested_run, run_at_or_above, training_run

    if out.exists() and not out.is_dir():
        raise RunFolderError(f"--out {out} is a file, not a folder: name a folder to write into")
    found = run_at_or_above(out)
    if found is not None:
        raise RunFolderError(f"--out {out} is or lies in the training run {found}; a {job} writes a folder of its "
                             f"own: choose another --out")  # fmt: skip
    if not out.is_dir():
        return
    for child in sorted(out.iterdir()) if own else []:  # the job's own runs are fine; any other is not
        if child.is_dir() and not child.is_symlink() and child.name not in own:
            nested = child if training_run(child) else nested_run(child)
            if nested is not None:
                raise RunFolderError(f"--out {out} holds the training run {nested}; choose a new or empty --out")
    others = sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME)
    if others and not earlier:
        raise RunFolderError(f"--out {out} is not empty ({', '.join(others[:3])}) and holds no earlier {job}; "
                             f"choose a new or empty --out")  # fmt: skip


# ----------------------------------------------------------------------------- options of several commands


def out_option(help: str, required: bool = False, short: bool = True) -> Any:
    """``--out`` (and ``-o``): the folder or file a command writes, a ``PATH`` passed as ``out_dir``."""
    return click.option(*(("--out", "-o") if short else ("--out",)), "out_dir", type=PATH, default=None,
                        required=required, help=help)  # fmt: skip


def overwrite_option(help: str) -> Any:
    return click.option("--overwrite", is_flag=True, help=help)


def device_option(help: str = "where to evaluate") -> Any:
    """``--device auto|cpu|cuda|cuda:N`` (``loopformer.devices.resolve_device`` reads it)."""
    from loopformer.devices import DEVICE_HELP

    return click.option("--device", default="auto", show_default=True, help=f"{help}: {DEVICE_HELP}")


def ema_option(help: str = "use the EMA weights when the checkpoint has them") -> Any:
    return click.option("--ema/--no-ema", default=True, show_default=True, help=help)


def best_option(help: str = "the run's best checkpoint (checkpoints/best, kept by train.keep_best) instead of "
                "its latest") -> Any:  # fmt: skip
    return click.option("--best", is_flag=True, help=help)


def budgets_option(help: str) -> Any:
    """``--max-steps B1,B2,...``: loop budgets, passed as ``budgets`` (a list of ints >= 1)."""
    return click.option("--max-steps", "budgets", default=None, metavar="B1,B2,...", help=help,
                        callback=lambda ctx, param, text: parse_int_list(text, "--max-steps"))  # fmt: skip


def task_option(help: str) -> Any:
    """``--task-option`` / ``-t KEY=VALUE`` (repeatable), passed as ``task_options``: a task's keywords."""
    return click.option("--task-option", "--task-options", "--option", "-t", "task_options", multiple=True,
                        metavar="KEY=VALUE", help=help)  # fmt: skip


def verify_option() -> Any:
    """``--verify``: refuse a checkpoint that has no manifest (loaded with a warning otherwise)."""
    return click.option("--verify", is_flag=True, help="refuse a checkpoint without its manifest.json (the size "
                        "and SHA-256 of each file), which otherwise loads with a warning that it is unverified")


def json_option(help: str) -> Any:
    return click.option("--json", "as_json", is_flag=True, help=help)


def print_config_option(help: str = "print the resolved configuration, every model and loop field (YAML), "
                        "and exit") -> Any:  # fmt: skip
    return click.option("--print-config", is_flag=True, help=help)


def plain_console(stderr: bool = False, quiet: bool = False) -> Any:
    """The console every command prints through: whole lines (``soft_wrap``: a long path or result line is never
    broken at 80 columns in a log file), no highlighting, characters the output's encoding lacks replaced by rich."""
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True, stderr=stderr, quiet=quiet)


def print_comparison(folder: Path) -> None:
    """The comparison in ``folder`` (its ``comparison.json``) as a table on the console, at 160 columns so a
    row stays one line; its notes (the sweep points without a report) on stderr."""
    from rich.console import Console

    from loopformer.eval.compare import comparison_table
    from loopformer.files import read_json

    data = read_json(folder / "comparison.json", ValueError)
    Console(highlight=False, width=160).print(comparison_table(data["rows"], data["title"]))
    for note in data.get("notes") or []:
        click.echo(note, err=True)


__all__ = ["PATH", "CleanErrorGroup", "PathParam", "WholeHelpGroup", "best_option", "budgets_option", "check_job_folder",
           "device_option", "ema_option", "json_option", "one_line", "out_option", "overwrite_option",
           "parse_int_list", "parse_pairs", "parse_variants", "print_comparison", "print_config_option",
           "task_option", "verify_option"]
