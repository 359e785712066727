"""Fast paths for attnscore: the one place that picks an implementation.

Three ops, each with one entry point here; the rest of the library calls these and never
tests devices, dtypes or transforms itself:

=========================================== ===================== ================== =====
entry point                                 cpu                   cuda               other
=========================================== ===================== ================== =====
:func:`softmax_by_lengths`                  C kernel (``_cpu``)   Triton (``_cuda``) plain
:func:`additive_scores_by_lengths`          C kernel (``_cpu``)   Triton (``_cuda``) plain
:func:`dot_product_attention_by_lengths`    flash SDPA per batch  SDPA + bool mask   plain
                                            element
=========================================== ===================== ================== =====

The first two are registered ``torch.library`` ops (``attnscore::softmax_by_lengths``,
``attnscore::additive_scores_by_lengths``, each with a backward op), so ``torch.compile``,
``torch.export`` and FakeTensor see them and compiled code keeps the kernels. The backend of
a device type is a module (:data:`attnscore.kernels._dispatch.BACKENDS`); a missing module
or function means the plain PyTorch twin (:mod:`attnscore.kernels._plain`).

The plain twins run instead, as differentiable PyTorch ops, when kernels are disabled
(``ATTNSCORE_DISABLE_KERNELS=1``, :func:`set_enabled`, :func:`disabled`) and inside
``torch.func`` transforms (vmap, grad, ...), which cannot take the registered ops. The
dot-product path is not an op (it loops over batch elements in Python): it runs the plain
twin under ``torch.compile``, tracing, fake tensors and transforms.

Shapes: B batch, n queries, m keys, h hidden units, d query/key size, v value size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check_floating, check_tensor, in_functorch, in_transform
from . import _ops, _plain
from ._build import build_info, load_library
from ._dispatch import (
    backend_function,
    backend_name,
    disabled,
    enabled,
    set_enabled,
    use_backend,
)

__all__ = [
    "additive_scores_by_lengths",
    "available",
    "backend_name",
    "build_info",
    "disabled",
    "dot_product_attention_by_lengths",
    "dot_product_weights_by_lengths",
    "enabled",
    "load_library",
    "set_enabled",
    "softmax_by_lengths",
    "use_backend",
]


@torch.compiler.assume_constant_result  # type: ignore[untyped-decorator]
def _enabled_when_compiling() -> bool:
    # Read once while compiling (dynamo cannot trace thread-local state); a compiled
    # function keeps the choice it was compiled with.
    return enabled()


def _use_ops(*tensors: Tensor) -> bool:
    """Whether the registered ops may run: kernels enabled, not inside torch.func."""
    if torch.compiler.is_compiling():
        return bool(_enabled_when_compiling())
    return enabled() and not any(in_functorch(t) for t in tensors)


def available(*tensors: Tensor) -> bool:
    """True when the C kernels take these tensors: kernels enabled, all on CPU, all of a
    float dtype, outside ``torch.func`` transforms, and the C library compiled and loaded."""
    if not _use_ops(*tensors):
        return False
    if any(t.device.type != "cpu" or not t.is_floating_point() for t in tensors):
        return False
    return load_library() is not None


# ---- input checks (one style: "Expected `name` ..., but got ... instead.") -----------------


def _check_lengths(lengths: object, *shapes: tuple[int, ...], device: torch.device) -> Tensor:
    t = check_tensor(lengths, "lengths")
    if t.dtype != torch.int64:
        raise TypeError(f"Expected `lengths` of dtype torch.int64, but got {t.dtype} instead.")
    if tuple(t.shape) not in shapes:
        want = " or ".join(str(s) for s in shapes)
        raise ValueError(f"Expected `lengths` of shape {want}, but got {tuple(t.shape)} instead.")
    if t.device != device:
        raise ValueError(f"Expected `lengths` on {device}, but got {t.device} instead.")
    return t


def _check_rank(x: Tensor, name: str, ndim: int) -> None:
    if x.ndim != ndim:
        raise ValueError(
            f"Expected `{name}` with {ndim} dimensions, but got shape {tuple(x.shape)} instead."
        )


def _check_like(x: Tensor, name: str, ref: Tensor, ref_name: str) -> None:
    if x.dtype != ref.dtype or x.device != ref.device:
        raise TypeError(
            f"Expected `{name}` of the dtype and device of `{ref_name}` ({ref.dtype}, "
            f"{ref.device}), but got {x.dtype}, {x.device} instead."
        )


# ---- entry points ----------------------------------------------------------------------------


def softmax_by_lengths(x: Tensor, lengths: Tensor) -> Tensor:
    """Softmax over the last axis of ``x`` restricted to its first ``lengths`` positions.

    Args:
        x: (..., m) floating tensor (float16, bfloat16, float32, float64), contiguous or not.
        lengths: int64 of shape ``x.shape[:-1]`` on x's device, values in [0, m] (validated
            by the caller; values above m act as m).

    Returns:
        Tensor of x's shape and dtype: the softmax of ``x[..., :L]`` followed by exact zeros;
        rows with L == 0 are all zero with zero gradient. float16/bfloat16 are reduced in
        float32. Values at padded positions (even NaN/inf) are never read.

    Raises:
        TypeError / ValueError for a non-float x, non-int64 lengths, or mismatched shapes.

    Source: D2L "Attention Scoring Functions" (masked softmax), fused into one pass per row.

    >>> softmax_by_lengths(torch.zeros(2, 3), torch.tensor([2, 0]))
    tensor([[0.5000, 0.5000, 0.0000],
            [0.0000, 0.0000, 0.0000]])
    """
    x = check_floating(x, "x", min_ndim=1)
    lengths = _check_lengths(lengths, tuple(x.shape[:-1]), device=x.device)
    if not _use_ops(x, lengths):
        return _plain.masked_softmax_forward(x, lengths)
    return _ops.softmax_by_lengths(x.contiguous(), lengths.contiguous())  # type: ignore[no-any-return]


def additive_scores_by_lengths(
    qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor | None = None
) -> Tensor:
    """Additive attention scores without a (..., n, m, h) intermediate.

    Args:
        qh: (..., n, h) projected queries, ``W_q q`` (plus any bias).
        kh: (..., m, h) projected keys, ``W_k k``; batch dimensions broadcastable with qh's.
        w_v: (h,) output weights (``w_v`` of the module, flattened); one dtype for all three.
        lengths: int64 (..., n) in [0, m], the number of valid keys per query row; None
            means all m.

    Returns:
        (..., n, m) in qh's dtype: ``scores[..., i, j] = sum_h w_v[h] * tanh(qh[..., i, h] +
        kh[..., j, h])`` for ``j < lengths[..., i]`` and exactly 0 elsewhere. Differentiable
        in qh, kh and w_v (twice: double backward runs the plain formulas); tanh is
        recomputed in backward. Keys at j >= lengths are never read by the kernels.

    Raises:
        TypeError / ValueError for non-float inputs, mixed dtypes, wrong ranks or shapes.

    Source: D2L "Attention Scoring Functions", additive attention (Bahdanau et al., 2015).

    >>> additive_scores_by_lengths(torch.zeros(1, 2, 4), torch.zeros(1, 3, 4), torch.ones(4),
    ...                            torch.tensor([[3, 1]])).shape
    torch.Size([1, 2, 3])
    """
    qh = check_floating(qh, "qh", min_ndim=2)
    kh = check_floating(kh, "kh", min_ndim=2)
    w_v = check_floating(w_v, "w_v", min_ndim=1)
    _check_like(kh, "kh", qh, "qh")
    _check_like(w_v, "w_v", qh, "qh")
    _check_rank(w_v, "w_v", 1)
    *batch, n, h = qh.shape
    m = kh.shape[-2]
    if kh.shape[-1] != h or w_v.shape[0] != h:
        raise ValueError(
            f"Expected `kh` of shape (..., m, {h}) and `w_v` of shape ({h},), but got "
            f"{tuple(kh.shape)} and {tuple(w_v.shape)} instead."
        )
    if lengths is not None:
        lengths = _check_lengths(lengths, (*batch, n), device=qh.device)
    if list(kh.shape[:-2]) != batch or not batch or not _use_ops(qh, kh, w_v):
        return _plain.additive_scores_dense(qh, kh, w_v, lengths)
    rows = 1
    for size in batch:  # explicit: -1 is ambiguous when n or m is 0
        rows *= size
    if lengths is None:
        lengths = torch.full((rows, n), m, dtype=torch.int64, device=qh.device)
    scores = _ops.additive_scores_by_lengths(
        qh.reshape(rows, n, h).contiguous(),
        kh.reshape(rows, m, h).contiguous(),
        w_v.contiguous(),
        lengths.clamp(0, m).reshape(rows, n).contiguous(),
    )
    return scores.reshape(*batch, n, m)  # type: ignore[no-any-return]


def dot_product_attention_by_lengths(
    q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, *, scale: float, dropout_p: float = 0.0
) -> Tensor:
    """Scaled dot-product attention where padded keys cost nothing.

    Args:
        q: (B, n, d) queries; k: (B, m, d) keys; v: (B, m, v) values; all one float dtype.
        lengths: (B,) or (B, n) int64 in [0, m], valid keys per batch element or query row.
        scale: multiplier of q k^T (usually 1 / sqrt(d)).
        dropout_p: dropout on the attention weights (pass 0.0 outside training).

    Returns:
        (B, n, v) in q's dtype. Rows with length 0 are zeros with zero gradients; keys and
        values at padded positions are never read. The (B, n, m) weights are not kept: use
        :func:`dot_product_weights_by_lengths` when they are needed.

    On CPU each batch element runs PyTorch's flash SDPA on its keys trimmed to its length;
    on other devices, and under ``torch.compile``, tracing, fake tensors and ``torch.func``
    transforms, the plain twin (bmm + masked softmax + bmm) runs.

    Source: D2L "Attention Scoring Functions" (Vaswani et al., 2017).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_rank(check_floating(t, name), name, 3)
    _check_like(k, "k", q, "q")
    _check_like(v, "v", q, "q")
    B, n, d = q.shape
    if k.shape[0] != B or k.shape[2] != d or v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"Expected `k` of shape ({B}, m, {d}) and `v` of shape ({B}, m, v), but got "
            f"{tuple(k.shape)} and {tuple(v.shape)} instead."
        )
    lengths = _check_lengths(lengths, (B,), (B, n), device=q.device)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if enabled() and not in_transform(q, k, v):
        fn = backend_function(q.device.type, "dot_product_attention")
        return fn(q, k, v, lengths, scale=scale, dropout_p=dropout_p)  # type: ignore[no-any-return]
    # Traced or transformed: PyTorch ops around the registered softmax op where it may run.
    softmax = softmax_by_lengths if _use_ops(q, k, v) else _plain.masked_softmax_forward
    return _plain.dot_product_attention(
        q, k, v, lengths, scale=scale, dropout_p=dropout_p, softmax=softmax
    )


def dot_product_weights_by_lengths(
    q: Tensor, k: Tensor, lengths: Tensor, *, scale: float
) -> Tensor:
    """The (B, n, m) attention weights of :func:`dot_product_attention_by_lengths` (before
    dropout), recomputed: softmax_by_lengths(q k^T * scale, lengths), with keys beyond each
    element's longest row zeroed first so garbage there cannot leak in."""
    B, n, m = q.shape[0], q.shape[1], k.shape[1]
    per_query = lengths[:, None].expand(B, n) if lengths.dim() == 1 else lengths
    keep = torch.arange(m, device=k.device) < per_query.amax(1, keepdim=True)
    k = torch.where(keep[..., None], k, 0.0)
    return softmax_by_lengths(torch.bmm(q, k.transpose(1, 2)) * scale, per_query)
