"""``python -m attnscore_g2p`` (also what ``torchrun -m attnscore_g2p`` runs)."""

import sys

from .cli import main

sys.exit(main())
