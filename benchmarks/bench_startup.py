"""Start-up of the ``loopformer`` command (issue 25): user CPU seconds of ``--help`` and ``recipes``.

Each command runs in a fresh ``python -m loopformer`` process; its user (and system) CPU time is the
difference of ``resource.getrusage(RUSAGE_CHILDREN)`` around the call (the child is waited for, so its
time is counted). The two commands alternate, the figure is the median over the repeats. CPU time, not
wall time: a loaded machine stretches the wall clock but not the CPU a process spends. The load average
before and after is in the details. Target: under 1 CPU-second (issue 25; it was ~7 with torch, scipy
and matplotlib imported up front).

    python -m benchmarks --only startup
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys

from benchmarks.common import Result

COMMANDS = {"help": ["--help"], "recipes": ["recipes"]}
TARGET_S = 1.0


def child_cpu(args: list[str]) -> tuple[float, float]:
    """(user, system) CPU seconds of one ``python -m loopformer ARGS`` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", "loopformer", *args], stdout=subprocess.DEVNULL, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime


def run(quick: bool) -> list[Result]:
    repeats = 1 if quick else 9
    load_before = os.getloadavg()
    user: dict[str, list[float]] = {name: [] for name in COMMANDS}
    system: dict[str, list[float]] = {name: [] for name in COMMANDS}
    names = list(COMMANDS)
    for r in range(repeats):
        for name in names[r % 2 :] + names[: r % 2]:
            u, s = child_cpu(COMMANDS[name])
            user[name].append(u)
            system[name].append(s)
    load_after = os.getloadavg()
    results = []
    for name in names:
        value = statistics.median(user[name])
        results.append(
            Result(
                "startup",
                f"startup.{name}_user_cpu_s",
                value,
                "s",
                f"<= {TARGET_S:g}",
                value <= TARGET_S,
                f"user CPU of `python -m loopformer {' '.join(COMMANDS[name])}`, median of {repeats}",
                {
                    "user_cpu_s": [round(x, 4) for x in user[name]],
                    "system_cpu_s": [round(x, 4) for x in system[name]],
                    "median_system_cpu_s": round(statistics.median(system[name]), 4),
                    "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in load_after],
                    "logical_cpus": os.cpu_count(),
                },
            )
        )
    return results
