"""The ``fedhier`` command line (:func:`main`): ``fedhier run``, ``diversity``, ``experiment``,
``sweep``, ``deploy``, ``plot`` (:mod:`fedhier.cli.commands`), with the flags every subcommand
shares (:mod:`fedhier.cli.flags`)."""

from fedhier.cli.commands import main

__all__ = ["main"]
