"""The plain PyTorch backend: runs on any device and defines the expected results.

It implements the backend contract (:class:`~attnscore.kernels._dispatch.Backend`) with
differentiable PyTorch ops only, so its functions also serve as the *twin* the dispatcher
runs where a registered op cannot go (``torch.func`` transforms, kernels disabled) and for
double backward.

Shapes: B batch, n queries, m keys, h hidden units, d query/key size, v value size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from .._checks import compute_dtype
from .._softmax import softmax_dense
from .._thresholds import value

# Elements of one (rows, keys, h) tanh block of the additive scores (16 MiB in float32):
# large enough to keep the matrix products efficient, small enough that no (B, n, m, h)
# tensor ever exists. The only chunk size of the library (attnscore._thresholds).
CHUNK_ELEMENTS: int = value("plain_chunk_elements")


def _valid(lengths: Tensor, m: int) -> Tensor:
    """Bool (..., m): True at positions j < lengths[...]."""
    return torch.arange(m, device=lengths.device) < lengths.unsqueeze(-1)


# ---- masked softmax ------------------------------------------------------------------------


def masked_softmax(x: Tensor, lengths: Tensor) -> Tensor:
    """Backend contract: :func:`attnscore._softmax.softmax_dense` of the lengths' mask."""
    return softmax_dense(x, _valid(lengths, x.shape[-1]))


def masked_softmax_backward(grad_y: Tensor, y: Tensor, lengths: Tensor) -> Tensor:
    """Backend contract: garbage in ``grad_y`` at padded positions is never used."""
    valid = _valid(lengths, y.shape[-1])
    yf = y.to(compute_dtype(y.dtype))
    g = torch.where(valid, grad_y.to(yf.dtype), 0.0)
    dx = yf * (g - (g * yf).sum(-1, keepdim=True))
    return torch.where(valid, dx, 0.0).to(y.dtype)


def softmax_pays(x: Tensor, training: bool) -> bool:
    """No kernel of its own for a softmax without a mask: False (``torch.softmax`` runs)."""
    return False


def small_masked_softmax(x: Tensor, valid_lens: Tensor) -> Tensor | None:
    """No path of its own for small calls: None (the general path runs)."""
    return None


def small_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    valid_lens: Tensor,
    scale: float,
    project: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None,
) -> tuple[Tensor, Tensor | None] | None:
    """No path of its own for small calls: None (the general path runs)."""
    return None


def small_additive_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    valid_lens: Tensor,
    hidden: int,
    project: Callable[[Tensor, Tensor], tuple[Tensor, Tensor, Tensor]],
) -> tuple[Tensor, Tensor] | None:
    """No path of its own for small calls: None (the general path runs)."""
    return None


def masked_softmax_dense(x: Tensor, allowed: Tensor) -> Tensor:
    """Backend contract: :func:`attnscore._softmax.softmax_dense` itself."""
    return softmax_dense(x, allowed)


def mask_summary(
    allowed: Tensor, dtype: torch.dtype | None
) -> tuple[Tensor | None, Tensor, Tensor]:
    """Backend contract: a ``torch.where`` and two ``any`` reductions."""
    additive = None
    if dtype is not None:
        zero = torch.zeros((), dtype=dtype, device=allowed.device)
        additive = torch.where(allowed, zero, torch.tensor(float("-inf"), dtype=dtype))
    return additive, allowed.any(dim=-1), allowed.any(dim=-2)


def lengths_mask(lengths: Tensor, m: int, dtype: torch.dtype) -> Tensor:
    """Backend contract: a ``torch.where`` of the lengths' boolean mask."""
    zero = torch.zeros((), dtype=dtype, device=lengths.device)
    neg_inf = torch.tensor(float("-inf"), dtype=dtype, device=lengths.device)
    return torch.where(_valid(lengths, m), zero, neg_inf)


# ---- additive scores -------------------------------------------------------------------------


def _rows_per_block(m: int, h: int, batch: int = 1) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, batch * m * h))


def _tanh_block(q_rows: Tensor, keys: Tensor) -> Tensor:
    """tanh(q_i + k_j) for rows (..., r, h) and keys (..., L, h): (..., r, L, h)."""
    return torch.tanh(q_rows.unsqueeze(-2) + keys.unsqueeze(-3))


def _blocks(lengths: Tensor, n: int, m: int, h: int) -> Iterator[tuple[int, int, int, int]]:
    """(b, i0, i1, L) row blocks of a (B, n) lengths tensor; L is the block's longest row.

    Reads the values of ``lengths`` (one device sync): eager code only, never traced.
    """
    rows = _rows_per_block(m, h)
    lengths_cpu = lengths.detach().to("cpu").clamp(0, m)
    for b in range(lengths.shape[0]):
        for i0 in range(0, n, rows):
            i1 = min(n, i0 + rows)
            L = int(lengths_cpu[b, i0:i1].max()) if i1 > i0 else 0
            if L:
                yield b, i0, i1, L


