"""Dot-product attention by lengths through ``flex_attention`` (kernels/_flex.py), against
float64 references written here.

The block mask is checked on its own (which key blocks each query block visits, and which
of them need the mask function), then the attention: on the CPU the eager
``flex_attention`` (forward only: PyTorch has no CPU backward for it), on a GPU the
compiled one, forward and backward. The selection (``_cuda.flex_takes``) is checked for
what it declines and why.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnscore._mask import AttentionMask
from attnscore.kernels import _flex

pytest.importorskip("torch.nn.attention.flex_attention")

HAS_CUDA = torch.cuda.is_available()
SHAPES = [  # B, H, n, m
    (2, 2, 200, 300),
    (1, 3, 128, 256),
    (2, 1, 5, 7),
    (1, 1, 130, 129),
    (2, 2, 257, 128),
    (1, 2, 384, 1000),
]
KINDS = ("per example", "per query", "causal + lengths", "zeros and m")


def _lengths(kind: str, B: int, H: int, n: int, m: int, gen: torch.Generator) -> torch.Tensor:
    """int64 lengths broadcastable to (B, H, n), values in [0, m]."""
    if kind == "per example":
        return torch.randint(0, m + 1, (B, H, 1), generator=gen).expand(B, H, n)
    if kind == "per query":
        return torch.randint(0, m + 1, (B, H, n), generator=gen)
    if kind == "causal + lengths":
        per_example = torch.randint(0, m + 1, (B, 1, 1), generator=gen)
        return torch.minimum(torch.arange(1, n + 1), per_example).expand(B, 1, n)
    lengths = torch.full((B, 1, n), m)
    lengths[:, :, ::3] = 0
    return lengths


def _reference(q, k, v, lengths, scale):
    """Softmax of the scaled scores over keys j < length, in float64; zeros for length 0."""
    q, k, v = q.double(), k.double(), v.double()
    allowed = torch.arange(k.shape[-2]) < lengths.unsqueeze(-1)
    scores = (q @ k.mT * scale).masked_fill(~allowed, -math.inf)
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_block_mask_visits_exactly_the_blocks_with_an_allowed_key(shape, kind):
    """Every (query block, key block) tile holding an allowed pair is visited; tiles marked
    full hold allowed pairs only; tiles beyond every length of a query block are absent."""
    B, H, n, m = shape
    lengths = _lengths(kind, B, H, n, m, torch.Generator().manual_seed(0))
    mask = _flex.block_mask(lengths, B, H, n, m)
    b = _flex.BLOCK
    qb, kb = -(-n // b), -(-m // b)
    allowed = torch.arange(m) < lengths.expand(B, H, n).unsqueeze(-1)  # (B, H, n, m)
    padded = torch.zeros(B, H, qb * b, kb * b, dtype=torch.bool)
    padded[:, :, :n, :m] = allowed
    tiles = padded.view(B, H, qb, b, kb, b)
    any_allowed = tiles.any(dim=(3, 5))
    # Full means every real (query < n, key < m) pair of the tile is allowed.
    real = torch.zeros(qb * b, kb * b, dtype=torch.bool)
    real[:n, :m] = True
    real_tiles = real.view(qb, b, kb, b)
    all_allowed = (tiles | ~real_tiles).all(dim=(3, 5)) & real_tiles.any(dim=(1, 3))

    def listed(counts: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(B, H, qb, kb, dtype=torch.bool)
        for i in range(qb):
            for bb in range(B):
                for h in range(H):
                    c = int(counts[bb, h, i])
                    out[bb, h, i, indices[bb, h, i, :c].long()] = True
        return out

    partial = listed(mask.kv_num_blocks, mask.kv_indices)
    full = listed(mask.full_kv_num_blocks, mask.full_kv_indices)
    assert not (partial & full).any(), "a tile listed both full and partial"
    assert torch.equal(partial | full, any_allowed), "visited tiles != tiles with a key"
    assert not (full & ~all_allowed).any(), "a tile marked full holds a masked pair"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_forward_equals_float64_on_the_cpu(shape, kind):
    B, H, n, m = shape
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(B, H, n, 16, generator=gen), torch.randn(B, H, m, 16, generator=gen)
    v = torch.randn(B, H, m, 8, generator=gen)
    lengths = _lengths(kind, B, H, n, m, gen)
    out = _flex.attention(q, k, v, lengths, scale=0.25)
    ref = _reference(q, k, v, lengths, 0.25)
    assert out.dtype == torch.float32 and out.shape == (B, H, n, 8)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)
    idle = (lengths.expand(B, H, n) == 0).unsqueeze(-1).expand_as(out)
    assert (out[idle] == 0).all(), "a query that attends nothing is not zeros"


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (no CPU backward for flex_attention)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_forward_and_backward_on_cuda(dtype, kind):
    B, H, n, m, d = 2, 3, 300, 517, 64
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, H, s, d, generator=gen) for s in (n, m, m))
    lengths = _lengths(kind, B, H, n, m, gen)
    grad = torch.randn(B, H, n, d, generator=gen)
    ins = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)]
    out = _flex.attention(*ins, lengths.cuda(), scale=d**-0.5)
    out.backward(grad.to("cuda", dtype))
    refs = [t.to(dtype).double().requires_grad_() for t in (q, k, v)]
    ref = _reference(*refs, lengths, d**-0.5)
    ref.backward(grad.to(dtype).double())
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # relative, Frobenius
    for got, want in [(out.detach(), ref.detach())] + [
        (t.grad, r.grad) for t, r in zip(ins, refs, strict=True)
    ]:
        error = float((got.double().cpu() - want).norm() / want.norm().clamp_min(1e-30))
        assert error < tol, error


def _meta_inputs(dtype, m, requires_grad):
    q = torch.empty(8, 2, 16, 64, dtype=dtype, device="meta", requires_grad=requires_grad)
    k = torch.empty(8, 2, m, 64, dtype=dtype, device="meta", requires_grad=requires_grad)
    return q, k


def _masks(m):
    lengths = torch.empty(8, 1, 16, dtype=torch.int64, device="meta")
    attend = torch.empty(8, 1, 16, m, dtype=torch.bool, device="meta")
    return (
        AttentionMask(n=16, m=m, lengths=lengths, key_lengths=lengths),
        AttentionMask(n=16, m=m, lengths=lengths, attend=attend),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("table", ["as measured", "an entry"])
def test_selection_declines_with_a_reason(dtype, training, table, thresholds):
    """``flex_takes`` takes only what FLEX_MIN_KEYS lists (dtype, training, keys), on CUDA,
    by lengths, without dropout; each refusal says why. With the table as measured (empty
    today) and with an entry for this (dtype, training) put in (``flex_min_keys``), so
    that both kinds of refusal run."""
    if table == "an entry":
        thresholds(flex_min_keys={(dtype, training): 1024})
    least = _flex.FLEX_MIN_KEYS.get((dtype, training))
    m = least or 4096
    by_lengths, by_bool = _masks(m)

    def why(m=m, mask=by_lengths, dropout=0.0):
        return _flex.flex_takes(*_meta_inputs(dtype, m, training), mask, dropout) or ""

    assert "dropout" in why(dropout=0.1)
    assert "boolean" in why(mask=by_bool)
    if least is None:
        assert "measured faster" in why()
    else:
        assert "CUDA" in why()  # everything else fits
        assert "fewer than" in why(m=least - 1)
