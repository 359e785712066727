"""The ``attnscore`` command: one argparse tree over the library.

``attnscore demo | run | bench | g2p ...``: each subcommand is added by the module that
owns it, through ``add_parser(subparsers)``, which sets ``handler(args) -> int`` as a
default. :func:`main` parses, calls the handler, and turns every
:class:`~attnscore._usage.UsageError` (from parsing or from running) into one line on
stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import pickle
import re
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ._io import FIGURE_FORMATS, check_output, default_device, device_arg, save_figure, write_atomic
from ._usage import ArgumentParser, UsageError, positive_int

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from torch import Tensor

__all__ = ["build_parser", "main"]

ARRAY_FORMATS = (".npz", ".pt")
_NAMES = "queries, keys, values (and optionally valid_lens)"
_EXPECTED_NPZ = f"expected a zip of arrays named {_NAMES}, as numpy.savez writes"
_EXPECTED_PT = f"expected a dict of tensors named {_NAMES}, as torch.save writes"
_DEFAULT_NUM_HIDDENS = 8
_SHOWN_EXAMPLES = 8

_RUN_DESCRIPTION = """\
Compute attention on your own arrays; print the output, or save it, or draw the weights.

--input is a .npz (numpy.savez) or .pt (torch.save of a dict of tensors) holding:
  queries     (B, n, q)       floating point
  keys        (B, m, k)       same dtype as queries
  values      (B, m, v)       same dtype as queries
  valid_lens  (B,) or (B, n)  integers, optional: each query attends the first
                              valid_lens keys of its example (a 0 gives a zero row)
B may be several batch dimensions. {same_size} need q == k.

