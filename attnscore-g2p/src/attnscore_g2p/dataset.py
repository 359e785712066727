"""The data of a training run: the lexicon its configuration names, split and indexed."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from .config import TrainConfig
from .data import Lexicon, Vocab, load_lexicon, pairs, split_lexicon

_SHOWN_ERRORS = 20


@dataclass
class Data:
    """Splits, vocabularies and training pairs of a run.

    Attributes:
        splits: ``"train"``, ``"valid"`` and ``"test"`` lexicons.
        letters: the letter vocabulary of the whole lexicon.
        phones: the phoneme vocabulary of the whole lexicon.
        train_pairs: the ``(word, pronunciation)`` pairs trained on.
    """

    splits: dict[str, Lexicon]
    letters: Vocab
    phones: Vocab
    train_pairs: list[tuple[str, tuple[str, ...]]]


def prepare_data(cfg: TrainConfig, *, report: bool = True) -> Data:
    """Load, split and index the lexicon of ``cfg`` (its file ``cfg.data``, stress option and
    training subset); ``report`` prints the first malformed lines (skipped) on stderr.

    Raises:
        ValueError: no valid entry, or an empty training split.
        FileNotFoundError, ImportError: no data (:func:`~attnscore_g2p.data.load_lexicon`).
    """
    parsed = load_lexicon(cfg.data, keep_stress=cfg.keep_stress)
    if not parsed.lexicon:
        raise ValueError(f"Expected at least one valid entry in {cfg.data!r}, but got none instead")
    if report and parsed.errors:
        for lineno, msg in parsed.errors[:_SHOWN_ERRORS]:
            print(f"warning: line {lineno} skipped: {msg}", file=sys.stderr)
        if len(parsed.errors) > _SHOWN_ERRORS:
            more = len(parsed.errors) - _SHOWN_ERRORS
            print(f"warning: {more} more malformed lines", file=sys.stderr)
    splits = split_lexicon(parsed.lexicon)
    if cfg.max_train_words is not None:
        keep = sorted(splits["train"])[: cfg.max_train_words]
        splits["train"] = {w: splits["train"][w] for w in keep}
    if not splits["train"]:
        raise ValueError("Expected a non-empty training split, but got no training words instead")
    letters, phones = Vocab.for_lexicon(parsed.lexicon)
    return Data(splits, letters, phones, pairs(splits["train"]))
