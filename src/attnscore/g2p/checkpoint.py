"""Checkpoint files: written atomically, read without unpickling anything but plain data.

A checkpoint (:class:`Checkpoint`) holds only tensors, numbers, strings, lists and dicts
(the vocabularies as lists, the configuration and training state as dicts; the model
configuration once, inside the training configuration) and is read with
``torch.load(..., weights_only=True)``: a file holding anything else, or a file that is not
a checkpoint at all, is refused with one :class:`CheckpointError`.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import TrainConfig
from .data import Vocab
from .model import G2PModel
from .state import TrainState

FORMAT = "attnscore.g2p/3"
"""Value of the ``"format"`` key of every checkpoint this version writes."""
READABLE_FORMATS = ("attnscore.g2p/2", FORMAT)
"""The formats :func:`load_checkpoint` reads. Version 2 also stored the model config on
its own (``"model_config"``, a copy of ``train_config["model"]``); version 3 stores it once."""

_ENTRIES: dict[str, type] = {
    "model": dict,
    "optimizer": dict,
    "train_config": dict,
    "letters": list,
    "phones": list,
    "state": dict,
    "rng": torch.Tensor,
}
"""The entries of a checkpoint and their types (``"averaged"``, a dict, is optional)."""


class CheckpointError(ValueError):
    """A file that is not a readable attnscore g2p checkpoint, or a run folder without one."""


@dataclass
class Checkpoint:
    """Everything needed to resume or evaluate a run.

    Attributes:
        config: the run's configuration (the model's included).
        letters: the letter vocabulary.
        phones: the phoneme vocabulary.
        state: where the run is.
        model: the model's ``state_dict``.
        optimizer: the optimizer's ``state_dict``.
        rng: torch's CPU random state when it was saved.
        averaged: the weight average over the final steps (the weights to evaluate with),
            when the run averages and has reached them.
    """

    config: TrainConfig
    letters: Vocab
    phones: Vocab
    state: TrainState
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: torch.Tensor
    averaged: dict[str, torch.Tensor] | None = None

    def to_payload(self) -> dict[str, Any]:
        """The plain-data dict written to the file: ``format``, ``model``, ``optimizer``,
        ``train_config``, ``letters``, ``phones``, ``state``, ``rng`` and, when there is one,
        ``averaged``; tensors, numbers, strings, lists and dicts only (what ``weights_only``
        loading accepts)."""
        payload: dict[str, Any] = {
            "format": FORMAT,
            "model": self.model,
            "optimizer": self.optimizer,
            "train_config": self.config.to_dict(),
            "letters": list(self.letters.itos),
            "phones": list(self.phones.itos),
            "state": self.state.to_dict(),
            "rng": self.rng,
        }
        if self.averaged is not None:
            payload["averaged"] = self.averaged
        return payload

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> Checkpoint:
        """Inverse of :meth:`to_payload` (format 2 read too), for a payload that
        :func:`load_checkpoint` checked.

        Raises:
            ValueError: vocabularies that do not start with the special tokens.
        """
        return cls(
            config=TrainConfig.from_dict(payload["train_config"]),
            letters=Vocab.from_itos(payload["letters"]),
            phones=Vocab.from_itos(payload["phones"]),
            state=TrainState.from_dict(payload["state"]),
            model=payload["model"],
            optimizer=payload["optimizer"],
            rng=payload["rng"],
            averaged=payload.get("averaged"),
        )


def save_checkpoint(path: Path, checkpoint: Checkpoint) -> None:
    """Write ``checkpoint`` to ``path``, atomically: the file is written to ``path.tmp`` and
    renamed, so a process killed while saving leaves the previous checkpoint intact."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(checkpoint.to_payload(), tmp)
    os.replace(tmp, path)


def _read_payload(p: Path) -> dict[str, Any]:
    """The checked plain-data dict of checkpoint file ``p``."""
    if not p.is_file():
        raise CheckpointError(f"expected a checkpoint file, but got {str(p)!r}")
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"{p}: refused: the file holds objects other than tensors, numbers, strings, "
            "lists and dicts (not an attnscore g2p checkpoint; nothing was unpickled)"
        ) from None
    except Exception:
        raise CheckpointError(
            f"{p}: expected an attnscore g2p checkpoint, but the file is not a readable "
            "PyTorch file (truncated, or another format)"
        ) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") not in READABLE_FORMATS:
        got = f"a {type(ckpt).__name__}" if not isinstance(ckpt, dict) else "another dict"
        if isinstance(ckpt, dict) and "format" in ckpt:
            got = f"format {ckpt['format']!r}"
        raise CheckpointError(
            f"{p}: expected an attnscore g2p checkpoint (format {FORMAT!r}), but got {got}"
        )
    missing = [k for k in _ENTRIES if k not in ckpt]
    if missing:
        raise CheckpointError(f"{p}: expected a complete g2p checkpoint, but it lacks {missing}")
    wrong = [k for k, kind in _ENTRIES.items() if not isinstance(ckpt[k], kind)]
    if wrong:
        raise CheckpointError(
            f"{p}: expected a g2p checkpoint, but its {wrong} have types "
            f"{[type(ckpt[k]).__name__ for k in wrong]}"
        )
    out: dict[str, Any] = ckpt
    return out


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read the checkpoint file ``path`` written by :func:`save_checkpoint`
    (``weights_only=True``); files of format version 2 (:data:`READABLE_FORMATS`) are read
    too.

    Raises:
        CheckpointError: ``path`` is missing, holds anything but plain data (refused, never
            unpickled), is not a PyTorch file (text, truncated, empty), or is a PyTorch file
            of another kind (a list, a bare state dict, another format version, entries
            missing or of the wrong type).
        ValueError: vocabularies that do not start with the special tokens.
    """
    return Checkpoint.from_payload(_read_payload(Path(path)))


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint file ``path``, or the one the run folder ``path`` evaluates with:
    ``best.pt`` (lowest validation WER) when there is one, else ``last.pt``.

    Raises:
        CheckpointError: neither a file nor a run folder with a checkpoint.
    """
    p = Path(path)
    if p.is_dir():
        for name in ("best.pt", "last.pt"):
            if (p / name).is_file():
                return p / name
        raise CheckpointError(f"expected best.pt or last.pt in {str(p)!r}, but got neither")
    if not p.is_file():
        raise CheckpointError(f"expected a checkpoint file or run folder, but got {str(p)!r}")
    return p


def load_model(path: str | Path, device: str = "cpu") -> tuple[G2PModel, Vocab, Vocab, TrainConfig]:
    """The model of a checkpoint file or run folder (:func:`resolve_checkpoint`), ready to
    decode: ``(model in eval mode on device, letters, phones, train config)``. The model
    carries the averaged weights when the checkpoint has them.

    Raises:
        CheckpointError: as :func:`load_checkpoint`, or weights that do not fit the stored
            config.
    """
    ckpt = load_checkpoint(resolve_checkpoint(path))
    model = G2PModel(ckpt.config.model, len(ckpt.letters), len(ckpt.phones))
    try:
        model.load_state_dict(ckpt.averaged or ckpt.model)
    except RuntimeError:
        raise CheckpointError(f"{path}: expected weights that fit its model config") from None
    model.to(device).eval()
    return model, ckpt.letters, ckpt.phones, ckpt.config