--output gets output (B, n, v) and weights (B, n, m), as .npz or .pt by extension.
--heatmap draws the weights of the first 8 examples, as .png, .pdf or .svg.
"""


def build_parser() -> ArgumentParser:
    """The whole command tree: ``demo``, ``run``, ``bench`` and ``g2p`` with their own
    subcommands. Every parser in it raises :class:`~attnscore._usage.UsageError`.

    >>> args = build_parser().parse_args(["run", "--input", "in.npz"])
    >>> args.scoring, args.handler.__name__
    ('scaled_dot', '_run')
    """
    from . import demo

    parser = ArgumentParser(
        prog="attnscore",
        description="Attention scoring functions and attention pooling (D2L section "
        "'Attention Scoring Functions').",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.add_parser(sub)
    add_run_parser(sub)
    # bench and g2p own their subcommands; each module adds its own parser.
    for module in ("attnscore.bench", "attnscore.g2p.cli"):
        importlib.import_module(module).add_parser(sub)
    return parser


def _scoring_help() -> str:
    from .registry import SCORERS, scorer_names

    lines = []
    for name in scorer_names():
        spec = SCORERS[name]
        if name == "dot":
            lines.append("dot: deprecated here, runs scaled_dot as before")
        else:
            lines.append(f"{name}: {spec.formula} ({spec.source})")
    return "scoring function (default: %(default)s); " + "; ".join(lines)


def add_run_parser(subparsers: argparse._SubParsersAction[ArgumentParser]) -> ArgumentParser:
    """Add ``attnscore run`` to ``subparsers`` and return its parser.

    >>> parser = ArgumentParser(prog="attnscore")
    >>> run = add_run_parser(parser.add_subparsers())
    >>> parser.parse_args(["run", "--input", "in.pt", "--scoring", "additive"]).scoring
    'additive'
    """
    from .registry import SCORERS, scorer_names

    run = subparsers.add_parser(
        "run",
        help="compute attention on your own arrays",
        description=_RUN_DESCRIPTION.format(
            same_size=", ".join(n for n in scorer_names() if SCORERS[n].same_feature_size)
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "--input",
        type=Path,
        required=True,
        metavar="FILE",
        help=".npz or .pt with queries, keys, values and optional valid_lens (shapes above)",
    )
    run.add_argument(
        "--scoring", choices=scorer_names(), default="scaled_dot", help=_scoring_help()
    )
    run.add_argument(
        "--num-hiddens",
        type=positive_int,
        default=None,
        metavar="H",
        help=f"hidden units h of scorers with a hidden layer "
        f"({', '.join(n for n in scorer_names() if _has_hidden_layer(n))}; default: "
        f"{_DEFAULT_NUM_HIDDENS}); refused with the others",
    )
    run.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed for the scorer's random parameters (default: %(default)s)",
    )
    run.add_argument(
        "--device",
        type=device_arg,
        default=None,
        metavar="DEVICE",
        help="cpu, cuda or cuda:N (default: cuda when available, else cpu)",
    )
    run.add_argument(
        "--output",
        type=Path,
        metavar="FILE",
        help="write output and weights to this .npz or .pt file",
    )
    run.add_argument(
        "--heatmap",
        type=Path,
        metavar="FILE",
        help="draw the weights into this .png, .pdf or .svg file",
    )
    run.set_defaults(handler=_run)
    return run


def _warn(message: str) -> None:
    print(f"attnscore: warning: {message}", file=sys.stderr)


def _load_npz(path: Path) -> dict[str, object]:
    import numpy as np
    import torch

    if not zipfile.is_zipfile(path):
        raise UsageError(f"--input: cannot read {path}: it is not an .npz archive; {_EXPECTED_NPZ}")
    arrays: dict[str, object] = {}
    try:
        with np.load(path, allow_pickle=False) as data:
            for name in data.files:
                try:
                    arrays[name] = torch.from_numpy(data[name])
                except ValueError as err:
                    if "allow_pickle" not in str(err):
                        raise
                    arrays[name] = data[name].dtype  # object arrays: reported below
                except TypeError:  # dtypes torch lacks (strings, complex256, ...)
                    arrays[name] = data[name].dtype
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile):
        raise UsageError(
            f"--input: cannot read {path}: a damaged .npz archive; {_EXPECTED_NPZ}"
        ) from None
    return arrays


def _load_pt(path: Path) -> dict[str, object]:
    import torch

    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if found is None:  # not a pickle torch can read: corrupt or another format
            raise UsageError(
                f"--input: cannot read {path}: not a file written by torch.save; {_EXPECTED_PT}"
            ) from None
        raise UsageError(
            f"--input: {path} holds objects other than tensors ({found.group(1)}), which are "
            f"never unpickled; {_EXPECTED_PT}"
        ) from None
    except Exception:  # torch.load raises many types (KeyError, RuntimeError, EOFError...)
        raise UsageError(
            f"--input: cannot read {path}: not a file written by torch.save; {_EXPECTED_PT}"
        ) from None
    if not isinstance(loaded, dict):
        raise UsageError(
            f"--input: expected {path} to hold a dict of tensors named {_NAMES}, but it holds "
            f"a {type(loaded).__name__}"
        )
    return {str(name): value for name, value in loaded.items()}


def _load_arrays(path: Path) -> dict[str, Tensor]:
    """The named tensors in ``path`` (.npz or .pt), or a UsageError naming --input."""
    import torch

    if not path.exists():
        raise UsageError(f"--input: no such file: {path}")
    if not path.is_file():
        raise UsageError(f"--input: {path} is a folder; expected a .npz or .pt file")
    suffix = path.suffix.lower()
    if suffix not in ARRAY_FORMATS:
        raise UsageError(f"--input: expected a .npz or .pt file, but got {path.name}")
    arrays = _load_npz(path) if suffix == ".npz" else _load_pt(path)
    missing = [name for name in ("queries", "keys", "values") if name not in arrays]
    if missing:
        raise UsageError(
            f"--input: {path} lacks array(s) {missing}; it has {sorted(arrays)}, but expected "
            f"arrays named {_NAMES}"
        )
    tensors: dict[str, Tensor] = {}
    for name in ("queries", "keys", "values", "valid_lens"):
        if name not in arrays:
            continue
        value = arrays[name]
        if not isinstance(value, torch.Tensor):
            got = f"dtype {value}" if suffix == ".npz" else type(value).__name__
            raise UsageError(f"--input: expected `{name}` in {path} to be numeric, but got {got}")
        tensors[name] = value
    return tensors


def _has_hidden_layer(name: str) -> bool:
    """Whether the registered scorer ``name`` has parameters that grow with num_hiddens."""
    from .registry import make_scorer

    def count(h: int) -> int:
        module = make_scorer(name, 3, 3, num_hiddens=h)
        return sum(p.numel() for p in module.parameters())

    return count(1) != count(2)


def _check_scoring(args: argparse.Namespace) -> str:
    """The registry name to run, after the deprecated spelling and the --num-hiddens check."""
    from .registry import scorer_names

    name: str = args.scoring
    if name == "dot":
        _warn(
            "--scoring dot is deprecated: it runs the scaled dot product qᵀk/√d as before; "
            "use --scoring scaled_dot (in the registry, dot is Luong's unscaled qᵀk)"
        )
        name = "scaled_dot"
    if args.num_hiddens is not None and not _has_hidden_layer(name):
        users = [n for n in scorer_names() if _has_hidden_layer(n)]
        raise UsageError(
            f"--num-hiddens: the {name} scorer has no hidden layer; --num-hiddens applies to "
            f"{', '.join(users) or 'no registered scorer'}"
        )
    return name


def _nonfinite(t: Tensor) -> str:
    """ "3 NaN and 1 inf" style count of the non-finite entries of ``t`` ("" if none)."""
    import torch

    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    return " and ".join(f"{count} {kind}" for count, kind in ((nan, "NaN"), (inf, "inf")) if count)


def _heatmap(weights: Tensor) -> Figure:
    """The figure of the first examples' weights, one titled heatmap per example."""
    import numpy as np

    from .plotting import show_heatmaps

    batch_shape = tuple(weights.shape[:-2])
    flat = weights.reshape(-1, *weights.shape[-2:])
    count = flat.shape[0]
    shown = min(count, _SHOWN_EXAMPLES)
    titles = [
        [f"example {', '.join(str(int(j)) for j in np.unravel_index(i, batch_shape))}"]
        for i in range(shown)
    ]
    if shown < count:
        titles[0][0] += f" (first {shown} of {count})"
    grid = flat[:shown].unsqueeze(1)
    n = weights.shape[-2]
    height = 0.9 + min(0.25 * n, 2.5)
    return show_heatmaps(
        grid, "Keys", "Queries", titles=titles, figsize=(5.0, 0.6 + height * shown)
    )


