"""What a finished training run reports: :class:`RunSummary`, written to ``OUT/summary.json``.

The file is plain JSON with the keys of :class:`RunSummary`'s fields (``budget`` and
``config`` nested, ``history`` a list), so tools other than attnscore can read it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from .config import Record, TrainConfig
from .files import write_text_atomic
from .state import AttentionStats, Validation

SUMMARY_FILE = "summary.json"
"""The summary's file name in a run folder."""


@dataclass(frozen=True)
class Budget(Record):
    """The step budget a run followed, and how a time budget was turned into it.

    Attributes:
        steps: the optimizer steps the learning-rate schedule spans.
        time_budget_min: the time budget in minutes, or None for a step budget.
        seconds_per_step: measured by the warm-up of a time budget (else None).
        seconds_per_validation: measured likewise (0.0 without periodic validation).
        warmup_seconds: the warm-up's own seconds.
    """

    steps: int
    time_budget_min: float | None = None
    seconds_per_step: float | None = None
    seconds_per_validation: float | None = None
    warmup_seconds: float | None = None


@dataclass(frozen=True)
class RunSummary(Record):
    """The outcome of a training run (:func:`attnscore_g2p.train.train`).

    Attributes:
        scoring: the attention scorer's registry name.
        seed: the run's seed.
        steps: optimizer steps done.
        epochs: passes over the training pairs (fractional).
        train_seconds: training wall-clock seconds, summed over resumes.
        parameters: trainable parameters of the model.
        peak_rss_mb: peak resident memory of the (main) training process, in MiB.
        best_valid_wer: the lowest validation WER, or None without validation.
        history: every validation, oldest first.
        attention: the attention's score spread and entropy at step 0 and at every
            validation (:mod:`attnscore_g2p.attention_stats`); empty in summaries written
            before they were recorded.
        world_size: training processes (DDP when above 1).
        threads: torch threads per process.
        device: where it trained.
        budget: the budget it followed.
        config: the whole configuration.
    """

    scoring: str
    seed: int
    steps: int
    epochs: float
    train_seconds: float
    parameters: int
    peak_rss_mb: float
    best_valid_wer: float | None
    history: list[Validation]
    attention: list[AttentionStats]
    world_size: int
    threads: int
    device: str
    budget: Budget
    config: TrainConfig

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunSummary:
        """Inverse of :meth:`to_dict` (as read from ``summary.json``); unknown keys are
        ignored.

        Raises:
            KeyError: a field is missing.
        """
        nested = {"history", "attention", "budget", "config"}
        names = {f.name for f in fields(cls)} - nested
        return cls(
            **{k: d[k] for k in names},
            history=[Validation.from_dict(h) for h in d["history"]],
            attention=[AttentionStats.from_dict(a) for a in d.get("attention", [])],
            budget=Budget.from_dict(d["budget"]),
            config=TrainConfig.from_dict(d["config"]),
        )

    def write(self, run: Path) -> None:
        """Write ``run/summary.json`` into the run folder ``run`` (it exists)."""
        write_text_atomic(Path(run) / SUMMARY_FILE, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def read(cls, run: Path) -> RunSummary:
        """The summary of a finished run folder ``run``: its ``summary.json``.

        Raises:
            FileNotFoundError: ``run`` has no ``summary.json`` (not a finished run).
            ValueError: a ``summary.json`` that is not a run summary.
        """
        path = Path(run) / SUMMARY_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"expected a finished run folder with summary.json, but got {str(run)!r}"
            )
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(
                f"{path}: expected a summary written by `attnscore g2p train`, but it cannot "
                f"be read ({type(err).__name__}: {err})"
            ) from None
