"""Probability functions and mask kinds against float64 NumPy references."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import attnscore
from attnscore.scoring import dot_product_scores
from reference import np_attention, np_dot_scores, np_masked_softmax_dense

entmax = pytest.importorskip("entmax")


def np_sparsemax(z: np.ndarray) -> np.ndarray:
    """Martins & Astudillo 2016, Algorithm 1 (sort-based threshold)."""
    zs = np.sort(z)[::-1]
    k = np.arange(1, len(z) + 1)
    support = 1 + k * zs > np.cumsum(zs)
    kz = k[support][-1]
    tau = (np.cumsum(zs)[kz - 1] - 1) / kz
    return np.maximum(z - tau, 0)


def np_entmax15(z: np.ndarray) -> np.ndarray:
    """alpha = 1.5 entmax by bisection on tau: p = max(z/2 - tau, 0)^2 sums to 1."""
    x = z / 2
    lo, hi = x.max() - 1, x.max()
    for _ in range(200):
        tau = (lo + hi) / 2
        if (np.maximum(x - tau, 0) ** 2).sum() >= 1:
            lo = tau
        else:
            hi = tau
    p = np.maximum(x - lo, 0) ** 2
    return p / p.sum()


def np_hardmax(z: np.ndarray) -> np.ndarray:
    out = np.zeros_like(z)
    out[np.argmax(z)] = 1.0
    return out


REFERENCES = {
    "softmax": lambda z: np.exp(z - z.max()) / np.exp(z - z.max()).sum(),
    "sparsemax": np_sparsemax,
    "entmax15": np_entmax15,
    "hardmax": np_hardmax,
}


def np_normalize(name, scores, allowed):
    out = np.zeros_like(scores)
    allowed = np.broadcast_to(allowed, scores.shape)
    for idx in np.ndindex(*scores.shape[:-1]):
        a = allowed[idx]
        if a.any():
            out[idx][a] = REFERENCES[name](scores[idx][a])
    return out


MASK_KINDS = {
    "none": lambda B, n, m: {},
    "valid_lens_1d": lambda B, n, m: {"valid_lens": torch.tensor([3, 0, m])},
    "valid_lens_2d": lambda B, n, m: {
        "valid_lens": torch.tensor([[1, 2, 0, 5], [5, 4, 3, 2], [0, 0, 1, 1]])
    },
    "query_valid_lens": lambda B, n, m: {"query_valid_lens": torch.tensor([4, 1, 0])},
    "attend_mask": lambda B, n, m: {
        "attend_mask": torch.rand(B, n, m, generator=torch.Generator().manual_seed(1)) > 0.4
    },
    "causal": lambda B, n, m: {"causal": True},
    "everything": lambda B, n, m: {
        "valid_lens": torch.tensor([4, 2, 5]),
        "query_valid_lens": torch.tensor([3, 4, 2]),
        "attend_mask": torch.tensor([True, False, True, True, True]),
        "causal": True,
    },
}


def np_allowed(B, n, m, valid_lens=None, query_valid_lens=None, attend_mask=None, causal=False):
    allowed = np.ones((B, n, m), dtype=bool)
    if valid_lens is not None:
        L = valid_lens.numpy()
        L = L[:, None] if L.ndim == 1 else L
        allowed &= np.arange(m) < L[..., None]
    if query_valid_lens is not None:
        allowed &= (np.arange(n) < query_valid_lens.numpy()[:, None])[..., None]
    if attend_mask is not None:
        allowed &= attend_mask.numpy()
    if causal:
        allowed &= np.arange(m)[None, :] <= np.arange(n)[:, None]
    return allowed


@pytest.mark.parametrize("normalizer", sorted(REFERENCES))
@pytest.mark.parametrize("kind", sorted(MASK_KINDS))
def test_normalizer_and_mask_against_reference(normalizer, kind):
    B, n, m, d = 3, 4, 5, 3
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, s, d, generator=g, dtype=torch.float64) for s in (n, m, m))
    masks = MASK_KINDS[kind](B, n, m)
    out, w = attnscore.dot_product_attention(
        q, k, v, normalizer=normalizer, return_weights=True, **masks
    )
    allowed = np_allowed(B, n, m, **masks)
    ref_w = np_normalize(normalizer, np_dot_scores(q, k), allowed)
    np.testing.assert_allclose(w.numpy(), ref_w, atol=1e-9)
    np.testing.assert_allclose(out.numpy(), np_attention(ref_w, v), atol=1e-9)
    rows_empty = ~allowed.any(-1)
    assert np.all(w.numpy()[rows_empty] == 0) and np.all(out.numpy()[rows_empty] == 0)


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax", "entmax15"])
@pytest.mark.parametrize("kind", sorted(MASK_KINDS))
def test_gradcheck_every_mask_kind(normalizer, kind):
    B, n, m, d = 3, 4, 5, 3
    g = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(B, s, d, generator=g, dtype=torch.float64, requires_grad=True)
        for s in (n, m, m)
    )
    masks = MASK_KINDS[kind](B, n, m)
    assert torch.autograd.gradcheck(
        lambda a, b, c: attnscore.dot_product_attention(a, b, c, normalizer=normalizer, **masks),
        (q, k, v),
    )


@pytest.mark.parametrize("normalizer", sorted(REFERENCES))
def test_padded_garbage_and_padded_queries_change_nothing(normalizer):
    B, n, m, d = 2, 3, 4, 3
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, s, d, generator=g, dtype=torch.float64) for s in (n, m, m))
    masks = {"valid_lens": torch.tensor([2, 3]), "query_valid_lens": torch.tensor([1, 3])}
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[0, 1:] = float("nan")
    k2[0, 2:], v2[0, 2:] = float("inf"), float("nan")
    k2[1, 3:], v2[1, 3:] = float("nan"), -float("inf")

    def run(*tensors):
        ts = [t.clone().requires_grad_(True) for t in tensors]
        out, w = attnscore.dot_product_attention(
            *ts, normalizer=normalizer, return_weights=True, **masks
        )
        out.sum().backward()
        # hardmax is not differentiable in the scores: no gradient reaches q and k.
        return out, w, *(torch.zeros_like(t) if t.grad is None else t.grad for t in ts)

    for a, b in zip(run(q, k, v), run(q2, k2, v2), strict=True):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b)


def test_attend_mask_direction_is_true_means_attend():
    q, k, v = torch.randn(1, 1, 2), torch.randn(1, 3, 2), torch.eye(3).unsqueeze(0)
    out = attnscore.dot_product_attention(q, k, v, attend_mask=torch.tensor([False, True, False]))
    torch.testing.assert_close(out, torch.tensor([[[0.0, 1.0, 0.0]]]))


def test_user_normalizer_callable():
    def uniform(scores, mask):
        allowed = mask.dense().expand_as(scores).to(scores.dtype)
        return allowed / allowed.sum(-1, keepdim=True).clamp(min=1)

    q, k, v = torch.randn(1, 2, 2), torch.randn(1, 4, 2), torch.randn(1, 4, 3)
    out = attnscore.attention(q, k, v, dot_product_scores, torch.tensor([2]), normalizer=uniform)
    torch.testing.assert_close(out, v[:, :2].mean(1, keepdim=True).expand(1, 2, 3))


def test_dense_reference_helper_sanity():
    # The reference itself must be able to fail: a wrong mask gives a different answer.
    s = np.array([[[1.0, 2.0, 3.0]]])
    assert not np.allclose(
        np_masked_softmax_dense(s, np.array([True, True, False])),
        np_masked_softmax_dense(s, np.array([True, False, True])),
    )


@pytest.mark.parametrize("name", ["sparsemax", "entmax15"])
def test_sparse_normalizers_name_their_missing_package(name, monkeypatch):
    monkeypatch.setitem(sys.modules, "entmax", None)  # as if it were not installed
    q = torch.randn(1, 2, 3)
    with pytest.raises(
        ImportError, match=rf"normalizer='{name}' needs .*`entmax`.*attnscore\[entmax\]"
    ):
        attnscore.dot_product_attention(q, q, q, normalizer=name)


def test_every_registered_normalizer_has_a_test_reference():
    assert set(attnscore.normalizer_names()) <= set(REFERENCES)


def test_a_registered_normalizer_is_taken_by_name_everywhere():
    """register_normalizer: the name then works in functions, modules and multi-head."""

    def uniform(scores, mask):
        allowed = mask.dense().expand_as(scores).to(scores.dtype)
        return allowed / allowed.sum(-1, keepdim=True).clamp(min=1)

    attnscore.register_normalizer("test_uniform", uniform)
    try:
        assert "test_uniform" in attnscore.normalizer_names()
        q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
        lengths = torch.tensor([2, 5])
        # Uniform weights: the mean of the first valid_lens values of each example.
        expected = torch.stack([v[b, : int(n)].mean(0) for b, n in enumerate(lengths)])
        expected = expected[:, None].expand(2, 3, 6)
        out = attnscore.dot_product_attention(q, k, v, lengths, normalizer="test_uniform")
        torch.testing.assert_close(out, expected)
        module = attnscore.make_scorer("additive", 4, 4, num_hiddens=3, normalizer="test_uniform")
        torch.testing.assert_close(module(q, k, v, lengths), expected)
        mha = attnscore.MultiHeadAttention(8, 2, normalizer="test_uniform").eval()
        mha(torch.randn(2, 3, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8), lengths)
        weights = mha.attention_weights.double()
        allowed = (torch.arange(5) < lengths[:, None]).double()
        torch.testing.assert_close(
            weights, (allowed / lengths[:, None])[:, None, None].expand(2, 2, 3, 5)
        )
    finally:
        del attnscore.normalizers.NORMALIZERS["test_uniform"]
    assert "test_uniform" not in attnscore.normalizer_names()


@pytest.mark.parametrize(
    ("name", "normalizer", "error", "message"),
    [
        ("two words", torch.softmax, ValueError, r"`name` to be a word.*'two words'"),
        ("softmax", torch.softmax, ValueError, r"`name`.*'softmax', which is registered already"),
        ("fresh_name", 3, TypeError, r"`normalizer` to be callable.*got int"),
    ],
)
def test_register_normalizer_refuses_bad_input(name, normalizer, error, message):
    before = dict(attnscore.normalizers.NORMALIZERS)
    with pytest.raises(error, match=message):
        attnscore.register_normalizer(name, normalizer)
    assert before == attnscore.normalizers.NORMALIZERS


def test_multihead_attention_takes_a_normalizer_name():
    mha = attnscore.MultiHeadAttention(8, 2, normalizer="hardmax").eval()
    x = torch.randn(2, 3, 8)
    mha(x, x, x, torch.tensor([1, 3]))
    weights = mha.attention_weights
    # hardmax: one weight of 1 per row, on an allowed key.
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 3))
    assert ((weights == 0) | (weights == 1)).all()
    assert (weights[0, :, :, 1:] == 0).all()
