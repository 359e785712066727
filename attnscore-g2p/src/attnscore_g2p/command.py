"""``attnscore g2p``: the entry point the ``attnscore`` command finds this task by (group
``attnscore.commands`` in attnscore-g2p's pyproject.toml).

``attnscore --help`` lists the command from :data:`HELP` after importing only this module, so
the help still answers without torch; :func:`add_parser` imports the command line (and torch)
when the whole tree is built.
"""

from __future__ import annotations

import argparse
from typing import Any

HELP = "grapheme-to-phoneme task on CMUdict (docs/g2p.md)"
"""The command's one line in ``attnscore --help``."""


def add_parser(subparsers: argparse._SubParsersAction[Any]) -> argparse.ArgumentParser:
    """Add ``g2p`` with its sub-commands: :func:`attnscore_g2p.cli.add_parser`.

    >>> from attnscore.cli import build_parser
    >>> build_parser().parse_args(["g2p", "table", "runs/g2p"]).handler.__name__
    'cmd_table'
    """
    from .cli import add_parser as add

    return add(subparsers)
