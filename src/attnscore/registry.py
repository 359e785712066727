"""The scorer registry: one table from a scoring name to the module that computes it.

Every place that takes a scorer by name (``MultiHeadAttention(scoring=...)``,
``attnscore run --scoring``, the G2P model, the benchmark and the test path registry)
looks it up here, so a scorer registered once is usable everywhere. Names have the
field's meaning:

========== ================================ =================================
name       score a(q, k)                    source
========== ================================ =================================
additive   w_vᵀ tanh(W_q q + W_k k)          Bahdanau et al. 2015, eq. A.1.2
dot        qᵀk                              Luong et al. 2015, eq. 8 "dot"
scaled_dot qᵀk / √d                         Vaswani et al. 2017, eq. 1
general    qᵀ W_a k                         Luong et al. 2015, eq. 8 "general"
cosine     s · cos(q, k), s learned          Liu et al. 2022 (Swin V2), eq. 2
========== ================================ =================================

>>> from attnscore.registry import make_scorer, scorer_names
>>> scorer_names()
['additive', 'cosine', 'dot', 'general', 'scaled_dot']
>>> make_scorer("general", query_size=4, key_size=6)
MultiplicativeAttention(
  (dropout): Dropout(p=0.0, inplace=False)
  (W_a): Linear(in_features=6, out_features=4, bias=False)
)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ._checks import check_new_name
from .modules import (
    AdditiveAttention,
    Attention,
    CosineAttention,
    DotProductAttention,
    MultiplicativeAttention,
)
from .normalizers import Normalizer

__all__ = [
    "SCORERS",
    "ScorerFactory",
    "ScorerSpec",
    "get_scorer",
    "make_scorer",
    "register_scorer",
    "scorer_names",
]


class ScorerFactory(Protocol):
    """``factory(*, query_size, key_size, num_hiddens, dropout, normalizer) -> Attention``,
    all arguments by keyword.

    Scorers without parameters of these sizes (dot, scaled_dot, cosine) ignore them; the
    multi-head module passes the head size for all three sizes.

    >>> factory = get_scorer("general").factory
    >>> factory(query_size=4, key_size=6, num_hiddens=4, dropout=0.0, normalizer="softmax").W_a
    Linear(in_features=6, out_features=4, bias=False)
    """

    def __call__(
        self,
        *,
        query_size: int,
        key_size: int,
        num_hiddens: int,
        dropout: float,
        normalizer: str | Normalizer,
    ) -> Attention: ...


@dataclass(frozen=True)
class ScorerSpec:
    """A registered scorer: its name, how to build it, its formula and its source.

    >>> spec = get_scorer("scaled_dot")
    >>> spec.formula, spec.same_feature_size, spec.hidden_units
    ('qᵀk / √d', True, False)
    """

    name: str
    factory: ScorerFactory
    formula: str
    source: str
    same_feature_size: bool = False
    """True when queries and keys must have the same size d (dot, scaled_dot, cosine)."""
    hidden_units: bool = False
    """True when the scorer has a hidden layer of ``num_hiddens`` units (additive)."""


SCORERS: dict[str, ScorerSpec] = {}


def register_scorer(
    name: str,
    factory: ScorerFactory,
    *,
    formula: str,
    source: str,
    same_feature_size: bool = False,
    hidden_units: bool = False,
    replace: bool = False,
) -> ScorerSpec:
    """Register ``factory`` under ``name`` and return its :class:`ScorerSpec`.

    Args:
        name: the name used by ``scoring=`` arguments and ``--scoring`` options.
        factory: called with keywords ``query_size``, ``key_size``, ``num_hiddens``,
            ``dropout``, ``normalizer``; returns an :class:`~attnscore.Attention`.
        formula: the score a(q, k), for tables and ``--help``.
        source: where the scoring function comes from (paper, equation).
        same_feature_size: queries and keys must share their feature size.
        hidden_units: the scorer has a hidden layer of ``num_hiddens`` units.
        replace: allow replacing an existing registration.

    Raises:
        ValueError: ``name`` is not an identifier-like string or is already registered.

    >>> from attnscore import Attention
    >>> spec = register_scorer(
    ...     "neg_distance",
    ...     lambda dropout, normalizer, **sizes: Attention(
    ...         lambda x, y: -torch.cdist(x, y), dropout, normalizer=normalizer),
    ...     formula="-‖q - k‖", source="an example", same_feature_size=True)
    >>> make_scorer("neg_distance", 4)(torch.randn(2, 3, 4), torch.randn(2, 5, 4),
    ...                                torch.randn(2, 5, 6)).shape
    torch.Size([2, 3, 6])
    >>> del SCORERS["neg_distance"]
    """
    check_new_name(name, SCORERS, "scorer", replace)
    spec = ScorerSpec(name, factory, formula, source, same_feature_size, hidden_units)
    SCORERS[name] = spec
    return spec


def scorer_names() -> list[str]:
    """The registered scorer names, sorted.

    >>> "additive" in scorer_names()
    True
    """
    return sorted(SCORERS)


def get_scorer(name: str) -> ScorerSpec:
    """The :class:`ScorerSpec` registered as ``name``.

    Raises:
        ValueError: no scorer of that name, naming the registered ones.

    >>> get_scorer("dot").source
    'Luong et al. 2015, eq. 8 "dot"'
    """
    try:
        return SCORERS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"Expected `scoring` to be one of {scorer_names()}, but got {name!r} instead."
        ) from None


def make_scorer(
    name: str,
    query_size: int,
    key_size: int | None = None,
    *,
    num_hiddens: int | None = None,
    dropout: float = 0.0,
    normalizer: str | Normalizer = "softmax",
) -> Attention:
    """Build the attention module registered as ``name``.

    Args:
        name: a registered scorer name (see :func:`scorer_names`).
        query_size: q, the queries' feature size.
        key_size: k, the keys' feature size (default: ``query_size``).
        num_hiddens: h for scorers with a hidden layer (additive; default: ``query_size``).
        dropout: dropout on the attention weights.
        normalizer: the probability function (:func:`attnscore.normalizers.normalizer_names`
            or a callable ``(scores, mask) -> weights``).

    Returns:
        An :class:`~attnscore.Attention` taking queries (..., n, q) and keys (..., m, k).

    Raises:
        ValueError: unknown name, or sizes the scorer rejects.

    >>> make_scorer("additive", query_size=20, key_size=2, num_hiddens=8)(
    ...     torch.randn(2, 1, 20), torch.randn(2, 10, 2), torch.randn(2, 10, 4)).shape
    torch.Size([2, 1, 4])
    """
    spec = get_scorer(name)
    return spec.factory(
        query_size=query_size,
        key_size=query_size if key_size is None else key_size,
        num_hiddens=query_size if num_hiddens is None else num_hiddens,
        dropout=dropout,
        normalizer=normalizer,
    )


register_scorer(
    "additive",
    lambda *, query_size, key_size, num_hiddens, dropout, normalizer: AdditiveAttention(
        key_size, query_size, num_hiddens, dropout, normalizer=normalizer
    ),
    formula="w_vᵀ tanh(W_q q + W_k k)",
    source="Bahdanau et al. 2015, eq. A.1.2",
    hidden_units=True,
)
register_scorer(
    "dot",
    lambda *, dropout, normalizer, **sizes: DotProductAttention(
        dropout, scale=1.0, normalizer=normalizer
    ),
    formula="qᵀk",
    source='Luong et al. 2015, eq. 8 "dot"',
    same_feature_size=True,
)
register_scorer(
    "scaled_dot",
    lambda *, dropout, normalizer, **sizes: DotProductAttention(dropout, normalizer=normalizer),
    formula="qᵀk / √d",
    source="Vaswani et al. 2017, eq. 1",
    same_feature_size=True,
)
register_scorer(
    "general",
    lambda *, query_size, key_size, dropout, normalizer, **sizes: MultiplicativeAttention(
        query_size, key_size, dropout, normalizer=normalizer
    ),
    formula="qᵀ W_a k",
    source='Luong et al. 2015, eq. 8 "general"',
)
register_scorer(
    "cosine",
    lambda *, dropout, normalizer, **sizes: CosineAttention(
        dropout, learn_scale=True, normalizer=normalizer
    ),
    formula="s · cos(q, k), s learned",
    source="Liu et al. 2022 (Swin Transformer V2), eq. 2",
    same_feature_size=True,
)
