"""``nn.Module`` wrappers: parameters and configuration around the functional pipeline.

Each module's ``forward`` checks its inputs and masks once, computes scores with its
scoring function (:mod:`attnscore.scoring`), and runs the shared pooling step
(:func:`attnscore.functional.attend`). Subclasses only say how to score.

Shape legend: B batch, n queries, m keys, q / k / d feature sizes, v value size, h hidden
units; ``...`` is (B,) or (B, H).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ._checks import check_dropout, in_transform
from ._engine import FusedPath, Prepared, WeightsFn, attend, fused_dot_product, prepare
from .normalizers import Normalizer, get_normalizer
from .scoring import (
    additive_scores_from_projections,
    cosine_scores,
    dot_product_scores,
    general_scores,
)

__all__ = [
    "AdditiveAttention",
    "Attention",
    "CosineAttention",
    "DotProductAttention",
    "MultiplicativeAttention",
]


def _check_size(value: object, name: str, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Expected `{name}` to be a positive int, but got {value!r} instead.")
    return value


def _check_features(linear: nn.Module, x: Tensor, name: str, size_name: str) -> None:
    """Name the argument when its feature size disagrees with a layer built for another."""
    expected = getattr(linear, "in_features", 0)
    if expected and x.shape[-1] != expected:
        raise ValueError(
            f"Expected `{name}` with last dimension {size_name}={expected}, but got shape "
            f"{tuple(x.shape)} instead."
        )


def _is_lazy(linear: nn.Module) -> bool:
    """An ``nn.LazyLinear`` whose weight is not materialised yet."""
    return isinstance(linear, nn.LazyLinear) and linear.has_uninitialized_params()


class Attention(nn.Module):
    """Attention pooling with any scoring function.

    ``forward(queries, keys, values, valid_lens=None, *, query_valid_lens=None,
    attend_mask=None, causal=False)`` returns ``dropout(normalizer(scores, mask)) @ values``
    with queries (..., n, q), keys (..., m, k), values (..., m, v) -> output (..., n, v).
    Dropout acts on the weights in training mode only.

    After each call, :attr:`attention_weights` holds that call's (..., n, m) weights, taken
    before dropout (rows sum to 1 over the keys they may attend; rows with no such key are
    zero). They are detached (for inspection), and on fast paths computed on first access.
    With several threads calling one module, it is the last call's (the outputs are each
    call's own: ``forward`` keeps no other state; the functional forms keep none).

    Args:
        scoring: a callable ``(queries, keys) -> scores (..., n, m)``: a plain function
            (e.g. :func:`attnscore.scoring.dot_product_scores`) or an ``nn.Module``, whose
            parameters then belong to this module. Subclasses leave it None and override
            :meth:`score`.
        dropout: dropout probability on the weights, in [0, 1).
        normalizer: ``"softmax"`` (default), ``"sparsemax"``, ``"entmax15"`` (optional
            ``entmax`` package), ``"hardmax"``, or a callable ``(scores, mask) -> weights``.

    Raises:
        TypeError, ValueError: bad ``dropout`` or ``normalizer`` here; bad inputs or masks
            in ``forward`` (see :func:`attnscore.functional.attention`).

    >>> attn = Attention(lambda q, k: -torch.cdist(q, k))   # a user's own scoring function
    >>> attn(torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)).shape
    torch.Size([2, 3, 6])
    """

    #: Whether queries and keys must share their feature size (dot-product-like scores).
    same_feature_size: bool = False

    def __init__(
        self,
        scoring: Callable[[Tensor, Tensor], Tensor] | None = None,
        dropout: float = 0.0,
        *,
        normalizer: str | Normalizer = "softmax",
    ) -> None:
        super().__init__()
        if scoring is not None and not callable(scoring):
            raise TypeError(
                f"Expected `scoring` to be callable (queries, keys) -> scores, but got "
                f"{type(scoring).__name__} instead."
            )
        self.scoring = scoring
        self.dropout = nn.Dropout(check_dropout(dropout))
        get_normalizer(normalizer)  # fail at construction, not at the first call
        self.normalizer = normalizer
        # The last call's weights: a tensor once computed, or the function computing them
        # (fast paths compute them only when asked), or None before any call. One attribute,
        # replaced whole, so that concurrent calls never mix two calls' halves.
        self._weights: Tensor | WeightsFn | None = None

    def score(self, queries: Tensor, keys: Tensor, lengths: Tensor | None) -> Tensor:
        """Scores (..., n, m) for checked queries (..., n, q) and keys (..., m, k).

        ``lengths`` (int64 (..., n) or None) is a hint: scores at keys j >= lengths[..., i]
        are masked afterwards, so a scorer may skip them.
        """
        if self.scoring is None:
            raise NotImplementedError(
                f"{type(self).__name__} has no scoring function: pass `scoring` or override "
                "`score`."
            )
        return self.scoring(queries, keys)

    def fused_path(self) -> FusedPath | None:
        """A fused implementation of the whole pipeline, if this scorer has one."""
        return None

    def forward(
        self,
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        valid_lens: Tensor | None = None,
        *,
        query_valid_lens: Tensor | None = None,
        attend_mask: Tensor | None = None,
        causal: bool = False,
    ) -> Tensor:
        """Attention pooling of ``values`` by the weights of ``queries`` over ``keys``.

        Args:
            queries: (..., n, q) floating (``...`` is (B,) or (B, H)). keys: (..., m, k).
                values: (..., m, v). One dtype and device for all three; dot-product-like
                scorers need q == k.
            valid_lens: key lengths (B,) (one per example), (B, n) (one per query) or
                (..., n); int or whole-number float; lengths above m mean all keys.
            query_valid_lens: query lengths (B,) or (...); queries at or beyond them
                attend nothing.
            attend_mask: bool broadcastable to (..., n, m); **True = may attend**.
            causal: query i attends keys j <= i only (top-left aligned).

        Returns:
            output (..., n, v) in the inputs' dtype: ``dropout(weights) @ values`` with
            ``weights = normalizer(score(queries, keys), mask)``. Queries that may attend
            no key give zero output (and zero gradient). The weights (..., n, m), before
            dropout, are in :attr:`attention_weights` afterwards.

        Raises:
            TypeError: non-tensor or non-floating inputs, mixed dtypes, bad mask dtypes.
            ValueError: inconsistent shapes (or feature sizes unlike the parameters'),
                negative or fractional lengths, masks of the wrong shape or device.
        """
        # The previous call's weights go first, so that this call's buffers can take their
        # memory (kept until the next call, they cost a cache's worth of speed otherwise).
        self.__dict__["_weights"] = None
        prepared = prepare(
            queries,
            keys,
            values,
            valid_lens,
            same_feature_size=self.same_feature_size,
            query_valid_lens=query_valid_lens,
            attend_mask=attend_mask,
            causal=causal,
        )
        output, weights_fn = self._attend(prepared)
        # Straight into __dict__: nn.Module.__setattr__ costs microseconds per call.
        self.__dict__["_weights"] = weights_fn
        return output

    def _attend(self, prepared: Prepared) -> tuple[Tensor, WeightsFn]:
        lengths = prepared.mask.lengths
        return attend(
            prepared,
            lambda q, k: self.score(q, k, lengths),
            dropout_p=self.dropout.p if self.training else 0.0,
            normalizer=self.normalizer,
            fused=self.fused_path(),
        )

    @property
    def attention_weights(self) -> Tensor | None:
        """The last call's weights (..., n, m), before dropout and detached; None before."""
        weights = self._weights
        if weights is None or isinstance(weights, Tensor):
            return weights
        with torch.no_grad():
            computed = weights().detach()
        self.__dict__["_weights"] = computed
        return computed

    def __getstate__(self) -> dict[str, object]:
        # The weights function is a closure (not picklable); keep the computed weights.
        self.attention_weights  # noqa: B018
        state = self.__dict__.copy()
        if "_keys_cache" in state:  # a weak reference: not picklable, and only a cache
            state["_keys_cache"] = None
        return state

    def extra_repr(self) -> str:
        extra = f"normalizer={self.normalizer!r}" if self.normalizer != "softmax" else ""
        return extra


class AdditiveAttention(Attention):
    """Additive (Bahdanau) attention, ``a(q, k) = w_vᵀ tanh(W_q q + W_k k [+ b])``.

    Bahdanau et al. 2015, eq. (A.1.2); D2L eq. "additive-attn". Parameters ``W_q``,
    ``W_k`` (``nn.Linear``, no bias) and ``w_v`` (``nn.Linear(num_hiddens, 1, bias=False)``)
    match the textbook's PyTorch class, so its state_dict loads with ``strict=True``. No
    (B, n, m, h) tensor is ever built.

    Args:
        key_size: k; None infers it on the first call (as the MXNet rendition and D2L's
            newer edition do, via ``nn.LazyLinear``).
        query_size: q; None infers it on the first call.
        num_hiddens: h, the hidden units of the scoring MLP (required).
        dropout: dropout on the attention weights (training mode only).
        bias: add a learned bias ``b`` (h,) inside the tanh (Bahdanau's original form).
        normalize: weight-normalise ``w_v`` as ``g · w_v / ‖w_v‖`` with a learned scalar
            gain ``g`` (init 1/sqrt(h)); implies ``bias`` (TensorFlow Addons'
            ``BahdanauAttention(normalize=True)``; Salimans & Kingma 2016).
        normalizer: as :class:`Attention`.

    Shapes: ``forward(queries (..., n, q), keys (..., m, k), values (..., m, v),
    valid_lens=None)`` -> (..., n, v); see :class:`Attention` for masks and weights.

    Raises:
        ValueError: sizes that are not positive ints; TypeError: missing ``num_hiddens``.

    >>> attention = AdditiveAttention(key_size=2, query_size=20, num_hiddens=8).eval()
    >>> queries, keys = torch.randn(2, 1, 20), torch.ones(2, 10, 2)
    >>> values = torch.arange(40.0).reshape(1, 10, 4).repeat(2, 1, 1)
    >>> attention(queries, keys, values, torch.tensor([2, 6])).detach().round(decimals=4)
    tensor([[[ 2.,  3.,  4.,  5.]],
    <BLANKLINE>
            [[10., 11., 12., 13.]]])
    """

    def __init__(
        self,
        key_size: int | None = None,
        query_size: int | None = None,
        num_hiddens: int | None = None,
        dropout: float = 0.0,
        *,
        bias: bool = False,
        normalize: bool = False,
        normalizer: str | Normalizer = "softmax",
    ) -> None:
        super().__init__(dropout=dropout, normalizer=normalizer)
        if num_hiddens is None:
            raise TypeError("AdditiveAttention needs `num_hiddens` (the h of W_q, W_k, w_v).")
        h = _check_size(num_hiddens, "num_hiddens")
        assert h is not None
        k = _check_size(key_size, "key_size", optional=True)
        q = _check_size(query_size, "query_size", optional=True)
        self.W_k = nn.Linear(k, h, bias=False) if k else nn.LazyLinear(h, bias=False)
        self.W_q = nn.Linear(q, h, bias=False) if q else nn.LazyLinear(h, bias=False)
        self.w_v = nn.Linear(h, 1, bias=False)
        self._keys_cache: tuple[weakref.ref[Tensor], tuple[object, ...], Tensor] | None = None
        self.normalize = bool(normalize)
        if normalize or bias:
            self.b = nn.Parameter(torch.zeros(h))
        else:
            self.register_parameter("b", None)
        if normalize:
            self.g = nn.Parameter(torch.tensor(1.0 / math.sqrt(h)))
        else:
            self.register_parameter("g", None)

    def score(self, queries: Tensor, keys: Tensor, lengths: Tensor | None) -> Tensor:
        _check_features(self.W_q, queries, "queries", "query_size")
        _check_features(self.W_k, keys, "keys", "key_size")
        qh = self.W_q(queries)
        if self.b is not None:
            qh = qh + self.b
        w = self.w_v.weight
        if self.g is not None:
            w = self.g * w / w.norm()
        return additive_scores_from_projections(qh, self._projected_keys(keys), w, lengths)

    def _projected_keys(self, keys: Tensor) -> Tensor:
        """``W_k keys``, computed once for the keys a decoder passes at every step.

        Without gradients (decoding under ``torch.no_grad``), the projection of the last
        keys tensor is kept and reused while the same tensor comes back unchanged (same
        object, same version: no in-place change since) and ``W_k`` is unchanged. With
        gradients nothing is kept: a kept projection would tie steps of autograd graphs.
        Inference-mode tensors keep no version counter, so they are never reused; nor is
        anything while tracing or compiling (a graph must hold the projection).
        """
        weight = self.W_k.weight
        if (
            torch.is_grad_enabled()
            or keys.is_inference()
            or _is_lazy(self.W_k)
            or (in_transform(keys))
        ):
            self.__dict__["_keys_cache"] = None
            return self.W_k(keys)  # type: ignore[no-any-return]
        stamp = (keys._version, weight._version, weight.data_ptr(), weight.dtype)
        cached = self._keys_cache
        if cached is not None and cached[0]() is keys and cached[1] == stamp:
            return cached[2]
        projected: Tensor = self.W_k(keys)
        self.__dict__["_keys_cache"] = (weakref.ref(keys), stamp, projected)
        return projected


class DotProductAttention(Attention):
    """Scaled dot-product attention, ``softmax(Q Kᵀ · scale) V``.

    Vaswani et al. 2017, eq. (1); D2L eq. "softmax_QK_V".

    Args:
        dropout: dropout on the attention weights (training mode only).
        scale: None for 1/sqrt(d) (scaled dot product); 1.0 for Luong et al. 2015's "dot".
        normalizer: as :class:`Attention`.

    Shapes: queries (..., n, d), keys (..., m, d), values (..., m, v) -> (..., n, v).

    Raises:
        ValueError: in ``forward``, queries and keys of different d; see :class:`Attention`.

    >>> attention = DotProductAttention(dropout=0.5).eval()
    >>> queries, keys = torch.randn(2, 1, 2), torch.ones(2, 10, 2)
    >>> values = torch.arange(40.0).reshape(1, 10, 4).repeat(2, 1, 1)
    >>> attention(queries, keys, values, torch.tensor([2, 6])).round(decimals=4)
    tensor([[[ 2.,  3.,  4.,  5.]],
    <BLANKLINE>
            [[10., 11., 12., 13.]]])
    """

    same_feature_size = True

    def __init__(
        self,
        dropout: float = 0.0,
        *,
        scale: float | None = None,
        normalizer: str | Normalizer = "softmax",
    ) -> None:
        super().__init__(dropout=dropout, normalizer=normalizer)
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
            raise TypeError(f"Expected `scale` to be a float or None, but got {scale!r} instead.")
        self.scale = None if scale is None else float(scale)

    def score(self, queries: Tensor, keys: Tensor, lengths: Tensor | None) -> Tensor:
        return dot_product_scores(queries, keys, self.scale)

    def fused_path(self) -> FusedPath | None:
        """Padding-free flash SDPA when key lengths are given (see fused_dot_product)."""
        return fused_dot_product(self.scale)

    def extra_repr(self) -> str:
        return ", ".join(filter(None, [f"scale={self.scale}", super().extra_repr()]))


class MultiplicativeAttention(Attention):
    """General (multiplicative, bilinear) attention, ``a(q, k) = qᵀ W_a k``.

    Luong et al. 2015, eq. (8) "general". Queries and keys may differ in size.

    Args:
        query_size: q (required).
        key_size: k; None infers it on the first call.
        dropout, normalizer: as :class:`Attention`.

    Shapes: queries (..., n, q), keys (..., m, k), values (..., m, v) -> (..., n, v).
    ``W_a`` is ``nn.Linear(key_size, query_size, bias=False)``.

    >>> attention = MultiplicativeAttention(query_size=20, key_size=2)
    >>> attention(torch.randn(2, 1, 20), torch.randn(2, 10, 2), torch.randn(2, 10, 4)).shape
    torch.Size([2, 1, 4])
    """

    def __init__(
        self,
        query_size: int,
        key_size: int | None = None,
        dropout: float = 0.0,
        *,
        normalizer: str | Normalizer = "softmax",
    ) -> None:
        super().__init__(dropout=dropout, normalizer=normalizer)
        q = _check_size(query_size, "query_size")
        assert q is not None
        k = _check_size(key_size, "key_size", optional=True)
        self.W_a = nn.Linear(k, q, bias=False) if k else nn.LazyLinear(q, bias=False)

    def score(self, queries: Tensor, keys: Tensor, lengths: Tensor | None) -> Tensor:
        _check_features(self.W_a, keys, "keys", "key_size")
        if queries.shape[-1] != self.W_a.out_features:
            raise ValueError(
                f"Expected `queries` with last dimension query_size={self.W_a.out_features}, "
                f"but got shape {tuple(queries.shape)} instead."
            )
        if isinstance(self.W_a, nn.LazyLinear) and self.W_a.has_uninitialized_params():
            self.W_a(keys[..., :1, :])  # materialise W_a from the key size
        return general_scores(queries, keys, self.W_a.weight)


class CosineAttention(Attention):
    """Scaled cosine attention, ``a(q, k) = s · cos(q, k)`` with a fixed or learned s.

    Liu et al. 2022 (Swin Transformer V2), eq. (2), with s = 1/τ. A learned scale is kept
    as its logarithm so that it stays positive.

    Args:
        dropout, normalizer: as :class:`Attention`.
        scale: s, the inverse temperature (default 10).
        learn_scale: learn s (parameter ``log_scale``).

    Shapes: queries (..., n, d), keys (..., m, d), values (..., m, v) -> (..., n, v).

    >>> CosineAttention()(torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)).shape
    torch.Size([2, 3, 6])
    """

    same_feature_size = True

    def __init__(
        self,
        dropout: float = 0.0,
        *,
        scale: float = 10.0,
        learn_scale: bool = False,
        normalizer: str | Normalizer = "softmax",
    ) -> None:
        super().__init__(dropout=dropout, normalizer=normalizer)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
            raise ValueError(f"Expected `scale` to be a positive float, but got {scale!r} instead.")
        log_scale = torch.tensor(math.log(scale))
        if learn_scale:
            self.log_scale = nn.Parameter(log_scale)
        else:
            self.register_buffer("log_scale", log_scale)

    def score(self, queries: Tensor, keys: Tensor, lengths: Tensor | None) -> Tensor:
        return cosine_scores(queries, keys, self.log_scale.exp().to(queries.dtype))
