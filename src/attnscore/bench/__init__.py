"""``attnscore bench``: attnscore against the PyTorch call a user would write instead, side
by side, over the matrix of real use.

The cells and their targets are :mod:`attnscore.bench.matrix`'s, the implementations
:mod:`attnscore.bench._cases`'s; :mod:`attnscore.bench._core` times them in one process
(interleaved rounds, median) and reads their peak memory. The full run prints each target's
verdict and exits 1 if one is missed; ``--quick`` is a smoke run at small shapes: no verdicts
(the targets are for the full shapes), but it lists the cells slower than their PyTorch
baseline. The command line is :mod:`attnscore.cli.bench`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from .._memory import keep_freed_memory
from . import _core, cpu, matrix
from ._core import describe, measure, missed, ratio_text, render_rows, render_summary, slower
from .load import LoadWatch, load_average

__all__ = ["case_names", "check_cases", "missed", "render", "run"]

MIN_RUN_TIME = {
    (device, quick): 0.05 if quick else 0.5 for device in ("cpu", "cuda") for quick in (True, False)
}
"""Timed seconds per implementation and cell (over all rounds), by (device type, quick)."""

SMOKE_NOTE = (
    "Smoke run (--quick): small shapes, not the targets' shapes, so no target verdicts "
    "(cells slower than their PyTorch baseline are listed below the table); run "
    "`attnscore bench` without --quick to check the targets."
)


def run(
    *,
    device: str = "cpu",
    quick: bool = False,
    memory: bool = True,
    threads: int = 2,
    cases: Sequence[str] | None = None,
    progress: bool = False,
    min_time: float | None = None,
) -> dict[str, Any]:
    """Run the bench rows on ``device`` and return the results (what ``--json`` writes).

    Args:
        device: ``"cpu"`` or a CUDA device (``"cuda"``, ``"cuda:1"``).
        quick: smoke run: small shapes, short timings, no verdicts (``met`` is None).
        memory: measure peak memory (what a step allocates; additive_memory: peak RSS of a
            subprocess).
        threads: torch threads.
        cases: run only the rows of these names.
        progress: print one line per cell to stderr as it is measured.
        min_time: seconds of timing per implementation and cell (default: 0.5 in a full
            run, 0.05 in a quick one); the rounds split it.

    Where the 1-minute load average exceeds the number of cores before the run or after a
    cell, one warning line goes to stderr and ``result["load"]["busy"]`` is true.

    Raises:
        ValueError: a name in ``cases`` that is not a row of ``device``.
    """
    dev = torch.device(device)
    torch.set_num_threads(threads)
    # Freed blocks stay in the heap: otherwise whether a call's buffers happen to fault in
    # fresh pages decides its time, on both sides.
    result_notes = ["malloc keeps freed memory"] if keep_freed_memory() else []
    check_cases(dev.type, cases)
    result: dict[str, Any] = {
        "device": dev.type,
        "device_name": describe(dev),
        "cpu": _core.processor(),
        **({"gpu": torch.cuda.get_device_name(dev)} if dev.type == "cuda" else {}),
        "quick": quick,
        "torch": torch.__version__,
        "threads": threads,
        "memory": memory,
        "notes": result_notes,
    }
    if dev.type == "cpu":
        from .. import kernels

        start = time.perf_counter()
        kernels.load_library()
        result["kernel_first_load_s"] = time.perf_counter() - start
        result["kernel_build"] = kernels.build_info().as_dict()
        result["kernel_cold_compile_s"] = cpu.cold_compile_seconds()
        result["kernels_enabled"] = kernels.enabled()
    watch = LoadWatch()
    if watch.see(load_average()):
        print(watch.warning(), file=sys.stderr, flush=True)
    todo = [c for c in matrix.cases(dev.type, quick) if not cases or c.name in cases]
    if min_time is None:
        min_time = MIN_RUN_TIME[dev.type, quick]
    result["min_time_s"] = min_time
    rows = []
    started = time.perf_counter()
    for i, case in enumerate(todo, 1):
        rss: dict[str, float | None] = {}
        if memory and any(t.kind == "rss_mib" for t in case.targets):
            rss = {"attnscore": cpu.peak_rss(case.name, quick, "attnscore", threads)}
        row = measure(
            case,
            dev,
            threads=threads,
            min_time=min_time,
            judge=not quick,
            memory=memory and not case.name.endswith("compiled"),
            rss=rss,
        )
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        if watch.see(load_average()):
            print(watch.warning(), file=sys.stderr, flush=True)
        if progress:
            ratios = "; ".join(ratio_text(c) for c in row["targets"])
            print(
                f"[{i}/{len(todo)}, {time.perf_counter() - started:.0f} s] {case.name} | "
                f"{case.mask or '-'} | {case.dtype} | {row['step']}: {ratios}",
                file=sys.stderr,
                flush=True,
            )
    result["rows"] = rows
    result["load"] = watch.as_dict()
    return result


def case_names(device_type: str) -> list[str]:
    """The row names of the CPU or the CUDA run (for ``--cases``)."""
    return list(dict.fromkeys(c.name for c in matrix.cases(device_type, quick=False)))


def check_cases(device_type: str, cases: Sequence[str] | None) -> None:
    """Raise ValueError naming the names in ``cases`` that are no row of the device's run."""
    names = case_names(device_type)
    unknown = sorted(set(cases or ()) - set(names))
    if unknown:
        raise ValueError(
            f"Expected names among {names} for {device_type}, but got {unknown} instead"
        )


