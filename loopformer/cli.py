"""The ``loopformer`` command: run | train | eval | compare | sweep | solve | models | data | convert.

Built on click: subcommands live in ``loopformer.commands`` and are attached here. Errors (bad config
keys, missing or corrupt checkpoints, wrong task or model) print one line and exit with status 1; ``--debug`` (or
``LOOPFORMER_DEBUG=1``) shows the traceback instead.
"""

from __future__ import annotations

import click

from loopformer.commands.common import CleanErrorGroup


@click.group(cls=CleanErrorGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="loopformer")
@click.option("--debug", is_flag=True, help="show the full traceback on errors")
@click.option("--quiet", "-q", is_flag=True, help="only warnings and errors from the loopformer loggers")
def cli(debug: bool, quiet: bool) -> None:
    """Looped transformers that think until they converge."""
    setup_logging(quiet)


def setup_logging(quiet: bool = False) -> None:
    """Show the ``loopformer.*`` loggers' messages (curriculum level-ups, resumes, warnings) on stderr:
    info and up, or warnings and up with ``-q``."""
    import logging

    from rich.console import Console
    from rich.logging import RichHandler

    logger = logging.getLogger("loopformer")
    if not any(getattr(h, "_loopformer", False) for h in logger.handlers):
        handler = RichHandler(console=Console(stderr=True), show_path=False, show_time=False)
        handler._loopformer = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.WARNING if quiet else logging.INFO)


def _attach_subcommands() -> None:
    from loopformer.commands.convert import convert
    from loopformer.commands.data import data
    from loopformer.commands.models import models
    from loopformer.commands.run import run
    from loopformer.commands.solve import solve
    from loopformer.commands.train_eval import evaluate_cmd, train

    for command in (run, train, evaluate_cmd, solve, models, data, convert):
        cli.add_command(command)
    from loopformer.commands.compare import compare
    from loopformer.commands.recipes import recipes
    from loopformer.commands.sweep import sweep
    from loopformer.data_prepare import prepare_cmd
    from loopformer.hub import push_cmd

    data.add_command(prepare_cmd)
    cli.add_command(push_cmd)
    cli.add_command(recipes)
    cli.add_command(compare)
    cli.add_command(sweep)


_attach_subcommands()


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
