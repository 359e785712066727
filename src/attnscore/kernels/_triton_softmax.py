# Triton kernels cannot carry Python type annotations (Triton reads them as its own
# types), and triton itself is untyped: relax those checks for this file only.
# mypy: disable-error-code="no-untyped-def, untyped-decorator, no-any-return"
"""Triton kernels: softmax over the last axis restricted to each row's first L positions.

Rows are the flattened leading dimensions of x (..., m); ``lengths`` holds one L per row.
Values at or beyond L are never used, so garbage there, even NaN, changes nothing; they are
written as exact zeros. Rows with L == 0 are all zeros. float16/bfloat16 are reduced in
float32, float64 in float64.

Two kernel shapes, chosen by the launcher from m:

* **one block per row** (m <= ``_MAX_SINGLE``): the row's valid part is loaded once into
  registers, as in Triton's fused-softmax tutorial. Short rows are packed several to a
  program (a (ROWS, BLOCK_M) tile) so a program still has enough work.
* **a loop over column blocks** (longer rows): pass 1 keeps a per-lane running maximum and
  rescaled sum (online softmax) over the blocks below L only; pass 2 writes the output.

**Vector loads.** A load masked by ``cols < L`` cannot use vector instructions (L may end
inside a vector). When m is a multiple of ``VEC`` (16 bytes of elements: 4 float32, 8
float16/bfloat16, 2 float64; fewer if m is not a multiple of that) the loads are masked
by L rounded up to a multiple of VEC (declared with ``tl.multiple_of``) and the tail
[L, round_up(L)) is replaced by ``tl.where``: the kernels then read at most VEC - 1
positions past L, inside the vector that holds position L - 1, and never use them.
The compile report (``tools/triton_aot.py``) checks that the PTX of the float32
and 16-bit kernels has ``ld.global.v4``/``.v2`` loads; register and spill counts on
sm_80/sm_90 are in docs/benchmarks.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._triton_launch import Launch

# Longest row held in registers by one program (elements of the reduction dtype).
_MAX_SINGLE = {torch.float64: 4096}
_MAX_SINGLE_DEFAULT = 8192
# Column block of the looping kernels.
_LOOP_BLOCK = 2048
# Elements per program the one-block kernels aim for when packing short rows.
_TILE = 1024
# Bytes per vector load.
_VEC_BYTES = 16


def _acc_dtype(dtype: torch.dtype) -> tl.dtype:
    return tl.float64 if dtype == torch.float64 else tl.float32


def _warps(elements: int, rows: int = 1) -> int:
    """Warps per program for a tile of ``elements`` in ``rows`` rows: 2 for one or two rows
    of at most 1024 elements (fewer warps to reduce across), else by size. The launch
    sweep in docs/benchmarks.md ("Masked softmax launches") chose these."""
    if elements <= 1024 and rows <= 2:
        return 2
    return 4 if elements <= 2048 else 8 if elements <= 8192 else 16


def _vec(m: int, dtype: torch.dtype) -> int:
    """Elements per vector load: 16 bytes' worth, halved until it divides m."""
    vec = max(1, _VEC_BYTES // dtype.itemsize)
    while m % vec:
        vec //= 2
    return vec


@triton.jit
def _row_lengths(len_ptr, rows, row_ok, m):
    """Lengths of the given rows, clamped to [0, m] (0 for rows past the end)."""
    L = tl.load(len_ptr + rows, mask=row_ok, other=0)
    return tl.minimum(tl.maximum(L, 0), m)


@triton.jit
def _round_up(L, VEC: tl.constexpr):
    """L rounded up to a multiple of VEC, declared as such (the load bound)."""
    return tl.multiple_of((L + (VEC - 1)) // VEC * VEC, VEC)


@triton.jit
def _tile(len_ptr, n_rows, m, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, VEC: tl.constexpr):
    """This program's (ROWS, BLOCK_M) tile of whole rows (BLOCK_M >= m; the launcher
    guarantees m % VEC == 0, so every row starts on a vector boundary): the rows' lengths
    L, the offsets, where columns are valid (< L), where to load (< L rounded up to VEC,
    so that loads stay vectors) and where to store (every column of a real row)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    L = _row_lengths(len_ptr, rows, row_ok, m)
    cols = tl.arange(0, BLOCK_M)
    offs = tl.multiple_of(rows * m, VEC)[:, None] + cols[None, :]
    valid = cols[None, :] < L[:, None]
    load_ok = cols[None, :] < _round_up(L, VEC)[:, None]
    store_ok = row_ok[:, None] & (cols[None, :] < _round_up(m, VEC))  # == m
    return L, offs, valid, load_ok, store_ok


@triton.jit
def _fwd_block_kernel(
    x_ptr, len_ptr, y_ptr, n_rows, m,
    ROWS: tl.constexpr, BLOCK_M: tl.constexpr, VEC: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    L, offs, valid, load_ok, store_ok = _tile(len_ptr, n_rows, m, ROWS, BLOCK_M, VEC)
    x = tl.load(x_ptr + offs, mask=load_ok)
    # Padded positions become -inf, so exp() makes them 0 without a second mask.
    x = tl.where(valid, x.to(ACC), -float("inf"))
    # A row with L == 0 has maximum -inf; subtracting 0 instead avoids -inf - -inf = NaN.
    row_max = tl.where(L > 0, tl.max(x, axis=1), 0.0)
    e = tl.exp(x - row_max[:, None])
    total = tl.where(L > 0, tl.sum(e, axis=1), 1.0)
    y = tl.where(valid, e / total[:, None], 0.0)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=store_ok)


@triton.jit
def _row(len_ptr, m, VEC: tl.constexpr):
    """This program's row (one per program): its length L clamped to [0, m], L rounded up
    to VEC (the load bound) and the row's offset."""
    row = tl.program_id(0).to(tl.int64)
    L = tl.minimum(tl.maximum(tl.load(len_ptr + row), 0), m)
    return L, _round_up(L, VEC), tl.multiple_of(row * m, VEC)


@triton.jit
def _fwd_loop_kernel(
    x_ptr, len_ptr, y_ptr, m, BLOCK_M: tl.constexpr, VEC: tl.constexpr, ACC: tl.constexpr
):
    # One row per program, BLOCK_M < m.
    L, Lv, start_of_row = _row(len_ptr, m, VEC)
    x_row = x_ptr + start_of_row
    y_row = y_ptr + start_of_row
    cols = tl.arange(0, BLOCK_M)
    NEG_INF: tl.constexpr = -float("inf")
    # Pass 1 (online softmax): each lane keeps the maximum it has seen and the sum of
    # exp(x - that maximum), rescaled whenever the maximum grows. Blocks at or beyond L are
    # not visited at all.
    lane_max = tl.full([BLOCK_M], NEG_INF, ACC)
    lane_sum = tl.zeros([BLOCK_M], ACC)
    for start in range(0, L, BLOCK_M):
        c = start + cols
        x = tl.load(x_row + c, mask=c < Lv)
        x = tl.where(c < L, x.to(ACC), NEG_INF)
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
    # Pass 2: normalised values below L, exact zeros from L to m.
    mv = _round_up(m, VEC)  # == m
    for start in range(0, m, BLOCK_M):
        c = start + cols
        valid = c < L
        x = tl.load(x_row + c, mask=c < Lv)
        y = tl.where(valid, tl.exp(x.to(ACC) - row_max) / total, 0.0)
        tl.store(y_row + c, y.to(y_ptr.dtype.element_ty), mask=c < mv)


@triton.jit
def _bwd_block_kernel(
    g_ptr, y_ptr, len_ptr, dx_ptr, n_rows, m,
    ROWS: tl.constexpr, BLOCK_M: tl.constexpr, VEC: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    # dx = y * (g - sum_{j<L} g_j y_j) below L, exact zeros beyond.
    _, offs, valid, load_ok, store_ok = _tile(len_ptr, n_rows, m, ROWS, BLOCK_M, VEC)
    y = tl.where(valid, tl.load(y_ptr + offs, mask=load_ok).to(ACC), 0.0)
    g = tl.where(valid, tl.load(g_ptr + offs, mask=load_ok).to(ACC), 0.0)
    dot = tl.sum(g * y, axis=1)
    dx = tl.where(valid, y * (g - dot[:, None]), 0.0)
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=store_ok)


@triton.jit
def _bwd_loop_kernel(
    g_ptr, y_ptr, len_ptr, dx_ptr, m, BLOCK_M: tl.constexpr, VEC: tl.constexpr, ACC: tl.constexpr
):
    L, Lv, start_of_row = _row(len_ptr, m, VEC)
    g_row = g_ptr + start_of_row
    y_row = y_ptr + start_of_row
    dx_row = dx_ptr + start_of_row
    cols = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M], ACC)
    for start in range(0, L, BLOCK_M):  # pass 1: sum_j g_j y_j over the valid blocks
        c = start + cols
        valid = c < L
        y = tl.where(valid, tl.load(y_row + c, mask=c < Lv).to(ACC), 0.0)
        g = tl.where(valid, tl.load(g_row + c, mask=c < Lv).to(ACC), 0.0)
        acc += g * y
    dot = tl.sum(acc, axis=0)
    mv = _round_up(m, VEC)  # == m
    for start in range(0, m, BLOCK_M):  # pass 2: write every column
        c = start + cols
        valid = c < L
        y = tl.load(y_row + c, mask=c < Lv).to(ACC)
        g = tl.load(g_row + c, mask=c < Lv).to(ACC)
        dx = tl.where(valid, y * (g - dot), 0.0)
        tl.store(dx_row + c, dx.to(dx_ptr.dtype.element_ty), mask=c < mv)


