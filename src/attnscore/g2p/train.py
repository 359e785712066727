"""Training loop: a step budget, periodic validation, checkpoints, resume and DDP (gloo).

The budget is a number of optimizer steps and the learning-rate schedule is defined over
it, so a run does not depend on the machine's load: the same configuration, seed and thread
count give the same losses and metrics. A time budget is turned into a step count once,
before training, from a short timed warm-up (:func:`steps_for_time_budget`), and that count
is what the run records and follows.

Under ``torchrun --nproc_per_node=N`` (or :func:`spawn_training`) every process builds the
same global batches and takes every N-th example of each; the loss of a process is its summed
token loss times N divided by the global number of target tokens, so DDP's gradient average
equals the one-process gradient of the token-mean loss, and N processes follow the one-process
run up to float rounding (dropout masks differ, so compare with ``dropout=0``).
"""

from __future__ import annotations

import copy
import ctypes
import json
import math
import os
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing
from torch import nn

from .checkpoint import load_checkpoint, save_checkpoint
from .config import TrainConfig
from .data import (
    PAD_ID,
    Lexicon,
    Vocab,
    length_batches,
    load_lexicon,
    make_batch,
    pairs,
    split_lexicon,
)
from .evaluate import evaluate
from .model import G2PModel, count_parameters
from .progress import Progress
from .state import TrainState

WARMUP_STEPS = 24
"""Optimizer steps timed (after 4 untimed ones) to turn a time budget into steps."""


@dataclass
class Data:
    """Splits, vocabularies and training pairs of a run."""

    splits: dict[str, Lexicon]
    letters: Vocab
    phones: Vocab
    train_pairs: list[tuple[str, tuple[str, ...]]]


def prepare_data(cfg: TrainConfig, *, report: bool = True) -> Data:
    """Load, split and index the lexicon of ``cfg`` (malformed lines go to stderr).

    Raises:
        ValueError: no valid entry, or an empty training split.
    """
    parsed = load_lexicon(cfg.data, keep_stress=cfg.keep_stress)
    if not parsed.lexicon:
        raise ValueError(f"Expected at least one valid entry in {cfg.data!r}, but got none instead")
    if report and parsed.errors:
        for lineno, msg in parsed.errors[:20]:
            print(f"warning: line {lineno} skipped: {msg}", file=sys.stderr)
        if len(parsed.errors) > 20:
            print(f"warning: {len(parsed.errors) - 20} more malformed lines", file=sys.stderr)
    splits = split_lexicon(parsed.lexicon)
    if cfg.max_train_words is not None:
        keep = sorted(splits["train"])[: cfg.max_train_words]
        splits["train"] = {w: splits["train"][w] for w in keep}
    if not splits["train"]:
        raise ValueError("Expected a non-empty training split, but got no training words instead")
    letters, phones = Vocab.for_lexicon(parsed.lexicon)
    return Data(splits, letters, phones, pairs(splits["train"]))


def build_model(cfg: TrainConfig, data: Data) -> G2PModel:
    """The model of ``cfg.model`` for the vocabularies of ``data`` (on the CPU)."""
    return G2PModel(cfg.model, len(data.letters), len(data.phones))


