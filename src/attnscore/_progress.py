"""A small progress reporter: a tqdm bar when tqdm is installed, plain lines otherwise
(``attnscore tune``; G2P training in attnscore-g2p, which installs tqdm)."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    """Progress of a loop of ``total`` steps with a few numbers alongside.

    Draws a tqdm bar on stderr when tqdm is installed (attnscore-g2p installs it), otherwise
    prints one plain line every ``interval`` seconds. ``enabled=False`` prints nothing at all
    (:meth:`write` still prints).

    Args:
        total: number of steps of the loop.
        desc: label in front of the bar or line.
        initial: steps already done (a resumed run).
        enabled: draw anything at all.
        interval: seconds between plain lines (and between tqdm redraws off a terminal).
        stream: where to draw (default ``sys.stderr``).
    """

    def __init__(
        self,
        total: int,
        desc: str,
        *,
        initial: int = 0,
        enabled: bool = True,
        interval: float = 30.0,
        stream: TextIO | None = None,
    ) -> None:
        self.total, self.desc, self.enabled = total, desc, enabled
        self.interval = interval
        self.stream = stream if stream is not None else sys.stderr
        self.n = initial
        self._last_line = time.perf_counter()
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                tty = self.stream.isatty()
                self._bar = tqdm(
                    total=total,
                    initial=initial,
                    desc=desc,
                    unit="step",
                    file=self.stream,
                    dynamic_ncols=True,
                    mininterval=0.2 if tty else interval,
                )

    def update(self, n: int, **stats: float) -> None:
        """Move to step ``n`` and show ``stats`` (name -> value) next to it."""
        shown = {k: f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}" for k, v in stats.items()}
        delta, self.n = n - self.n, n
        if self._bar is not None:
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(delta)
        elif self.enabled:
            now = time.perf_counter()
            if now - self._last_line >= self.interval or n >= self.total:
                self._last_line = now
                text = " ".join(f"{k} {v}" for k, v in shown.items())
                print(f"{self.desc}: step {n}/{self.total} {text}", file=self.stream, flush=True)

    def write(self, message: str) -> None:
        """Print a line above the bar (or to stdout without a bar)."""
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            print(message, flush=True)

    def close(self) -> None:
        """Finish the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
