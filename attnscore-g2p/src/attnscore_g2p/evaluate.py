"""Decoding a split and scoring it with PER/WER (greedy or beam search)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpoint import load_model
from .data import (
    Lexicon,
    Vocab,
    encode_words,
    iter_chunks,
    load_lexicon,
    make_batch,
    split_lexicon,
)
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
        """One report line, ``"name: PER 7.12%  WER 29.80%  (6350 words, 3.1 s)"``."""
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
    length_norm: float = 0.0,
) -> tuple[list[list[str]], list[torch.Tensor]]:
    """Pronounce ``words`` with batched greedy (``beam == 1``) or beam-search decoding
    (``length_norm``: :meth:`~attnscore_g2p.model.G2PModel.beam_search`'s).

    Returns:
        Per word the phoneme strings and its attention weights, a (phonemes + 1, letters)
        float tensor whose last row is the step that emitted ``</s>`` (phonemes rows if the
        decoder reached its length limit without ``</s>``).
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        # sort by length so that batches hold words of similar length
        order = sorted(range(len(words)), key=lambda i: len(words[i]))
        out: dict[int, tuple[list[str], torch.Tensor]] = {}
        for chunk in iter_chunks(order, batch_size):
            src, lengths = encode_words([words[i] for i in chunk], letters)
            src, lengths = src.to(device), lengths.to(device)
            if beam <= 1:
                ids, ws = model.greedy(src, lengths)
            else:
                ids, ws = model.beam_search(src, lengths, beam=beam, length_norm=length_norm)
            for i, seq, w in zip(chunk, ids, ws, strict=True):
                out[i] = (phones.decode(seq), w)
    finally:
        model.train(was_training)
    return [out[i][0] for i in range(len(words))], [out[i][1] for i in range(len(words))]


def evaluate(
    model: G2PModel,
    lexicon: Lexicon,
    letters: Vocab,
    phones: Vocab,
    beam: int = 1,
    max_words: int | None = None,
    length_norm: float = 0.0,
) -> EvalResult:
    """Decode every word of ``lexicon`` (or the first ``max_words`` in sorted order) and score."""
    words = sorted(lexicon)[:max_words] if max_words else sorted(lexicon)
    if not words:
        raise ValueError("Expected a non-empty split to evaluate, but got no words instead")
    t0 = time.perf_counter()
    hyps, _ = predict(model, words, letters, phones, beam=beam, length_norm=length_norm)
    per, wer = error_rates(hyps, [[list(p) for p in lexicon[w]] for w in words])
    return EvalResult(per, wer, len(words), time.perf_counter() - t0)


def evaluate_checkpoint(
    path: str | Path,
    split: str = "test",
    beam: int = 5,
    data: str | None = None,
    max_words: int | None = None,
    device: str = "cpu",
    length_norm: float = 0.0,
) -> dict[str, Any]:
    """PER/WER of a checkpoint (or run folder) on a split: greedy, and beam if ``beam > 1``.

    Returns:
        ``{"checkpoint", "split", "beam_width", "length_norm", "greedy": {...}, "beam":
        {...}}`` with ``per``, ``wer``, ``words`` and ``seconds`` per decoding (``"beam"``
        only when ``beam > 1``).

    Raises:
        CheckpointError: an unreadable checkpoint (:mod:`attnscore_g2p.checkpoint`).
        FileNotFoundError, ImportError: no data (:func:`~attnscore_g2p.data.load_lexicon`).
    """
    model, letters, phones, tcfg = load_model(path, device)
    parsed = load_lexicon(data if data is not None else tcfg.data, tcfg.keep_stress)
    lexicon = split_lexicon(parsed.lexicon)[split]
    results: dict[str, Any] = {
        "checkpoint": str(path),
        "split": split,
        "beam_width": beam,
        "length_norm": length_norm,
    }
    results["greedy"] = asdict(evaluate(model, lexicon, letters, phones, max_words=max_words))
    if beam > 1:
        res = evaluate(
            model, lexicon, letters, phones, beam=beam, max_words=max_words, length_norm=length_norm
        )
        results["beam"] = asdict(res)
    return results


def forced_alignment(
    model: G2PModel, word: str, pron: list[str], letters: Vocab, phones: Vocab
) -> torch.Tensor:
    """Teacher-forced attention of ``word`` on ``pron``: (len(pron) + 1, len(word)) float."""
    batch = make_batch([(word, tuple(pron))], letters, phones)
    device = next(model.parameters()).device
    _, _, weights = model.teacher_forced_attention(
        batch.src.to(device), batch.valid_lens.to(device), batch.tgt_in.to(device)
    )
    return weights[0].cpu()
