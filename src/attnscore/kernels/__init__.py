"""Fast paths for attnscore: the one place that picks an implementation.

Three ops; the rest of the library calls them and never tests devices, dtypes or
transforms itself:

=========================================== ===================== ================== =====
entry point                                 cpu                   cuda               other
=========================================== ===================== ================== =====
:func:`masked_softmax`                      C kernel (``_cpu``)   Triton (``_cuda``) plain
:func:`additive_scores`                     C kernel (``_cpu``)   Triton (``_cuda``) plain
:func:`dot_product_attention`               the priority list of  flash varlen, SDPA SDPA
                                            :data:`PRIORITY` (C
                                            kernels, flash loop,
                                            SDPA)
=========================================== ===================== ================== =====

The first two are registered ``torch.library`` ops as well (``attnscore::masked_softmax``,
``attnscore::additive_scores``, each with a backward op), which ``torch.compile`` and
FakeTensor see, so compiled code keeps the kernels (exported code does not: see below);
eager calls reach
the same backend functions through an ``autograd.Function`` (:mod:`._ops`). The backend of
a device type is a module (:data:`attnscore.kernels._dispatch.BACKENDS`, contract
:class:`~attnscore.kernels._dispatch.Backend`); a missing module or function means the plain
PyTorch twin (:mod:`attnscore.kernels._plain`). Dot-product attention runs on the first
implementation of the device's priority list that takes the call (:mod:`._select`:
:func:`use` restricts them, :func:`explain` says which ran); where nothing can be skipped,
that is PyTorch's ``scaled_dot_product_attention``, unless this machine measured ours
faster (:mod:`._measured`: ``attnscore tune``, :func:`tuned`, :data:`benchmark`). The names:

- ``c_small``: one C pass for small inference calls, by lengths, with causal masking alone
  or without a mask (float32, float64);
- ``c_by_lengths``: the C kernel by lengths, forward and backward (float32, bfloat16, float16);
- ``flash_cut``: PyTorch's flash kernel per example, on keys cut to its longest length;
- ``flash_grouped``: the same per group of examples of similar length (training);
- ``flash_varlen`` (CUDA): flash attention's variable-length kernel, padded keys never read;
- ``sdpa``: PyTorch's scaled_dot_product_attention, padding zeroed, empty rows zeros;
- ``plain``: the textbook formulation; carries NaN and inf exactly.

The plain twins run instead, as differentiable PyTorch ops, when kernels are disabled
(``ATTNSCORE_DISABLE_KERNELS=1``, :func:`set_enabled`, :func:`disabled`) and inside
``torch.func`` transforms (vmap, grad, ...), which cannot take the registered ops. While
``torch.export`` traces (``torch.export.export``, ``torch.onnx.export(..., dynamo=True)``;
:func:`~._dispatch.exporting`), every op runs its plain formulation in one block and the
fused dot-product path declines (:func:`._attention.declines`): an exported program holds
plain PyTorch operators only, which every exporter translates, at every size its dynamic
dimensions allow, and runs without attnscore.

Which implementation runs also depends on sizes: every size and work threshold that decides
it is one entry of :data:`THRESHOLDS` (value, what it decides, why, the machine and bench
row behind it). Tests steer the choice with :func:`thresholds` (e.g. ``with
thresholds(small_work=-1):`` keeps every call off the small path), with :func:`disabled`
(the plain twins) and :func:`use_backend`, never by patching private names.

The functions here check their arguments; the library's own layers, which check once at
their public entry, call the unchecked forms in :mod:`._ops` and :mod:`._attention`.

Shapes: B batch, H heads, n queries, m keys, h hidden units, d query/key size, v value size.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from .._checks import check_floating, check_tensor, in_functorch
from .._mask import AttentionMask
from .._thresholds import THRESHOLDS, Threshold, thresholds
from . import _attention, _ops, _plain
from ._build import build_info, load_library, python_threads
from ._dispatch import (
    Backend,
    backend_name,
    disabled,
    enabled,
    exporting,
    set_enabled,
    use_backend,
)
from ._measured import tuned
from ._select import (
    PIPELINE,
    PRIORITY,
    Choice,
    Explanation,
    Implementation,
    NoImplementationError,
    explain,
    explaining,
    implementations,
    use,
)

__all__ = [
    "PIPELINE",
    "PRIORITY",
    "THRESHOLDS",
    "Backend",
    "Choice",
    "Explanation",
    "Implementation",
    "NoImplementationError",
    "Threshold",
    "additive_scores",
    "available",
    "backend_name",
    "benchmark",
    "build_info",
    "disabled",
    "dot_product_attention",
    "enabled",
    "explain",
    "explaining",
    "implementations",
    "load_library",
    "masked_softmax",
    "python_threads",
    "set_enabled",
    "thresholds",
    "tuned",
    "use",
    "use_backend",
]

#: Measure on first call (``ATTNSCORE_BENCHMARK=1`` sets it): a dense CPU call that no
#: ``thresholds`` block decides times the C kernel and SDPA on its own inputs, once per
#: bucket (:func:`._measured.bucket`), and the faster runs that bucket for the process.
benchmark: bool = os.environ.get("ATTNSCORE_BENCHMARK", "") not in ("", "0")


def available(*tensors: Tensor) -> bool:
    """True when the C kernels take these tensors: kernels enabled, all on CPU, all of a
    float dtype, outside ``torch.func`` transforms, and the C library compiled and loaded."""
    if not enabled() or any(in_functorch(t) for t in tensors):
        return False
    if any(t.device.type != "cpu" or not t.is_floating_point() for t in tensors):
        return False
    return load_library() is not None


# ---- input checks (one style: "Expected `name` ..., but got ... instead.") -----------------


def _check_int64_lengths(lengths: object, *shapes: tuple[int, ...], device: torch.device) -> Tensor:
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


def masked_softmax(x: Tensor, lengths: Tensor) -> Tensor:
    """Softmax over the last axis of ``x`` restricted to its first ``lengths`` positions.

    Args:
        x: (..., m) floating tensor (float16, bfloat16, float32, float64), contiguous or not.
        lengths: int64 of shape ``x.shape[:-1]`` on x's device, values in [0, m] (values
            above m act as m).

    Returns:
        Tensor of x's shape and dtype: the softmax of ``x[..., :L]`` followed by exact zeros;
        rows with L == 0 are all zero with zero gradient. float16/bfloat16 are reduced in
        float32. Values at padded positions (even NaN/inf) are never read.

    Raises:
        TypeError / ValueError for a non-float x, non-int64 lengths, or mismatched shapes.

    Source: D2L "Attention Scoring Functions" (masked softmax), fused into one pass per row.

    >>> masked_softmax(torch.zeros(2, 3), torch.tensor([2, 0]))
    tensor([[0.5000, 0.5000, 0.0000],
            [0.0000, 0.0000, 0.0000]])
    """
    x = check_floating(x, "x", min_ndim=1)
    lengths = _check_int64_lengths(lengths, tuple(x.shape[:-1]), device=x.device)
    return _ops.masked_softmax(x, lengths.clamp(min=0))


def additive_scores(qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor | None = None) -> Tensor:
    """Additive attention scores without a (..., n, m, h) intermediate.

    Args:
        qh: (..., n, h) projected queries, ``W_q q`` (plus any bias).
        kh: (..., m, h) projected keys, ``W_k k``; batch dimensions broadcastable with qh's.
        w_v: (h,) output weights (``w_v`` of the module, flattened); one dtype for all three.
        lengths: int64 (..., n) in [0, m], the number of valid keys per query row; None
            means all m.

    Returns:
        (..., n, m) in qh's dtype: ``scores[..., i, j] = sum_h w_v[h] * tanh(qh[..., i, h] +
        kh[..., j, h])`` for ``j < lengths[..., i]`` and exactly 0 elsewhere, computed in
        float32 for 16-bit inputs. Differentiable in qh, kh and w_v (twice: double backward
        runs the plain formulas); tanh is recomputed in backward. Keys at j >= lengths are
        never read by the kernels.

    Raises:
        TypeError / ValueError for non-float inputs, mixed dtypes, wrong ranks or shapes.

    Source: D2L "Attention Scoring Functions", additive attention (Bahdanau et al., 2015).

    >>> additive_scores(torch.zeros(1, 2, 4), torch.zeros(1, 3, 4), torch.ones(4),
    ...                 torch.tensor([[3, 1]])).shape
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
        lengths = _check_int64_lengths(lengths, (*batch, n), device=qh.device)
    if exporting():  # one block of plain operators (any batch dimensions, broadcast too)
        return _plain.additive_scores_whole(qh, kh, w_v, lengths)
    if list(kh.shape[:-2]) != batch or not batch:
        return _plain.additive_scores_dense(qh, kh, w_v, lengths)
    rows = 1
    for size in batch:  # explicit: -1 is ambiguous when n or m is 0
        rows *= size
    if lengths is None:
        lengths = torch.full((rows, n), m, dtype=torch.int64, device=qh.device)
    scores = _ops.additive_scores(
        qh.reshape(rows, n, h).contiguous(),
        kh.reshape(rows, m, h).contiguous(),
        w_v.contiguous(),
        lengths.clamp(0, m).reshape(rows, n).contiguous(),
    )
    return scores.reshape(*batch, n, m)


def dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: AttentionMask,
    *,
    scale: float,
    dropout_p: float = 0.0,
) -> Tensor:
    """Dot-product attention ``softmax(q kᵀ · scale) v`` where nothing is computed twice and
    padded keys cost nothing.

    Args:
        q: (..., n, d) queries; k: (..., m, d) keys; v: (..., m, dv) values; one float dtype
            and device, the same leading dimensions (checked by the caller, e.g.
            :func:`attnscore.dot_product_attention`).
        mask: an :class:`AttentionMask` built by :func:`attnscore.masking.build_mask` for
            these shapes (its checks are the only ones).
        scale: multiplier of q kᵀ (usually 1 / sqrt(d)).
        dropout_p: dropout on the attention weights (pass 0.0 outside training).

    Returns:
        (..., n, dv) in q's dtype, differentiable through PyTorch ops. Rows with no key are
        zeros with zero gradients; padding (keys no query may attend, idle queries) is never
        read or is zeroed first. No (..., n, m) weights are kept: the plain pipeline
        recomputes them when they are asked for.

    Which kernel runs: the first implementation of the device's :data:`PRIORITY` list that
    takes the call (PyTorch's SDPA wherever nothing can be skipped; on the CPU the C kernel
    by lengths, or one flash call per example on keys cut to its length);
    :func:`explain` says which.

    Source: Vaswani et al. 2017, eq. (1); D2L "Attention Scoring Functions".
    """
    if not isinstance(mask, AttentionMask):
        raise TypeError(
            f"Expected `mask` to be an AttentionMask (from build_mask), but got "
            f"{type(mask).__name__} instead."
        )
    return _attention.dot_product_attention(q, k, v, mask, scale=scale, dropout_p=dropout_p)
