"""The two kernel ops, masked softmax and additive scores: how each call reaches a backend.

Each op has one name through the layers (``masked_softmax``: this module's function, the
registered op ``attnscore::masked_softmax``, the backend function, the C kernel
``masked_softmax_<dtype>``; likewise ``additive_scores``), and three ways to run:

=================================================== ========================================
context                                             runs
=================================================== ========================================
eager code, kernels enabled                         the device's backend, through an
                                                    ``autograd.Function`` (or directly when
                                                    no gradient is needed): a few
                                                    microseconds per call
``torch.compile``, ``torch.jit`` tracing, fake      the registered ``torch.library`` op (same
tensors                                             backend functions), so graphs keep it
``torch.export`` (and ``torch.onnx.export``, which  the plain formulation in PyTorch
runs it)                                            operators, in one block: an exported
                                                    program runs without attnscore, at
                                                    every size, in any exporter's runtime
``torch.func`` transforms, kernels disabled         the plain backend's differentiable twin
=================================================== ========================================

The registered ops have fake implementations (shapes only) and a registered autograd
formula whose backward is an op of its own, so compiled backward passes keep the kernels
too. Double backward: a backward run with ``create_graph=True`` computes with the plain
backend's differentiable formulas instead, so the gradient of the gradient is exact.

Callers pass checked inputs (the public entry points in :mod:`attnscore.kernels` and the
library's own layers check once): ``lengths`` int64 of the documented shape, on the input's
device, values in [0, m].
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._checks import constant_when_compiling, fake_tensor_type, in_functorch
from . import _plain
from ._dispatch import backend_for, enabled, exporting


@constant_when_compiling
def _enabled_when_compiling() -> bool:
    # Read once while compiling (dynamo cannot trace thread-local state); a compiled
    # function keeps the choice it was compiled with.
    return enabled()


def _graph_capture() -> bool:
    """True while torch.compile / export or jit tracing captures a graph."""
    return torch.compiler.is_compiling() or bool(
        torch.jit.is_tracing()  # type: ignore[attr-defined,no-untyped-call]
    )


def _fresh(out: Tensor, *inputs: Tensor) -> Tensor:
    """Custom ops may not return an input (or a view of one): copy in that rare case."""
    for t in inputs:
        if out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() and t.numel():
            return out.clone()
    return out


def _needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _is_fake(t: Tensor) -> bool:
    """A FakeTensor (torch.export's and torch.compile's shape propagation)."""
    return type(t) is not Tensor and isinstance(t, fake_tensor_type())


# ---- masked softmax ------------------------------------------------------------------------


def masked_softmax(x: Tensor, lengths: Tensor) -> Tensor:
    """The backend contract's ``masked_softmax``, dispatched as the table above says."""
    if _graph_capture():
        if exporting() or (torch.compiler.is_compiling() and not _enabled_when_compiling()):
            return _plain.masked_softmax(x, lengths)
        return masked_softmax_op(x.contiguous(), lengths.contiguous())  # type: ignore[no-any-return]
    if not enabled() or in_functorch(x):
        return _plain.masked_softmax(x, lengths)
    if _is_fake(x):
        return masked_softmax_op(x.contiguous(), lengths.contiguous())  # type: ignore[no-any-return]
    if _needs_grad(x):
        return _MaskedSoftmax.apply(x, lengths)  # type: ignore[no-any-return,no-untyped-call]
    return backend_for(x, "masked_softmax")(x, lengths)  # type: ignore[no-any-return]


def softmax(x: Tensor) -> Tensor:
    """``torch.softmax(x, dim=-1)``, or in eager code the device's masked softmax with every
    length m where it measured faster (the backend contract's ``softmax_pays``; on the CPU
    from a size on), with PyTorch's softmax backward in training. 16-bit inputs are reduced
    in float32 either way."""
    if _graph_capture() or not enabled():
        return torch.softmax(x, dim=-1)
    training = torch.is_grad_enabled() and x.requires_grad
    # The backend's verdict (shape and dtype alone) first: on most calls it declines, and
    # the transform checks after it are then not paid for.
    if not backend_for(x, "softmax_pays")(x, training) or in_functorch(x) or _is_fake(x):
        return torch.softmax(x, dim=-1)
    if training:
        return _Softmax.apply(x)  # type: ignore[no-any-return,no-untyped-call]
    return _every_key_softmax(x)


def _every_key(x: Tensor) -> Tensor:
    """Lengths x.shape[:-1] that are all m = x.shape[-1] (an expanded scalar, not
    materialised): a masked softmax by them is the plain softmax."""
    return torch.full((), x.shape[-1], dtype=torch.int64, device=x.device).expand(x.shape[:-1])


def _every_key_softmax(x: Tensor) -> Tensor:
    """The backend's masked softmax of x with every length m."""
    return backend_for(x, "masked_softmax")(x, _every_key(x))  # type: ignore[no-any-return]


