"""The ``train``, ``eval`` and ``predict`` sub-commands (``compare`` lives in compare.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from .checkpoint import load_model
from .data import EOS, Vocab, load_lexicon, split_lexicon
from .evaluate import evaluate, predict
from .model import G2PModel


def resolve_checkpoint(path: str) -> Path:
    """A checkpoint file, or ``best.pt`` (else ``last.pt``) inside a run directory."""
    p = Path(path)
    if p.is_dir():
        for name in ("best.pt", "last.pt"):
            if (p / name).is_file():
                return p / name
        raise FileNotFoundError(
            f"Expected best.pt or last.pt in {str(p)!r}, but got neither instead"
        )
    if not p.is_file():
        raise FileNotFoundError(
            f"Expected a checkpoint file or run directory, but got {path!r} instead"
        )
    return p


def cmd_train(args: argparse.Namespace) -> int:
    from .cli import train_config
    from .train import TrainConfig, distributed_env, run_training

    rank, world_size = distributed_env()
    cfg = train_config(args)
    assert isinstance(cfg, TrainConfig)
    summary = run_training(cfg, rank=rank, world_size=world_size, resume=args.resume)
    if rank == 0:
        last = summary["history"][-1] if summary["history"] else {}
        print(
            f"trained {summary['scoring']}: {summary['steps']} steps, "
            f"{summary['epochs']:.2f} epochs, {summary['train_seconds'] / 60:.1f} min; "
            f"valid PER {100 * last.get('valid_per', float('nan')):.2f}% "
            f"WER {100 * last.get('valid_wer', float('nan')):.2f}% -> {cfg.out}"
        )
    return 0


def evaluate_checkpoint(
    path: str | Path,
    split: str = "test",
    beam: int = 5,
    data: str | None = None,
    max_words: int | None = None,
) -> dict[str, Any]:
    """PER/WER of a checkpoint on a split, greedy and (if ``beam > 1``) beam search."""
    model, letters, phones, tcfg = load_model(resolve_checkpoint(str(path)))
    parsed = load_lexicon(data if data is not None else tcfg["data"], tcfg["keep_stress"])
    lexicon = split_lexicon(parsed.lexicon)[split]
    results: dict[str, Any] = {"checkpoint": str(path), "split": split}
    res = evaluate(model, lexicon, letters, phones, beam=1, max_words=max_words)
    results["greedy"] = vars(res)
    print(res.line(f"{split} greedy"))
    if beam > 1:
        res = evaluate(model, lexicon, letters, phones, beam=beam, max_words=max_words)
        results[f"beam{beam}"] = vars(res)
        results["beam"] = vars(res)
        print(res.line(f"{split} beam={beam}"))
    return results


def cmd_eval(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    results = evaluate_checkpoint(args.checkpoint, args.split, args.beam, args.data, args.max_words)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def check_words(words: list[str], letters: Vocab) -> list[str]:
    """Lower-case ``words``; raise ValueError for a word with letters the model never saw."""
    out = []
    for w in words:
        lw = w.lower()
        unknown = sorted({c for c in lw if c not in letters.stoi})
        if not lw or unknown:
            raise ValueError(
                f"Expected words made of the training letters, but got {w!r} instead "
                f"(unknown: {''.join(unknown) or 'empty word'})"
            )
        out.append(lw)
    return out


def plot_alignment(att: torch.Tensor, word: str, pron: list[str], title: str | None = None) -> Any:
    """Heatmap figure of one word's attention: (phonemes + 1, letters) weights."""
    import attnscore

    return attnscore.show_heatmaps(
        att[None, None],
        xlabel="letters",
        ylabel="phonemes",
        titles=[title] if title else None,
        figsize=(0.35 * len(word) + 1.5, 0.35 * (len(pron) + 1) + 1.2),
        xticklabels=list(word),
        yticklabels=[*pron, EOS],
    )


def heatmap_paths(base: str, words: list[str]) -> list[Path]:
    """One figure file per word: ``base`` itself for one word, ``stem-WORD.suffix`` for more."""
    p = Path(base)
    if len(words) == 1:
        return [p]
    suffix = p.suffix or ".png"
    return [p.with_name(f"{p.stem}-{w}{suffix}") for w in words]


def cmd_predict(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    model, letters, phones, _ = load_model(resolve_checkpoint(args.checkpoint))
    words = check_words(args.words, letters)
    prons, atts = predict(model, words, letters, phones, beam=args.beam)
    for w, p in zip(words, prons, strict=True):
        print(f"{w}\t{' '.join(p)}")
    if args.heatmap:
        import matplotlib.pyplot as plt

        for w, p, a, path in zip(
            words, prons, atts, heatmap_paths(args.heatmap, words), strict=True
        ):
            fig = plot_alignment(a, w, p, title=model.cfg.scoring)
            fig.savefig(path, bbox_inches="tight", dpi=120)
            plt.close(fig)
            print(f"attention heatmap: {path}")
    return 0


def forced_alignment(
    model: G2PModel, word: str, pron: list[str], letters: Vocab, phones: Vocab
) -> torch.Tensor:
    """Teacher-forced attention of ``word`` on ``pron``: (len(pron) + 1, len(word)) float."""
    from .data import make_batch

    batch = make_batch([(word, tuple(pron))], letters, phones)
    model.eval()
    with torch.no_grad():
        model(batch.src, batch.src_lens, batch.tgt_in)
    return model.last_attention_weights()[0].cpu()
