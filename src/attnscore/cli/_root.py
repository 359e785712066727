"""The ``attnscore`` command tree (:func:`build_parser`) and its entry point (:func:`main`).

Each command's module adds its parser through ``add_parser(subparsers)``, which sets
``handler(args) -> int`` as a default; :func:`main` calls it under
:func:`~attnscore.cli._usage.run_main`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ._usage import ArgumentParser, run_main

__all__ = ["build_parser", "main"]


def build_parser() -> ArgumentParser:
    """The whole command tree: ``demo``, ``run``, ``bench``, ``g2p`` with their own
    subcommands, ``export``, ``tune``, and ``--version``.

    Returns:
        The ``attnscore`` parser; every parser in it raises
        :class:`~attnscore.cli._usage.UsageError` on bad options.

    >>> args = build_parser().parse_args(["run", "--input", "in.npz"])
    >>> args.scoring, args.handler.__name__
    ('scaled_dot', '_run')
    """
    from .. import __version__
    from . import bench, demo, export, g2p, run, tune

    parser = ArgumentParser(
        prog="attnscore",
        description="Attention scoring functions and attention pooling (D2L section "
        "'Attention Scoring Functions').",
    )
    parser.add_argument(
        "--version", action="version", version=f"attnscore {__version__}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (demo, run, bench, g2p, export, tune):
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``attnscore`` command; returns the exit code.

    Bad input anywhere (options, missing or corrupt files, wrong arrays, bad shapes, an
    existing output file without ``--overwrite``, a missing optional extra) gives one line
    on stderr, ``attnscore: error: ...``, and exit code 2, and leaves no output file behind.
    Standard output closed early (``attnscore run ... | head -1``) ends the command quietly
    with exit code 141. No traceback is printed for any of these.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        0 on success, 1 when a command fails in its own terms (``bench`` missing a target,
        a handler exiting with a message), 2 on bad input, 141 when standard output was
        closed.

    >>> main(["run", "--input", "no-such-file.npz"])
    2
    """

    def command() -> int:
        try:
            args = build_parser().parse_args(argv)
            return int(args.handler(args))
        except SystemExit as done:  # --help, --version, or a handler that exits
            if done.code is None or isinstance(done.code, int):
                return done.code or 0
            print(done.code, file=sys.stderr)
            return 1

    return run_main("attnscore", command)
