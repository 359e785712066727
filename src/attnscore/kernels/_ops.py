"""The registered ops: ``torch.library`` custom ops over the backend table.

Each op runs the backend of its input's device type (:func:`._dispatch.backend_function`),
has a fake (meta) implementation so ``torch.compile``, ``torch.export`` and FakeTensor see
its output shapes without running it, and a registered autograd formula whose backward is an
op of its own, so the backward too runs the device's kernel (in eager and compiled code).

=========================================== =================================================
op                                          computes
=========================================== =================================================
``attnscore::softmax_by_lengths``           masked softmax of x (..., m) by lengths (...)
``attnscore::softmax_by_lengths_backward``  its input gradient
``attnscore::additive_scores_by_lengths``   w_vᵀ tanh(qh_i + kh_j) for j < lengths, (B, n, m)
``attnscore::additive_scores_by_lengths_backward`` its gradients (qh, kh, w_v)
=========================================== =================================================

Double backward: when a backward runs with ``create_graph=True`` (grad mode on), it computes
with the plain backend's differentiable PyTorch formulas instead of the backward op, so the
gradient of the gradient is exact.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import _plain
from ._dispatch import backend_function

__all__ = [
    "additive_scores_by_lengths",
    "additive_scores_by_lengths_backward",
    "softmax_by_lengths",
    "softmax_by_lengths_backward",
]


def _fresh(out: Tensor, *inputs: Tensor) -> Tensor:
    """Custom ops may not return an input (or a view of one): copy in that rare case."""
    for t in inputs:
        if out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() and t.numel():
            return out.clone()
    return out


# ---- masked softmax ------------------------------------------------------------------------


@torch.library.custom_op("attnscore::softmax_by_lengths", mutates_args=())
def softmax_by_lengths(x: Tensor, lengths: Tensor) -> Tensor:
    """Softmax of x (..., m) over its first lengths[...] positions, exact zeros beyond."""
    fn = backend_function(x.device.type, "masked_softmax_forward")
    return _fresh(fn(x, lengths), x)


@softmax_by_lengths.register_fake
def _(x: Tensor, lengths: Tensor) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("attnscore::softmax_by_lengths_backward", mutates_args=())
def softmax_by_lengths_backward(grad_y: Tensor, y: Tensor, lengths: Tensor) -> Tensor:
    """Input gradient of :func:`softmax_by_lengths` from its output y."""
    fn = backend_function(y.device.type, "masked_softmax_backward")
    return _fresh(fn(grad_y, y, lengths), grad_y, y)


@softmax_by_lengths_backward.register_fake
def _(grad_y: Tensor, y: Tensor, lengths: Tensor) -> Tensor:
    return torch.empty_like(y)


def _softmax_setup(ctx: Any, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
    # The output, not a float32 copy: in a create_graph backward it is connected to this op
    # again, which keeps double backward exact.
    ctx.save_for_backward(output, inputs[1])


def _softmax_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
    y, lengths = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph: differentiable PyTorch formula
        return _plain.masked_softmax_backward(grad, y, lengths), None
    return softmax_by_lengths_backward(grad.contiguous(), y, lengths), None


softmax_by_lengths.register_autograd(_softmax_backward, setup_context=_softmax_setup)


# ---- additive scores ----------------------------------------------------------------------


@torch.library.custom_op("attnscore::additive_scores_by_lengths", mutates_args=())
def additive_scores_by_lengths(qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor) -> Tensor:
    """Additive scores (B, n, m) for j < lengths (B, n), exact zeros elsewhere."""
    fn = backend_function(qh.device.type, "additive_scores_forward")
    return _fresh(fn(qh, kh, w_v, lengths), qh, kh)


@additive_scores_by_lengths.register_fake
def _(qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor) -> Tensor:
    return qh.new_empty(qh.shape[0], qh.shape[1], kh.shape[1])


@torch.library.custom_op("attnscore::additive_scores_by_lengths_backward", mutates_args=())
def additive_scores_by_lengths_backward(
    grad_scores: Tensor, qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (qh, kh, w_v) of :func:`additive_scores_by_lengths`, tanh recomputed."""
    fn = backend_function(qh.device.type, "additive_scores_backward")
    dq, dk, dw = fn(grad_scores, qh, kh, w_v, lengths)
    return _fresh(dq, qh, kh, w_v), _fresh(dk, qh, kh, w_v), _fresh(dw, qh, kh, w_v)


@additive_scores_by_lengths_backward.register_fake
def _(
    grad_scores: Tensor, qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(qh), torch.empty_like(kh), torch.empty_like(w_v)


def _additive_setup(ctx: Any, inputs: tuple[Tensor, ...], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _additive_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
    qh, kh, w_v, lengths = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph: differentiable PyTorch formula
        dq, dk, dw = _plain.additive_scores_backward(grad, qh, kh, w_v, lengths)
    else:
        dq, dk, dw = additive_scores_by_lengths_backward(grad.contiguous(), qh, kh, w_v, lengths)
    return dq, dk, dw, None


additive_scores_by_lengths.register_autograd(_additive_backward, setup_context=_additive_setup)
