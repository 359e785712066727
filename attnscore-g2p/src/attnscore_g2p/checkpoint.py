"""Checkpoint files: written atomically, read without unpickling anything but plain data.

A checkpoint (:class:`Checkpoint`) holds only tensors, numbers, strings, lists and dicts
(the vocabularies as lists, the configuration and training state as dicts; the model
configuration once, inside the training configuration) and is read with
``torch.load(..., weights_only=True)``: a file holding anything else, or a file that is not
a checkpoint at all, is refused with one :class:`CheckpointError`.

What it holds is checked before anything is built from it: every entry's type and range
(:mod:`attnscore_g2p.schema`), the weights' shapes against the model its configuration
describes (worked out without allocating it), the weights' SHA-256 digest written at save
(a file changed or damaged since is refused), and the weights' values (NaN or infinity
refused).
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import TrainConfig
from .data import Vocab
from .files import write_atomic
from .model import G2PModel
from .schema import record_problems
from .state import TrainState

FORMAT = "attnscore.g2p/4"
"""Value of the ``"format"`` key of every checkpoint this version writes. A name, not a module
path (nothing in a checkpoint is one): it kept ``attnscore.g2p`` when the task moved to
attnscore-g2p, so files written before still read."""
READABLE_FORMATS = ("attnscore.g2p/2", "attnscore.g2p/3", FORMAT)
"""The formats :func:`load_checkpoint` reads. Version 2 also stored the model config on
its own (``"model_config"``, a copy of ``train_config["model"]``); version 3 stores it once;
version 4 adds ``"digest"``, the SHA-256 of the weights (:func:`weights_digest`)."""

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
        payload["digest"] = weights_digest(self.model, self.averaged)
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


def weights_digest(
    model: dict[str, torch.Tensor], averaged: dict[str, torch.Tensor] | None = None
) -> str:
    """``"sha256:<hex>"`` of the weights (``model``, then ``averaged``): each tensor's name,
    dtype, shape and bytes, in name order. Written at save, compared at load.

    >>> w = {"w": torch.ones(2)}
    >>> weights_digest(w) == weights_digest({"w": torch.ones(2)}) != weights_digest(w, w)
    True
    """
    h = hashlib.sha256()
    for part, weights in (("model", model), ("averaged", averaged or {})):
        for name in sorted(weights):
            t = weights[name].detach().cpu().contiguous()
            h.update(f"{part}/{name}/{t.dtype}/{tuple(t.shape)}\n".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return "sha256:" + h.hexdigest()


def save_checkpoint(path: Path, checkpoint: Checkpoint) -> None:
    """Write ``checkpoint`` to ``path``, atomically (:func:`~attnscore_g2p.files.write_atomic`):
    a process stopped while saving leaves the previous checkpoint intact and no partial file."""
    payload = checkpoint.to_payload()
    write_atomic(path, lambda f: torch.save(payload, f))


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
    if ckpt.get("averaged") is not None and not isinstance(ckpt["averaged"], dict):
        wrong.append("averaged")
    if wrong:
        raise CheckpointError(
            f"{p}: expected a g2p checkpoint, but its {wrong} have types "
            f"{[type(ckpt[k]).__name__ for k in wrong]}"
        )
    problems = record_problems(TrainConfig, ckpt["train_config"], "train_config")
    problems += record_problems(TrainState, ckpt["state"], "state")
    rng = ckpt["rng"]
    if rng.dtype != torch.uint8 or rng.ndim != 1:
        problems.append(
            f"rng: expected a 1-d uint8 tensor (torch's random state), but got "
            f"{rng.dtype} of shape {tuple(rng.shape)}"
        )
    for vocab in ("letters", "phones"):
        if not all(isinstance(token, str) for token in ckpt[vocab]):
            problems.append(f"{vocab}: expected a list of strings")
    for entry in ("model", "averaged"):
        for name, t in (ckpt.get(entry) or {}).items():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                problems.append(f"{entry}[{name!r}]: expected a floating-point tensor")
    if problems:
        raise CheckpointError(f"{p}: expected a valid g2p checkpoint, but " + "; ".join(problems))
    if ckpt["format"] == FORMAT:
        digest = weights_digest(ckpt["model"], ckpt.get("averaged"))
        if ckpt.get("digest") != digest:
            raise CheckpointError(
                f"{p}: refused: the weights do not match the digest written when the "
                "checkpoint was saved (the file was changed or damaged since)"
            )
    for entry in ("model", "averaged"):
        bad = [n for n, t in (ckpt.get(entry) or {}).items() if not bool(t.isfinite().all())]
        if bad:
            raise CheckpointError(
                f"{p}: refused: the weights {entry}[{bad[0]!r}] hold NaN or infinity"
                + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
            )
    out: dict[str, Any] = ckpt
    return out


def _check_shapes(path: Path, ckpt: Checkpoint, weights: dict[str, torch.Tensor]) -> None:
    """Refuse weights whose names or shapes differ from the model the configuration
    describes, worked out on the ``meta`` device (nothing allocated, however large the
    sizes the file names)."""
    with torch.device("meta"):
        expected = G2PModel(ckpt.config.model, len(ckpt.letters), len(ckpt.phones)).state_dict()
    for name, t in expected.items():
        got = weights.get(name)
        if got is None or got.shape != t.shape:
            shape = "nothing" if got is None else f"shape {tuple(got.shape)}"
            raise CheckpointError(
                f"{path}: expected weights that fit its model config ({name} of shape "
                f"{tuple(t.shape)}), but got {shape}"
            )
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise CheckpointError(
            f"{path}: expected weights that fit its model config, but got {extra[0]!r} too"
        )


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read the checkpoint file ``path`` written by :func:`save_checkpoint`
    (``weights_only=True``); files of format version 2 (:data:`READABLE_FORMATS`) are read
    too.

    Raises:
        CheckpointError: ``path`` is missing, holds anything but plain data (refused, never
            unpickled), is not a PyTorch file (text, truncated, empty), or is a PyTorch file
            of another kind (a list, a bare state dict, another format version, entries
            missing or of the wrong type); an entry of the configuration or state of the
            wrong type or out of its range (each named); weights that differ from the
            digest written at save; weights holding NaN or infinity.
        ValueError: vocabularies that do not start with the special tokens.
    """
    p = Path(path)
    ckpt = Checkpoint.from_payload(_read_payload(p))
    for weights in (ckpt.model, ckpt.averaged):
        if weights is not None:
            _check_shapes(p, ckpt, weights)
    return ckpt


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
    model.load_state_dict(ckpt.averaged or ckpt.model)  # shapes checked by load_checkpoint
    model.to(device).eval()
    return model, ckpt.letters, ckpt.phones, ckpt.config
