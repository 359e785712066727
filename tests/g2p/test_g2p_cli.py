from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnscore.g2p.cli import main


def _train_args(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train", "--data", str(data), "--out", str(out), "--epochs", "1", "--hidden", "16",
        "--emb", "8", "--batch-size", "32", "--eval-every", "0", "--no-progress", *extra,
    ]  # fmt: skip


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err.splitlines()[-1]


def test_train_eval_predict(
    toy_dict: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(_train_args(toy_dict, out, "--scoring", "general")) == 0
    assert (out / "last.pt").is_file() and (out / "summary.json").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["scoring"] == "general" and summary["peak_rss_mb"] > 0
    capsys.readouterr()

    res_file = tmp_path / "res.json"
    assert main(["eval", str(out), "--beam", "2", "--json", str(res_file)]) == 0
    text = capsys.readouterr().out
    assert "test greedy: PER" in text and "test beam=2: PER" in text
    res = json.loads(res_file.read_text())
    assert 0 <= res["greedy"]["wer"] <= 1

    fig = tmp_path / "att.png"
    assert main(["predict", str(out), "abba", "Mosk", "--heatmap", str(fig)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("abba\t") and "\nmosk\t" in text
    assert (tmp_path / "att-abba.png").is_file() and (tmp_path / "att-mosk.png").is_file()


def test_bad_input_is_one_line_and_exit_2(
    toy_dict: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_train_args(tmp_path / "missing.dict", tmp_path / "r")) == 2
    assert "Expected a cmudict-format file" in _one_line_error(capsys)

    assert main(["eval", str(tmp_path / "nothing")]) == 2
    assert "Expected a checkpoint file or run directory" in _one_line_error(capsys)

    assert main(_train_args(toy_dict, tmp_path / "r", "--scoring", "bogus")) == 2
    assert "invalid choice" in _one_line_error(capsys)

    assert main(_train_args(toy_dict, tmp_path / "r", "--epochs", "0")) == 2
    assert "Expected a positive integer" in _one_line_error(capsys)

    empty = tmp_path / "empty.dict"
    empty.write_text("only-a-word\n")
    assert main(_train_args(empty, tmp_path / "r")) == 2
    assert "Expected at least one valid entry" in _one_line_error(capsys)

    assert main(_train_args(toy_dict, tmp_path / "r2")) == 0
    capsys.readouterr()
    assert main(["predict", str(tmp_path / "r2"), "qu!z", "--heatmap", ""]) == 2
    assert "Expected words made of the training letters" in _one_line_error(capsys)


def test_compare_writes_table_and_figures(
    toy_dict: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cmp"
    argv = [
        "compare", "--data", str(toy_dict), "--out", str(out), "--scorings", "dot", "cosine",
        "--epochs", "1", "--hidden", "8", "--emb", "8", "--beam", "2", "--eval-every", "0",
        "--no-progress", "--words", "abba", "xyz",
    ]  # fmt: skip
    assert main(argv) == 0
    table = (out / "compare.md").read_text().splitlines()
    assert table[0].startswith("| scoring | test PER greedy")
    assert [row.split("|")[1].strip() for row in table[2:]] == ["dot", "cosine"]
    assert (out / "compare.png").is_file()
    assert (out / "alignment-abba.png").is_file()  # 'xyz' has unknown letters: skipped
    assert not (out / "alignment-xyz.png").exists()
    rows = json.loads((out / "compare.json").read_text())
    assert rows[0]["parameters"] > 0 and rows[1]["train_seconds"] > 0
