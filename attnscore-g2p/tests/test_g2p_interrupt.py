"""``g2p train`` interrupted: exit 130, one line that says whether a checkpoint is there."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnscore_g2p import _handlers as handlers
from attnscore_g2p.cli import main

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


def test_ctrl_c_while_saving_keeps_the_previous_checkpoint_and_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from attnscore_g2p import checkpoint as ckpt_mod
    from attnscore_g2p.config import ModelConfig, TrainConfig
    from attnscore_g2p.data import Vocab
    from attnscore_g2p.model import G2PModel
    from attnscore_g2p.state import TrainState

    def _checkpoint(hidden: int = 4) -> ckpt_mod.Checkpoint:
        cfg = TrainConfig(model=ModelConfig(emb=4, enc_hidden=hidden, dec_hidden=hidden))
        model = G2PModel(cfg.model, 6, 6)
        return ckpt_mod.Checkpoint(
            config=cfg, letters=Vocab("ab"), phones=Vocab(["AE", "B"]), state=TrainState(),
            model=model.state_dict(), optimizer={}, rng=torch.get_rng_state(),
        )  # fmt: skip

    path = tmp_path / "last.pt"
    ckpt_mod.save_checkpoint(path, _checkpoint())
    before = path.read_bytes()
    real_save = torch.save

    def interrupted_save(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        f.truncate(100)  # half written when Ctrl-C arrives
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        ckpt_mod.save_checkpoint(path, _checkpoint(hidden=6))
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"] and path.read_bytes() == before
