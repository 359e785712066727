"""Atomic checkpoint files and loading a trained model back for evaluation."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .data import Vocab
from .model import G2PModel, ModelConfig

if TYPE_CHECKING:
    from .train import Data, TrainConfig


def save_checkpoint(
    path: Path,
    model: G2PModel,
    opt: torch.optim.Optimizer,
    cfg: TrainConfig,
    data: Data,
    state: dict[str, Any],
    rng: torch.Tensor,
    py_rng: object,
) -> None:
    """Write everything needed to resume or evaluate to ``path``, atomically.

    The file is written to ``path.tmp`` and renamed, so a process killed while saving leaves
    the previous checkpoint intact.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": "attnscore.g2p/1",
        "model": model.state_dict(),
        "model_config": model.cfg.to_dict(),
        "optimizer": opt.state_dict(),
        "train_config": asdict(cfg),
        "letters": data.letters.itos,
        "phones": data.phones.itos,
        "state": state,
        "rng": rng,
        "py_rng": py_rng,
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"Expected a checkpoint file, but got {str(p)!r} instead")
    ckpt: dict[str, Any] = torch.load(p, map_location="cpu", weights_only=False)
    if not isinstance(ckpt, dict) or ckpt.get("format") != "attnscore.g2p/1":
        raise ValueError(f"Expected an attnscore g2p checkpoint, but got {str(p)!r} instead")
    return ckpt


def _vocab(itos: list[str]) -> Vocab:
    v = Vocab([])
    v.itos = list(itos)
    v.stoi = {t: i for i, t in enumerate(v.itos)}
    return v


def load_model(path: str | Path) -> tuple[G2PModel, Vocab, Vocab, dict[str, Any]]:
    """``(model in eval mode, letters, phones, train_config dict)`` from a checkpoint."""
    ckpt = load_checkpoint(path)
    model = G2PModel(ModelConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    model.eval()
    return model, _vocab(ckpt["letters"]), _vocab(ckpt["phones"]), ckpt["train_config"]
