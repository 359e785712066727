"""The training loop of one process: steps, the weight average, validations, checkpoints.

:class:`Trainer` runs a configured step budget from a fresh start or from a checkpoint;
only the main process (rank 0) validates and writes files. The entry points that set it
up (the budget, the processes) are in :mod:`attnscore_g2p.train`.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch
from torch import nn

from attnscore._memory import peak_rss_mib
from attnscore._progress import Progress

from .attention_stats import attention_stats, sample
from .checkpoint import Checkpoint, save_checkpoint
from .config import TrainConfig
from .data import length_batches
from .dataset import Data
from .evaluate import evaluate
from .files import write_text_atomic
from .model import G2PModel, count_parameters
from .schedule import lr_at
from .state import TrainState, Validation
from .stepper import Stepper
from .summary import Budget, RunSummary


def average_into(
    averaged: dict[str, torch.Tensor] | None, model: nn.Module, n: int
) -> dict[str, torch.Tensor]:
    """Fold the weights of ``model`` into the running mean ``averaged`` (updated in place;
    None starts one) of ``n - 1`` others; return the mean (floating-point entries averaged,
    the others the first model's)."""
    state = model.state_dict()
    if averaged is None:
        return {k: v.detach().clone() for k, v in state.items()}
    for k, v in state.items():
        if v.is_floating_point():
            averaged[k] += (v.detach() - averaged[k]) / n
    return averaged


class Trainer:
    """One process's run of ``cfg.steps`` optimizer steps: process ``rank`` of ``world_size``
    (rank 0 validates and writes files), from a fresh start or from the checkpoint
    ``resume_from`` (its model, optimizer, state, random state and weight average)."""

    def __init__(
        self,
        cfg: TrainConfig,
        data: Data,
        rank: int = 0,
        world_size: int = 1,
        resume_from: Checkpoint | None = None,
    ) -> None:
        self.cfg, self.data, self.world_size = cfg, data, world_size
        self.is_main = rank == 0
        self.total = int(cfg.steps or 0)
        self.out = Path(cfg.out)
        self.stepper = Stepper(cfg, data, rank, world_size)
        self.state = TrainState()
        self.averaged: dict[str, torch.Tensor] | None = None
        self.valid_words = data.splits["valid"] or data.splits["train"]
        """The words validations score (the training words when there is no validation split)."""
        self.attention_sample = sample(self.valid_words)
        """The fixed sample of :func:`~attnscore_g2p.attention_stats.attention_stats`."""
        if resume_from is not None:
            self.stepper.model.load_state_dict(resume_from.model)
            self.stepper.optimizer.load_state_dict(resume_from.optimizer)
            self.state = resume_from.state
            torch.set_rng_state(resume_from.rng)
            self.averaged = resume_from.averaged
        if world_size > 1 and rank > 0:
            # per-rank dropout streams (rank 0's is the checkpointed one); identical to one
            # process when dropout == 0
            torch.manual_seed(cfg.seed + 1000 * rank + self.state.step)
        average_steps = round(cfg.average_last * self.total) if cfg.average_last > 0 else 0
        self.average_from = self.total - average_steps
        """Steps after this one are folded into the weight average."""

    def run(self) -> None:
        """Train until the budget is spent; validate at the end; save ``last.pt``.

        A ``KeyboardInterrupt`` saves ``last.pt`` on the way out (resume continues from it).
        """
        cfg, state = self.cfg, self.state
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.out / "config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")
        progress = Progress(
            self.total,
            f"train {cfg.model.scoring}",
            initial=state.step,
            enabled=self.is_main and cfg.progress,
        )
        if self.is_main and state.step == 0 and not state.attention:
            self._record_attention(self.stepper.model)  # at initialisation
        start, base_elapsed, tokens = time.perf_counter(), state.elapsed, 0
        try:
            while state.step < self.total:
                batches = length_batches(
                    self.data.train_pairs, cfg.batch_size, cfg.seed, state.epoch
                )
                while state.batch < len(batches) and state.step < self.total:
                    n_tokens, loss = self._step(batches[state.batch])
                    tokens += n_tokens
                    state.elapsed = base_elapsed + time.perf_counter() - start
                    tok_s = tokens / (state.elapsed - base_elapsed)
                    # the bar shows the last batch's loss; validation lines the mean since
                    # the previous one (names say which)
                    progress.update(state.step, batch_loss=loss, tok_s=tok_s)
                    self._after_step(progress)
                if state.batch >= len(batches):
                    state.epoch += 1
                    state.batch = 0
        except KeyboardInterrupt:
            self.save(self.out / "last.pt")
            raise
        finally:
            progress.close()
        if state.last_eval != state.step:
            self.validate(progress)
        self.save(self.out / "last.pt")

    def _step(self, idx: list[int]) -> tuple[int, float]:
        """One optimizer step, counted and folded into the average: (tokens, loss)."""
        state = self.state
        n_tokens, loss = self.stepper.step(idx, lr_at(self.cfg, state.step, self.total))
        state.batch += 1
        state.step += 1
        state.loss_sum += loss
        state.loss_steps += 1
        if state.step > self.average_from:
            state.averaged_steps += 1
            self.averaged = average_into(self.averaged, self.stepper.model, state.averaged_steps)
        return n_tokens, loss

    def _after_step(self, progress: Progress) -> None:
        """The periodic validation and checkpoint."""
        cfg, step = self.cfg, self.state.step
        if cfg.eval_every > 0 and step % cfg.eval_every == 0:
            self.validate(progress)
        if cfg.ckpt_every > 0 and step % cfg.ckpt_every == 0:
            self.save(self.out / "last.pt")

    def validate(self, progress: Progress) -> None:
        """Validate the weights to evaluate with (the average once there is one).

        The main process records a :class:`~attnscore_g2p.state.Validation`, saves
        ``best.pt`` on a new lowest WER and writes the validation line on ``progress``.
        """
        state = self.state
        state.last_eval = state.step
        if not self.is_main:
            return
        model = self.stepper.model
        if self.averaged is not None:
            model = copy.deepcopy(model)
            model.load_state_dict(self.averaged)
        res = evaluate(
            model,
            self.valid_words,
            self.data.letters,
            self.data.phones,
            max_words=self.cfg.eval_words,
        )
        self._record_attention(model)
        loss = state.loss_sum / state.loss_steps if state.loss_steps else float("nan")
        state.loss_sum, state.loss_steps = 0.0, 0
        state.history.append(Validation(state.step, state.elapsed, loss, res.per, res.wer))
        if state.best_wer is None or res.wer < state.best_wer:
            state.best_wer = res.wer
            self.save(self.out / "best.pt")
        progress.write(
            f"step {state.step}: mean train loss {loss:.4f} (since the last validation), "
            f"valid {res.line('greedy')}"
        )

    def _record_attention(self, model: G2PModel) -> None:
        """Append the attention statistics of ``model`` at this step to the state."""
        stats = attention_stats(
            model, self.attention_sample, self.data.letters, self.data.phones, self.state.step
        )
        self.state.attention.append(stats)

    def save(self, path: Path) -> None:
        """Write the run's checkpoint to ``path`` (``last.pt`` or ``best.pt`` of the run
        folder), on the main process only."""
        if not self.is_main:
            return
        save_checkpoint(
            path,
            Checkpoint(
                config=self.cfg,
                letters=self.data.letters,
                phones=self.data.phones,
                state=self.state,
                model=self.stepper.model.state_dict(),
                optimizer=self.stepper.optimizer.state_dict(),
                rng=torch.get_rng_state(),
                averaged=self.averaged,
            ),
        )

    def summary(self, budget: Budget) -> RunSummary:
        """What the run did, following ``budget``, for ``summary.json``."""
        cfg, state = self.cfg, self.state
        steps_per_epoch = len(length_batches(self.data.train_pairs, cfg.batch_size, cfg.seed, 0))
        return RunSummary(
            scoring=cfg.model.scoring,
            seed=cfg.seed,
            steps=state.step,
            epochs=state.epoch + state.batch / max(steps_per_epoch, 1),
            train_seconds=state.elapsed,
            parameters=count_parameters(self.stepper.model),
            peak_rss_mb=peak_rss_mib(),
            best_valid_wer=state.best_wer,
            history=state.history,
            attention=state.attention,
            world_size=self.world_size,
            threads=cfg.threads,
            device=cfg.device,
            budget=budget,
            config=cfg,
        )
