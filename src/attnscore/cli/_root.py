"""The ``attnscore`` command tree (:func:`build_parser`) and its entry point (:func:`main`).

Each command's module adds its parser through ``add_parser(subparsers)``, which sets
``handler(args) -> int`` as a default; :func:`main` calls it under
:func:`~attnscore.cli._usage.run_main`. Other distributions add commands through the entry
point group :data:`ENTRY_POINTS` (attnscore-g2p's ``g2p``), read only when a parser is built.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence
from types import ModuleType

from ._usage import ArgumentParser, UsageError, run_main

COMMANDS: dict[str, str] = {
    "demo": "run the section's worked examples and draw heatmaps",
    "run": "compute attention on your own arrays",
    "bench": "time attnscore against the textbook code and PyTorch",
    "export": "write a scorer's attention module as .onnx or .pt2",
    "tune": "measure the C kernels against PyTorch's calls on this machine for the selection "
    "(<= 2 min)",
}
"""attnscore's own commands and their one-line help, as each command's parser gives it (a test
checks that they agree): ``attnscore --help`` and ``--version`` print from this alone, without
importing a command's module (and torch)."""

ENTRY_POINTS = "attnscore.commands"
"""The entry point group of the commands other distributions add: each entry names a module
that imports nothing heavy, with ``HELP`` (its line in ``--help``) and ``add_parser``."""

ELSEWHERE = {"g2p": "./attnscore-g2p"}
"""Commands of this repository's other distributions, by name, and what ``pip install`` takes
to add each: asked for while not installed, they are refused with that hint."""


@functools.cache
def installed() -> dict[str, ModuleType]:
    """The commands other distributions add (:data:`ENTRY_POINTS`), by name, in name order;
    read once (importing each entry's small module, not torch). A name of :data:`COMMANDS`
    is not taken."""
    from importlib.metadata import entry_points

    found = {ep.name: ep for ep in entry_points(group=ENTRY_POINTS) if ep.name not in COMMANDS}
    return {name: found[name].load() for name in sorted(found)}


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
    plugins = {name: command.HELP for name, command in installed().items()}
    for name, summary in {**COMMANDS, **plugins}.items():
        sub.add_parser(name, help=summary)
    return parser


def build_parser() -> ArgumentParser:
    """The whole command tree: ``demo``, ``run``, ``bench`` with its own subcommands,
    ``export``, ``tune``, the commands of :func:`installed`, and ``--version``.

    Returns:
        The ``attnscore`` parser; every parser in it raises
        :class:`~attnscore.cli._usage.UsageError` on bad options.

    >>> args = build_parser().parse_args(["run", "--input", "in.npz"])
    >>> args.scoring, args.handler.__name__
    ('scaled_dot', '_run')
    """
    from . import bench, demo, export, run, tune

    parser, sub = _root()
    for command in (demo, run, bench, export, tune, *installed().values()):
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
            if words and words[0] in ELSEWHERE and words[0] not in installed():
                raise UsageError(
                    f"{words[0]}: this command is not installed; install it from attnscore's "
                    f"repository with: pip install {ELSEWHERE[words[0]]}"
                )
            if (
                not words
                or words[0] in ("-h", "--help", "--version")
                or (not words[0].startswith("-") and words[0] not in {*COMMANDS, *installed()})
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
