"""The ``attnscore`` command: a thin argparse layer over the library.

``main(argv) -> int`` parses, calls the library and turns bad input into a one-line error
with exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["main"]


class UsageError(Exception):
    """Bad input from the user: reported in one line, exit code 2."""


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnscore",
        description="Attention scoring functions and attention pooling (D2L section "
        "'Attention Scoring Functions').",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the section's worked examples and draw heatmaps")
    demo.add_argument(
        "--out",
        type=Path,
        default=Path("attnscore-demo"),
        help="folder for the heatmap PNGs (default: ./attnscore-demo)",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")

    run = sub.add_parser("run", help="compute attention on your own arrays")
    run.add_argument(
        "--input",
        type=Path,
        required=True,
        help=".npz or .pt with queries, keys, values and optional valid_lens",
    )
    run.add_argument("--scoring", choices=["additive", "dot"], default="dot")
    run.add_argument(
        "--num-hiddens", type=int, default=8, help="hidden units h of additive scoring (default: 8)"
    )
    run.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed for the additive scorer's random parameters (default: 0)",
    )
    run.add_argument("--output", type=Path, help="write output and weights to this .npz")
    run.add_argument("--heatmap", type=Path, help="write the weights' heatmap to this .png")

    sub.add_parser("bench", help="benchmark against the textbook and PyTorch SDPA", add_help=False)
    sub.add_parser("g2p", help="grapheme-to-phoneme on CMUdict (attnscore g2p -h)", add_help=False)
    return parser


def _load_arrays(path: Path) -> dict[str, Tensor]:
    import numpy as np
    import torch

    if not path.is_file():
        raise UsageError(f"--input: no such file: {path}")
    suffix = path.suffix.lower()
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as data:
                arrays: dict[str, object] = {
                    name: torch.from_numpy(data[name]) for name in data.files
                }
        elif suffix == ".pt":
            loaded = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(loaded, dict):
                raise UsageError(
                    f"--input: expected a dict of tensors in {path}, got {type(loaded).__name__}"
                )
            arrays = dict(loaded)
        else:
            raise UsageError(f"--input: expected a .npz or .pt file, got {path.name}")
    except UsageError:
        raise
    except Exception as err:  # numpy/zip/pickle raise many types for corrupt files
        # First line only: torch.load's messages run over several lines of advice.
        reason = (str(err).strip().splitlines() or [""])[0]
        raise UsageError(f"--input: cannot read {path}: {type(err).__name__}: {reason}") from None
    missing = [name for name in ("queries", "keys", "values") if name not in arrays]
    if missing:
        raise UsageError(f"--input: {path} lacks array(s) {missing}; it has {sorted(arrays)}")
    tensors: dict[str, Tensor] = {}
    for name, value in arrays.items():
        if not isinstance(value, torch.Tensor):
            raise UsageError(f"--input: `{name}` in {path} is not an array")
        tensors[name] = value
    return tensors


def _check_writable(path: Path | None, option: str) -> None:
    """Fail before any work when an output path cannot be a file."""
    if path is not None and path.is_dir():
        raise UsageError(f"{option}: {path} is a folder; expected a file name")


def _atomic_write(path: Path, write: Callable[[BinaryIO], object], option: str) -> None:
    """Write through a temporary file in the same folder, so no partial file is left."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise UsageError(f"{option}: cannot write {path}: {err.strerror or err}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except OSError as err:
        raise UsageError(f"{option}: cannot write {path}: {err.strerror or err}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from .modules import AdditiveAttention, Attention, DotProductAttention
    from .plotting import show_heatmaps

    _check_writable(args.output, "--output")
    _check_writable(args.heatmap, "--heatmap")
    arrays = _load_arrays(args.input)
    queries, keys, values = arrays["queries"], arrays["keys"], arrays["values"]
    valid_lens = arrays.get("valid_lens")
    attention: Attention
    if args.scoring == "additive":
        torch.manual_seed(args.seed)
        attention = AdditiveAttention(num_hiddens=args.num_hiddens)
    else:
        attention = DotProductAttention()
    attention.eval()
    try:
        with torch.no_grad():
            output: Tensor = attention(queries, keys, values, valid_lens)
    except (TypeError, ValueError) as err:
        raise UsageError(f"--input: {err}") from None
    weights = attention.attention_weights
    assert weights is not None
    fig = None
    if args.heatmap is not None:  # drawn before anything is written, as it may fail
        if weights.numel() == 0:
            raise UsageError(
                f"--heatmap: nothing to draw: the weights have shape {tuple(weights.shape)}"
            )
        grid = weights.flatten(0, -3).unsqueeze(1)[:8]
        fig = show_heatmaps(grid, "Keys", "Queries", figsize=(4.0, 1.5 + 1.5 * grid.shape[0]))
    print(f"output {tuple(output.shape)}, weights {tuple(weights.shape)}")
    if args.output is None and args.heatmap is None:
        print(output)
    if args.output is not None:
        _atomic_write(
            args.output,
            lambda f: np.savez(f, output=output.numpy(), weights=weights.numpy()),
            "--output",
        )
        print(f"wrote {args.output}")
    if fig is not None:
        _atomic_write(args.heatmap, lambda f: fig.savefig(f, format="png", dpi=120), "--heatmap")
        print(f"wrote {args.heatmap}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``attnscore`` command; returns the exit code.

    Bad input (missing or corrupt files, wrong arrays, bad shapes) gives one line on
    stderr and exit code 2, and leaves no output file behind.

    >>> main(["run", "--input", "no-such-file.npz"])
    2
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from .bench import main as bench_main

        return int(bench_main(argv[1:]))
    if argv[:1] == ["g2p"]:
        from .g2p.cli import main as g2p_main

        return int(g2p_main(argv[1:]))
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            from .demo import run_demo

            written = run_demo(args.out, seed=args.seed)
            print(f"\nwrote {len(written)} heatmaps into {args.out}/")
            return 0
        return _run(args)
    except UsageError as err:
        print(f"attnscore: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
