"""A pytest plug-in for tools/gpu_check.sh: every test's start and end time-stamped in the log, and one JSON
line per finished test appended to ``$GPU_CHECK_TESTS`` as it happens (so a run cut short by its time limit
still shows how far it got). Load with ``-p tools.pytest_timestamps`` from the repository root."""

from __future__ import annotations

import json
import os
import time
from typing import Any


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


_started: dict[str, float] = {}


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _started[nodeid] = time.time()
    print(f"\n[{_now()}] start {nodeid}", flush=True)


def pytest_runtest_logreport(report: Any) -> None:
    if report.when != "call" and not (report.when == "setup" and report.outcome != "passed"):
        return
    seconds = round(time.time() - _started.get(report.nodeid, time.time()), 2)
    print(f"[{_now()}] end {report.nodeid} {report.outcome} ({seconds} s)", flush=True)
    path = os.environ.get("GPU_CHECK_TESTS")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"test": report.nodeid, "outcome": report.outcome, "seconds": seconds,
                                 "end": _now()}) + "\n")  # fmt: skip
