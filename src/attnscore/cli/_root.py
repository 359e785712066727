"""The ``attnscore`` command tree (:func:`build_parser`) and its entry point (:func:`main`).

Each command's module adds its parser through ``add_parser(subparsers)``, which sets
``handler(args) -> int`` as a default; :func:`main` calls it under
:func:`~attnscore.cli._usage.run_main`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._usage import ArgumentParser, run_main

COMMANDS: dict[str, str] = {
    "demo": "run the section's worked examples and draw heatmaps",
    "run": "compute attention on your own arrays",
    "bench": "time attnscore against the textbook code and PyTorch",
    "g2p": "grapheme-to-phoneme task on CMUdict (docs/g2p.md)",
    "export": "write a scorer's attention module as .onnx or .pt2",
    "tune": "measure the C kernel against SDPA on this machine for the selection (<= 2 min)",
}
"""The commands and their one-line help, as each command's parser gives it (a test checks
that they agree): ``attnscore --help`` and ``--version`` print from this alone, without
importing a command's module (and torch)."""


def _root() -> tuple[ArgumentParser, argparse._SubParsersAction[ArgumentParser]]:
    from .. import __version__  # attnscore's __init__ imports nothing heavy

    parser = ArgumentParser(
        prog="attnscore",
        description="Attention scoring functions and attention pooling (D2L section "
        "'Attention Scoring Functions').",
    )
    parser.add_argument(
        "--version", action="version", version=f"attnscore {__version__}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    return parser, sub


def top_parser() -> ArgumentParser:
    """The ``attnscore`` parser with each command's name and help only (no options): what
    ``attnscore --help``, ``--version`` and an unknown command need, built without torch.

    >>> top_parser().format_help() == build_parser().format_help()
    True
    """
    parser, sub = _root()
    for name, summary in COMMANDS.items():
        sub.add_parser(name, help=summary)
    return parser


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
    from . import bench, demo, export, g2p, run, tune

    parser, sub = _root()
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

    words = list(sys.argv[1:] if argv is None else argv)

    def command() -> int:
        try:
            if (
                not words
                or words[0] in ("-h", "--help", "--version")
                or (not words[0].startswith("-") and words[0] not in COMMANDS)
            ):
                top_parser().parse_args(words)  # prints help, the version or the error
            args = build_parser().parse_args(words)
            return int(args.handler(args))
        except SystemExit as done:  # --help, --version, or a handler that exits
            if done.code is None or isinstance(done.code, int):
                return done.code or 0
            print(done.code, file=sys.stderr)
            return 1

    return run_main("attnscore", command)
