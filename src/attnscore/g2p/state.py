"""The state of a training run: where it is, what it measured (stored in checkpoints)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class TrainState:
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
        history: one entry per validation: step, elapsed, train_loss, valid_per, valid_wer.
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
    history: list[dict[str, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of numbers and lists (checkpoint- and JSON-safe)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainState:
        """Inverse of :meth:`to_dict`; unknown keys are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
