"""``python -m attnscore.bench``: the same as ``attnscore bench``."""

from . import main

raise SystemExit(main())
