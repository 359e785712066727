"""Training loop: budgets, periodic evaluation, checkpoints, resume and DDP (gloo).

Under ``torchrun --nproc_per_node=N`` (or :func:`spawn_training`) every process builds the
same global batches and takes every N-th example of each; the loss of a process is its summed
token loss times N divided by the global number of target tokens, so DDP's gradient average
equals the one-process gradient of the token-mean loss, and N processes follow the one-process
run up to float rounding (dropout masks differ, so compare with ``dropout=0``).
"""

from __future__ import annotations

import json
import math
import os
import random
import resource
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import load_checkpoint, save_checkpoint
from .data import PAD_ID, Lexicon, Vocab, load_lexicon, make_batch, pairs, split_lexicon
from .evaluate import evaluate
from .model import G2PModel, ModelConfig, count_parameters


@dataclass
class TrainConfig:
    """Everything a training run depends on (stored in its checkpoints)."""

    out: str = "runs/g2p"
    data: str | None = None
    keep_stress: bool = False
    scoring: str = "additive"
    emb: int = 64
    enc_hidden: int = 256
    dec_hidden: int = 256
    enc_layers: int = 1
    dropout: float = 0.1
    input_feeding: bool = False
    batch_size: int = 64
    lr: float = 3e-3
    lr_min_ratio: float = 0.05
    label_smoothing: float = 0.1
    clip: float = 5.0
    epochs: int | None = None
    time_budget: float | None = None
    """Minutes of training (wall clock, summed over resumes)."""
    seed: int = 0
    eval_every: int = 1000
    ckpt_every: int = 200
    eval_words: int | None = None
    max_train_words: int | None = None
    threads: int = 1
    progress: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class Data:
    """Splits, vocabularies and training pairs of a run."""

    splits: dict[str, Lexicon]
    letters: Vocab
    phones: Vocab
    train_pairs: list[tuple[str, tuple[str, ...]]]


def prepare_data(cfg: TrainConfig, *, report: bool = True) -> Data:
    """Load, split and index the lexicon of ``cfg`` (malformed lines go to stderr)."""
    parsed = load_lexicon(cfg.data, keep_stress=cfg.keep_stress)
    if report and parsed.errors:
        for lineno, msg in parsed.errors[:20]:
            print(f"warning: line {lineno} skipped: {msg}", file=sys.stderr)
        if len(parsed.errors) > 20:
            print(f"warning: {len(parsed.errors) - 20} more malformed lines", file=sys.stderr)
    if not parsed.lexicon:
        raise ValueError(f"Expected at least one valid entry in {cfg.data!r}, but got none instead")
    splits = split_lexicon(parsed.lexicon)
    if cfg.max_train_words is not None:
        keep = sorted(splits["train"])[: cfg.max_train_words]
        splits["train"] = {w: splits["train"][w] for w in keep}
    if not splits["train"]:
        raise ValueError("Expected a non-empty training split, but got no training words instead")
    letters, phones = Vocab.for_lexicon(parsed.lexicon)
    return Data(splits, letters, phones, pairs(splits["train"]))


def build_model(cfg: TrainConfig, data: Data) -> G2PModel:
    """The model of ``cfg`` for the vocabularies of ``data``."""
    mcfg = ModelConfig(
        n_letters=len(data.letters),
        n_phones=len(data.phones),
        scoring=cfg.scoring,
        emb=cfg.emb,
        enc_hidden=cfg.enc_hidden,
        dec_hidden=cfg.dec_hidden,
        enc_layers=cfg.enc_layers,
        dropout=cfg.dropout,
        input_feeding=cfg.input_feeding,
    )
    return G2PModel(mcfg)


