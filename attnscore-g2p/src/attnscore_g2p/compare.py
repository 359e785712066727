"""Comparing scorers: runs trained one at a time, scored on the test split, tabled.

What ``g2p compare`` (every scorer x every seed, one budget) and ``g2p table`` (finished
runs -> table) compute. Each training runs in a fresh (spawned) process, one at a time, so
that its peak memory is its own and runs do not compete for the cores. Tables report the
mean and the sample standard deviation over the seeds of each scorer.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import re
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checkpoint import load_model, resolve_checkpoint
from .config import TrainConfig
from .data import load_lexicon
from .evaluate import evaluate_checkpoint, forced_alignment, predict
from .files import write_text_atomic
from .plots import alignments_figure
from .summary import SUMMARY_FILE, RunSummary
from .train import train

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_METRICS = ("per_greedy", "wer_greedy", "per_beam", "wer_beam")

RUN_FILES = ("config.json", "last.pt", "best.pt", "last.pt.tmp", "best.pt.tmp", SUMMARY_FILE)
"""The files a training run writes in its folder (checkpoints through a ``.tmp`` file)."""

_TEST_CACHE = re.compile(r"test-beam\d+-ln[-+.\w]+\.json")
"""The names of :func:`run_result`'s test-score caches, ``test-beam{beam}-ln{length_norm}``."""


def clear_run(run: Path) -> list[str]:
    """Delete what an earlier run wrote in folder ``run`` (if it exists): :data:`RUN_FILES`
    and the test score caches of :func:`run_result`; return the names deleted, sorted.
    Other files and sub-folders are left alone.

    Raises:
        OSError: a file that cannot be deleted.
    """
    if not run.is_dir():
        return []
    names = sorted(
        p.name
        for p in run.iterdir()
        if (p.name in RUN_FILES or _TEST_CACHE.fullmatch(p.name)) and not p.is_dir()
    )
    for name in names:
        (run / name).unlink(missing_ok=True)
    return names


def train_in_subprocess(cfg: TrainConfig) -> RunSummary:
    """Run :func:`~attnscore_g2p.train.train` of ``cfg`` in a spawned process; return the
    run's summary.

    Raises:
        RuntimeError: the training process failed.
    """
    proc = mp.get_context("spawn").Process(target=train, args=(cfg,))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(
            f"Expected training {cfg.model.scoring!r} to succeed, but it exited with "
            f"code {proc.exitcode} instead"
        )
    return RunSummary.read(Path(cfg.out))


_NOT_RECIPE = frozenset({"out", "progress", "threads", "nprocs", "device"})
"""Configuration fields that do not change what a run computes (up to rounding)."""


def recipe_differences(a: TrainConfig, b: TrainConfig) -> list[str]:
    """The fields (the model's by their own names) in which two configurations differ as
    recipes, sorted: every field counts but where the run is written, its threads,
    processes, device and progress bar. With a time budget the step count is the budget's,
    decided by each run's warm-up, and not compared.

    >>> recipe_differences(TrainConfig(out="a", threads=1), TrainConfig(out="b", threads=2))
    []
    >>> recipe_differences(TrainConfig(), TrainConfig.from_fields({"dropout": 0.3, "lr": 1.0}))
    ['dropout', 'lr']
    """
    ignored = _NOT_RECIPE | ({"steps"} if a.time_budget or b.time_budget else set())

    def flat(cfg: TrainConfig) -> dict[str, Any]:
        fields = cfg.to_dict()
        return {**fields.pop("model"), **fields}

    fa, fb = flat(a), flat(b)
    return sorted(k for k in fa.keys() - ignored if fa[k] != fb[k])


def run_folder(out: Path, scoring: str, seed: int, lr: float | None = None) -> Path:
    """Where ``g2p compare`` keeps a run: ``{scoring}-seed{seed}``, or with a learning-rate
    grid ``{scoring}-lr{lr:g}-seed{seed}``."""
    return out / (f"{scoring}-seed{seed}" if lr is None else f"{scoring}-lr{lr:g}-seed{seed}")


