# Triton kernels cannot carry Python type annotations (Triton reads them as its own
# types), and triton itself is untyped: relax those checks for this file only.
# mypy: disable-error-code="no-untyped-def, untyped-decorator, no-any-return"
"""Triton kernels: additive (Bahdanau) scores without a (B, n, m, h) tensor.

    scores[b, i, j] = sum_h w_v[h] * tanh(qh[b, i, h] + kh[b, j, h])   for j < lengths[b, i]
                    = 0                                                 otherwise

Each program owns a (BLOCK_I, BLOCK_J) tile of scores and walks h in chunks of BLOCK_H, so
the tanh values only ever exist as one (BLOCK_I, BLOCK_J, BLOCK_H) block in registers.

Backward (tanh recomputed, d = g * w_v * (1 - tanh^2)):

* ``_bwd_rows_kernel``, one program per (b, block of queries): grad_qh = sum_j d, and this
  program's part of grad_w_v = sum_{i,j} g * tanh (summed over programs afterwards, in the
  reduction dtype: deterministic, no atomics).
* ``_bwd_keys_kernel``, one program per (b, block of keys): grad_kh = sum_i d.

So the backward evaluates tanh twice per (i, j, h) and the forward once. Keys at or beyond
the longest length of the query block (forward, grad_qh) or of the batch element (grad_kh)
are never loaded; queries with length 0 are never loaded; grad_scores is read only below
the lengths. float16/bfloat16 are computed and reduced in float32, float64 in float64.

tanh: ``APPROX=True`` uses the hardware ``tanh.approx.f32`` (inline PTX, real CUDA only),
otherwise an exp-based formula accurate to float32 rounding (see :func:`_tanh`). The
launchers take the choice as an argument; :mod:`attnscore.kernels._cuda` picks it.
Block sizes are first choices, not tuned on hardware.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["additive_bwd", "additive_fwd"]

BLOCK_I = 32
BLOCK_J = 32
BLOCK_H = 8


@triton.jit
def _tanh(x, APPROX: tl.constexpr):
    """tanh(x) in x's dtype (float32 or float64)."""
    if APPROX:
        # sm_75+: one MUFU instruction; relative error about 2^-11 (not float32 exact).
        return tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        # tanh|x| = (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1]: no overflow for any x.
        ax = tl.abs(x)
        e = tl.exp(-2.0 * ax)
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(x < 0, -t, t)
        # Near 0, 1 - e loses digits to cancellation: use the odd Taylor series there
        # (|x| < 1/8: the first omitted term, 21844/6081075 x^13, is below 1e-13 relative).
        x2 = x * x
        p = 62.0 / 2835.0 - x2 * (1382.0 / 155925.0)
        p = -1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * p))
        p = x + x * x2 * p
        return tl.where(ax < 0.125, p, t)


