"""The ``loopformer`` command: run | train | eval | compare | sweep | solve | models | data | convert |
export | translate | consolidate | push | recipes.

Built on click: subcommands live in ``loopformer.commands`` and are imported only when they run (or
print their own ``--help``), so ``loopformer --help`` and ``loopformer recipes`` never import torch,
scipy or matplotlib (``LazyGroup``; ``tests/test_startup.py``). Errors (bad config keys, missing or
corrupt checkpoints, wrong task or model) print one line and exit with status 1; ``--debug`` (or
``LOOPFORMER_DEBUG=1``) shows the traceback instead.

Before a command runs, user code is loaded (``loopformer.plugins``): the ``loopformer.plugins`` entry
points of installed distributions, the modules in ``LOOPFORMER_IMPORT`` (comma-separated) and those
given with ``--import MODULE`` (repeatable), in that order.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from loopformer.commands.common import CleanErrorGroup

# name -> (where the command object lives, its one-line summary for ``loopformer --help``); the summary
# is the first sentence of the command's own help (tests/test_startup.py checks they agree), printed
# whole (wrapped, never cut: commands.common.WholeHelpGroup)
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "compare": (
        "loopformer.commands.compare:compare",
        "Compare evaluations: accuracy, loops, converged, time, parameters; overlay plots.",
    ),
    "sweep": (
        "loopformer.commands.sweep:sweep",
        "Run RECIPE over a grid, e.g. loop_eval.solver=damped,anderson train.lr=1e-3,3e-4; compare the points.",
    ),
    "consolidate": (
        "loopformer.commands.convert:consolidate_cmd",
        "Turn a sharded (FSDP2) checkpoint into a full safetensors checkpoint.",
    ),
    "convert": (
        "loopformer.commands.convert:convert",
        "Turn an authors' checkpoint (a PyTorch state dict, "
        "loaded with weights_only=True) into a run folder that loopformer eval, solve and the "
        "analyses accept.",
    ),
    "data": (
        "loopformer.commands.data:data",
        "Generate, show and summarise task datasets; loopformer data TASK ... generates examples of TASK.",
    ),
    "export": (
        "loopformer.commands.convert:export_cmd",
        "Write RUN as a checkpoint of the authors' code for SYSTEM (the inverse of loopformer convert).",
    ),
    "eval": (
        "loopformer.commands.train_eval:evaluate_cmd",
        "Evaluate CHECKPOINT (a run folder or checkpoint folder) on its held-out set; write a report.",
    ),
    "models": (
        "loopformer.commands.models:models",
        "List every registered model family with its parameter count at paper size and at the default CPU size.",
    ),
    "push": (
        "loopformer.runs.hub:push_cmd",
        "Share RUN's latest checkpoint as hub model REPO_ID (owner/name) with a generated model card.",
    ),
    "recipes": (
        "loopformer.commands.recipes:recipes",
        "List the shipped recipes, each with what it reaches (use one by name: loopformer train NAME).",
    ),
    "run": (
        "loopformer.commands.run:run",
        "Train the recipe's looped model and an equal-size plain transformer, evaluate both, report.",
    ),
    "solve": (
        "loopformer.commands.solve:solve",
        "Solve PUZZLE with a trained model, printing the answer as the loop refines it.",
    ),
    "translate": (
        "loopformer.commands.convert:translate_cmd",
        "Translate the authors' config keys or command line for SYSTEM into loopformer overrides.",
    ),
    "train": (
        "loopformer.commands.train_eval:train",
        "Train the model of RECIPE (a name in recipes/ or a path); OVERRIDES are key=value pairs.",
    ),
}


def load_command(name: str) -> click.Command:
    """The click command ``name`` of ``LAZY_COMMANDS``, imported now."""
    module, _, attr = LAZY_COMMANDS[name][0].partition(":")
    command: click.Command = getattr(importlib.import_module(module), attr)
    return command


class LazyGroup(CleanErrorGroup):
    """A group whose subcommands (``LAZY_COMMANDS``) are imported only when one is looked up to run; the
    group's own ``--help`` lists them from their summaries without importing any."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(LAZY_COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in LAZY_COMMANDS:
            self.add_command(load_command(cmd_name), cmd_name)
        return super().get_command(ctx, cmd_name)

    def command_summary(self, ctx: click.Context, name: str) -> str | None:
        """A command's whole first sentence: from ``LAZY_COMMANDS`` (nothing imported), else its own."""
        if name in LAZY_COMMANDS:
            return LAZY_COMMANDS[name][1]
        return super().command_summary(ctx, name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="loopformer")
@click.option("--debug", is_flag=True, help="show the full traceback on errors")
@click.option("--quiet", "-q", is_flag=True, help="only warnings and errors from the loopformer loggers")
@click.option(
    "--import",
    "imports",
    multiple=True,
    metavar="MODULE",
    help="import MODULE first (repeatable): user plug-ins (tasks, models, solvers, ...) register themselves; "
    "also LOOPFORMER_IMPORT=mod1,mod2",
)
def cli(debug: bool, quiet: bool, imports: tuple[str, ...]) -> None:
    """Looped transformers that think until they converge."""
    setup_logging(quiet)
    load_user_code(imports)


def load_user_code(imports: tuple[str, ...] | list[str] = ()) -> None:
    """The ``loopformer.plugins`` entry points, then the ``LOOPFORMER_IMPORT`` modules, then ``imports``."""
    from loopformer.plugins import ENV_VAR, env_modules, import_modules, load_entry_points

    load_entry_points()
    import_modules(env_modules(), ENV_VAR)
    import_modules(list(imports), "--import")


def _plain_stderr_handler() -> Any:
    """A ``LEVEL message`` handler writing to whatever ``sys.stderr`` is when a record is written (a test
    runner or a redirection may replace it after the handler is made), as rich's stderr console does."""
    import logging

    class PlainStderrHandler(logging.StreamHandler):
        @property  # type: ignore[override]
        def stream(self) -> Any:
            return sys.stderr

        @stream.setter
        def stream(self, value: Any) -> None:
            pass

    handler = PlainStderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    return handler


def setup_logging(quiet: bool = False) -> None:
    """Show the ``loopformer.*`` loggers' messages (curriculum level-ups, resumes, warnings) on stderr:
    info and up, or warnings and up with ``-q``."""
    import logging

    logger = logging.getLogger("loopformer")
    if not any(getattr(h, "_loopformer", False) for h in logger.handlers):
        handler: logging.Handler
        if sys.stderr.isatty():  # rich only for a terminal (its import is a tenth of a second)
            from rich.console import Console
            from rich.logging import RichHandler

            handler = RichHandler(console=Console(stderr=True), show_path=False, show_time=False)
        else:  # a log file (nohup, SLURM, torchrun): one plain line per message, never wrapped at 80 columns
            handler = _plain_stderr_handler()
        handler._loopformer = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.WARNING if quiet else logging.INFO)


def _attach_subcommands() -> None:
    """Import and attach every subcommand now (tests that read the command table)."""
    ctx = click.Context(cli)
    for name in LAZY_COMMANDS:
        cli.get_command(ctx, name)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
