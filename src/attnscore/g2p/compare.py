"""``g2p compare`` (every scorer x every seed, one budget) and ``g2p table`` (runs -> table).

Each training of ``compare`` runs in a fresh (spawned) process, one at a time, so that its
peak memory is its own and runs do not compete for the cores. Tables report the mean and
the sample standard deviation over the seeds of each scorer.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from .._io import check_output, save_figure, write_atomic
from .._usage import UsageError
from .checkpoint import load_model, resolve_checkpoint
from .config import TrainConfig, train_config_from_args
from .data import load_lexicon
from .evaluate import evaluate_checkpoint, forced_alignment, predict
from .plots import alignments_figure, comparison_figure
from .train import train

_METRICS = ("per_greedy", "wer_greedy", "per_beam", "wer_beam")


def _child(cfg: TrainConfig) -> None:
    train(cfg)


def train_in_subprocess(cfg: TrainConfig) -> dict[str, Any]:
    """Run :func:`~attnscore.g2p.train.train` in a spawned process; its summary.

    Raises:
        RuntimeError: the training process failed.
    """
    proc = mp.get_context("spawn").Process(target=_child, args=(cfg,))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(
            f"Expected training {cfg.model.scoring!r} to succeed, but it exited with "
            f"code {proc.exitcode} instead"
        )
    summary: dict[str, Any] = json.loads((Path(cfg.out) / "summary.json").read_text())
    return summary


def run_result(
    run: Path, beam: int, device: str = "cpu", length_norm: float = 0.0
) -> dict[str, Any]:
    """Summary and test scores of one run folder (evaluated once, then read from its JSON).

    The test scores are cached in ``RUN/test-beam{beam}-ln{length_norm}.json``.

    Raises:
        UsageError: ``run`` is not a finished run folder.
    """
    summary_path = run / "summary.json"
    if not summary_path.is_file():
        raise UsageError(f"expected a finished run folder with summary.json, but got {str(run)!r}")
    summary: dict[str, Any] = json.loads(summary_path.read_text())
    cache = run / f"test-beam{beam}-ln{length_norm:g}.json"
    if cache.is_file():
        res: dict[str, Any] = json.loads(cache.read_text())
    else:
        res = evaluate_checkpoint(run, "test", beam, device=device, length_norm=length_norm)
        cache.write_text(json.dumps(res, indent=2) + "\n")
    beam_res = res.get("beam", res["greedy"])
    return {
        "run": str(run),
        "scoring": summary["scoring"],
        "seed": summary.get("seed"),
        "steps": summary["steps"],
        "train_seconds": summary["train_seconds"],
        "epochs": summary["epochs"],
        "peak_rss_mb": summary["peak_rss_mb"],
        "parameters": summary["parameters"],
        "per_greedy": res["greedy"]["per"],
        "wer_greedy": res["greedy"]["wer"],
        "per_beam": beam_res["per"],
        "wer_beam": beam_res["wer"],
    }


def _stats(xs: Sequence[float]) -> dict[str, float | None]:
    return {
        "mean": statistics.fmean(xs),
        "std": statistics.stdev(xs) if len(xs) > 1 else None,
    }


def summarize(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Group per-run results (:func:`run_result`) by scorer: mean and std over the seeds.

    Returns:
        One row per scorer, in first-seen order: ``scoring``, ``seeds``, ``runs`` and, for
        each metric and for steps, train seconds, peak RSS, ``{"mean", "std"}`` (std is the
        sample standard deviation, None for one seed); ``parameters``.
    """
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault(r["scoring"], []).append(r)
    rows = []
    for scoring, rs in groups.items():
        row: dict[str, Any] = {
            "scoring": scoring,
            "seeds": [r["seed"] for r in rs],
            "runs": [r["run"] for r in rs],
            "parameters": rs[0]["parameters"],
        }
        for key in (*_METRICS, "steps", "train_seconds", "epochs", "peak_rss_mb"):
            row[key] = _stats([float(r[key]) for r in rs])
        rows.append(row)
    return rows


def _pm(s: dict[str, float | None], scale: float = 100.0, digits: int = 2) -> str:
    mean, std = s["mean"], s["std"]
    assert mean is not None
    text = f"{scale * mean:.{digits}f}"
    return text + (f" ± {scale * std:.{digits}f}" if std is not None else " (1 seed)")


