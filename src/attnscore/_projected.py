"""A decoder's memory projected once: the keys (and values) a decoder attends at every step
are the same tensor from step to step, so their projection is made at the first step and
reused while nothing it depends on changed (``AdditiveAttention``'s ``W_k keys``,
``MultiHeadAttention``'s ``W_k keys`` and ``W_v values``)."""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from ._checks import in_transform

#: What a module keeps under a slot: a weak reference to the input, its stamp
#: (:func:`_stamp`), and the projection.
Kept = tuple["weakref.ref[Tensor]", tuple[object, ...], Tensor]


def project_once(module: nn.Module, slot: str, linear: nn.Module, x: Tensor) -> Tensor:
    """``linear(x)``, reused from ``module``'s earlier call while the same tensor ``x`` comes
    back unchanged (the same object and version) and so do ``linear``'s parameters
    (versions, memory and dtype: a load, an optimizer step and ``.to`` each change one;
    :func:`_stamp`).
    Kept in ``module.__dict__[slot]`` (:data:`Kept`; a module pickles it as None).

    Nothing is kept with gradients enabled (it would tie the steps' autograd graphs), for
    inference-mode tensors (no version counter) or while tracing or compiling (a graph must
    hold the projection): the slot is emptied and ``linear(x)`` returned. Any device and
    dtype; raises what ``linear(x)`` raises."""
    state = module.__dict__
    # in_transform first: tracers (torch.compile) cannot evaluate is_inference().
    if torch.is_grad_enabled() or in_transform(x) or x.is_inference():
        state[slot] = None
        return linear(x)  # type: ignore[no-any-return]
    kept: Kept | None = state.get(slot)
    if kept is not None and kept[0]() is x and kept[1] == _stamp(x, linear):
        return kept[2]
    projected: Tensor = linear(x)  # (before the stamp: a lazy projection's first call sizes it)
    state[slot] = (weakref.ref(x), _stamp(x, linear), projected)
    return projected


def _stamp(x: Tensor, linear: nn.Module) -> tuple[object, ...]:
    """What a projection of ``x`` depends on beyond its identity: its version, and the
    version, memory and dtype of each of ``linear``'s parameters (an ``nn.Linear``'s weight
    and bias read where it keeps them: a decoder's every step pays for this; any other
    module's, a parametrized or adapted one's included, through ``parameters()``)."""
    if type(linear) is nn.Linear:
        weight, bias = linear._parameters["weight"], linear._parameters["bias"]
        assert weight is not None
        stamp = (x._version, weight._version, weight.data_ptr(), weight.dtype)
        return stamp if bias is None else (*stamp, bias._version, bias.data_ptr())
    params = tuple((p._version, p.data_ptr(), p.dtype) for p in linear.parameters())
    return x._version, params
