"""``attnscore bench``: attnscore against the textbook code and PyTorch, side by side.

Every row is timed in one process with ``torch.utils.benchmark`` (median of
``blocked_autorange``); valid lengths are uniform in [1, m] from a fixed seed; "textbook"
is the book's code from :mod:`attnscore.textbook`.

- ``--device cpu`` (default): the CPU rows (:mod:`attnscore.bench.cpu`), eager and under
  ``torch.compile``; peak memory is the peak RSS of a fresh subprocess per case.
- ``--device cuda``: the CUDA rows of issue 10 (:mod:`attnscore.bench.cuda`), fp32 and
  bf16, against SDPA, flex_attention and ``nn.MultiheadAttention``; peak memory from
  ``torch.cuda.max_memory_allocated``, reset per case.

The full run prints each target's verdict and exits 1 if one is missed. ``--quick`` is a
smoke run at small shapes: it says so and prints no verdicts, since the targets are for
the full shapes.

The command line (``attnscore bench``, ``python -m attnscore.bench``) is
:mod:`attnscore.cli.bench`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from . import cpu, cuda
from ._core import measure, missed, render_rows

__all__ = ["case_names", "missed", "render", "run"]

MIN_RUN_TIME = {("cpu", True): 0.1, ("cpu", False): 1.5, ("cuda", True): 0.2, ("cuda", False): 1.0}
"""``blocked_autorange`` seconds per implementation, by (device type, quick)."""

SMOKE_NOTE = (
    "Smoke run (--quick): small shapes, not the targets' shapes, so no target verdicts; "
    "run `attnscore bench` without --quick to check the targets."
)


def run(
    *,
    device: str = "cpu",
    quick: bool = False,
    memory: bool = True,
    threads: int = 2,
    cases: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Run the bench rows on ``device`` and return the results (what ``--json`` writes).

    Args:
        device: ``"cpu"`` or a CUDA device (``"cuda"``, ``"cuda:1"``).
        quick: smoke run: small shapes, short timings, no verdicts (``met`` is None).
        memory: measure peak memory (CPU: one subprocess per case and implementation).
        threads: torch threads.
        cases: run only the rows of these names.

    Raises:
        ValueError: a name in ``cases`` that is not a row of ``device``.
    """
    dev = torch.device(device)
    torch.set_num_threads(threads)
    names = case_names(dev.type)
    unknown = sorted(set(cases or ()) - set(names))
    if unknown:
        raise ValueError(
            f"Expected `cases` among {names} for {dev.type}, but got {unknown} instead"
        )
    result: dict[str, Any] = {
        "device": dev.type,
        "device_name": cuda.describe(dev),
        "quick": quick,
        "torch": torch.__version__,
        "threads": threads,
        "memory": memory,
    }
    if dev.type == "cuda":
        todo = cuda.cases(dev, 1 / 8 if quick else 1.0)
    else:
        from .. import kernels

        start = time.perf_counter()
        kernels.load_library()
        result["kernel_first_load_s"] = time.perf_counter() - start
        result["kernel_build"] = kernels.build_info().as_dict()
        result["kernel_cold_compile_s"] = cpu.cold_compile_seconds()
        result["kernels_enabled"] = kernels.enabled()
        todo = cpu.cases(quick)
    min_time = MIN_RUN_TIME[dev.type, quick]
    rows = []
    for case in todo:
        if cases and case.name not in cases:
            continue
        rss: dict[str, float | None] = {}
        if memory and dev.type == "cpu" and not case.name.endswith("compiled"):
            # --quick measures only attnscore's memory, to stay well under a minute.
            impls = ["attnscore"] if quick else list(case.build().forwards)
            rss = {name: cpu.peak_rss(case.name, quick, name, threads) for name in impls}
        row = measure(case, dev, threads=threads, min_time=min_time, judge=not quick, rss=rss)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
    result["rows"] = rows
    return result


def case_names(device_type: str) -> list[str]:
    """The row names of the CPU or the CUDA run (for ``--cases``)."""
    if device_type == "cuda":
        return list(dict.fromkeys(c.name for c in cuda.cases(torch.device("cpu"), 1 / 1024)))
    return list(cpu.FULL)


def render(result: dict[str, Any]) -> str:
    """The results as a Markdown table with a heading line and notes."""
    quick = result["quick"]
    lines = [
        f"attnscore bench on {result['device_name']}, {result['threads']} CPU threads",
        *([SMOKE_NOTE] if quick else []),
        "",
        *render_rows(result["rows"], verdicts=not quick),
    ]
    if result["device"] == "cpu":
        cold = result.get("kernel_cold_compile_s")
        lines += [
            "",
            f"C kernels: first load in this process {result['kernel_first_load_s']:.2f} s "
            f"(compiled now: {result['kernel_build']['compiled']}, enabled: "
            f"{result['kernels_enabled']}); cold compile + load with an empty cache: "
            f"{'n/a' if cold is None else f'{cold:.2f} s'}. Peak MiB: "
            + (
                "VmHWM of a fresh subprocess per case (whole process, torch included); "
                "not measured for the compiled rows."
                if result["memory"]
                else "not measured (--no-memory)."
            ),
        ]
        if quick:
            lines.append(
                "additive_fwd_bwd_compiled is not in the smoke run (compiling the textbook "
                "module alone takes about 20 s here)."
            )
    else:
        lines += [
            "",
            "Peak MiB: torch.cuda.max_memory_allocated during one step, above what was "
            "allocated before it (inputs and parameters), reset per case and implementation.",
        ]
    return "\n".join(lines)
