"""How sharp a model's attention is: the spread of its scores and the entropy of its weights.

Issue 20's saturation hypothesis: a scorer whose scores spread widely at initialisation
(unscaled dot products, the bilinear "general" form) gives near one-hot weights from the
first step, so that its gradient reaches few keys. :func:`attention_stats` measures that on
a fixed sample of validation words, teacher forced, in evaluation mode (no dropout): per
decoder step (a row of the (B, n, m) scores) over the word's letters (the valid keys),

- ``score_std``: the standard deviation of the row's scores, averaged over the rows;
- ``entropy``: the entropy of the row's weights in nats, averaged over the rows (log L for
  uniform weights over L letters, 0 for one-hot ones);
- ``max_weight``: the row's largest weight, averaged over the rows (1 for one-hot rows).

The training loop records them at step 0 and at every validation
(:attr:`attnscore_g2p.state.TrainState.attention`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .data import PAD_ID, Lexicon, Vocab, make_batch
from .model import G2PModel
from .state import AttentionStats

SAMPLE_WORDS = 512
"""How many validation words (the first in sorted order, one pronunciation each) are used."""


def sample(lexicon: Lexicon, words: int = SAMPLE_WORDS) -> list[tuple[str, tuple[str, ...]]]:
    """The fixed sample: the first ``words`` words in sorted order, first pronunciation."""
    return [(w, lexicon[w][0]) for w in sorted(lexicon)[:words]]


def row_stats(scores: Tensor, weights: Tensor, rows: Tensor, keys: Tensor) -> tuple[float, ...]:
    """``(score_std, entropy, max_weight)``, as :mod:`this module
    <attnscore_g2p.attention_stats>` defines them, of the (B, n, m) float ``scores`` and
    ``weights`` (zeros beyond the valid keys), averaged over the (B, n) bool ``rows`` (at
    least one), each over the (B, m) bool valid ``keys`` of its example (at least one)."""
    s, w = scores.double(), weights.double()
    valid = keys[:, None, :].expand_as(s)
    count = valid.sum(-1)
    mean = s.where(valid, 0.0).sum(-1) / count
    var = ((s - mean[..., None]).where(valid, 0.0) ** 2).sum(-1) / count
    positive = valid & (w > 0)
    entropy = -(w.where(positive, 1.0).log() * w.where(positive, 0.0)).sum(-1)
    peak = w.where(valid, 0.0).amax(-1)
    return tuple(float(t[rows].mean()) for t in (var.sqrt(), entropy, peak))


def attention_stats(
    model: G2PModel,
    examples: Sequence[tuple[str, tuple[str, ...]]],
    letters: Vocab,
    phones: Vocab,
    step: int,
) -> AttentionStats:
    """Score spread and weight entropy of ``model`` (in evaluation mode for the call) on the
    ``(word, pronunciation)`` pairs ``examples`` (:func:`sample`), teacher forced: the
    statistics over every decoder step of every example (the ``</s>`` step included) and
    each word's letters, recorded as of training step ``step``."""
    batch = make_batch(examples, letters, phones)
    device = next(model.parameters()).device
    queries, keys, weights = model.teacher_forced_attention(
        batch.src.to(device), batch.valid_lens.to(device), batch.tgt_in.to(device)
    )
    with torch.no_grad():
        scores = model.attention.score(queries, keys, None)
    rows = (batch.tgt_out != PAD_ID).to(device)
    valid_keys = torch.arange(batch.src.shape[1], device=device) < batch.valid_lens[:, None].to(
        device
    )
    score_std, entropy, max_weight = row_stats(scores, weights, rows, valid_keys)
    return AttentionStats(step, score_std, entropy, max_weight)
