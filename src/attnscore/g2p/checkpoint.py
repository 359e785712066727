"""Atomic checkpoint files and loading a trained model back for evaluation.

A checkpoint holds only tensors, numbers, strings, lists and dicts (vocabularies as lists,
configurations as dicts) and is read with ``torch.load(..., weights_only=True)``: a file
holding anything else is refused, never unpickled.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._usage import UsageError
from .data import Vocab
from .model import G2PModel, ModelConfig

if TYPE_CHECKING:
    from .train import Data, TrainConfig

FORMAT = "attnscore.g2p/2"
_REQUIRED = ("model", "model_config", "train_config", "letters", "phones", "state")


def save_checkpoint(
    path: Path,
    model: G2PModel,
    opt: torch.optim.Optimizer,
    cfg: TrainConfig,
    data: Data,
    state: dict[str, Any],
    rng: torch.Tensor,
) -> None:
    """Write everything needed to resume or evaluate to ``path``, atomically.

    The file is written to ``path.tmp`` and renamed, so a process killed while saving leaves
    the previous checkpoint intact.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT,
        "model": model.state_dict(),
        "model_config": model.cfg.to_dict(),
        "optimizer": opt.state_dict(),
        "train_config": asdict(cfg),
        "letters": data.letters.itos,
        "phones": data.phones.itos,
        "state": state,
        "rng": rng,
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"Expected a checkpoint file, but got {str(p)!r} instead")
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UsageError(
            f"{p}: refused: the file holds objects other than tensors, numbers, strings, "
            "lists and dicts (it is not an attnscore g2p checkpoint and was not unpickled)"
        ) from None
    except Exception:  # truncated file, text file, another format: torch's own reasons vary
        raise UsageError(
            f"{p}: expected an attnscore g2p checkpoint, but the file is not a readable "
            "PyTorch checkpoint (truncated, or another format)"
        ) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        got = type(ckpt).__name__ if not isinstance(ckpt, dict) else repr(ckpt.get("format"))
        raise UsageError(
            f"{p}: expected an attnscore g2p checkpoint (format {FORMAT!r}), but got {got}"
        )
    missing = [k for k in _REQUIRED if k not in ckpt]
    if missing:
        raise UsageError(f"{p}: expected a complete g2p checkpoint, but it lacks {missing}")
    out: dict[str, Any] = ckpt
    return out


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
