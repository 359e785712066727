# Triton kernels cannot carry Python type annotations (Triton reads them as its own
# types), and triton itself is untyped: relax those checks for this file only.
# mypy: disable-error-code="no-untyped-def, untyped-decorator, no-any-return"
"""Triton kernels: softmax over the last axis restricted to each row's first L positions.

Rows are the flattened leading dimensions of x (..., m); ``lengths`` holds one L per row.
Positions at or beyond L are never loaded (masked loads touch no memory), so garbage there,
even NaN, changes nothing; they are written as exact zeros. Rows with L == 0 are all zeros.
float16/bfloat16 are reduced in float32, float64 in float64.

Two kernel shapes, chosen by the launcher from m:

* **one block per row** (m <= ``_MAX_SINGLE``): the row's valid part is loaded once into
  registers, as in Triton's fused-softmax tutorial. Short rows are packed several to a
  program (a (ROWS, BLOCK_M) tile) so a program still has enough work.
* **a loop over column blocks** (longer rows): pass 1 keeps a per-lane running maximum and
  rescaled sum (online softmax) over the blocks below L only; pass 2 writes the output.

Device: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (the test suite).
Block sizes below are first choices, not tuned on hardware.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["masked_softmax_bwd", "masked_softmax_fwd"]

# Longest row held in registers by one program (elements of the reduction dtype).
_MAX_SINGLE = {torch.float64: 4096}
_MAX_SINGLE_DEFAULT = 8192
# Column block of the looping kernels.
_LOOP_BLOCK = 2048
# Elements per program the one-block kernels aim for when packing short rows.
_TILE = 1024


def _acc_dtype(dtype: torch.dtype) -> tl.dtype:
    return tl.float64 if dtype == torch.float64 else tl.float32


def _warps(elements: int) -> int:
    return 4 if elements <= 2048 else 8 if elements <= 8192 else 16


@triton.jit
def _row_lengths(len_ptr, rows, row_ok, m):
    """Lengths of the given rows, clamped to [0, m] (0 for rows past the end)."""
    L = tl.load(len_ptr + rows, mask=row_ok, other=0)
    return tl.minimum(tl.maximum(L, 0), m)


@triton.jit
def _fwd_block_kernel(
    x_ptr, len_ptr, y_ptr, n_rows, m, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, ACC: tl.constexpr
):
    # One (ROWS, BLOCK_M) tile: ROWS whole rows, BLOCK_M >= m.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    L = _row_lengths(len_ptr, rows, row_ok, m)
    cols = tl.arange(0, BLOCK_M)
    offs = rows[:, None] * m + cols[None, :]
    valid = cols[None, :] < L[:, None]
    # Padded positions load as -inf, so exp() makes them 0 without a second mask.
    x = tl.load(x_ptr + offs, mask=valid, other=-float("inf")).to(ACC)
    # A row with L == 0 has maximum -inf; subtracting 0 instead avoids -inf - -inf = NaN.
    row_max = tl.where(L > 0, tl.max(x, axis=1), 0.0)
    e = tl.exp(x - row_max[:, None])
    total = tl.where(L > 0, tl.sum(e, axis=1), 1.0)
    y = tl.where(valid, e / total[:, None], 0.0)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < m))


@triton.jit
def _fwd_loop_kernel(x_ptr, len_ptr, y_ptr, m, BLOCK_M: tl.constexpr, ACC: tl.constexpr):
    # One row per program, BLOCK_M < m.
    row = tl.program_id(0).to(tl.int64)
    L = tl.minimum(tl.maximum(tl.load(len_ptr + row), 0), m)
    base = x_ptr + row * m
    cols = tl.arange(0, BLOCK_M)
    NEG_INF: tl.constexpr = -float("inf")
    # Pass 1 (online softmax): each lane keeps the maximum it has seen and the sum of
    # exp(x - that maximum), rescaled whenever the maximum grows. Blocks at or beyond L are
    # not visited at all.
    lane_max = tl.full([BLOCK_M], NEG_INF, ACC)
    lane_sum = tl.zeros([BLOCK_M], ACC)
    for start in range(0, L, BLOCK_M):
        c = start + cols
        x = tl.load(base + c, mask=c < L, other=NEG_INF).to(ACC)
        new_max = tl.maximum(lane_max, x)
        # A lane that has only seen -inf keeps sum 0 (exp(-inf - -inf) would be NaN).
        seen = new_max > NEG_INF
        safe_max = tl.where(seen, new_max, 0.0)
        lane_sum = lane_sum * tl.exp(lane_max - safe_max) + tl.exp(x - safe_max)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    row_max = tl.where(L > 0, row_max, 0.0)
    lane_scale = tl.where(lane_max > NEG_INF, tl.exp(lane_max - row_max), 0.0)
    total = tl.sum(lane_sum * lane_scale, axis=0)
    total = tl.where(L > 0, total, 1.0)
    # Pass 2: normalised values below L, exact zeros from L to m (those loads are masked off).
    for start in range(0, m, BLOCK_M):
        c = start + cols
        valid = c < L
        x = tl.load(base + c, mask=valid, other=NEG_INF).to(ACC)
        y = tl.where(valid, tl.exp(x - row_max) / total, 0.0)
        tl.store(y_ptr + row * m + c, y.to(y_ptr.dtype.element_ty), mask=c < m)


@triton.jit
def _bwd_block_kernel(
    g_ptr,
    y_ptr,
    len_ptr,
    dx_ptr,
    n_rows,
    m,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ACC: tl.constexpr,
):
    # dx = y * (g - sum_{j<L} g_j y_j) below L, exact zeros beyond.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    L = _row_lengths(len_ptr, rows, row_ok, m)
    cols = tl.arange(0, BLOCK_M)
    offs = rows[:, None] * m + cols[None, :]
    valid = cols[None, :] < L[:, None]
    y = tl.load(y_ptr + offs, mask=valid, other=0.0).to(ACC)
    g = tl.load(g_ptr + offs, mask=valid, other=0.0).to(ACC)
    dot = tl.sum(g * y, axis=1)
    dx = tl.where(valid, y * (g - dot[:, None]), 0.0)
    tl.store(
        dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < m)
    )


@triton.jit
def _bwd_loop_kernel(g_ptr, y_ptr, len_ptr, dx_ptr, m, BLOCK_M: tl.constexpr, ACC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    L = tl.minimum(tl.maximum(tl.load(len_ptr + row), 0), m)
    cols = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M], ACC)
    for start in range(0, L, BLOCK_M):  # pass 1: sum_j g_j y_j over the valid blocks
        c = start + cols
        valid = c < L
        y = tl.load(y_ptr + row * m + c, mask=valid, other=0.0).to(ACC)
        g = tl.load(g_ptr + row * m + c, mask=valid, other=0.0).to(ACC)
        acc += g * y
    dot = tl.sum(acc, axis=0)
    for start in range(0, m, BLOCK_M):  # pass 2: write every column
        c = start + cols
        valid = c < L
        y = tl.load(y_ptr + row * m + c, mask=valid, other=0.0).to(ACC)
        g = tl.load(g_ptr + row * m + c, mask=valid, other=0.0).to(ACC)
        dx = tl.where(valid, y * (g - dot), 0.0)
        tl.store(dx_ptr + row * m + c, dx.to(dx_ptr.dtype.element_ty), mask=c < m)


def _plan(m: int, dtype: torch.dtype) -> tuple[bool, int, int]:
    """(one_block, BLOCK_M, ROWS) for rows of length m."""
    block = triton.next_power_of_2(max(m, 1))
    if block <= _MAX_SINGLE.get(dtype, _MAX_SINGLE_DEFAULT):
        return True, block, max(1, _TILE // block)
    return False, _LOOP_BLOCK, 1


def masked_softmax_fwd(x: Tensor, lengths: Tensor) -> Tensor:
    """y = softmax(x[..., :L]) followed by exact zeros; see the module docstring.

    x: (..., m) contiguous float tensor; lengths: int64 contiguous, shape x.shape[:-1].
    """
    y = torch.empty_like(x)
    m = x.shape[-1]
    rows = x.numel() // m if m else 0
    if rows == 0:
        return y
    acc = _acc_dtype(x.dtype)
    one_block, block, rows_per = _plan(m, x.dtype)
    if one_block:
        grid = (triton.cdiv(rows, rows_per),)
        _fwd_block_kernel[grid](
            x, lengths, y, rows, m, ROWS=rows_per, BLOCK_M=block, ACC=acc,
            num_warps=_warps(rows_per * block),
        )  # fmt: skip
    else:
        _fwd_loop_kernel[(rows,)](x, lengths, y, m, BLOCK_M=block, ACC=acc, num_warps=_warps(block))
    return y


def masked_softmax_bwd(grad_y: Tensor, y: Tensor, lengths: Tensor) -> Tensor:
    """grad_x = y * (grad_y - sum_{j<L} grad_y y) below L, exact zeros beyond and for L == 0.

    grad_y, y: (..., m) contiguous, one float dtype; lengths as in :func:`masked_softmax_fwd`.
    """
    dx = torch.empty_like(y)
    m = y.shape[-1]
    rows = y.numel() // m if m else 0
    if rows == 0:
        return dx
    acc = _acc_dtype(y.dtype)
    one_block, block, rows_per = _plan(m, y.dtype)
    if one_block:
        grid = (triton.cdiv(rows, rows_per),)
        _bwd_block_kernel[grid](
            grad_y, y, lengths, dx, rows, m, ROWS=rows_per, BLOCK_M=block, ACC=acc,
            num_warps=_warps(rows_per * block),
        )  # fmt: skip
    else:
        _bwd_loop_kernel[(rows,)](
            grad_y, y, lengths, dx, m, BLOCK_M=block, ACC=acc, num_warps=_warps(block)
        )
    return dx
