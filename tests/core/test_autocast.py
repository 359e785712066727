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


@pytest.mark.parametrize("causal", [False, True], ids=["no mask", "causal"])
@pytest.mark.parametrize("form", ["function", "module"])
def test_projected_scorer_under_autocast_with_nothing_padded(form, causal):
    """General attention (qᵀ W_a k) under a bfloat16 autocast with no mask or causal
    masking alone, at a size the C kernels take: autocast's projections come out bfloat16
    while the values stay float32, which the kernels do not take (they declined by lengths
    only, and causal masking alone gave NaN). The float64 formula, projected first."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(4, 64, 64, generator=gen) for _ in range(3))
    module = attnscore.MultiplicativeAttention(64, 64)
    with torch.no_grad():
        module.W_a.weight.copy_(torch.randn(64, 64, generator=gen) / 8)
    W = module.W_a.weight.detach()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        if form == "function":
            out = attnscore.functional.general_attention(q, k, v, W, causal=causal)
        else:
            out = module(q, k, v, causal=causal)
    scores = q.double() @ W.double() @ k.double().mT
    if causal:
        scores = scores.masked_fill(torch.ones(64, 64, dtype=torch.bool).triu(1), -math.inf)
    ref = torch.softmax(scores, -1) @ v.double()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=0.15, rtol=0.05)