def format_table(rows: Sequence[dict[str, Any]], beam: int) -> str:
    """Markdown table of :func:`summarize` rows: PER/WER in % as mean ± std over seeds."""
    b = f"beam {beam}" if beam > 1 else "greedy"
    lines = [
        f"| scoring | seeds | steps | test PER greedy (%) | test WER greedy (%) | "
        f"test PER {b} (%) | test WER {b} (%) | train time (min) | peak RSS (MiB) | "
        "parameters |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        lines.append(
            f"| {r['scoring']} | {len(r['seeds'])} | {_pm(r['steps'], 1, 0)} | "
            f"{_pm(r['per_greedy'])} | {_pm(r['wer_greedy'])} | {_pm(r['per_beam'])} | "
            f"{_pm(r['wer_beam'])} | {_pm(r['train_seconds'], 1 / 60, 1)} | "
            f"{_pm(r['peak_rss_mb'], 1, 0)} | {r['parameters']:,} |"
        )
    return "\n".join(lines)


def budget_line(cfg: TrainConfig) -> str:
    """Which budget a comparison used: equal steps or equal time."""
    if cfg.time_budget is not None:
        return (
            f"budget: equal time, {cfg.time_budget:g} min per run (each run turns it into "
            "steps from its own warm-up)"
        )
    return f"budget: equal steps, {cfg.steps} optimizer steps per run"


def _write_text(path: Path, text: str, option: str) -> None:
    write_atomic(path, lambda f: f.write(text.encode()), option)


def cmd_table(args: argparse.Namespace) -> int:
    """``g2p table RUN...``: the mean ± std table of finished run folders (grouped by scorer)."""
    if args.out is not None:
        check_output(Path(args.out), "--out", (".md",))
    torch.set_num_threads(args.threads)
    results = [run_result(Path(r), args.beam, args.device, args.length_norm) for r in args.runs]
    rows = summarize(results)
    table = format_table(rows, args.beam)
    if args.out is not None:
        _write_text(Path(args.out), table + "\n", "--out")
    print(table)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """``g2p compare``: every scorer x every seed with one budget, then table and figures."""
    base = train_config_from_args(args, scoring=args.scorings[0], seed=args.seeds[0])
    out = Path(args.out)
    if not out.parent.is_dir():
        raise UsageError(f"--out: folder {out.parent} does not exist; create it first")
    out.mkdir(exist_ok=True)
    print(budget_line(base))
    results: list[dict[str, Any]] = []
    first_runs: dict[str, Path] = {}
    for scoring in args.scorings:
        for seed in args.seeds:
            run = out / f"{scoring}-seed{seed}"
            cfg = replace(base, model=replace(base.model, scoring=scoring), seed=seed, out=str(run))
            if not (run / "summary.json").is_file():
                train_in_subprocess(cfg)
            results.append(run_result(run, args.beam, args.device, args.length_norm))
            first_runs.setdefault(scoring, run)
    rows = summarize(results)
    table = format_table(rows, args.beam)
    _write_text(out / "compare.json", json.dumps(rows, indent=2) + "\n", "--out")
    _write_text(out / "compare.md", budget_line(base) + "\n\n" + table + "\n", "--out")
    print(table)
    save_figure(comparison_figure(rows), out / "compare.png", "--out")
    for p in plot_alignments(first_runs, args.words, out):
        print(f"alignment heatmap: {p}")
    print(f"table, figures and runs: {out}")
    return 0


def plot_alignments(run_dirs: dict[str, Path], words: list[str], out: Path) -> list[Path]:
    """Per word, ``out/alignment-WORD.png``: teacher-forced attention of every scorer.

    The pronunciation is the word's first dictionary entry, or the first model's prediction
    for a word outside the dictionary; words with letters the models never saw are skipped.
    """
    models = {s: load_model(resolve_checkpoint(d)) for s, d in run_dirs.items()}
    model0, letters, phones, tcfg = next(iter(models.values()))
    lexicon = load_lexicon(tcfg.data, tcfg.keep_stress).lexicon
    paths = []
    for word in words:
        w = word.lower()
        if not w or any(c not in letters.stoi for c in w):
            continue
        pron = list(lexicon[w][0]) if w in lexicon else predict(model0, [w], letters, phones)[0][0]
        mats = [forced_alignment(m, w, pron, lt, ph) for m, lt, ph, _ in models.values()]
        path = out / f"alignment-{w}.png"
        save_figure(alignments_figure(mats, list(models), w, pron), path, "--words")
        paths.append(path)
    return paths
