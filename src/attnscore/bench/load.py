"""Whether the machine was busy while the bench ran: the load average against the cores.

A timing taken while other processes compete for the cores is slower than on an idle
machine, and not by the same factor on both sides of a ratio. The run reads the 1-minute
load average before it starts and after each cell and warns where it exceeds the cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MARGIN", "LoadWatch", "load_average", "usable_cores"]

MARGIN = 0.5
"""How far above the core count the load average may go before the machine counts as busy: a
run that times on every core keeps the load at its thread count, and an idle machine's
average wobbles a little above that; a competing process adds a whole core."""


def load_average() -> float | None:
    """The 1-minute load average, or None where the system does not report one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows has no getloadavg
        return None


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


@dataclass
class LoadWatch:
    """The highest load average seen over a run, against ``cores``.

    >>> watch = LoadWatch(cores=2)
    >>> watch.see(1.5), watch.see(2.4), watch.see(3.25), watch.see(4.0), watch.see(None)
    (False, False, True, False, False)
    >>> watch.as_dict()
    {'cores': 2, 'max_load_1min': 4.0, 'busy': True, 'readings': 4, 'threshold': 2.5}

    :meth:`see` is true only the first time the load exceeds the cores (plus
    :data:`MARGIN`): the moment to warn.
    """

    cores: int = field(default_factory=usable_cores)
    highest: float | None = None
    readings: int = 0
    busy: bool = False

    def see(self, load: float | None) -> bool:
        """Record one reading (None: not available); true the first time it exceeds the
        cores."""
        if load is None:
            return False
        self.readings += 1
        self.highest = load if self.highest is None else max(self.highest, load)
        over = load > self.threshold
        first = over and not self.busy
        self.busy = self.busy or over
        return first

    @property
    def threshold(self) -> float:
        """The load above which the machine counts as busy."""
        return self.cores + MARGIN

    def warning(self) -> str:
        """The one line printed when the load first exceeds the cores."""
        return (
            f"attnscore bench: warning: load average {self.highest:.1f} exceeds the "
            f"{self.cores} cores: other processes compete for them, so the timings are slower "
            "and noisier than on an idle machine"
        )

    def as_dict(self) -> dict[str, Any]:
        """What the results record under ``"load"``."""
        return {
            "cores": self.cores,
            "max_load_1min": self.highest,
            "busy": self.busy,
            "readings": self.readings,
            "threshold": self.threshold,
        }