def lr_at(cfg: TrainConfig, progress: float) -> float:
    """Cosine decay from ``lr`` to ``lr * lr_min_ratio`` over progress in [0, 1]."""
    p = min(max(progress, 0.0), 1.0)
    return cfg.lr * (cfg.lr_min_ratio + (1 - cfg.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB (Linux ``ru_maxrss`` is in KiB)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024 if sys.platform != "darwin" else rss / 2**20


def _seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def run_training(
    cfg: TrainConfig,
    rank: int = 0,
    world_size: int = 1,
    init_method: str | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Train (or resume) a model; returns the run summary also written to ``out/summary.json``.

    Args:
        cfg: the run's configuration; ``epochs`` and/or ``time_budget`` bound it (default 20
            minutes if neither is given).
        rank, world_size: process index and count; ``world_size > 1`` uses DDP on gloo.
        init_method: ``torch.distributed`` rendezvous URL (default ``env://`` as torchrun sets).
        resume: continue from ``out/last.pt`` if it exists.
    """
    torch.set_num_threads(max(1, cfg.threads))
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


def _train(cfg: TrainConfig, rank: int, world_size: int, resume: bool) -> dict[str, Any]:
    out = Path(cfg.out)
    last_path = out / "last.pt"
    ckpt = load_checkpoint(last_path) if resume and last_path.is_file() else None
    if ckpt is not None:
        budget = {"epochs": cfg.epochs, "time_budget": cfg.time_budget}
        cfg = TrainConfig.from_dict(
            {
                **ckpt["train_config"],
                "out": cfg.out,
                "threads": cfg.threads,
                "progress": cfg.progress,
            }
        )
        for k, v in budget.items():
            if v is not None:
                setattr(cfg, k, v)
    if cfg.epochs is None and cfg.time_budget is None:
        cfg.time_budget = 20.0
    is_main = rank == 0
    _seed_all(cfg.seed)
    data = prepare_data(cfg, report=is_main and ckpt is None)
    model = build_model(cfg, data)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    st: dict[str, Any] = {
        "epoch": 0,
        "batch": 0,
        "step": 0,
        "elapsed": 0.0,
        "best_wer": None,
        "last_eval": -1,
        "history": [],
    }
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        st = ckpt["state"]
        torch.set_rng_state(ckpt["rng"])
    wrapped: nn.Module = model
    if world_size > 1:
        wrapped = nn.parallel.DistributedDataParallel(model)
        # per-rank dropout streams (rank 0's is the checkpointed one); identical to one
        # process when dropout == 0
        if rank > 0:
            torch.manual_seed(cfg.seed + 1000 * rank + st["step"])
    loss_fn = nn.CrossEntropyLoss(
        ignore_index=PAD_ID, reduction="sum", label_smoothing=cfg.label_smoothing
    )
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    steps_per_epoch = len(_epoch_batches(cfg, data, 0))
    total_steps = cfg.epochs * steps_per_epoch if cfg.epochs is not None else None
    budget_s = cfg.time_budget * 60 if cfg.time_budget is not None else None
    bar = _make_bar(cfg, is_main, total_steps, budget_s, st)
    t_start, base_elapsed = time.perf_counter(), float(st["elapsed"])
    tokens_seen, t_tok = 0, time.perf_counter()

    def save(path: Path) -> None:
        if is_main:
            save_checkpoint(path, model, opt, cfg, data, st, torch.get_rng_state())

    def periodic_eval() -> None:
        st["last_eval"] = st["step"]
        if is_main:
            res = evaluate(
                model,
                data.splits["valid"] or data.splits["train"],
                data.letters,
                data.phones,
                max_words=cfg.eval_words,
            )
            st["history"].append(
                {
                    "step": st["step"],
                    "elapsed": st["elapsed"],
                    "valid_per": res.per,
                    "valid_wer": res.wer,
                }
            )
            if st["best_wer"] is None or res.wer < st["best_wer"]:
                st["best_wer"] = res.wer
                save(out / "best.pt")
            msg = f"step {st['step']}: valid {res.line('greedy')}"
            (bar.write if bar is not None else print)(msg)

    done = budget_s is not None and st["elapsed"] >= budget_s  # resumed after the end
    try:
        while not done:
            if cfg.epochs is not None and st["epoch"] >= cfg.epochs:
                break
            batches = _epoch_batches(cfg, data, st["epoch"])
            while st["batch"] < len(batches):
                idx = batches[st["batch"]]
                progress = _progress(st, total_steps, budget_s)
                for g in opt.param_groups:
                    g["lr"] = lr_at(cfg, progress)
                n_tok = _train_step(wrapped, opt, loss_fn, cfg, data, idx, rank, world_size, bar)
                tokens_seen += n_tok
                st["batch"] += 1
                st["step"] += 1
                st["elapsed"] = _sync_elapsed(
                    base_elapsed + time.perf_counter() - t_start, world_size
                )
                if bar is not None:
                    now = time.perf_counter()
                    bar.set_postfix(
                        loss=f"{bar.last_loss:.3f}",
                        tok_s=f"{tokens_seen / (now - t_tok):.0f}",
                        ep=st["epoch"],
                        refresh=False,
                    )
                    bar.update(1 if budget_s is None else min(st["elapsed"], budget_s) - bar.n)
                if cfg.eval_every > 0 and st["step"] % cfg.eval_every == 0:
                    periodic_eval()
                if cfg.ckpt_every > 0 and st["step"] % cfg.ckpt_every == 0:
                    save(last_path)
                if budget_s is not None and st["elapsed"] >= budget_s:
                    done = True
                    break
            else:
                st["epoch"] += 1
                st["batch"] = 0
    except KeyboardInterrupt:
        save(last_path)
        raise
    finally:
        if bar is not None:
            bar.close()
    if st["last_eval"] != st["step"]:
        periodic_eval()
    save(last_path)
    summary = {
        "scoring": cfg.scoring,
        "steps": st["step"],
        "epochs": st["epoch"] + st["batch"] / max(steps_per_epoch, 1),
        "train_seconds": st["elapsed"],
        "parameters": count_parameters(model),
        "peak_rss_mb": peak_rss_mb(),
        "best_valid_wer": st["best_wer"],
        "history": st["history"],
        "world_size": world_size,
    }
    if is_main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _epoch_batches(cfg: TrainConfig, data: Data, epoch: int) -> list[list[int]]:
    from .data import length_batches

    return length_batches(data.train_pairs, cfg.batch_size, cfg.seed, epoch)


def _progress(st: dict[str, Any], total_steps: int | None, budget_s: float | None) -> float:
    p = 0.0
    if total_steps:
        p = max(p, st["step"] / total_steps)
    if budget_s:
        p = max(p, st["elapsed"] / budget_s)
    return p


def _sync_elapsed(elapsed: float, world_size: int) -> float:
    """Rank 0's clock everywhere, so that all processes stop at the same step."""
    if world_size == 1:
        return elapsed
    t = torch.tensor([elapsed], dtype=torch.float64)
    dist.broadcast(t, src=0)
    return float(t.item())


def _train_step(
    wrapped: nn.Module,
    opt: torch.optim.Optimizer,
    loss_fn: nn.Module,
    cfg: TrainConfig,
    data: Data,
    idx: list[int],
    rank: int,
    world_size: int,
    bar: Any,
) -> int:
    """One optimizer step on the global batch ``idx``; returns the global target tokens."""
    examples = [data.train_pairs[i] for i in idx]
    total_tokens = sum(len(p) + 1 for _, p in examples)
    local = examples[rank::world_size]
    weight = float(world_size) / total_tokens
    if not local:  # fewer examples than processes: contribute a zero gradient
        local, weight = examples[:1], 0.0
    batch = make_batch(local, data.letters, data.phones)
    logits = wrapped(batch.src, batch.src_lens, batch.tgt_in)
    loss = loss_fn(logits.flatten(0, 1), batch.tgt_out.flatten()) * weight
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.clip > 0:
        nn.utils.clip_grad_norm_(wrapped.parameters(), cfg.clip)
    opt.step()
    if bar is not None:
        bar.last_loss = loss.item() / weight / batch.num_tokens if weight else 0.0
    return total_tokens


def _make_bar(
    cfg: TrainConfig,
    is_main: bool,
    total_steps: int | None,
    budget_s: float | None,
    st: dict[str, Any],
) -> Any:
    if not (is_main and cfg.progress):
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # optional extra 'g2p'
        print("note: no progress bar without tqdm (pip install 'attnscore[g2p]')", file=sys.stderr)
        return None

    if budget_s is not None:
        bar = tqdm(
            total=round(budget_s),
            initial=0,
            unit="s",
            dynamic_ncols=True,
            mininterval=0.2 if sys.stderr.isatty() else 30.0,
            desc=f"train {cfg.scoring}",
            bar_format="{l_bar}{bar}| {n:.0f}/{total}s [{elapsed}<{remaining}{postfix}]",
        )
        bar.update(st["elapsed"])
    else:
        bar = tqdm(
            total=total_steps,
            initial=st["step"],
            unit="step",
            dynamic_ncols=True,
            mininterval=0.2 if sys.stderr.isatty() else 30.0,
            desc=f"train {cfg.scoring}",
        )
    bar.last_loss = float("nan")
    return bar


def spawn_training(cfg: TrainConfig, nprocs: int, port: int) -> None:
    """Run :func:`run_training` in ``nprocs`` processes on 127.0.0.1:``port`` (gloo)."""
    import torch.multiprocessing as mp

    mp.spawn(  # type: ignore[attr-defined,no-untyped-call]
        _spawn_worker, args=(cfg, nprocs, port), nprocs=nprocs, join=True
    )


def _spawn_worker(rank: int, cfg: TrainConfig, nprocs: int, port: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    run_training(cfg, rank=rank, world_size=nprocs, init_method=f"tcp://127.0.0.1:{port}")


def distributed_env() -> tuple[int, int]:
    """``(rank, world_size)`` from torchrun's environment variables (``(0, 1)`` without)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
