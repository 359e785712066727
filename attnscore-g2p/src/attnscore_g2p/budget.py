"""A time budget turned into a step budget, once, before training, by a timed warm-up.

The budget of a run is a number of optimizer steps, and the learning-rate schedule is
defined over it, so a run does not depend on the machine's load: the same configuration,
seed and thread count give the same losses and metrics. A time budget is turned into that
count once (:func:`steps_for_time_budget`), and the count is what the run records and
follows.
"""

from __future__ import annotations

import time

import torch

from .config import TrainConfig
from .data import length_batches
from .dataset import Data
from .distributed import broadcast_from_main
from .evaluate import evaluate
from .stepper import Stepper
from .summary import Budget

WARMUP_STEPS = 24
"""Optimizer steps timed (after 4 untimed ones) to turn a time budget into steps."""
_UNTIMED = 4
_SAMPLE_WORDS = 200


def steps_for_time_budget(
    cfg: TrainConfig, data: Data, rank: int = 0, world_size: int = 1
) -> Budget:
    """Turn ``cfg.time_budget`` minutes into a step count, once, from a timed warm-up.

    Runs :data:`WARMUP_STEPS` optimizer steps (after 4 untimed ones) on a throwaway copy of
    the model and times one greedy validation on up to 200 words, then divides the budget
    left after the warm-up by the time of a step plus its share of the periodic validation.
    The random state is restored afterwards, so the training that follows is the one a
    ``--steps`` run with that count would do. Under DDP (process ``rank`` of
    ``world_size``), rank 0's count is used everywhere. Returns the step count with the
    measured seconds per step, per validation and of the warm-up.

    Raises:
        ValueError: ``cfg.time_budget`` is None.
    """
    if cfg.time_budget is None:
        raise ValueError("Expected a configuration with a time budget, but got none instead")
    t0 = time.perf_counter()
    rng = torch.get_rng_state()
    probe = Stepper(cfg, data, rank, world_size)
    count = WARMUP_STEPS + _UNTIMED
    batches = length_batches(data.train_pairs, cfg.batch_size, cfg.seed + 7919, 0)
    batches = (batches * (1 + count // max(len(batches), 1)))[:count]
    for idx in batches[:_UNTIMED]:
        probe.step(idx, cfg.lr)
    t1 = time.perf_counter()
    for idx in batches[_UNTIMED:]:
        probe.step(idx, cfg.lr)
    per_step = (time.perf_counter() - t1) / max(len(batches) - _UNTIMED, 1)
    per_eval = 0.0
    if cfg.eval_every > 0:
        valid = data.splits["valid"] or data.splits["train"]
        n_words = min(len(valid), cfg.eval_words or len(valid))
        sample = dict(sorted(valid.items())[:_SAMPLE_WORDS])
        t2 = time.perf_counter()
        evaluate(probe.model, sample, data.letters, data.phones)
        per_eval = (time.perf_counter() - t2) * n_words / max(len(sample), 1)
    torch.set_rng_state(rng)
    warmup_s = time.perf_counter() - t0
    left = max(cfg.time_budget * 60 - warmup_s, 0.0)
    per = per_step + (per_eval / cfg.eval_every if cfg.eval_every > 0 else 0.0)
    steps = broadcast_from_main(max(1, int(left / per)), world_size)
    return Budget(
        steps=steps,
        time_budget_min=cfg.time_budget,
        seconds_per_step=per_step,
        seconds_per_validation=per_eval,
        warmup_seconds=warmup_s,
    )