def render(result: dict[str, Any]) -> str:
    """The results as a Markdown table with a heading line and notes."""
    quick = result["quick"]
    load = result.get("load") or {}
    at_most = load.get("max_load_1min")
    seen = "" if at_most is None else f", load average up to {at_most:.1f} on {load['cores']} cores"
    lines = [
        f"attnscore bench on {result['device_name']}, {result['threads']} CPU threads{seen}",
        *([SMOKE_NOTE] if quick else []),
        "",
        *render_summary(result["rows"]),
        "",
        *render_rows(result["rows"], verdicts=not quick),
    ]
    if result["device"] == "cpu" and "kernel_first_load_s" in result:  # not in old saved runs
        cold = result.get("kernel_cold_compile_s")
        lines += [
            "",
            f"C kernels: first load in this process {result['kernel_first_load_s']:.2f} s "
            f"(compiled now: {result['kernel_build']['compiled']}, enabled: "
            f"{result['kernels_enabled']}); cold compile + load with an empty cache: "
            f"{'n/a' if cold is None else f'{cold:.2f} s'}. Peak MiB: "
            + (
                "what one step allocates above what was allocated before it (the "
                "allocations and frees torch.profiler records); additive_memory: VmHWM of a "
                "fresh process (torch included); not measured for the compiled rows."
                if result["memory"]
                else "not measured (--no-memory)."
            ),
        ]
    elif result["device"] != "cpu":
        lines += [
            "",
            "Peak MiB: torch.cuda.max_memory_allocated during one step, above what was "
            "allocated before it (inputs and parameters), reset per case and implementation.",
        ]
    if load.get("busy"):
        lines += [
            "",
            f"**Busy machine**: the load average reached {load['max_load_1min']:.1f} on "
            f"{load['cores']} cores during this run, so its timings are slower and noisier than "
            "on an idle machine; rerun when it is idle before reading the ratios.",
        ]
    if "malloc keeps freed memory" in result.get("notes", ()):
        lines += [
            "",
            "Allocator: glibc keeps freed blocks of up to 32 MiB for reuse (mallopt), for every "
            "implementation alike, so no timing below that depends on faulting in fresh pages. "
            "Larger blocks (the float32 (32, 256, 1024) tensors of masked_softmax, decode's KV "
            "caches at m = 4096) are fresh pages on every call, whose cost varies between runs; "
            "the C kernels hint huge pages for large outputs.",
        ]
    notes = sorted({note for row in result["rows"] for note in row["notes"]})
    lines += ["", *(f"- {note}" for note in notes)] if notes else []
    if quick:
        slow = slower(result)
        busy = " (on a busy machine: see above)" if load.get("busy") else ""
        lines += ["", f"Cells slower than their PyTorch baseline (> 1.05x){busy}: {len(slow)}"]
        lines += [f"- {cell}" for cell in slow]
    return "\n".join(lines)
