"""The attention pooling pipeline as functions: tensors in, tensors out.

Every attention in the library runs the same steps (D2L eq. "attn-pooling")::

    scores  = scoring(queries, keys)                 (..., n, m)
    weights = normalizer(scores, mask)               masked softmax by default
    output  = dropout(weights) @ values              (..., n, v)

Masks are checked once, here, and padded keys, values and queries are zeroed before any
arithmetic, so whatever they hold (even NaN or inf) changes neither outputs, weights nor
gradients. A scoring function may bring a fused fast path for the whole pipeline; it is
used when the result is the same and the weights are not needed at once.

Shape legend: B batch, n queries, m keys, q / k / d feature sizes, v value size, h hidden
units; ``...`` is (B,) or (B, H) for H heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypedDict, overload

import torch
import torch.nn.functional as F
from torch import Tensor
from typing_extensions import Unpack

from . import kernels
from ._checks import check_attention_inputs, check_dropout, in_transform
from .masking import AttentionMask, build_mask
from .normalizers import Normalizer, get_normalizer, softmax
from .scoring import additive_scores, default_scale, dot_product_scores

__all__ = [
    "MaskOptions",
    "additive_attention",
    "attention",
    "dot_product_attention",
]

Scoring = Callable[[Tensor, Tensor], Tensor]
WeightsFn = Callable[[], Tensor]
FusedPath = Callable[
    [Tensor, Tensor, Tensor, AttentionMask, float], "tuple[Tensor, WeightsFn] | None"
]


class MaskOptions(TypedDict, total=False):
    """Masks beyond ``valid_lens``, accepted by every attention function and module.

    Attributes:
        query_valid_lens: (B,) or (B, ...) lengths; queries at or beyond them get zero
            output.
        attend_mask: bool broadcastable to (..., n, m); **True = may attend** (as in
            ``scaled_dot_product_attention``; ``nn.MultiheadAttention``'s
            ``key_padding_mask`` means the opposite: True = ignore).
        causal: query i attends keys j <= i only (top-left alignment, as SDPA's
            ``is_causal``).

    >>> masks: MaskOptions = {"causal": True}
    >>> q = torch.randn(1, 3, 4)
    >>> _, w = dot_product_attention(q, q, q, return_weights=True, **masks)
    >>> (w > 0).int()
    tensor([[[1, 0, 0],
             [1, 1, 0],
             [1, 1, 1]]], dtype=torch.int32)
    """

    query_valid_lens: Tensor | None
    attend_mask: Tensor | None
    causal: bool


@dataclass(frozen=True)
class Prepared:
    """Checked inputs with padding zeroed, and their canonical mask."""

    queries: Tensor
    keys: Tensor
    values: Tensor
    mask: AttentionMask


def prepare(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor | None = None,
    *,
    same_feature_size: bool = False,
    **masks: Unpack[MaskOptions],
) -> Prepared:
    """Check inputs and masks once; zero padded keys, values and queries.

    Zeroing (rather than trusting the weights to be 0) is what keeps NaN or inf stored in
    padding out of the output and the gradients: 0 * NaN is NaN.
    """
    unknown = set(masks) - set(MaskOptions.__annotations__)
    if unknown:
        raise TypeError(f"Unexpected keyword argument(s) {sorted(unknown)}.")
    q, k, v = check_attention_inputs(queries, keys, values, same_feature_size=same_feature_size)
    *batch, n, _ = q.shape
    m = k.shape[-2]
    mask = build_mask(
        torch.Size(batch),
        n,
        m,
        q.device,
        valid_lens=valid_lens,
        query_valid_lens=masks.get("query_valid_lens"),
        attend_mask=masks.get("attend_mask"),
        causal=masks.get("causal", False),
    )
    padded_keys = mask.padded_keys()
    if padded_keys is not None:
        k = k.masked_fill(padded_keys.unsqueeze(-1), 0.0)
        v = v.masked_fill(padded_keys.unsqueeze(-1), 0.0)
    if mask.lengths is not None or mask.attend is not None:
        idle = _idle_queries(mask)
        if idle is not None:
            q = q.masked_fill(idle.unsqueeze(-1), 0.0)
    return Prepared(q, k, v, mask)


def _idle_queries(mask: AttentionMask) -> Tensor | None:
    """Bool (..., n): queries that may attend no key (their rows are inert)."""
    if mask.attend is None and mask.lengths is not None:
        return mask.lengths == 0
    dense = mask.dense()
    return None if dense is None else ~dense.any(dim=-1)


def attend(
    prepared: Prepared,
    scoring: Scoring,
    *,
    dropout_p: float = 0.0,
    normalizer: str | Normalizer = "softmax",
    fused: FusedPath | None = None,
) -> tuple[Tensor, WeightsFn]:
    """Run the pipeline on prepared inputs; return the output and a weights function.

    The weights function returns the (..., n, m) attention weights taken before dropout:
    on the plain path the tensor already computed, on a fused path a recomputation from
    what the forward kept (so the weights exist only if someone asks for them).
    """
    dropout_p = check_dropout(dropout_p, "dropout_p")
    normalize = get_normalizer(normalizer)
    if fused is not None and normalize is softmax:
        result = fused(prepared.queries, prepared.keys, prepared.values, prepared.mask, dropout_p)
        if result is not None:
            return result
    values = prepared.values
    # Scores arrive in float32 for 16-bit inputs (see scoring): weights and the weighted sum
    # are computed there too and rounded to the inputs' dtype once, at the end.
    scores = scoring(prepared.queries, prepared.keys)
    weights = normalize(scores, prepared.mask)
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0.0 else weights
    output = torch.matmul(dropped, values.to(weights.dtype)).to(values.dtype)
    weights = weights.to(values.dtype)
    return output, lambda: weights


def _finish(
    result: tuple[Tensor, WeightsFn], return_weights: bool
) -> Tensor | tuple[Tensor, Tensor]:
    output, weights_fn = result
    return (output, weights_fn()) if return_weights else output


def fused_dot_product(scale: float | None) -> FusedPath:
    """The fused path of scaled dot-product attention with key lengths.

    Runs :func:`attnscore.kernels.dot_product_attention` (flash SDPA on keys trimmed to each
    element's length, so padded keys cost nothing) and returns a weights function that
    recomputes the weights through the plain pipeline (same values) only when asked. Declines
    (returns None) for boolean masks, no lengths, broadcast batch shapes, empty inputs, or
    when kernels are disabled, the tensors are not on CPU, or they are being traced or
    transformed (torch.compile, vmap, ...: the plain path is what those can see through).
    """

    def fused(
        q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, dropout_p: float
    ) -> tuple[Tensor, WeightsFn] | None:
        lengths = mask.lengths
        if lengths is None or mask.attend is not None or q.ndim < 3:
            return None
        if not kernels.enabled() or q.device.type != "cpu" or in_transform(q, k, v):
            return None
        *batch, n, d = q.shape
        m, dv = k.shape[-2], v.shape[-1]
        if list(k.shape[:-2]) != batch or list(v.shape[:-2]) != batch:
            return None
        rows = math.prod(batch)
        if min(rows, n, m, d) == 0:
            return None  # empty inputs: the plain path gives the documented result
        # One length per example (expanded over queries) needs no mask inside SDPA.
        per_example = n == 1 or lengths.stride(-1) == 0
        lens = lengths[..., 0].reshape(rows) if per_example else lengths.reshape(rows, n)
        out = kernels.dot_product_attention(
            q.reshape(rows, n, d),
            k.reshape(rows, m, d),
            v.reshape(rows, m, dv),
            lens,
            scale=default_scale(d) if scale is None else scale,
            dropout_p=dropout_p,
        )
        return out.reshape(*batch, n, dv), lambda: softmax(
            dot_product_scores(q, k, scale), mask
        ).to(q.dtype)

    return fused


@overload
def attention(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    scoring: Scoring,
    valid_lens: Tensor | None = ...,
    *,
    dropout_p: float = ...,
    normalizer: str | Normalizer = ...,
    return_weights: Literal[False] = ...,
    **masks: Unpack[MaskOptions],
) -> Tensor: ...
@overload
def attention(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    scoring: Scoring,
    valid_lens: Tensor | None = ...,
    *,
    dropout_p: float = ...,
    normalizer: str | Normalizer = ...,
    return_weights: Literal[True],
    **masks: Unpack[MaskOptions],
) -> tuple[Tensor, Tensor]: ...
def attention(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    scoring: Scoring,
    valid_lens: Tensor | None = None,
    *,
    dropout_p: float = 0.0,
    normalizer: str | Normalizer = "softmax",
    return_weights: bool = False,
    **masks: Unpack[MaskOptions],
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention pooling with any scoring function.

    ``output = dropout(normalizer(scoring(queries, keys), mask)) @ values``
    (D2L eqs. "attn-pooling" and "attn-scoring-alpha").

    Args:
        queries: (..., n, q) floating. keys: (..., m, k). values: (..., m, v); one dtype
            and device for all three.
        scoring: any callable ``(queries, keys) -> scores (..., n, m)``, e.g.
            :func:`attnscore.scoring.dot_product_scores` or a user's function or module.
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

    Raises:
        TypeError: non-tensor or non-floating inputs, mixed dtypes, bad mask dtypes.
        ValueError: inconsistent shapes, bad lengths or masks (see :func:`build_mask`),
            ``dropout_p`` outside [0, 1).

    >>> from attnscore.scoring import dot_product_scores
    >>> q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
    >>> attention(q, k, v, dot_product_scores, torch.tensor([2, 5])).shape
    torch.Size([2, 3, 6])
    """
    prepared = prepare(queries, keys, values, valid_lens, **masks)
    result = attend(prepared, scoring, dropout_p=dropout_p, normalizer=normalizer)
    return _finish(result, return_weights)


@overload
def additive_attention(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    W_q: Tensor,
    W_k: Tensor,
    w_v: Tensor,
    valid_lens: Tensor | None = ...,
    *,
    bias: Tensor | None = ...,
    dropout_p: float = ...,
    normalizer: str | Normalizer = ...,
    return_weights: Literal[False] = ...,
    **masks: Unpack[MaskOptions],
) -> Tensor: ...
@overload
def additive_attention(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    W_q: Tensor,
    W_k: Tensor,
    w_v: Tensor,
    valid_lens: Tensor | None = ...,
    *,
    bias: Tensor | None = ...,
    dropout_p: float = ...,
    normalizer: str | Normalizer = ...,
    return_weights: Literal[True],
    **masks: Unpack[MaskOptions],
) -> tuple[Tensor, Tensor]: ...
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
) -> Tensor | tuple[Tensor, Tensor]:
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
    return _finish(result, return_weights)


@overload
def dot_product_attention(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor | None = ...,
    *,
    scale: float | None = ...,
    dropout_p: float = ...,
    normalizer: str | Normalizer = ...,
    return_weights: Literal[False] = ...,
    **masks: Unpack[MaskOptions],
) -> Tensor: ...
@overload
def dot_product_attention(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor | None = ...,
    *,
    scale: float | None = ...,
    dropout_p: float = ...,
    normalizer: str | Normalizer = ...,
    return_weights: Literal[True],
    **masks: Unpack[MaskOptions],
) -> tuple[Tensor, Tensor]: ...
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
) -> Tensor | tuple[Tensor, Tensor]:
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
    return _finish(result, return_weights)
