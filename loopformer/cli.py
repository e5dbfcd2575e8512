"""The ``loopformer`` command: run | train | eval | solve | models | data | convert.

Built on click: subcommands live in ``loopformer.commands`` (and ``data`` next to the tasks in
``loopformer.tasks.cli``) and are attached here. Errors (bad config keys, missing or corrupt
checkpoints, wrong task or model) print one line and exit with status 1; ``--debug`` (or
``LOOPFORMER_DEBUG=1``) shows the traceback instead.
"""

from __future__ import annotations

import click

from loopformer.commands.common import CleanErrorGroup


@click.group(cls=CleanErrorGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="loopformer")
@click.option("--debug", is_flag=True, help="show the full traceback on errors")
def cli(debug: bool) -> None:
    """Looped transformers that think until they converge."""


def _attach_subcommands() -> None:
    from loopformer.commands.convert import convert
    from loopformer.commands.models import models
    from loopformer.commands.run import run
    from loopformer.commands.solve import solve
    from loopformer.commands.train_eval import evaluate_cmd, train
    from loopformer.tasks.cli import data

    for command in (run, train, evaluate_cmd, solve, models, data, convert):
        cli.add_command(command)
    from loopformer.data_prepare import prepare_cmd
    from loopformer.hub import push_cmd

    data.add_command(prepare_cmd)
    cli.add_command(push_cmd)


_attach_subcommands()


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
