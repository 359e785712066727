"""The CUDA backend of the kernels (GitHub issue 10): Triton kernels and SDPA with a mask.

Importing this module imports ``triton``; :mod:`attnscore` itself never does. The functions
are plain tensor functions implementing the backend contract
(:class:`~attnscore.kernels._dispatch.Backend`); the op registration and the dispatch
around them live in :mod:`attnscore.kernels`.

Shapes: B batch, n queries, m keys, h hidden units, d query/key size, dv value size.
Devices: CUDA tensors; CPU tensors only under ``TRITON_INTERPRET=1`` (Triton's interpreter,
used by the test suite). Dtypes: float16, bfloat16, float32, float64 (16-bit reduced in
float32). The kernels are described in :mod:`._triton_softmax` (masked softmax) and
:mod:`._triton_additive` (additive scores); their timings on hardware and compile report
are in docs/benchmarks.md.

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

The hardware instruction exists only on CUDA: under the interpreter ``exact`` always runs.

**Softmax by a boolean mask** and **mask summaries**: the plain backend's (PyTorch ops).

**Dot-product attention** is not a backend function: the CUDA priority list
(:data:`attnscore.kernels._select.PRIORITY`) runs flash attention's variable-length kernel
by lengths where it measured faster (:class:`attnscore.kernels._varlen.FlashVarlen`), else
SDPA (:class:`attnscore.kernels._sdpa.Sdpa`).
"""

from __future__ import annotations

import os

from torch import Tensor

# A private module without __all__: its names are the backend contract (_dispatch.Backend,
# checked by mypy), ten of them the plain backend's, re-exported as they are.
from . import _triton_softmax
from ._plain import all_finite as all_finite
from ._plain import lengths_mask as lengths_mask
from ._plain import mask_summary as mask_summary
from ._plain import masked_softmax_dense as masked_softmax_dense
from ._plain import matmul as matmul
from ._plain import small_additive_attention as small_additive_attention
from ._plain import small_dot_product_attention as small_dot_product_attention
from ._plain import small_masked_softmax as small_masked_softmax
from ._plain import softmax_pays as softmax_pays
from ._triton_additive import additive_bwd, additive_fwd
from ._triton_launch import hardware_tanh as uses_hardware_tanh
from ._triton_launch import interpreting

_TANH_MODES = ("auto", "exact", "approx")


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


def _approx(*tensors: Tensor) -> bool:
    """Whether to use the hardware tanh for these tensors (CUDA only, not interpreted)."""
    mode = tanh_mode()
    if interpreting() or any(t.device.type != "cuda" for t in tensors):
        return False
    return uses_hardware_tanh(*(t.dtype for t in tensors), mode=mode)


def masked_softmax(x: Tensor, lengths: Tensor) -> Tensor:
    """Backend contract (Triton): one pass per row; positions >= L are never used (at most
    the rest of the 16-byte vector holding position L - 1 is read); lengths outside [0, m]
    are clamped."""
    return _triton_softmax.masked_softmax(x.contiguous(), lengths.contiguous())


def masked_softmax_backward(grad_y: Tensor, y: Tensor, lengths: Tensor) -> Tensor:
    """Backend contract (Triton): ``grad_y`` is used only below the lengths."""
    g = grad_y.to(y.dtype).contiguous()
    return _triton_softmax.masked_softmax_backward(g, y.contiguous(), lengths.contiguous())


def additive_scores(qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor) -> Tensor:
    """Backend contract (Triton), without a (B, n, m, h) tensor: keys beyond the longest
    length of each query block (32 to 64 queries) and queries of length 0 are never read;
    garbage in keys another row may read cannot reach a row's scores. tanh per
    :func:`tanh_mode`.

    Raises:
        ValueError: a bad ``ATTNSCORE_TANH``.
    """
    qh, kh, w_v = qh.contiguous(), kh.contiguous(), w_v.contiguous()
    return additive_fwd(qh, kh, w_v, lengths.contiguous(), approx=_approx(qh, kh, w_v))


def additive_scores_backward(
    grad_scores: Tensor, qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Backend contract (Triton), tanh recomputed, deterministic run to run; ``grad_scores``
    read only below the lengths. No (B, n, m, h) tensor: the extra memory is the partial
    sums of each (BI, BJ) tile, B h (n ceil(m / BJ) + m ceil(n / BI)) floats plus transposed
    copies of qh and kh (BI, BJ from 32 to 128, chosen per shape).

    Raises:
        ValueError: as :func:`additive_scores`.
    """
    qh, kh, w_v = qh.contiguous(), kh.contiguous(), w_v.contiguous()
    g = grad_scores.contiguous()
    return additive_bwd(g, qh, kh, w_v, lengths.contiguous(), approx=_approx(qh, kh, w_v))