def train_or_reuse(cfg: TrainConfig) -> RunSummary:
    """The summary of the run ``cfg`` describes: the finished one in ``cfg.out`` if there is
    one, else a new one trained in a subprocess (:func:`train_in_subprocess`).

    Raises:
        ValueError: ``cfg.out`` holds a finished run of another recipe
            (:func:`recipe_differences`).
        RuntimeError: the training process failed.
    """
    run = Path(cfg.out)
    if not (run / SUMMARY_FILE).is_file():
        return train_in_subprocess(cfg)
    summary = RunSummary.read(run)
    differ = recipe_differences(summary.config, cfg)
    if differ:
        raise ValueError(
            f"Expected the finished run in {run} to have this comparison's recipe, but it "
            f"differs in {', '.join(differ)}; use another --out or delete that run"
        )
    return summary


def pick_lr(valid_wer: dict[float, float | None]) -> float:
    """The learning rate of the lowest validation WER (the first of equals); a run without
    a validation never wins.

    >>> pick_lr({1e-3: 0.31, 2e-3: 0.29, 4e-3: 0.29})
    0.002
    """
    scored = [(wer, i, lr) for i, (lr, wer) in enumerate(valid_wer.items()) if wer is not None]
    if not scored:
        raise ValueError("Expected a validated run in the learning-rate grid, but got none")
    return min(scored)[2]


def grid_table(grid: dict[str, dict[float, float | None]], chosen: dict[str, float]) -> str:
    """Markdown table of a learning-rate grid: best validation WER (%) per scorer and rate,
    the chosen rate in bold."""
    rates = sorted({lr for row in grid.values() for lr in row})
    rows = []
    for scoring, row in grid.items():
        cells = [scoring]
        for lr in rates:
            wer = row.get(lr)
            text = "-" if wer is None else f"{100 * wer:.2f}"
            cells.append(f"**{text}**" if lr == chosen.get(scoring) else text)
        rows.append(cells)
    return _markdown(["scoring", *(f"lr {lr:g}" for lr in rates)], rows)


def _markdown(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(cells) + " |" for cells in (head, *rows)]
    return "\n".join([lines[0], "|" + "---|" * len(head), *lines[1:]])


def run_result(
    run: Path, beam: int, device: str = "cpu", length_norm: float = 0.0
) -> dict[str, Any]:
    """Summary and test scores of the finished run folder ``run``, decoded on ``device``
    greedily and with beam width ``beam`` (1: greedy only) and length-normalisation exponent
    ``length_norm``; evaluated once, then read from ``RUN/test-beam{beam}-ln{length_norm}.json``.

    Returns:
        One table row: ``run``, ``scoring``, ``lr`` (peak), ``seed``, ``steps``, ``train_seconds``,
        ``epochs``, ``peak_rss_mb``, ``parameters`` and the test ``per_greedy``,
        ``wer_greedy``, ``per_beam``, ``wer_beam``.

    Raises:
        FileNotFoundError: ``run`` is not a finished run folder (no summary.json).
        CheckpointError: its checkpoint cannot be read.
    """
    summary = RunSummary.read(run)
    cache = run / f"test-beam{beam}-ln{length_norm:g}.json"
    if cache.is_file():
        res: dict[str, Any] = json.loads(cache.read_text())
    else:
        res = evaluate_checkpoint(run, "test", beam, device=device, length_norm=length_norm)
        write_text_atomic(cache, json.dumps(res, indent=2) + "\n")
    beam_res = res.get("beam", res["greedy"])
    kept = ("seed", "steps", "train_seconds", "epochs", "peak_rss_mb", "parameters")
    return {
        "run": str(run),
        "scoring": summary.scoring,
        "lr": summary.config.lr,
        **{key: getattr(summary, key) for key in kept},
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
    """Group per-run results (:func:`run_result`) by scorer and peak learning rate: mean and
    std over the seeds.

    Returns:
        One row per (scorer, lr), in first-seen order: ``scoring``, ``lr``, ``seeds``,
        ``runs`` and, for each metric and for steps, train seconds, peak RSS, ``{"mean",
        "std"}`` (std is the sample standard deviation, None for one seed); ``parameters``.
    """
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["scoring"], r["lr"]), []).append(r)
    rows = []
    for (scoring, lr), rs in groups.items():
        row: dict[str, Any] = {
            "scoring": scoring,
            "lr": lr,
            "seeds": [r["seed"] for r in rs],
            "runs": [r["run"] for r in rs],
            "parameters": rs[0]["parameters"],
        }
        for key in (*_METRICS, "steps", "train_seconds", "epochs", "peak_rss_mb"):
            row[key] = _stats([float(r[key]) for r in rs])
        rows.append(row)
    return rows


