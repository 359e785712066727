"""Checkpoints are read with ``weights_only=True``: crafted or foreign files are refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnscore.g2p.cli import main


class _WritesAFile:
    """Unpickling this object (without weights_only) creates the file ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def _crafted(tmp_path: Path, target: Path) -> Path:
    ckpt = tmp_path / "evil.pt"
    torch.save({"format": "attnscore.g2p/2", "model": {}, "payload": _WritesAFile(target)}, ckpt)
    return ckpt


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "\x1b" not in err
    assert len(err.splitlines()) == 1, err
    return err


def test_crafted_pickle_is_refused_and_never_executed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "pwned"
    ckpt = _crafted(tmp_path, target)
    # the payload is live: an unsafe load would run it (checked in a child process)
    probe = tmp_path / "probe"
    torch.save({"payload": _WritesAFile(probe)}, tmp_path / "live.pt")
    code = (
        "import sys, torch; sys.path.insert(0, sys.argv[2]); "
        "torch.load(sys.argv[1], weights_only=False)"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "live.pt"), str(Path(__file__).parent)],
        capture_output=True,
        check=False,
    )
    assert probe.exists(), "the crafted payload must be live for this test to mean anything"

    for argv in (["predict", str(ckpt), "abc"], ["eval", str(ckpt)]):
        assert main(argv) == 2
        err = _one_line(capsys)
        assert "refused" in err and str(ckpt) in err
        assert not target.exists()


def _env() -> dict[str, str]:
    """This checkout's package first on the path (not another installed copy)."""
    import attnscore

    src = str(Path(attnscore.__file__).resolve().parents[1])
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])),
    }


def test_crafted_pickle_through_python_m(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    ckpt = _crafted(tmp_path, target)
    proc = subprocess.run(
        [sys.executable, "-m", "attnscore.g2p", "predict", str(ckpt), "abc"],
        capture_output=True,
        text=True,
        check=False,
        env=_env(),
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert proc.stdout == ""
    assert not target.exists()


@pytest.mark.parametrize("kind", ["text", "truncated", "list", "empty", "other-dict"])
def test_files_that_are_not_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    path = tmp_path / "x.pt"
    if kind == "text":
        path.write_text("hello world\n")
    elif kind == "truncated":
        torch.save({"format": "attnscore.g2p/2", "w": torch.zeros(1000)}, path)
        path.write_bytes(path.read_bytes()[:500])
    elif kind == "list":
        torch.save([1, 2, 3], path)
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        torch.save({"weights": torch.zeros(3)}, path)
    assert main(["predict", str(path), "abc"]) == 2
    err = _one_line(capsys)
    assert str(path) in err and "checkpoint" in err
