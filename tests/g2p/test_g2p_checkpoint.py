"""Checkpoints are read with ``weights_only=True``: crafted or foreign files are refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnscore.cli.g2p import main
from attnscore.g2p.checkpoint import (
    FORMAT,
    Checkpoint,
    CheckpointError,
    load_checkpoint,
    load_model,
    resolve_checkpoint,
    save_checkpoint,
)
from attnscore.g2p.config import ModelConfig, TrainConfig
from attnscore.g2p.data import Vocab
from attnscore.g2p.model import G2PModel
from attnscore.g2p.state import TrainState


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


@pytest.mark.parametrize(
    "kind", ["text", "truncated", "list", "empty", "other-dict", "old-format", "incomplete"]
)
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
    elif kind == "old-format":
        torch.save({"format": "attnscore.g2p/1", "model": {}}, path)
    elif kind == "incomplete":
        torch.save({"format": "attnscore.g2p/2", "model": {}}, path)
    else:
        torch.save({"weights": torch.zeros(3)}, path)
    assert main(["predict", str(path), "abc"]) == 2
    err = _one_line(capsys)
    assert str(path) in err and "checkpoint" in err
    if kind == "old-format":
        assert "but got format 'attnscore.g2p/1'" in err
    if kind == "incomplete":
        assert "it lacks ['optimizer', 'train_config', 'letters', 'phones', 'state', 'rng']" in err


def _checkpoint(hidden: int = 4) -> Checkpoint:
    """An untrained checkpoint of a tiny model (letters a, b; phonemes AE, B)."""
    cfg = TrainConfig(model=ModelConfig(emb=4, enc_hidden=hidden, dec_hidden=hidden))
    letters, phones = Vocab("ab"), Vocab(["AE", "B"])
    model = G2PModel(cfg.model, len(letters), len(phones))
    return Checkpoint(
        config=cfg,
        letters=letters,
        phones=phones,
        state=TrainState(),
        model=model.state_dict(),
        optimizer=torch.optim.Adam(model.parameters()).state_dict(),
        rng=torch.get_rng_state(),
    )


def _save(path: Path, hidden: int = 4) -> None:
    save_checkpoint(path, _checkpoint(hidden))


def test_load_checkpoint_of_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError, match=r"expected a checkpoint file, but got '.*nothing\.pt'"
    ):
        load_checkpoint(tmp_path / "nothing.pt")


def test_checkpoint_errors_are_value_errors_not_usage_errors() -> None:
    from attnscore.cli._usage import UsageError

    assert issubclass(CheckpointError, ValueError)
    assert not issubclass(CheckpointError, UsageError)


def test_run_folder_evaluates_with_best_then_last(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError, match=r"expected best\.pt or last\.pt in '.*', but got neither"
    ):
        resolve_checkpoint(tmp_path)
    _save(tmp_path / "last.pt")
    assert resolve_checkpoint(tmp_path) == tmp_path / "last.pt"
    _save(tmp_path / "best.pt")
    assert resolve_checkpoint(tmp_path) == tmp_path / "best.pt"
    assert resolve_checkpoint(tmp_path / "last.pt") == tmp_path / "last.pt"
    model, letters, phones, cfg = load_model(tmp_path)
    assert letters.itos[4:] == ["a", "b"] and phones.itos[4:] == ["AE", "B"]
    assert cfg.model.enc_hidden == 4 and not model.training


def test_weights_that_do_not_fit_the_stored_config_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "x.pt"
    _save(path, hidden=4)
    ckpt = torch.load(path, weights_only=True)
    ckpt["train_config"]["model"]["enc_hidden"] = 6  # as if edited by hand
    torch.save(ckpt, path)
    assert main(["predict", str(path), "ab"]) == 2
    assert _one_line(capsys).endswith(f"{path}: expected weights that fit its model config")


def test_the_model_config_is_stored_once(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    _save(path, hidden=6)
    payload = torch.load(path, weights_only=True)
    assert payload["format"] == FORMAT == "attnscore.g2p/3"
    assert "model_config" not in payload and payload["train_config"]["model"]["enc_hidden"] == 6
    ckpt = load_checkpoint(path)
    assert ckpt.config.model.enc_hidden == 6 and ckpt.averaged is None
    assert ckpt.letters.itos == _checkpoint().letters.itos


def test_a_format_2_checkpoint_still_loads(tmp_path: Path) -> None:
    """Version 2 files (written before the model config was stored once) keep loading."""
    path = tmp_path / "old.pt"
    ckpt = _checkpoint(hidden=5)
    payload = ckpt.to_payload()
    payload["format"] = "attnscore.g2p/2"
    payload["model_config"] = ckpt.config.model.to_dict()
    torch.save(payload, path)
    model, _, phones, cfg = load_model(path)
    assert cfg.model.enc_hidden == 5 and model.encoder.hidden_size == 5
    assert phones.itos[4:] == ["AE", "B"]


def test_entries_of_the_wrong_type_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "x.pt"
    payload = _checkpoint().to_payload()
    payload["letters"], payload["state"] = "ab", [1]
    torch.save(payload, path)
    assert main(["predict", str(path), "ab"]) == 2
    err = _one_line(capsys)
    assert f"{path}: expected a g2p checkpoint, but its ['letters', 'state'] have types" in err
    assert "['str', 'list']" in err
