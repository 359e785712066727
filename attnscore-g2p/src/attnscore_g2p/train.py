"""Training a G2P model: in this process, under torchrun, or in several spawned processes.

:func:`train` is the entry point (``attnscore g2p train``); :func:`run_training` is one
process's share (the parts it runs are listed in :mod:`attnscore_g2p`). glibc keeps freed
memory while training (:func:`attnscore._memory.keep_freed_memory`).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

from attnscore._memory import keep_freed_memory

from .budget import steps_for_time_budget
from .checkpoint import load_checkpoint
from .config import TrainConfig
from .dataset import prepare_data
from .distributed import distributed_env, process_group, spawn
from .loop import Trainer
from .summary import Budget, RunSummary


def run_training(
    cfg: TrainConfig,
    rank: int = 0,
    world_size: int = 1,
    init_method: str | None = None,
    resume: bool = False,
) -> RunSummary:
    """Train (or resume) process ``rank`` of ``world_size`` (above 1: DDP on gloo, joined at
    ``init_method``, default ``env://``) of a run; return its summary, which the main
    process also writes to ``out/summary.json``.

    The budget is ``cfg.steps``, or ``cfg.time_budget`` minutes turned into steps once by
    :func:`~attnscore_g2p.budget.steps_for_time_budget`. ``resume`` continues from
    ``out/last.pt`` if it exists (with its configuration and budget).

    Raises:
        ValueError: no budget, or data that cannot be trained on.
        CheckpointError: an unreadable ``last.pt`` on resume.
    """
    torch.set_num_threads(max(1, cfg.threads))
    keep_freed_memory()
    with process_group(rank, world_size, init_method):
        return _train(cfg, rank, world_size, resume)


def _train(cfg: TrainConfig, rank: int, world_size: int, resume: bool) -> RunSummary:
    last = Path(cfg.out) / "last.pt"
    ckpt = load_checkpoint(last) if resume and last.is_file() else None
    if ckpt is not None:  # the stored run, on this machine's threads, device and display
        cfg = replace(
            ckpt.config, out=cfg.out, threads=cfg.threads, progress=cfg.progress, device=cfg.device
        )
    if cfg.steps is None and cfg.time_budget is None:
        raise ValueError("Expected a budget (steps or time_budget), but got neither instead")
    is_main = rank == 0
    torch.manual_seed(cfg.seed)
    data = prepare_data(cfg, report=is_main and ckpt is None)
    if cfg.steps is None:
        budget = steps_for_time_budget(cfg, data, rank, world_size)
        cfg = replace(cfg, steps=budget.steps)
        if is_main:
            print(
                f"time budget {cfg.time_budget:g} min -> {budget.steps} steps "
                f"({(budget.seconds_per_step or 0.0) * 1000:.0f} ms/step measured)",
                file=sys.stderr,
            )
    else:
        budget = Budget(steps=cfg.steps, time_budget_min=cfg.time_budget)
    if is_main and ckpt is None and cfg.warmup_steps >= budget.steps:
        print(
            f"warning: the warm-up ({cfg.warmup_steps} steps) spans the whole run of "
            f"{budget.steps} steps, so the learning rate never reaches its peak {cfg.lr:g} "
            "(--warmup-steps sets it)",
            file=sys.stderr,
        )
    trainer = Trainer(cfg, data, rank, world_size, resume_from=ckpt)
    trainer.run()
    summary = trainer.summary(budget)
    if is_main:
        summary.write(Path(cfg.out))
    return summary


def _worker(rank: int, init_method: str, cfg: TrainConfig, nprocs: int, resume: bool) -> None:
    run_training(cfg, rank=rank, world_size=nprocs, init_method=init_method, resume=resume)


def train(cfg: TrainConfig, resume: bool = False) -> RunSummary | None:
    """Train as configured: in this process, under torchrun, or in ``cfg.nprocs`` processes;
    ``resume`` continues from ``cfg.out/last.pt`` if it exists. Returns the summary on the
    main process, None on the other torchrun ranks.

    Raises:
        ValueError: as :func:`run_training`.
    """
    rank, world_size = distributed_env()
    if world_size > 1:
        summary = run_training(cfg, rank=rank, world_size=world_size, resume=resume)
        return summary if rank == 0 else None
    if cfg.nprocs > 1:
        spawn(_worker, cfg.nprocs, cfg, cfg.nprocs, resume)
        return RunSummary.read(Path(cfg.out))
    return run_training(cfg, resume=resume)
