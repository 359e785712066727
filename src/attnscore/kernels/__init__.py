"""Fast paths for attnscore (GitHub issue 3), self-contained tensor functions.

Each op dispatches to a fused CPU C kernel (or, for dot-product attention, a padding-free
use of PyTorch's flash SDPA) when :func:`available` says so, and otherwise to a plain PyTorch
twin in :mod:`attnscore.kernels._plain` that gives the same results on any device.

Shapes: B batch, n queries, m keys, h hidden, d query/key size, v value size.
Kernels are disabled by ``ATTNSCORE_DISABLE_KERNELS=1`` or :func:`set_enabled`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import cast

import torch
from torch import Tensor

from .._checks import in_transform
from ._build import build_info, load_library
from ._fast import AdditiveScoresC, MaskedSoftmaxC, dot_product_attention_trimmed
from ._plain import (
    additive_scores_plain,
    dot_product_attention_plain,
    masked_softmax_plain,
)

__all__ = [
    "additive_scores",
    "additive_scores_plain",
    "available",
    "build_info",
    "disabled",
    "dot_product_attention",
    "dot_product_attention_plain",
    "dot_product_weights",
    "enabled",
    "load_library",
    "masked_softmax",
    "masked_softmax_plain",
    "set_enabled",
]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_override: bool | None = None
# disabled() is per thread, like torch.no_grad: one thread's plain-path block must not
# switch paths under another thread's call.
_local = threading.local()


def enabled() -> bool:
    """Whether fast paths may be used in this thread.

    :func:`disabled` (this thread) wins over :func:`set_enabled` (process-wide), which wins
    over the ``ATTNSCORE_DISABLE_KERNELS`` environment variable.
    """
    if getattr(_local, "disabled", 0):
        return False
    if _override is not None:
        return _override
    return os.environ.get("ATTNSCORE_DISABLE_KERNELS", "") in ("", "0")


def set_enabled(flag: bool | None) -> None:
    """Force fast paths on (True) or off (False) process-wide; None defers to the
    ``ATTNSCORE_DISABLE_KERNELS`` environment variable."""
    global _override
    _override = flag


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the body on the plain PyTorch paths, in this thread only (nests)."""
    _local.disabled = getattr(_local, "disabled", 0) + 1
    try:
        yield
    finally:
        _local.disabled -= 1


def available(*tensors: Tensor) -> bool:
    """True when the C kernels can take these tensors: enabled, all on CPU, all of a float
    dtype (float16/bfloat16/float32/float64), not being traced or transformed (see
    :func:`attnscore._checks.in_transform`), and the library compiled and loaded."""
    if not enabled() or in_transform(*tensors):
        return False
    for t in tensors:
        if t.device.type != "cpu" or t.dtype not in _FLOATS:
            return False
    return load_library() is not None


def _check_float(name: str, t: object, dim: int | None = None) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"Expected {name} to be a torch.Tensor, but got {type(t).__name__} instead")
    if not t.is_floating_point():
        raise TypeError(f"Expected {name} to be floating point, but got {t.dtype} instead")
    if dim is not None and t.dim() != dim:
        raise ValueError(
            f"Expected {name} to have {dim} dimensions, but got shape {tuple(t.shape)} instead"
        )
    return t


def _check_lens(lens: object, shape: tuple[int, ...], *alternatives: tuple[int, ...]) -> Tensor:
    if not isinstance(lens, Tensor):
        raise TypeError(
            f"Expected lens to be a torch.Tensor, but got {type(lens).__name__} instead"
        )
    if lens.dtype != torch.int64:
        raise TypeError(f"Expected lens of dtype torch.int64, but got {lens.dtype} instead")
    shapes = (shape, *alternatives)
    if tuple(lens.shape) not in shapes:
        want = " or ".join(str(s) for s in shapes)
        raise ValueError(f"Expected lens of shape {want}, but got {tuple(lens.shape)} instead")
    return lens


def masked_softmax(x: Tensor, lens: Tensor) -> Tensor:
    """Softmax over the last axis of ``x`` restricted to its first ``lens`` positions.

    Args:
        x: (..., n, m) floating tensor (float16, bfloat16, float32, float64), contiguous or not.
        lens: int64 of shape ``x.shape[:-1]``, values in [0, m] (validated by the caller;
            out-of-range values are clamped).

    Returns:
        Tensor of x's shape and dtype: the softmax of ``x[..., :L]`` followed by exact zeros;
        rows with L == 0 are all zero with zero gradient. float16/bfloat16 are reduced in
        float32. Values at padded positions (even NaN/inf) are never read.

    Raises:
        TypeError / ValueError for a non-float x, non-int64 lens, or mismatched shapes.

    Source: D2L "Attention Scoring Functions" (masked softmax), fused into one pass per row.
    """
    _check_float("x", x)
    if x.dim() < 1:
        raise ValueError(
            f"Expected x with at least 1 dimension, but got shape {tuple(x.shape)} instead"
        )
    _check_lens(lens, tuple(x.shape[:-1]))
    if available(x) and lens.device.type == "cpu":
        return cast(Tensor, MaskedSoftmaxC.apply(x, lens))  # type: ignore[no-untyped-call]
    return masked_softmax_plain(x, lens)


