"""The CPU backend: the C kernels (via ctypes) and padding-free use of PyTorch's flash SDPA.

It implements the backend contract (:class:`~attnscore.kernels._dispatch.Backend`); when the C
library cannot be built or loaded, the C-backed functions hand over to the plain backend.

Threads: the C functions take a row range; Python splits rows over ``torch.get_num_threads()``
ranges of equal *work* (rows have different valid lengths). The ranges run on torch's own
OpenMP threads through the C drivers when the library shares torch's libgomp
(:func:`~attnscore.kernels._build.parallel_in_c`), else on a small Python thread pool (ctypes
releases the GIL). Small calls run on the calling thread with no splitting at all. The
attention kernel by lengths takes tasks instead of ranges: each thread takes the next task
from a shared counter as it finishes one (:func:`_run_tasks`).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
from collections.abc import Callable, Container, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import compute_dtype, value_range
from .._mask import AttentionMask
from .._thresholds import NEVER, value
from . import _build, _measured, _plain, _sdpa
from ._build import has_float16, load_library
from ._dispatch import NOTHING_CUT, NothingCut, enabled
from ._select import AttentionCall, Implementation, Runner

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
# The size and work thresholds below (upper-case names bound by value()) are bound once from
# the one table of them, attnscore._thresholds, which says what each decides and why.
_MIN_WORK_PER_THREAD: int = value("min_work_per_thread")


def _lib() -> ctypes.CDLL:
    lib = _build.state.lib or load_library()  # (loaded: read without a call)
    if lib is None:  # callers check availability first
        raise RuntimeError("attnscore C kernels are not available")
    return lib


# Outputs at least this large get a transparent-huge-page hint (see attnscore_advise_huge).
_HUGE_MIN_BYTES: int = value("huge_min_bytes")


def _huge(t: Tensor) -> Tensor:
    """``t`` (new, uninitialised), hinted to use huge pages when large, so first-touch page
    faults stay cheap."""
    nbytes = t.numel() * t.element_size()
    if nbytes >= _HUGE_MIN_BYTES:
        _lib().attnscore_advise_huge(t.data_ptr(), nbytes)
    return t


def _empty(shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """torch.empty on CPU, hinted to use huge pages."""
    return _huge(torch.empty(shape, dtype=dtype))


def _empty_like(t: Tensor) -> Tensor:
    """A contiguous ``torch.empty_like(t)`` (half ``torch.empty``'s cost in small calls),
    hinted to use huge pages."""
    return _huge(torch.empty_like(t, memory_format=torch.contiguous_format))


def _split(
    R: int, work: Callable[[], Tensor], threads: int, bound: int, div: int = 1
) -> list[tuple[int, int]]:
    """Cut rows 0..R into at most ``threads`` contiguous ranges of about equal total work.

    ``work()`` gives the work of each group of ``div`` consecutive rows (R / div,), the
    ranges cut between groups; ``bound`` is an upper bound of the total: below two threads'
    minimum the rows are one range, and ``work`` is never computed (small calls run no
    tensor op for it).
    """
    if threads < 2 or bound < 2 * _MIN_WORK_PER_THREAD:
        return [(0, R)]
    work_ = work()
    groups = work_.numel()
    total = int(work_.sum())
    parts = max(1, min(threads, groups, total // _MIN_WORK_PER_THREAD))
    if parts == 1:
        return [(0, R)]
    cum = work_.cumsum(0)
    targets = torch.arange(1, parts, dtype=cum.dtype) * total // parts
    cuts = [0, *((torch.searchsorted(cum, targets) + 1) * div).tolist(), R]
    ranges = [(a, b) for a, b in itertools.pairwise(cuts) if b > a]
    return ranges or [(0, R)]


def _lengths_split(shared: Tensor, div: int, R: int, m: int, threads: int) -> list[tuple[int, int]]:
    """Row ranges of equal work for a masked softmax by lengths in :func:`_shared_lengths`'
    form: the exps cost per valid entry, writing zeros a little per padded one. Rows that
    share a length are cut together (no per-row tensor), unless there are too few groups
    to give every thread some. One length for every row: ranges of equal count."""
    pad = m // 8
    bound = R * (m + pad)
    if shared.numel() == 1:
        return _even(R, threads, bound)
    if shared.numel() < threads:
        return _split(R, lambda: _row_lengths(shared, div).clamp(0, m) + pad, threads, bound)
    return _split(R, lambda: (shared.reshape(-1).clamp(0, m) + pad) * div, threads, bound, div)


Args = tuple[Sequence[Any], Sequence[Any]]


_functions: dict[tuple[int, str], Callable[..., Any]] = {}


def _function(lib: ctypes.CDLL, name: str) -> Callable[..., Any]:
    """The library's C function ``name`` (looked up once: ctypes' lookup costs a few
    microseconds, which small calls notice)."""
    key = (id(lib), name)
    fn = _functions.get(key)
    if fn is None:
        fn = _functions[key] = getattr(lib, name)
    return fn


def _run(
    lib: ctypes.CDLL,
    kernel: str,
    ranges: Sequence[tuple[int, int]],
    args: Callable[[int], Args],
    driver_tail: Sequence[Any] = (),
) -> None:
    """Run C ``kernel`` (e.g. ``"masked_softmax_f32"``) over contiguous row ``ranges``.

    ``args(i)`` gives (head, tail) for range i: the kernel is called as
    ``kernel(*head, r0, r1, *tail)``. With several ranges, either the C driver
    ``<op>_par_<suffix>(*head_0, cuts, parts, *tail, *driver_tail)`` runs them on torch's
    OpenMP threads, or a Python thread pool calls the kernel once per range.
    """
    fn = _function(lib, kernel)
    head, tail = args(0)
    if len(ranges) == 1:
        fn(*head, *ranges[0], *tail)
    elif _build.state.parallel:
        cuts = torch.tensor([ranges[0][0], *(r1 for _, r1 in ranges)], dtype=torch.int64)
        _function(lib, _driver(kernel))(*head, cuts.data_ptr(), len(ranges), *tail, *driver_tail)
    else:
        _run_threads(fn, ranges, args)


def _run_threads(
    fn: Callable[..., None], ranges: Sequence[tuple[int, int]], args: Callable[[int], Args]
) -> None:
    """Call the kernel once per range on the module's Python thread pool, grown as needed
    (this thread takes range 0)."""
    global _pool, _pool_size
    workers = len(ranges) - 1
    if _pool is None or _pool_size < workers:
        _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="attnscore")
        _pool_size = workers

    def call(i: int) -> None:
        head, tail = args(i)
        fn(*head, *ranges[i], *tail)

    futures = [_pool.submit(call, i) for i in range(1, len(ranges))]
    call(0)
    for f in futures:
        f.result()


def _shared_lengths(lengths: Tensor) -> tuple[Tensor, int]:
    """``lengths`` (..., n) as (entries, div): a contiguous tensor whose entry r // div is
    row r's length. Lengths expanded over trailing dimensions (one per example, shared by
    its heads and queries) are not copied: div is the number of rows sharing an entry."""
    sizes, strides = lengths.shape, lengths.stride()
    k, div = len(sizes), 1
    while k and (strides[k - 1] == 0 or sizes[k - 1] == 1):
        k -= 1
        div *= sizes[k]
    base = lengths.as_strided(sizes[:k], strides[:k])
    if base.is_contiguous():
        return base, div
    return lengths.reshape(-1).contiguous(), 1


def _row_lengths(shared: Tensor, div: int) -> Tensor:
    """One length per row, from :func:`_shared_lengths`' form."""
    return shared.reshape(-1).repeat_interleave(div) if div > 1 else shared.reshape(-1)


