"""``attnscore g2p compare``: every scoring function, same budget and seeds, one table.

Each training runs in a fresh (spawned) process, one at a time, so that its peak memory is
its own and runs do not compete for the CPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from .train import TrainConfig


def _child(cfg: TrainConfig) -> None:
    from .train import run_training

    run_training(cfg)


def train_in_subprocess(cfg: TrainConfig) -> dict[str, Any]:
    """Run :func:`~attnscore.g2p.train.run_training` in a spawned process; its summary."""
    proc = mp.get_context("spawn").Process(target=_child, args=(cfg,))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(
            f"Expected training {cfg.scoring!r} to succeed, but it exited with "
            f"code {proc.exitcode} instead"
        )
    summary: dict[str, Any] = json.loads((Path(cfg.out) / "summary.json").read_text())
    return summary


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def format_table(rows: list[dict[str, Any]], beam: int) -> str:
    """Markdown table of the comparison rows (means over seeds)."""
    head = (
        f"| scoring | test PER greedy | test WER greedy | test PER beam {beam} | "
        f"test WER beam {beam} | train time (min) | epochs | peak RSS (MiB) | parameters |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['scoring']} | {100 * r['per_greedy']:.2f}% | {100 * r['wer_greedy']:.2f}% | "
            f"{100 * r['per_beam']:.2f}% | {100 * r['wer_beam']:.2f}% | "
            f"{r['train_seconds'] / 60:.1f} | {r['epochs']:.2f} | {r['peak_rss_mb']:.0f} | "
            f"{r['parameters']:,} |"
        )
    return "\n".join(lines)


def plot_comparison(rows: list[dict[str, Any]], path: Path) -> None:
    """Bar chart of test PER and WER (beam search) per scoring function."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["scoring"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    for ax, key, label in zip(axes, ("per_beam", "wer_beam"), ("PER (%)", "WER (%)"), strict=True):
        ax.bar(names, [100 * r[key] for r in rows], color="tab:red")
        ax.set_ylabel(f"test {label}")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_alignments(run_dirs: dict[str, Path], words: list[str], out: Path) -> list[Path]:
    """One figure per word: the teacher-forced attention of every scorer side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    import attnscore

    from .checkpoint import load_model
    from .commands import forced_alignment, resolve_checkpoint
    from .data import EOS, load_lexicon
    from .evaluate import predict

    models = {s: load_model(resolve_checkpoint(str(d))) for s, d in run_dirs.items()}
    first = next(iter(models.values()))
    tcfg = first[3]
    lexicon = load_lexicon(tcfg["data"], tcfg["keep_stress"]).lexicon
    paths = []
    for word in words:
        w = word.lower()
        if any(c not in first[1].stoi for c in w):
            continue
        pron = (
            list(lexicon[w][0])
            if w in lexicon
            else predict(first[0], [w], first[1], first[2])[0][0]
        )
        mats = [forced_alignment(m, w, pron, lt, ph) for m, lt, ph, _ in models.values()]
        fig = attnscore.show_heatmaps(
            torch.stack(mats)[None],
            xlabel="letters",
            ylabel="phonemes",
            titles=list(models),
            figsize=(len(models) * (0.3 * len(w) + 1.2), 0.3 * (len(pron) + 1) + 1.4),
            xticklabels=list(w),
            yticklabels=[*pron, EOS],
        )
        path = out / f"alignment-{w}.png"
        fig.savefig(path, bbox_inches="tight", dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def cmd_compare(args: argparse.Namespace) -> int:
    from .cli import train_config
    from .commands import evaluate_checkpoint

    base = train_config(args)
    assert isinstance(base, TrainConfig)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    run_dirs: dict[str, Path] = {}
    for scoring in args.scorings:
        per_seed = []
        for seed in args.seeds:
            run = out / f"{scoring}-seed{seed}"
            cfg = replace(base, scoring=scoring, seed=seed, out=str(run))
            summary = train_in_subprocess(cfg)
            res = evaluate_checkpoint(run, "test", args.beam)
            per_seed.append((summary, res))
            run_dirs.setdefault(scoring, run)
        beam_key = "beam" if args.beam > 1 else "greedy"
        rows.append(
            {
                "scoring": scoring,
                "seeds": list(args.seeds),
                "per_greedy": _mean([r["greedy"]["per"] for _, r in per_seed]),
                "wer_greedy": _mean([r["greedy"]["wer"] for _, r in per_seed]),
                "per_beam": _mean([r[beam_key]["per"] for _, r in per_seed]),
                "wer_beam": _mean([r[beam_key]["wer"] for _, r in per_seed]),
                "train_seconds": _mean([s["train_seconds"] for s, _ in per_seed]),
                "epochs": _mean([s["epochs"] for s, _ in per_seed]),
                "peak_rss_mb": max(s["peak_rss_mb"] for s, _ in per_seed),
                "parameters": per_seed[0][0]["parameters"],
            }
        )
        (out / "compare.json").write_text(json.dumps(rows, indent=2))
    table = format_table(rows, args.beam)
    (out / "compare.md").write_text(table + "\n")
    print(table)
    plot_comparison(rows, out / "compare.png")
    for p in plot_alignments(run_dirs, args.words, out):
        print(f"alignment heatmap: {p}")
    print(f"table, figures and runs: {out}")
    return 0
