"""Scoring functions: (queries, keys) -> scores.

A scoring function maps queries (..., n, q) and keys (..., m, k) to scores (..., n, m): the
only part that differs between additive, dot-product, general and cosine attention (the
rest is shared, see :mod:`attnscore.functional`). These functions take parameters as
tensors; the modules of :mod:`attnscore.modules` hold them as ``nn.Parameter``.

Shape legend: B batch, n queries, m keys, q / k / d feature sizes, h hidden units.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import kernels
from .kernels import _ops

__all__ = [
    "additive_scores",
    "additive_scores_from_projections",
    "cosine_scores",
    "default_scale",
    "dot_product_scores",
    "general_scores",
    "unit_rows",
]


def default_scale(d: int) -> float:
    """1/sqrt(d), the scale that keeps q·k at unit variance (d = 0 gives 1: scores are 0).

    >>> default_scale(64)
    0.125
    """
    return 1.0 / math.sqrt(max(d, 1))


def dot_product_scores(queries: Tensor, keys: Tensor, scale: float | None = None) -> Tensor:
    """Dot-product scores ``scale * q·k``; scale None means 1/sqrt(d) (scaled dot product).

    Args:
        queries: (..., n, d) floating.
        keys: (..., m, d), same dtype.
        scale: multiplier; None gives 1/sqrt(d) (Vaswani et al. 2017, eq. 1), 1.0 gives
            Luong et al. 2015 "dot" (eq. 8).

    Returns:
        scores (..., n, m) in the inputs' dtype, as every scoring function here (matrix
        products accumulate in float32 for 16-bit inputs, as PyTorch's do; float16 ones on
        the CPU run in the library's C kernel).

    >>> dot_product_scores(torch.ones(1, 2, 4), torch.ones(1, 3, 4)).shape
    torch.Size([1, 2, 3])
    """
    if scale is None:
        # d = 0: every score is the empty sum 0, so any finite scale gives the same result.
        scale = default_scale(queries.shape[-1])
    # 16-bit inputs scale the scores: where q·k cancels (large terms, a small sum), rounding
    # a scaled operand before the products moves near-tied scores far more than one rounding
    # of the score does. Elsewhere scaling the smaller operand costs less than scaling the
    # (n, m) scores (not while exporting: a branch on n <= m would hold the exported
    # program to that case).
    if queries.dtype.itemsize <= 2:
        return _ops.matmul(queries, keys.transpose(-1, -2)) * scale
    if torch.compiler.is_exporting() or queries.shape[-2] <= keys.shape[-2]:
        return _ops.matmul(queries * scale, keys.transpose(-1, -2))
    return _ops.matmul(queries, (keys * scale).transpose(-1, -2))


def general_scores(queries: Tensor, keys: Tensor, W_a: Tensor) -> Tensor:
    """General (multiplicative, bilinear) scores ``qᵀ W_a k`` (Luong et al. 2015, eq. 8).

    Queries and keys may differ in size, and only matrix products are used (the answer to
    exercise 2 of the textbook section).

    Args:
        queries: (..., n, q). keys: (..., m, k). W_a: (q, k), as ``nn.Linear(k, q).weight``.

    Returns:
        scores (..., n, m).

    >>> general_scores(torch.ones(1, 2, 3), torch.ones(1, 4, 5), torch.ones(3, 5)).shape
    torch.Size([1, 2, 4])
    """
    # Project whichever side has fewer vectors: the cost is (n or m) * q * k (not while
    # exporting: a branch on n <= m would hold the exported program to that case).
    if torch.compiler.is_exporting() or queries.shape[-2] <= keys.shape[-2]:
        return _ops.matmul(_ops.matmul(queries, W_a), keys.transpose(-1, -2))
    return _ops.matmul(queries, _ops.matmul(keys, W_a.transpose(0, 1)).transpose(-1, -2))


def cosine_scores(queries: Tensor, keys: Tensor, scale: float | Tensor = 10.0) -> Tensor:
    """Scaled cosine similarity ``scale * cos(q, k)`` (as in Swin Transformer V2, eq. 2).

    Zero vectors score 0 against everything (no division by zero in any dtype).

    Args:
        queries: (..., n, d). keys: (..., m, d). scale: the inverse temperature, a float
            or a 0-d tensor (learnable in :class:`attnscore.CosineAttention`).

    Returns:
        scores (..., n, m).

    >>> cosine_scores(torch.tensor([[[1.0, 0.0]]]), torch.tensor([[[2.0, 0.0], [0.0, 0.0]]]))
    tensor([[[10.,  0.]]])
    """
    return _ops.matmul(unit_rows(queries) * scale, unit_rows(keys).transpose(-1, -2))


def unit_rows(x: Tensor) -> Tensor:
    """Each row of ``x`` divided by its norm: the vectors whose dot products are cosine
    similarities (cosine attention is dot-product attention of these, the queries' times s).

    Args:
        x: (..., d) floating.

    Returns:
        (..., d) in x's dtype; zero rows stay zero (the norm is clamped to the dtype's
        smallest normal number, so nothing is divided by zero).

    >>> unit_rows(torch.tensor([[3.0, 4.0], [0.0, 0.0]]))
    tensor([[0.6000, 0.8000],
            [0.0000, 0.0000]])
    """
    unit: Tensor = x / x.norm(dim=-1, keepdim=True).clamp(min=torch.finfo(x.dtype).tiny)
    return unit


def additive_scores_from_projections(
    qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor | None = None
) -> Tensor:
    """Additive scores ``w_vᵀ tanh(qh_i + kh_j)`` from projected queries and keys.

    Runs :func:`attnscore.kernels.additive_scores`: neither forward nor backward
    holds the (..., n, m, h) tensor of the textbook formulation.

    Args:
        qh: projected queries (..., n, h) (``W_q q``, plus any bias). kh: projected keys
            (..., m, h) (``W_k k``). w_v: (h,) or (1, h).
        lengths: optional int64 (..., n): scores at j >= lengths[..., i] are masked later,
            so they are skipped (returned as 0).

    Returns:
        scores (..., n, m).

    >>> additive_scores_from_projections(torch.zeros(1, 2, 8), torch.zeros(1, 5, 8),
    ...                                  torch.ones(8)).shape
    torch.Size([1, 2, 5])
    """
    # One dtype for all three (under autocast the projections may be 16-bit and w_v not):
    # the kernels compute in float32 for 16-bit inputs anyway.
    dtype = torch.promote_types(torch.promote_types(qh.dtype, kh.dtype), w_v.dtype)
    return kernels.additive_scores(qh.to(dtype), kh.to(dtype), w_v.reshape(-1).to(dtype), lengths)


# Parameters named as functional.additive_attention's, alike in shape (`duplicates`) on purpose.
def additive_scores(
    queries: Tensor,
    keys: Tensor,
    W_q: Tensor,
    W_k: Tensor,
    w_v: Tensor,
    bias: Tensor | None = None,
    lengths: Tensor | None = None,
) -> Tensor:
    """Additive (Bahdanau) scores ``w_vᵀ tanh(W_q q + W_k k + b)``.

    Bahdanau et al. 2015, eq. (A.1.2); D2L eq. "additive-attn".

    Args:
        queries: (..., n, q). keys: (..., m, k).
        W_q: (h, q). W_k: (h, k). w_v: (h,) or (1, h). bias: optional (h,).
        lengths: optional key lengths (..., n), a hint that lets a kernel skip padded keys.

    Returns:
        scores (..., n, m).

    >>> s = additive_scores(torch.ones(2, 1, 3), torch.ones(2, 5, 4),
    ...                     torch.ones(8, 3), torch.ones(8, 4), torch.ones(8))
    >>> s.shape
    torch.Size([2, 1, 5])
    """
    qh = _ops.matmul(queries, W_q.transpose(0, 1))
    if bias is not None:
        qh = qh + bias
    kh = _ops.matmul(keys, W_k.transpose(0, 1))
    return additive_scores_from_projections(qh, kh, w_v, lengths)