def additive_scores(qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor) -> Tensor:
    """Backend contract: (B, n, m) scores ``sum_h w_v tanh(qh_i + kh_j)`` for j < lengths,
    exact zeros elsewhere; keys beyond each block's longest row are skipped."""
    cdt = compute_dtype(qh.dtype)
    q, k, w = qh.to(cdt), kh.to(cdt), w_v.to(cdt)
    B, n, h = q.shape
    m = k.shape[1]
    scores = q.new_zeros(B, n, m)
    for b, i0, i1, L in _blocks(lengths, n, m, h):
        valid = _valid(lengths[b, i0:i1], L)
        scores[b, i0:i1, :L] = torch.where(valid, _tanh_block(q[b, i0:i1], k[b, :L]) @ w, 0.0)
    return scores.to(qh.dtype)


def additive_scores_backward(
    grad_scores: Tensor, qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Backend contract: gradients (qh, kh, w_v) of :func:`additive_scores`, tanh
    recomputed block by block. Differentiable PyTorch ops: double backward runs here."""
    cdt = compute_dtype(qh.dtype)
    q, k, w = qh.to(cdt), kh.to(cdt), w_v.to(cdt)
    n, h, m = q.shape[1], q.shape[2], k.shape[1]
    g = grad_scores.to(cdt)
    dq, dk, dw = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(w)
    for b, i0, i1, L in _blocks(lengths, n, m, h):
        valid = _valid(lengths[b, i0:i1], L)
        # garbage keys and gradients must not reach the sums
        t = torch.where(valid.unsqueeze(-1), _tanh_block(q[b, i0:i1], k[b, :L]), 0.0)
        gm = torch.where(valid, g[b, i0:i1, :L], 0.0)
        d = (gm.unsqueeze(-1) * (1.0 - t * t)) * w
        dq[b, i0:i1] += d.sum(1)
        dk[b, :L] += d.sum(0)
        dw += torch.einsum("ij,ijh->h", gm, t)
    return dq.to(qh.dtype), dk.to(kh.dtype), dw.to(w_v.dtype)


def additive_scores_dense(
    qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor | None = None
) -> Tensor:
    """The twin of the additive op in differentiable PyTorch ops (any transform).

    qh (..., n, h) and kh (..., m, h) with broadcastable batch dimensions, w_v (h,),
    lengths (..., n) or None; scores (..., n, m), exact zeros at j >= lengths. Works on
    blocks of queries (no (..., n, m, h) tensor at once; autograd keeps the blocks for
    backward) and reads no values, so vmap, grad and tracing see through it. Keys that no
    row may attend are zeroed first, so garbage there reaches neither scores nor gradients.
    """
    n, m, h = qh.shape[-2], kh.shape[-2], qh.shape[-1]
    if lengths is not None:  # each row's longest length (0 without queries)
        longest = lengths.amax(-1) if lengths.shape[-1] else lengths.new_zeros(lengths.shape[:-1])
        kh = torch.where(_valid(longest, m).unsqueeze(-1), kh, 0.0)
    rows = _rows_per_block(m, h, math.prod(torch.broadcast_shapes(qh.shape[:-2], kh.shape[:-2])))
    # max(n, 1): with no queries there is still one (empty) block to return.
    pieces = [_tanh_block(qh[..., i : i + rows, :], kh) @ w_v for i in range(0, max(n, 1), rows)]
    scores = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-2)
    if lengths is None:
        return scores
    return torch.where(_valid(lengths, m), scores, 0.0)


def additive_scores_whole(
    qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor | None = None
) -> Tensor:
    """The additive op's formula in one block, for exported programs: qh (..., n, h), kh
    (..., m, h) (batch dimensions broadcastable), w_v (h,), lengths (..., n) or None ->
    scores (..., n, m), ``w_vᵀ tanh(qh_i + kh_j)`` for j < lengths, exact zeros elsewhere,
    computed in float32 for 16-bit inputs. Holds the (..., n, m, h) tanh tensor: a graph of
    dynamic sizes cannot loop over blocks of them. Scores at padded keys are selected away
    (not multiplied), so garbage there, NaN included, reaches no output."""
    cdt = compute_dtype(qh.dtype)
    scores = (_tanh_block(qh.to(cdt), kh.to(cdt)) @ w_v.to(cdt)).to(qh.dtype)
    if lengths is None:
        return scores
    return torch.where(_valid(lengths, kh.shape[-2]), scores, 0.0)


# ---- inputs ---------------------------------------------------------------------------------


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """Backend contract: no NaN or inf in any of ``tensors`` (PyTorch's reduction of each).

    Read on the CPU only. Off the CPU (CUDA and other accelerators) reading the answer
    makes the host wait for the device, which on a GPU cost more than the attention itself
    at the sizes measured (docs/benchmarks.md, "On a GPU"): there the answer is
    true without a read, the callers zero padding without looking, and NaN in what some
    query attends may reach other queries of the same kernel tile (README, NaN contract).
    Meta tensors have no values: true as well."""
    first = tensors[0]
    if not first.is_cpu:
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.numel())


# ---- matrix products -----------------------------------------------------------------------


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` (the backend contract's ``matmul``): ``torch.matmul`` itself."""
    return torch.matmul(a, b)