class _Softmax(torch.autograd.Function):
    """A softmax without a mask on the device's backend, with PyTorch's softmax backward
    of its output (differentiable: double backward stays exact)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        y = _every_key_softmax(x)
        ctx.save_for_backward(y)
        ctx.input_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad, y, -1, ctx.input_dtype)


def small_masked_softmax(x: Tensor, valid_lens: object) -> Tensor | None:
    """The masked softmax of a small eager call without gradients, from ``valid_lens`` as a
    caller got them, where the device's backend runs such calls whole (the backend
    contract's ``small_masked_softmax``: it checks the lengths it takes); None for every
    other call, which then takes the checks and :func:`masked_softmax`."""
    if (
        type(valid_lens) is not Tensor
        or valid_lens.dtype != torch.int64
        or _needs_grad(x)
        or not _eager_backend()
        or in_functorch(x)
        or _is_fake(x)
    ):
        return None
    return backend_for(x, "small_masked_softmax")(x, valid_lens)  # type: ignore[no-any-return]


def _masked_softmax_backward(grad: Tensor, y: Tensor, lengths: Tensor) -> Tensor:
    if torch.is_grad_enabled():  # create_graph: differentiable PyTorch formula
        return _plain.masked_softmax_backward(grad, y, lengths)
    fn = backend_for(y, "masked_softmax_backward")
    return fn(grad, y, lengths)  # type: ignore[no-any-return]


class _MaskedSoftmax(torch.autograd.Function):
    """Eager masked softmax on the device's backend, with its backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, lengths: Tensor) -> Tensor:
        y: Tensor = backend_for(x, "masked_softmax")(x, lengths)
        ctx.save_for_backward(y, lengths)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        y, lengths = ctx.saved_tensors
        return _masked_softmax_backward(grad, y, lengths), None


@torch.library.custom_op("attnscore::masked_softmax", mutates_args=())
def masked_softmax_op(x: Tensor, lengths: Tensor) -> Tensor:
    """Softmax of x (..., m) over its first lengths[...] positions, exact zeros beyond."""
    return _fresh(backend_for(x, "masked_softmax")(x, lengths), x)


masked_softmax_op.register_fake(lambda x, lengths: torch.empty_like(x))


@torch.library.custom_op("attnscore::masked_softmax_backward", mutates_args=())
def masked_softmax_backward_op(grad_y: Tensor, y: Tensor, lengths: Tensor) -> Tensor:
    """Input gradient of ``attnscore::masked_softmax`` from its output y."""
    return _fresh(backend_for(y, "masked_softmax_backward")(grad_y, y, lengths), grad_y, y)


masked_softmax_backward_op.register_fake(lambda grad_y, y, lengths: torch.empty_like(y))


