"""The attention pipeline engine (private): checked inputs in, output and weights out.

Every attention in the library runs the same steps (D2L eq. "attn-pooling")::

    prepared = prepare(queries, keys, values, valid_lens, **masks)   check once, zero padding
    scores   = scoring(queries, keys)                 (..., n, m)
    weights  = normalizer(scores, mask)               masked softmax by default
    output   = dropout(weights) @ values              (..., n, v)

Masks are checked once, in :func:`prepare`, and padded keys, values and queries are zeroed
before any arithmetic, so whatever they hold (even NaN or inf) changes neither outputs,
weights nor gradients. A scorer may bring a fused path for the whole pipeline
(:func:`fused_dot_product`); it is used when the result is the same and the weights are not
needed at once. The public forms are in :mod:`attnscore.functional`, the modules in
:mod:`attnscore.modules`.

Shape legend: B batch, n queries, m keys, q / k / d feature sizes, v value size, h hidden
units; ``...`` is (B,) or (B, H) for H heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

import torch
import torch.nn.functional as F
from torch import Tensor
from typing_extensions import Unpack

from . import kernels
from ._checks import check_attention_inputs, check_dropout
from .masking import AttentionMask, build_mask
from .normalizers import Normalizer, get_normalizer, softmax
from .scoring import default_scale, dot_product_scores

__all__ = [
    "FusedPath",
    "MaskOptions",
    "Prepared",
    "Scoring",
    "WeightsFn",
    "attend",
    "finish",
    "fused_dot_product",
    "prepare",
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

    >>> from attnscore import dot_product_attention
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


def finish(
    result: tuple[Tensor, WeightsFn], return_weights: bool
) -> Tensor | tuple[Tensor, Tensor]:
    """(output) or (output, weights) from :func:`attend`'s result."""
    output, weights_fn = result
    return (output, weights_fn()) if return_weights else output


def fused_dot_product(scale: float | None) -> FusedPath:
    """The fused path of scaled dot-product attention with key lengths.

    Runs :func:`attnscore.kernels.dot_product_attention_by_lengths` (on CPU flash SDPA on keys
    trimmed to each element's length, so padded keys cost nothing) and returns a weights
    function that recomputes the weights through the plain pipeline (same values) only when
    asked. Declines (returns None) for boolean masks, no lengths, broadcast batch shapes and
    empty inputs; the kernels choose the implementation.
    """

    def fused(
        q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, dropout_p: float
    ) -> tuple[Tensor, WeightsFn] | None:
        lengths = mask.lengths
        if lengths is None or mask.attend is not None or q.ndim < 3:
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
        row_lengths = lengths[..., 0].reshape(rows) if per_example else lengths.reshape(rows, n)
        out = kernels.dot_product_attention_by_lengths(
            q.reshape(rows, n, d),
            k.reshape(rows, m, d),
            v.reshape(rows, m, dv),
            row_lengths,
            scale=default_scale(d) if scale is None else scale,
            dropout_p=dropout_p,
        )
        return out.reshape(*batch, n, dv), lambda: softmax(
            dot_product_scores(q, k, scale), mask
        ).to(q.dtype)

    return fused
