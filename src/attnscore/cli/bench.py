"""``attnscore bench``: the command line of :mod:`attnscore.bench`.

:func:`add_parser` adds the command to the ``attnscore`` tree; :func:`main` is ``python -m
attnscore.bench`` (what each peak-RSS subprocess runs, with the hidden ``--child CASE
IMPL``). The measuring is :func:`attnscore.bench.run`; this module checks the options,
prints :func:`attnscore.bench.render`, writes ``--json`` and gives the exit code.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import bench
from ._files import FIGURE_FORMATS, check_output, save_figure, write_atomic
from ._usage import ArgumentParser, UsageError, add_overwrite, argument_type, device_arg, run_main

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["add_parser", "handle", "main"]

DESCRIPTION = """\
Time attnscore against the PyTorch call a user would write instead (SDPA,
nn.MultiheadAttention, torch.softmax, the plain formulation), side by side in
one process, over rows x masks x dtypes x {forward, forward+backward}, with the
peak memory of each; then large, tiny and mid-size calls, what users run
(decode: one query against a KV cache; long_causal; serving), a decoder step.

  --device cpu    the CPU run (about 12 minutes on 2 idle cores)
  --device cuda   the same cells on a GPU, at larger shapes
  --quick         a smoke run at small shapes (about 1 minute): no verdicts, but
                  it lists the cells slower than PyTorch
  --plot FILE     draw each cell's time ratio (png, pdf or svg)
  --from-json F   render and plot a saved run (--json) instead of measuring

The full run prints each target's verdict and exits 1 on a miss. Each ratio is
the median of per-round ratios (both sides timed back to back in each round).
A load average above the core count (by half a core), before or during the run,
gives a warning on stderr and "busy" in the JSON: timings on a busy machine are
not comparable with an idle one's."""
_PARSER: dict[str, Any] = {
    "description": DESCRIPTION,
    "formatter_class": argparse.RawDescriptionHelpFormatter,
}

_threads = argument_type(int, lambda v: v >= 1, "a positive integer", "--threads")
_seconds = argument_type(
    float, lambda v: 0 < v < float("inf"), "a positive number of seconds", "--min-time"
)


def _add_arguments(parser: ArgumentParser) -> ArgumentParser:
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: small shapes, no target verdicts"
    )
    parser.add_argument(
        "--device",
        type=device_arg,
        default="cpu",
        help="cpu (default) or cuda[:N]: the same cells on a GPU",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results here")
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="FILE",
        help="also draw each cell's time ratio, log scale, by row and step (.png, .pdf, .svg)",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        metavar="FILE",
        help="measure nothing: print the table of a saved run (--json) and plot it with --plot",
    )
    add_overwrite(parser, "--json or --plot if it exists")
    parser.add_argument("--threads", type=_threads, default=2, help="torch threads (default 2)")
    parser.add_argument(
        "--min-time",
        type=_seconds,
        default=None,
        metavar="S",
        help="seconds of timing per implementation and cell (default 0.5; --quick 0.05)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip peak-memory measurement")
    parser.add_argument(
        "--quiet", action="store_true", help="no progress lines (one per cell, on stderr)"
    )
    parser.add_argument(
        "--cases", nargs="+", metavar="ROW", help="run only these rows (e.g. dot decode serving)"
    )
    parser.add_argument("--child", nargs=2, metavar=("CASE", "IMPL"), help=argparse.SUPPRESS)
    parser.set_defaults(handler=handle)
    return parser


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(
            "--plot: needs matplotlib, which cannot be imported; install it with: "
            "pip install matplotlib"
        ) from None


def _saved_run(path: Path) -> dict[str, Any]:
    """The results a former ``--json`` wrote, checked enough to render and plot."""
    try:
        result: Any = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"--from-json: {path} does not exist") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise UsageError(f"--from-json: cannot read {path} as JSON: {err}") from None
    keys = ("case", "dtype", "step", "targets", "median_s", "peak_mib", "peak_rss_mib")
    rows = result.get("rows") if isinstance(result, dict) else None
    if not isinstance(rows, list) or not all(
        isinstance(r, dict) and all(k in r for k in keys) for r in rows
    ):
        raise UsageError(
            f'--from-json: expected the results `attnscore bench --json` writes (a "rows" '
            f"list of cells with {', '.join(keys)}), but got {path} without them"
        )
    defaults = {"device": "cpu", "device_name": "?", "threads": "?", "quick": False, "memory": True}
    for key, default in defaults.items():
        result.setdefault(key, default)
    saved: dict[str, Any] = result
    return saved


