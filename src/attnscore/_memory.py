"""This process's memory: the one peak-memory reader of attnscore (``attnscore bench``, G2P
summaries), and glibc's ``malloc`` tuned to keep freed blocks (the bench, G2P training)."""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


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


def keep_freed_memory() -> bool:
    """Ask glibc's ``malloc`` to keep freed blocks of up to 32 MiB for reuse.

    Every training step (and every benchmark repetition) allocates and frees the same
    few-MiB buffers. By default glibc serves blocks above 128 KiB with ``mmap`` and unmaps
    them on free, so each step faults its buffers in afresh, page by page, and whether a
    call hit fresh pages decides its time. Process-wide, so it is called where a long run
    starts (G2P training, ``attnscore bench``), never on import.

    Returns:
        True if glibc took both settings; False elsewhere (no glibc: nothing changes).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
