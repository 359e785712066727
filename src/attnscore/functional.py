"""The public functional forms of attention pooling: tensors in, tensors out.

Every form runs the shared pipeline of :mod:`attnscore._engine` (D2L eq. "attn-pooling")::

    scores  = scoring(queries, keys)                 (..., n, m)
    weights = normalizer(scores, mask)               masked softmax by default
    output  = dropout(weights) @ values              (..., n, v)

One form per registered scorer with parameters given as tensors (:func:`additive_attention`,
:func:`dot_product_attention`, :func:`general_attention`, :func:`cosine_attention`) and the
generic :func:`attention`, which takes any scoring callable or a registered scorer's name.

Each returns ``output`` or, with ``return_weights=True``, ``(output, weights)``; the
return type follows ``return_weights`` for type checkers (one shared overload,
:class:`PoolingFunction`).

Shape legend: B batch, n queries, m keys, q / k / d feature sizes, v value size, h hidden
units; ``...`` is (B,) or (B, H) for H heads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol, cast, overload

import torch  # noqa: F401  (the doctests use it)
from torch import Tensor
from typing_extensions import Unpack

from ._engine import MaskOptions, Scoring, attend, finish, fused_dot_product, prepare
from .normalizers import Normalizer
from .registry import get_scorer
from .scoring import additive_scores, cosine_scores, dot_product_scores, general_scores

__all__ = [
    "MaskOptions",
    "PoolingFunction",
    "additive_attention",
    "attention",
    "cosine_attention",
    "dot_product_attention",
    "general_attention",
]

Result = Tensor | tuple[Tensor, Tensor]


class PoolingFunction(Protocol):
    """The type of every functional form: ``output`` (..., n, v), or ``(output, weights)``
    with ``weights`` (..., n, m) when called with ``return_weights=True``.

    >>> q = torch.randn(1, 2, 4)
    >>> out, weights = dot_product_attention(q, q, q, return_weights=True)
    >>> out.shape, weights.shape
    (torch.Size([1, 2, 4]), torch.Size([1, 2, 2]))
    """

    @overload
    def __call__(
        self, *args: Any, return_weights: Literal[False] = ..., **kwargs: Any
    ) -> Tensor: ...
    @overload
    def __call__(
        self, *args: Any, return_weights: Literal[True], **kwargs: Any
    ) -> tuple[Tensor, Tensor]: ...
    @overload
    def __call__(self, *args: Any, return_weights: bool, **kwargs: Any) -> Result: ...


def _pooling(fn: Callable[..., Result]) -> PoolingFunction:
    """Give a functional form the return type that follows ``return_weights``."""
    return cast(PoolingFunction, fn)


@_pooling
def attention(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    scoring: Scoring | str,
    valid_lens: Tensor | None = None,
    *,
    dropout_p: float = 0.0,
    normalizer: str | Normalizer = "softmax",
    return_weights: bool = False,
    **masks: Unpack[MaskOptions],
) -> Result:
    """Attention pooling with any scoring function.

    ``output = dropout(normalizer(scoring(queries, keys), mask)) @ values``
    (D2L eqs. "attn-pooling" and "attn-scoring-alpha").

    Args:
        queries: (..., n, q) floating. keys: (..., m, k). values: (..., m, v); one dtype
            and device for all three.
        scoring: any callable ``(queries, keys) -> scores (..., n, m)``, e.g.
            :func:`attnscore.scoring.dot_product_scores` or a user's function or module;
            or the name of a registered scorer without parameters (``"dot"``,
            ``"scaled_dot"``, or one added with :func:`attnscore.register_scorer`). Scorers
            with parameters have their own forms (:func:`additive_attention`,
            :func:`general_attention`, :func:`cosine_attention`) and modules.
        valid_lens: key lengths (B,), (B, n) or (..., n); int or whole-number float.
        dropout_p: dropout on the weights (pass 0 in evaluation).
        normalizer: ``"softmax"`` (default), ``"sparsemax"``, ``"entmax15"``, ``"hardmax"``
            or a callable ``(scores, mask) -> weights``.
        return_weights: also return the weights (..., n, m), taken before dropout.
        **masks: ``query_valid_lens``, ``attend_mask`` (True = may attend), ``causal``;
            see :class:`MaskOptions`.

    Returns:
        output (..., n, v) in the inputs' dtype, and the weights if asked. Queries that
        may attend no key (valid length 0, padded queries) give zero weights and zero
        output, with zero gradient. Empty dimensions are not errors: n = 0 or a batch of
        0 give empty results; m = 0 (no keys) gives zero output and (..., n, 0) weights;
        feature size 0 gives zero scores. NaN in what is attended propagates to the
        output (never hidden); NaN in padding changes nothing.

    Equivalent to this plain code (softmax normalizer; ``valid_lens`` (B,) or (B, n)),
    which masks with -inf and then turns rows with no valid key into zeros::

        def attention(queries, keys, values, scoring, valid_lens=None, dropout_p=0.0):
            scores = scoring(queries, keys)                       # (..., n, m)
            n, m = scores.shape[-2:]
            allowed = torch.ones(scores.shape, dtype=torch.bool)
            if valid_lens is not None:
                lengths = valid_lens.reshape(valid_lens.shape[0], -1)  # (B, 1) or (B, n)
                lengths = lengths.reshape(-1, *[1] * (scores.ndim - 3), lengths.shape[-1])
                allowed = torch.arange(m) < lengths.unsqueeze(-1)    # (..., n, m)
            weights = torch.softmax(scores.masked_fill(~allowed, -torch.inf), dim=-1)
            weights = torch.where(allowed, weights, 0.0)          # no valid key: zeros
            values = values.masked_fill(~allowed.any(-2).unsqueeze(-1), 0.0)  # padding
            return torch.dropout(weights, dropout_p, train=True) @ values

    Raises:
        TypeError: non-tensor or non-floating inputs, mixed dtypes, bad mask dtypes.
        ValueError: inconsistent shapes, bad lengths or masks (see :func:`build_mask`),
            ``dropout_p`` outside [0, 1), an unknown scorer name or one with parameters.

    >>> from attnscore.scoring import dot_product_scores
    >>> q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
    >>> attention(q, k, v, dot_product_scores, torch.tensor([2, 5])).shape
    torch.Size([2, 3, 6])
    >>> torch.allclose(attention(q, k, v, "scaled_dot"), attention(q, k, v, dot_product_scores))
    True
    """
    if isinstance(scoring, str):
        return _attention_by_name(
            queries,
            keys,
            values,
            scoring,
            valid_lens,
            dropout_p,
            normalizer,
            return_weights,
            masks,
        )
    prepared = prepare(queries, keys, values, valid_lens, **masks)
    result = attend(prepared, scoring, dropout_p=dropout_p, normalizer=normalizer)
    return finish(result, return_weights)


def _attention_by_name(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    name: str,
    valid_lens: Tensor | None,
    dropout_p: float,
    normalizer: str | Normalizer,
    return_weights: bool,
    masks: MaskOptions,
) -> Result:
    """:func:`attention` with a registered scorer's name: its module's scores and fused path."""
    spec = get_scorer(name)
    q_size = queries.shape[-1] if isinstance(queries, Tensor) else 1
    k_size = keys.shape[-1] if isinstance(keys, Tensor) else 1
    scorer = spec.factory(
        query_size=q_size, key_size=k_size, num_hiddens=q_size, dropout=0.0, normalizer="softmax"
    )
    if any(True for _ in scorer.parameters()):
        raise ValueError(
            f"Expected `scoring` to name a scorer without parameters, but got {name!r}, whose "
            f"{type(scorer).__name__} has parameters: use its own functional form or module."
        )
    prepared = prepare(
        queries, keys, values, valid_lens, same_feature_size=spec.same_feature_size, **masks
    )
    scorer.to(prepared.queries.device)
    lengths = prepared.mask.lengths
    result = attend(
        prepared,
        lambda q, k: scorer.score(q, k, lengths),
        dropout_p=dropout_p,
        normalizer=normalizer,
        fused=None if return_weights else scorer.fused_path(),
    )
    return finish(result, return_weights)


@_pooling
def additive_attention(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    W_q: Tensor,
    W_k: Tensor,
    w_v: Tensor,
    valid_lens: Tensor | None = None,
    *,
    bias: Tensor | None = None,
    dropout_p: float = 0.0,
    normalizer: str | Normalizer = "softmax",
    return_weights: bool = False,
    **masks: Unpack[MaskOptions],
) -> Result:
    """Additive (Bahdanau) attention: scores ``w_vᵀ tanh(W_q q + W_k k + b)``.

    Bahdanau et al. 2015, eq. (A.1.2); D2L eq. "additive-attn". No (B, n, m, h) tensor is
    ever built.

    Args:
        queries: (..., n, q). keys: (..., m, k). values: (..., m, v).
        W_q: (h, q). W_k: (h, k). w_v: (h,) or (1, h). bias: optional (h,).
        valid_lens, dropout_p, normalizer, return_weights, masks: as :func:`attention`.

    Returns:
        output (..., n, v), and the weights (..., n, m) if asked; rows with no valid key
        are zero.

    Raises:
        TypeError, ValueError: as :func:`attention`.

    >>> q, k, v = torch.randn(2, 1, 20), torch.ones(2, 10, 2), torch.randn(2, 10, 4)
    >>> out = additive_attention(q, k, v, torch.randn(8, 20), torch.randn(8, 2),
    ...                          torch.randn(8), torch.tensor([2, 6]))
    >>> out.shape
    torch.Size([2, 1, 4])
    """
    prepared = prepare(queries, keys, values, valid_lens, **masks)
    lengths = prepared.mask.lengths

    def scoring(q: Tensor, k: Tensor) -> Tensor:
        return additive_scores(q, k, W_q, W_k, w_v, bias, lengths)

    result = attend(prepared, scoring, dropout_p=dropout_p, normalizer=normalizer)
    return finish(result, return_weights)


@_pooling
def dot_product_attention(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor | None = None,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    normalizer: str | Normalizer = "softmax",
    return_weights: bool = False,
    **masks: Unpack[MaskOptions],
) -> Result:
    """Scaled dot-product attention: ``softmax(Q Kᵀ · scale) V``.

    Vaswani et al. 2017, eq. (1); D2L eq. "softmax_QK_V". ``scale`` None means 1/sqrt(d);
    ``scale=1.0`` is Luong et al. 2015's "dot".

    Args:
        queries: (..., n, d). keys: (..., m, d). values: (..., m, v).
        valid_lens, dropout_p, normalizer, return_weights, masks: as :func:`attention`.

    Returns:
        output (..., n, v), and the weights (..., n, m) if asked; rows with no valid key
        are zero.

    Raises:
        TypeError, ValueError: as :func:`attention`; also when queries and keys differ in
            feature size d.

    >>> q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
    >>> out, w = dot_product_attention(q, k, v, torch.tensor([2, 5]), return_weights=True)
    >>> w[0, 0, 2:].abs().sum().item()
    0.0
    """
    prepared = prepare(queries, keys, values, valid_lens, same_feature_size=True, **masks)

    def scoring(q: Tensor, k: Tensor) -> Tensor:
        return dot_product_scores(q, k, scale)

    # Weights asked for now: the plain path computes them once anyway.
    fused = None if return_weights else fused_dot_product(scale)
    result = attend(prepared, scoring, dropout_p=dropout_p, normalizer=normalizer, fused=fused)
    return finish(result, return_weights)


@_pooling
def general_attention(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    W_a: Tensor,
    valid_lens: Tensor | None = None,
    *,
    dropout_p: float = 0.0,
    normalizer: str | Normalizer = "softmax",
    return_weights: bool = False,
    **masks: Unpack[MaskOptions],
) -> Result:
    """General (multiplicative, bilinear) attention: scores ``qᵀ W_a k``.

    Luong et al. 2015, eq. (8) "general". Queries and keys may differ in size.

    Args:
        queries: (..., n, q). keys: (..., m, k). values: (..., m, v).
        W_a: (q, k), as :class:`attnscore.MultiplicativeAttention`'s ``W_a.weight``.
        valid_lens, dropout_p, normalizer, return_weights, masks: as :func:`attention`.

    Returns:
        output (..., n, v), and the weights (..., n, m) if asked; rows with no valid key
        are zero.

    Raises:
        TypeError, ValueError: as :func:`attention`; also ``W_a`` not of shape (q, k).

    >>> q, k, v = torch.randn(2, 1, 3), torch.randn(2, 4, 5), torch.randn(2, 4, 6)
    >>> general_attention(q, k, v, torch.randn(3, 5), torch.tensor([1, 4])).shape
    torch.Size([2, 1, 6])
    """
    prepared = prepare(queries, keys, values, valid_lens, **masks)
    expected = (prepared.queries.shape[-1], prepared.keys.shape[-1])
    if not isinstance(W_a, Tensor) or tuple(W_a.shape) != expected:
        got = tuple(W_a.shape) if isinstance(W_a, Tensor) else type(W_a).__name__
        raise ValueError(f"Expected `W_a` of shape {expected}, but got {got} instead.")

    def scoring(q: Tensor, k: Tensor) -> Tensor:
        return general_scores(q, k, W_a)

    result = attend(prepared, scoring, dropout_p=dropout_p, normalizer=normalizer)
    return finish(result, return_weights)


@_pooling
def cosine_attention(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor | None = None,
    *,
    scale: float | Tensor = 10.0,
    dropout_p: float = 0.0,
    normalizer: str | Normalizer = "softmax",
    return_weights: bool = False,
    **masks: Unpack[MaskOptions],
) -> Result:
    """Scaled cosine attention: scores ``scale · cos(q, k)``.

    Liu et al. 2022 (Swin Transformer V2), eq. (2), with scale = 1/τ. Zero vectors score 0.

    Args:
        queries: (..., n, d). keys: (..., m, d). values: (..., m, v).
        scale: the inverse temperature, a float or a 0-d tensor (may require grad).
        valid_lens, dropout_p, normalizer, return_weights, masks: as :func:`attention`.

    Returns:
        output (..., n, v), and the weights (..., n, m) if asked; rows with no valid key
        are zero.

    Raises:
        TypeError, ValueError: as :func:`attention`; also when queries and keys differ in
            feature size d.

    >>> q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
    >>> cosine_attention(q, k, v, torch.tensor([2, 5]), scale=5.0).shape
    torch.Size([2, 3, 6])
    """
    prepared = prepare(queries, keys, values, valid_lens, same_feature_size=True, **masks)

    def scoring(q: Tensor, k: Tensor) -> Tensor:
        return cosine_scores(q, k, scale)

    result = attend(prepared, scoring, dropout_p=dropout_p, normalizer=normalizer)
    return finish(result, return_weights)
