"""tools/reliability_before_after.py names its cases by test node id: every one must still exist (a
renamed test would otherwise show up only as "missing" the next time the table is made), and the
table marks anything but fail-before / pass-now."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location(
        "before_after", REPO / "tools" / "reliability_before_after.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("group", ["issue 16", "issue 24", "issue 35"])
def test_every_case_names_a_collected_test(group: str) -> None:
    tool = _tool()
    _, cases, _, copied = next(g for g in tool.GROUPS if g[0] == group)
    ids = [node for _, _, node in getattr(tool, cases)]
    assert len(ids) == len(set(ids))
    assert {node.split("::")[0] for node in ids} <= set(getattr(tool, copied))
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


def test_the_issue_24_table_is_made_from_its_own_cases() -> None:
    tool = _tool()
    then = {node: ("fail", "AssertionError: x") for _, _, node in tool.CASES_24}
    now = {node: ("pass", "") for _, _, node in tool.CASES_24}
    table = tool.markdown(then, now, tool.BEFORE_24, 1.0, tool.CASES_24)
    n = len(tool.CASES_24)
    assert table.startswith(f"{n} of {n} cases fail before (commit {tool.BEFORE_24})")
    assert table.count("\n| ") == n + 1  # the header's separator row and one row per case
