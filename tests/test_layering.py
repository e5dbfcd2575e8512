"""Layering of the package, read from the source with ``ast`` (every import, also inside functions).

The package is a house of floors (``FLOORS``, drawn in docs/architecture.md): ``loop``, ``nn``, ``tasks``
< ``models`` < ``config`` < run storage (``runs``) and ``eval`` < ``convert`` < ``train`` < ``api`` <
``commands`` < ``cli``, with ``files``, ``numerics``, ``devices`` and ``plugins`` below them all. No
top-level unit imports a unit on its own floor or above, so there is no import cycle between units. Also
held here: module and function lengths, and that the trainer never branches on a mode's name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "loopformer"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every loopformer module ``path`` imports (module-level and inside functions), with the
    packages whose ``__init__`` an import runs."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names
            ]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
        ):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                targets = [node.args[0].value]
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__
                prefix = ".".join(parts[:i])
                # the root package's __init__ is the public facade (it may re-export from any layer)
                if prefix in known and prefix not in (name, "loopformer"):
                    found.add(prefix)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(path, name, known) for name, path in modules.items()}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


# The floors of the house, bottom up (docs/architecture.md draws them). A top-level unit of the package (a
# sub-package or a loose module) imports only units on floors below its own: never one above, never another
# unit on its own floor.
FLOORS: list[tuple[str, ...]] = [
    ("files", "numerics", "devices", "plugins"),  # used everywhere; import nothing of loopformer
    ("loop", "nn", "tasks"),
    ("models",),
    ("config",),
    ("runs", "eval"),  # run storage; evaluation
    ("convert",),  # the authors' checkpoints -> run folders
    ("train",),
    ("api",),  # loopformer.load / solve
    ("commands",),
    ("cli",),
    ("__main__",),  # python -m loopformer
]
FLOOR = {unit: level for level, units in enumerate(FLOORS) for unit in units}


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "loopformer" and len(parts) > 1 else None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import (module -> module) that goes to a unit on the importer's floor or above; a unit missing
    from ``FLOORS`` is a violation too (a new unit must be given a floor)."""
    bad = []
    for module, targets in graph.items():
        unit = _unit(module)
        if unit is None:  # the package's __init__: the public facade (lazy imports of api)
            continue
        if unit not in FLOOR:
            bad.append(f"{module}: unit {unit!r} has no floor in FLOORS")
            continue
        for target in sorted(targets):
            other = _unit(target)
            if other is None or other == unit:
                continue
            if other not in FLOOR or FLOOR[other] >= FLOOR[unit]:
                bad.append(f"{module} -> {target} ({unit!r} floor {FLOOR[unit]}, {other!r} floor {FLOOR.get(other)})")
    return bad


def test_the_scanner_sees_function_level_imports(graph) -> None:
    # loopformer.eval.evaluate imports loopformer.tasks.text inside evaluate_lm, and the
    # trainer imports the evaluation at module level: both edges must be found
    assert "loopformer.tasks.text" in graph["loopformer.eval.evaluate"]
    assert "loopformer.eval.evaluate" in graph["loopformer.train.trainer"]
    assert "loopformer.config.memory" in graph["loopformer.config.schema"]  # inside validate()


def test_every_unit_imports_only_floors_below_its_own(graph) -> None:
    units = {_unit(m) for m in graph} - {None}
    assert units == set(FLOOR)  # every unit has a floor, and every floor names a real unit
    assert layer_violations(graph) == []


@pytest.mark.parametrize(
    ("importer", "target"),
    [
        ("loopformer.config.schema", "loopformer.train.setup"),  # up: config -> train
        ("loopformer.runs.load", "loopformer.eval.evaluate"),  # across one floor: storage -> evaluation
        ("loopformer.tasks.sudoku", "loopformer.models.fprm"),  # up: tasks -> models
    ],
)
def test_the_layer_check_fails_on_an_upward_import(graph, importer: str, target: str) -> None:
    changed = {m: set(t) for m, t in graph.items()}
    changed[importer].add(target)
    assert layer_violations(changed) == [
        v for v in layer_violations(changed) if v.startswith(f"{importer} -> {target} ")
    ] != []


def test_a_unit_without_a_floor_is_reported(graph) -> None:
    changed = {**graph, "loopformer.helpers": {"loopformer.files"}}
    assert layer_violations(changed) == ["loopformer.helpers: unit 'helpers' has no floor in FLOORS"]


def test_the_trainer_never_tests_a_mode_or_strategy_name() -> None:
    source = (PACKAGE / "train" / "trainer.py").read_text()
    for name in ('"simple"', '"deep_supervision"', '"ddp"', '"fsdp"', "is_fsdp", "self.fsdp", "hasattr("):
        assert name not in source, name


MAX_MODULE_LINES = 500  # issue 14: no module in the package longer than this
MAX_FUNCTION_LINES = 60  # issue 14: no function in loop/ or train/ longer than this (def line to last line)


def _long_functions(path: Path, limit: int, root: Path = PACKAGE.parent) -> list[str]:
    return [
        f"{path.relative_to(root)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_every_module_in_the_package_is_at_most_500_lines() -> None:
    paths = sorted(PACKAGE.rglob("*.py"))
    assert len(paths) > 50  # the scan sees the whole package, sub-packages included
    long_modules = [
        f"{p.relative_to(PACKAGE.parent)} ({n} lines)"
        for p in paths
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert long_modules == []


@pytest.mark.parametrize("folder", ["loop", "train"])
def test_loop_and_train_functions_are_at_most_60_lines(folder: str) -> None:
    paths = sorted((PACKAGE / folder).rglob("*.py"))
    assert paths
    long_functions = [row for p in paths for row in _long_functions(p, MAX_FUNCTION_LINES)]
    assert long_functions == []


def test_the_function_length_check_can_fail(tmp_path: Path) -> None:
    # a function counts from its def line to its last line; methods and nested functions count too
    body = "\n".join(f"        x{i} = {i}" for i in range(59))
    source = tmp_path / "probe.py"
    source.write_text(
        f"class A:\n    def long(self):\n{body}\n\n\ndef short():\n    def inner():\n        pass\n"
    )
    assert _long_functions(source, 59, tmp_path) == ["probe.py:2 long (60 lines)"]
    assert _long_functions(source, MAX_FUNCTION_LINES, tmp_path) == []