def validation_curves(
    summaries: Mapping[str, Sequence[RunSummary]],
) -> dict[str, dict[int, dict[str, float | None]]]:
    """Per scorer of ``summaries`` (scorer -> the summaries of its runs, one per seed), its
    validation WER along training, at every validation step that all of its runs reached:
    scorer -> step (ascending) -> ``{"mean", "std"}`` (sample std, None for one run)."""
    curves: dict[str, dict[int, dict[str, float | None]]] = {}
    for scoring, runs in summaries.items():
        by_step: dict[int, list[float]] = {}
        for summary in runs:
            for v in summary.history:
                by_step.setdefault(v.step, []).append(v.valid_wer)
        curves[scoring] = {
            step: _stats(wers) for step, wers in sorted(by_step.items()) if len(wers) == len(runs)
        }
    return curves


def ranking(scores: dict[str, dict[str, float | None]]) -> list[list[str]]:
    """Scorers from best (lowest mean) to worst, in groups that the spread separates.

    A scorer opens a new group when its mean exceeds the previous scorer's by more than
    the sum of their standard deviations (one-sigma intervals that do not overlap); within
    a group the order is that of the means and is not a finding. Without a spread (one
    run) nothing is separated: one group.

    ``scores``: scorer -> ``{"mean", "std"}`` of one metric (lower is better).

    >>> ranking({"a": {"mean": 0.30, "std": 0.01}, "b": {"mean": 0.31, "std": 0.01},
    ...          "c": {"mean": 0.40, "std": 0.02}})
    [['a', 'b'], ['c']]
    """
    order = sorted(scores, key=lambda k: (scores[k]["mean"], k))
    groups: list[list[str]] = []
    for name in order:
        if groups:
            prev, here = scores[groups[-1][-1]], scores[name]
            a, b = prev["std"], here["std"]
            gap = float(here["mean"] or 0.0) - float(prev["mean"] or 0.0)
            if a is None or b is None or gap <= a + b:
                groups[-1].append(name)
                continue
        groups.append([name])
    return groups


def ranking_text(groups: list[list[str]]) -> str:
    """``a ≈ b < c``: ``<`` where the spread separates neighbours, ``≈`` where it does not.

    >>> ranking_text([["a", "b"], ["c"]])
    'a ≈ b < c'
    """
    return " < ".join(" ≈ ".join(group) for group in groups)


def same_ranking(a: list[list[str]], b: list[list[str]]) -> bool:
    """Whether two rankings have the same groups in the same order (the order inside a
    group is not part of a ranking)."""
    return [set(g) for g in a] == [set(g) for g in b]


