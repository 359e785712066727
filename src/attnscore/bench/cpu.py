"""CPU-only helpers of the bench: peak RSS (``VmHWM``, the whole process, torch included) of
a case in a fresh process, for ``additive_memory``, and the C kernels' cold compile time."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from .._memory import peak_rss_mib
from . import matrix
from ._core import make_step


# ------------------------------------------------------------------ peak RSS, subprocesses
def child(case: str, quick: bool, impl: str) -> None:
    """Run one case (an extra row, by name) once in this fresh process and print its peak
    RSS in MiB."""
    (found,) = [c for c in matrix.extras("cpu", quick) if c.name == case]
    built = found.build()
    make_step(built.forwards[impl], built.grad_inputs.get(impl), found.backward)()
    print(peak_rss_mib())


def _last_float(stdout: str) -> float | None:
    try:
        value = float(stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return None
    return value if value == value else None


def _run(args: list[str], timeout: float, **extra_env: str) -> float | None:
    """The number a Python subprocess prints last (None if it prints none); it imports this
    very attnscore (not another install)."""
    import attnscore

    root = os.path.dirname(os.path.dirname(os.path.abspath(attnscore.__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, **extra_env}
    cmd = [sys.executable, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return _last_float(proc.stdout)


def peak_rss(case: str, quick: bool, impl: str, threads: int) -> float | None:
    """Peak RSS in MiB of a fresh process running ``impl`` of ``case`` once; None on failure."""
    args = ["-m", "attnscore.bench", "--child", case, impl, "--threads", str(threads)]
    return _run(args + (["--quick"] if quick else []), 900)


def cold_compile_seconds() -> float | None:
    """First-call compile + load time of the C kernels, in a subprocess with an empty cache."""
    code = (
        "import time, torch; t = time.perf_counter(); from attnscore import kernels; "
        "ok = kernels.load_library() is not None; "
        "print(time.perf_counter() - t if ok else -1)"
    )
    with tempfile.TemporaryDirectory() as cache:
        seconds = _run(["-c", code], 600, ATTNSCORE_CACHE=cache)
    return None if seconds is None or seconds < 0 else seconds
