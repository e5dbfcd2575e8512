"""Layering of the package, read from the source with ``ast`` (every import, also inside functions).

- evaluation (``loopformer.eval``) imports neither the trainer (``loopformer.train``) nor run
  loading (``loopformer.runs``) nor the commands, at any depth: so there is no import cycle between
  ``train/`` and ``eval/``, including function-level imports;
- the loop engine imports no model, task, trainer or evaluation; models import no task;
- the task modules import no command (``loopformer data`` lives in ``loopformer.commands``).
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


def test_the_scanner_sees_function_level_imports(graph) -> None:
    # loopformer.eval.lm imports loopformer.tasks.text inside evaluate_lm, and the
    # trainer's evaluation mixin imports the evaluation at module level: both edges must be found
    assert "loopformer.tasks.text" in graph["loopformer.eval.lm"]
    assert "loopformer.eval.evaluate" in graph["loopformer.train.evaluation"]
    assert "loopformer.train.checkpoint" in graph["loopformer.runs"]


def test_evaluation_never_imports_training_run_loading_or_commands(graph) -> None:
    bad = {
        module: sorted(
            m
            for m in _reachable(graph, module)
            if _in(m, "loopformer.train", "loopformer.runs", "loopformer.commands", "loopformer.cli")
        )
        for module in graph
        if _in(module, "loopformer.eval")
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_no_import_cycle_between_train_and_eval(graph) -> None:
    for module in graph:
        if _in(module, "loopformer.train"):
            back = [m for m in _reachable(graph, module) if _in(m, "loopformer.eval")]
            for m in back:
                assert not any(_in(x, "loopformer.train") for x in _reachable(graph, m)), (module, m)


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("loopformer.loop", ("loopformer.models", "loopformer.tasks", "loopformer.train", "loopformer.eval")),
        (
            "loopformer.models",
            ("loopformer.tasks", "loopformer.train", "loopformer.eval", "loopformer.commands"),
        ),
        (
            "loopformer.tasks",
            ("loopformer.commands", "loopformer.train", "loopformer.eval", "loopformer.models"),
        ),
    ],
)
def test_lower_layers_do_not_import_upper_ones(graph, package: str, forbidden: tuple[str, ...]) -> None:
    bad = {m: sorted(x for x in _reachable(graph, m) if _in(x, *forbidden)) for m in graph if _in(m, package)}
    assert {k: v for k, v in bad.items() if v} == {}


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
