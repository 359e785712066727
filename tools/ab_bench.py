"""Old code against new on every cell of ``attnscore bench``, in one process: each cell's
attnscore call of the old tree and of the new one, timed in interleaved rounds (the bench's
own timing loop), with the peak memory of each.

The old tree's package is imported as ``attnscore_old`` (``ab_compare.renamed_copy``), so
that both are importable at once; the cells are paired by row, mask, dtype and step (a cell
only one of them has is listed as such). ``new/old`` is the median of the per-round ratios.

    git worktree add /tmp/old 5a777dd
    python tools/ab_bench.py /tmp/old/src src [--quick] [--rows dot cosine ...] [--targets]
        [--json F]

Prints one line per cell and, last, the cells slower than ``--limit`` (default 1.05x): what
"no cell slower than before by more than 5%" asks. A cell above it is measured again for
four times as long, and that measurement is the one reported (with the first's ratio);
each side's peak memory is the least of three steps' (the profiler's reading of one step
varies by whole allocator blocks). Rows that compile (minutes each) and the RSS and
Hugging Face rows are left out unless named in ``--rows``.

With ``--targets`` the cell's PyTorch baselines run in the same rounds, and each side's
verdict on each of the bench's targets comes from those rounds (the bench's own check): what
"every bench target still met" asks, free of the baselines' drift between processes. A cell
with a target that the old code meets and the new one misses is measured again, four times
as long, and the targets are counted last by both sides' verdicts.
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
from functools import partial
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_compare import renamed_copy

SLOW_ROWS = ("additive_compiled", "masked_softmax_compiled", "additive_memory", "hf_llama")


def _key(case: Any) -> tuple[str, str, str, bool]:
    return (case.name, case.mask, case.dtype, case.backward)


def _cell(
    pair: dict[str, Any], *, threads: int, min_time: float, targets: bool = False
) -> dict[str, Any]:
    """Time the attnscore call of each package's case side by side; peak memory of each.
    With ``targets``, the new case's baselines too, and both sides' verdicts on its targets
    (``verdicts``: one ``{kind, vs, bound, old, new, old_met, new_met}`` per target)."""
    import torch

    core = importlib.import_module("attnscore.bench._core")
    device = torch.device("cpu")
    steps: dict[str, Any] = {}
    peaks: dict[str, float] = {}
    residents: dict[str, float] = {}
    for tag, case in pair.items():
        built = case.build()
        ours = "attnscore_old" if "attnscore_old" in built.forwards else "attnscore"  # (renamed)
        names = {tag: ours}
        if targets and tag == "new":  # the baselines, once: from the new tree's case
            names |= {t.vs: t.vs for t in case.targets if t.vs in built.forwards}
        for name, fwd in names.items():
            grads = built.grad_inputs.get(fwd)
            step = core.make_step(built.forwards[fwd], grads, case.backward)
            step()
            residents[name] = core.resident_mib(grads or ())
            peaks[name] = residents[name] + core.peak_mib(step, device)
            steps[name] = step
    for _ in range(2):  # (the profiler's peak of one step varies by whole blocks: the least)
        for name, step in steps.items():
            peaks[name] = min(peaks[name], residents[name] + core.peak_mib(step, device))
    samples = core._time(steps, threads, min_time, device)
    ratios = [n / o for o, n in zip(samples["old"], samples["new"], strict=True)]
    cell: dict[str, Any] = {
        "old_ms": statistics.median(samples["old"]) * 1e3,
        "new_ms": statistics.median(samples["new"]) * 1e3,
        "time": statistics.median(ratios),
        "peak": peaks["new"] / peaks["old"] if peaks["old"] else 1.0,
    }
    if targets:
        cell["verdicts"] = [_verdict(core, t, samples, peaks) for t in pair["new"].targets]
    return cell


def _verdict(core: Any, target: Any, samples: dict, peaks: dict) -> dict[str, Any]:
    """Each side's value and verdict on ``target``, by the bench's own check, from the
    same rounds (each side's samples paired with the baseline's of the same rounds)."""
    out: dict[str, Any] = {"kind": target.kind, "vs": target.vs, "bound": target.bound}
    base = {k: v for k, v in samples.items() if k not in ("old", "new")}
    base_peaks = {k: v for k, v in peaks.items() if k not in ("old", "new")}
    for tag in ("old", "new"):
        checked = core._check(
            target, base | {"attnscore": samples[tag]}, base_peaks | {"attnscore": peaks[tag]},
            {}, True,
        )  # fmt: skip
        out[tag], out[f"{tag}_met"] = checked["value"], checked["met"]
    return out


def _lost(cell: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets the old code meets and the new one misses."""
    return [v for v in cell.get("verdicts", ()) if v["old_met"] and v["new_met"] is False]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="the old tree's src folder")
    parser.add_argument("new", help="the new tree's src folder")
    parser.add_argument("--quick", action="store_true", help="the bench's smoke shapes")
    parser.add_argument("--rows", nargs="*", default=[], help="only these rows (bench names)")
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds per side and cell")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit", type=float, default=1.05, help="new/old above it is listed")
    parser.add_argument(
        "--targets", action="store_true", help="also each side's verdicts on the bench targets"
    )
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
            measure = partial(_cell, pair, threads=args.threads, targets=args.targets)
            cell = measure(min_time=args.min_time)
            if cell["time"] > args.limit or _lost(cell):  # again, longer: what is reported
                first = cell
                cell = measure(min_time=4 * args.min_time)
                cell["first_time"] = first["time"]
                cell["first_lost"] = [_target_text(v) for v in _lost(first)]
            cell["cell"] = label
            rows.append(cell)
            again = f" (first {cell['first_time']:.3f}x)" if "first_time" in cell else ""
            verdicts = "".join(
                f"; {_target_text(v)}: old {_met(v['old_met'])}, new {_met(v['new_met'])}"
                for v in cell.get("verdicts", ())
            )
            print(
                f"{label}: {cell['old_ms']:.4f} -> {cell['new_ms']:.4f} ms, "
                f"time {cell['time']:.3f}x{again}, peak {cell['peak']:.3f}x{verdicts}",
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
    if args.targets:
        _summarize_targets(rows)
    if args.json:
        with open(args.json, "x", encoding="utf-8") as f:
            json.dump({"torch": torch.__version__, "threads": args.threads, "cells": rows}, f)
    return 0


def _met(met: bool | None) -> str:
    return "-" if met is None else "met" if met else "missed"


def _target_text(v: dict[str, Any]) -> str:
    vs = f" {v['vs']}" if v["vs"] else ""
    return f"{v['kind']} <= {v['bound']:g}{vs}"


def _value(v: dict[str, Any], tag: str) -> str:
    return "-" if v[tag] is None else f"{v[tag]:.3f}"


def _summarize_targets(rows: list[dict[str, Any]]) -> None:
    """Counts of the targets by both sides' verdicts; the lost ones (old met, new missed)
    and those both miss, each with both sides' values."""
    both = [(r, v) for r in rows for v in r.get("verdicts", ())]
    judged = [(r, v) for r, v in both if v["old_met"] is not None]
    lost = [(r, v) for r, v in judged if v["old_met"] and not v["new_met"]]
    gained = [(r, v) for r, v in judged if v["new_met"] and not v["old_met"]]
    missed = [(r, v) for r, v in judged if not v["old_met"] and not v["new_met"]]
    print(
        f"\n{len(judged)} targets judged: {len(judged) - len(lost) - len(gained) - len(missed)} "
        f"met by both, {len(lost)} met by old only, {len(gained)} by new only, {len(missed)} "
        "by neither"
    )
    for title, group in (("met by old only", lost), ("met by new only", gained),
                         ("met by neither", missed)):  # fmt: skip
        if group:
            print(f"{title}:")
        for r, v in group:
            values = f"old {_value(v, 'old')}, new {_value(v, 'new')}"
            print(f"  {r['cell']}: {_target_text(v)}, {values}")


if __name__ == "__main__":
    sys.exit(main())
