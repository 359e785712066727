"""``python -m attnscore.cli``: the same as the ``attnscore`` command."""

from . import main

raise SystemExit(main())
