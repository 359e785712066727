"""``attnscore export``: a registered scorer's attention module as a deployable file.

:func:`add_parser` adds the command to the ``attnscore`` tree; its handler builds the
module from :mod:`attnscore.registry` (:func:`attnscore.make_scorer`, or
:class:`attnscore.MultiHeadAttention` with ``--heads``), exports it through
:mod:`attnscore.integrations.export` with dynamic batch, query and key sizes, and writes
``--out`` through :mod:`._files` (checked before any work, written atomically, never over
an existing file without ``--overwrite``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ._files import check_output, write_atomic
from ._usage import ArgumentParser, UsageError, positive_int, require_extra, show_defaults
from .run import check_num_hiddens, hidden_scorers

if TYPE_CHECKING:
    from torch import nn

__all__ = ["add_parser"]

FORMATS = (".onnx", ".pt2")
_DEFAULT_SIZE = 8
_EXAMPLE = (2, 3, 5)  # B, n, m of the example inputs traced (any sizes >= 2 would do)

_DESCRIPTION = """\
Export an attention module of a registered scorer, with random parameters (--seed), as a
file that runs without attnscore:

  FILE.onnx  an ONNX model for ONNX Runtime (needs the [onnx] extra to write)
  FILE.pt2   a torch.export program (torch.export.load(FILE).module())

Inputs: queries (B, n, q), keys (B, m, k), values (B, m, v) of --dtype and valid_lens (B,)
int64; output (B, n, v), or (B, n, E) with --heads (E = --num-hiddens). B, n and m are
dynamic; q, k, v are fixed by the options. Queries of length 0 give zeros.
"""


def add_parser(subparsers: argparse._SubParsersAction[ArgumentParser]) -> ArgumentParser:
    """Add ``attnscore export`` to ``subparsers`` and return its parser (``handler`` set).

    >>> export = add_parser(ArgumentParser(prog="attnscore").add_subparsers())
    >>> args = export.parse_args(["--scoring", "additive", "--out", "a.onnx"])
    >>> args.query_size, args.heads, args.overwrite
    (8, None, False)
    """
    from ..registry import scorer_names

    export = subparsers.add_parser(
        "export",
        help="write a scorer's attention module as .onnx or .pt2",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.add_argument(
        "--scoring", choices=scorer_names(), required=True, help="registered scoring function"
    )
    export.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="FILE",
        help="the file to write: .onnx (ONNX Runtime) or .pt2 (torch.export)",
    )
    export.add_argument(
        "--query-size", type=positive_int, default=_DEFAULT_SIZE, metavar="Q", help="q"
    )
    export.add_argument(
        "--key-size", type=positive_int, default=None, metavar="K", help="k (default: Q)"
    )
    export.add_argument(
        "--value-size", type=positive_int, default=None, metavar="V", help="v (default: K)"
    )
    hidden = hidden_scorers() or "none"
    export.add_argument(
        "--num-hiddens",
        type=positive_int,
        default=None,
        metavar="H",
        help=f"hidden units of scorers with a hidden layer ({hidden}); with --heads the "
        f"model size E, a multiple of --heads (default: {_DEFAULT_SIZE})",
    )
    export.add_argument(
        "--heads",
        type=positive_int,
        default=None,
        metavar="N",
        help="export MultiHeadAttention with N heads, each scored by --scoring on "
        "E / N features (default: one single-head module)",
    )
    export.add_argument(
        "--dtype", choices=("float32", "float64"), default="float32", help="parameters and inputs"
    )
    export.add_argument("--seed", type=int, default=0, help="seed of the random parameters")
    export.add_argument(
        "--overwrite", action="store_true", help="replace --out if it exists (default: refuse)"
    )
    show_defaults(export)
    export.set_defaults(handler=_export)
    return export


def _module(args: argparse.Namespace) -> tuple[nn.Module, tuple[int, int, int]]:
    """The module to export and the feature sizes (q, k, v) of its inputs."""
    import torch

    from ..modules import make_scorer
    from ..multihead import MultiHeadAttention
    from ..registry import SCORERS

    name: str = args.scoring
    q: int = args.query_size
    k: int = q if args.key_size is None else args.key_size
    v: int = k if args.value_size is None else args.value_size
    hiddens = _DEFAULT_SIZE if args.num_hiddens is None else args.num_hiddens
    if args.heads is None:
        check_num_hiddens(name, args.num_hiddens, ", or to --heads")
    if args.heads is None and SCORERS[name].same_feature_size and q != k:
        raise UsageError(
            f"--key-size: the {name} scorer needs queries and keys of one size, but got "
            f"--query-size {q} and --key-size {k}"
        )
    torch.manual_seed(args.seed)
    module: nn.Module
    try:
        if args.heads is None:
            module = make_scorer(name, q, k, num_hiddens=hiddens)
        else:
            module = MultiHeadAttention(hiddens, args.heads, scoring=name)
    except ValueError as err:
        option = "--num-hiddens" if args.heads is not None else "--scoring"
        raise UsageError(f"{option}: {err}") from None
    return module.to(getattr(torch, args.dtype)), (q, k, v)


def _export(args: argparse.Namespace) -> int:
    """The handler of ``attnscore export``: 0, or a UsageError for bad input."""
    import torch

    from ..integrations import export as exporting

    out: Path = check_output(args.out, "--out", FORMATS, overwrite=args.overwrite)
    onnx = out.suffix.lower() == ".onnx"
    if onnx:
        for package in ("onnx", "onnxscript"):
            require_extra(package, f"--out {out.name}")
    module, (q, k, v) = _module(args)
    B, n, m = _EXAMPLE
    dtype = getattr(torch, args.dtype)
    inputs = (
        torch.randn(B, n, q, dtype=dtype),
        torch.randn(B, m, k, dtype=dtype),
        torch.randn(B, m, v, dtype=dtype),
        torch.tensor([m, 0][:B] + [m] * (B - 2)),
    )
    try:
        if onnx:
            data = exporting.export_onnx(module, inputs).model_proto.SerializeToString()
            write_atomic(out, lambda f: f.write(data), "--out", overwrite=args.overwrite)
        else:
            program = exporting.export_program(module, inputs)
            write_atomic(
                out, lambda f: torch.export.save(program, f), "--out", overwrite=args.overwrite
            )
    except (TypeError, ValueError) as err:  # what the module refuses for these sizes
        raise UsageError(f"--scoring {args.scoring}: {err}") from None
    size = v if args.heads is None else args.num_hiddens or _DEFAULT_SIZE
    print(
        f"wrote {out}: queries (B, n, {q}), keys (B, m, {k}), values (B, m, {v}) "
        f"{args.dtype}, valid_lens (B,) int64 -> output (B, n, {size})"
    )
    return 0
