"""The CPU backend: the C kernels (via ctypes) and a padding-free use of PyTorch's flash SDPA.

It implements the backend contract of :mod:`attnscore.kernels._dispatch`; when the C library
cannot be built or loaded, the C-backed functions hand over to the plain backend.

Threads: the C functions take a row range; Python splits rows over ``torch.get_num_threads()``
ranges of equal *work* (rows have different valid lengths). The ranges run on torch's own
OpenMP threads through the C drivers when the library shares torch's libgomp
(:func:`~attnscore.kernels._build.parallel_in_c`), else on a small Python thread pool (ctypes
releases the GIL).
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
from . import _plain
from ._build import load_library, parallel_in_c

__all__ = [
    "additive_scores_backward",
    "additive_scores_forward",
    "dot_product_attention",
    "masked_softmax_backward",
    "masked_softmax_forward",
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


Args = tuple[Sequence[Any], Sequence[Any]]


def _run(
    lib: ctypes.CDLL,
    kernel: str,
    ranges: Sequence[tuple[int, int]],
    args: Callable[[int], Args],
    driver_tail: Sequence[Any] = (),
) -> None:
    """Run C ``kernel`` (e.g. ``"ms_fwd_f32"``) over contiguous row ``ranges``.

    ``args(i)`` gives (head, tail) for range i: the kernel is called as
    ``kernel(*head, r0, r1, *tail)``. With several ranges, either the C driver
    ``<op>_par_<suffix>(*head_0, cuts, parts, *tail, *driver_tail)`` runs them on torch's
    OpenMP threads, or a Python thread pool calls the kernel once per range.
    """
    fn: Callable[..., None] = getattr(lib, kernel)
    if len(ranges) == 1:
        head, tail = args(0)
        fn(*head, *ranges[0], *tail)
        return
    if parallel_in_c():
        op, suffix = kernel.rsplit("_", 1)
        cuts = torch.tensor([ranges[0][0], *(r1 for _, r1 in ranges)], dtype=torch.int64)
        head, tail = args(0)
        driver = getattr(lib, f"{op}_par_{suffix}")
        driver(*head, cuts.data_ptr(), len(ranges), *tail, *driver_tail)
        return
    _run_threads(fn, ranges, args)


def _run_threads(
    fn: Callable[..., None], ranges: Sequence[tuple[int, int]], args: Callable[[int], Args]
) -> None:
    """Call the kernel once per range on a Python thread pool (this thread takes range 0)."""
    global _pool, _pool_size

    def call(i: int) -> None:
        head, tail = args(i)
        fn(*head, *ranges[i], *tail)

    if _pool is None or _pool_size < len(ranges) - 1:
        _pool = ThreadPoolExecutor(max_workers=len(ranges) - 1, thread_name_prefix="attnscore")
        _pool_size = len(ranges) - 1
    futures = [_pool.submit(call, i) for i in range(1, len(ranges))]
    call(0)
    for f in futures:
        f.result()


def _suffix(dtype: torch.dtype) -> str:
    return "f64" if dtype == torch.float64 else "f32"


def masked_softmax_forward(x: Tensor, lengths: Tensor) -> Tensor:
    """Backend contract (C kernel): softmax of ``x[..., :L]``, exact zeros beyond; one pass
    per row, padded positions never read, 16-bit inputs reduced in float32."""
    lib = load_library()
    if lib is None:
        return _plain.masked_softmax_forward(x, lengths)
    cdt = compute_dtype(x.dtype)
    m = x.shape[-1]
    xc = x.to(cdt).contiguous()
    rows = lengths.reshape(-1).contiguous()
    y = _empty(x.shape, cdt)
    if rows.numel() and m:
        # exps cost per valid entry, writing zeros a little per padded one
        ranges = _split(rows.clamp(0, m) + m // 8, torch.get_num_threads())
        head = (xc.data_ptr(), rows.data_ptr(), y.data_ptr())
        _run(lib, f"ms_fwd_{_suffix(cdt)}", ranges, lambda _i: (head, (m,)))
    return y if x.dtype == cdt else y.to(x.dtype)


def masked_softmax_backward(grad_y: Tensor, y: Tensor, lengths: Tensor) -> Tensor:
    """Backend contract (C kernel): ``y * (grad_y - sum_j grad_y y)`` for j < L, zeros beyond."""
    lib = load_library()
    if lib is None:
        return _plain.masked_softmax_backward(grad_y, y, lengths)
    cdt = compute_dtype(y.dtype)
    m = y.shape[-1]
    yc = y.to(cdt).contiguous()
    g = grad_y.to(cdt).contiguous()
    rows = lengths.reshape(-1).contiguous()
    dx = _empty(y.shape, cdt)
    if rows.numel() and m:
        ranges = _split(rows.clamp(0, m) + m // 8, torch.get_num_threads())
        head = (yc.data_ptr(), g.data_ptr(), rows.data_ptr(), dx.data_ptr())
        _run(lib, f"ms_bwd_{_suffix(cdt)}", ranges, lambda _i: (head, (m,)))
    return dx if y.dtype == cdt else dx.to(y.dtype)


def additive_scores_forward(qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor) -> Tensor:
    """Backend contract (C kernel): ``sum_h w_v tanh(qh_i + kh_j)`` for j < lengths, exact
    zeros elsewhere, without a (B, n, m, h) intermediate; keys j >= lengths never read."""
    lib = load_library()
    if lib is None:
        return _plain.additive_scores_forward(qh, kh, w_v, lengths)
    cdt = compute_dtype(qh.dtype)
    q, k, w = (t.to(cdt).contiguous() for t in (qh, kh, w_v))
    B, n, h = q.shape
    m = k.shape[1]
    s = _empty((B, n, m), cdt)
    if B * n and m:
        ranges = _split(lengths.reshape(-1).clamp(0, m) * h + m, torch.get_num_threads())
        head = (q.data_ptr(), k.data_ptr(), w.data_ptr(), lengths.data_ptr(), s.data_ptr())
        _run(lib, f"add_fwd_{_suffix(cdt)}", ranges, lambda _i: (head, (n, m, h)))
    return s if qh.dtype == cdt else s.to(qh.dtype)


def additive_scores_backward(
    grad_scores: Tensor, qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Backend contract (C kernel): gradients (qh, kh, w_v), tanh recomputed.

    Memory: (B, n, h) for dqh and one (B, m, h) dkh accumulator per thread, never anything
    of size B*n*m*h.
    """
    lib = load_library()
    if lib is None:
        return _plain.additive_scores_backward(grad_scores, qh, kh, w_v, lengths)
    cdt = compute_dtype(qh.dtype)
    q, k, w = (t.to(cdt).contiguous() for t in (qh, kh, w_v))
    B, n, h = q.shape
    m = k.shape[1]
    g = grad_scores.to(cdt).contiguous()
    dq = torch.zeros_like(q)
    ranges = _split(lengths.reshape(-1).clamp(0, m) * h + 1, torch.get_num_threads())
    # one (B, m, h) and one (h,) accumulator per range, summed below
    dks = k.new_zeros((len(ranges), *k.shape))
    dws = w.new_zeros((len(ranges), h))
    if B * n and m:
        inputs = (q.data_ptr(), k.data_ptr(), w.data_ptr(), lengths.data_ptr(), g.data_ptr())

        def args(i: int) -> Args:
            return (*inputs, dq.data_ptr(), dks[i].data_ptr(), dws[i].data_ptr()), (n, m, h)

        _run(lib, f"add_bwd_{_suffix(cdt)}", ranges, args, driver_tail=(B,))
    dk = dks[0] if len(ranges) == 1 else dks.sum(0)
    dw = dws[0] if len(ranges) == 1 else dws.sum(0)
    return dq.to(qh.dtype), dk.to(kh.dtype), dw.to(w_v.dtype)


