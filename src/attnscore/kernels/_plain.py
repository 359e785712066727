"""Plain PyTorch twins of the fast paths: run on any device, define the expected results.

They keep the same guarantees as the C kernels: exact zeros (and zero gradients) at padded
positions and on fully masked rows, reductions of float16/bfloat16 in float32, and NaN/inf
garbage at padded positions changing nothing.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import compute_dtype
from .._softmax import softmax_dense

__all__ = [
    "additive_scores_plain",
    "dot_product_attention_plain",
    "masked_softmax_plain",
]

# Elements of one (rows, keys, h) tanh block in the chunked additive path (16 MiB in float32).
_CHUNK_ELEMENTS = 1 << 22


def masked_softmax_plain(x: Tensor, lens: Tensor) -> Tensor:
    """Softmax over the last axis of x restricted to the first ``lens`` positions; rows with
    no valid position are zeros with zero gradient (see :func:`attnscore._softmax.softmax_dense`).
    """
    return softmax_dense(x, torch.arange(x.shape[-1], device=x.device) < lens.unsqueeze(-1))


class _AdditiveScoresChunked(torch.autograd.Function):
    """Additive scores in blocks of rows, tanh recomputed in backward.

    No (B, n, m, h) tensor ever exists: each block holds at most ``_CHUNK_ELEMENTS`` tanh
    values, and keys beyond the block's longest row are skipped.
    """

    @staticmethod
    def forward(ctx: Any, qh: Tensor, kh: Tensor, w_v: Tensor, lens: Tensor) -> Tensor:
        cdt = compute_dtype(qh.dtype)
        q, k, w = qh.detach().to(cdt), kh.detach().to(cdt), w_v.detach().to(cdt)
        B, n, h = q.shape
        m = k.shape[1]
        scores = q.new_zeros(B, n, m)
        for b, i0, i1, L, mask in _blocks(lens, n, m, h):
            t = torch.tanh(q[b, i0:i1, None, :] + k[b, None, :L, :])
            scores[b, i0:i1, :L] = torch.where(mask, t @ w, 0.0)
        ctx.save_for_backward(q, k, w, lens)
        ctx.dtypes = (qh.dtype, kh.dtype, w_v.dtype)
        return scores.to(qh.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, w, lens = ctx.saved_tensors
        n, h, m = q.shape[1], q.shape[2], k.shape[1]
        g = grad.to(q.dtype)
        dq, dk, dw = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(w)
        for b, i0, i1, L, mask in _blocks(lens, n, m, h):
            t = torch.tanh(q[b, i0:i1, None, :] + k[b, None, :L, :])
            t = torch.where(mask[..., None], t, 0.0)  # garbage keys must not reach the sums
            gm = torch.where(mask, g[b, i0:i1, :L], 0.0)
            d = (gm[..., None] * (1.0 - t * t)) * w
            dq[b, i0:i1] += d.sum(1)
            dk[b, :L] += d.sum(0)
            dw += torch.einsum("ij,ijh->h", gm, t)
        qd, kd, wd = ctx.dtypes
        return dq.to(qd), dk.to(kd), dw.to(wd), None


def _blocks(lens: Tensor, n: int, m: int, h: int) -> Any:
    """Yield (b, i0, i1, L, mask) row blocks; L is the block's longest row, mask (rows, L)."""
    rows = max(1, _CHUNK_ELEMENTS // max(1, m * h))
    lens_cpu = lens.detach().to("cpu")  # one device sync instead of one per block
    for b in range(lens.shape[0]):
        for i0 in range(0, n, rows):
            i1 = min(n, i0 + rows)
            L = int(lens_cpu[b, i0:i1].max().clamp(0, m))
            if L == 0:
                continue
            mask = torch.arange(L, device=lens.device) < lens[b, i0:i1, None]
            yield b, i0, i1, L, mask


def additive_scores_plain(qh: Tensor, kh: Tensor, w_v: Tensor, lens: Tensor) -> Tensor:
    """PyTorch twin of :func:`attnscore.kernels.additive_scores` (chunked, any device)."""
    return cast(Tensor, _AdditiveScoresChunked.apply(qh, kh, w_v, lens))  # type: ignore[no-untyped-call]


def dot_product_attention_plain(
    q: Tensor, k: Tensor, v: Tensor, lens: Tensor, *, scale: float, dropout_p: float = 0.0
) -> Tensor:
    """bmm + masked softmax + bmm; keys/values beyond each element's longest row are zeroed
    first so garbage there cannot turn 0 * NaN into NaN in outputs or gradients."""
    B, n, m = q.shape[0], q.shape[1], k.shape[1]
    lens2 = lens[:, None].expand(B, n) if lens.dim() == 1 else lens
    keep = (torch.arange(m, device=q.device) < lens2.amax(1, keepdim=True))[..., None]
    k = torch.where(keep, k, 0.0)
    v = torch.where(keep, v, 0.0)
    weights = masked_softmax_plain(torch.bmm(q, k.transpose(1, 2)) * scale, lens2)
    if dropout_p > 0.0:
        weights = F.dropout(weights, dropout_p)
    return torch.bmm(weights, v)
