from __future__ import annotations

import pytest

from attnscore_g2p.metrics import closest_reference, edit_distance, error_rates


def p(text: str) -> list[str]:
    """Phonemes of a space-separated string."""
    return text.split()


def test_edit_distance_hand_worked() -> None:
    assert edit_distance([], []) == 0
    assert edit_distance(["A"], []) == 1
    assert edit_distance(p("K AE T"), p("K AE T")) == 0
    assert edit_distance(p("K AE T"), p("K AH T")) == 1  # substitution
    assert edit_distance(p("K AE T S"), p("K AE T")) == 1  # insertion
    assert edit_distance(p("K T"), p("K AE T")) == 1  # deletion
    # kitten -> sitting: the classic 3
    assert edit_distance(list("kitten"), list("sitting")) == 3


def test_closest_reference() -> None:
    refs = [p("T AH M EY T OW"), p("T AH M AA T OW")]
    assert closest_reference(p("T AH M AA T OW"), refs) == (0, 6)
    assert closest_reference(p("T AH M AA T"), refs) == (1, 6)
    # tie in distance: the longer reference is used
    assert closest_reference(["A"], [["B"], ["A", "C"]]) == (1, 2)
    with pytest.raises(ValueError):
        closest_reference(["A"], [])


def test_error_rates_hand_worked() -> None:
    hyps = [
        p("T AH M AA T OW"),  # matches the 2nd reference: 0 errors, right word
        p("K AE T"),  # 1 substitution against K AH T (3 phonemes)
        p("D AO G Z"),  # 1 insertion against D AO G (3 phonemes)
        p("HH AW S"),  # right
    ]
    refs = [
        [p("T AH M EY T OW"), p("T AH M AA T OW")],
        [p("K AH T")],
        [p("D AO G"), p("D AA G")],
        [p("HH AW S")],
    ]
    per, wer = error_rates(hyps, refs)
    # PER = (0 + 1 + 1 + 0) / (6 + 3 + 3 + 3) = 2 / 15; WER = 2 wrong of 4
    assert per == pytest.approx(2 / 15)
    assert wer == pytest.approx(0.5)


def test_error_rates_checks() -> None:
    with pytest.raises(ValueError, match="as many hypotheses"):
        error_rates([["A"]], [])
    with pytest.raises(ValueError, match="at least one word"):
        error_rates([], [])


def test_per_exceeds_100_percent_when_the_output_inserts_phones() -> None:
    """docs/g2p.md, Metrics: insertions count, so PER can pass 1 (issue 21.6)."""
    per, wer = error_rates([p("K AE AE AE AE")], [[p("K AE")]])  # three insertions
    assert per == 3 / 2 and wer == 1.0
