"""``python -m attnscore.g2p`` (also what ``torchrun -m attnscore.g2p`` runs)."""

import sys

from ..cli.g2p import main

sys.exit(main())
