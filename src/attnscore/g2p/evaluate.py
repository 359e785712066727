"""Decoding a split and scoring it with PER/WER (greedy or beam search)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .data import Lexicon, Vocab, encode_words, iter_chunks
from .metrics import error_rates
from .model import G2PModel


@dataclass
class EvalResult:
    """PER and WER (fractions), number of words, decoding time in seconds."""

    per: float
    wer: float
    words: int
    seconds: float

    def line(self, name: str) -> str:
        return (
            f"{name}: PER {100 * self.per:.2f}%  WER {100 * self.wer:.2f}%  "
            f"({self.words} words, {self.seconds:.1f} s)"
        )


def predict(
    model: G2PModel,
    words: list[str],
    letters: Vocab,
    phones: Vocab,
    beam: int = 1,
    batch_size: int = 256,
) -> tuple[list[list[str]], list[torch.Tensor]]:
    """Pronounce ``words`` with batched greedy (``beam == 1``) or beam-search decoding.

    Returns:
        Per word the phoneme strings and its attention weights, a (phonemes + 1, letters)
        float tensor whose last row is the step that emitted ``</s>``.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    prons: list[list[str]] = []
    atts: list[torch.Tensor] = []
    try:
        # sort by length so that batches hold words of similar length
        order = sorted(range(len(words)), key=lambda i: len(words[i]))
        out: dict[int, tuple[list[str], torch.Tensor]] = {}
        for chunk in iter_chunks(order, batch_size):
            src, lens = encode_words([words[i] for i in chunk], letters)
            src, lens = src.to(device), lens.to(device)
            if beam <= 1:
                ids, ws = model.greedy(src, lens)
            else:
                ids, ws = model.beam_search(src, lens, beam=beam)
            for i, seq, w in zip(chunk, ids, ws, strict=True):
                out[i] = (phones.decode(seq), w)
        for i in range(len(words)):
            prons.append(out[i][0])
            atts.append(out[i][1])
    finally:
        model.train(was_training)
    return prons, atts


def evaluate(
    model: G2PModel,
    lexicon: Lexicon,
    letters: Vocab,
    phones: Vocab,
    beam: int = 1,
    max_words: int | None = None,
) -> EvalResult:
    """Decode every word of ``lexicon`` (or the first ``max_words`` in sorted order) and score."""
    words = sorted(lexicon)[:max_words] if max_words else sorted(lexicon)
    if not words:
        raise ValueError("Expected a non-empty split to evaluate, but got no words instead")
    t0 = time.perf_counter()
    hyps, _ = predict(model, words, letters, phones, beam=beam)
    per, wer = error_rates(hyps, [[list(p) for p in lexicon[w]] for w in words])
    return EvalResult(per, wer, len(words), time.perf_counter() - t0)