def curves_table(curves: dict[str, dict[int, dict[str, float | None]]]) -> str:
    """Markdown table of :func:`validation_curves` (WER in %, one row per step, one column
    per scorer), a ranking column (:func:`ranking_text`), and a last line saying whether the
    ranking changed between the last two validations."""
    names = list(curves)
    steps = sorted(set.intersection(*(set(c) for c in curves.values()))) if curves else []
    rows, ranks = [], []
    for step in steps:
        at = {name: curves[name][step] for name in names}
        ranks.append(ranking(at))
        rows.append([str(step), *(_pm(at[name]) for name in names), ranking_text(ranks[-1])])
    table = _markdown(["step", *names, "ranking (spread-separated)"], rows)
    if len(steps) >= 2:
        verdict = "unchanged" if same_ranking(ranks[-2], ranks[-1]) else "changed"
        table += f"\n\nranking between steps {steps[-2]} and {steps[-1]}: {verdict}"
    return table


def _pm(s: dict[str, float | None], scale: float = 100.0, digits: int = 2) -> str:
    mean, std = s["mean"], s["std"]
    assert mean is not None
    text = f"{scale * mean:.{digits}f}"
    return text + (f" ± {scale * std:.{digits}f}" if std is not None else " (1 seed)")


def format_table(rows: Sequence[dict[str, Any]], beam: int) -> str:
    """Markdown table of :func:`summarize` rows: PER/WER in % as mean ± std over seeds; a
    ``peak lr`` column when the rows' learning rates differ, and beam-search columns when
    ``beam`` > 1 (with beam 1 they would repeat the greedy ones)."""
    with_lr = len({r.get("lr") for r in rows}) > 1
    metrics = [("per_greedy", "test PER greedy (%)"), ("wer_greedy", "test WER greedy (%)")]
    if beam > 1:
        metrics += [
            ("per_beam", f"test PER beam {beam} (%)"),
            ("wer_beam", f"test WER beam {beam} (%)"),
        ]
    head = ["scoring", *(["peak lr"] if with_lr else []), "seeds", "steps"]
    head += [title for _, title in metrics]
    head += ["train time (min)", "peak RSS (MiB)", "parameters"]
    lines = []
    for r in rows:
        cells = [r["scoring"], *([f"{r['lr']:g}"] if with_lr else [])]
        cells += [str(len(r["seeds"])), _pm(r["steps"], 1, 0)]
        cells += [_pm(r[key]) for key, _ in metrics]
        cells += [_pm(r["train_seconds"], 1 / 60, 1), _pm(r["peak_rss_mb"], 1, 0)]
        lines.append([*cells, f"{r['parameters']:,}"])
    return _markdown(head, lines)


def budget_line(cfg: TrainConfig) -> str:
    """Which budget a comparison used: equal steps or equal time."""
    if cfg.time_budget is not None:
        return (
            f"budget: equal time, {cfg.time_budget:g} min per run (each run turns it into "
            "steps from its own warm-up)"
        )
    return f"budget: equal steps, {cfg.steps} optimizer steps per run"


def alignment_figures(run_dirs: dict[str, Path], words: list[str]) -> dict[str, Figure]:
    """Per word, the teacher-forced attention of every scorer, side by side.

    The pronunciation is the word's first dictionary entry, or the first model's prediction
    for a word outside the dictionary; words with letters the models never saw are skipped.

    ``run_dirs`` maps a scorer name to a run folder (or checkpoint) of it; the figures come
    by lower-cased word, in the order of ``words``.

    Raises:
        CheckpointError: a checkpoint cannot be read.
    """
    models = {s: load_model(resolve_checkpoint(d)) for s, d in run_dirs.items()}
    model0, letters, phones, tcfg = next(iter(models.values()))
    lexicon = load_lexicon(tcfg.data, tcfg.keep_stress).lexicon
    figures: dict[str, Figure] = {}
    for word in words:
        w = word.lower()
        if not w or any(c not in letters.stoi for c in w):
            continue
        pron = list(lexicon[w][0]) if w in lexicon else predict(model0, [w], letters, phones)[0][0]
        mats = [forced_alignment(m, w, pron, lt, ph) for m, lt, ph, _ in models.values()]
        figures[w] = alignments_figure(mats, list(models), w, pron)
    return figures
