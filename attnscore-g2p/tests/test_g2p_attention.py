"""Issue 20: the attention statistics a run records (score spread, entropy, peak weight) and
``g2p compare --lr-grid``. References are computed here: by hand for the row statistics, and
from each word's teacher-forced alignment (``forced_alignment``) for a model's."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from attnscore_g2p import compare
from attnscore_g2p.attention_stats import attention_stats, row_stats, sample
from attnscore_g2p.checkpoint import load_checkpoint
from attnscore_g2p.cli import main
from attnscore_g2p.config import ModelConfig, TrainConfig
from attnscore_g2p.dataset import prepare_data
from attnscore_g2p.evaluate import forced_alignment
from attnscore_g2p.stepper import build_model
from attnscore_g2p.summary import RunSummary
from attnscore_g2p.train import train
from g2p_toy import toy_lexicon_text


def test_row_stats_by_hand() -> None:
    """Row 0: scores 1, 2, 3 over 3 valid keys, uniform weights; row 1: one-hot weights;
    row 2 is not selected (its numbers must not count); the 4th key is padding."""
    scores = torch.tensor([[[1.0, 2.0, 3.0, 50.0], [0.0, 0.0, 4.0, -9.0], [7.0, 7.0, 7.0, 7.0]]])
    third = 1 / 3
    weights = torch.tensor([[[third, third, third, 0.0], [0.0, 0.0, 1.0, 0.0], [1, 0, 0, 0]]])
    rows = torch.tensor([[True, True, False]])
    keys = torch.tensor([[True, True, True, False]])
    score_std, entropy, max_weight = row_stats(scores, weights, rows, keys)
    std0, std1 = math.sqrt(2 / 3), math.sqrt(32 / 9)  # population std of (1,2,3), (0,0,4)
    assert score_std == pytest.approx((std0 + std1) / 2)
    assert entropy == pytest.approx(math.log(3) / 2)
    assert max_weight == pytest.approx((third + 1.0) / 2)


@pytest.mark.parametrize(
    ("scoring", "feeding"),
    [("dot", False), ("general", False), ("additive", False), ("cosine", False), ("dot", True)],
)
def test_model_stats_agree_with_teacher_forced_alignments(
    toy_dict: Path, scoring: str, feeding: bool
) -> None:
    """Entropy and peak weight from each word's own forced alignment; the score spread from
    the log weights (log softmax moves every score of a row by one constant). With input
    feeding the attention runs once per step: every step's weights count."""
    torch.manual_seed(0)
    model_cfg = ModelConfig(
        scoring=scoring, emb=8, enc_hidden=16, dec_hidden=16, input_feeding=feeding
    )
    cfg = TrainConfig(model=model_cfg)
    cfg = TrainConfig.from_dict({**cfg.to_dict(), "data": str(toy_dict)})
    data = prepare_data(cfg, report=False)
    model = build_model(cfg, data).train()
    words = sample(data.splits["train"], words=6)
    stats = attention_stats(model, words, data.letters, data.phones, step=3)
    assert stats.step == 3 and model.training  # its mode is given back
    stds, entropies, peaks = [], [], []
    for word, pron in words:
        w = forced_alignment(model, word, list(pron), data.letters, data.phones).double().numpy()
        assert w.shape == (len(pron) + 1, len(word))
        stds += list(np.log(w).std(axis=1))
        entropies += list(-(w * np.log(w)).sum(axis=1))
        peaks += list(w.max(axis=1))
    assert stats.score_std == pytest.approx(np.mean(stds), rel=1e-4)
    assert stats.entropy == pytest.approx(np.mean(entropies), rel=1e-5)
    assert stats.max_weight == pytest.approx(np.mean(peaks), rel=1e-5)


def _args(data: Path, *extra: str) -> list[str]:
    return [
        "--data", str(data), "--hidden", "8", "--emb", "8", "--batch-size", "32",
        "--no-progress", "--threads", "1", "--nprocs", "1", "--device", "cpu", *extra,
    ]  # fmt: skip


