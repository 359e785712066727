"""How ``g2p compare`` ranks scorers: validation curves over seeds, and groups that only
a gap wider than the seeds' spread separates. Expected values are worked out by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

from attnscore_g2p.compare import (
    curves_table,
    ranking,
    ranking_text,
    same_ranking,
    validation_curves,
)
from attnscore_g2p.state import Validation


def _run(*wers: tuple[int, float]) -> Any:
    history = [Validation(step, 0.0, 1.0, 0.1, wer) for step, wer in wers]
    return SimpleNamespace(history=history)


def _s(mean: float, std: float | None) -> dict[str, float | None]:
    return {"mean": mean, "std": std}


def test_validation_curves_average_the_seeds_at_steps_all_reached() -> None:
    curves = validation_curves(
        {
            "dot": [_run((500, 0.50), (1000, 0.30)), _run((500, 0.40), (1000, 0.50))],
            "cosine": [_run((500, 0.20))],  # one seed: no spread
            "general": [_run((500, 0.6), (1000, 0.5)), _run((500, 0.6))],  # one stopped early
        }
    )
    assert list(curves["dot"]) == [500, 1000]
    assert curves["dot"][500]["mean"] == pytest.approx(0.45)
    assert curves["dot"][1000]["std"] == pytest.approx(math.sqrt(0.02))  # (0.3, 0.5)
    assert curves["cosine"] == {500: {"mean": pytest.approx(0.2), "std": None}}
    assert list(curves["general"]) == [500]


def test_ranking_separates_only_gaps_wider_than_the_spread() -> None:
    scores = {
        "general": _s(0.60, 0.01),
        "cosine": _s(0.330, 0.002),
        "scaled_dot": _s(0.334, 0.003),  # 0.004 apart, spread 0.005: together
        "dot": _s(0.370, 0.004),  # 0.036 above scaled_dot: its own group
    }
    groups = ranking(scores)
    assert groups == [["cosine", "scaled_dot"], ["dot"], ["general"]]
    assert ranking_text(groups) == "cosine ≈ scaled_dot < dot < general"
    # one seed: no spread to separate anything
    assert ranking({"a": _s(0.1, None), "b": _s(0.9, None)}) == [["a", "b"]]
    # a gap equal to the spread does not separate
    assert ranking({"a": _s(0.25, 0.125), "b": _s(0.5, 0.125)}) == [["a", "b"]]
    assert same_ranking([["a", "b"], ["c"]], [["b", "a"], ["c"]])
    assert not same_ranking([["a", "b"], ["c"]], [["a"], ["b", "c"]])


def test_curves_table_says_whether_the_last_two_validations_rank_alike() -> None:
    stable = {
        "a": {500: _s(0.50, 0.01), 1000: _s(0.30, 0.01)},
        "b": {500: _s(0.60, 0.01), 1000: _s(0.40, 0.01)},
    }
    text = curves_table(stable)
    assert "| 1000 | 30.00 ± 1.00 | 40.00 ± 1.00 | a < b |" in text
    assert text.endswith("ranking between steps 500 and 1000: unchanged")
    swapped = {"a": stable["a"], "b": {500: _s(0.60, 0.01), 1000: _s(0.20, 0.01)}}
    assert curves_table(swapped).endswith("ranking between steps 500 and 1000: changed")
