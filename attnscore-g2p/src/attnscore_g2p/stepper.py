"""One optimizer step of one training process: the model, its optimizer, the loss.

Under DDP every process builds the same global batches and takes every N-th example of
each; the loss of a process is its summed token loss times N divided by the global number
of target tokens, so DDP's gradient average equals the one-process gradient of the
token-mean loss, and N processes follow the one-process run up to float rounding (dropout
masks differ, so compare with ``dropout=0``).
"""

from __future__ import annotations

import torch
from torch import nn

from .config import TrainConfig
from .data import PAD_ID, make_batch
from .dataset import Data
from .model import G2PModel


def build_model(cfg: TrainConfig, data: Data) -> G2PModel:
    """The model of ``cfg.model`` for the vocabularies of ``data``, freshly initialised, on
    the CPU."""
    return G2PModel(cfg.model, len(data.letters), len(data.phones))


class Stepper:
    """The model, optimizer and loss of one training process, and the steps it takes.

    ``cfg`` gives the model, device, precision, label smoothing and clipping; with a
    ``world_size`` above 1 the model is wrapped in DDP, ``rank`` being this process's index.
    ``model`` is the unwrapped model (what checkpoints store), ``optimizer`` PyTorch's Adam
    (fused on CPU and CUDA).
    """

    def __init__(self, cfg: TrainConfig, data: Data, rank: int, world_size: int) -> None:
        self.cfg, self.data, self.rank, self.world_size = cfg, data, rank, world_size
        self.device = torch.device(cfg.device)
        self.model = build_model(cfg, data).to(self.device)
        # PyTorch's fused Adam takes less time per step (docs/g2p.md, item 4).
        fused = self.device.type in ("cpu", "cuda")
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.lr, fused=fused)
        self.wrapped: nn.Module = self.model
        if world_size > 1:
            self.wrapped = nn.parallel.DistributedDataParallel(self.model)
        self.loss_fn = nn.CrossEntropyLoss(
            ignore_index=PAD_ID, reduction="sum", label_smoothing=cfg.label_smoothing
        )

    def step(self, idx: list[int], lr: float) -> tuple[int, float]:
        """One optimizer step at learning rate ``lr`` on the global batch ``idx`` (indices into
        ``data.train_pairs``, for all processes); returns ``(global target tokens, loss)``,
        the loss being this process's mean token loss (label smoothing included)."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        examples = [self.data.train_pairs[i] for i in idx]
        total_tokens = sum(len(p) + 1 for _, p in examples)
        local = examples[self.rank :: self.world_size]
        weight = float(self.world_size) / total_tokens
        if not local:  # fewer examples than processes: contribute a zero gradient
            local, weight = examples[:1], 0.0
        batch = make_batch(local, self.data.letters, self.data.phones)
        dev = self.device
        with torch.autocast(dev.type, torch.bfloat16, enabled=self.cfg.precision == "bfloat16"):
            logits = self.wrapped(batch.src.to(dev), batch.valid_lens.to(dev), batch.tgt_in.to(dev))
            loss = self.loss_fn(logits.flatten(0, 1), batch.tgt_out.to(dev).flatten()) * weight
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.clip > 0:
            nn.utils.clip_grad_norm_(self.wrapped.parameters(), self.cfg.clip)
        self.optimizer.step()
        mean = float(loss.detach()) / weight / batch.num_tokens if weight else 0.0
        return total_tokens, mean
