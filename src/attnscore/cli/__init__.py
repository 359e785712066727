"""The ``attnscore`` command: a thin argparse layer over the library, ``main(argv) -> int``.

:mod:`._root` holds the command tree; :mod:`.demo`, :mod:`.run`, :mod:`.bench`,
:mod:`.export` and :mod:`.tune` each add a command with ``add_parser(subparsers)``, as other
distributions' commands do (``g2p``: attnscore-g2p); :mod:`._usage` holds
:class:`~._usage.UsageError` (one line, exit 2) and the option types, :mod:`._files` the
policy for files a command writes, and :mod:`._arrays` reads ``attnscore run --input``.
Nothing below this package raises :class:`~._usage.UsageError`: the commands turn the
library's errors into it.
"""

from ._root import build_parser, main

__all__ = ["build_parser", "main"]