class _Zeros(torch.autograd.Function):
    """Zeros (count, n, v) that stay connected to q, k, v with zero gradient, so batch elements
    whose rows are all empty still give gradients (of zero) like the plain path."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, count: int) -> Tensor:
        return q.new_zeros(count, q.shape[1], v.shape[2])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None, None]:
        return None, None, None, None


def dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, *, scale: float, dropout_p: float = 0.0
) -> Tensor:
    """Backend contract: padding-free dot-product attention on PyTorch's CPU flash SDPA.

    Each batch element runs SDPA in 4-D (1, 1, n, d) layout (3-D would take the slow math
    path) on views of its keys/values trimmed to its length, so padded keys cost nothing and
    nothing is copied; 2-D lengths trim to the row maximum and mask the rest. Measured against
    grouping elements of similar length into batched calls, the per-element loop won (the
    gathers cost more than the extra parallel regions). PyTorch's backward does the gradient.
    """
    sdpa = torch.nn.functional.scaled_dot_product_attention
    B, n, m = q.shape[0], q.shape[1], k.shape[1]
    two_d = lengths.dim() == 2
    key_len = (lengths.amax(1) if two_d else lengths).clamp(0, m).tolist() if B else []
    outs = []
    for b, L in enumerate(key_len):
        if L == 0:  # nothing to attend to: zeros with zero gradients
            outs.append(_Zeros.apply(q, k, v, 1))  # type: ignore[no-untyped-call]
            continue
        qb, kb, vb = q[b, None, None], k[b, None, None, :L], v[b, None, None, :L]
        if not two_d:
            outs.append(sdpa(qb, kb, vb, dropout_p=dropout_p, scale=scale)[0])
            continue
        lb = lengths[b].clamp(0, L)
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
