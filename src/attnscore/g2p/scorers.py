"""Registry mapping ``--scoring`` names to attention-module factories of the core library."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

ScorerFactory = Callable[[int, float], nn.Module]
"""``factory(size, dropout) -> module``; queries and keys both have feature size ``size``."""


def _additive(size: int, dropout: float) -> nn.Module:
    import attnscore

    return attnscore.AdditiveAttention(
        key_size=size, query_size=size, num_hiddens=size, dropout=dropout
    )


def _dot(size: int, dropout: float) -> nn.Module:
    import attnscore

    return attnscore.DotProductAttention(dropout=dropout, scale=1.0)


def _scaled_dot(size: int, dropout: float) -> nn.Module:
    import attnscore

    return attnscore.DotProductAttention(dropout=dropout, scale=None)


def _general(size: int, dropout: float) -> nn.Module:
    import attnscore

    return attnscore.MultiplicativeAttention(size, size, dropout=dropout)


def _cosine(size: int, dropout: float) -> nn.Module:
    import attnscore

    return attnscore.CosineAttention(dropout=dropout, learn_scale=True)


SCORERS: dict[str, ScorerFactory] = {
    "additive": _additive,
    "dot": _dot,
    "scaled_dot": _scaled_dot,
    "general": _general,
    "cosine": _cosine,
}


def make_scorer(name: str, size: int, dropout: float = 0.0) -> nn.Module:
    """Build the attention module called ``name`` for queries and keys of feature size ``size``."""
    try:
        factory = SCORERS[name]
    except KeyError:
        raise ValueError(
            f"Expected a scoring function in {sorted(SCORERS)}, but got {name!r} instead"
        ) from None
    return factory(size, dropout)
