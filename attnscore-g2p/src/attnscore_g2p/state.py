"""The state of a training run: where it is, what it measured (stored in checkpoints)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .config import Record, known_fields


@dataclass(frozen=True)
class Validation(Record):
    """One periodic validation of a run (an entry of :attr:`TrainState.history`).

    Attributes:
        step: optimizer steps done when it ran.
        elapsed: training seconds by then.
        train_loss: mean training loss per target token since the previous validation
            (NaN when no step ran since).
        valid_per: phoneme error rate on the validation words (greedy decoding).
        valid_wer: word error rate on the same words.
    """

    step: int
    elapsed: float
    train_loss: float
    valid_per: float
    valid_wer: float


@dataclass(frozen=True)
class AttentionStats(Record):
    """A model's attention on a fixed sample of validation words at one step of its
    training (:mod:`attnscore_g2p.attention_stats` says what each number is)."""

    step: int
    score_std: float
    entropy: float
    max_weight: float


@dataclass
class TrainState(Record):
    """Progress of a training run, saved in every checkpoint and restored on ``--resume``.

    Attributes:
        epoch: epochs completed.
        batch: batches of the current epoch done.
        step: optimizer steps done.
        elapsed: training seconds (wall clock, summed over resumes).
        loss_sum: sum of the per-step training losses since the last validation.
        loss_steps: number of steps in ``loss_sum``.
        best_wer: lowest validation WER so far, or None before the first validation.
        last_eval: step of the last validation (-1: none yet).
        averaged_steps: steps folded into the weight average so far.
        history: the validations so far, oldest first.
        attention: the attention's score spread and entropy on a fixed sample of validation
            words at step 0 and at every validation, oldest first
            (:mod:`attnscore_g2p.attention_stats`).
    """

    epoch: int = 0
    batch: int = 0
    step: int = 0
    elapsed: float = 0.0
    loss_sum: float = 0.0
    loss_steps: int = 0
    best_wer: float | None = None
    last_eval: int = -1
    averaged_steps: int = 0
    history: list[Validation] = field(default_factory=list)
    attention: list[AttentionStats] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainState:
        """Inverse of :meth:`to_dict` (``history`` and ``attention`` as lists of dicts; a
        state saved before ``attention`` existed has none); unknown keys are ignored.

        >>> TrainState.from_dict(TrainState(step=3).to_dict()).step
        3
        """
        history = [Validation.from_dict(h) for h in d.get("history", [])]
        attention = [AttentionStats.from_dict(a) for a in d.get("attention", [])]
        fields = known_fields(cls, d, {"history", "attention"})
        return cls(**fields, history=history, attention=attention)
