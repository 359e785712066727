"""``python -m attnscore``: the same as the ``attnscore`` command."""

from .cli import main

raise SystemExit(main())
