"""``attnscore run``: attention on the user's own arrays, printed, saved or drawn.

:func:`add_parser` adds the command to the ``attnscore`` tree; its handler reads
``--input`` (:mod:`._arrays`), builds the scorer from :mod:`attnscore.registry`, and writes
``--output`` and ``--heatmap`` through :mod:`._files` (checked before any work, written
atomically, never over an existing file without ``--overwrite``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ._arrays import ARRAY_FORMATS, load_arrays
from ._files import FIGURE_FORMATS, check_output, save_figure, write_atomic
from ._usage import (
    ArgumentParser,
    UsageError,
    add_overwrite,
    default_device,
    device_arg,
    positive_int,
    require_extra,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from torch import Tensor

__all__ = ["add_parser"]

_DEFAULT_NUM_HIDDENS = 8
_SHOWN_EXAMPLES = 8
_NORMALIZER_PACKAGES = {"sparsemax": "entmax", "entmax15": "entmax"}
"""The normalizers that need an optional package (a key of :data:`._usage.EXTRAS`)."""

_DESCRIPTION = """\
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
Existing files are refused unless --overwrite is given.
"""


def _scoring_help() -> str:
    from ..registry import SCORERS, scorer_names

    lines = [f"{n}: {SCORERS[n].formula} ({SCORERS[n].source})" for n in scorer_names()]
    return "scoring function (default: %(default)s); " + "; ".join(lines)


def add_parser(subparsers: argparse._SubParsersAction[ArgumentParser]) -> ArgumentParser:
    """Add ``attnscore run`` to ``subparsers`` and return its parser (``handler`` set).

    >>> run = add_parser(ArgumentParser(prog="attnscore").add_subparsers())
    >>> run.parse_args(["--input", "in.pt", "--scoring", "additive"]).scoring
    'additive'
    """
    from ..normalizers import normalizer_names
    from ..registry import SCORERS, scorer_names

    run = subparsers.add_parser(
        "run",
        help="compute attention on your own arrays",
        description=_DESCRIPTION.format(
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
        help=f"hidden units h of scorers with a hidden layer ({hidden_scorers()}; default: "
        f"{_DEFAULT_NUM_HIDDENS}); refused with the others",
    )
    run.add_argument(
        "--normalizer",
        choices=normalizer_names(),
        default="softmax",
        help="probability function (default: %(default)s; sparsemax and entmax15 need the "
        "optional entmax package)",
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
    add_overwrite(run, "--output and --heatmap if they exist")
    run.set_defaults(handler=_run)
    return run


def hidden_scorers() -> str:
    """The registered scorers with a hidden layer, comma-separated ("" if none)."""
    from ..registry import SCORERS, scorer_names

    return ", ".join(n for n in scorer_names() if SCORERS[n].hidden_units)


def check_num_hiddens(name: str, num_hiddens: int | None, otherwise: str = "") -> None:
    """Refuse ``--num-hiddens`` for the scorer ``name`` if it has no hidden layer; the
    message ends with ``otherwise`` (another use of the option)."""
    from ..registry import SCORERS

    if num_hiddens is not None and not SCORERS[name].hidden_units:
        raise UsageError(
            f"--num-hiddens: the {name} scorer has no hidden layer; --num-hiddens applies to "
            f"{hidden_scorers() or 'no registered scorer'}{otherwise}"
        )


def _nonfinite(t: Tensor) -> str:
    """ "3 NaN and 1 inf" style count of the non-finite entries of ``t`` ("" if none)."""
    import torch

    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    return " and ".join(f"{count} {kind}" for count, kind in ((nan, "NaN"), (inf, "inf")) if count)


def _heatmap(weights: Tensor) -> Figure:
    """The figure of the first examples' weights, one titled heatmap per example."""
    import numpy as np

    from ..plotting import show_heatmaps

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


def _warn_nonfinite(output: Tensor, weights: Tensor, arrays: dict[str, Tensor]) -> None:
    """One warning line when the results hold NaN or inf, naming the inputs that do."""
    held = [
        f"{label} {verb} {text}"
        for label, verb, t in (("output", "holds", output), ("weights", "hold", weights))
        if (text := _nonfinite(t))
    ]
    if held:
        sources = [label for label in ("queries", "keys", "values") if _nonfinite(arrays[label])]
        hint = f"; --input's {', '.join(sources)} hold NaN or inf" if sources else ""
        print(f"attnscore: warning: {', '.join(held)}{hint}", file=sys.stderr)


def _write_output(path: Path, output: Tensor, weights: Tensor, overwrite: bool) -> None:
    """``--output``: output and weights as .pt (tensors) or .npz (arrays), atomically."""
    import numpy as np
    import torch

    if path.suffix.lower() == ".pt":
        saved = {"output": output.contiguous(), "weights": weights.contiguous()}
        write_atomic(path, lambda f: torch.save(saved, f), "--output", overwrite=overwrite)
        return
    # numpy has no bfloat16: widen it to float32
    out_np, w_np = (
        (t.float() if t.dtype == torch.bfloat16 else t).numpy() for t in (output, weights)
    )
    write_atomic(
        path, lambda f: np.savez(f, output=out_np, weights=w_np), "--output", overwrite=overwrite
    )


def _run(args: argparse.Namespace) -> int:
    """The handler of ``attnscore run``: 0, or a UsageError for bad input."""
    import torch

    from ..modules import make_scorer

    if args.output is not None:
        check_output(args.output, "--output", ARRAY_FORMATS, overwrite=args.overwrite)
    if args.heatmap is not None:
        check_output(args.heatmap, "--heatmap", FIGURE_FORMATS, overwrite=args.overwrite)
    name: str = args.scoring
    check_num_hiddens(name, args.num_hiddens)
    if args.normalizer in _NORMALIZER_PACKAGES:
        require_extra(_NORMALIZER_PACKAGES[args.normalizer], f"--normalizer {args.normalizer}")
    device = torch.device(args.device or default_device())
    arrays = load_arrays(args.input)
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
        attention = make_scorer(
            name,
            queries.shape[-1],
            keys.shape[-1],
            num_hiddens=num_hiddens,
            normalizer=args.normalizer,
        )
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
    _warn_nonfinite(output, weights, arrays)
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
        _write_output(args.output, output, weights, args.overwrite)
        print(f"wrote {args.output}")
    if fig is not None:
        save_figure(fig, args.heatmap, "--heatmap", overwrite=args.overwrite)
        print(f"wrote {args.heatmap}")
    return 0
