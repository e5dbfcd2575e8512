"""Subcommands of the ``loopformer`` command line (attached in ``loopformer.cli``)."""
