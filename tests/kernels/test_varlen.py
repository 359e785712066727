"""Dot-product attention by key lengths through the variable-length flash kernel
(kernels/_varlen.py), against float64 references written here.

On the CPU the sequence layout is checked with a variable-length kernel written here from
its definition (queries of rows [cu_q[s], cu_q[s+1]) over keys of rows [cu_k[s],
cu_k[s+1])): outputs and gradients against the masked softmax in float64, padding full of
NaN, lengths 0 and m. On a GPU the flash kernel itself runs through the selection, forward
and backward, and the reasons it declines are checked.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnscore
from attnscore import kernels
from attnscore.kernels import _varlen

HAS_CUDA = torch.cuda.is_available()


def _varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal):
    """The variable-length kernel's definition, one sequence at a time (float64 inside):
    causal masking aligned to the bottom right of each sequence (query r of sq attends keys
    c <= r + sk - sq), as flash attention does; queries with no key give zeros."""
    assert dropout_p == 0.0
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    for s in range(cu_q.numel() - 1):
        qs = slice(int(cu_q[s]), int(cu_q[s + 1]))
        ks = slice(int(cu_k[s]), int(cu_k[s + 1]))
        sq, sk = qs.stop - qs.start, ks.stop - ks.start
        assert 0 <= sq <= max_q and 0 <= sk <= max_k
        scores = torch.einsum("ihd,jhd->hij", q[qs].double(), k[ks].double()) * scale
        if causal:
            allowed = torch.arange(sk) <= torch.arange(sq).unsqueeze(-1) + sk - sq
            scores = scores.masked_fill(~allowed, -math.inf)
        weights = scores.softmax(-1).nan_to_num(0.0)
        out[qs] = torch.einsum("hij,jhd->ihd", weights, v[ks].double())
    return out.to(q.dtype)


def _reference(q, k, v, lengths, scale, causal=False):
    """Softmax of the scaled scores over keys j < length (B, H, 1) (and j <= i with
    ``causal``), float64; zeros for queries with no key."""
    q, k, v = q.double(), k.double(), v.double()
    n, m = q.shape[-2], k.shape[-2]
    allowed = torch.arange(m) < lengths.unsqueeze(-1)
    if causal:
        allowed = allowed & (torch.arange(m) <= torch.arange(n).unsqueeze(-1))
    scores = (q @ k.mT * scale).masked_fill(~allowed, -math.inf)
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v


@pytest.mark.parametrize(("B", "H", "n", "m"), [(3, 2, 5, 7), (2, 1, 4, 4), (1, 3, 1, 9)])
@pytest.mark.parametrize("broadcast", ["none", "lengths over heads", "lengths and keys over heads"])
def test_sequences_keep_every_padded_key_out(B, H, n, m, broadcast):
    """Each pair's queries see exactly its first L keys; padded keys (NaN here) belong to
    sequences without queries, so outputs match the masked softmax and NaN reaches
    nothing; lengths 0 give zeros. Lengths (B, 1, 1) and keys and values (B, 1, m, d)
    broadcast over the heads."""
    gen = torch.Generator().manual_seed(B * 100 + m)
    kv_heads = 1 if broadcast == "lengths and keys over heads" else H
    q = torch.randn(B, H, n, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(B, kv_heads, m, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(B, kv_heads, m, 8, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, m + 1, (B, 1 if broadcast != "none" else H, 1), generator=gen)
    lengths.view(-1)[0], lengths.view(-1)[-1] = 0, m
    padded = (torch.arange(m) >= lengths).unsqueeze(-1)
    k_nan, v_nan = k.masked_fill(padded, math.nan), v.masked_fill(padded, math.nan)
    out = _varlen.attention(q, k_nan, v_nan, lengths, scale=0.3, kernel=_varlen_reference)
    want = _reference(q, k.expand(B, H, m, 8), v.expand(B, H, m, 8), lengths, 0.3)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("n", "m"), [(5, 5), (3, 8), (8, 3), (1, 4)])
def test_causal_calls_add_up_to_top_left_causal_masking(n, m):
    """Causal masking with key lengths as two calls (a causal one on squares, bottom-right
    aligned as flash attention aligns it, and a plain one): their sum is top-left causal
    masking by lengths, NaN padding unread, lengths 0 and m among them."""
    B, H = 3, 2
    gen = torch.Generator().manual_seed(n * 10 + m)
    q = torch.randn(B, H, n, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(B, H, m, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(B, H, m, 8, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, m + 1, (B, 1, 1), generator=gen)
    lengths[0], lengths[-1] = 0, m
    padded = (torch.arange(m) >= lengths).unsqueeze(-1)
    k_nan, v_nan = k.masked_fill(padded, math.nan), v.masked_fill(padded, math.nan)
    out = _varlen.attention(
        q, k_nan, v_nan, lengths, scale=0.4, causal=True, kernel=_varlen_reference
    )
    want = _reference(q, k, v, lengths, 0.4, causal=True)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def test_sequences_offsets():
    """Pair i: its queries [i·n, (i+1)·n) over keys [i·m, i·m + L); then no query over the
    rest of its keys."""
    cu_q, cu_k = _varlen.sequences(torch.tensor([[2], [0], [5]]), 3, 4, 5)
    assert cu_q.tolist() == [0, 4, 4, 8, 8, 12, 12]
    assert cu_k.tolist() == [0, 2, 5, 5, 10, 15, 15]
    assert cu_q.dtype == cu_k.dtype == torch.int32
    cu_q, causal, other = _varlen.causal_sequences(torch.tensor([2, 0, 6]), 3, 4, 6)
    assert cu_q.tolist() == [0, 2, 4, 4, 4, 8, 8, 12, 12, 12]
    assert causal.tolist() == [0, 2, 2, 6, 6, 6, 12, 16, 16, 18]
    assert other.tolist() == [0, 0, 2, 6, 6, 6, 12, 12, 18, 18]


def _call(dtype, lengths_shape=(2,), d=64, device="cpu", **options):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 16, d, generator=gen).to(device, dtype)
    lengths = torch.randint(1, 17, lengths_shape, generator=gen).to(device)
    options = {key: t.to(device) if torch.is_tensor(t) else t for key, t in options.items()}
    return q, lengths, options


@pytest.mark.parametrize(
    ("dtype", "lengths_shape", "d", "options", "reason"),
    [
        (torch.float32, (2,), 64, {}, "flash attention takes float16 and bfloat16"),
        (torch.bfloat16, (2, 16), 64, {}, "lengths that differ between queries"),
        (
            torch.bfloat16,
            (2,),
            64,
            {"query_valid_lens": torch.tensor([3, 16])},
            "lengths that differ between queries",
        ),
        (torch.bfloat16, (2,), 12, {}, "a multiple of 8"),
    ],
)
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_declines_with_its_reason(dtype, lengths_shape, d, options, reason):
    q, lengths, options = _call(dtype, lengths_shape, d, "cuda", **options)
    with kernels.use("flash_varlen"), pytest.raises(kernels.NoImplementationError, match=reason):
        attnscore.dot_product_attention(q, q, q, lengths, **options)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("n", "m"), [(40, 300), (300, 40), (1, 129), (200, 200)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_on_cuda_matches_float64(dtype, n, m, causal):
    """The flash kernel through the selection: output and gradients of q, k, v against the
    float64 reference, with NaN padding and lengths 0 and m, with and without causal
    masking; padded keys get zero gradients."""
    gen = torch.Generator().manual_seed(n + m)
    B, H, d = 3, 2, 64
    q64 = torch.randn(B, H, n, d, generator=gen, dtype=torch.float64)
    k64 = torch.randn(B, H, m, d, generator=gen, dtype=torch.float64)
    v64 = torch.randn(B, H, m, d, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, m + 1, (B,), generator=gen)
    lengths[0], lengths[-1] = 0, m
    padded = (torch.arange(m) >= lengths.view(B, 1, 1)).unsqueeze(-1)
    q, k, v = (t.to("cuda", dtype).requires_grad_() for t in (q64, k64, v64))
    with torch.no_grad():
        k.masked_fill_(padded.cuda(), math.nan)
        v.masked_fill_(padded.cuda(), math.nan)
    every = {(dtype, training): 1 for training in (False, True)}  # whatever the sizes
    with (
        kernels.thresholds(varlen_min_keys=every, varlen_causal_min_keys=every),
        kernels.explaining() as seen,
    ):
        out = attnscore.dot_product_attention(q, k, v, lengths.cuda(), causal=causal)
    assert seen.chosen == ["flash_varlen"]
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out.double() * grad_out.cuda()).sum().backward()
    ref_in = [t.clone().requires_grad_() for t in (q64, k64, v64)]
    ref = _reference(*ref_in, lengths.view(B, 1, 1), 1 / math.sqrt(d), causal=causal)
    (ref * grad_out).sum().backward()
    tol = {"rtol": 0.05, "atol": 0.05}
    torch.testing.assert_close(out.double().cpu(), ref.detach(), **tol)
    for got, want in zip((q, k, v), ref_in, strict=True):
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad.double().cpu(), want.grad, **tol)
    assert (k.grad.cpu()[padded.expand_as(k.grad)] == 0).all()
