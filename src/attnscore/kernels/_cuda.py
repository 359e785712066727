"""The CUDA backend of the kernels (GitHub issue 10): Triton kernels and SDPA with a mask.

Importing this module imports ``triton``; :mod:`attnscore` itself never does. The functions
are plain tensor functions (no autograd Function, except that
none); the op registration and the dispatch around them live in :mod:`attnscore.kernels`.

Shapes: B batch, n queries, m keys, h hidden units, d query/key size, dv value size.
Devices: CUDA tensors; CPU tensors only under ``TRITON_INTERPRET=1`` (Triton's interpreter,
used by the test suite). Dtypes: float16, bfloat16, float32, float64 (16-bit reduced in
float32). :func:`supports` says whether a set of tensors can be taken.

**Masked softmax** (``_triton_softmax``): one program per row (short rows packed several
to a program); the row's valid part is loaded once when m <= 8192 (4096 in float64), else
an online-softmax pass over the valid column blocks and a writing pass. Loads are 16-byte
vectors when m allows (the bound rounded up to the vector width, the tail dropped with
``tl.where``); padded entries are never used. Issue 10 measured a first-try kernel of
this kind at 0.79x (fp32) / 0.69x (bf16) of unmasked ``torch.softmax`` at
(64, 256, 1024) on an H100; this one is not yet measured.

**Additive scores** (``_triton_additive``): (query block x key block) tiles, autotuned
among a few sizes; the forward walks h one unit at a time over a tile held in registers
(inputs pre-transposed to (B, h, n) and (B, h, m), no exchange between lanes). The
backward uses the same tiling: each tile recomputes tanh once per (i, j, h) and writes
partial sums of grad_qh, grad_kh and grad_w_v, which ``torch.sum`` adds up:
deterministic, no atomics, nothing of size B*n*m*h.

**Compile-time evidence** (no GPU has run these kernels): ``python
tools/triton_aot.py --markdown`` compiles every kernel for sm_80 and sm_90 at the
launch configurations of the benchmark shapes and prints registers, spills, shared memory,
grid sizes and PTX facts; ``tests/kernels/test_triton_aot.py`` asserts them (docs/benchmarks.md).

**tanh mode** (``ATTNSCORE_TANH``, read on every call; :func:`tanh_mode`):

* ``auto`` (default): the hardware ``tanh.approx.f32`` when every input is float16 or
  bfloat16, ``exact`` otherwise (float32, float64, mixed with those).
* ``exact``: tanh|x| = (1 - e) / (1 + e), e = exp(-2|x|), with a Taylor series for
  |x| < 1/8. Max relative error of tanh measured under the interpreter: 5.5e-7 in float32,
  5e-14 in float64; stable for any |x|.
* ``approx``: the hardware tanh for float32 too (never for float64). Its documented
  maximum relative error is about 2^-11 per call: below the rounding of float16 (2^-11
  relative) and bfloat16 (2^-8) outputs, but far above float32's, hence not the float32
  default. Its effect on scores, emulated on the CPU, is in docs/benchmarks.md.
  On the H100 of issue 10 it was 2.8x faster (0.050 vs 0.139 ms, B=8 n=128 m=512
  h=128).

The hardware instruction exists only on CUDA: under the interpreter ``exact`` always runs.

**Softmax by a boolean mask** and **mask summaries**: the plain backend's (PyTorch ops).

**Dot-product attention** is not a backend function: the CUDA priority list
(:data:`attnscore.kernels._select.PRIORITY`) runs flash attention's variable-length kernel
by lengths where it measured faster (:class:`attnscore.kernels._varlen.FlashVarlen`), else
SDPA (:class:`attnscore.kernels._sdpa.Sdpa`); the measurements are in docs/benchmarks.md.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

# A private module without __all__: its names are the backend contract (_dispatch.Backend,
# checked by mypy), nine of them the plain backend's, re-exported as they are.
from . import _triton_softmax
from ._plain import all_finite as all_finite
from ._plain import finite_copies as finite_copies
from ._plain import lengths_mask as lengths_mask
from ._plain import mask_summary as mask_summary
from ._plain import masked_softmax_dense as masked_softmax_dense
from ._plain import matmul as matmul
from ._plain import small_additive_attention as small_additive_attention
from ._plain import small_dot_product_attention as small_dot_product_attention
from ._plain import small_masked_softmax as small_masked_softmax
from ._plain import softmax_pays as softmax_pays
from ._triton_additive import additive_bwd, additive_fwd
from ._triton_launch import hardware_tanh

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TANH_MODES = ("auto", "exact", "approx")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def supports(*tensors: Tensor) -> bool:
    """True when the Triton kernels can take these tensors: all of a float dtype (float16,
    bfloat16, float32, float64), all on one CUDA device, or all on CPU while
    ``TRITON_INTERPRET=1`` was set before triton was imported."""
    if not tensors:
        return False
    device = tensors[0].device
    if device.type != "cuda" and not (device.type == "cpu" and _interpreting()):
        return False
    return all(t.device == device and t.dtype in _FLOATS for t in tensors)


def tanh_mode() -> str:
    """The tanh of the additive kernels, from ``ATTNSCORE_TANH``: ``"auto"`` (default:
    hardware tanh for float16/bfloat16 inputs, exact otherwise), ``"exact"`` or ``"approx"``
    (hardware tanh.approx.f32 for float32 too); see the module docstring.

    Raises:
        ValueError: ``ATTNSCORE_TANH`` is set to anything else.
    """
    mode = os.environ.get("ATTNSCORE_TANH", "").strip().lower() or "auto"
    if mode not in _TANH_MODES:
        raise ValueError(
            "Expected ATTNSCORE_TANH to be 'auto', 'exact' or 'approx', but got "
            f"{os.environ['ATTNSCORE_TANH']!r} instead"
        )
    return mode


def uses_hardware_tanh(*dtypes: torch.dtype, mode: str) -> bool:
    """Whether additive kernels on CUDA inputs of these dtypes use ``tanh.approx.f32`` in
    tanh ``mode`` (``"auto"``, ``"exact"`` or ``"approx"``; see :func:`tanh_mode`): in
    ``auto`` only when every dtype is float16 or bfloat16; never with float64."""
    return hardware_tanh(*dtypes, mode=mode)


def _approx(*tensors: Tensor) -> bool:
    """Whether to use the hardware tanh for these tensors (CUDA only, not interpreted)."""
    mode = tanh_mode()
    if _interpreting() or any(t.device.type != "cuda" for t in tensors):
        return False
    return uses_hardware_tanh(*(t.dtype for t in tensors), mode=mode)


def masked_softmax(x: Tensor, lengths: Tensor) -> Tensor:
    """Backend contract: softmax over the last axis of ``x`` restricted to its first
    ``lengths`` positions (inputs as the contract says: checked by the caller).

    Args:
        x: (..., m) float16/bfloat16/float32/float64 (made contiguous if it is not).
        lengths: int64 of shape ``x.shape[:-1]``, values in [0, m] (others are clamped).

    Returns:
        Tensor of x's shape and dtype: softmax of ``x[..., :L]``, then exact zeros; rows
        with L == 0 are all zeros. 16-bit inputs are reduced in float32. Positions >= L are
        never used (at most the rest of the 16-byte vector holding position L - 1 is
        read), so NaN there changes nothing.

    Source: D2L "Attention Scoring Functions" (masked softmax), one pass per row.
    """
    return _triton_softmax.masked_softmax(x.contiguous(), lengths.contiguous())


def masked_softmax_backward(grad_y: Tensor, y: Tensor, lengths: Tensor) -> Tensor:
    """Backend contract: the gradient of :func:`masked_softmax` with respect to x.

    Args:
        grad_y: (..., m) gradient of the output; used only below the lengths.
        y: (..., m) the forward's output, same dtype.
        lengths: int64 of shape ``y.shape[:-1]``.

    Returns:
        grad_x of y's shape and dtype: ``y * (grad_y - sum_{j<L} grad_y_j y_j)`` below L,
        exact zeros at and beyond L and on rows with L == 0; 16-bit reduced in float32.
    """
    g = grad_y.to(y.dtype).contiguous()
    return _triton_softmax.masked_softmax_backward(g, y.contiguous(), lengths.contiguous())


def additive_scores(qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor) -> Tensor:
    """Backend contract: additive scores ``sum_h w_v[h] tanh(qh[b, i, h] + kh[b, j, h])``
    without a (B, n, m, h) tensor (inputs checked by the caller).

    Args:
        qh: (B, n, h) projected queries ``W_q q``.
        kh: (B, m, h) projected keys ``W_k k``.
        w_v: (h,) output weights.
        lengths: (B, n) int64 in [0, m], valid keys per query row.

    Returns:
        scores (B, n, m) in qh's dtype, exact 0 for j >= lengths[b, i] (whole rows for
        length 0). Keys beyond the longest length of each query block (32 to 64 queries)
        and queries of length 0 are never read; garbage in keys another row may read
        cannot reach a row's scores. tanh per :func:`tanh_mode`.

    Raises:
        ValueError: a bad ``ATTNSCORE_TANH``.

    Source: Bahdanau et al., 2015, eq. (6); D2L "Attention Scoring Functions", additive.
    """
    qh, kh, w_v = qh.contiguous(), kh.contiguous(), w_v.contiguous()
    return additive_fwd(qh, kh, w_v, lengths.contiguous(), approx=_approx(qh, kh, w_v))


def additive_scores_backward(
    grad_scores: Tensor, qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Backend contract: the gradients of :func:`additive_scores`, tanh recomputed.

    Args:
        grad_scores: (B, n, m) gradient of the scores; read only below the lengths.
        qh, kh, w_v, lengths: the forward's inputs.

    Returns:
        (grad_qh (B, n, h), grad_kh (B, m, h), grad_w_v (h,)) in the dtypes of qh, kh, w_v;
        reduced in float32 (float64 for float64 inputs); deterministic run to run. No
        (B, n, m, h) tensor: the extra memory is the partial sums of each (BI, BJ) tile,
        B h (n ceil(m / BJ) + m ceil(n / BI)) floats plus transposed copies of qh and kh
        (BI, BJ from 32 to 128, chosen per shape; 96 MiB at B=4 n=m=1024 h=256).

    Raises:
        ValueError: as :func:`additive_scores`.
    """
    qh, kh, w_v = qh.contiguous(), kh.contiguous(), w_v.contiguous()
    g = grad_scores.contiguous()
    return additive_bwd(g, qh, kh, w_v, lengths.contiguous(), approx=_approx(qh, kh, w_v))