#: The C functions' name suffix of each dtype (float16's arithmetic needs _Float16).
_SUFFIX = {torch.float64: "f64", torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the C masked softmax runs in: the input's own, or float32 where no kernel
    of that dtype exists (float16 without a compiler that has _Float16)."""
    if dtype in _SUFFIX and (dtype != torch.float16 or has_float16()):
        return dtype
    return torch.float32


def masked_softmax(x: Tensor, lengths: Tensor) -> Tensor:
    """Backend contract (C kernel): one pass per row; 16-bit rows are read and written in
    their own dtype."""
    lib = load_library()
    if lib is None:
        return _plain.masked_softmax(x, lengths)
    dtype = _softmax_dtype(x.dtype)
    m = x.shape[-1]
    xc = x if x.dtype == dtype and x.is_contiguous() else x.to(dtype).contiguous()
    y = _empty_like(xc)
    R = lengths.numel()
    if R and m:
        shared, div = _shared_lengths(lengths)
        ranges = _lengths_split(shared, div, R, m, torch.get_num_threads())
        head = (xc.data_ptr(), shared.data_ptr(), y.data_ptr())
        _run(lib, f"masked_softmax_{_SUFFIX[dtype]}", ranges, lambda _i: (head, (m, div)))
    return y if x.dtype == dtype else y.to(x.dtype)


_SOFTMAX_INFERENCE: Any = value("softmax_inference")
_SOFTMAX_TRAINING: Any = value("softmax_training")
_SOFTMAX_TRAINING_DTYPES: frozenset[torch.dtype] = value("softmax_training_dtypes")


def _softmax_from(limit: Any, dtype: torch.dtype, training: bool) -> int:
    """The size from which the softmax without a mask runs the kernel here: a threshold
    set to an int (a ``thresholds`` block's, or one value for every CPU) as it is; else
    this machine's tune file, else the value shipped for this CPU (``limit``, a mapping
    CPU -> int), else :data:`NEVER` (not measured here: PyTorch's own call)."""
    if type(limit) is int:
        return limit
    tuned = _measured.softmax_from(dtype, training)
    return tuned if tuned is not None else limit.get(_measured.cpu_name(), NEVER)


def softmax_pays(x: Tensor, training: bool) -> bool:
    """Backend contract: contiguous inputs in a dtype the C kernel reads as it is, from the
    size measured on this machine (:func:`_softmax_from`: ``softmax_inference`` /
    ``softmax_training``; a machine not measured: never)."""
    dtype = x.dtype
    if training:
        if dtype not in _SOFTMAX_TRAINING_DTYPES:
            return False
        limit = _SOFTMAX_TRAINING
    else:
        limit = _SOFTMAX_INFERENCE
    if x.numel() < _softmax_from(limit, dtype, training):
        return False
    return _softmax_dtype(dtype) == dtype and x.is_contiguous() and load_library() is not None


def _callers_lengths(valid_lens: Tensor, rows_shape: Sequence[int]) -> tuple[int, int] | None:
    """Lengths as a caller passed them to a small path, for rows of shape ``rows_shape``
    (B, ...): (B,) (every row of an example shares its entry) or ``rows_shape`` itself,
    contiguous, on the CPU, none negative. Returns (rows per entry, the shortest length),
    read once into Python (which is the check), or None."""
    shape = valid_lens.shape
    if not valid_lens.is_cpu or not valid_lens.is_contiguous() or not shape:
        return None
    if shape == rows_shape:
        div = 1
    elif len(shape) == 1 and len(rows_shape) and shape[0] == rows_shape[0]:
        div = math.prod(rows_shape[1:])
    else:
        return None
    if valid_lens.numel() == 0:
        return None
    shortest, _ = value_range(valid_lens)
    return None if shortest < 0 else (div, shortest)


def small_masked_softmax(x: Tensor, valid_lens: Tensor) -> Tensor | None:
    """Backend contract (C kernel): the lengths are read once into Python, to check them.
    None for calls the general path would split, non-contiguous tensors, dtypes converted on
    the way, and without the C library."""
    m = x.shape[-1]
    rows = x.numel() // m if m else 0
    if (
        rows == 0
        or rows * (m + m // 8) >= 2 * _MIN_WORK_PER_THREAD  # the general path splits these
        or _softmax_dtype(x.dtype) != x.dtype
        or not x.is_contiguous()
    ):
        return None
    read = _callers_lengths(valid_lens, x.shape[:-1])
    lib = load_library()
    if lib is None or read is None:
        return None
    div, _ = read
    y = torch.empty_like(x)
    _function(lib, f"masked_softmax_{_SUFFIX[x.dtype]}")(
        x.data_ptr(), valid_lens.data_ptr(), y.data_ptr(), 0, rows, m, div
    )
    return y


def masked_softmax_backward(grad_y: Tensor, y: Tensor, lengths: Tensor) -> Tensor:
    """Backend contract (C kernel): ``y * (grad_y - sum_j grad_y y)`` for j < L, zeros beyond."""
    lib = load_library()
    if lib is None:
        return _plain.masked_softmax_backward(grad_y, y, lengths)
    dtype = _softmax_dtype(y.dtype)
    m = y.shape[-1]
    yc = y.to(dtype).contiguous()
    # One row broadcast to every row (the gradient of a sum) is read as that one row, not
    # copied out to y's size first.
    one_row = grad_y.ndim > 1 and grad_y.numel() > 0 and not any(grad_y.stride()[:-1])
    g = (grad_y.reshape(-1, m)[0] if one_row else grad_y).to(dtype).contiguous()
    dx = _empty_like(yc)
    R = lengths.numel()
    if R and m:
        shared, div = _shared_lengths(lengths)
        ranges = _lengths_split(shared, div, R, m, torch.get_num_threads())
        head = (yc.data_ptr(), g.data_ptr(), shared.data_ptr(), dx.data_ptr())
        kernel = f"masked_softmax_backward_{_SUFFIX[dtype]}"
        _run(lib, kernel, ranges, lambda _i: (head, (m, div, 0 if one_row else m)))
    return dx if y.dtype == dtype else dx.to(y.dtype)


def _even(rows: int, threads: int, bound: int) -> list[tuple[int, int]]:
    """Cut rows 0..R into at most ``threads`` ranges of equal count (rows of equal work)."""
    parts = max(1, min(threads, rows, bound // _MIN_WORK_PER_THREAD))
    cuts = [rows * t // parts for t in range(parts + 1)]
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a] or [(0, rows)]


def _row_offsets(mask: Tensor, shape: Sequence[int]) -> Tensor:
    """int64 (R,): where each row of a tensor of ``shape`` (..., m) starts in ``mask``, a
    boolean mask broadcastable to it whose last dimension is contiguous."""
    expanded = mask.expand(*shape)
    offsets = torch.zeros((), dtype=torch.int64)
    pairs = zip(expanded.shape[:-1], expanded.stride()[:-1], strict=True)
    for dim, (size, stride) in enumerate(pairs):
        if stride and size > 1:
            view = [1] * (len(shape) - 1)
            view[dim] = size
            offsets = offsets + torch.arange(size, dtype=torch.int64).mul_(stride).view(view)
    return offsets.expand(*shape[:-1]).reshape(-1).contiguous()


def masked_softmax_dense(x: Tensor, allowed: Tensor) -> Tensor:
    """Backend contract (C kernel): one pass over the row and its mask, masked entries never
    used; 16-bit rows read and written in their own dtype."""
    lib = load_library()
    if lib is None:
        return _plain.masked_softmax_dense(x, allowed)
    dtype = _softmax_dtype(x.dtype)
    m = x.shape[-1]
    xc = x.to(dtype).contiguous()
    y = _empty(x.shape, dtype)
    rows = xc.numel() // m if m else 0
    if rows and m:
        mask = (
            allowed if allowed.stride(-1) == 1 or allowed.shape[-1] == 1 else allowed.contiguous()
        )
        if mask.shape[-1] != m:  # (..., 1): one flag for the whole row
            mask = mask.expand(*mask.shape[:-1], m).contiguous()
        offsets = _row_offsets(mask, x.shape)
        ranges = _even(rows, torch.get_num_threads(), rows * m)
        head = (xc.data_ptr(), mask.data_ptr(), offsets.data_ptr(), y.data_ptr())
        _run(lib, f"masked_softmax_dense_{_SUFFIX[dtype]}", ranges, lambda _i: (head, (m,)))
    return y if x.dtype == dtype else y.to(x.dtype)


def mask_summary(
    allowed: Tensor, dtype: torch.dtype | None
) -> tuple[Tensor | None, Tensor, Tensor]:
    """Backend contract (C kernel): one read of the mask."""
    lib = load_library()
    suffix = _SUFFIX.get(dtype or torch.float32)
    if lib is None or suffix is None or allowed.ndim < 2:
        return _plain.mask_summary(allowed, dtype)
    *lead, r, m = allowed.shape
    mask = allowed.contiguous()
    groups = mask.numel() // (r * m) if r * m else 0
    row_any = torch.empty((*lead, r), dtype=torch.bool)
    col_any = torch.empty((*lead, m), dtype=torch.bool)
    additive = None if dtype is None else _empty(mask.shape, dtype)
    if groups:
        out = 0 if additive is None else additive.data_ptr()
        ranges = _even(groups, torch.get_num_threads(), groups * r * m)
        head = (mask.data_ptr(), out, row_any.data_ptr(), col_any.data_ptr())
        _run(lib, f"mask_summary_{suffix}", ranges, lambda _i: (head, (r, m)))
    return additive, row_any, col_any


def lengths_mask(lengths: Tensor, m: int, dtype: torch.dtype) -> Tensor:
    """Backend contract (C kernel): the additive mask (..., m) of lengths (...), written
    straight from the lengths (one pass, no boolean mask in between)."""
    lib = load_library()
    suffix = _SUFFIX.get(dtype)
    if lib is None or suffix is None:
        return _plain.lengths_mask(lengths, m, dtype)
    rows_ = lengths.reshape(-1).contiguous()
    out = _empty((*lengths.shape, m), dtype)
    R = rows_.numel()
    if R and m:
        ranges = _even(R, torch.get_num_threads(), R * m)
        head = (rows_.data_ptr(), out.data_ptr())
        _run(lib, f"lengths_mask_{suffix}", ranges, lambda _i: (head, (m,)))
    return out


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Backend contract (C kernel): a and b read through their strides, the float32 sums
    rounded once (PyTorch's float16 product is slow on CPUs without float16 arithmetic).
    Other shapes and dtypes, and without the C library or its float16: ``torch.matmul``."""
    lib = load_library()
    if (
        lib is None
        or not has_float16()
        or not (a.dtype == b.dtype == torch.float16)
        or min(a.ndim, b.ndim) < 2
        or b.device.type != "cpu"  # another device: torch.matmul's error
    ):
        return torch.matmul(a, b)
    *lead, r, k = a.shape
    c = b.shape[-1]
    batched = b.ndim == a.ndim > 2 and b.shape[:-2] == a.shape[:-2]
    if b.shape[-2] != k or not (b.ndim == 2 or batched):
        return torch.matmul(a, b)  # broadcast batch dimensions; wrong sizes: its error
    out = torch.empty((*lead, r, c), dtype=torch.float16)
    if out.numel() == 0 or k == 0:  # nothing, or empty sums
        return out.zero_()
    x = a if a.ndim == 3 else a.reshape(-1, r, k)
    y = b if b.ndim <= 3 else b.reshape(-1, k, c)
    rows = out.numel() // c
    ranges = _even(rows, torch.get_num_threads(), rows * k * c)
    head = (x.data_ptr(), y.data_ptr(), out.data_ptr())
    tail = (r, k, c, *x.stride(), y.stride(0) if batched else 0, *y.stride()[-2:])
    _run(lib, "matmul_f16", ranges, lambda _i: (head, tail))
    return out


def additive_scores(qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor) -> Tensor:
    """Backend contract (C kernel): no (B, n, m, h) intermediate; keys j >= lengths never
    read."""
    lib = load_library()
    if lib is None:
        return _plain.additive_scores(qh, kh, w_v, lengths)
    cdt = compute_dtype(qh.dtype)
    q, k, w = (t.to(cdt).contiguous() for t in (qh, kh, w_v))
    B, n, h = q.shape
    m = k.shape[1]
    s = _empty((B, n, m), cdt)
    if B * n and m:
        threads, bound = torch.get_num_threads(), B * n * (m * h + m)
        ranges = _split(B * n, lambda: lengths.reshape(-1).clamp(0, m) * h + m, threads, bound)
        head = (q.data_ptr(), k.data_ptr(), w.data_ptr(), lengths.data_ptr(), s.data_ptr())
        _run(lib, f"additive_scores_{_SUFFIX[cdt]}", ranges, lambda _i: (head, (n, m, h)))
    return s if qh.dtype == cdt else s.to(qh.dtype)


def additive_scores_backward(
    grad_scores: Tensor, qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Backend contract (C kernel), tanh recomputed. Memory: (B, n, h) for dqh and one
    (B, m, h) dkh accumulator per thread, never anything of size B*n*m*h."""
    lib = load_library()
    if lib is None:
        return _plain.additive_scores_backward(grad_scores, qh, kh, w_v, lengths)
    cdt = compute_dtype(qh.dtype)
    q, k, w = (t.to(cdt).contiguous() for t in (qh, kh, w_v))
    B, n, h = q.shape
    m = k.shape[1]
    g = grad_scores.to(cdt).contiguous()
    dq = torch.zeros_like(q)
    threads, bound = torch.get_num_threads(), B * n * (m * h + 1)
    ranges = _split(B * n, lambda: lengths.reshape(-1).clamp(0, m) * h + 1, threads, bound)
    # one (B, m, h) and one (h,) accumulator per range, summed below
    dks = k.new_zeros((len(ranges), *k.shape))
    dws = w.new_zeros((len(ranges), h))
    if B * n and m:
        inputs = (q.data_ptr(), k.data_ptr(), w.data_ptr(), lengths.data_ptr(), g.data_ptr())

        def args(i: int) -> Args:
            return (*inputs, dq.data_ptr(), dks[i].data_ptr(), dws[i].data_ptr()), (n, m, h)

        _run(lib, f"additive_scores_backward_{_SUFFIX[cdt]}", ranges, args, driver_tail=(B,))
    dk = dks[0] if len(ranges) == 1 else dks.sum(0)
    dw = dws[0] if len(ranges) == 1 else dws.sum(0)
    return dq.to(qh.dtype), dk.to(kh.dtype), dw.to(w_v.dtype)


# ---- inputs ---------------------------------------------------------------------------------


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """Backend contract (C scan): an attention call's three contiguous inputs of one dtype
    take one C call; a tensor passed twice (self-attention's keys and values) is read once;
    others one C call each where their entries fill one block of memory (any order of
    dimensions: a result in the layout the attention kernels write); other layouts take
    PyTorch's reduction."""
    lib = _build.state.lib or load_library()
    if 2 <= len(tensors) <= 3:  # (two: a result's check, queries and output, one C call too)
        q, k, v = tensors if len(tensors) == 3 else (*tensors, tensors[-1])
        scan = _scan3_for(lib, q, k, v)
        if scan is not None:
            kp, vp = k.data_ptr(), v.data_ptr()
            vn = v.numel() * (vp != kp)
            return not scan(q.data_ptr(), q.numel(), kp, k.numel(), vp, vn, None, None)
    read: set[tuple[int, int]] = set()
    for t in tensors:
        n = t.numel()
        suffix = _SUFFIX.get(t.dtype)
        if not n or (t.data_ptr(), n) in read:
            continue
        read.add((t.data_ptr(), n))
        if lib is None or suffix is None or not _one_block(t):
            if not bool(torch.isfinite(t).all()):
                return False
        elif _function(lib, f"any_nonfinite_{suffix}")(t.data_ptr(), n):
            return False
    return True


def _one_block(t: Tensor) -> bool:
    """Whether ``t``'s entries are its numel consecutive slots from ``data_ptr()`` (a
    contiguous tensor with its dimensions in any order): a scan that only asks whether
    some entry is not finite reads them in memory order."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted(zip(t.stride(), t.shape, strict=True)):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


_SCAN3: dict[torch.dtype, Callable[..., int]] = {}


def _scan3_for(
    lib: ctypes.CDLL | None, q: Tensor, k: Tensor, v: Tensor
) -> Callable[..., int] | None:
    """The C scan of q, k, v at once (kept per dtype), where it reads them: the library
    loaded, one dtype with a scan, all three in one block each (:func:`_one_block`); else
    None."""
    if lib is None:
        return None
    scan = _SCAN3.get(q.dtype)
    if scan is None:
        suffix = _SUFFIX.get(q.dtype)
        if suffix is None:
            return None
        scan = _SCAN3[q.dtype] = _function(lib, f"any_nonfinite3_{suffix}")
    same = k.dtype == v.dtype == q.dtype
    if not same:
        return None
    # (is_contiguous first: no Python call on the common layout)
    if not (q.is_contiguous() or _one_block(q)) or not (k.is_contiguous() or _one_block(k)):
        return None
    return scan if v.is_contiguous() or _one_block(v) else None


# ---- dot-product attention: padded keys cost nothing -----------------------------------

_CALL_WORK: int = value("call_work")
_THREADS_WORK: int = value("threads_work")
_SMALL_WORK: int = value("small_work")  # multiply-adds, B * H * n * m * (d + dv)

_SMALL_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
#: The dtypes of calls by key lengths that dot-product attention runs whole from the
#: caller's tensors: the small pass's and the kernel by lengths'.
_SMALL_DTYPES = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16})


def _small_pass(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Tensor,
    div: int,
    scale: float,
    weights: Tensor | None = None,
) -> Tensor | None:
    """The C pass of small dot-product attention: q (..., n, d), k (..., m, d), v (...,
    m, dv), contiguous and of one float dtype with a kernel; row r of q attends the first
    ``lengths[r // div]`` keys of its (example, head) (clamped to [0, m]). ``weights``
    (..., n, m), contiguous, when given, receives the weights. None where a row's scores or
    output are not all finite (the C arithmetic does not promise to carry them as PyTorch
    does)."""
    lib = _lib()
    *lead, n, d = q.shape
    m, dv = k.shape[-2], v.shape[-1]
    out = q.new_empty((*lead, n, dv))
    bad = _function(lib, f"small_attention_{_SMALL_SUFFIX[q.dtype]}")(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), lengths.data_ptr(), out.data_ptr(),
        None if weights is None else weights.data_ptr(),
        out.numel() // dv if dv else 0, n, m, d, dv, div, scale,
    )  # fmt: skip
    return None if bad else out


def _small_layout(
    q: Tensor, k: Tensor, v: Tensor, valid_lens: Tensor, features: int, dtypes: Container[Any]
) -> tuple[int, int, bool] | None:
    """The checks a call from the caller's tensors passes (both kinds of scores): q (B, n,
    ·) or (B, H, n, ·), k and v alike, one dtype among ``dtypes``, on the CPU, lengths (B,)
    or q.shape[:-1], contiguous, none negative. Returns how many rows share a length, the
    call's work (multiply-adds, ``features`` per score) and whether some length cuts a key
    (below m); else None."""
    # (each Tensor attribute read once: this runs on every small call)
    ndim, qs, ks, vs = q.ndim, q.shape, k.shape, v.shape
    if (
        q.dtype not in dtypes
        or k.dtype != q.dtype
        or v.dtype != q.dtype
        or ndim not in (3, 4)
        or len(ks) != ndim
        or len(vs) != ndim
        or not (k.is_cpu and v.is_cpu)
    ):
        return None
    n, d, m, dv = qs[-2], qs[-1], ks[-2], vs[-1]
    if (
        ks[:-2] != qs[:-2]
        or vs[:-1] != ks[:-1]
        or min(n, m, d, dv, features) == 0
        or load_library() is None
    ):
        return None
    read = _callers_lengths(valid_lens, qs[:-1])
    if read is None:  # (bad ones: the checks name them)
        return None
    return read[0], q.numel() // d * m * (features + dv), read[1] < m


def small_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    valid_lens: Tensor,
    scale: float,
    project: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None,
) -> tuple[Tensor, Tensor | None] | NothingCut | None:
    """Backend contract (C kernels), for calls :func:`_small_layout` takes (at mid sizes the
    layers between cost more than the work): up to ``_SMALL_WORK`` multiply-adds in float32
    and float64 the C pass of :func:`_small_pass`, which writes the weights as well (one
    (..., n, m) tensor costs less than keeping copies of the inputs); above it and in 16
    bits the kernel by lengths (:func:`_by_lengths_forward`) where it runs, no weights;
    above the pass, :data:`~._dispatch.NOTHING_CUT` for lengths that cut no key (the pass
    takes them: nothing cut is every length m)."""
    if project is None and k.shape[-1] != q.shape[-1]:
        return None
    taken = _small_layout(q, k, v, valid_lens, k.shape[-1], _SMALL_DTYPES)
    if taken is None:
        return None
    div, work, cut = taken
    whole = work <= _SMALL_WORK and q.dtype in _SMALL_SUFFIX  # else the kernel by lengths
    if not (whole or cut):
        return NOTHING_CUT
    if not whole and (work < _BY_LENGTHS_WORK or _by_lengths_declines(q, k, v) is not None):
        return None
    if project is not None:
        q, k = project(q, k)
    if whole:
        weights = q.new_empty((*q.shape[:-1], k.shape[-2]))
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = _small_pass(q, k, v, valid_lens, div, scale, weights)
        return None if out is None else (out, weights)
    B, n = q.shape[0], q.shape[-2]
    H = q.shape[1] if q.ndim == 4 else 1
    lengths = valid_lens.view(B, 1, 1) if valid_lens.ndim == 1 else valid_lens.view(B, H, n)
    out = _by_lengths_forward(q, k, v, _ByLength.of(lengths, n), scale, logsumexp=False)[0]
    # Queries of different lengths share the kernel's tiles: there NaN in a key or value
    # one of them attends reaches the others (0 x NaN), and shows in the output, which the
    # checked path then computes again (lengths shared by an (example, head)'s queries
    # carry NaN exactly). The small pass checks its own scores and output.
    if div < n and not all_finite((q, out)):
        return None
    return out, None


def small_additive_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    valid_lens: Tensor,
    hidden: int,
    project: Callable[[Tensor, Tensor], tuple[Tensor, Tensor, Tensor]],
) -> tuple[Tensor, Tensor] | None:
    """Backend contract (C kernel), for calls :func:`_small_layout` takes of at most
    ``_SMALL_WORK`` multiply-adds (float32, float64): one C pass of each query row's scores
    over its valid keys only, their softmax and the weighted values."""
    taken = _small_layout(q, k, v, valid_lens, hidden, _SMALL_SUFFIX)
    if taken is None or taken[1] > _SMALL_WORK:
        return None
    div = taken[0]
    qh, kh, w = (t.contiguous() for t in project(q, k))
    vc = v.contiguous()
    *lead, n, h = qh.shape
    m, dv = kh.shape[-2], vc.shape[-1]
    out = torch.empty((*lead, n, dv), dtype=qh.dtype)
    weights = torch.empty((*lead, n, m), dtype=qh.dtype)
    bad = _function(_lib(), f"small_additive_{_SMALL_SUFFIX[qh.dtype]}")(
        qh.data_ptr(), kh.data_ptr(), w.data_ptr(), vc.data_ptr(), valid_lens.data_ptr(),
        out.data_ptr(), weights.data_ptr(), out.numel() // dv, n, m, h, dv, div,
    )  # fmt: skip
    return None if bad else (out, weights)


#: A flash call's q, k, v, additive mask (or None) and is_causal.
_FlashCall = tuple[Tensor, Tensor, Tensor, Tensor | None, bool]


@dataclass(frozen=True)
class _Cut:
    """The loop's piece of example ``b``: its first ``queries`` queries over its first
    ``keys`` keys, with ``is_causal`` or, inside the piece, per-row lengths ``rows`` (1, H or
    1, queries, 1) that make a mask (``idle``: some of them are 0)."""

    b: int
    queries: int
    keys: int
    causal: bool = False
    rows: Tensor | None = None
    idle: bool = False

    def zero_idle(self, t: Tensor) -> Tensor:
        """``t`` (1, H, queries, ·) with the rows that attend nothing zeroed."""
        if self.idle:
            assert self.rows is not None
            return t.masked_fill(self.rows == 0, 0.0)
        return t

    def call(self, q: Tensor, k: Tensor, v: Tensor) -> _FlashCall:
        """The flash op's arguments for this piece: views of q, k, v (rows that attend
        nothing zeroed in q), the additive form of the mask inside, ``is_causal``."""
        b, keys, rows = self.b, self.keys, self.rows
        mask = None if rows is None else lengths_mask(rows[..., 0], keys, q.dtype)
        qb = self.zero_idle(q[b : b + 1, :, : self.queries])
        return qb, k[b : b + 1, :, :keys], v[b : b + 1, :, :keys], mask, self.causal

    def put(self, out: Tensor, value: Tensor) -> None:
        """Write the piece's output (1, H, queries, dv) into ``out``."""
        out[self.b : self.b + 1, :, : self.queries] = value


def _flash_forward(
    pieces: Sequence[_Cut | _Group], q: Tensor, k: Tensor, v: Tensor, out: Tensor, scale: float
) -> list[Tensor]:
    """Each piece's flash forward, written into ``out``; returns their logsumexps (kept for
    the backward), from PyTorch's CPU flash op (which keeps them: torch >= 2.2). One call's
    output, mask and gathered inputs live at a time."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    saved = []
    for piece in pieces:
        qp, kp, vp, mask, causal = piece.call(q, k, v)
        o, lse = flash(qp, kp, vp, 0.0, causal, attn_mask=mask, scale=scale)
        piece.put(out, o)
        del o, qp, kp, vp, mask  # before the next piece makes its own
        saved.append(lse)
    return saved


def _flash_backward(
    call: _FlashCall, grad: Tensor, out: Tensor, lse: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The flash backward of one piece's ``call`` (its :func:`_flash_forward` arguments),
    given the piece's upstream gradient, output and logsumexp: (dq, dk, dv) of the piece."""
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    qp, kp, vp, mask, causal = call
    grads: tuple[Tensor, Tensor, Tensor] = backward(
        grad, qp, kp, vp, out, lse, 0.0, causal, attn_mask=mask, scale=scale
    )
    return grads


class _CutAttention(torch.autograd.Function):
    """The loop as one autograd node: each piece's flash forward writes into one output
    allocated once, its backward into gradients allocated once (nothing of the inputs' size
    is allocated per example, so the cost stays linear in the batch)."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, cuts: list[_Cut], scale: float
    ) -> Tensor:
        B, H, n, _ = q.shape
        dv = v.shape[-1]
        heads_inner = H > 1 and q.stride(1) < q.stride(2)  # (B, n, H, d) in memory (MHA)
        out = q.new_empty(B, n, H, dv).transpose(1, 2) if heads_inner else q.new_empty(B, H, n, dv)
        saved = _flash_forward(cuts, q, k, v, out, scale)
        covered = dict.fromkeys(range(B), 0) | {cut.b: cut.queries for cut in cuts}
        for b, stop in covered.items():  # queries its piece covers: the rest is zero
            if stop < n:
                out[b, :, stop:].zero_()
        ctx.cuts, ctx.scale = cuts, scale
        ctx.save_for_backward(q, k, v, out, *saved)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        q, k, v, out, *lses = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

        def example(cut: _Cut, lse: Tensor) -> None:  # writes its example's slices only
            b, rows, keys = cut.b, slice(0, cut.queries), slice(0, cut.keys)
            with torch.no_grad():  # grad mode is per thread: pool threads have it on
                g, o = grad[b : b + 1, :, rows].contiguous(), out[b : b + 1, :, rows]
                gq, gk, gv = _flash_backward(cut.call(q, k, v), g, o, lse, ctx.scale)
                dq[b : b + 1, :, rows] = cut.zero_idle(gq)
                dk[b : b + 1, :, keys] += gk
                dv[b : b + 1, :, keys] += gv

        # PyTorch's flash backward splits its work by (example, head) only: with fewer heads
        # than threads one call would leave cores idle, so examples run side by side on
        # threads instead (each writes its own slices; ATen releases the GIL). The threads
        # end with the backward: a live thread that has run a PyTorch op slows every later
        # small op of the main thread, so a pool kept for the next call would tax the program.
        threads = torch.get_num_threads()
        if q.shape[1] < threads and len(lses) > 1:
            with ThreadPoolExecutor(threads, thread_name_prefix="attnscore-bwd") as pool:
                list(pool.map(example, ctx.cuts, lses))
        else:
            for cut, lse in zip(ctx.cuts, lses, strict=True):
                example(cut, lse)
        return dq, dk, dv, None, None


def _cut_attention_autograd(
    q: Tensor, k: Tensor, v: Tensor, cuts: list[_Cut], scale: float, dropout_p: float
) -> Tensor:
    """The loop through PyTorch's ``scaled_dot_product_attention`` and its autograd: for
    dropout (which the flash op does not take) and value sizes unlike the query size. Views
    of the inputs per piece (one stack per input in the backward), one concatenation."""
    B, H, n, _ = q.shape
    heads_inner = H > 1 and q.stride(1) < q.stride(2)
    by_example = {cut.b: cut for cut in cuts}
    outs = []
    for b, (qb, kb, vb) in enumerate(zip(q.unbind(0), k.unbind(0), v.unbind(0), strict=True)):
        cut = by_example.get(b)
        if cut is None:  # nothing to attend
            out = _Zeros.apply(qb, kb, vb)  # type: ignore[no-untyped-call]
        else:
            out = F.scaled_dot_product_attention(
                cut.zero_idle(qb[None, :, : cut.queries]),
                kb[None, :, : cut.keys],
                vb[None, :, : cut.keys],
                attn_mask=None if cut.rows is None else torch.arange(cut.keys) < cut.rows,
                dropout_p=dropout_p,
                is_causal=cut.causal,
                scale=scale,
            )
            if cut.queries < n:
                out = F.pad(out, (0, 0, 0, n - cut.queries))
        outs.append(out.transpose(1, 2) if heads_inner else out)
    result = torch.cat(outs, 0) if B > 1 else outs[0]
    return result.transpose(1, 2) if heads_inner else result


class _Zeros(torch.autograd.Function):
    """Zeros (1, H, n, dv) that stay connected to q, k, v with zero gradient, so examples
    with nothing to attend still give gradients (of zero), as SDPA does."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ctx.inputs = [(t.shape, t.dtype) for t in (q, k, v)]
        return q.new_zeros(1, q.shape[0], q.shape[1], v.shape[2])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, ...]:
        return tuple(grad.new_zeros(shape, dtype=dtype) for shape, dtype in ctx.inputs)


def _spaced(t: Tensor, examples: list[int]) -> Tensor | None:
    """``t``'s ``examples`` (increasing, dim 0) as a view where they are evenly spaced
    (always for one or two examples), else None."""
    step = examples[1] - examples[0] if len(examples) > 1 else 1
    if any(b - a != step for a, b in itertools.pairwise(examples)):
        return None
    sizes, strides = t.shape, t.stride()
    return t.as_strided(
        (len(examples), *sizes[1:]),
        (step * strides[0], *strides[1:]),
        t.storage_offset() + examples[0] * strides[0],
    )


def _examples(t: Tensor, examples: list[int]) -> Tensor:
    """``t``'s ``examples`` (increasing, dim 0): a view when evenly spaced, else a copy."""
    view = _spaced(t, examples)
    if view is not None:
        return view
    return t.index_select(0, torch.tensor(examples, device=t.device))


@dataclass(frozen=True)
class _Group:
    """A call of the grouped path: examples of similar length, on their first ``keys`` keys
    (the longest of their lengths), with the mask of their rows' ``lengths`` (G, H or 1,
    n or 1) inside."""

    examples: list[int]
    keys: int
    lengths: Tensor

    def put(self, out: Tensor, value: Tensor) -> None:
        """Write ``value`` (G, ...) into the group's examples of ``out`` (dim 0)."""
        view = _spaced(out, self.examples)
        if view is not None:
            view.copy_(value)
        else:
            out.index_copy_(0, torch.tensor(self.examples, device=out.device), value)

    def call(self, q: Tensor, k: Tensor, v: Tensor) -> _FlashCall:
        """The flash op's arguments: the group's q, k, v (keys cut) and its additive mask
        (G, H or 1, n or 1, keys); not causal (causal masking is in the lengths)."""
        keys, examples = self.keys, self.examples
        qg, kg, vg = (_examples(t, examples) for t in (q, k[:, :, :keys], v[:, :, :keys]))
        return qg, kg, vg, lengths_mask(self.lengths, keys, q.dtype), False


def _groups(longest: list[int], lengths: Tensor, size: int) -> list[_Group]:
    """The examples in groups of ``size`` by their longest length (``longest``), each cut to
    the longest among its examples (at least 1), with its rows of ``lengths``."""
    order = sorted(range(len(longest)), key=longest.__getitem__)
    groups = []
    for i in range(0, len(order), size):
        examples = sorted(order[i : i + size])
        keys = max(1, max(longest[b] for b in examples))
        rows = lengths if lengths.shape[0] == 1 else _examples(lengths, examples)
        groups.append(_Group(examples, keys, rows))
    return groups


class _GroupedAttention(torch.autograd.Function):
    """Training where the loop's backward would leave threads idle: one flash call per group
    of examples of similar length (:func:`_groups`) on keys cut to the group's longest,
    with the mask inside, so each call has examples x heads to split over the threads.
    One autograd node, as the loop's; a group's inputs are views where its examples are
    evenly spaced (:func:`_examples`). q, k, v arrive with their padding inert
    (:func:`_sdpa.inert`)."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, groups: list[_Group], scale: float
    ) -> Tensor:
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        saved = _flash_forward(groups, q, k, v, out, scale)
        ctx.groups, ctx.scale = groups, scale
        ctx.save_for_backward(q, k, v, out, *saved)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        q, k, v, out, *lses = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for group, lse in zip(ctx.groups, lses, strict=True):
            rows, outs = _examples(grad, group.examples), _examples(out, group.examples)
            if rows.stride(-1) != 1 or 0 in rows.stride():  # e.g. a sum's: one value
                rows = rows.contiguous()  # broadcast, made whole for this group only
            gq, gk, gv = _flash_backward(group.call(q, k, v), rows, outs, lse, ctx.scale)
            group.put(dq, gq)
            group.put(dk[:, :, : group.keys], gk)
            group.put(dv[:, :, : group.keys], gv)
        return dq, dk, dv, None, None


#: dtypes of the C kernel by lengths (:func:`_by_lengths_forward`), which computes in
#: float32.
_BY_LENGTHS_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_FLASH_LENGTHS = {dtype: f"flash_lengths_{suffix}" for dtype, suffix in _BY_LENGTHS_SUFFIX.items()}
_BY_LENGTHS_KEYS: int = value("by_lengths_keys")
_BY_LENGTHS_WORK: int = value("by_lengths_work")
_BY_LENGTHS_CHUNK: int = value("by_lengths_chunk")
#: The kernel's tile of queries (FA_ROWS in the C source); fewer go row by row.
_FA_ROWS = 8


def _by_lengths_declines(q: Tensor, k: Tensor, v: Tensor) -> str | None:
    """None where the C kernel by lengths runs these inputs, else why not."""
    suffix = _BY_LENGTHS_SUFFIX.get(q.dtype)
    if not (k.dtype == v.dtype == q.dtype):
        return f"mixed dtypes {q.dtype}, {k.dtype}, {v.dtype}"
    if suffix is None:
        return f"{q.dtype} (float32, bfloat16, float16 only)"
    if k.shape[-2] > _BY_LENGTHS_KEYS:
        return f"{k.shape[-2]} keys, above by_lengths_keys ({_BY_LENGTHS_KEYS})"
    if (_build.state.lib is None and load_library() is None) or (
        suffix == "f16" and not has_float16()
    ):
        return "the C library is not loaded (or has no float16)"
    return None


@dataclass(frozen=True)
class _ByLength:
    """Each (example, head)'s queries in order of length, as the C kernel by lengths reads
    them: ``lengths`` (B or 1, H or 1, n) ascending and ``order`` the queries' indices in
    that order, both contiguous int64; ``strides``: theirs over examples and heads (0
    where the lengths are shared)."""

    lengths: Tensor
    order: Tensor
    strides: tuple[int, int]

    @staticmethod
    def of(lengths: Tensor, n: int, *, ascending: bool = False) -> _ByLength:
        """From lengths (B or 1, H or 1, n or 1) (:func:`~attnscore._mask.compact`); ``ascending``:
        each (example, head)'s are in order already (causal masking's). Lengths shared by
        an (example, head)'s queries, or in order, are not sorted (a sort of a few rows
        costs more than the kernel's work in a mid-size call)."""
        Bl, Hl, nl = lengths.shape
        strides = (Hl * n if Bl > 1 else 0, n if Hl > 1 else 0)
        if nl == 1 or ascending:
            if nl != n or not lengths.is_contiguous():  # else as the kernels read them
                lengths = lengths.expand(Bl, Hl, n).contiguous()
            if Bl * Hl == 1:
                order = _ascending(n)
            elif Bl * Hl * n <= _KEPT_ORDER:  # kept: a copy costs microseconds per call
                order = _ascending_rows(Bl, Hl, n)
            else:
                order = _ascending(n).expand(Bl, Hl, n).contiguous()
            return _ByLength(lengths, order, strides)
        # sort keeps its input's strides: lengths made as (n, B).T come back laid out as
        # that, and the kernel reads (B, H, n) in order
        by_length, order = lengths.sort(dim=-1)
        return _ByLength(by_length.contiguous(), order.contiguous(), strides)


@functools.lru_cache(maxsize=64)
def _ascending(n: int) -> Tensor:
    """0, 1, ..., n - 1 as (1, 1, n) int64: the order of queries already in order (kept:
    the kernels only read it)."""
    return torch.arange(n).view(1, 1, n)


_KEPT_ORDER: int = value("kept_order")


@functools.lru_cache(maxsize=64)
def _ascending_rows(B: int, H: int, n: int) -> Tensor:
    """:func:`_ascending` for each of (B, H) (example, head) pairs, contiguous (B, H, n)."""
    return _ascending(n).expand(B, H, n).contiguous()


@functools.lru_cache(maxsize=128)
def _unpadded_by(n: int, m: int, causal: bool) -> _ByLength:
    """The queries by length with nothing padded, as (1, 1, n) int64, in order (never
    sorted or copied per call; kept: the kernels only read them): causal masking's lengths
    1, 2, ..., n (at most m), or m for each query without a mask."""
    lengths = torch.arange(1, n + 1).clamp_(max=m) if causal else torch.full((n,), m)
    return _ByLength.of(lengths.view(1, 1, n), n, ascending=True)


@functools.lru_cache(maxsize=256)
def _int64s(values: tuple[int, ...]) -> ctypes.Array[ctypes.c_int64]:
    """``values`` as a C array of int64 (the kernels' strides): cheaper than a tensor's;
    the same values give the same array (kept: the kernels only read it)."""
    return (ctypes.c_int64 * len(values))(*values)


def _run_tasks(
    lib: ctypes.CDLL, kernel: str, head: Sequence[Any], tail: Sequence[Any], tasks: int, work: int
) -> None:
    """Run C ``kernel`` (``kernel(*head, next, tasks, *tail)``) over ``tasks`` tasks of
    ``work`` multiply-adds in all: on one thread when that is too little for two, else on
    torch's threads, each taking the next task from a shared counter as it finishes one
    (the C driver ``<op>_par_<suffix>(*head, tasks, threads, *tail)`` on OpenMP threads, or
    the kernel on Python threads)."""
    in_c = _in_c(lib, kernel, tasks, work)
    if in_c is not None:
        fn, middle = in_c
        fn(*head, *middle, *tail)
        return
    # Python threads sharing one task counter
    threads = min(torch.get_num_threads(), tasks)
    counter = torch.zeros(1, dtype=torch.int64)
    fn = _function(lib, kernel)
    _run_threads(fn, [(counter.data_ptr(), tasks)] * threads, lambda _i: (head, tail))


def _in_c(
    lib: ctypes.CDLL, kernel: str, tasks: int, work: int
) -> tuple[Callable[..., None], tuple[Any, ...]] | None:
    """How :func:`_run_tasks` calls ``kernel`` in one C call: (the function, the arguments
    between its head and its tail), on one thread when ``work`` is too little for two, else
    on torch's threads through the OpenMP driver; None where the kernels run on Python
    threads instead."""
    threads = min(torch.get_num_threads(), tasks) if work >= 2 * _MIN_WORK_PER_THREAD else 1
    if threads <= 1:
        return _function(lib, kernel), (None, tasks)
    if _build.state.parallel:
        return _function(lib, _driver(kernel)), (tasks, threads)
    return None


@functools.cache
def _driver(kernel: str) -> str:
    """The C driver of ``kernel`` (``<op>_<suffix>``): ``<op>_par_<suffix>``."""
    op, suffix = kernel.rsplit("_", 1)
    return f"{op}_par_{suffix}"


def _strides(*tensors: Tensor) -> list[int]:
    """The strides (example, head, row) of each 4-D tensor, or of each 3-D one as one head
    (its head stride 0): the C kernels'."""
    out: list[int] = []
    for t in tensors:
        s = t.stride()
        out += s[:3] if len(s) == 4 else (s[0], 0, s[1])
    return out


def _last_contiguous(*tensors: Tensor) -> list[Tensor]:
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def _by_lengths_forward(
    q: Tensor, k: Tensor, v: Tensor, by: _ByLength, scale: float, logsumexp: bool
) -> tuple[Tensor, Tensor | None]:
    """Dot-product attention by lengths in one C call (``flash_lengths``): each (example,
    head)'s queries in order of length (``by``), 8 at a time, each tile over the keys its
    longest query attends, so the work follows the lengths (PyTorch's CPU flash kernel
    takes keys in blocks of 512: a mask inside a call saves nothing there). Keys beyond an
    (example, head)'s longest length and queries of length 0 (zeros) are never read.
    Computes in float32 for every dtype it takes (:func:`_by_lengths_declines`); bfloat16's
    products, on a CPU with AVX512-BF16, from pairs of bfloat16 into float32 sums.

    q (B, H, n, d), k (B, H, m, d), v (B, H, m, dv), or all three without H. Returns the
    output (B, H, n, dv) in the layout PyTorch's flash op writes (memory (B, n, H, dv); (B,
    n, dv) without H) and, with ``logsumexp``, each row's logsumexp of its scaled scores
    (B, H, n) float32 as that op keeps it (0 for rows of length 0)."""
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = _last_contiguous(q, k, v)
    shape = q.shape
    B, H, n, d = shape if len(shape) == 4 else (shape[0], 1, *shape[1:])  # (B, n, d): one head
    m, dv = k.shape[-2], v.shape[-1]
    out = _by_lengths_output(q, B, H, n, dv)
    lse = torch.empty((B, H, n), dtype=torch.float32) if logsumexp else None
    strides = _int64s((*_strides(q, k, v, out), *by.strides))
    chunks = _by_lengths_chunks(B * H, n)
    head = (
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
        None if lse is None else lse.data_ptr(), by.order.data_ptr(), by.lengths.data_ptr(),
        strides,
    )  # fmt: skip
    kernel = _FLASH_LENGTHS[q.dtype]
    tail = (H, n, m, d, dv, chunks, scale)
    _run_tasks(_lib(), kernel, head, tail, B * H * chunks, B * H * n * m * (d + dv))
    return out, lse


def _by_lengths_output(q: Tensor, B: int, H: int, n: int, dv: int) -> Tensor:
    """The output of :func:`_by_lengths_forward`: (B, n, dv), or with heads the same
    memory as (B, n, H, dv), each allocated in one op (and a view)."""
    if H == 1 and q.ndim == 3:
        return q.new_empty((B, n, dv))
    if H == 1 or n == 1:  # (a decoder step's (B, 1, H, dv) is (B, H, 1, dv) in memory)
        return q.new_empty((B, H, n, dv))
    return q.new_empty((B, n, H, dv)).transpose(1, 2)


def _by_lengths_chunks(pairs: int, n: int) -> int:
    """Tasks per (example, head) of :func:`_by_lengths_forward`: one, or chunks of its
    sorted queries where there are too few pairs for the threads to share."""
    return max(1, min(-(-4 * torch.get_num_threads() // pairs), n // _BY_LENGTHS_CHUNK))


def _by_lengths_runner(
    q: Tensor, k: Tensor, v: Tensor, by: _ByLength, scale: float
) -> Callable[[Tensor, Tensor, Tensor], Tensor] | None:
    """:func:`_by_lengths_forward` without the logsumexps for every call of q, k, v's sizes,
    strides and dtype (a plan's runner: :meth:`ByLengths.prepare`), with what depends only
    on those worked out now: one C call per run. None where the kernels would run on
    Python threads, or a last stride is not 1."""
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return None
    shape = q.shape
    B, H, n, d = shape if len(shape) == 4 else (shape[0], 1, *shape[1:])
    m, dv = k.shape[-2], v.shape[-1]
    chunks = _by_lengths_chunks(B * H, n)
    in_c = _in_c(_lib(), _FLASH_LENGTHS[q.dtype], B * H * chunks, B * H * n * m * (d + dv))
    if in_c is None:
        return None
    fn, middle = in_c
    strides = _int64s((*_strides(q, k, v, _by_lengths_output(q, B, H, n, dv)), *by.strides))
    tail = (H, n, m, d, dv, chunks, scale)

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = _by_lengths_output(q, B, H, n, dv)
        order, lengths = by.order.data_ptr(), by.lengths.data_ptr()  # (keeps `by`)
        fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), None, order, lengths,
           strides, *middle, *tail)  # fmt: skip
        return out

    return run


class _ByLengthsAttention(torch.autograd.Function):
    """Training by lengths in the C kernel, forward (:func:`_by_lengths_forward`, keeping
    each row's logsumexp) and backward (``flash_lengths_backward``, on the forward's tiles,
    one task per (example, head), whose key gradients add up in float32; what the forward
    never reads gets zero gradients): one autograd node that keeps the inputs, the output,
    the logsumexps and the queries' order."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, by: _ByLength, scale: float) -> Tensor:
        out, lse = _by_lengths_forward(q, k, v, by, scale, logsumexp=True)
        ctx.scale, ctx.by = scale, by
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        q, k, v, out, grad = _last_contiguous(q, k, v, out, grad)
        B, H, n, d = q.shape
        m, dv = k.shape[-2], v.shape[-1]
        dq, dk, dv_ = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        by = ctx.by
        st = _int64s((*_strides(q, k, v, out), *by.strides, *_strides(grad, dq, dk, dv_)))
        head = (
            *(t.data_ptr() for t in (q, k, v, out, grad, lse, dq, dk, dv_)),
            by.order.data_ptr(), by.lengths.data_ptr(), st,
        )  # fmt: skip
        tail = (H, n, m, d, dv, ctx.scale)
        kernel = f"flash_lengths_backward_{_BY_LENGTHS_SUFFIX[q.dtype]}"
        _run_tasks(_lib(), kernel, head, tail, B * H, 2 * B * H * n * m * (d + dv))
        return dq, dk, dv_, None, None


# (per CPU measured: mappings CPU -> int, resolved by _measured.verdict; ints in a
# thresholds() block)
_UNPADDED_WORK: Any = value("unpadded_work")
_UNPADDED_HEAD: int = value("unpadded_head")
_UNPADDED_INFERENCE: Any = value("unpadded_inference")
_DECODE_WORK: Any = value("decode_work")
_DECODE_WORK_BF16: Any = value("decode_work_bf16")


def _unpadded_pays(call: AttentionCall, kernel: Implementation) -> str | None:
    """None where the kernel by lengths runs a call with nothing padded (no mask, or causal
    masking alone), else why not: float16 always (SDPA's float16 kernel has no float16
    arithmetic to use on CPUs without it) and projected calls under causal masking (their
    plain pipeline skips nothing); else as measured on this machine
    (:func:`._measured.verdict`; the reason names the measurement). The shipped rule: from
    ``unpadded_inference`` multiply-adds without gradients, from ``unpadded_work`` in
    training with an (example, head) per thread (the backward's tasks), either with a tile
    of queries and heads up to ``unpadded_head``; causal masking from ``unpadded_work`` at
    any shape. Projected calls in bfloat16 keep their plain pipeline (PyTorch's bfloat16
    GEMMs) in training, and in inference where the kernel multiplies bfloat16 in float32
    (no AVX512-BF16: :func:`bf16_dots`); on AVX512-BF16 the kernel measured faster in
    inference (at mid sizes 0.7x-1.0x the plain formulation, against the pipeline's
    1.3x), not in training (``tools/projected_bf16.py``, docs/benchmarks.md). Decoder steps
    (:func:`._measured.decoding`) from ``decode_work`` (``decode_work_bf16``) on."""
    dtype, projected = call.q.dtype, call.project is not None
    if dtype == torch.float16 or (projected and call.kind == "causal"):
        return None
    pairs, n, _, d, dv = call.sizes

    def shipped(work_from: int, inference_from: int) -> bool:
        work = call.work
        if call.kind == "causal" and work >= work_from:
            return True
        if work < inference_from:
            return False
        if projected and dtype == torch.bfloat16 and (call.needs_grad or not bf16_dots()):
            return False
        if n < _FA_ROWS or max(d, dv) > _UNPADDED_HEAD:
            return False
        # (a projected call in training counts: its parameters may)
        return not call.needs_grad or (work >= work_from and pairs >= torch.get_num_threads())

    if _measured.decoding(call):  # the kernel's row path, from its own threshold per dtype
        if max(d, dv) > _UNPADDED_HEAD:
            return f"a decoder step with heads of {max(d, dv)} (unpadded_head)"
        given: tuple[Any, ...] = (_DECODE_WORK_BF16 if dtype == torch.bfloat16 else _DECODE_WORK,)
        runs, source = _measured.verdict(call, kernel, given, lambda w: call.work >= w)
    else:
        given = (_UNPADDED_WORK, _UNPADDED_INFERENCE)
        runs, source = _measured.verdict(call, kernel, given, shipped)
    call.notes["measured"] = source
    if runs:
        return None
    return source if source == _measured.NOT_MEASURED else f"SDPA faster here ({source})"


@functools.cache
def bf16_dots() -> bool:
    """Whether this build's bfloat16 kernels by lengths multiply pairs of bfloat16 on
    AVX512-BF16 (``-march=native`` on a CPU that has it), rather than in float32."""
    return load_library() is not None and bool(_function(_lib(), "fa_bf16_dots")())


def _in_order(mask: AttentionMask) -> bool:
    """Whether each (example, head)'s lengths rise with the query: causal masking with key
    lengths shared by its queries (min(i + 1, L)) and no query lengths (no sort needed)."""
    key_lengths = mask.key_lengths
    return (
        mask.causal
        and mask.query_lengths is None
        and (key_lengths is None or key_lengths.stride(-1) == 0 or key_lengths.shape[-1] == 1)
    )


def _cuts(mask: AttentionMask, lengths: Tensor, n: int, key_len: list[int]) -> list[_Cut]:
    """The loop's pieces, one per example: its longest key length (``key_len``, from
    ``lengths``), its queries up to the last one that attends anything, and what masking is
    left inside (none, causal, or a boolean mask). Examples with nothing to attend have no
    piece."""
    if lengths.shape[2] == 1:
        query_len = [n if L else 0 for L in key_len]
    else:  # up to the last query that attends anything
        steps = torch.arange(1, n + 1, device=lengths.device)
        query_len = ((lengths > 0).any(dim=1) * steps).amax(dim=-1).tolist()
    key_lengths = mask.key_lengths
    structured = key_lengths is not None or mask.causal or mask.query_lengths is not None
    per_example = structured and (key_lengths is None or not any(key_lengths.stride()[1:]))
    causal = per_example and mask.causal
    has_idle = [False] * len(key_len) if per_example else (lengths == 0).any(dim=(1, 2)).tolist()
    cuts = []
    for b, (Lq, Lk) in enumerate(zip(query_len, key_len, strict=True)):
        if Lq == 0 or Lk == 0:
            continue
        rows = None
        if not per_example:  # a mask inside the piece, from its rows' lengths
            rows = (lengths[b, :, :Lq] if lengths.shape[2] > 1 else lengths[b])[None, ..., None]
        cuts.append(_Cut(b, Lq, Lk, causal, rows, has_idle[b]))
    return cuts


# ---- the implementations (attnscore.kernels._select: the CPU's priority list) -------------


def _kernel_declines(call: AttentionCall) -> str | None:
    """Why no kernel of this module takes ``call``, where it is not about the call's sizes:
    kernels disabled, traced code, non-finite inputs (the kernels work on tiles of queries:
    0 x NaN would reach other queries of a tile), a score bias."""
    if not enabled():
        return "kernels disabled (attnscore.kernels.disabled, ATTNSCORE_DISABLE_KERNELS)"
    if call.traced:
        return "traced or transformed (torch.compile, torch.func): no data-dependent Python"
    if not call.finite:
        return "inputs hold NaN or inf"
    if call.bias is not None:
        return "a score bias (SDPA takes it as its float mask)"
    return None


def _lengths_decline(call: AttentionCall) -> str | None:
    """Why lengths give the per-example loops nothing to skip: no lengths, or this torch's
    SDPA not giving zeros for rows with no key (the loops rely on it). (Lengths that cut no
    key never reach them: :meth:`~._select.AttentionCall.drop_uncut_lengths`.)"""
    kind = call.kind
    if kind != "lengths":
        return f"no lengths to skip by (mask: {kind})"
    if not _sdpa.empty_rows_are_zero("cpu"):
        return "this torch's SDPA gives no zeros for rows with no key"
    return None


@functools.lru_cache(maxsize=64)
def _every_key(m: int) -> Tensor:
    """One length m, (1,) int64, for the small pass of a call without a mask (every row
    shares it). Kept: the pass only reads it."""
    return torch.full((1,), m, dtype=torch.int64)


def _small_unmasked(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor | None:
    """:func:`_small_pass` of a call without a mask (q (..., n, d), k, v alike): every row
    over every key."""
    rows = q.numel() // q.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _small_pass(q, k, v, _every_key(k.shape[-2]), max(rows, 1), scale)


@functools.lru_cache(maxsize=64)
def _causal_lengths(rows: int, n: int, m: int) -> Tensor:
    """Causal masking alone as the small pass's lengths, one per row: row r, query r % n
    of its (example, head), attends its first min(r % n + 1, m) keys. Kept per shape: the
    pass only reads it."""
    return (torch.arange(rows, dtype=torch.int64) % n + 1).clamp_(max=m)


def _small_causal(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor | None:
    """:func:`_small_pass` of a call with causal masking alone (q (..., n, d), k, v alike):
    query i over keys 0..i."""
    n, rows = q.shape[-2], q.numel() // q.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _small_pass(q, k, v, _causal_lengths(rows, n, k.shape[-2]), 1, scale)


class SmallPass(Implementation):
    """Small inference calls by lengths, with causal masking alone, or without a mask, in
    one C pass (:func:`_small_pass`): every query over its own keys, padding never read,
    nothing zeroed and no mask built; up to ``small_work`` multiply-adds (where SDPA's fixed
    cost is most of a call). float32 and float64."""

    name = "c_small"
    summary = "one C pass for small inference calls (float32, float64)"
    kinds = frozenset({"none", "causal", "lengths"})

    def supports(self, call: AttentionCall) -> str | None:
        if call.needs_grad or call.dropout_p:  # (first: training calls are decided here)
            return "gradients or dropout (the pass is inference only)"
        if (why := _kernel_declines(call)) is not None:
            return why
        if call.q.dtype not in _SMALL_SUFFIX:
            return f"{call.q.dtype} (float32 and float64 only)"
        if call.work > _SMALL_WORK:
            return f"{call.work} multiply-adds, above small_work ({_SMALL_WORK})"
        if load_library() is None:
            return "the C library is not loaded"
        return None

    def padding_inert(self, call: AttentionCall) -> bool:
        return True  # (padding never read; no gradients either)

    def shows_queries(self, call: AttentionCall) -> bool:
        return True  # (it declines a call whose scores are not finite)

    def prepare(self, call: AttentionCall) -> Runner | None:
        if call.kind == "lengths" or call.project or call.inert:
            return None
        unpadded = _small_unmasked if call.kind == "none" else _small_causal
        return functools.partial(unpadded, scale=call.scale)

    def run(self, call: AttentionCall) -> Tensor | None:
        q, k, v = call.projected()
        if q.dtype not in _SMALL_SUFFIX:  # (under autocast projections change the dtype)
            out = None
        elif call.kind == "none":
            out = _small_unmasked(q, k, v, call.scale)
        elif call.kind == "causal":
            out = _small_causal(q, k, v, call.scale)
        else:  # (B, H, n, ·), lengths (B or 1, H or 1, n or 1)
            B, H, n, _ = q.shape
            shared, div = _shared_lengths(call.lengths.expand(B, H, n))
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            out = _small_pass(q, k, v, shared, div, call.scale)
        if out is None:
            call.notes["declined"] = "some row's scores or output not finite"
        return out


_SDPA_FASTER = "nothing padded, and SDPA measured faster at this size (small_work)"


class ByLengths(Implementation):
    """The C kernel by lengths (:func:`_by_lengths_forward`, :class:`_ByLengthsAttention`),
    forward and backward (:meth:`_ByLength.of` orders the queries by length): every
    query over its own keys only, padded keys and idle queries never read. Lengths from
    ``by_lengths_work`` multiply-adds on; with nothing padded (no mask: every length m;
    causal masking alone: lengths 1, 2, ..., n, which PyTorch's CPU flash kernel skips only
    in blocks of 512) where it measured faster than SDPA (:func:`_unpadded_pays`). float32,
    bfloat16, float16; no dropout."""

    name = "c_by_lengths"
    summary = "the C kernel by lengths, forward and backward (float32, bfloat16, float16)"
    kinds = frozenset({"none", "causal", "lengths"})

    def supports(self, call: AttentionCall) -> str | None:
        work = call.work
        if call.kind != "lengths" and (work < _BY_LENGTHS_WORK or work < _SMALL_WORK):
            return _SDPA_FASTER  # (a constant: most small calls with nothing padded meet it)
        if (why := _kernel_declines(call)) is not None:
            return why
        if call.dropout_p:
            return "dropout (the kernel has none)"
        if call.kind != "lengths":
            return _by_lengths_declines(call.q, call.k, call.v) or _unpadded_pays(call, self)
        if work < _BY_LENGTHS_WORK:
            return f"{work} multiply-adds, below by_lengths_work ({_BY_LENGTHS_WORK})"
        return _by_lengths_declines(call.q, call.k, call.v)

    def padding_inert(self, call: AttentionCall) -> bool:
        return True  # keys beyond an (example, head)'s longest length are never read

    def shows_queries(self, call: AttentionCall) -> bool:
        return True  # NaN and inf stay in the scores of the query, in float32

    def prepare(self, call: AttentionCall) -> Runner | None:
        if call.kind == "lengths" or call.needs_grad or call.project or call.inert:
            return None
        _, n, m, _, _ = call.sizes
        by = _unpadded_by(n, m, call.kind == "causal")
        return _by_lengths_runner(call.q, call.k, call.v, by, call.scale)

    def run(self, call: AttentionCall) -> Tensor | None:
        direct = call.project is None and call.inert is None
        q, k, v = (call.q, call.k, call.v) if direct else call.projected()
        # projections the kernel does not take (autocast's dtypes; supports read the inputs')
        if not (q.dtype == k.dtype == call.q.dtype) and _by_lengths_declines(q, k, v):
            return None
        if call.kind == "lengths":
            ordered = call.mask.causal and _in_order(call.mask)
            by = _ByLength.of(call.lengths, q.shape[-2], ascending=ordered)
            needs_grad = call.needs_grad
        else:
            _, n, m, _, _ = call.sizes  # (projections keep n and m)
            by = _unpadded_by(n, m, call.kind == "causal")
            needs_grad = call.needs_grad and (
                call.project is None or q.requires_grad or k.requires_grad or v.requires_grad
            )
        if not needs_grad:  # forward only, no logsumexps kept
            return _by_lengths_forward(q, k, v, by, call.scale, logsumexp=False)[0]
        if q.ndim == 3:  # the backward takes heads
            out = _ByLengthsAttention.apply(q[:, None], k[:, None], v[:, None], by, call.scale)  # type: ignore[no-untyped-call]
            return out.squeeze(1)  # type: ignore[no-any-return]
        return _ByLengthsAttention.apply(q, k, v, by, call.scale)  # type: ignore[no-any-return,no-untyped-call]


_Plan = tuple[list[_Cut], list[int], int]


def _plan(call: AttentionCall) -> str | _Plan:
    """The per-example loop's pieces for a call by lengths, (cuts, each example's longest
    length, the queries x keys they keep), or why the loops decline it (as the kernels do,
    or cutting saves too little: less than ``call_work`` per example). Worked out once per
    call (both loops read it)."""
    plan = call.notes.get("plan")
    if plan is None:
        plan = call.notes["plan"] = _kernel_declines(call) or _lengths_decline(call) or _cut(call)
    return plan


def _cut(call: AttentionCall) -> str | _Plan:
    q, k, v = call.q, call.k, call.v
    B, H, n, _ = q.shape
    work = H * (k.shape[-1] + v.shape[-1])  # per (example, query, key)
    full = B * n * k.shape[-2]
    if full * work < B * _CALL_WORK:
        return "too little work to cut examples (call_work)"
    longest = call.lengths.amax(dim=(1, 2)).tolist()  # (B,) each example's longest row
    # Without idle queries the loop keeps each example's queries whole: what it would save
    # is known before its pieces are made (per-query lengths near m save too little).
    if call.shortest > 0 and (full - n * sum(longest)) * work < B * _CALL_WORK:
        return "cutting examples to their longest length saves too little (call_work)"
    cuts = _cuts(call.mask, call.lengths, n, longest)
    kept = sum(c.queries * c.keys for c in cuts)
    if (full - kept) * work < B * _CALL_WORK:
        return "cutting examples saves too little (call_work)"
    return cuts, longest, kept


def _grouped(call: AttentionCall, kept: int) -> bool:
    """Whether the loop's backward would need threads of its own that only a large
    backward repays (training, fewer heads than threads, less than ``threads_work``)."""
    H = call.q.shape[1]
    work = H * (call.k.shape[-1] + call.v.shape[-1])
    return call.needs_grad and torch.get_num_threads() > H and kept * work < _THREADS_WORK


def _flash_takes(call: AttentionCall) -> bool:
    """The flash op takes no dropout and one head size for q, k and v."""
    return call.dropout_p == 0.0 and call.q.shape[-1] == call.v.shape[-1]


class CutExamples(Implementation):
    """One PyTorch flash-attention call per example with all its heads, on keys (and
    values) cut to the example's longest length and queries cut after its last query that
    attends anything (:class:`_CutAttention`; with dropout or a value size unlike the
    query size, through SDPA's autograd: :func:`_cut_attention_autograd`). Inside the cut,
    per-example lengths need no mask, lengths with causal masking are ``is_causal``, and
    per-query lengths a mask. Where the kernel by lengths does not run (dropout, float64,
    more keys than it takes) and cutting saves more than a call costs."""

    name = "flash_cut"
    summary = "PyTorch's flash kernel per example, on keys cut to its longest length"
    kinds = frozenset({"lengths"})
    weighs_lengths = True

    def supports(self, call: AttentionCall) -> str | None:
        plan = _plan(call)
        if isinstance(plan, str):
            return plan
        if _grouped(call, plan[2]):
            return "training with fewer heads than threads: its backward would leave threads idle"
        return None

    def padding_inert(self, call: AttentionCall) -> bool:
        # Keys beyond an example's longest length are cut off; inside the cut each key is
        # attended in every head by the longest query, unless lengths differ by head.
        return call.lengths.shape[1] == 1

    def run(self, call: AttentionCall) -> Tensor:
        cuts = call.notes["plan"][0]  # (its supports found them)
        q, k, v = call.projected()
        if _flash_takes(call):
            return _CutAttention.apply(q, k, v, cuts, call.scale)  # type: ignore[no-any-return,no-untyped-call]
        return _cut_attention_autograd(q, k, v, cuts, call.scale, call.dropout_p)


class GroupedExamples(Implementation):
    """Training with fewer heads than threads, where the loop's backward would need threads
    of its own that only a large backward repays: one flash call per group of examples of
    similar length (:class:`_GroupedAttention`), each group on keys cut to its longest."""

    name = "flash_grouped"
    summary = "PyTorch's flash kernel per group of examples of similar length (training)"
    kinds = frozenset({"lengths"})
    weighs_lengths = True

    def supports(self, call: AttentionCall) -> str | None:
        plan = _plan(call)
        if isinstance(plan, str):
            return plan
        if not _grouped(call, plan[2]):
            return "not training with fewer heads than threads"
        if not _flash_takes(call):
            return "dropout, or a value size unlike the query size (the flash op takes neither)"
        q, k, v = call.q, call.k, call.v
        B, H, n, _ = q.shape
        size = -(-torch.get_num_threads() // H)  # examples per group: a thread per head
        groups = call.notes["groups"] = _groups(plan[1], call.lengths, size)
        kept = n * sum(len(g.examples) * g.keys for g in groups)
        work = H * (k.shape[-1] + v.shape[-1])
        if (B * n * k.shape[-2] - kept) * work < len(groups) * _CALL_WORK:
            return "grouping examples saves too little (call_work)"
        return None

    def padding_inert(self, call: AttentionCall) -> bool:
        return True  # looked at and zeroed where not finite (below)

    def run(self, call: AttentionCall) -> Tensor:
        groups = call.notes["groups"]  # (its supports found them)
        q, k, v = call.projected()
        lengths, m = call.lengths, k.shape[-2]
        padded, first = _sdpa.padding_by_lengths(lengths, m, look=True)
        idle = (lengths == 0).unsqueeze(-1) if call.shortest == 0 else None
        inert = _sdpa.inert(q, k, v, padded, idle, look=True, first=first)
        return _GroupedAttention.apply(*inert, groups, call.scale)  # type: ignore[no-any-return,no-untyped-call]
