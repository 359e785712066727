"""Checkpoint files: written atomically, read without unpickling anything but plain data.

A checkpoint holds only tensors, numbers, strings, lists and dicts (the vocabularies as
lists, the configurations and training state as dicts) and is read with
``torch.load(..., weights_only=True)``: a file holding anything else, or a file that is not a
checkpoint at all, is refused with one :class:`~attnscore._usage.UsageError` line.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from .._usage import UsageError
from .config import ModelConfig, TrainConfig
from .data import Vocab
from .model import G2PModel
from .state import TrainState

FORMAT = "attnscore.g2p/2"
"""Value of the ``"format"`` key of every checkpoint this version writes."""

_REQUIRED = ("model", "model_config", "train_config", "letters", "phones", "state")


def save_checkpoint(
    path: Path,
    *,
    model: G2PModel,
    optimizer: torch.optim.Optimizer,
    cfg: TrainConfig,
    letters: Vocab,
    phones: Vocab,
    state: TrainState,
    rng: torch.Tensor,
    averaged: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write everything needed to resume or evaluate a run to ``path``, atomically.

    The file is written to ``path.tmp`` and renamed, so a process killed while saving leaves
    the previous checkpoint intact. ``averaged`` (the averaged weights, when the run
    averages) is what :func:`load_model` returns for evaluation.
    """
    payload: dict[str, Any] = {
        "format": FORMAT,
        "model": model.state_dict(),
        "model_config": model.cfg.to_dict(),
        "optimizer": optimizer.state_dict(),
        "train_config": cfg.to_dict(),
        "letters": list(letters.itos),
        "phones": list(phones.itos),
        "state": state.to_dict(),
        "rng": rng,
    }
    if averaged is not None:
        payload["averaged"] = averaged
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (``weights_only=True``).

    Raises:
        UsageError: ``path`` is missing, holds anything but plain data (refused, never
            unpickled), is not a PyTorch file (text, truncated, empty), or is a PyTorch file
            of another kind (a list, a bare state dict, another format version).
    """
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"expected a checkpoint file, but got {str(p)!r}")
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UsageError(
            f"{p}: refused: the file holds objects other than tensors, numbers, strings, "
            "lists and dicts (not an attnscore g2p checkpoint; nothing was unpickled)"
        ) from None
    except Exception:
        raise UsageError(
            f"{p}: expected an attnscore g2p checkpoint, but the file is not a readable "
            "PyTorch file (truncated, or another format)"
        ) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        got = f"a {type(ckpt).__name__}" if not isinstance(ckpt, dict) else "another dict"
        if isinstance(ckpt, dict) and "format" in ckpt:
            got = f"format {ckpt['format']!r}"
        raise UsageError(
            f"{p}: expected an attnscore g2p checkpoint (format {FORMAT!r}), but got {got}"
        )
    missing = [k for k in _REQUIRED if k not in ckpt]
    if missing:
        raise UsageError(f"{p}: expected a complete g2p checkpoint, but it lacks {missing}")
    out: dict[str, Any] = ckpt
    return out


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint file, or the one a run folder evaluates with.

    In a run folder that is ``last.pt`` when the run averaged its weights (its final
    average), else ``best.pt`` (lowest validation WER), else ``last.pt``.

    Raises:
        UsageError: neither a file nor a run folder with a checkpoint.
    """
    p = Path(path)
    if p.is_dir():
        for name in ("best.pt", "last.pt"):
            if (p / name).is_file():
                return p / name
        raise UsageError(f"expected best.pt or last.pt in {str(p)!r}, but got neither")
    if not p.is_file():
        raise UsageError(f"expected a checkpoint file or run folder, but got {str(p)!r}")
    return p


def load_model(path: str | Path, device: str = "cpu") -> tuple[G2PModel, Vocab, Vocab, TrainConfig]:
    """``(model in eval mode on device, letters, phones, train config)`` of a checkpoint.

    The model carries the averaged weights when the checkpoint has them.

    Raises:
        UsageError: as :func:`load_checkpoint`, or weights that do not fit the stored config.
    """
    ckpt = load_checkpoint(resolve_checkpoint(path))
    letters, phones = Vocab.from_itos(ckpt["letters"]), Vocab.from_itos(ckpt["phones"])
    model = G2PModel(ModelConfig.from_dict(ckpt["model_config"]), len(letters), len(phones))
    try:
        model.load_state_dict(ckpt.get("averaged") or ckpt["model"])
    except RuntimeError:
        raise UsageError(f"{path}: expected weights that fit its model config") from None
    model.to(device).eval()
    return model, letters, phones, TrainConfig.from_dict(ckpt["train_config"])