def _plan(m: int, dtype: torch.dtype) -> tuple[bool, int, int]:
    """(one_block, BLOCK_M, ROWS) for rows of length m."""
    block = triton.next_power_of_2(max(m, 1))
    if block <= _MAX_SINGLE.get(dtype, _MAX_SINGLE_DEFAULT):
        return True, block, max(1, _TILE // block)
    return False, _LOOP_BLOCK, 1


def _launch(
    block_kernel: object, loop_kernel: object, tensors: tuple[Tensor, ...], out: Tensor, m: int
) -> Launch:
    """The launch of the block or the loop kernel for rows of length m (rows > 0)."""
    rows = out.numel() // m
    dtype = out.dtype
    one_block, block, rows_per = _plan(m, dtype)
    meta = {"BLOCK_M": block, "VEC": _vec(m, dtype), "ACC": _acc_dtype(dtype)}
    if one_block:
        n_programs = triton.cdiv(rows, rows_per)
        meta |= {"ROWS": rows_per, "num_warps": _warps(rows_per * block, rows_per)}
        return Launch(block_kernel, (*tensors, out, rows, m), meta, lambda _: (n_programs,))
    meta["num_warps"] = _warps(block)
    return Launch(loop_kernel, (*tensors, out, m), meta, lambda _: (rows,))


def fwd_launch(x: Tensor, lengths: Tensor, y: Tensor) -> Launch:
    """The launch :func:`masked_softmax` makes for x (..., m), m > 0 and rows > 0;
    any device (``meta`` tensors for the compile report)."""
    return _launch(_fwd_block_kernel, _fwd_loop_kernel, (x, lengths), y, x.shape[-1])


def bwd_launch(grad_y: Tensor, y: Tensor, lengths: Tensor, dx: Tensor) -> Launch:
    """The launch :func:`masked_softmax_backward` makes; as :func:`fwd_launch`."""
    return _launch(_bwd_block_kernel, _bwd_loop_kernel, (grad_y, y, lengths), dx, y.shape[-1])


def masked_softmax(x: Tensor, lengths: Tensor) -> Tensor:
    """y = softmax(x[..., :L]) followed by exact zeros; see the module docstring.

    x: (..., m) contiguous float tensor; lengths: int64 contiguous, shape x.shape[:-1].
    """
    y = torch.empty_like(x)
    if y.numel():
        fwd_launch(x, lengths, y).run()
    return y


def masked_softmax_backward(grad_y: Tensor, y: Tensor, lengths: Tensor) -> Tensor:
    """grad_x = y * (grad_y - sum_{j<L} grad_y y) below L, exact zeros beyond and for L == 0.

    grad_y, y: (..., m) contiguous, one float dtype; lengths as in :func:`masked_softmax`.
    """
    dx = torch.empty_like(y)
    if dx.numel():
        bwd_launch(grad_y, y, lengths, dx).run()
    return dx
