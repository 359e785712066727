"""masked_softmax and sequence_mask against float64 NumPy and the textbook formulation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnscore
from attnscore import masked_softmax, sequence_mask
from reference import (
    broadcast_lengths,
    d2l_masked_softmax,
    np_attention,
    np_dot_scores,
    np_masked_softmax,
)

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@st.composite
def scores_and_lengths(draw):
    B = draw(st.integers(1, 3))
    n = draw(st.integers(1, 4))
    m = draw(st.integers(1, 6))
    per_query = draw(st.booleans())
    shape = (B, n) if per_query else (B,)
    lens = draw(
        st.lists(st.integers(0, m + 2), min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))
    )
    seed = draw(st.integers(0, 2**16))
    X = torch.randn(B, n, m, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return X * 3, torch.tensor(lens).reshape(shape)


@settings(max_examples=60, deadline=None)
@given(scores_and_lengths())
def test_matches_float64_reference(case):
    X, lens = case
    B, n, _m = X.shape
    expected = np_masked_softmax(X.numpy(), broadcast_lengths(lens.numpy(), (B,), n))
    np.testing.assert_allclose(masked_softmax(X, lens).numpy(), expected, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(scores_and_lengths())
def test_masked_equals_truncated(case):
    """The masked result equals softmax of the truncated row, zero-padded."""
    X, lens = case
    out = masked_softmax(X, lens)
    full = broadcast_lengths(lens.numpy(), (X.shape[0],), X.shape[1])
    for b, i in np.ndindex(*full.shape):
        L = min(int(full[b, i]), X.shape[-1])
        if L:
            torch.testing.assert_close(out[b, i, :L], torch.softmax(X[b, i, :L], -1))
        assert torch.all(out[b, i, L:] == 0)


def test_book_examples():
    X = torch.rand(2, 2, 4)
    out = masked_softmax(X, torch.tensor([2, 3]))
    assert torch.all(out[0, :, 2:] == 0) and torch.all(out[1, :, 3:] == 0)
    torch.testing.assert_close(out.sum(-1), torch.ones(2, 2))
    torch.testing.assert_close(out, d2l_masked_softmax(X.clone(), torch.tensor([2, 3])))
    lens2 = torch.tensor([[1, 3], [2, 4]])
    out2 = masked_softmax(X, lens2)
    torch.testing.assert_close(out2, d2l_masked_softmax(X.clone(), lens2))
    assert out2[0, 0, 0] == 1 and torch.all(out2[0, 0, 1:] == 0)


def test_none_is_plain_softmax():
    X = torch.randn(2, 3, 5)
    torch.testing.assert_close(masked_softmax(X), torch.softmax(X, -1))


def test_zero_length_rows_are_zero_with_zero_gradient():
    X = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    out = masked_softmax(X, torch.tensor([[0, 2, 0], [4, 0, 1]]))
    assert torch.all(out[0, 0] == 0) and torch.all(out[0, 2] == 0) and torch.all(out[1, 1] == 0)
    (out * torch.randn_like(out)).sum().backward()
    assert torch.all(X.grad[0, 0] == 0) and torch.all(X.grad[1, 1] == 0)
    assert torch.isfinite(X.grad).all()
    # The textbook's -1e6 trick gives uniform weights instead: the bug we fix.
    book = d2l_masked_softmax(X.detach().clone(), torch.tensor([[0, 2, 0], [4, 0, 1]]))
    assert torch.allclose(book[0, 0], torch.full((4,), 0.25, dtype=torch.float64))


def test_lengths_above_m_mean_all_valid():
    X = torch.randn(2, 2, 3)
    torch.testing.assert_close(masked_softmax(X, torch.tensor([3, 99])), torch.softmax(X, -1))


@pytest.mark.parametrize(
    "lens",
    [
        torch.tensor([2.0, 3.0]),
        torch.tensor([2, 3], dtype=torch.int32),
        torch.tensor([2, 3], dtype=torch.uint8),
    ],
)
def test_accepts_integer_valued_lengths(lens):
    X = torch.randn(2, 2, 4)
    torch.testing.assert_close(masked_softmax(X, lens), masked_softmax(X, torch.tensor([2, 3])))


@pytest.mark.parametrize("dtype", FLOATS)
def test_every_float_dtype_no_overflow(dtype):
    # Scores near each dtype's range: -1e6 constants or exp without max-subtraction overflow.
    big = float(torch.finfo(dtype).max) / 4
    X = torch.tensor([[[big, -big, 0.0, big], [1.0, 2.0, 3.0, 4.0]]], dtype=dtype)
    out = masked_softmax(X, torch.tensor([[3, 0]]))
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert (
        out[0, 0, 0].item() == 1.0 and torch.all(out[0, 0, 1:] == 0) and torch.all(out[0, 1] == 0)
    )


@pytest.mark.parametrize("dtype", FLOATS)
def test_low_precision_error_budget(dtype):
    X64 = torch.randn(4, 8, 64, dtype=torch.float64) * 4
    lens = torch.randint(0, 65, (4, 8))
    ref = torch.from_numpy(np_masked_softmax(X64.numpy(), lens.numpy()))
    X = X64.to(dtype)
    out = masked_softmax(X, lens).double()
    # Budget: 4x the error of the same maths done naively in that dtype (textbook style).
    naive = torch.softmax(X.masked_fill(torch.arange(64) >= lens[..., None], float("-inf")), -1)
    naive = torch.nan_to_num(naive.double())
    budget = 4 * (naive - ref).abs().max().item() + 1e-12
    assert (out - ref).abs().max().item() <= budget


def test_garbage_at_masked_positions_changes_nothing():
    X = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    lens = torch.tensor([[2, 0, 5], [1, 3, 4]])
    garbage = X.detach().clone()
    keep = torch.arange(5) < lens[..., None]
    garbage[~keep] = torch.tensor(
        [float("nan"), float("inf"), -float("inf")], dtype=X.dtype
    ).repeat(10)[: int((~keep).sum())]
    garbage.requires_grad_(True)
    g = torch.randn(2, 3, 5, dtype=torch.float64)
    out1, out2 = masked_softmax(X, lens), masked_softmax(garbage, lens)
    torch.testing.assert_close(out1, out2)
    (out1 * g).sum().backward()
    (out2 * g).sum().backward()
    torch.testing.assert_close(X.grad, garbage.grad)


def test_nan_in_valid_positions_propagates():
    X = torch.zeros(1, 1, 3)
    X[0, 0, 1] = float("nan")
    assert torch.isnan(masked_softmax(X, torch.tensor([2]))[0, 0, :2]).all()


def test_gradcheck():
    X = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    lens = torch.tensor([[0, 2, 4], [1, 3, 9]])
    assert torch.autograd.gradcheck(lambda x: masked_softmax(x, lens), (X,))
    assert torch.autograd.gradgradcheck(lambda x: masked_softmax(x, lens), (X,))


def test_leading_dimensions_broadcast_lengths():
    X = torch.randn(2, 3, 4, 5, dtype=torch.float64)  # (B, H, n, m)
    for lens in (
        torch.tensor([1, 4]),
        torch.tensor([[1, 2, 3, 0], [5, 4, 3, 2]]),
        torch.randint(0, 6, (2, 3, 4)),
    ):
        expected = np_masked_softmax(
            X.numpy(), broadcast_lengths(lens.numpy(), (2, 3), 4) if lens.ndim < 3 else lens.numpy()
        )
        np.testing.assert_allclose(masked_softmax(X, lens).numpy(), expected, atol=1e-12)


@pytest.mark.parametrize(
    ("X", "lens", "error", "match"),
    [
        (torch.randn(2, 4), torch.tensor([1, 2]), ValueError, "at least 3 dimensions"),
        (
            torch.randn(2, 3, 4),
            torch.tensor([1, 2, 3]),
            ValueError,
            r"valid_lens.*\(2,\) or \(2, 3\)",
        ),
        (torch.randn(2, 3, 4), torch.tensor([[1, 2], [3, 4]]), ValueError, "shape"),
        (
            torch.randn(2, 5, 3, 4),
            torch.ones(2, 4, dtype=torch.long),
            ValueError,
            r"valid_lens.*\(2,\) or \(2, 3\) or \(2, 5, 3\).*\(2, 5, 3, 4\)",
        ),
        (torch.randn(2, 3, 4), torch.tensor([1, -1]), ValueError, "non-negative.*-1"),
        (torch.randn(2, 3, 4), torch.tensor([1.5, 2.0]), ValueError, "whole numbers.*1.5"),
        (torch.randn(2, 3, 4), torch.tensor([float("nan"), 2.0]), ValueError, "whole numbers"),
        (torch.randn(2, 3, 4), torch.tensor([True, False]), TypeError, "bool"),
        (torch.randn(2, 3, 4), [1, 2], TypeError, "valid_lens.*torch.Tensor.*list"),
        (torch.randint(0, 3, (2, 3, 4)), None, TypeError, "X.*floating"),
        (torch.randn(2, 3, 4), torch.tensor([1, 2], device="meta"), ValueError, "device"),
    ],
)
def test_bad_input_errors(X, lens, error, match):
    with pytest.raises(error, match=match):
        masked_softmax(X, lens)


@pytest.mark.parametrize("B", [3, 300], ids=["few lengths", "many lengths"])
@pytest.mark.parametrize("per_query", [False, True], ids=["(B,)", "(B, n)"])
def test_lengths_read_in_python_or_by_a_reduction_agree(B, per_query):
    """Up to 256 lengths are checked by reading them into Python, more by a reduction: both
    give the float64 reference, lengths above m included (no clamp is skipped wrongly),
    and both name a negative length."""
    n, m = 2, 5
    gen = torch.Generator().manual_seed(B)
    X = torch.randn(B, n, m, generator=gen, dtype=torch.float64)
    shape = (B, n) if per_query else (B,)
    lens = torch.randint(0, m + 3, shape, generator=gen)
    lens.view(-1)[-1] = m + 7  # one far above m, last (where a read might stop early)
    expected = np_masked_softmax(X.numpy(), broadcast_lengths(lens.numpy(), (B,), n))
    np.testing.assert_allclose(masked_softmax(X, lens).numpy(), expected, atol=1e-12)
    q = torch.randn(B, n, 4, generator=gen, dtype=torch.float64)
    k, v = torch.randn(2, B, m, 4, generator=gen, dtype=torch.float64)
    weights = np_masked_softmax(
        np_dot_scores(q.numpy(), k.numpy()), broadcast_lengths(lens.numpy(), (B,), n)
    )
    np.testing.assert_allclose(
        attnscore.dot_product_attention(q, k, v, lens).numpy(),
        np_attention(weights, v.numpy()),
        atol=1e-12,
    )
    bad = lens.clone()
    bad.view(-1)[-1] = -4
    with pytest.raises(ValueError, match=r"`valid_lens` to be non-negative, but got -4"):
        masked_softmax(X, bad)


def test_sequence_mask_returns_new_tensor():
    X = torch.arange(12.0).reshape(3, 4)
    before = X.clone()
    out = sequence_mask(X, torch.tensor([1, 0, 9]), value=-5.0)
    assert torch.equal(X, before)
    expected = torch.tensor([[0, -5, -5, -5], [-5, -5, -5, -5], [8, 9, 10, 11.0]])
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match=r"valid_len.*broadcastable"):
        sequence_mask(X, torch.tensor([1, 2]))


def test_public_names():
    for name in (
        "masked_softmax",
        "sequence_mask",
        "AdditiveAttention",
        "DotProductAttention",
        "show_heatmaps",
    ):
        assert hasattr(attnscore, name)