def handle(args: argparse.Namespace) -> int:
    """Run ``attnscore bench`` for parsed arguments.

    Args:
        args: the options :func:`add_parser` defines.

    Returns:
        0, or 1 when the full run misses a target (``--from-json``: 0, nothing is run).

    Raises:
        UsageError: an unknown ``--cases`` name, a ``--json`` or ``--plot`` path that cannot
            be written (or exists, without ``--overwrite``), ``--plot`` without matplotlib,
            or a ``--from-json`` file that is not a saved run.
    """
    import torch

    if args.child:
        torch.set_num_threads(args.threads)
        bench.cpu.child(args.child[0], args.quick, args.child[1])
        return 0
    if args.plot is not None:
        check_output(args.plot, "--plot", FIGURE_FORMATS, overwrite=args.overwrite)
        _require_matplotlib()
    if args.from_json is not None:
        if args.json is not None or args.cases or args.quick:
            raise UsageError(
                "--from-json: renders a saved run; --json, --cases and --quick "
                "are options of a run that measures"
            )
        saved = _saved_run(args.from_json)
        fig = None if args.plot is None else _figure(saved, args.plot)  # refused before output
        print(bench.render(saved))
        if fig is not None:
            save_figure(fig, args.plot, "--plot", overwrite=args.overwrite)
        return 0
    if args.json is not None:
        check_output(args.json, "--json", (".json",), overwrite=args.overwrite)
    try:
        bench.check_cases(torch.device(args.device).type, args.cases)
    except ValueError as err:
        raise UsageError(f"--cases: {err}") from None
    result = bench.run(
        device=args.device,
        quick=args.quick,
        memory=not args.no_memory,
        threads=args.threads,
        min_time=args.min_time,
        cases=args.cases,
        progress=not args.quiet,
    )
    print(bench.render(result))
    if args.json is not None:
        text = json.dumps(result, indent=2).encode()
        write_atomic(args.json, lambda f: f.write(text), "--json", overwrite=args.overwrite)
    if args.plot is not None:
        save_figure(_figure(result, args.plot), args.plot, "--plot", overwrite=args.overwrite)
    misses = bench.missed(result)
    if misses:
        print(f"\n{len(misses)} target(s) missed: " + "; ".join(misses), file=sys.stderr)
        return 1
    return 0


def _figure(result: dict[str, Any], path: Path) -> Figure:
    from ..bench.plot import ratio_figure

    try:
        return ratio_figure(result)
    except ValueError:
        raise UsageError(
            f"--plot: the run has no time ratio to draw, so {path} was not written"
        ) from None


def add_parser(subparsers: argparse._SubParsersAction[ArgumentParser]) -> ArgumentParser:
    """Add ``attnscore bench`` to ``subparsers`` (from ``add_subparsers()``) and return
    its parser, whose ``handler`` default runs the command.

    >>> parser = ArgumentParser(prog="attnscore")
    >>> _ = add_parser(parser.add_subparsers())
    >>> parser.parse_args(["bench", "--quick"]).handler.__name__
    'handle'
    """
    summary = "time attnscore against the textbook code and PyTorch"
    return _add_arguments(subparsers.add_parser("bench", help=summary, **_PARSER))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m attnscore.bench [options]``: the same as ``attnscore bench [options]``.

    Args:
        argv: the options (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0, 1 when the full run misses a target, 2 on bad input (one line on
        stderr), 141 when standard output was closed early.

    >>> main(["--threads", "0"])
    2
    """
    parser = _add_arguments(ArgumentParser(prog="attnscore bench", **_PARSER))
    return run_main(
        "attnscore bench",
        lambda: handle(parser.parse_args(sys.argv[1:] if argv is None else list(argv))),
    )