def _run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from .registry import make_scorer

    if args.output is not None:
        check_output(args.output, "--output", ARRAY_FORMATS)
    if args.heatmap is not None:
        check_output(args.heatmap, "--heatmap", FIGURE_FORMATS)
    name = _check_scoring(args)
    device = torch.device(args.device or default_device())
    arrays = _load_arrays(args.input)
    queries, keys, values = arrays["queries"], arrays["keys"], arrays["values"]
    valid_lens = arrays.get("valid_lens")
    for label, t, shape in (("queries", queries, "(B, n, q)"), ("keys", keys, "(B, m, k)")):
        if t.ndim < 2:
            raise UsageError(
                f"--input: expected `{label}` of shape {shape}, but got shape {tuple(t.shape)}"
            )
    torch.manual_seed(args.seed)
    num_hiddens = _DEFAULT_NUM_HIDDENS if args.num_hiddens is None else args.num_hiddens
    try:
        attention = make_scorer(name, queries.shape[-1], keys.shape[-1], num_hiddens=num_hiddens)
    except ValueError as err:
        raise UsageError(f"--scoring {name}: {err}") from None
    attention.to(device)
    if queries.is_floating_point():
        attention.to(queries.dtype)
    attention.eval()
    try:
        with torch.no_grad():
            output: Tensor = attention(
                queries.to(device),
                keys.to(device),
                values.to(device),
                None if valid_lens is None else valid_lens.to(device),
            )
    except (TypeError, ValueError) as err:
        raise UsageError(f"--input: {err}") from None
    weights = attention.attention_weights
    assert weights is not None
    output, weights = output.cpu(), weights.cpu()
    held = [
        f"{label} {verb} {text}"
        for label, verb, t in (("output", "holds", output), ("weights", "hold", weights))
        if (text := _nonfinite(t))
    ]
    if held:
        sources = [label for label in ("queries", "keys", "values") if _nonfinite(arrays[label])]
        hint = f"; --input's {', '.join(sources)} hold NaN or inf" if sources else ""
        _warn(", ".join(held) + hint)
    fig = None
    if args.heatmap is not None:  # drawn before anything is written, as it may fail
        if weights.numel() == 0:
            raise UsageError(
                f"--heatmap: nothing to draw: the weights have shape {tuple(weights.shape)}"
            )
        fig = _heatmap(weights)
    print(f"output {tuple(output.shape)}, weights {tuple(weights.shape)}")
    if args.output is None and args.heatmap is None:
        print(output)
    if args.output is not None:
        if args.output.suffix.lower() == ".pt":
            saved = {"output": output.contiguous(), "weights": weights.contiguous()}
            write_atomic(args.output, lambda f: torch.save(saved, f), "--output")
        else:
            # numpy has no bfloat16: widen it to float32
            out_np, w_np = (
                (t.float() if t.dtype == torch.bfloat16 else t).numpy() for t in (output, weights)
            )
            write_atomic(
                args.output, lambda f: np.savez(f, output=out_np, weights=w_np), "--output"
            )
        print(f"wrote {args.output}")
    if fig is not None:
        save_figure(fig, args.heatmap, "--heatmap")
        print(f"wrote {args.heatmap}")
    return 0


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``attnscore`` command; returns the exit code.

    Bad input anywhere (options, missing or corrupt files, wrong arrays, bad shapes) gives
    one line on stderr, ``attnscore: error: ...``, and exit code 2, and leaves no output
    file behind.

    >>> main(["run", "--input", "no-such-file.npz"])
    2
    """
    try:
        args = build_parser().parse_args(argv)
        return int(args.handler(args))
    except UsageError as err:
        print(f"attnscore: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except SystemExit as done:  # --help, or a handler that exits
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
