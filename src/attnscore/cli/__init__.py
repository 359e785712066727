"""The ``attnscore`` command: a thin argparse layer over the library, ``main(argv) -> int``.

One module per command, and the helpers they share:

- :mod:`._root`: the command tree (:func:`build_parser`) and :func:`main`;
- :mod:`.demo`, :mod:`.run`, :mod:`.bench`, :mod:`.g2p` (with :mod:`._g2p_handlers`): the
  commands, each adding its parser with ``add_parser(subparsers)``;
- :mod:`._usage`: :class:`~._usage.UsageError` (one line, exit 2), the parser class that
  raises it, and the option types (counts, fractions, ``--device``);
- :mod:`._files`: the one policy for files a command writes (checked first, written
  atomically); :mod:`._arrays`: reading ``attnscore run --input``.

Nothing below this package raises :class:`~._usage.UsageError`: the commands turn the
library's errors into it.
"""

from ._root import build_parser, main

__all__ = ["build_parser", "main"]
