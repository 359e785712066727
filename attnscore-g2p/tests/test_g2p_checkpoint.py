"""Checkpoints are read with ``weights_only=True``: crafted or foreign files are refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnscore_g2p.checkpoint import (
    FORMAT,
    Checkpoint,
    CheckpointError,
    load_checkpoint,
    load_model,
    resolve_checkpoint,
    save_checkpoint,
)
from attnscore_g2p.cli import main
from attnscore_g2p.config import ModelConfig, TrainConfig
from attnscore_g2p.data import Vocab
from attnscore_g2p.model import G2PModel
from attnscore_g2p.state import TrainState


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
    """This checkout's packages first on the path (not other installed copies)."""
    import attnscore
    import attnscore_g2p

    src = [str(Path(m.__file__).resolve().parents[1]) for m in (attnscore_g2p, attnscore)]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [*src, os.environ.get("PYTHONPATH")])),
    }


def test_crafted_pickle_through_python_m(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    ckpt = _crafted(tmp_path, target)
    proc = subprocess.run(
        [sys.executable, "-m", "attnscore_g2p", "predict", str(ckpt), "abc"],
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
    err = _one_line(capsys)
    assert f"{path}: expected weights that fit its model config" in err
    assert "(encoder.weight_ih_l0 of shape (18, 4)), but got shape (12, 4)" in err


def test_the_model_config_is_stored_once(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    _save(path, hidden=6)
    payload = torch.load(path, weights_only=True)
    assert payload["format"] == FORMAT == "attnscore.g2p/4"
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


def _edited(tmp_path: Path, edit) -> Path:
    """A checkpoint file whose plain data ``edit(payload)`` changed, as a hand could."""
    path = tmp_path / "edited.pt"
    payload = _checkpoint().to_payload()
    edit(payload)
    torch.save(payload, path)
    return path


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def edit(payload):
        d = payload
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set("averaged", "abc"), "its ['averaged'] have types ['str']"),
        (_set("averaged", [1.0]), "its ['averaged'] have types ['list']"),
        (_set("train_config", "model", "enc_hidden", "abc"),
         "train_config.model.enc_hidden: expected int, but got 'abc'"),
        (_set("train_config", "model", "enc_hidden", 2.5),
         "train_config.model.enc_hidden: expected int, but got 2.5"),
        (_set("train_config", "model", "enc_hidden", 10**6),
         "train_config.model.enc_hidden: expected between 1 and 65536, but got 1000000"),
        (_set("train_config", "model", "enc_hidden", 0),
         "train_config.model.enc_hidden: expected between 1 and 65536, but got 0"),
        (_set("train_config", "model", "dropout", "x"),
         "train_config.model.dropout: expected float, but got 'x'"),
        (_set("train_config", "model", "scoring", "nope"),
         "train_config.model.scoring: expected one of additive, "),
        (_set("train_config", "model", [1]), "train_config.model: expected a dict, but got a list"),
        (_set("train_config", "precision", 16), "train_config.precision: expected str, but got 16"),
        (_set("state", "step", -1), "state.step: expected non-negative, but got -1"),
        (_set("letters", ["<pad>", 3]), "letters: expected a list of strings"),
        (_set("model", "out.bias", [0.0]), "model['out.bias']: expected a floating-point tensor"),
        (_set("rng", torch.zeros(3)), "rng: expected a 1-d uint8 tensor"),
    ],
)  # fmt: skip
def test_each_bad_entry_is_named_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit, message: str
) -> None:
    path = _edited(tmp_path, edit)
    assert main(["predict", str(path), "ab"]) == 2
    err = _one_line(capsys)
    assert f"{path}: expected " in err and message in err


def test_two_bad_entries_are_both_named(tmp_path: Path) -> None:
    def edit(payload):
        payload["train_config"]["model"].update(emb="x", dropout=2.0)

    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(_edited(tmp_path, edit))
    assert "model.emb: expected int" in str(caught.value)
    assert "model.dropout: expected in [0, 1), but got 2.0" in str(caught.value)


def test_sizes_the_weights_do_not_have_are_refused_before_allocating(tmp_path: Path) -> None:
    """A config naming 60000-wide layers over 4-wide weights: the 43 GB model is never
    built (its shapes are worked out on the meta device)."""
    path = _edited(tmp_path, _set("train_config", "model", "enc_hidden", 60000))
    with pytest.raises(CheckpointError, match=r"of shape \(180000, 4\)\), but got shape \(12, 4\)"):
        load_checkpoint(path)


def test_flipped_bytes_in_the_weights_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "x.pt"
    ckpt = _checkpoint(hidden=8)
    save_checkpoint(path, ckpt)
    data = bytearray(path.read_bytes())
    weights = ckpt.model["encoder.weight_hh_l0"].numpy().tobytes()  # 24 x 8 float32
    at = data.find(weights)
    assert at > 0 and data.find(weights, at + 1) < 0
    for i in range(at, at + 64):
        data[i] ^= 0x01  # 64 bytes of the weights, each a little off: still finite
    path.write_bytes(bytes(data))
    assert main(["predict", str(path), "ab"]) == 2
    err = _one_line(capsys)
    assert "the weights do not match the digest written when the checkpoint was saved" in err


@pytest.mark.parametrize("seed", range(4))
def test_64_flipped_bytes_anywhere_are_refused(tmp_path: Path, seed: int) -> None:
    import random

    path = tmp_path / "x.pt"
    _save(path)
    data = bytearray(path.read_bytes())
    rng = random.Random(seed)
    for i in rng.sample(range(len(data)), 64):
        data[i] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError):
        load_checkpoint(path)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: float
) -> None:
    """Saved as they are (a digest that matches): the values themselves are refused."""
    path = tmp_path / "x.pt"
    ckpt = _checkpoint()
    ckpt.model = {k: torch.full_like(t, value) for k, t in ckpt.model.items()}
    save_checkpoint(path, ckpt)
    assert main(["predict", str(path), "ab"]) == 2
    err = _one_line(capsys)
    assert "refused: the weights model['" in err and "hold NaN or infinity (and " in err


def test_a_format_3_checkpoint_without_a_digest_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "old.pt"
    payload = _checkpoint(hidden=5).to_payload()
    payload["format"] = "attnscore.g2p/3"
    del payload["digest"]
    torch.save(payload, path)
    assert load_checkpoint(path).config.model.enc_hidden == 5


def test_a_digest_of_other_weights_is_refused(tmp_path: Path) -> None:
    path = _edited(tmp_path, _set("digest", "sha256:" + "0" * 64))
    with pytest.raises(CheckpointError, match="do not match the digest"):
        load_checkpoint(path)
