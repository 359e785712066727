"""``attnscore g2p export``: the G2P model leaves Python (issue 36, item 2).

A tiny run is trained for a few seconds, exported to one ONNX file, and
``examples/g2p_onnx_decode.py`` pronounces 50 words with it in a process that imports
neither torch nor attnscore (numpy and onnxruntime only): the same phonemes as
``attnscore g2p predict RUN --beam 1``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from attnscore_g2p.cli import main
from g2p_toy import toy_lexicon_text

pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")

SCRIPT = Path(__file__).parents[2] / "examples" / "g2p_onnx_decode.py"

# Runs the example as `python SCRIPT ARGS...` would, then checks what it imported.
_RUN_WITHOUT_TORCH = """
import runpy
import sys

sys.argv = sys.argv[1:]
code = 0
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as stop:
    code = stop.code
assert "torch" not in sys.modules and "attnscore" not in sys.modules, "imported torch"
sys.exit(code)
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder trained long enough to emit varied phonemes and ``</s>``."""
    folder = tmp_path_factory.mktemp("g2p")
    data = folder / "toy.dict"
    data.write_text(toy_lexicon_text())
    args = [
        "train", "--data", str(data), "--out", str(folder / "run"), "--steps", "120",
        "--lr", "0.01", "--hidden", "16", "--emb", "8", "--batch-size", "32",
        "--eval-every", "0", "--no-progress", "--threads", "1", "--nprocs", "1",
        "--device", "cpu", "--scoring", "additive",
    ]  # fmt: skip
    assert main(args) == 0
    return folder / "run"


def _decode(model: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _RUN_WITHOUT_TORCH, str(SCRIPT), str(model), *args],
        capture_output=True,
        text=True,
    )


def test_onnx_greedy_decoding_gives_predicts_phonemes(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "g2p.onnx"
    out.write_bytes(b"mine")  # replaced with --overwrite (refused without it: below)
    assert main(["export", str(run), "--out", str(out), "--max-letters", "6", "--overwrite"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["g2p.onnx"]  # no temporary file left
    words = [line.split()[0] for line in toy_lexicon_text(400, seed=7).splitlines()][::8][:50]
    words[0] = words[0].upper()  # letters are lower-cased, as predict does
    assert main(["predict", str(run), "--beam", "1", *words]) == 0
    want = capsys.readouterr().out
    done = _decode(out, *words)
    assert done.returncode == 0, done.stderr
    assert done.stdout == want
    # the run emits varied phonemes and </s> (a constant decoder would prove little)
    prons = [line.split("\t")[1] for line in want.splitlines()]
    assert len(set(prons)) > 25 and min(len(p.split()) for p in prons) < 16


def test_export_refuses_to_overwrite_and_bad_paths(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    existing = tmp_path / "g2p.onnx"
    existing.write_bytes(b"keep")
    for args in (
        ["export", str(run), "--out", str(existing)],
        ["export", str(run), "--out", str(tmp_path / "g2p.txt")],
        ["export", str(tmp_path / "no-run"), "--out", str(tmp_path / "new.onnx")],
        ["export", str(run), "--out", str(tmp_path / "new.onnx"), "--max-letters", "0"],
    ):
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert existing.read_bytes() == b"keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g2p.onnx"]


def test_decoder_script_one_line_errors(run: Path, tmp_path: Path) -> None:
    not_ours = tmp_path / "other.onnx"
    not_ours.write_bytes(b"not a model")
    for model, words in ((not_ours, ["abba"]), (tmp_path / "missing.onnx", ["abba"])):
        done = _decode(model, *words)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
