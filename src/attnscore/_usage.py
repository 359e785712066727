"""The command line's one usage-error convention, shared by every subcommand.

Bad input anywhere in the ``attnscore`` command tree raises :class:`UsageError` (argparse
errors included, through :class:`ArgumentParser`); :func:`attnscore.cli.main` prints it as
one line on stderr, ``attnscore: error: <message>``, and returns exit code 2. No
traceback, no partial output file.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["ArgumentParser", "UsageError", "positive_int"]


class UsageError(Exception):
    """Bad input from the user: reported in one line, exit code 2."""


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose errors raise :class:`UsageError` instead of exiting.

    Subparsers made with ``add_subparsers().add_parser(...)`` are of this class too, so a
    whole command tree shares the convention.

    >>> parser = ArgumentParser(prog="demo")
    >>> _ = parser.add_argument("--n", type=int)
    >>> parser.parse_args(["--n", "x"])
    Traceback (most recent call last):
    ...
    attnscore._usage.UsageError: argument --n: invalid int value: 'x'
    """

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def positive_int(text: str) -> int:
    """argparse ``type=`` for counts and sizes: an integer >= 1.

    Raises:
        argparse.ArgumentTypeError: anything else (argparse reports it, naming the option).

    >>> parser = ArgumentParser(prog="demo")
    >>> _ = parser.add_argument("--num-hiddens", type=positive_int)
    >>> parser.parse_args(["--num-hiddens", "0"])
    Traceback (most recent call last):
    ...
    attnscore._usage.UsageError: argument --num-hiddens: expected a positive integer, but got '0'
    """
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, but got {text!r}")
    return value
