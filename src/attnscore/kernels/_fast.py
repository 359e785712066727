"""autograd Functions over the C kernels, plus the padding-free dot-product path.

Threads: the C functions take a row range; Python splits rows over ``torch.get_num_threads()``
ranges of equal *work* (rows have different valid lengths) and runs them on a small thread pool.
ctypes releases the GIL, so the ranges run in parallel without an OpenMP runtime.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from .._checks import compute_dtype
from ._build import load_library

__all__ = [
    "AdditiveScoresC",
    "MaskedSoftmaxC",
    "dot_product_attention_trimmed",
]

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
# Below this much work (roughly element operations) a second thread costs more than it saves.
_MIN_WORK_PER_THREAD = 1 << 15


def _lib() -> ctypes.CDLL:
    lib = load_library()
    if lib is None:  # callers check availability first
        raise RuntimeError("attnscore C kernels are not available")
    return lib


# Outputs at least this large get a transparent-huge-page hint (see attnscore_advise_huge).
_HUGE_MIN_BYTES = 4 << 20


def _empty(shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """torch.empty on CPU, hinted to use huge pages so first-touch page faults stay cheap."""
    t = torch.empty(tuple(shape), dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes >= _HUGE_MIN_BYTES:
        _lib().attnscore_advise_huge(t.data_ptr(), nbytes)
    return t


def _split(work: Tensor, threads: int) -> list[tuple[int, int]]:
    """Cut rows 0..R into at most ``threads`` contiguous ranges of about equal total work."""
    R = work.numel()
    total = int(work.sum())
    parts = max(1, min(threads, R, total // _MIN_WORK_PER_THREAD))
    if parts == 1:
        return [(0, R)]
    cum = work.cumsum(0)
    targets = torch.arange(1, parts, dtype=cum.dtype) * total // parts
    cuts = [0, *(torch.searchsorted(cum, targets) + 1).tolist(), R]
    ranges = [(a, b) for a, b in itertools.pairwise(cuts) if b > a]
    return ranges or [(0, R)]


def _run(
    fn: Callable[..., None],
    ranges: Sequence[tuple[int, int]],
    args: Callable[[int, int, int], Sequence[Any]],
) -> None:
    """Call fn(*args(index, r0, r1)) for every range, in parallel when there are several."""
    global _pool, _pool_size
    if len(ranges) == 1:
        fn(*args(0, *ranges[0]))
        return
    if _pool is None or _pool_size < len(ranges) - 1:
        _pool = ThreadPoolExecutor(max_workers=len(ranges) - 1, thread_name_prefix="attnscore")
        _pool_size = len(ranges) - 1
    futures = [_pool.submit(fn, *args(i, r0, r1)) for i, (r0, r1) in enumerate(ranges) if i]
    fn(*args(0, *ranges[0]))
    for f in futures:
        f.result()


def _suffix(dtype: torch.dtype) -> str:
    return "f64" if dtype == torch.float64 else "f32"


class MaskedSoftmaxC(torch.autograd.Function):
    """Fused masked softmax over the last axis (C kernel; CPU, any float dtype)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, lens: Tensor) -> Tensor:
        cdt = compute_dtype(x.dtype)
        m = x.shape[-1]
        xc = x.detach().to(cdt).contiguous()
        lc = lens.detach().reshape(-1).to(torch.int64).contiguous()
        y = _empty(x.shape, cdt)
        if lc.numel() and m:
            fn = getattr(_lib(), f"ms_fwd_{_suffix(cdt)}")
            # exps cost per valid entry, writing zeros a little per padded one
            ranges = _split(lc.clamp(0, m) + m // 8, torch.get_num_threads())
            _run(
                fn,
                ranges,
                lambda _i, r0, r1: (xc.data_ptr(), lc.data_ptr(), y.data_ptr(), r0, r1, m),
            )
        out = y if x.dtype == cdt else y.to(x.dtype)
        # Saving the output (not a float32 copy) keeps double backward exact: unpacked in a
        # create_graph backward it is connected to this Function again.
        ctx.save_for_backward(out, lc)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        out, lc = ctx.saved_tensors
        m = out.shape[-1]
        if torch.is_grad_enabled():  # double backward: differentiable PyTorch formula
            yf = out.to(compute_dtype(out.dtype))
            gf = grad.to(yf.dtype)
            dxf = yf * (gf - (gf * yf).sum(-1, keepdim=True))
            return dxf.to(grad.dtype), None
        y = out.to(compute_dtype(out.dtype)).contiguous()
        g = grad.to(y.dtype).contiguous()
        dx = _empty(y.shape, y.dtype)
        if lc.numel() and m:
            fn = getattr(_lib(), f"ms_bwd_{_suffix(y.dtype)}")
            ranges = _split(lc.clamp(0, m) + m // 8, torch.get_num_threads())
            _run(
                fn,
                ranges,
                lambda _i, r0, r1: (
                    y.data_ptr(),
                    g.data_ptr(),
                    lc.data_ptr(),
                    dx.data_ptr(),
                    r0,
                    r1,
                    m,
                ),
            )
        return dx.to(grad.dtype), None


class AdditiveScoresC(torch.autograd.Function):
    """Additive scores w_v . tanh(qh_i + kh_j) for j < lens, tanh recomputed in backward.

    Memory: forward keeps only its inputs; backward allocates (B, n, h) for dqh and one
    (B, m, h) dkh accumulator per thread, never anything of size B*n*m*h.
    """

    @staticmethod
    def forward(ctx: Any, qh: Tensor, kh: Tensor, w_v: Tensor, lens: Tensor) -> Tensor:
        cdt = compute_dtype(qh.dtype)
        q = qh.detach().to(cdt).contiguous()
        k = kh.detach().to(cdt).contiguous()
        w = w_v.detach().to(cdt).contiguous()
        lc = lens.detach().to(torch.int64).contiguous()
        B, n, h = q.shape
        m = k.shape[1]
        s = _empty((B, n, m), cdt)
        if B * n and m:
            fn = getattr(_lib(), f"add_fwd_{_suffix(cdt)}")
            ranges = _split(lc.reshape(-1).clamp(0, m) * h + m, torch.get_num_threads())
            _run(
                fn,
                ranges,
                lambda _i, r0, r1: (
                    q.data_ptr(),
                    k.data_ptr(),
                    w.data_ptr(),
                    lc.data_ptr(),
                    s.data_ptr(),
                    r0,
                    r1,
                    n,
                    m,
                    h,
                ),
            )
        ctx.save_for_backward(q, k, w, lc)
        ctx.dtypes = (qh.dtype, kh.dtype, w_v.dtype)
        return s if qh.dtype == cdt else s.to(qh.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, w, lc = ctx.saved_tensors
        B, n, h = q.shape
        m = k.shape[1]
        g = grad.to(q.dtype).contiguous()
        dq = torch.zeros_like(q)
        ranges = _split(lc.reshape(-1).clamp(0, m) * h + 1, torch.get_num_threads())
        dks = [torch.zeros_like(k) for _ in ranges]
        dws = [torch.zeros_like(w) for _ in ranges]
        if B * n and m:
            fn = getattr(_lib(), f"add_bwd_{_suffix(q.dtype)}")
            _run(
                fn,
                ranges,
                lambda i, r0, r1: (
                    q.data_ptr(),
                    k.data_ptr(),
                    w.data_ptr(),
                    lc.data_ptr(),
                    g.data_ptr(),
                    dq.data_ptr(),
                    dks[i].data_ptr(),
                    dws[i].data_ptr(),
                    r0,
                    r1,
                    n,
                    m,
                    h,
                ),
            )
        dk, dw = dks[0], dws[0]
        for extra_k, extra_w in zip(dks[1:], dws[1:], strict=True):
            dk += extra_k
            dw += extra_w
        qd, kd, wd = ctx.dtypes
        return dq.to(qd), dk.to(kd), dw.to(wd), None


class _Zeros(torch.autograd.Function):
    """Zeros (count, n, v) that stay connected to q, k, v with zero gradient, so batch elements
    whose rows are all empty still give gradients (of zero) like the plain path."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, count: int) -> Tensor:
        return q.new_zeros(count, q.shape[1], v.shape[2])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None, None]:
        return None, None, None, None


def dot_product_attention_trimmed(
    q: Tensor, k: Tensor, v: Tensor, lens: Tensor, *, scale: float, dropout_p: float = 0.0
) -> Tensor:
    """Padding-free dot-product attention on top of PyTorch's CPU flash SDPA.

    Each batch element runs SDPA in 4-D (1, 1, n, d) layout (3-D would take the slow math
    path) on views of its keys/values trimmed to its length, so padded keys cost nothing and
    nothing is copied; 2-D lens trim to the row maximum and mask the rest. Measured against
    grouping elements of similar length into batched calls, the per-element loop won (the
    gathers cost more than the extra parallel regions). PyTorch's backward does the gradient.
    """
    sdpa = torch.nn.functional.scaled_dot_product_attention
    B, n, m = q.shape[0], q.shape[1], k.shape[1]
    two_d = lens.dim() == 2
    key_len = (lens.amax(1) if two_d else lens).clamp(0, m).tolist() if B else []
    outs = []
    for b, L in enumerate(key_len):
        if L == 0:  # nothing to attend to: zeros with zero gradients
            outs.append(_Zeros.apply(q, k, v, 1))  # type: ignore[no-untyped-call]
            continue
        qb, kb, vb = q[b, None, None], k[b, None, None, :L], v[b, None, None, :L]
        if not two_d:
            outs.append(sdpa(qb, kb, vb, dropout_p=dropout_p, scale=scale)[0])
            continue
        lb = lens[b].clamp(0, L)
        empty = lb == 0
        # empty rows attend to all (finite) keys and are zeroed below, avoiding NaN
        mask = (torch.arange(L, device=q.device) < lb[:, None]) | empty[:, None]
        out = sdpa(qb, kb, vb, attn_mask=mask[None, None], dropout_p=dropout_p, scale=scale)[0]
        if bool(empty.any()):
            out = torch.where(empty[None, :, None], 0.0, out)
        outs.append(out)
    if not outs:
        return q.new_zeros(0, n, v.shape[2])
    return torch.cat(outs, 0) if len(outs) > 1 else outs[0]