def lr_at(cfg: TrainConfig, step: int, total: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based) of ``total``.

    Linear warm-up over ``cfg.warmup_steps``, then cosine decay from ``cfg.lr`` to
    ``cfg.lr * cfg.lr_min_ratio`` at the last step.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(total - cfg.warmup_steps - 1, 1)
    p = min(max((step - cfg.warmup_steps) / span, 0.0), 1.0)
    return cfg.lr * (cfg.lr_min_ratio + (1 - cfg.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB, from ``VmHWM`` of /proc/self/status.

    Not ``ru_maxrss``: Linux carries that over fork + exec, so a child would report its
    parent's peak. Returns NaN where /proc is missing.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    return float("nan")  # pragma: no cover


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Ask glibc's ``malloc`` to keep freed blocks of up to 32 MiB for reuse.

    Every training step allocates and frees the same few-MiB buffers (the GRUs' gate
    gradients, for one). By default glibc serves blocks above 128 KiB with ``mmap`` and
    unmaps them on free, so each step faults its buffers in afresh, page by page; on the
    2-core machine this project measures on, a fresh 2.6 MiB zero tensor took 4.6 ms against
    0.18 ms for a reused one. Raising the mmap and trim thresholds keeps the memory in the
    heap for the next step. Process-wide, so it is called when training starts
    (:func:`run_training`), never on import.

    Returns:
        True if glibc took both settings; False elsewhere (no glibc: nothing changes).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def run_training(
    cfg: TrainConfig,
    rank: int = 0,
    world_size: int = 1,
    init_method: str | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Train (or resume) one process of a run; the summary also written to ``out/summary.json``.

    Args:
        cfg: the run's configuration; ``cfg.steps`` is the budget (or ``cfg.time_budget``
            minutes, turned into steps once by :func:`steps_for_time_budget`).
        rank, world_size: process index and count; ``world_size > 1`` uses DDP on gloo.
        init_method: ``torch.distributed`` rendezvous URL (default ``env://`` as torchrun sets).
        resume: continue from ``out/last.pt`` if it exists (its configuration and budget).

    Raises:
        ValueError: no budget, or data that cannot be trained on.
        UsageError: an unreadable ``last.pt`` on resume.
    """
    torch.set_num_threads(max(1, cfg.threads))
    keep_freed_memory()
    distributed = world_size > 1
    if distributed and not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=init_method or "env://", rank=rank, world_size=world_size
        )
    try:
        return _train(cfg, rank, world_size, resume)
    finally:
        if distributed and dist.is_initialized():
            dist.destroy_process_group()


class _Run:
    """The objects of one training process, and the steps it takes with them."""

    def __init__(self, cfg: TrainConfig, data: Data, rank: int, world_size: int) -> None:
        self.cfg, self.data, self.rank, self.world_size = cfg, data, rank, world_size
        self.device = torch.device(cfg.device)
        self.model = build_model(cfg, data).to(self.device)
        # PyTorch's fused Adam: about 5% off a CPU step here (docs/g2p.md, item 4).
        fused = self.device.type in ("cpu", "cuda")
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr, fused=fused)
        self.wrapped: nn.Module = self.model
        if world_size > 1:
            self.wrapped = nn.parallel.DistributedDataParallel(self.model)
        self.loss_fn = nn.CrossEntropyLoss(
            ignore_index=PAD_ID, reduction="sum", label_smoothing=cfg.label_smoothing
        )

    def step(self, idx: list[int], lr: float) -> tuple[int, float]:
        """One optimizer step on the global batch ``idx``: (global target tokens, loss).

        The loss is this process's mean token loss (label smoothing included).
        """
        for g in self.opt.param_groups:
            g["lr"] = lr
        examples = [self.data.train_pairs[i] for i in idx]
        total_tokens = sum(len(p) + 1 for _, p in examples)
        local = examples[self.rank :: self.world_size]
        weight = float(self.world_size) / total_tokens
        if not local:  # fewer examples than processes: contribute a zero gradient
            local, weight = examples[:1], 0.0
        batch = make_batch(local, self.data.letters, self.data.phones)
        dev = self.device
        logits = self.wrapped(batch.src.to(dev), batch.src_lens.to(dev), batch.tgt_in.to(dev))
        loss = self.loss_fn(logits.flatten(0, 1), batch.tgt_out.to(dev).flatten()) * weight
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.clip > 0:
            nn.utils.clip_grad_norm_(self.wrapped.parameters(), self.cfg.clip)
        self.opt.step()
        mean = float(loss.detach()) / weight / batch.num_tokens if weight else 0.0
        return total_tokens, mean


def steps_for_time_budget(
    cfg: TrainConfig, data: Data, rank: int = 0, world_size: int = 1
) -> tuple[int, dict[str, float]]:
    """Turn ``cfg.time_budget`` minutes into a step count, once, from a timed warm-up.

    Runs :data:`WARMUP_STEPS` optimizer steps (after 4 untimed ones) on a throwaway copy of
    the model and times one greedy validation on up to 200 words, then divides the budget
    left after the warm-up by the time of a step plus its share of the periodic validation.
    The random state is restored afterwards, so the training that follows is the one a
    ``--steps`` run with that count would do. Under DDP, rank 0's count is used everywhere.

    Returns:
        ``(steps, record)`` where ``record`` holds the measured seconds per step, seconds per
        validation and the warm-up's own seconds, for the run's summary.
    """
    assert cfg.time_budget is not None
    t0 = time.perf_counter()
    rng = torch.get_rng_state()
    probe = _Run(cfg, data, rank, world_size)
    batches = length_batches(data.train_pairs, cfg.batch_size, cfg.seed + 7919, 0)
    batches = (batches * (1 + (WARMUP_STEPS + 4) // max(len(batches), 1)))[: WARMUP_STEPS + 4]
    for idx in batches[:4]:
        probe.step(idx, cfg.lr)
    t1 = time.perf_counter()
    for idx in batches[4:]:
        probe.step(idx, cfg.lr)
    per_step = (time.perf_counter() - t1) / max(len(batches) - 4, 1)
    per_eval = 0.0
    if cfg.eval_every > 0:
        valid = data.splits["valid"] or data.splits["train"]
        n_words = min(len(valid), cfg.eval_words or len(valid))
        sample = dict(sorted(valid.items())[:200])
        t2 = time.perf_counter()
        evaluate(probe.model, sample, data.letters, data.phones)
        per_eval = (time.perf_counter() - t2) * n_words / max(len(sample), 1)
    torch.set_rng_state(rng)
    warmup_s = time.perf_counter() - t0
    left = max(cfg.time_budget * 60 - warmup_s, 0.0)
    per = per_step + (per_eval / cfg.eval_every if cfg.eval_every > 0 else 0.0)
    steps = max(1, int(left / per))
    if world_size > 1:
        t = torch.tensor([steps], dtype=torch.int64)
        dist.broadcast(t, src=0)
        steps = int(t.item())
    record = {"seconds_per_step": per_step, "seconds_per_validation": per_eval}
    record["warmup_seconds"] = warmup_s
    return steps, record


def _average_into(
    averaged: dict[str, torch.Tensor] | None, model: nn.Module, n: int
) -> dict[str, torch.Tensor]:
    """Fold the weights of ``model`` into the running mean ``averaged`` of ``n - 1`` others."""
    state = model.state_dict()
    if averaged is None:
        return {k: v.detach().clone() for k, v in state.items()}
    for k, v in state.items():
        if v.is_floating_point():
            averaged[k] += (v.detach() - averaged[k]) / n
    return averaged


def _train(cfg: TrainConfig, rank: int, world_size: int, resume: bool) -> dict[str, Any]:
    out = Path(cfg.out)
    last_path = out / "last.pt"
    ckpt = load_checkpoint(last_path) if resume and last_path.is_file() else None
    if ckpt is not None:  # the stored run, on this machine's threads, device and display
        stored = TrainConfig.from_dict(ckpt["train_config"])
        cfg = replace(
            stored, out=cfg.out, threads=cfg.threads, progress=cfg.progress, device=cfg.device
        )
    if cfg.steps is None and cfg.time_budget is None:
        raise ValueError("Expected a budget (steps or time_budget), but got neither instead")
    is_main = rank == 0
    torch.manual_seed(cfg.seed)
    data = prepare_data(cfg, report=is_main and ckpt is None)
    budget: dict[str, float] = {}
    if cfg.steps is None:
        steps, budget = steps_for_time_budget(cfg, data, rank, world_size)
        cfg = replace(cfg, steps=steps)
        if is_main:
            print(
                f"time budget {cfg.time_budget:g} min -> {steps} steps "
                f"({budget['seconds_per_step'] * 1000:.0f} ms/step measured)",
                file=sys.stderr,
            )
    total = int(cfg.steps or 0)
    run = _Run(cfg, data, rank, world_size)
    state = TrainState()
    averaged: dict[str, torch.Tensor] | None = None
    if ckpt is not None:
        run.model.load_state_dict(ckpt["model"])
        run.opt.load_state_dict(ckpt["optimizer"])
        state = TrainState.from_dict(ckpt["state"])
        torch.set_rng_state(ckpt["rng"])
        averaged = ckpt.get("averaged")
    if world_size > 1 and rank > 0:
        # per-rank dropout streams (rank 0's is the checkpointed one); identical to one
        # process when dropout == 0
        torch.manual_seed(cfg.seed + 1000 * rank + state.step)
    avg_start = total - round(cfg.average_last * total) if cfg.average_last > 0 else total
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    steps_per_epoch = len(length_batches(data.train_pairs, cfg.batch_size, cfg.seed, 0))
    progress = Progress(
        total, f"train {cfg.model.scoring}", initial=state.step, enabled=is_main and cfg.progress
    )
    t_start, base_elapsed, tokens = time.perf_counter(), state.elapsed, 0

    def save(path: Path) -> None:
        if is_main:
            save_checkpoint(
                path,
                model=run.model,
                optimizer=run.opt,
                cfg=cfg,
                letters=data.letters,
                phones=data.phones,
                state=state,
                rng=torch.get_rng_state(),
                averaged=averaged,
            )

    def validate() -> None:
        state.last_eval = state.step
        if not is_main:
            return
        model = run.model
        if averaged is not None:
            model = copy.deepcopy(run.model)
            model.load_state_dict(averaged)
        res = evaluate(
            model,
            data.splits["valid"] or data.splits["train"],
            data.letters,
            data.phones,
            max_words=cfg.eval_words,
        )
        loss = state.loss_sum / state.loss_steps if state.loss_steps else float("nan")
        state.loss_sum, state.loss_steps = 0.0, 0
        state.history.append(
            {
                "step": state.step,
                "elapsed": state.elapsed,
                "train_loss": loss,
                "valid_per": res.per,
                "valid_wer": res.wer,
            }
        )
        if state.best_wer is None or res.wer < state.best_wer:
            state.best_wer = res.wer
            save(out / "best.pt")
        progress.write(f"step {state.step}: train loss {loss:.4f}, valid {res.line('greedy')}")

    try:
        while state.step < total:
            batches = length_batches(data.train_pairs, cfg.batch_size, cfg.seed, state.epoch)
            while state.batch < len(batches) and state.step < total:
                n_tok, loss = run.step(batches[state.batch], lr_at(cfg, state.step, total))
                tokens += n_tok
                state.batch += 1
                state.step += 1
                state.loss_sum += loss
                state.loss_steps += 1
                state.elapsed = base_elapsed + time.perf_counter() - t_start
                if state.step > avg_start:
                    state.averaged_steps += 1
                    averaged = _average_into(averaged, run.model, state.averaged_steps)
                progress.update(
                    state.step, loss=loss, tok_s=tokens / (state.elapsed - base_elapsed)
                )
                if cfg.eval_every > 0 and state.step % cfg.eval_every == 0:
                    validate()
                if cfg.ckpt_every > 0 and state.step % cfg.ckpt_every == 0:
                    save(last_path)
            if state.batch >= len(batches):
                state.epoch += 1
                state.batch = 0
    except KeyboardInterrupt:
        save(last_path)
        raise
    finally:
        progress.close()
    if state.last_eval != state.step:
        validate()
    save(last_path)
    summary = {
        "scoring": cfg.model.scoring,
        "seed": cfg.seed,
        "steps": state.step,
        "epochs": state.epoch + state.batch / max(steps_per_epoch, 1),
        "train_seconds": state.elapsed,
        "parameters": count_parameters(run.model),
        "peak_rss_mb": peak_rss_mb(),
        "best_valid_wer": state.best_wer,
        "history": state.history,
        "world_size": world_size,
        "threads": cfg.threads,
        "device": cfg.device,
        "budget": {"steps": total, "time_budget_min": cfg.time_budget, **budget},
        "config": cfg.to_dict(),
    }
    if is_main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for the gloo rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_training(cfg: TrainConfig, nprocs: int, port: int, resume: bool = False) -> None:
    """Run :func:`run_training` in ``nprocs`` processes on 127.0.0.1:``port`` (gloo)."""
    torch.multiprocessing.spawn(  # type: ignore[attr-defined,no-untyped-call]
        _spawn_worker, args=(cfg, nprocs, port, resume), nprocs=nprocs, join=True
    )


def _spawn_worker(rank: int, cfg: TrainConfig, nprocs: int, port: int, resume: bool) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    run_training(
        cfg, rank=rank, world_size=nprocs, init_method=f"tcp://127.0.0.1:{port}", resume=resume
    )


def distributed_env() -> tuple[int, int]:
    """``(rank, world_size)`` from torchrun's environment variables (``(0, 1)`` without)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def train(cfg: TrainConfig, resume: bool = False) -> dict[str, Any] | None:
    """Train as configured: in this process, under torchrun, or in ``cfg.nprocs`` processes.

    Returns:
        The summary on the main process, None on the other torchrun ranks.
    """
    rank, world_size = distributed_env()
    if world_size > 1:
        summary = run_training(cfg, rank=rank, world_size=world_size, resume=resume)
        return summary if rank == 0 else None
    if cfg.nprocs > 1:
        spawn_training(cfg, cfg.nprocs, free_port(), resume=resume)
        loaded: dict[str, Any] = json.loads((Path(cfg.out) / "summary.json").read_text())
        return loaded
    return run_training(cfg, resume=resume)
