"""What a CUDA call dispatches beyond the PyTorch call a user would write instead, counted
on fake CUDA tensors (``FakeTensorMode`` makes them on a CPU-only build) with a
``TorchDispatchMode``: every op a call dispatches costs the GPU's host microseconds, which
small calls wait for. The route is the one real CUDA tensors take: nothing in it asks
whether a tensor is fake (the op that would differ, a detach for the weights, is skipped
for any tensor without autograd history).

On a CPU-only build SDPA itself runs its math formulation under fake tensors; both sides
run it, so the difference counts what attnscore adds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from attnscore import DotProductAttention


class _Ops(TorchDispatchMode):
    """The ops dispatched under it, by name (``prim.device`` reads excluded: no dispatch
    to a kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is not torch.ops.prim.device.default:
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _extra(ours: list[str], theirs: list[str]) -> list[str]:
    """The ops of ``ours`` left once each of ``theirs`` is taken out once."""
    left = list(ours)
    for name in theirs:
        if name in left:
            left.remove(name)
    return left


def _count(fn) -> list[str]:  # type: ignore[no-untyped-def]
    with _Ops() as ops:
        fn()
    return ops.names


@pytest.fixture
def cuda():  # type: ignore[no-untyped-def]
    """(q, k, v, lengths) on the fake CUDA device: (B, H, n, d) = (2, 4, 8, 16), 32 keys."""
    with FakeTensorMode():
        q = torch.empty(2, 4, 8, 16, device="cuda")
        k, v = torch.empty(2, 4, 32, 16, device="cuda"), torch.empty(2, 4, 32, 16, device="cuda")
        lengths = torch.empty(2, dtype=torch.int64, device="cuda")
        yield q, k, v, lengths


#: Ops beyond SDPA's own call, with no mask and with causal masking alone. Fake tensors
#: take the checked path (the lanes take plain tensors only), whose causal mask is built
#: per call (arange, clamp, expand): an upper bound of the real route's, whose lane keeps
#: that mask between calls. The goal is 1.
NOTHING_PADDED_CEILING = {False: 1, True: 3}


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("causal", [False, True], ids=["none", "causal"])
def test_a_call_with_nothing_padded_adds_at_most_the_ceiling(
    cuda, causal: bool, grad: bool
) -> None:  # type: ignore[no-untyped-def]
    q, k, v, _ = cuda
    q = torch.empty(2, 4, 32, 16, device="cuda")  # self-attention: n = m
    module = DotProductAttention().eval()
    module(q, k, v, causal=causal)  # warm: what a call keeps between calls is made once
    with torch.set_grad_enabled(grad):
        theirs = _count(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
        ours = _count(lambda: module(q, k, v, causal=causal))
    assert len(_extra(ours, theirs)) <= NOTHING_PADDED_CEILING[causal], _extra(ours, theirs)


#: The ops a CUDA call by lengths adds today beyond SDPA with a key mask built per call
#: (arange, unsqueeze, lt, view), in inference: the lengths' check without a sync (min, ge,
#: _assert_async), their clamp and compact view, padded keys and values zeroed
#: unconditionally (no look without a sync: ge, unsqueeze, two masked_fill), the mask's
#: layout, and rows with no key zeroed after (eq, unsqueeze, masked_fill). A ceiling against
#: regressions: the goal of three needs a kernel that never reads padding on the device
#: (GitHub issue 52).
LENGTHS_CEILING = 15


def test_a_call_by_lengths_adds_no_more_ops_than_today(cuda) -> None:  # type: ignore[no-untyped-def]
    q, k, v, lengths = cuda
    module = DotProductAttention().eval()
    m = k.shape[-2]

    def theirs() -> None:
        mask = (torch.arange(m, device="cuda") < lengths.unsqueeze(1)).view(2, 1, 1, m)
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    module(q, k, v, lengths)  # warm
    extra = _extra(_count(lambda: module(q, k, v, lengths)), _count(theirs))
    assert len(extra) <= LENGTHS_CEILING, extra
