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

from .. import bench
from ._files import check_output, write_atomic
from ._usage import ArgumentParser, UsageError, device_arg, run_main

__all__ = ["add_parser", "handle", "main"]

DESCRIPTION = """\
Time attnscore against the PyTorch call a user would write instead (SDPA,
nn.MultiheadAttention, torch.softmax, the plain formulation), side by side in
one process, over rows x masks x dtypes x {forward, forward+backward}, with the
peak memory of each; then issue 16's table, tiny and mid-size calls and the decoder step.

  --device cpu    the CPU run (a few minutes on 2 cores)
  --device cuda   the same cells on a GPU, at larger shapes

The full run prints each target's verdict and exits 1 on a miss. --quick is a
smoke run at small shapes: no verdicts, but it lists cells slower than PyTorch."""


def _threads(value: str) -> int:
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if threads < 1:
        raise UsageError(f"--threads: expected a positive integer, but got {value!r}")
    return threads


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0.0 or seconds == float("inf"):
        raise UsageError(f"--min-time: expected a positive number of seconds, but got {value!r}")
    return seconds


def _add_arguments(parser: argparse.ArgumentParser) -> None:
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
        "--overwrite", action="store_true", help="replace --json if it exists (default: refuse)"
    )
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
        "--cases", nargs="+", metavar="ROW", help="run only these rows (e.g. dot multihead)"
    )
    parser.add_argument("--child", nargs=2, metavar=("CASE", "IMPL"), help=argparse.SUPPRESS)


def _check_cases(device: str, cases: Sequence[str] | None) -> None:
    """Refuse ``--cases`` naming rows the device's run does not have."""
    import torch

    device_type = torch.device(device).type
    names = bench.case_names(device_type)
    unknown = sorted(set(cases or ()) - set(names))
    if unknown:
        raise UsageError(
            f"--cases: expected names among {names} for {device_type}, but got {unknown} instead"
        )


def handle(args: argparse.Namespace) -> int:
    """Run ``attnscore bench`` for parsed arguments.

    Args:
        args: the options :func:`add_parser` defines.

    Returns:
        0, or 1 when the full run misses a target.

    Raises:
        UsageError: an unknown ``--cases`` name, or a ``--json`` path that cannot be written
            (or exists, without ``--overwrite``).
    """
    import torch

    if args.child:
        torch.set_num_threads(args.threads)
        bench.cpu.child(args.child[0], args.quick, args.child[1])
        return 0
    if args.json is not None:
        check_output(args.json, "--json", (".json",), overwrite=args.overwrite)
    _check_cases(args.device, args.cases)
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
    misses = bench.missed(result)
    if misses:
        print(f"\n{len(misses)} target(s) missed: " + "; ".join(misses), file=sys.stderr)
        return 1
    return 0


def add_parser(subparsers: argparse._SubParsersAction[ArgumentParser]) -> ArgumentParser:
    """Add ``attnscore bench`` to ``subparsers`` (from ``add_subparsers()``) and return
    its parser, whose ``handler`` default runs the command.

    >>> parser = ArgumentParser(prog="attnscore")
    >>> _ = add_parser(parser.add_subparsers())
    >>> parser.parse_args(["bench", "--quick"]).handler.__name__
    'handle'
    """
    parser = subparsers.add_parser(
        "bench",
        help="time attnscore against the textbook code and PyTorch",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    parser.set_defaults(handler=handle)
    return parser


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
    parser = ArgumentParser(
        prog="attnscore bench",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    return run_main(
        "attnscore bench",
        lambda: handle(parser.parse_args(sys.argv[1:] if argv is None else list(argv))),
    )
