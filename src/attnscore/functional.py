"""The public functional forms of attention pooling: tensors in, tensors out.

Every form runs the shared pipeline of :mod:`attnscore._engine` (D2L eq. "attn-pooling")::

    scores  = scoring(queries, keys)                 (..., n, m)
    weights = normalizer(scores, mask)               masked softmax by default
    output  = dropout(weights) @ values              (..., n, v)

The generic :func:`attention` takes any scoring callable, or a registered scorer's name
with its parameters as tensors: the form comes from the scorer's spec
(:mod:`attnscore.registry`), as its module does. The built-in scorers also have named forms
with the textbook's arguments (:func:`additive_attention`, :func:`dot_product_attention`,
:func:`general_attention`, :func:`cosine_attention`); all run the same path.

Each returns ``output``, or ``(output, weights)`` with ``return_weights=True`` (typed so
for type checkers by one shared overload, :class:`PoolingFunction`).

Shape legend: B batch, n queries, m keys, q / k / d feature sizes, v value size, h hidden
units; ``...`` is (B,) or (B, H) for H heads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Literal, Protocol, cast, overload

import torch  # noqa: F401  (the doctests use it)
from torch import Tensor
from typing_extensions import Unpack

from ._checks import check_score_bias, check_tensor, one_length_each
from ._engine import MASK_NAMES, FusedPath, MaskOptions, Prepared, Scoring, attend, prepare
from ._habits import check_keywords
from .normalizers import Normalizer, get_normalizer, score_factor
from .registry import ProjectionFunction, ScorerSpec, get_scorer, unprojected
from .scoring import cosine_scores, dot_product_scores, unit_rows

__all__ = [
    "MaskOptions",
    "PoolingFunction",
    "PoolingOptions",
    "additive_attention",
    "attention",
    "cosine_attention",
    "dot_product_attention",
    "general_attention",
]

Result = Tensor | tuple[Tensor, Tensor]


class PoolingOptions(MaskOptions, total=False):
    """The keyword options every functional form takes, beyond its tensors: the masks of
    :class:`MaskOptions` and these four.

    Attributes:
        dropout_p: dropout on the weights, in [0, 1) (default 0; pass 0 in evaluation).
        normalizer: ``"softmax"`` (default), ``"sparsemax"``, ``"entmax15"``, ``"hardmax"``,
            a name added with :func:`attnscore.register_normalizer`, or a callable
            ``(scores, mask) -> weights``.
        return_weights: also return the weights (..., n, m), taken before dropout
            (default False); they carry gradients: the output is computed from them.
        score_bias: a floating tensor broadcastable to the scores (..., n, m), on the
            queries' device (it may require grad), added to the scores in their dtype
            before the normalizer, as SDPA adds a float ``attn_mask``: an additive mask (0
            where allowed, -inf or the dtype's lowest value where not), ALiBi's or T5's
            position bias. It masks nothing itself (a row all -inf gives NaN, as in SDPA);
            the masks above decide which keys may be attended, whatever the bias holds.

    >>> options: PoolingOptions = {"causal": True, "return_weights": True}
    >>> q = torch.randn(1, 3, 4)
    >>> out, w = dot_product_attention(q, q, q, **options)
    >>> w[0, 0]
    tensor([1., 0., 0.])
    """

    dropout_p: float
    normalizer: str | Normalizer
    return_weights: bool
    score_bias: Tensor | None


_OPTION_NAMES = frozenset(PoolingOptions.__annotations__)


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
    params: Mapping[str, Tensor] | None = None,
    **options: Unpack[PoolingOptions],
) -> Result:
    """Attention pooling with any scoring function.

    ``output = dropout(normalizer(scoring(queries, keys), mask)) @ values``
    (D2L eqs. "attn-pooling" and "attn-scoring-alpha").

    Args:
        queries: (..., n, q) floating. keys: (..., m, k). values: (..., m, v); one dtype
            and device for all three.
        scoring: any callable ``(queries, keys) -> scores (..., n, m)``, e.g.
            :func:`attnscore.scoring.dot_product_scores` or a user's function or module;
            or the name of a registered scorer (:func:`attnscore.scorer_names`, or one
            added with :func:`attnscore.register_scorer`).
        valid_lens: key lengths (B,), (B, n) or (..., n); int or whole-number float.
        params: with a scorer's name, its parameters by name, of the shapes its spec
            gives (``get_scorer(name).params``; matrices (out, in) as an ``nn.Linear``'s
            ``weight``), e.g. ``{"W_a": W_a}`` (q, k) for ``"general"``. None for scorers
            without parameters.
        **options: ``dropout_p``, ``normalizer``, ``return_weights``, ``score_bias`` and
            the masks ``query_valid_lens``, ``attend_mask``, ``causal``; see
            :class:`PoolingOptions`.

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
        TypeError: non-tensor or non-floating inputs, mixed dtypes, bad mask dtypes, a
            ``score_bias`` that is not floating.
        ValueError: inconsistent shapes, bad lengths or masks (see :func:`build_mask`), a
            ``score_bias`` that does not broadcast to (..., n, m) or on another device,
            ``dropout_p`` outside [0, 1), an unknown scorer name, ``params`` missing,
            extra or of the wrong shape.

    >>> from attnscore.scoring import dot_product_scores
    >>> q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
    >>> attention(q, k, v, dot_product_scores, torch.tensor([2, 5])).shape
    torch.Size([2, 3, 6])
    >>> torch.allclose(attention(q, k, v, "scaled_dot"), attention(q, k, v, dot_product_scores))
    True
    >>> attention(q, k, v, "general", params={"W_a": torch.randn(4, 4)}).shape
    torch.Size([2, 3, 6])
    """
    if isinstance(scoring, str):
        return _pool(get_scorer(scoring), queries, keys, values, valid_lens, params, options)
    if params is not None:
        raise TypeError(
            "Expected `params` only with a registered scorer's name as `scoring`, but got "
            f"them with a {type(scoring).__name__}."
        )
    valid_lens = one_length_each(valid_lens, queries)
    prepared = prepare(queries, keys, values, valid_lens, **_masks(options))
    return _attend(prepared, scoring, options, None)  # a user's callable: (q, k) -> scores


def _spec_tensors(
    spec: ScorerSpec, params: Mapping[str, Tensor] | None, prepared: Prepared
) -> dict[str, Tensor]:
    """The parameters given for ``spec``, checked against its shapes: q and k from the
    inputs, h from the first parameter that has it."""
    given = dict(params or {})
    names = [p.name for p in spec.params]
    if sorted(given) != sorted(names):
        raise ValueError(
            f"Expected `params` with the tensors {names} of scorer {spec.name!r}, but got "
            f"{sorted(given)} instead."
        )
    q, k = prepared.queries, prepared.keys
    sizes: dict[str, int | None] = {"query_size": q.shape[-1], "key_size": k.shape[-1]}
    for param in spec.params:
        tensor = check_tensor(given[param.name], param.name)
        if tensor.ndim == len(param.shape):
            for dim, size in zip(param.shape, tensor.shape, strict=True):
                sizes.setdefault(str(dim), size)
        expected = param.resolve(sizes)
        if tuple(tensor.shape) != expected:
            shape = tuple(
                d if d is not None else name for d, name in zip(expected, param.shape, strict=True)
            )
            raise ValueError(
                f"Expected `{param.name}` of shape {shape}, but got {tuple(tensor.shape)} instead."
            )
    return given


def _pool(
    spec: ScorerSpec,
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor | None,
    params: Mapping[str, Tensor] | None,
    options: PoolingOptions,
    **constants: object,
) -> Result:
    """The functional form of ``spec`` (what every form of a scorer runs): check inputs,
    masks and parameters once, score with the spec's function (``constants`` passed to it
    as they are), take its fused path (its projection's, bound to the parameters) where
    the weights are not asked for."""
    masks = _masks(options)
    valid_lens = one_length_each(valid_lens, queries)
    prepared = prepare(
        queries, keys, values, valid_lens, same_feature_size=spec.same_feature_size, **masks
    )
    tensors: dict[str, object] = {**_spec_tensors(spec, params, prepared), **constants}
    lengths = prepared.mask.lengths
    factor = score_factor(get_normalizer(options.get("normalizer", "softmax")))
    # The fused path runs only where the weights are not returned (_attend): it keeps none.
    fused = None if factor is None else spec.fused_path(tensors, factor, weights=False)
    return _attend(prepared, lambda q, k: spec.scores(q, k, tensors, lengths), options, fused)


def _masks(options: PoolingOptions) -> MaskOptions:
    """The masks among ``options``, after refusing keywords that are not options."""
    check_keywords(options, _OPTION_NAMES, "function")
    return cast(MaskOptions, {k: v for k, v in options.items() if k in MASK_NAMES})


def _attend(
    prepared: Prepared, scoring: Scoring, options: PoolingOptions, fused: FusedPath | None
) -> Result:
    """The pipeline on checked inputs, with ``options``' dropout, normalizer, score bias
    and weights."""
    return_weights = options.get("return_weights", False)
    score_bias = options.get("score_bias")
    if score_bias is not None:
        score_bias = check_score_bias(score_bias, prepared.queries, prepared.keys.shape[-2])
    output, weights = attend(
        prepared,
        scoring,
        dropout_p=options.get("dropout_p", 0.0),
        normalizer=options.get("normalizer", "softmax"),
        fused=fused,
        weights_asked=return_weights,
        score_bias=score_bias,
    )
    return (output, weights()) if return_weights else output


# Signature alike in shape to dot_product_attention's (`duplicates`): one pooling API, on purpose.
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
    **options: Unpack[PoolingOptions],
) -> Result:
    """Additive (Bahdanau) attention: scores ``w_vᵀ tanh(W_q q + W_k k + b)``.

    Bahdanau et al. 2015, eq. (A.1.2); D2L eq. "additive-attn". No (B, n, m, h) tensor is
    ever built.

    Args:
        queries: (..., n, q). keys: (..., m, k). values: (..., m, v).
        W_q: (h, q). W_k: (h, k). w_v: (h,) or (1, h). bias: optional (h,).
        valid_lens, options: as :func:`attention`.

    Returns:
        output (..., n, v), with the weights (..., n, m) if asked: see :func:`attention`.

    Raises:
        TypeError, ValueError: as :func:`attention`; parameters of other shapes.

    >>> q, k, v = torch.randn(2, 1, 20), torch.ones(2, 10, 2), torch.randn(2, 10, 4)
    >>> out = additive_attention(q, k, v, torch.randn(8, 20), torch.randn(8, 2),
    ...                          torch.randn(8), torch.tensor([2, 6]))
    >>> out.shape
    torch.Size([2, 1, 4])
    """
    w_v = w_v.reshape(1, -1) if isinstance(w_v, Tensor) and w_v.ndim == 1 else w_v
    params = {"W_q": W_q, "W_k": W_k, "w_v": w_v}
    return _pool(_ADDITIVE, queries, keys, values, valid_lens, params, options, bias=bias)


@_pooling
def dot_product_attention(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor | None = None,
    *,
    scale: float | None = None,
    **options: Unpack[PoolingOptions],
) -> Result:
    """Scaled dot-product attention: ``softmax(Q Kᵀ · scale) V``.

    Vaswani et al. 2017, eq. (1); D2L eq. "softmax_QK_V". ``scale`` None means 1/sqrt(d);
    ``scale=1.0`` is Luong et al. 2015's "dot".

    Args:
        queries: (..., n, d). keys: (..., m, d). values: (..., m, v).
        valid_lens, options: as :func:`attention`.

    Returns:
        As :func:`attention`; the fused path where the weights are not asked for.

    Raises:
        TypeError, ValueError: as :func:`attention`; queries and keys of different d.

    >>> q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
    >>> out, w = dot_product_attention(q, k, v, torch.tensor([2, 5]), return_weights=True)
    >>> w[0, 0, 2:].abs().sum().item()
    0.0
    """
    return _pool(_dot_product(scale), queries, keys, values, valid_lens, None, options)


@_pooling
def general_attention(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    W_a: Tensor,
    valid_lens: Tensor | None = None,
    **options: Unpack[PoolingOptions],
) -> Result:
    """General (multiplicative, bilinear) attention: scores ``qᵀ W_a k``.

    Luong et al. 2015, eq. (8) "general". Queries and keys may differ in size.

    Args:
        queries: (..., n, q). keys: (..., m, k). values: (..., m, v).
        W_a: (q, k), as :class:`attnscore.MultiplicativeAttention`'s ``W_a.weight``.
        valid_lens, options: as :func:`attention`.

    Returns:
        As :func:`attention`: zero output where a query may attend no key.

    Raises:
        TypeError, ValueError: as :func:`attention`; also ``W_a`` not of shape (q, k).

    >>> q, k, v = torch.randn(2, 1, 3), torch.randn(2, 4, 5), torch.randn(2, 4, 6)
    >>> general_attention(q, k, v, torch.randn(3, 5), torch.tensor([1, 4])).shape
    torch.Size([2, 1, 6])
    """
    return _pool(_GENERAL, queries, keys, values, valid_lens, {"W_a": W_a}, options)


@_pooling
def cosine_attention(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor | None = None,
    *,
    scale: float | Tensor = 10.0,
    **options: Unpack[PoolingOptions],
) -> Result:
    """Scaled cosine attention: scores ``scale · cos(q, k)``.

    Liu et al. 2022 (Swin Transformer V2), eq. (2), with scale = 1/τ. Zero vectors score 0.

    Args:
        queries: (..., n, d). keys: (..., m, d). values: (..., m, v).
        scale: the inverse temperature, a float or a 0-d tensor (may require grad).
        valid_lens, options: as :func:`attention`.

    Returns:
        As :func:`attention` (zero vectors score 0 against every key).

    Raises:
        TypeError, ValueError: as :func:`attention`; queries and keys of different d.

    >>> q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
    >>> cosine_attention(q, k, v, torch.tensor([2, 5]), scale=5.0).shape
    torch.Size([2, 3, 6])
    """
    return _pool(_COSINE_FORM, queries, keys, values, valid_lens, None, options, scale=scale)


# The built-in specs the named forms stand for (captured at import: a later registration
# replacing a name does not change these forms).
_ADDITIVE, _GENERAL, _SCALED_DOT = map(get_scorer, ("additive", "general", "scaled_dot"))


def _ad_hoc(
    name: str, score: Scoring, projection: ProjectionFunction, scale: float | None
) -> ScorerSpec:
    """A spec of a named form with its own constants (not registered; queries and keys of
    one size d)."""
    return ScorerSpec(name, score, "", "", (), True, None, projection, scale)


# Its scale comes with each call: cosine scores are dot products of (scale q/‖q‖, k/‖k‖).
_COSINE_FORM = _ad_hoc(
    "cosine", cosine_scores, lambda q, k, scale: (unit_rows(q) * scale, unit_rows(k)), 1.0
)


def _dot_product(scale: float | None) -> ScorerSpec:
    """The spec of dot-product attention with a fixed ``scale`` (the default one built once:
    the functional forms are hot)."""
    if scale is None:
        return _SCALED_DOT
    return _ad_hoc("dot_product", partial(dot_product_scores, scale=scale), unprojected, scale)
