"""Start-up of the ``loopformer`` command (issue 25): ``--help`` and ``recipes`` import no torch, scipy or
matplotlib (the behaviour; the CPU time is the ``startup`` benchmark's row, benchmarks/bench_startup.py),
``train --print-config`` and a refused key or value are answered before the trainer, Dynamo or SciPy is
imported (issue 49), and the lazily loaded subcommands' summaries agree with the commands themselves."""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest

from loopformer.cli import LAZY_COMMANDS, cli, load_command

HEAVY = ("torch", "scipy", "matplotlib", "numpy")

PROBE = """
import json, sys
watch = set(json.loads(sys.argv[2]))
sys.argv = ["loopformer", *json.loads(sys.argv[1])]
from loopformer.cli import main
try:
    main()
except SystemExit as stop:
    code = stop.code
heavy = sorted(name for name in watch if name in sys.modules)
print("HEAVY=" + json.dumps(heavy), file=sys.stderr)
"""


def heavy_imports(args: list[str], watch: tuple[str, ...] = HEAVY) -> tuple[list[str], str]:
    """(the modules of ``watch`` imported by ``loopformer ARGS``, its stdout and stderr)."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(args), json.dumps(watch)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stderr.splitlines() if line.startswith("HEAVY=")]
    assert lines, proc.stderr
    return json.loads(lines[-1].removeprefix("HEAVY=")), proc.stdout + proc.stderr


@pytest.mark.parametrize("args", [["--help"], ["recipes"], ["-h"]])
def test_help_and_recipes_import_no_heavy_package(args: list[str]) -> None:
    heavy, out = heavy_imports(args)
    assert heavy == [], f"loopformer {' '.join(args)} imported {heavy}"
    assert ("sudoku4_fprm" in out) if args == ["recipes"] else ("train" in out and "solve" in out)


@pytest.mark.parametrize(
    "args, says",
    [
        (["--print-config"], "n_inner: 3"),
        (["train.stpes=10"], "did you mean 'train.steps'"),
        (["train.steps=-1"], "train.steps"),
    ],
)
def test_configuration_answers_come_before_the_trainer(args: list[str], says: str) -> None:
    """Answered from the configuration alone: the trainer, Dynamo (torch.compile) and SciPy are not loaded."""
    proc_args = ["train", "sudoku4_trm", *args]
    heavy, out = heavy_imports(proc_args, ("loopformer.train.trainer", "torch._dynamo", "scipy", "matplotlib"))
    assert heavy == [], f"loopformer {' '.join(proc_args)} imported {heavy}"
    assert says in out, out


def test_the_probe_sees_a_command_that_does_import_torch() -> None:
    heavy, out = heavy_imports(["models", "--json"])  # builds models (on the meta device): needs torch
    assert "torch" in heavy and '"fprm"' in out


def test_lazy_summaries_are_the_commands_own_first_sentences() -> None:
    for name in LAZY_COMMANDS:
        command = load_command(name)
        assert isinstance(command, click.Command) and command.name == name
        text = " ".join((command.help or "").split())
        assert text.startswith(LAZY_COMMANDS[name][1].rstrip(".")), name
    assert sorted(cli.list_commands(click.Context(cli))) == sorted(LAZY_COMMANDS)
