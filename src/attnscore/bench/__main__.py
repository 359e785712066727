"""``python -m attnscore.bench``: the same as ``attnscore bench``."""

from ..cli.bench import main

raise SystemExit(main())
