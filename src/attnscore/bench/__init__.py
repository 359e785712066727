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

The subcommand joins the ``attnscore`` parser through :func:`add_parser`;
``python -m attnscore.bench`` runs :func:`main`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .._io import check_output, device_arg, write_atomic
from .._usage import ArgumentParser, UsageError
from . import cpu, cuda
from ._core import measure, missed, render_rows

__all__ = ["add_parser", "main", "render", "run"]

MIN_RUN_TIME = {("cpu", True): 0.1, ("cpu", False): 1.5, ("cuda", True): 0.2, ("cuda", False): 1.0}
"""``blocked_autorange`` seconds per implementation, by (device type, quick)."""

DESCRIPTION = """\
Time attnscore against the textbook code and PyTorch, side by side in one process
(torch.utils.benchmark medians; valid lengths uniform in [1, m], fixed seed).

  --device cpu    the CPU rows, eager and under torch.compile; peak RSS per case
  --device cuda   the CUDA rows: fp32/bf16 vs SDPA + mask, flex_attention,
                  nn.MultiheadAttention and the textbook; peak CUDA memory

The full run prints each target's verdict and exits 1 on a miss. --quick is a
smoke run at small shapes, with no verdicts."""

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
        UsageError: a name in ``cases`` that is not a row of ``device``.
    """
    dev = torch.device(device)
    torch.set_num_threads(threads)
    names = case_names(dev.type)
    unknown = sorted(set(cases or ()) - set(names))
    if unknown:
        raise UsageError(
            f"--cases: expected names among {names} for {dev.type}, but got {unknown} instead"
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


def _threads(value: str) -> int:
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if threads < 1:
        raise UsageError(f"--threads: expected a positive integer, but got {value!r}")
    return threads


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: small shapes, no target verdicts"
    )
    parser.add_argument(
        "--device",
        type=device_arg,
        default="cpu",
        help="cpu (default) or cuda[:N]: the CUDA rows (SDPA, flex, nn.MultiheadAttention)",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results here")
    parser.add_argument("--threads", type=_threads, default=2, help="torch threads (default 2)")
    parser.add_argument("--no-memory", action="store_true", help="skip peak-memory measurement")
    parser.add_argument("--cases", nargs="+", metavar="CASE", help="run only these rows")
    parser.add_argument("--child", nargs=2, metavar=("CASE", "IMPL"), help=argparse.SUPPRESS)


def handle(args: argparse.Namespace) -> int:
    """Run ``attnscore bench`` for parsed arguments; the exit code (1 on a missed target)."""
    if args.child:
        torch.set_num_threads(args.threads)
        cpu.child(args.child[0], args.quick, args.child[1])
        return 0
    if args.json is not None:
        check_output(args.json, "--json", (".json",))
    result = run(
        device=args.device,
        quick=args.quick,
        memory=not args.no_memory,
        threads=args.threads,
        cases=args.cases,
    )
    print(render(result))
    if args.json is not None:
        text = json.dumps(result, indent=2).encode()
        write_atomic(args.json, lambda f: f.write(text), "--json")
    misses = missed(result)
    if misses:
        print(f"\n{len(misses)} target(s) missed: " + "; ".join(misses), file=sys.stderr)
        return 1
    return 0


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``bench`` subcommand to the ``attnscore`` parser's ``subparsers``.

    The subcommand's defaults carry ``handler``, a function ``(args) -> int`` giving the
    exit code. Bad options raise :class:`~attnscore._usage.UsageError` when the parent is
    an :class:`attnscore._usage.ArgumentParser`.
    """
    parser = subparsers.add_parser(
        "bench",
        help="time attnscore against the textbook code and PyTorch",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    parser.set_defaults(handler=handle)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m attnscore.bench [options]``: the same as ``attnscore bench [options]``.

    Returns the exit code: 0, 1 when the full run misses a target, 2 on bad input (one
    line on stderr).
    """
    parser = ArgumentParser(
        prog="attnscore bench",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
        return handle(args)
    except UsageError as err:
        print(f"attnscore bench: error: {err}", file=sys.stderr)
        return 2
