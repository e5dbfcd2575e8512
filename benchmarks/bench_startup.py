"""Start-up of the ``loopformer`` command (issues 25, 49): user CPU seconds of ``--help`` and ``recipes``
(under 1 s: no torch), of ``train sudoku4_trm --print-config`` (under 2 s: the configuration is read and
checked before the trainer is imported; its checks load the registries, so torch, but not Dynamo or
SciPy), and of the default job's first training step (a fresh process that builds the default recipe's
config, the ``Trainer``, and runs one ``train_step``; informational). loopformer imports neither
``scipy.stats`` nor matplotlib for it; what else it loads comes from its dependencies: ``torch._dynamo``
(and sympy) from ``torch.optim.Optimizer.__init__`` (torch's own lazy ``_disable_dynamo``), numba (and
``scipy.linalg``) for the Sudoku generator's kernels.

Each command runs in a fresh ``python`` process; its user (and system) CPU time is the difference of
``resource.getrusage(RUSAGE_CHILDREN)`` around the call (the child is waited for, so its time is
counted). The commands alternate, the figure is the median over the repeats. CPU time, not wall time: a
loaded machine stretches the wall clock but not the CPU a process spends. The load average before and
after is in the details.

    python -m benchmarks --only startup
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile

from benchmarks.common import Result

# the default job's first training step: its config (the run: table is loopformer run's), the Trainer, one step
FIRST_STEP = """
import sys
from loopformer.commands.run import training_config
from loopformer.train.trainer import Trainer
trainer = Trainer(training_config("default", ["train.threads=1"], sys.argv[1]))
trainer.train_step()
imported = [m for m in ("scipy.stats", "matplotlib") if m in sys.modules]
assert not imported, f"a CPU training step imported {imported}"
"""
# name -> (arguments of `python`, what it is, target user CPU seconds or None)
COMMANDS = {
    "help": (["-m", "loopformer", "--help"], "`python -m loopformer --help`", 1.0),
    "recipes": (["-m", "loopformer", "recipes"], "`python -m loopformer recipes`", 1.0),
    "print_config": (["-m", "loopformer", "train", "sudoku4_trm", "--print-config"],
                     "`python -m loopformer train sudoku4_trm --print-config`", 2.0),
    "first_step": (["-c", FIRST_STEP], "the default job's first training step in a fresh process "
                   "(config, Trainer, one train_step, one thread)", None),
}  # fmt: skip


def child_cpu(args: list[str]) -> tuple[float, float]:
    """(user, system) CPU seconds of one ``python ARGS`` process (a run folder, if any, in a temporary one)."""
    with tempfile.TemporaryDirectory() as tmp:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        folder = [f"{tmp}/run"] if args[0] == "-c" else []
        subprocess.run([sys.executable, *args, *folder], stdout=subprocess.DEVNULL, check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime


# the rows a --quick run (the smoke test) measures: the others import torch in a fresh process (tens of
# seconds of wall time on a loaded machine) and are left out with a reason
QUICK = ("help", "recipes")


def run(quick: bool) -> list[Result]:
    repeats = 1 if quick else 5
    load_before = os.getloadavg()
    names = [name for name in COMMANDS if name in QUICK or not quick]
    user: dict[str, list[float]] = {name: [] for name in names}
    system: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            u, s = child_cpu(COMMANDS[name][0])
            user[name].append(u)
            system[name].append(s)
    load_after = os.getloadavg()
    results = []
    for name in names:
        value = statistics.median(user[name])
        _, what, target = COMMANDS[name]
        results.append(
            Result(
                "startup",
                f"startup.{name}_user_cpu_s",
                value,
                "s",
                None if target is None else f"<= {target:g}",
                None if target is None else value <= target,
                f"user CPU of {what}, median of {repeats}",
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
    results += [
        Result("startup", f"startup.{name}_user_cpu_s", None, "s", None, None,
               f"not measured with --quick (it imports torch in a fresh process): {COMMANDS[name][1]}")
        for name in COMMANDS if name not in names
    ]  # fmt: skip
    return results
