"""How much memory this process has used: the one peak-memory reader of attnscore.

``attnscore bench`` (the peak of each measuring subprocess) and the G2P runs (their
summaries) both report it.
"""

from __future__ import annotations

__all__ = ["peak_rss_mib"]


def peak_rss_mib() -> float:
    """Peak resident memory of this process in MiB, from ``VmHWM`` of /proc/self/status.

    Not ``ru_maxrss``: Linux carries that over fork + exec, so a child would report its
    parent's peak; ``VmHWM`` belongs to this process image only.

    Returns:
        The peak in MiB (the whole process, torch included); NaN where /proc is missing.

    >>> peak_rss_mib() > 0
    True
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    return float("nan")  # pragma: no cover
