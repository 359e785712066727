"""The learning-rate schedule: linear warm-up, then cosine decay over the step budget."""

from __future__ import annotations

import math

from .config import TrainConfig


def lr_at(cfg: TrainConfig, step: int, total: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based) of a budget of ``total`` steps.

    Linear warm-up over ``cfg.warmup_steps``, then cosine decay from ``cfg.lr`` to
    ``cfg.lr * cfg.lr_min_ratio`` at the last step.

    >>> cfg = TrainConfig(lr=1.0, lr_min_ratio=0.1, warmup_steps=2)
    >>> [round(lr_at(cfg, s, 5), 3) for s in range(5)]
    [0.5, 1.0, 1.0, 0.55, 0.1]
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(total - cfg.warmup_steps - 1, 1)
    p = min(max((step - cfg.warmup_steps) / span, 0.0), 1.0)
    return cfg.lr * (cfg.lr_min_ratio + (1 - cfg.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))
