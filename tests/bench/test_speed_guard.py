"""A coarse speed guard for CI: attnscore against the PyTorch call a user would write
instead, timed in this one process at shapes that take about a second a cell; a cell fails
at 2x its baseline.

What it catches: a 3-9x regression that no unit test sees (a copy or a scan of the inputs on
every call, a fall back to the plain formulation). What it is not: ``attnscore bench``, whose
targets sit near 1x and need an idle machine. The cells are the bench's own builders
(:mod:`attnscore.bench._cases`). Each cell times both sides in :data:`ROUNDS` interleaved
rounds (the order alternates); a side's time in a round is its fastest call (a call the
scheduler preempted drops out), and the verdict is the median of the per-round ratios, so a
drift of the machine's speed or a neighbour taking a core hits both sides alike. It times
on one thread (on a shared core a second thread waits at every barrier, and the waits
differ between the sides) and without the coverage tracer (CI measures coverage; tracing
slows attnscore's Python lines, which one SDPA call lacks).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from attnscore.bench import _cases
from attnscore.bench._core import make_step

LIMIT = 2.0
"""A cell fails when attnscore's median per-round ratio to its baseline reaches this."""
ROUNDS = 7
CALLS = 9
SIDE_S = 0.01
"""Each side's calls in a round: as many as fill this many seconds of the baseline's, at
least :data:`CALLS`; its time in the round is the fastest call's."""

CELLS = {
    # name: (builder row, shapes, mask, forward + backward); float32, against SDPA
    "decode": ("heads", {"B": 4, "H": 8, "n": 1, "m": 2048, "d": 64}, _cases.CACHE, False),
    "decode_no_mask": ("heads", {"B": 4, "H": 8, "n": 1, "m": 2048, "d": 64}, "none", False),
    "dense": ("heads", {"B": 2, "H": 4, "n": 256, "m": 256, "d": 64}, "none", False),
    "causal": ("heads", {"B": 2, "H": 4, "n": 256, "m": 256, "d": 64}, "causal", False),
    "mid": ("dot", {"B": 2, "n": 64, "m": 64, "d": 32}, "lengths (B,)", True),
    # every length m: nothing padded (against SDPA with the all-True mask a user builds)
    "uncut": ("heads", {"B": 2, "H": 4, "n": 64, "m": 64, "d": 32}, _cases.UNCUT, False),
}


@contextlib.contextmanager
def _quiet_machine() -> Iterator[None]:
    """One torch thread, no garbage collection, no ``sys.settrace`` tracer (coverage's)."""
    threads, tracer = torch.get_num_threads(), sys.gettrace()
    torch.set_num_threads(1)
    sys.settrace(None)
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        sys.settrace(tracer)
        torch.set_num_threads(threads)


def _fastest(step: Callable[[], Any], calls: int) -> float:
    """The fastest of ``calls`` calls: on a loaded machine most calls lose the core for a
    while, not all of them."""
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def ratios(ours: Callable[[], Any], theirs: Callable[[], Any]) -> list[float]:
    """``ours``' time over ``theirs``' in each of :data:`ROUNDS` interleaved rounds."""
    with _quiet_machine():
        for _ in range(3):  # warm-up: first calls load kernels and fill caches
            ours(), theirs()
        calls = max(CALLS, round(SIDE_S / _fastest(theirs, 5)))
        out = []
        for r in range(ROUNDS):
            sides = (ours, theirs) if r % 2 == 0 else (theirs, ours)
            best = {side: _fastest(side, calls) for side in sides}
            out.append(best[ours] / best[theirs])
    return out


def _steps(cell: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    row, shapes, mask, backward = CELLS[cell]
    built = _cases.BUILDERS[row](
        shapes, mask, dtype=torch.float32, device=torch.device("cpu"), backward=backward
    )
    ours, theirs = (
        make_step(built.forwards[name], built.grad_inputs.get(name), backward)
        for name in ("attnscore", "sdpa")
    )
    return ours, theirs


@pytest.mark.parametrize("cell", list(CELLS))
def test_attnscore_within_2x_of_sdpa(cell):
    per_round = ratios(*_steps(cell))
    median = statistics.median(per_round)
    print(f"speed guard {cell}: {median:.2f}x sdpa (rounds: {per_round})")
    assert median < LIMIT, (
        f"Expected attnscore within {LIMIT}x SDPA on the {cell} cell {CELLS[cell]}, but got "
        f"{median:.2f}x instead (per round: {', '.join(f'{r:.2f}' for r in per_round)})"
    )


def test_the_guard_sees_a_3x_regression():
    """The same call made three times where once would do reads as about 3x: over the
    limit, on the cheapest cell."""
    _, theirs = _steps("mid")

    def three_times() -> Any:
        return [theirs() for _ in range(3)][-1]

    assert statistics.median(ratios(three_times, theirs)) > LIMIT
