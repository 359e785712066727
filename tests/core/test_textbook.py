"""attnscore.textbook, the book's formulation, against float64 NumPy and the book's outputs."""

from __future__ import annotations

import numpy as np
import torch

from attnscore import textbook
from reference import (
    broadcast_lengths,
    np_additive_scores,
    np_attention,
    np_dot_scores,
    np_masked_softmax,
)


def test_masked_softmax_matches_float64_reference():
    X = torch.randn(2, 3, 5, dtype=torch.float64)
    for lens in (torch.tensor([2, 5]), torch.tensor([[1, 3, 5], [4, 2, 1]])):
        expected = np_masked_softmax(X.numpy(), broadcast_lengths(lens.numpy(), (2,), 3))
        np.testing.assert_allclose(textbook.masked_softmax(X.clone(), lens).numpy(), expected)
    np.testing.assert_allclose(
        textbook.masked_softmax(X, None).numpy(), np_masked_softmax(X.numpy(), np.array(5))
    )


def test_book_limits_are_kept():
    """-1e6 fill: a length-0 row is uniform, not zero; the input is written in place."""
    X = torch.zeros(1, 2, 4)
    out = textbook.masked_softmax(X, torch.tensor([[0, 2]]))
    torch.testing.assert_close(out[0, 0], torch.full((4,), 0.25))
    assert torch.equal(X[0, 1], torch.tensor([0.0, 0.0, -1e6, -1e6]))


def test_additive_matches_float64_reference():
    torch.manual_seed(0)
    att = textbook.AdditiveAttention(3, 5, 7, 0.0).double().eval()
    q, k, v = (torch.randn(2, x, f, dtype=torch.float64) for x, f in ((4, 5), (6, 3), (6, 2)))
    lens = torch.tensor([1, 6])
    out = att(q, k, v, lens)
    W_q, W_k, w_v = (p.detach() for p in (att.W_q.weight, att.W_k.weight, att.w_v.weight))
    scores = np_additive_scores(q, k, W_q, W_k, w_v)
    weights = np_masked_softmax(scores, broadcast_lengths(lens.numpy(), (2,), 4))
    np.testing.assert_allclose(att.attention_weights.detach().numpy(), weights, atol=1e-12)
    np.testing.assert_allclose(out.detach().numpy(), np_attention(weights, v), atol=1e-12)
    assert sorted(att.state_dict()) == ["W_k.weight", "W_q.weight", "w_v.weight"]


def test_dot_product_matches_float64_reference():
    q, k, v = (torch.randn(2, x, 4, dtype=torch.float64) for x in (3, 6, 6))
    lens = torch.tensor([[1, 2, 6], [6, 5, 4]])
    out = textbook.DotProductAttention(0.0)(q, k, v, lens)
    weights = np_masked_softmax(np_dot_scores(q, k), lens.numpy())
    np.testing.assert_allclose(out.numpy(), np_attention(weights, v), atol=1e-12)


def test_toy_examples_print_the_book_values():
    """The section's toy outputs (eval mode): [[2, 3, 4, 5]] and [[10, 11, 12, 13]]."""
    keys = torch.ones(2, 10, 2)
    values = torch.arange(40, dtype=torch.float32).reshape(1, 10, 4).repeat(2, 1, 1)
    lens = torch.tensor([2, 6])
    expected = torch.tensor([[[2.0, 3, 4, 5]], [[10.0, 11, 12, 13]]])
    additive = textbook.AdditiveAttention(2, 20, 8, 0.1).eval()
    torch.testing.assert_close(additive(torch.randn(2, 1, 20), keys, values, lens), expected)
    dot = textbook.DotProductAttention(0.5).eval()
    torch.testing.assert_close(dot(torch.randn(2, 1, 2), keys, values, lens), expected)