def test_training_records_attention_at_initialisation_and_each_validation(
    toy_dict: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--steps", "8", "--eval-every", "4", "--scoring", "dot"]
    assert main([*argv, *_args(toy_dict)]) == 0
    summary = RunSummary.read(out)
    assert [a.step for a in summary.attention] == [0, 4, 8]
    assert all(a.score_std > 0 and 0 < a.max_weight <= 1 for a in summary.attention)
    # a summary written before the statistics existed still reads
    raw = json.loads((out / "summary.json").read_text())
    del raw["attention"]
    assert RunSummary.from_dict(raw).attention == []
    # the checkpoint keeps them (a resumed run continues the list)
    assert load_checkpoint(out / "last.pt").state.attention == summary.attention


def _train_here(cfg: TrainConfig) -> RunSummary:
    train(cfg)
    return RunSummary.read(Path(cfg.out))


LR_GRID = [
    "compare", "--scorings", "dot", "--seeds", "0", "1", "--steps", "6", "--eval-every", "0",
    "--beam", "1", "--lr-grid", "1e-4", "3e-2", "--words", "abba",
]  # fmt: skip


@pytest.fixture(scope="module")
def lr_grid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """A finished ``g2p compare --lr-grid``, shared by the tests below: the lexicon, the
    comparison's folder and what it printed. Its three runs train in this process (the
    spawned process g2p compare gives each run: tests/cli/test_cli_bad_input_table.py)."""
    folder = tmp_path_factory.mktemp("lr-grid")
    data = folder / "toy.dict"
    data.write_text(toy_lexicon_text())
    out = folder / "cmp"
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(compare, "train_in_subprocess", _train_here)
        assert main([*LR_GRID, "--out", str(out), *_args(data)]) == 0
    return data, out, printed.getvalue()


def test_compare_lr_grid_trains_the_other_seeds_at_the_best_rate(
    lr_grid: tuple[Path, Path, str],
) -> None:
    _, out, printed = lr_grid
    wer = {
        lr: RunSummary.read(out / f"dot-lr{lr}-seed0").best_valid_wer for lr in ("0.0001", "0.03")
    }
    best = min(wer, key=lambda lr: (wer[lr], lr != "0.0001"))  # the first of equals
    assert sorted(p.name for p in out.glob("dot-*")) == sorted(
        ["dot-lr0.0001-seed0", "dot-lr0.03-seed0", f"dot-lr{best}-seed1"]
    )
    assert RunSummary.read(out / f"dot-lr{best}-seed1").config.lr == float(best)
    grid = (out / "lr-grid.md").read_text()
    assert f"**{100 * wer[best]:.2f}**" in grid and grid.count("**") == 2
    assert f"dot: peak lr {float(best):g}" in printed
    rows = json.loads((out / "compare.json").read_text())
    assert [(r["scoring"], r["lr"], r["seeds"]) for r in rows] == [("dot", float(best), [0, 1])]
    assert (out / "attention.png").is_file()
    report = (out / "compare.md").read_text()
    assert "beam" not in report  # beam 1: greedy columns only
    assert "test WER (greedy) ranking, spread-separated: dot\n" in report
    curves = json.loads((out / "validation.json").read_text())
    history = [RunSummary.read(out / f"dot-lr{best}-seed{s}").history for s in (0, 1)]
    steps = sorted({v.step for v in history[0]} & {v.step for v in history[1]})
    assert [int(k) for k in curves["dot"]] == steps and steps
    wers = [next(v.valid_wer for v in h if v.step == steps[-1]) for h in history]
    assert curves["dot"][str(steps[-1])]["mean"] == pytest.approx(sum(wers) / 2)


def test_compare_refuses_a_finished_run_of_another_recipe(
    lr_grid: tuple[Path, Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    data, out, _ = lr_grid
    runs = sorted(out.glob("dot-*"))
    before = {run: (run / "summary.json").read_bytes() for run in runs}
    tables = {p: p.read_bytes() for p in out.iterdir() if p.is_file()}
    # --overwrite replaces the finished comparison's tables, never a run of another recipe
    argv = [*LR_GRID, "--out", str(out), "--overwrite", *_args(data, "--dropout", "0.3")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "differs in dropout" in err
    assert {run: (run / "summary.json").read_bytes() for run in runs} == before
    assert {p: p.read_bytes() for p in out.iterdir() if p.is_file()} == tables
