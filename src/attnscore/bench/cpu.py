"""The CPU rows: attnscore against the textbook code and SDPA, eager and under torch.compile.

Peak memory on the CPU is the peak RSS (``VmHWM``) of a fresh subprocess that builds the
inputs and runs the case once, so it is the peak of the whole process (torch included).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from functools import partial

import torch

import attnscore

from .._memory import peak_rss_mib
from . import _cases
from ._core import Built, Case, Shapes, Target, lengths, make_step

_SMALL_SOFTMAX: Shapes = {"B": 16, "n": 64, "m": 256}
_SMALL_DOT: Shapes = {"B": 8, "n": 256, "m": 256, "d": 32}
SHAPES: dict[str, tuple[Shapes, Shapes | None]] = {
    # name: (full shapes, smoke-run shapes)
    "masked_softmax": (_cases.SOFTMAX, _SMALL_SOFTMAX),
    "additive_fwd_bwd": (_cases.ADDITIVE_SMALL, {"B": 2, "n": 32, "m": 128, "h": 32, "d": 16}),
    "additive_memory": (_cases.ADDITIVE_LARGE, {"B": 1, "n": 256, "m": 256, "h": 64, "d": 16}),
    "dot_no_grad": (_cases.DOT, _SMALL_DOT),
    "dot_fwd_bwd": (_cases.DOT, _SMALL_DOT),
    # Not in the smoke run: compiling the textbook module takes about 20 s on a 2-core
    # machine, which alone would blow the smoke run's minute.
    "additive_fwd_bwd_compiled": (_cases.ADDITIVE_SMALL, None),
    "masked_softmax_compiled": (_cases.SOFTMAX, _SMALL_SOFTMAX),
}
FULL: dict[str, Shapes] = {name: full for name, (full, _) in SHAPES.items()}
QUICK: dict[str, Shapes] = {name: q for name, (_, q) in SHAPES.items() if q is not None}

TARGETS: dict[str, list[Target]] = {
    "masked_softmax": [Target("time", 1.3, "softmax"), Target("time", 0.25, "textbook")],
    "additive_fwd_bwd": [Target("time", 1 / 3, "textbook")],
    "additive_memory": [Target("rss_mib", 1024.0)],
    "dot_no_grad": [Target("time", 0.7, "sdpa"), Target("time", 0.2, "textbook")],
    "dot_fwd_bwd": [Target("time", 1.0, "sdpa")],
    # issue 9, point 2: registered ops keep the kernels under torch.compile
    "additive_fwd_bwd_compiled": [Target("time", 1 / 3, "textbook")],
    "masked_softmax_compiled": [Target("time", 1.3, "eager")],
}
BACKWARD = {"additive_fwd_bwd", "additive_memory", "dot_fwd_bwd", "additive_fwd_bwd_compiled"}


def build(case: str, s: Shapes) -> Built:
    """The implementations of CPU case ``case`` at shapes ``s`` (float32)."""
    cpu, f32 = torch.device("cpu"), torch.float32
    if case == "masked_softmax_compiled":
        torch.manual_seed(0)  # as every case: the same inputs on every run
        X, vl = torch.randn(s["B"], s["n"], s["m"]), lengths(s["B"], s["m"])
        compiled = torch.compile(attnscore.masked_softmax)
        return Built(
            {
                "attnscore": lambda: compiled(X, vl),
                "eager": lambda: attnscore.masked_softmax(X, vl),
            },
            same=("eager",),
            notes=[
                "attnscore = torch.compile(attnscore.masked_softmax); eager = the same "
                "function uncompiled (the C kernel's fast path)"
            ],
        )
    if case == "masked_softmax":
        return _cases.softmax(s, dtype=f32, device=cpu)
    if case.startswith("additive"):
        return _cases.additive(
            s,
            backward=case in BACKWARD,
            device=cpu,
            with_textbook=case != "additive_memory",
            compiled=case.endswith("compiled"),
        )
    return _cases.dot(
        s,
        dtype=f32,
        device=cpu,
        flex=False,
        backward=case in BACKWARD,
        with_textbook=case == "dot_no_grad",  # as before: fwd+bwd compares with SDPA only
    )


def cases(quick: bool) -> list[Case]:
    """The CPU case list at full or smoke-run shapes."""
    shapes = QUICK if quick else FULL
    return [
        Case(
            name,
            s,
            "float32",
            partial(build, name, s),
            TARGETS[name],
            backward=name in BACKWARD,
            timed=name != "additive_memory",
        )
        for name, s in shapes.items()
    ]


# ------------------------------------------------------------------ peak RSS, subprocesses
def child(case: str, quick: bool, impl: str) -> None:
    """Run one case once in this fresh process and print its peak RSS in MiB."""
    shapes = (QUICK if quick else FULL)[case]
    built = build(case, shapes)
    make_step(built.forwards[impl], built.grad_inputs.get(impl), case in BACKWARD)()
    print(peak_rss_mib())


def env(**extra: str) -> dict[str, str]:
    """Environment for subprocesses: import this very attnscore (not another install)."""
    import attnscore

    root = os.path.dirname(os.path.dirname(os.path.abspath(attnscore.__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def _last_float(stdout: str) -> float | None:
    try:
        value = float(stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return None
    return value if value == value else None


def peak_rss(case: str, quick: bool, impl: str, threads: int) -> float | None:
    """Peak RSS in MiB of a fresh process running ``impl`` of ``case`` once; None on failure."""
    cmd = [sys.executable, "-m", "attnscore.bench", "--child", case, impl]
    cmd += ["--threads", str(threads)] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env())
    return _last_float(proc.stdout)


def cold_compile_seconds() -> float | None:
    """First-call compile + load time of the C kernels, in a subprocess with an empty cache."""
    code = (
        "import time, torch; t = time.perf_counter(); from attnscore import kernels; "
        "ok = kernels.load_library() is not None; "
        "print(time.perf_counter() - t if ok else -1)"
    )
    with tempfile.TemporaryDirectory() as cache:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=env(ATTNSCORE_CACHE=cache),
            timeout=600,
        )
    seconds = _last_float(proc.stdout)
    return None if seconds is None or seconds < 0 else seconds