def _softmax_setup(ctx: Any, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
    # The output, not a float32 copy: in a create_graph backward it is connected to this op
    # again, which keeps double backward exact.
    ctx.save_for_backward(output, inputs[1])


def _softmax_op_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
    y, lengths = ctx.saved_tensors
    if torch.is_grad_enabled():
        return _plain.masked_softmax_backward(grad, y, lengths), None
    return masked_softmax_backward_op(grad, y, lengths), None


masked_softmax_op.register_autograd(_softmax_op_backward, setup_context=_softmax_setup)


# ---- masked softmax by a boolean mask -------------------------------------------------------


def _eager_backend() -> bool:
    """Whether eager backends may run (not compiling or tracing, kernels enabled)."""
    return enabled() and not _graph_capture()


def masked_softmax_dense(x: Tensor, allowed: Tensor) -> Tensor:
    """The backend contract's ``masked_softmax_dense``; under compile, tracing and
    transforms the plain twin, which compilers fuse on their own."""
    if not _eager_backend() or in_functorch(x) or _is_fake(x):
        return _plain.masked_softmax_dense(x, allowed)
    if _needs_grad(x):
        return _MaskedSoftmaxDense.apply(x, allowed)  # type: ignore[no-any-return,no-untyped-call]
    return backend_for(x, "masked_softmax_dense")(x, allowed)  # type: ignore[no-any-return]


class _MaskedSoftmaxDense(torch.autograd.Function):
    """Eager masked softmax by a boolean mask on the device's backend. Its backward is the
    masked softmax's with every length m: the output is exactly 0 where the mask forbids,
    and so is the gradient there."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, allowed: Tensor) -> Tensor:
        y: Tensor = backend_for(x, "masked_softmax_dense")(x, allowed)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (y,) = ctx.saved_tensors
        return _masked_softmax_backward(grad, y, _every_key(y)), None


def mask_summary(
    allowed: Tensor, dtype: torch.dtype | None
) -> tuple[Tensor | None, Tensor, Tensor]:
    """The backend contract's ``mask_summary`` (eager code; else the plain twin)."""
    if not _eager_backend() or in_functorch(allowed):
        return _plain.mask_summary(allowed, dtype)
    return backend_for(allowed, "mask_summary")(allowed, dtype)  # type: ignore[no-any-return]


def lengths_mask(lengths: Tensor, m: int, dtype: torch.dtype) -> Tensor:
    """The backend contract's ``lengths_mask`` (eager code; else the plain twin)."""
    if not _eager_backend() or in_functorch(lengths):
        return _plain.lengths_mask(lengths, m, dtype)
    return backend_for(lengths, "lengths_mask")(lengths, m, dtype)  # type: ignore[no-any-return]


# ---- matrix products -----------------------------------------------------------------------


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b``, float16 through the device's backend in eager code (the backend contract's
    ``matmul``), with its gradients through the same; ``torch.matmul`` for every other
    dtype, under compile, tracing and transforms, and with kernels disabled."""
    if (
        a.dtype != torch.float16
        or b.dtype != torch.float16
        or not _eager_backend()
        or in_functorch(a)
        or in_functorch(b)
        or _is_fake(a)
        or a.ndim < 2
        or not (b.ndim == 2 or b.shape[:-2] == a.shape[:-2])  # broadcasting: PyTorch's
    ):
        return torch.matmul(a, b)
    if _needs_grad(a, b):
        return _Matmul.apply(a, b)  # type: ignore[no-any-return,no-untyped-call]
    return backend_for(a, "matmul")(a, b)  # type: ignore[no-any-return]


class _Matmul(torch.autograd.Function):
    """A float16 product on the device's backend, its two gradients products as well
    (``torch.matmul``'s differentiable ones for double backward)."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(a, b)
        return backend_for(a, "matmul")(a, b)  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        a, b = ctx.saved_tensors
        product = torch.matmul if torch.is_grad_enabled() else matmul
        grad_a = product(grad, b.mT) if ctx.needs_input_grad[0] else None
        grad_b = None
        if ctx.needs_input_grad[1]:
            if b.ndim == 2 and a.ndim > 2:  # one matrix for all of a's rows
                # flatten, not reshape(-1, k): a feature size of 0 leaves -1 undefined
                grad_b = product(a.flatten(0, -2).mT, grad.flatten(0, -2))
            else:
                grad_b = product(a.mT, grad)
        return grad_a, grad_b


# ---- additive scores ----------------------------------------------------------------------


def additive_scores(qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor) -> Tensor:
    """The backend contract's ``additive_scores``, dispatched as the table above says."""
    if _graph_capture():
        if exporting():
            return _plain.additive_scores_whole(qh, kh, w_v, lengths)
        if torch.compiler.is_compiling() and not _enabled_when_compiling():
            return _plain.additive_scores_dense(qh, kh, w_v, lengths)
        return additive_scores_op(qh, kh, w_v, lengths)  # type: ignore[no-any-return]
    if not enabled() or in_functorch(qh):
        return _plain.additive_scores_dense(qh, kh, w_v, lengths)
    if _is_fake(qh):
        return additive_scores_op(qh, kh, w_v, lengths)  # type: ignore[no-any-return]
    if _needs_grad(qh, kh, w_v):
        return _AdditiveScores.apply(qh, kh, w_v, lengths)  # type: ignore[no-any-return,no-untyped-call]
    return backend_for(qh, "additive_scores")(qh, kh, w_v, lengths)  # type: ignore[no-any-return]


class _AdditiveScores(torch.autograd.Function):
    """Eager additive scores on the device's backend, with their backward."""

    @staticmethod
    def forward(ctx: Any, qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor) -> Tensor:
        ctx.save_for_backward(qh, kh, w_v, lengths)
        out: Tensor = backend_for(qh, "additive_scores")(qh, kh, w_v, lengths)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        qh, kh, w_v, lengths = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: differentiable PyTorch formula
            return (*_plain.additive_scores_backward(grad, qh, kh, w_v, lengths), None)
        fn = backend_for(qh, "additive_scores_backward")
        return (*fn(grad.contiguous(), qh, kh, w_v, lengths), None)


@torch.library.custom_op("attnscore::additive_scores", mutates_args=())
def additive_scores_op(qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor) -> Tensor:
    """Additive scores (B, n, m) for j < lengths (B, n), exact zeros elsewhere."""
    return _fresh(backend_for(qh, "additive_scores")(qh, kh, w_v, lengths), qh, kh)


additive_scores_op.register_fake(
    lambda qh, kh, w_v, lengths: qh.new_empty(qh.shape[0], qh.shape[1], kh.shape[1])
)


@torch.library.custom_op("attnscore::additive_scores_backward", mutates_args=())
def additive_scores_backward_op(
    grad_scores: Tensor, qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (qh, kh, w_v) of ``attnscore::additive_scores``, tanh recomputed."""
    dq, dk, dw = backend_for(qh, "additive_scores_backward")(grad_scores, qh, kh, w_v, lengths)
    return _fresh(dq, qh, kh, w_v), _fresh(dk, qh, kh, w_v), _fresh(dw, qh, kh, w_v)


additive_scores_backward_op.register_fake(
    lambda grad_scores, qh, kh, w_v, lengths: tuple(map(torch.empty_like, (qh, kh, w_v)))
)


def _additive_op_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
    qh, kh, w_v, lengths = ctx.saved_tensors
    if torch.is_grad_enabled():
        return (*_plain.additive_scores_backward(grad, qh, kh, w_v, lengths), None)
    return (*additive_scores_backward_op(grad.contiguous(), qh, kh, w_v, lengths), None)


additive_scores_op.register_autograd(
    _additive_op_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs)
)
