"""The ``loopformer`` command: run | train | eval | solve | data | models.

Built on click: subcommands live next to the code they drive and are attached here.
"""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="loopformer")
def cli() -> None:
    """Looped transformers that think until they converge."""


def _attach_subcommands() -> None:
    from loopformer.tasks.cli import data

    cli.add_command(data)


def main() -> None:
    _attach_subcommands()
    cli()


if __name__ == "__main__":
    main()
