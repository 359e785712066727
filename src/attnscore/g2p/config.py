"""The configurations of a G2P run: :class:`ModelConfig` inside :class:`TrainConfig`.

This module is the one place that turns parsed command-line options into a configuration
(:func:`train_config_from_args`). Both configurations are stored in checkpoints as plain
dicts (:meth:`TrainConfig.to_dict`), so a checkpoint holds no pickled objects.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .._usage import UsageError

DEFAULT_STEPS = 15_000
"""Step budget when neither ``--steps`` nor ``--time-budget`` is given."""


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of :class:`~attnscore.g2p.model.G2PModel`.

    The vocabulary sizes are not part of it: they come from the data (and the vocabularies
    stored in a checkpoint).
    """

    scoring: str = "cosine"
    """A scorer name of :mod:`attnscore.registry`."""
    emb: int = 64
    enc_hidden: int = 256
    dec_hidden: int = 256
    enc_layers: int = 1
    dropout: float = 0.1
    input_feeding: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (checkpoint- and JSON-safe)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Inverse of :meth:`to_dict`; unknown keys are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on (stored in its checkpoints and summary)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    out: str = "runs/g2p"
    data: str | None = None
    keep_stress: bool = False
    batch_size: int = 128
    lr: float = 2e-3
    lr_min_ratio: float = 0.05
    warmup_steps: int = 200
    """Linear learning-rate warm-up over the first steps (then cosine decay)."""
    label_smoothing: float = 0.1
    clip: float = 5.0
    steps: int | None = None
    """The budget in optimizer steps; the learning-rate schedule is defined over it."""
    time_budget: float | None = None
    """Minutes; turned once into ``steps`` by a timed warm-up (recorded in the run)."""
    average_last: float = 0.2
    """Average the weights over this final fraction of the steps (0: no averaging)."""
    seed: int = 0
    eval_every: int = 1000
    ckpt_every: int = 200
    eval_words: int | None = None
    max_train_words: int | None = None
    threads: int = 1
    nprocs: int = 1
    device: str = "cpu"
    progress: bool = True

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict, the model config nested under ``"model"``."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`; unknown keys are ignored."""
        names = {f.name for f in fields(cls)} - {"model"}
        return cls(
            model=ModelConfig.from_dict(d.get("model", {})),
            **{k: v for k, v in d.items() if k in names},
        )


def train_config_from_args(
    args: argparse.Namespace, *, scoring: str | None = None, seed: int | None = None
) -> TrainConfig:
    """The :class:`TrainConfig` of parsed ``train``/``compare`` options.

    Args:
        args: options added by :func:`attnscore.g2p.cli.add_parser`.
        scoring: the scorer (default ``args.scoring``).
        seed: the seed (default ``args.seed``).

    Raises:
        UsageError: both ``--steps`` and ``--time-budget``, or ``--nprocs`` with CUDA.
    """
    if args.steps is not None and args.time_budget is not None:
        raise UsageError("expected --steps or --time-budget, but got both")
    nprocs = args.nprocs
    if nprocs > 1 and args.device != "cpu":
        raise UsageError(f"--nprocs: expected 1 with --device {args.device}, but got {nprocs}")
    model = ModelConfig(
        scoring=scoring if scoring is not None else args.scoring,
        emb=args.emb,
        enc_hidden=args.hidden,
        dec_hidden=args.hidden,
        enc_layers=args.enc_layers,
        dropout=args.dropout,
        input_feeding=args.input_feeding,
    )
    steps = args.steps
    if steps is None and args.time_budget is None:
        steps = DEFAULT_STEPS
    threads = args.threads if args.threads is not None else max(1, usable_cores() // nprocs)
    return TrainConfig(
        model=model,
        out=args.out,
        data=args.data,
        keep_stress=args.keep_stress,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        label_smoothing=args.label_smoothing,
        steps=steps,
        time_budget=args.time_budget,
        average_last=args.average_last,
        seed=seed if seed is not None else args.seed,
        eval_every=args.eval_every,
        ckpt_every=args.ckpt_every,
        eval_words=args.eval_words,
        max_train_words=args.max_train_words,
        threads=threads,
        nprocs=nprocs,
        device=args.device,
        progress=not args.no_progress,
    )
