"""The handlers of ``attnscore g2p train``, ``eval`` and ``predict``: ``handler(args) -> int``.

Bad input raises :class:`~attnscore._usage.UsageError` (one line, exit 2, from the caller).
``compare`` and ``table`` are in :mod:`attnscore.g2p.compare`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .._io import check_output, save_figure, write_atomic
from .._usage import UsageError
from .checkpoint import load_model
from .config import train_config_from_args
from .data import Vocab
from .evaluate import EvalResult, evaluate_checkpoint, predict
from .plots import words_figure
from .train import train


def cmd_train(args: argparse.Namespace) -> int:
    """``g2p train``: train one model; prints its summary line."""
    cfg = train_config_from_args(args)
    try:
        summary = train(cfg, resume=args.resume)
    except KeyboardInterrupt:
        print("interrupted: the last checkpoint is kept; continue with --resume", file=sys.stderr)
        return 130
    if summary is not None:
        last = summary["history"][-1] if summary["history"] else {}
        print(
            f"trained {summary['scoring']}: {summary['steps']} steps, "
            f"{summary['epochs']:.2f} epochs, {summary['train_seconds'] / 60:.1f} min; "
            f"valid PER {100 * last.get('valid_per', float('nan')):.2f}% "
            f"WER {100 * last.get('valid_wer', float('nan')):.2f}% -> {cfg.out}"
        )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """``g2p eval``: PER/WER of a checkpoint on a split (greedy, then beam search)."""
    if args.json is not None:
        check_output(Path(args.json), "--json", (".json",))
    torch.set_num_threads(args.threads)
    res = evaluate_checkpoint(
        args.checkpoint,
        args.split,
        args.beam,
        args.data,
        args.max_words,
        device=args.device,
        length_norm=args.length_norm,
    )
    print(EvalResult(**res["greedy"]).line(f"{args.split} greedy"))
    if "beam" in res:
        print(EvalResult(**res["beam"]).line(f"{args.split} beam={args.beam}"))
    if args.json is not None:
        text = json.dumps(res, indent=2) + "\n"
        write_atomic(Path(args.json), lambda f: f.write(text.encode()), "--json")
    return 0


def check_words(words: list[str], letters: Vocab) -> list[str]:
    """Lower-case ``words``.

    Raises:
        UsageError: a word with letters the model never saw, or an empty word.
    """
    out = []
    for w in words:
        lw = w.lower()
        unknown = sorted({c for c in lw if c not in letters.stoi})
        if not lw or unknown:
            raise UsageError(
                f"expected words made of the training letters, but got {w!r} "
                f"(unknown: {''.join(unknown) or 'empty word'})"
            )
        out.append(lw)
    return out


def cmd_predict(args: argparse.Namespace) -> int:
    """``g2p predict``: pronounce words; with ``--heatmap F`` also draw one figure ``F``.

    The figure has one panel per word. Without ``--heatmap`` nothing is written. The output
    path is checked before anything is printed.
    """
    if args.heatmap is not None:
        check_output(Path(args.heatmap), "--heatmap", (".png", ".pdf", ".svg"))
    torch.set_num_threads(1)
    model, letters, phones, _ = load_model(args.checkpoint, args.device)
    words = check_words(args.words, letters)
    prons, atts = predict(
        model, words, letters, phones, beam=args.beam, length_norm=args.length_norm
    )
    if args.heatmap is not None:
        fig = words_figure(words, prons, atts, title=model.cfg.scoring)
        save_figure(fig, Path(args.heatmap), "--heatmap")
    for w, p in zip(words, prons, strict=True):
        print(f"{w}\t{' '.join(p)}")
    if args.heatmap is not None:
        print(f"attention heatmap: {args.heatmap}", file=sys.stderr)
    return 0