def additive_scores(qh: Tensor, kh: Tensor, w_v: Tensor, lens: Tensor) -> Tensor:
    """Additive attention scores without a (B, n, m, h) intermediate.

    Args:
        qh: (B, n, h) projected queries, ``W_q q``.
        kh: (B, m, h) projected keys, ``W_k k``.
        w_v: (h,) output weights (``w_v`` of the module, flattened).
        lens: (B, n) int64 in [0, m], the number of valid keys per query row.

    Returns:
        (B, n, m) in qh's dtype: ``scores[b, i, j] = sum_h w_v[h] * tanh(qh[b, i, h] +
        kh[b, j, h])`` for ``j < lens[b, i]`` and exactly 0 elsewhere (whole rows for lens 0).
        Differentiable in qh, kh and w_v; tanh is recomputed in backward. Keys at j >= lens
        are never read, so garbage there changes neither scores nor gradients.

    Raises:
        TypeError / ValueError for non-float inputs, wrong ranks or mismatched shapes.

    Source: D2L "Attention Scoring Functions", additive attention (Bahdanau et al., 2015).
    """
    _check_float("qh", qh, 3)
    _check_float("kh", kh, 3)
    _check_float("w_v", w_v, 1)
    B, n, h = qh.shape
    if kh.shape[0] != B or kh.shape[2] != h or w_v.shape[0] != h:
        raise ValueError(
            f"Expected kh of shape ({B}, m, {h}) and w_v of shape ({h},), but got "
            f"{tuple(kh.shape)} and {tuple(w_v.shape)} instead"
        )
    _check_lens(lens, (B, n))
    if available(qh, kh, w_v) and lens.device.type == "cpu":
        return cast(Tensor, AdditiveScoresC.apply(qh, kh, w_v, lens))  # type: ignore[no-untyped-call]
    return additive_scores_plain(qh, kh, w_v, lens)


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, lens: Tensor) -> None:
    _check_float("q", q, 3)
    _check_float("k", k, 3)
    _check_float("v", v, 3)
    B, n, d = q.shape
    if k.shape[0] != B or k.shape[2] != d or v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"Expected k of shape ({B}, m, {d}) and v of shape ({B}, m, v), but got "
            f"{tuple(k.shape)} and {tuple(v.shape)} instead"
        )
    _check_lens(lens, (B,), (B, n))


def dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, lens: Tensor, *, scale: float, dropout_p: float = 0.0
) -> Tensor:
    """Scaled dot-product attention where padded keys cost nothing.

    Args:
        q: (B, n, d) queries; k: (B, m, d) keys; v: (B, m, v) values; all one float dtype.
        lens: (B,) or (B, n) int64 in [0, m], valid keys per batch element or per query row.
        scale: multiplier of q k^T (usually 1 / sqrt(d)).
        dropout_p: dropout on the attention weights (pass 0.0 outside training).

    Returns:
        (B, n, v) in q's dtype. Rows with length 0 are zeros with zero gradients; keys and
        values at padded positions are never read.

    On CPU (kernels enabled), each batch element runs PyTorch's flash SDPA in 4-D layout on its
    keys trimmed to its length; otherwise bmm + masked softmax + bmm. The (B, n, m) weights are
    not materialised: use :func:`dot_product_weights` when they are needed.

    Source: D2L "Attention Scoring Functions" (Vaswani et al., 2017).
    """
    _check_qkv(q, k, v, lens)
    if enabled() and q.device.type == "cpu" and q.dtype in _FLOATS and not in_transform(q, k, v):
        return dot_product_attention_trimmed(q, k, v, lens, scale=scale, dropout_p=dropout_p)
    return dot_product_attention_plain(q, k, v, lens, scale=scale, dropout_p=dropout_p)


def dot_product_weights(q: Tensor, k: Tensor, lens: Tensor, *, scale: float) -> Tensor:
    """The (B, n, m) attention weights of :func:`dot_product_attention` (before dropout),
    recomputed from what its forward kept: masked_softmax(q k^T * scale, lens), with keys
    beyond each element's longest row zeroed first so garbage there cannot leak in."""
    B, n, m = q.shape[0], q.shape[1], k.shape[1]
    lens2 = lens[:, None].expand(B, n) if lens.dim() == 1 else lens
    keep = torch.arange(m, device=k.device) < lens2.amax(1, keepdim=True)
    k = torch.where(keep[..., None], k, 0.0)
    return masked_softmax(torch.bmm(q, k.transpose(1, 2)) * scale, lens2)
