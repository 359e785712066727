"""Inputs of mixed dtypes under ``torch.autocast``: cast to the autocast dtype, as PyTorch's
own ops are (on a GPU a GRU's output comes out float16 while a Linear's is bfloat16 under a
bfloat16 autocast: the G2P model's decoder met exactly that). Outside autocast, mixed dtypes
stay an error. Reference: the float64 textbook formulation."""

from __future__ import annotations

import math

import pytest
import torch

import attnscore


def _reference(q, k, v, valid_lens):
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.mT / math.sqrt(q.shape[-1])
    allowed = torch.arange(k.shape[-2]) < valid_lens[:, None, None]
    return torch.softmax(scores.masked_fill(~allowed, -math.inf), -1) @ v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("training", [False, True])
def test_mixed_dtypes_are_cast_to_the_autocast_dtype(dtype, training):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 8, generator=gen).to(torch.float16)
    k = torch.randn(2, 7, 8, generator=gen).to(torch.bfloat16)
    v = torch.randn(2, 7, 3, generator=gen)
    valid_lens = torch.tensor([3, 7])
    q.requires_grad_(training)
    with torch.autocast("cpu", dtype=dtype):
        out = attnscore.DotProductAttention(0.0)(q, k, v, valid_lens)
    assert out.dtype == dtype
    ref = _reference(q.detach().to(dtype), k.to(dtype), v.to(dtype), valid_lens)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)
    if training:
        out.float().sum().backward()
        assert q.grad is not None and q.grad.dtype == torch.float16


def test_mixed_dtypes_outside_autocast_are_refused():
    q = torch.randn(2, 5, 8, dtype=torch.float16)
    k = torch.randn(2, 7, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="dtype of `queries`"):
        attnscore.DotProductAttention(0.0)(q, k, k, torch.tensor([3, 7]))
