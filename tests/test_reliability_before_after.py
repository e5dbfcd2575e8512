"""tools/reliability_before_after.py names its cases by test node id: every one must still exist (a
renamed test would otherwise show up only as "missing" the next time the table is made), and the
table marks anything but fail-before / pass-now."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location(
        "before_after", REPO / "tools" / "reliability_before_after.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_case_names_a_collected_test() -> None:
    tool = _tool()
    ids = [node for _, _, node in tool.CASES]
    assert len(ids) == len(set(ids))
    assert {node.split("::")[0] for node in ids} <= set(tool.COPIED)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            *ids,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout
    collected = {line.strip() for line in out.splitlines() if "::" in line}
    assert set(ids) <= collected, sorted(set(ids) - collected)


def test_the_table_flags_what_is_not_fail_before_pass_now() -> None:
    tool = _tool()
    (_, _, first), (_, _, second) = tool.CASES[:2]
    then = {node: ("fail", "AssertionError: x") for _, _, node in tool.CASES}
    now = {node: ("pass", "") for _, _, node in tool.CASES}
    then[second] = ("pass", "")
    now[first] = ("error", "ImportError: /tmp/pytest-of-u/pytest-3/test_x0/a.py | b")
    table = tool.markdown(then, now, "abc1234", 1.0)
    assert table.startswith(f"{len(tool.CASES) - 2} of {len(tool.CASES)} cases fail before (commit abc1234)")
    assert "| error: ImportError: a.py \\| b |" in table and "| pass | pass |" in table
