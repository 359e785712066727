"""Turn the cell-by-cell table of a bench run, as `attnscore bench` printed it into
docs/benchmarks.md, back into the results `attnscore bench --json` writes.

The full CPU run the documentation reports was saved as its printed table only; this
recovers its JSON so that `attnscore bench --from-json FILE --plot FIG.png` redraws the
README's figure without measuring again. Usage:

    python tools/bench_table_to_json.py docs/benchmarks.md OUT.json --heading "The full matrix"

The values are the table's, at its printed precision (times in ms to 3 decimals or 1).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def _name(case: str, shapes: dict[str, int]) -> str:
    if case.endswith(" (issue)"):
        size = "tiny" if shapes.get("m", 10**6) <= 8 else "large"
        return f"{case[: -len(' (issue)')]} ({size})"
    return case


def _pairs(text: str) -> dict[str, float]:
    if text.strip() == "-":
        return {}
    return {k: float(v) for k, v in (part.rsplit(" ", 1) for part in text.split(", "))}


def _target(value: str, bound: str, met: str) -> dict[str, object]:
    verdict = {"yes": True, "**NO**": False, "n/a": None}[met.strip()]
    b = float(re.search(r"[\d.]+", bound).group())
    if m := re.fullmatch(r"mem ([\d.]+)x (\w+)", value):
        return {"kind": "peak", "vs": m[2], "value": float(m[1]), "bound": b, "met": verdict}
    if m := re.fullmatch(r"([\d.]+)x (\w+)", value):
        return {"kind": "time", "vs": m[2], "value": float(m[1]), "bound": b, "met": verdict}
    if m := re.fullmatch(r"([\d.]+) us", value):
        return {"kind": "us", "vs": None, "value": float(m[1]), "bound": b, "met": verdict}
    if m := re.fullmatch(r"peak RSS ([\d.]+) MiB", value):
        return {"kind": "rss_mib", "vs": None, "value": float(m[1]), "bound": b, "met": verdict}
    raise ValueError(f"unknown ratio {value!r}")


def convert(markdown: str, heading: str) -> list[dict[str, object]]:
    """The cells of the first table after the heading that starts with ``heading``."""
    section = markdown[markdown.index(f"## {heading}") :]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith("| row "):
            if rows and not line.startswith("|"):
                break
            continue
        case, mask, dtype, step, shapes, times, peaks, ratios, bounds, met = (
            c.strip() for c in line.strip("|").split(" | ")
        )
        shape = {k: int(v) for k, v in (p.split("=") for p in shapes.split())}
        memory = _pairs(peaks)
        rss = case == "additive_memory"
        rows.append(
            {
                "case": _name(case, shape),
                "mask": "" if mask == "-" else mask,
                "shapes": shape,
                "dtype": dtype,
                "step": step,
                "median_s": {k: v / 1e3 for k, v in _pairs(times).items()},
                "peak_mib": {} if rss else memory,
                "peak_rss_mib": memory if rss else {},
                "targets": [
                    _target(v, b, y)
                    for v, b, y in zip(
                        ratios.split("; "), bounds.split("; "), met.split("; "), strict=True
                    )
                ],
                "notes": [],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("markdown", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--heading", default="The full matrix")
    parser.add_argument("--device-name", default="x86_64 (AMD EPYC Zen 5, 2-core VM)")
    parser.add_argument("--commit", default="481b016")
    args = parser.parse_args()
    result = {
        "device": "cpu",
        "device_name": args.device_name,
        "quick": False,
        "torch": "2.13.0+cpu",
        "threads": 2,
        "memory": True,
        "commit": args.commit,
        "notes": ["recovered from the printed table by tools/bench_table_to_json.py"],
        "rows": convert(args.markdown.read_text(), args.heading),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
