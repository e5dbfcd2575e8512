"""User code loaded before a command runs: plug-in modules, entry points and ``module:Class`` names.

Three ways bring a plug-in (a task, model family, solver, halting rule, gradient mode or training mode
defined outside the package, docs/extending.md) into a ``loopformer`` command:

- ``loopformer --import MODULE`` (repeatable) and the ``LOOPFORMER_IMPORT`` environment variable
  (comma-separated module names) import the modules before the command runs;
- an installed distribution that declares entry points in the group ``loopformer.plugins``
  (``[project.entry-points."loopformer.plugins"] mine = "mypkg.plugins"``): each is loaded once,
  the first time a command runs or a registry lookup misses (``load_entry_points``);
- ``module:Class`` wherever a registered name is accepted (``model.name``, ``data.task``,
  ``loop_*.solver`` / ``halting`` / ``grad``, ``train.mode``): the module is imported and the class
  used directly (``resolve_class``).

Code runs only when the user asks. A checkpoint records the modules that define its model, task and loop
plug-ins when they are not loopformer's own (the ``plugins`` entry of its ``config.json``), but a run folder,
checkpoint or downloaded model is data: nothing it names is ever imported. While loopformer reads such a
file (``reading_data``), a module it names must already be imported, by the user: ``--import``,
``LOOPFORMER_IMPORT``, an installed ``loopformer.plugins`` entry point, or the user's own ``import`` before
``loopformer.load``; otherwise ``PluginError`` names the module, the file and the option that allows it
(``check_recorded``). No module of this package adds the current folder or a run folder to the import path.
A plug-in that exits or raises any ``BaseException`` (but ``KeyboardInterrupt``) while importing is a
``PluginError``, never a silent exit. This module imports nothing heavy (no torch): the command line loads it
first.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

log = logging.getLogger("loopformer.plugins")

ENTRY_POINT_GROUP = "loopformer.plugins"
ENV_VAR = "LOOPFORMER_IMPORT"

_entry_points_loaded = False
# the data file being read (a checkpoint's config.json, a downloaded model): None while reading user input
_reading: contextvars.ContextVar[str | None] = contextvars.ContextVar("loopformer_reading_data", default=None)


class PluginError(ImportError):
    """A plug-in module or ``module:Class`` name that cannot be imported or is not the right kind of class;
    the message names the module, who asked for it and what to do."""


def env_modules(value: str | None = None) -> list[str]:
    """The module names in ``LOOPFORMER_IMPORT`` (or ``value``): comma-separated, blanks ignored."""
    text = os.environ.get(ENV_VAR, "") if value is None else value
    return [part.strip() for part in text.split(",") if part.strip()]


def import_modules(names: Iterable[str], needed_by: str) -> list[Any]:
    """Import each module of ``names`` (in order) that the user asked for (``--import``, ``LOOPFORMER_IMPORT``,
    a recipe's ``module:Class``); ``needed_by`` says who asked, for the error message. A module that cannot be
    imported raises ``PluginError`` naming it and the cause."""
    return [_import(name, needed_by) for name in names]


@contextlib.contextmanager
def reading_data(where: str) -> Iterator[None]:
    """Within this block loopformer reads a file it did not get from the user (``where``: e.g. "checkpoint
    runs/x/checkpoints/step_00000100/config.json"): a module it names is never imported (``_import`` refuses
    one that is not imported yet)."""
    token = _reading.set(where)
    try:
        yield
    finally:
        _reading.reset(token)


def _refusal(name: str, where: str) -> PluginError:
    return PluginError(
        f"{where} names plug-in module {name!r}, which is not imported; loopformer never imports code that a "
        f"run folder, checkpoint or downloaded model names. If you trust it, import it yourself: "
        f"`loopformer --import {name} ...` (or {ENV_VAR}={name}, an installed {ENTRY_POINT_GROUP!r} entry point, "
        f"or `import {name}` before loopformer.load), with its folder on PYTHONPATH"
    )


def check_recorded(names: Iterable[str], where: str) -> None:
    """Every module of ``names`` (a checkpoint's recorded plug-ins) is already imported, by the user; the
    installed entry points are loaded first. ``PluginError`` naming the first one that is not."""
    load_entry_points()
    for name in names:
        if not isinstance(name, str) or not name or not all(p.isidentifier() for p in name.split(".")):
            raise PluginError(f"{where}: {name!r} is not a Python module name")
        if name not in sys.modules:
            raise _refusal(name, where)


def _import(name: str, needed_by: str) -> Any:
    if not name or not all(part.isidentifier() for part in name.split(".")):
        raise PluginError(f"{needed_by}: {name!r} is not a Python module name (expected e.g. mypkg.plugins)")
    if name in sys.modules:
        return sys.modules[name]
    where = _reading.get()
    if where is not None:  # a data file names it: never imported on its word
        load_entry_points()
        if name not in sys.modules:
            raise _refusal(name, where)
        return sys.modules[name]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        missing = err.name or name
        where_ = "" if missing == name else f" (it imports {missing!r}, which is not installed)"
        raise PluginError(
            f"{needed_by}: cannot import plug-in module {name!r}{where_}; put its folder on PYTHONPATH "
            f"(e.g. PYTHONPATH=. for a module in the current folder) or install it"
        ) from err
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # the user's module raised (or called sys.exit) while importing
        what = f"exited (SystemExit {err.code!r})" if isinstance(err, SystemExit) else f"failed: {type(err).__name__}: {err}"
        raise PluginError(f"{needed_by}: importing plug-in module {name!r} {what}") from err


def load_entry_points() -> list[str]:
    """Load every ``loopformer.plugins`` entry point of the installed distributions, once per process.

    Returns the names loaded by this call ([] on later calls). A broken entry point is reported as a
    warning and skipped: one bad installed package must not stop every command."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return []
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    loaded = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except KeyboardInterrupt:
            raise
        except BaseException as err:  # a plug-in's own import error (or exit): warn, name it, go on
            dist = getattr(getattr(ep, "dist", None), "name", "?")
            log.warning(
                "plug-in entry point %r (%s, from %s) could not be loaded: %s: %s",
                ep.name,
                ep.value,
                dist,
                type(err).__name__,
                err,
            )
            continue
        loaded.append(ep.name)
    return loaded


def is_class_path(name: object) -> bool:
    """Whether ``name`` is a ``module:Class`` reference rather than a registered name."""
    return isinstance(name, str) and ":" in name


def resolve_class(spec: str, base: type, what: str) -> type:
    """The class a ``module:Class`` (``module:Outer.Inner``) names, checked to subclass ``base``.

    ``what`` names the setting for error messages (e.g. "model.name")."""
    module_name, _, qualname = spec.partition(":")
    if not module_name or not qualname:
        raise PluginError(f"{what}: {spec!r} is not module:Class")
    module = _import(module_name, f"{what}={spec}")
    obj: Any = module
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{what}: module {module_name!r} has no attribute {qualname!r}")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise PluginError(f"{what}: {spec} is {obj!r}, not a subclass of {base.__name__}")
    return obj


def own_module(module: str) -> bool:
    """Whether ``module`` is part of loopformer itself (nothing to record or re-import)."""
    return module == "loopformer" or module.startswith("loopformer.")


def external_modules(classes: Iterable[type | None]) -> list[str]:
    """The defining modules of ``classes`` that are not loopformer's, in first-seen order, ``__main__`` left
    out (a script's classes cannot be imported again by name)."""
    out: list[str] = []
    for cls in classes:
        module = getattr(cls, "__module__", None)
        if not module or own_module(module) or module == "__main__" or module in out:
            continue
        out.append(module)
    return out


__all__ = [
    "ENTRY_POINT_GROUP",
    "ENV_VAR",
    "PluginError",
    "check_recorded",
    "env_modules",
    "external_modules",
    "import_modules",
    "is_class_path",
    "load_entry_points",
    "own_module",
    "reading_data",
    "resolve_class",
]
