"""Old code against new on every cell of ``attnscore bench``, in one process: each cell's
attnscore call of the old tree and of the new one, timed in interleaved rounds (the bench's
own timing loop), with the peak memory of each.

The old tree's package is imported as ``attnscore_old`` (``ab_compare.renamed_copy``), so
that both are importable at once; the cells are paired by row, mask, dtype and step (a cell
only one of them has is listed as such). ``new/old`` is the median of the per-round ratios.

    git worktree add /tmp/old 5a777dd
    python tools/ab_bench.py /tmp/old/src src [--quick] [--rows dot cosine ...] [--json F]

Prints one line per cell and, last, the cells slower than ``--limit`` (default 1.05x): what
"no cell slower than before by more than 5%" asks. A cell above it is measured again for
four times as long, and that measurement is the one reported (with the first's ratio);
each side's peak memory is the least of three steps' (the profiler's reading of one step
varies by whole allocator blocks). Rows that compile (minutes each) and the
RSS and Hugging Face rows are left out unless named in ``--rows``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_compare import renamed_copy

SLOW_ROWS = ("additive_compiled", "masked_softmax_compiled", "additive_memory", "hf_llama")


def _key(case: Any) -> tuple[str, str, str, bool]:
    return (case.name, case.mask, case.dtype, case.backward)


def _cell(pair: dict[str, Any], *, threads: int, min_time: float) -> dict[str, Any]:
    """Time the attnscore call of each package's case side by side; peak memory of each."""
    import torch

    core = importlib.import_module("attnscore.bench._core")
    device = torch.device("cpu")
    steps: dict[str, Any] = {}
    peaks: dict[str, float] = {}
    residents: dict[str, float] = {}
    for tag, case in pair.items():
        built = case.build()
        ours = "attnscore_old" if "attnscore_old" in built.forwards else "attnscore"  # (renamed)
        step = core.make_step(built.forwards[ours], built.grad_inputs.get(ours), case.backward)
        step()
        residents[tag] = core.resident_mib(built.grad_inputs.get(ours, ()))
        peaks[tag] = residents[tag] + core.peak_mib(step, device)
        steps[tag] = step
    for _ in range(2):  # (the profiler's peak of one step varies by whole blocks: the least)
        for tag, step in steps.items():
            peaks[tag] = min(peaks[tag], residents[tag] + core.peak_mib(step, device))
    samples = core._time(steps, threads, min_time, device)
    ratios = [n / o for o, n in zip(samples["old"], samples["new"], strict=True)]
    return {
        "old_ms": statistics.median(samples["old"]) * 1e3,
        "new_ms": statistics.median(samples["new"]) * 1e3,
        "time": statistics.median(ratios),
        "peak": peaks["new"] / peaks["old"] if peaks["old"] else 1.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="the old tree's src folder")
    parser.add_argument("new", help="the new tree's src folder")
    parser.add_argument("--quick", action="store_true", help="the bench's smoke shapes")
    parser.add_argument("--rows", nargs="*", default=[], help="only these rows (bench names)")
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds per side and cell")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit", type=float, default=1.05, help="new/old above it is listed")
    parser.add_argument("--json", help="write the cells here")
    args = parser.parse_args(argv)
    into = tempfile.mkdtemp(prefix="ab-bench-old-")
    try:
        renamed_copy(os.path.abspath(args.old), into)
        sys.path[:0] = [os.path.abspath(args.new), into]
        import torch

        torch.set_num_threads(args.threads)
        cases = {}
        for tag, pkg in (("old", "attnscore_old"), ("new", "attnscore")):
            matrix = importlib.import_module(f"{pkg}.bench.matrix")
            cases[tag] = {_key(c): c for c in matrix.cases("cpu", args.quick)}
        rows: list[dict[str, Any]] = []
        for key, case in cases["new"].items():
            name = key[0]
            if args.rows and not any(name == r or name.startswith(f"{r} (") for r in args.rows):
                continue
            if not args.rows and name in SLOW_ROWS:
                continue
            label = f"{name} | {key[1]} | {key[2]} | {'fwd+bwd' if key[3] else 'fwd'}"
            if key not in cases["old"]:
                print(f"{label}: new only", flush=True)
                continue
            pair = {"old": cases["old"][key], "new": case}
            cell = _cell(pair, threads=args.threads, min_time=args.min_time)
            if cell["time"] > args.limit:  # measured again, longer: what the verdict reads
                first = cell["time"]
                cell = _cell(pair, threads=args.threads, min_time=4 * args.min_time)
                cell["first_time"] = first
            cell["cell"] = label
            rows.append(cell)
            again = f" (first {cell['first_time']:.3f}x)" if "first_time" in cell else ""
            print(
                f"{label}: {cell['old_ms']:.4f} -> {cell['new_ms']:.4f} ms, "
                f"time {cell['time']:.3f}x{again}, peak {cell['peak']:.3f}x",
                flush=True,
            )
    finally:
        shutil.rmtree(into, ignore_errors=True)
    slower = [r for r in rows if r["time"] > args.limit]
    print(f"\n{len(rows)} cells; {len(slower)} with new/old time above {args.limit}x:")
    for r in slower:
        print(f"  {r['cell']}: {r['time']:.3f}x ({r['old_ms']:.4f} -> {r['new_ms']:.4f} ms)")
    more_memory = [r for r in rows if r["peak"] > args.limit]
    print(f"{len(more_memory)} with new/old peak memory above {args.limit}x:")
    for r in more_memory:
        print(f"  {r['cell']}: {r['peak']:.3f}x")
    if args.json:
        with open(args.json, "x", encoding="utf-8") as f:
            json.dump({"torch": torch.__version__, "threads": args.threads, "cells": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
