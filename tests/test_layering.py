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


def _type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): imports only a type checker runs."""
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` that runs (``ast.walk`` without the bodies of ``if TYPE_CHECKING:``)."""
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if _type_checking(node):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """Every loopformer module ``path`` imports at run time (module-level and inside functions; not under
    ``if TYPE_CHECKING:``), with the packages whose ``__init__`` an import runs."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
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


def test_every_import_of_the_package_names_a_module_that_exists() -> None:
    """A function-level import of a module that a move removed fails only when that function runs (issue 49:
    ``loopformer run``'s report imported ``loopformer.runs.fingerprint`` after it moved into runs/folder.py)."""
    modules = _modules()
    missing = []
    for name, path in modules.items():
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("loopformer"):
                if node.module not in modules:
                    missing.append(f"{name}:{node.lineno} imports {node.module}")
    assert missing == []


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


MAX_FUNCTION_LINES = 60  # issue 14: no function in loop/ or train/ longer than this (def line to last line)


def _long_functions(path: Path, limit: int, root: Path = PACKAGE.parent) -> list[str]:
    return [
        f"{path.relative_to(root)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > limit
    ]


def _package(module: str) -> str:
    """The package a module belongs to (``loopformer.loop.engine`` -> ``loopformer.loop``)."""
    return module.rsplit(".", 1)[0]


def cycles_inside_packages(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle among the modules of one package (issue 45: one concern per module, and no two
    modules of a package importing each other, at module level or inside a function), each as the list of
    its modules; found by Tarjan's strongly connected components over the edges inside a package."""
    edges = {m: {t for t in ts if t in graph and _package(t) == _package(m) and t != m} for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_inside_a_package(graph) -> None:
    assert cycles_inside_packages(graph) == []


def test_the_cycle_check_fails_on_a_cycle_inside_a_package(graph) -> None:
    # loop/engine.py imports loop/state.py; the state importing the engine back (even inside a function) closes
    # a cycle inside loop/
    assert "loopformer.loop.state" in graph["loopformer.loop.engine"]
    changed = {m: set(t) for m, t in graph.items()}
    changed["loopformer.loop.state"].add("loopformer.loop.engine")
    assert ["loopformer.loop.engine", "loopformer.loop.state"] in cycles_inside_packages(changed)


def test_type_checking_imports_are_not_runtime_edges(tmp_path: Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from loopformer.loop import engine\n"
        "def f():\n    from loopformer.loop import solvers\n"
    )
    known = {"loopformer.loop", "loopformer.loop.engine", "loopformer.loop.solvers"}
    assert _imports(source, "loopformer.probe", known) == {"loopformer.loop", "loopformer.loop.solvers"}


MAX_TRAINER_PATH_MODULES = 45  # issue 45: what `import loopformer.train.trainer, loopformer.models.fprm` loads


def test_the_trainer_and_fprm_load_at_most_45_of_the_package_modules() -> None:
    import subprocess
    import sys

    code = (
        "import sys, loopformer.train.trainer, loopformer.models.fprm; "
        "print(len([m for m in sys.modules if m.startswith('loopformer')]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert int(out.stdout.strip()) <= MAX_TRAINER_PATH_MODULES


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
