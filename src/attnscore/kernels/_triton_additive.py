# Triton kernels cannot carry Python type annotations (Triton reads them as its own
# types), and triton itself is untyped: relax those checks for this file only.
# mypy: disable-error-code="no-untyped-def, untyped-decorator, no-any-return"
"""Triton kernels: additive (Bahdanau) scores without a (B, n, m, h) tensor.

    scores[b, i, j] = sum_h w_v[h] * tanh(qh[b, i, h] + kh[b, j, h])   for j < lengths[b, i]
                    = 0                                                 otherwise

The launchers first transpose qh to (B, h, n) and kh to (B, h, m), so that the values of
one hidden unit for a block of queries (or keys) are contiguous.

**Forward** (``_fwd_kernel``): each program owns a (BI, BJ) tile of scores in registers
and walks h one unit at a time: load BI query values and BJ key values of unit h, add
``w_v[h] * tanh(q_i + k_j)`` to every entry. Every thread works on its own entries: no
reduction, no exchange between lanes. The tile size and warp count are autotuned among
``FWD_CONFIGS`` (each new shape costs one timing run of the candidates; see
:func:`_keep_full_grids`).

**Backward** (``_bwd_kernel``), on the forward's tiling: each (BI, BJ) program loads its
tile of grad_scores once, then for each h recomputes t = tanh(q_i + k_j) once and writes
three partial sums, for this tile alone:

* grad_qh: w_v[h] * sum_j g (1 - t^2), one value per query, into a (B, m / BJ, h, n)
  buffer;
* grad_kh: w_v[h] * sum_i g (1 - t^2), one value per key, into (B, n / BI, h, m);
* grad_w_v: sum_{i, j} g t, one value, into (programs, h).

A second pass sums the partial buffers over their tile axis (``torch.sum``: deterministic,
no atomics). The tile is chosen per shape (:func:`_bwd_tile`).

**What is read.** Keys at or beyond the longest length of a query block, and queries with
length 0, are never loaded (their loads are masked off); a tile entirely beyond that
length loads nothing else and writes zeros. grad_scores is read only below the lengths.
Entries (i, j) with j >= lengths[b, i] are masked out of every sum, so garbage in keys that
another row of the block attends cannot reach this row's results.

float16/bfloat16 are computed and reduced in float32, float64 in float64.

tanh: ``APPROX=True`` uses the hardware ``tanh.approx.f32`` (inline PTX, real CUDA only),
otherwise an exp-based formula (:func:`_tanh`); :mod:`attnscore.kernels._cuda` picks it.
Register and spill counts on sm_80/sm_90 are in docs/benchmarks.md.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._triton_launch import MIN_PROGRAMS, Launch, config_meta

#: Forward candidates: (BI queries, BJ keys) per tile and warps per program.
FWD_CONFIGS = [
    triton.Config({"BI": bi, "BJ": bj}, num_warps=w)
    for bi, bj, w in ((32, 32, 4), (32, 32, 2), (64, 32, 4), (32, 64, 4), (64, 64, 8))
]
#: Backward tiles (BI, BJ, warps), fewest partial sums first (see :func:`_bwd_tile`).
BWD_TILES = ((128, 64, 8), (64, 64, 8), (64, 32, 4), (32, 32, 4))


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
def _tile(pid, len_ptr, n, m, BI: tl.constexpr, BJ: tl.constexpr):
    """Decode a program id of the 1-D grid over (b, query block, key block), key block
    fastest (neighbours share queries), and load the block's clamped lengths."""
    n_jb = tl.cdiv(m, BJ)
    n_ib = tl.cdiv(n, BI)
    jb = pid % n_jb
    ib = (pid // n_jb) % n_ib
    b = (pid // (n_jb * n_ib)).to(tl.int64)
    i = ib * BI + tl.arange(0, BI)
    j = jb * BJ + tl.arange(0, BJ)
    row_ok = i < n
    L = tl.load(len_ptr + b * n + i, mask=row_ok, other=0)
    L = tl.minimum(tl.maximum(L, 0), m)
    return b, ib, jb, i, j, row_ok, L


@triton.jit
def _fwd_kernel(
    qt_ptr, kt_ptr, w_ptr, len_ptr, s_ptr, B, n, m, H,
    BI: tl.constexpr, BJ: tl.constexpr, ACC: tl.constexpr, APPROX: tl.constexpr,
):  # fmt: skip
    # qt (B, H, n), kt (B, H, m): unit h of a block of queries / keys is contiguous.
    b, _, jb, i, j, row_ok, L = _tile(tl.program_id(0), len_ptr, n, m, BI, BJ)
    max_len = tl.max(L, axis=0)
    key_ok = j < max_len  # keys no row of this block may attend are never loaded
    q_ok = row_ok & (L > 0)  # nor are queries that attend nothing
    q_ptrs = qt_ptr + b * H * n + i
    k_ptrs = kt_ptr + b * H * m + j
    acc = tl.zeros([BI, BJ], ACC)
    # A tile entirely beyond the block's lengths runs no iteration and stores zeros.
    h_end = tl.where(jb * BJ < max_len, H, 0)
    for h in range(0, h_end):
        q = tl.load(q_ptrs, mask=q_ok, other=0.0).to(ACC)
        k = tl.load(k_ptrs, mask=key_ok, other=0.0).to(ACC)
        w = tl.load(w_ptr + h).to(ACC)
        acc += w * _tanh(q[:, None] + k[None, :], APPROX)
        q_ptrs += n
        k_ptrs += m
    # The key index again, built in 2-D: sharing the 1-D j with the loop made Triton
    # convert the layout of the keys inside the loop (through shared memory, every h).
    j2 = jb * BJ + tl.arange(0, BJ)[None, :]
    out = tl.where(j2 < L[:, None], acc, 0.0)  # also drops NaN from other rows' keys
    tl.store(s_ptr + (b * n + i[:, None]) * m + j2, out.to(s_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (j2 < m))  # fmt: skip


def _fwd_grid(B: int, n: int, m: int, meta: dict[str, Any]) -> tuple[int]:
    return (B * triton.cdiv(n, meta["BI"]) * triton.cdiv(m, meta["BJ"]),)


def _keep_full_grids(configs: list[Any], named_args: dict[str, Any], **_: Any) -> list[Any]:
    """The configurations whose grid has at least MIN_PROGRAMS programs, or, when none has,
    the first with the largest grid (autotune's ``early_config_prune``)."""
    B, n, m = named_args["B"], named_args["n"], named_args["m"]
    sizes = [_fwd_grid(B, n, m, c.kwargs)[0] for c in configs]
    full = [c for c, size in zip(configs, sizes, strict=True) if size >= MIN_PROGRAMS]
    return full or [configs[sizes.index(max(sizes))]]


_fwd_kernel = triton.autotune(
    configs=FWD_CONFIGS,
    key=["B", "n", "m", "H", "APPROX"],
    prune_configs_by={"early_config_prune": _keep_full_grids},
)(_fwd_kernel)


@triton.jit
def _bwd_kernel(
    g_ptr, qt_ptr, kt_ptr, w_ptr, len_ptr, dq_ptr, dk_ptr, dw_ptr, n, m, H,
    BI: tl.constexpr, BJ: tl.constexpr, ACC: tl.constexpr, APPROX: tl.constexpr,
):  # fmt: skip
    # Partial sums of this (BI, BJ) tile: dq (B, n_jb, H, n), dk (B, n_ib, H, m), dw (grid, H).
    pid = tl.program_id(0)
    b, ib, jb, i, j, row_ok, L = _tile(pid, len_ptr, n, m, BI, BJ)
    max_len = tl.max(L, axis=0)
    key_ok = j < max_len
    q_ok = row_ok & (L > 0)
    valid = j[None, :] < L[:, None]
    n_jb = tl.cdiv(m, BJ)
    n_ib = tl.cdiv(n, BI)
    dq_ptrs = dq_ptr + ((b * n_jb + jb) * H) * n + i
    dk_ptrs = dk_ptr + ((b * n_ib + ib) * H) * m + j
    dw_ptrs = dw_ptr + pid.to(tl.int64) * H
    key_in = j < m
    if jb * BJ < max_len:
        g = tl.load(g_ptr + (b * n + i[:, None]) * m + j[None, :], mask=valid, other=0.0)
        g = g.to(ACC)
        q_ptrs = qt_ptr + b * H * n + i
        k_ptrs = kt_ptr + b * H * m + j
        for h in range(0, H):
            q = tl.load(q_ptrs, mask=q_ok, other=0.0).to(ACC)
            k = tl.load(k_ptrs, mask=key_ok, other=0.0).to(ACC)
            w = tl.load(w_ptr + h).to(ACC)
            # Entries of keys valid for another row only: their t must not reach the sums.
            t = tl.where(valid, _tanh(q[:, None] + k[None, :], APPROX), 0.0)
            gt = g * t
            d = g - gt * t  # g (1 - t^2)
            tl.store(dq_ptrs, w * tl.sum(d, axis=1), mask=row_ok)
            tl.store(dk_ptrs, w * tl.sum(d, axis=0), mask=key_in)
            tl.store(dw_ptrs + h, tl.sum(tl.sum(gt, axis=1), axis=0))
            q_ptrs += n
            k_ptrs += m
            dq_ptrs += n
            dk_ptrs += m
    else:  # no row of the block attends these keys: zero partial sums, nothing read
        zq = tl.zeros([BI], ACC)
        zk = tl.zeros([BJ], ACC)
        for h in range(0, H):
            tl.store(dq_ptrs, zq, mask=row_ok)
            tl.store(dk_ptrs, zk, mask=key_in)
            tl.store(dw_ptrs + h, 0.0)
            dq_ptrs += n
            dk_ptrs += m


def _acc(*tensors: Tensor) -> tuple[tl.dtype, torch.dtype]:
    """Reduction dtype: float64 if any input is float64, else float32."""
    if any(t.dtype == torch.float64 for t in tensors):
        return tl.float64, torch.float64
    return tl.float32, torch.float32


def _transposed(x: Tensor) -> Tensor:
    """(B, k, h) -> contiguous (B, h, k)."""
    return x.transpose(1, 2).contiguous()


def fwd_launch(
    qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor, scores: Tensor, *, approx: bool
) -> Launch:
    """The launch :func:`additive_fwd` makes (B n m > 0); any device (``meta`` tensors for
    the compile report). Its ``configs`` are the autotune candidates at this shape."""
    B, n, H = qh.shape
    m = kh.shape[1]
    acc, _ = _acc(qh, kh, w_v)
    args = (_transposed(qh), _transposed(kh), w_v, lengths, scores, B, n, m, H)
    named = {"B": B, "n": n, "m": m}
    configs = tuple(config_meta(c) for c in _keep_full_grids(_fwd_kernel.configs, named))
    return Launch(
        _fwd_kernel,
        args,
        {"ACC": acc, "APPROX": approx},
        lambda meta: _fwd_grid(B, n, m, meta),
        configs,
    )


def additive_fwd(qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor, *, approx: bool) -> Tensor:
    """scores (B, n, m) in qh's dtype from qh (B, n, h), kh (B, m, h), w_v (h,), lengths (B, n).

    All contiguous, on one device; lengths int64. See the module docstring.
    """
    B, n, _ = qh.shape
    m = kh.shape[1]
    scores = torch.empty((B, n, m), dtype=qh.dtype, device=qh.device)
    if B * n * m:
        fwd_launch(qh, kh, w_v, lengths, scores, approx=approx).run()
    return scores


def _bwd_tile(B: int, n: int, m: int) -> tuple[int, int, int]:
    """(BI, BJ, warps) of the backward: of ``BWD_TILES``, the one with the fewest partial
    sums, h (n ceil(m / BJ) + m ceil(n / BI)) per batch element, among those with at least
    MIN_PROGRAMS programs; if none has, the one with the most programs."""

    def programs(tile: tuple[int, int, int]) -> int:
        return B * triton.cdiv(n, tile[0]) * triton.cdiv(m, tile[1])

    def partials(tile: tuple[int, int, int]) -> int:
        return n * triton.cdiv(m, tile[1]) + m * triton.cdiv(n, tile[0])

    full = [t for t in BWD_TILES if programs(t) >= MIN_PROGRAMS]
    if full:
        return min(full, key=partials)
    return max(BWD_TILES, key=programs)


class BwdBuffers(NamedTuple):
    """The backward's partial sums (float32, float64 for float64 inputs)."""

    dq: Tensor  # (B, ceil(m / BJ), h, n)
    dk: Tensor  # (B, ceil(n / BI), h, m)
    dw: Tensor  # (programs, h)


def bwd_launch(
    grad_scores: Tensor, qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor, *, approx: bool
) -> tuple[Launch, BwdBuffers]:
    """The launch :func:`additive_bwd` makes (B n m h > 0) and the partial-sum buffers it
    fills; any device (``meta`` tensors for the compile report)."""
    B, n, H = qh.shape
    m = kh.shape[1]
    acc, acc_torch = _acc(qh, kh, w_v)
    BI, BJ, warps = _bwd_tile(B, n, m)
    n_ib, n_jb = triton.cdiv(n, BI), triton.cdiv(m, BJ)
    programs = B * n_ib * n_jb
    bufs = BwdBuffers(
        torch.empty((B, n_jb, H, n), dtype=acc_torch, device=qh.device),
        torch.empty((B, n_ib, H, m), dtype=acc_torch, device=qh.device),
        torch.empty((programs, H), dtype=acc_torch, device=qh.device),
    )
    args = (grad_scores, _transposed(qh), _transposed(kh), w_v, lengths, *bufs, n, m, H)
    meta = {"BI": BI, "BJ": BJ, "ACC": acc, "APPROX": approx, "num_warps": warps}
    return Launch(_bwd_kernel, args, meta, lambda _: (programs,)), bufs


def additive_bwd(
    grad_scores: Tensor, qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor, *, approx: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_qh, grad_kh, grad_w_v) in the dtypes of qh, kh, w_v; grad_scores (B, n, m)
    contiguous. Allocates the partial sums of :class:`BwdBuffers`, never O(B n m h)."""
    B, n, H = qh.shape
    m = kh.shape[1]
    if B * n * m * H == 0:
        return torch.zeros_like(qh), torch.zeros_like(kh), torch.zeros_like(w_v)
    launch, bufs = bwd_launch(grad_scores, qh, kh, w_v, lengths, approx=approx)
    launch.run()
    # The second pass: fixed-order sums over the tile axis (deterministic, no atomics).
    dq = torch.empty_like(qh).copy_(bufs.dq.sum(1).transpose(1, 2))
    dk = torch.empty_like(kh).copy_(bufs.dk.sum(1).transpose(1, 2))
    return dq, dk, bufs.dw.sum(0).to(w_v.dtype)