@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, w_ptr, len_ptr, s_ptr, n, m, H,
    BI: tl.constexpr, BJ: tl.constexpr, BH: tl.constexpr, ACC: tl.constexpr, APPROX: tl.constexpr,
):  # fmt: skip
    # 1-D grid over (b, query block, key block), key block fastest: neighbours share queries.
    pid = tl.program_id(0).to(tl.int64)
    n_jb = tl.cdiv(m, BJ)
    n_ib = tl.cdiv(n, BI)
    jb = pid % n_jb
    ib = (pid // n_jb) % n_ib
    b = pid // (n_jb * n_ib)
    i = ib * BI + tl.arange(0, BI)
    j = jb * BJ + tl.arange(0, BJ)
    row_ok = i < n
    L = tl.load(len_ptr + b * n + i, mask=row_ok, other=0)
    L = tl.minimum(tl.maximum(L, 0), m)
    max_len = tl.max(L, axis=0)
    key_ok = j < max_len  # keys no row of this block may attend are never loaded
    q_ok = row_ok & (L > 0)  # nor are queries that attend nothing
    acc = tl.zeros([BI, BJ], ACC)
    # A tile entirely beyond the block's lengths runs no iteration and stores zeros.
    h_end = tl.where(jb * BJ < max_len, H, 0)
    for h0 in range(0, h_end, BH):
        hh = h0 + tl.arange(0, BH)
        h_ok = hh < H
        q = tl.load(q_ptr + (b * n + i[:, None]) * H + hh[None, :],
                    mask=q_ok[:, None] & h_ok[None, :], other=0.0).to(ACC)  # fmt: skip
        k = tl.load(k_ptr + (b * m + j[:, None]) * H + hh[None, :],
                    mask=key_ok[:, None] & h_ok[None, :], other=0.0).to(ACC)  # fmt: skip
        w = tl.load(w_ptr + hh, mask=h_ok, other=0.0).to(ACC)
        t = _tanh(q[:, None, :] + k[None, :, :], APPROX)
        acc += tl.sum(t * w[None, None, :], axis=2)
    valid = j[None, :] < L[:, None]
    out = tl.where(valid, acc, 0.0)  # also drops NaN from garbage in other rows' keys
    tl.store(s_ptr + (b * n + i[:, None]) * m + j[None, :], out.to(s_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (j[None, :] < m))  # fmt: skip


@triton.jit
def _bwd_rows_kernel(
    g_ptr, q_ptr, k_ptr, w_ptr, len_ptr, dq_ptr, dw_ptr, n, m, H,
    BI: tl.constexpr, BJ: tl.constexpr, BH: tl.constexpr, ACC: tl.constexpr, APPROX: tl.constexpr,
):  # fmt: skip
    # One program per (b, query block): grad_qh rows and a partial grad_w_v.
    pid = tl.program_id(0).to(tl.int64)
    n_ib = tl.cdiv(n, BI)
    ib = pid % n_ib
    b = pid // n_ib
    i = ib * BI + tl.arange(0, BI)
    row_ok = i < n
    L = tl.load(len_ptr + b * n + i, mask=row_ok, other=0)
    L = tl.minimum(tl.maximum(L, 0), m)
    max_len = tl.max(L, axis=0)
    q_ok = row_ok & (L > 0)
    # h outermost: the accumulators are (BI, BH) and (BH,), not (BI, H).
    for h0 in range(0, H, BH):
        hh = h0 + tl.arange(0, BH)
        h_ok = hh < H
        q = tl.load(q_ptr + (b * n + i[:, None]) * H + hh[None, :],
                    mask=q_ok[:, None] & h_ok[None, :], other=0.0).to(ACC)  # fmt: skip
        w = tl.load(w_ptr + hh, mask=h_ok, other=0.0).to(ACC)
        dq = tl.zeros([BI, BH], ACC)
        dw = tl.zeros([BH], ACC)
        for j0 in range(0, max_len, BJ):
            j = j0 + tl.arange(0, BJ)
            valid = j[None, :] < L[:, None]
            g = tl.load(g_ptr + (b * n + i[:, None]) * m + j[None, :], mask=valid,
                        other=0.0).to(ACC)  # fmt: skip
            k = tl.load(k_ptr + (b * m + j[:, None]) * H + hh[None, :],
                        mask=(j < max_len)[:, None] & h_ok[None, :], other=0.0).to(ACC)  # fmt: skip
            t = _tanh(q[:, None, :] + k[None, :, :], APPROX)
            # Entries of keys valid for another row only: garbage there must not reach sums.
            t = tl.where(valid[:, :, None], t, 0.0)
            gg = g[:, :, None]
            dq += tl.sum(tl.where(valid[:, :, None], gg * (1.0 - t * t), 0.0), axis=1)
            dw += tl.sum(tl.sum(gg * t, axis=1), axis=0)
        tl.store(dq_ptr + (b * n + i[:, None]) * H + hh[None, :],
                 (dq * w[None, :]).to(dq_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & h_ok[None, :])  # fmt: skip
        tl.store(dw_ptr + pid * H + hh, dw, mask=h_ok)


@triton.jit
def _bwd_keys_kernel(
    g_ptr, q_ptr, k_ptr, w_ptr, len_ptr, maxlen_ptr, dk_ptr, n, m, H,
    BI: tl.constexpr, BJ: tl.constexpr, BH: tl.constexpr, ACC: tl.constexpr, APPROX: tl.constexpr,
):  # fmt: skip
    # One program per (b, key block): grad_kh rows, summing over every query block.
    pid = tl.program_id(0).to(tl.int64)
    n_jb = tl.cdiv(m, BJ)
    jb = pid % n_jb
    b = pid // n_jb
    j = jb * BJ + tl.arange(0, BJ)
    max_len = tl.load(maxlen_ptr + b)  # longest length of batch element b
    key_ok = j < max_len
    # Key blocks no query of this element attends run no iteration and store zeros.
    n_end = tl.where(jb * BJ < max_len, n, 0)
    for h0 in range(0, H, BH):
        hh = h0 + tl.arange(0, BH)
        h_ok = hh < H
        k = tl.load(k_ptr + (b * m + j[:, None]) * H + hh[None, :],
                    mask=key_ok[:, None] & h_ok[None, :], other=0.0).to(ACC)  # fmt: skip
        w = tl.load(w_ptr + hh, mask=h_ok, other=0.0).to(ACC)
        dk = tl.zeros([BJ, BH], ACC)
        for i0 in range(0, n_end, BI):
            i = i0 + tl.arange(0, BI)
            row_ok = i < n
            L = tl.load(len_ptr + b * n + i, mask=row_ok, other=0)
            L = tl.minimum(tl.maximum(L, 0), m)
            valid = j[None, :] < L[:, None]
            q_ok = row_ok & (L > 0)
            q = tl.load(q_ptr + (b * n + i[:, None]) * H + hh[None, :],
                        mask=q_ok[:, None] & h_ok[None, :], other=0.0).to(ACC)  # fmt: skip
            g = tl.load(g_ptr + (b * n + i[:, None]) * m + j[None, :], mask=valid,
                        other=0.0).to(ACC)  # fmt: skip
            t = _tanh(q[:, None, :] + k[None, :, :], APPROX)
            d = tl.where(valid[:, :, None], g[:, :, None] * (1.0 - t * t), 0.0)
            dk += tl.sum(d, axis=0)
        tl.store(dk_ptr + (b * m + j[:, None]) * H + hh[None, :],
                 (dk * w[None, :]).to(dk_ptr.dtype.element_ty),
                 mask=(j < m)[:, None] & h_ok[None, :])  # fmt: skip


def _acc(*tensors: Tensor) -> tuple[tl.dtype, torch.dtype]:
    """Reduction dtype: float64 if any input is float64, else float32."""
    if any(t.dtype == torch.float64 for t in tensors):
        return tl.float64, torch.float64
    return tl.float32, torch.float32


def _block_h(H: int) -> int:
    return min(BLOCK_H, triton.next_power_of_2(max(H, 1)))


def additive_fwd(qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor, *, approx: bool) -> Tensor:
    """scores (B, n, m) in qh's dtype from qh (B, n, h), kh (B, m, h), w_v (h,), lengths (B, n).

    All contiguous, on one device; lengths int64. See the module docstring.
    """
    B, n, H = qh.shape
    m = kh.shape[1]
    scores = torch.empty((B, n, m), dtype=qh.dtype, device=qh.device)
    if B * n * m == 0:
        return scores
    acc, _ = _acc(qh, kh, w_v)
    grid = (B * triton.cdiv(n, BLOCK_I) * triton.cdiv(m, BLOCK_J),)
    _fwd_kernel[grid](
        qh, kh, w_v, lengths, scores, n, m, H,
        BI=BLOCK_I, BJ=BLOCK_J, BH=_block_h(H), ACC=acc, APPROX=approx, num_warps=4,
    )  # fmt: skip
    return scores


def additive_bwd(
    grad_scores: Tensor, qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor, *, approx: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_qh, grad_kh, grad_w_v) in the dtypes of qh, kh, w_v; grad_scores (B, n, m)
    contiguous. Allocates O(B n h + B m h + B (n / BLOCK_I) h), never O(B n m h)."""
    B, n, H = qh.shape
    m = kh.shape[1]
    dq = torch.zeros_like(qh)
    dk = torch.zeros_like(kh)
    acc, acc_torch = _acc(qh, kh, w_v)
    if B * n * m * H == 0:
        return dq, dk, torch.zeros_like(w_v)
    bh = _block_h(H)
    n_ib = triton.cdiv(n, BLOCK_I)
    dw_parts = torch.zeros((B * n_ib, H), dtype=acc_torch, device=qh.device)
    _bwd_rows_kernel[(B * n_ib,)](
        grad_scores, qh, kh, w_v, lengths, dq, dw_parts, n, m, H,
        BI=BLOCK_I, BJ=BLOCK_J, BH=bh, ACC=acc, APPROX=approx, num_warps=4,
    )  # fmt: skip
    max_len = lengths.clamp(0, m).amax(1).contiguous()
    _bwd_keys_kernel[(B * triton.cdiv(m, BLOCK_J),)](
        grad_scores, qh, kh, w_v, lengths, max_len, dk, n, m, H,
        BI=BLOCK_I, BJ=BLOCK_J, BH=bh, ACC=acc, APPROX=approx, num_warps=4,
    )  # fmt: skip
    return dq, dk, dw_parts.sum(0).to(w_v.dtype)
