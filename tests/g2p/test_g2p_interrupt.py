"""``g2p train`` interrupted: exit 130, one line that says whether a checkpoint is there."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnscore.cli import _g2p_handlers as handlers
from attnscore.cli.g2p import main

ARGS = ["--steps", "14", "--hidden", "16", "--emb", "8", "--no-progress", "--device", "cpu"]


@pytest.mark.parametrize("checkpoint", [False, True])
def test_interrupted_training_says_what_is_kept(
    toy_dict: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    checkpoint: bool,
) -> None:
    out = tmp_path / "run"

    def interrupted(cfg, resume=False):  # Ctrl-C before (or after) the first checkpoint
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")
        if checkpoint:
            (out / "last.pt").write_bytes(b"")
        raise KeyboardInterrupt

    monkeypatch.setattr(handlers, "train", interrupted)
    assert main(["train", "--data", str(toy_dict), "--out", str(out), *ARGS]) == 130
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    if checkpoint:
        assert "the last checkpoint is kept" in line and "--resume" in line
    else:
        assert "before the first checkpoint" in line and "nothing to resume" in line
        assert "--resume" not in line and "--overwrite" in line
