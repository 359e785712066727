"""Phoneme error rate (PER) and word error rate (WER) against multiple references."""

from __future__ import annotations

from collections.abc import Sequence


def edit_distance(a: Sequence[str], b: Sequence[str]) -> int:
    """Levenshtein distance (unit cost insert/delete/substitute) between token sequences."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, start=1):
        cur = [i] + [0] * len(b)
        for j, y in enumerate(b, start=1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y))
        prev = cur
    return prev[-1]


def closest_reference(hyp: Sequence[str], refs: Sequence[Sequence[str]]) -> tuple[int, int]:
    """``(distance, reference length)`` of the reference closest to ``hyp``.

    Ties in distance are broken by the longer reference (the smaller error rate), then by
    the order of ``refs``.
    """
    if not refs:
        raise ValueError("Expected at least one reference pronunciation, but got none instead")
    best = min((edit_distance(hyp, r), -len(r)) for r in refs)
    return best[0], -best[1]


def error_rates(
    hyps: Sequence[Sequence[str]], refs: Sequence[Sequence[Sequence[str]]]
) -> tuple[float, float]:
    """Corpus ``(PER, WER)`` as fractions in [0, 1] (PER may exceed 1 for long outputs).

    PER = sum over words of the edit distance to the closest reference, divided by the sum
    of the lengths of those closest references.  WER = fraction of words whose hypothesis
    equals none of its references.

    Args:
        hyps: one predicted phoneme sequence per word.
        refs: per word, the list of its reference pronunciations.
    """
    if len(hyps) != len(refs):
        raise ValueError(
            f"Expected as many hypotheses as reference lists, but got {len(hyps)} and "
            f"{len(refs)} instead"
        )
    if not hyps:
        raise ValueError("Expected at least one word to score, but got none instead")
    errors = length = wrong = 0
    for hyp, rs in zip(hyps, refs, strict=True):
        d, n = closest_reference(hyp, rs)
        errors += d
        length += n
        wrong += d != 0
    return errors / max(length, 1), wrong / len(hyps)
