"""Scoring functions: (queries, keys) -> scores.

A scoring function maps queries (..., n, q) and keys (..., m, k) to scores (..., n, m). It
is the only part that differs between additive, dot-product, general and cosine attention;
masking, softmax, dropout and the weighted sum are shared (see :mod:`attnscore.functional`).
These functions take parameters as tensors; the modules in :mod:`attnscore.modules` hold
them as ``nn.Parameter``.

Shape legend: B batch, n queries, m keys, q / k / d feature sizes, h hidden units.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import kernels
from ._checks import compute_dtype, in_transform

__all__ = [
    "additive_scores",
    "additive_scores_from_projections",
    "cosine_scores",
    "default_scale",
    "dot_product_scores",
    "general_scores",
]

# Elements of the (chunk, m, h) tanh tensor the plain additive path builds at once: large
# enough to keep matmuls efficient, small enough that no (B, n, m, h) tensor ever exists.
_ADDITIVE_CHUNK_ELEMENTS = 1 << 22


def _upcast(*tensors: Tensor) -> list[Tensor]:
    """16-bit floats to float32: scores are rounded once, at the end of the pipeline (like
    flash attention's float32 accumulators), not after every product."""
    dtype = compute_dtype(tensors[0].dtype)
    return [t.to(dtype) for t in tensors]


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
        scores (..., n, m): float32 for 16-bit inputs (rounded once, later), else the
        inputs' dtype. The same holds for every scoring function here.

    >>> dot_product_scores(torch.ones(1, 2, 4), torch.ones(1, 3, 4)).shape
    torch.Size([1, 2, 3])
    """
    if scale is None:
        # d = 0: every score is the empty sum 0, so any finite scale gives the same result.
        scale = default_scale(queries.shape[-1])
    queries, keys = _upcast(queries, keys)
    # Scaling the smaller operand costs less than scaling the (n, m) scores.
    if queries.shape[-2] <= keys.shape[-2]:
        return torch.matmul(queries * scale, keys.transpose(-1, -2))
    return torch.matmul(queries, (keys * scale).transpose(-1, -2))


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
    queries, keys, W_a = _upcast(queries, keys, W_a)
    # Project whichever side has fewer vectors: the cost is (n or m) * q * k.
    if queries.shape[-2] <= keys.shape[-2]:
        return torch.matmul(torch.matmul(queries, W_a), keys.transpose(-1, -2))
    return torch.matmul(queries, torch.matmul(keys, W_a.transpose(0, 1)).transpose(-1, -2))


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
    queries, keys = _upcast(queries, keys)
    tiny = torch.finfo(queries.dtype).tiny
    q = queries / queries.norm(dim=-1, keepdim=True).clamp(min=tiny)
    k = keys / keys.norm(dim=-1, keepdim=True).clamp(min=tiny)
    return torch.matmul(q * scale, k.transpose(-1, -2))


def additive_scores_from_projections(
    qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor | None = None
) -> Tensor:
    """Additive scores ``w_vᵀ tanh(qh_i + kh_j)`` from projected queries and keys.

    Never builds the (..., n, m, h) tensor of the textbook formulation: the plain path
    works on chunks of queries.

    Args:
        qh: projected queries (..., n, h) (``W_q q``, plus any bias).
        kh: projected keys (..., m, h) (``W_k k``).
        w_v: (h,) or (1, h).
        lengths: optional int64 (..., n): scores at j >= lengths[..., i] are masked later,
            so a kernel may skip them (their value is unspecified).

    Returns:
        scores (..., n, m).

    >>> additive_scores_from_projections(torch.zeros(1, 2, 8), torch.zeros(1, 5, 8),
    ...                                  torch.ones(8)).shape
    torch.Size([1, 2, 5])
    """
    qh, kh, w = _upcast(qh, kh, w_v.reshape(-1))
    n, m, h = qh.shape[-2], kh.shape[-2], qh.shape[-1]
    batch_shape = qh.shape[:-2]
    if qh.ndim >= 3 and kh.shape[:-2] == batch_shape and not in_transform(qh, kh, w):
        # Fused kernel (C on CPU, else a chunked autograd Function that recomputes tanh in
        # backward): neither forward nor backward holds a (..., n, m, h) tensor.
        rows = math.prod(batch_shape)  # explicit: -1 is ambiguous when n or m is 0
        lens = (
            torch.full((*batch_shape, n), m, dtype=torch.int64, device=qh.device)
            if lengths is None
            else lengths.clamp(max=m)
        )
        scores = kernels.additive_scores(
            qh.reshape(rows, n, h), kh.reshape(rows, m, h), w, lens.reshape(rows, n)
        )
        return scores.reshape(*batch_shape, n, m)
    batch = max(1, math.prod(torch.broadcast_shapes(qh.shape[:-2], kh.shape[:-2])))
    chunk = max(1, _ADDITIVE_CHUNK_ELEMENTS // max(1, batch * m * h))
    k = kh.unsqueeze(-3)
    # max(n, 1): with no queries there is still one (empty) piece to return.
    pieces = [
        torch.matmul(torch.tanh(qh[..., i : i + chunk, :].unsqueeze(-2) + k), w)
        for i in range(0, max(n, 1), chunk)
    ]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-2)


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
    qh = torch.matmul(queries, W_q.transpose(0, 1))
    if bias is not None:
        qh = qh + bias
    kh = torch.matmul(keys, W_k.transpose(0, 1))
    return additive_scores_from_projections(qh, kh, w_v, lengths)
