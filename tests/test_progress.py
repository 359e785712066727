from __future__ import annotations

import io
import sys

import pytest

from attnscore._progress import Progress


def test_plain_lines_without_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now fails
    stream = io.StringIO()
    bar = Progress(10, "train x", stream=stream, interval=0.0)
    for step in range(1, 11):
        bar.update(step, loss=1.5, tok_s=25_000.4)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 10
    assert lines[-1] == "train x: step 10/10 loss 1.5 tok_s 25000"


def test_disabled_prints_nothing_but_write(capsys: pytest.CaptureFixture[str]) -> None:
    stream = io.StringIO()
    bar = Progress(5, "train", enabled=False, stream=stream)
    bar.update(5, loss=1.0)
    bar.write("step 5: done")
    bar.close()
    assert stream.getvalue() == ""
    assert capsys.readouterr().out == "step 5: done\n"


def test_tqdm_bar_when_installed() -> None:
    pytest.importorskip("tqdm")
    stream = io.StringIO()
    bar = Progress(4, "train y", stream=stream, initial=1)
    bar.update(4, loss=0.5)
    bar.write("hello")
    bar.close()
    text = stream.getvalue()
    assert "train y" in text and "4/4" in text and "hello" in text
