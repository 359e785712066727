"""The public functional forms: the reference code in `attention`'s docstring, the new
general and cosine forms, and the docstrings of every public forward."""

from __future__ import annotations

import pydoc
import textwrap

import pytest
import torch

import attnscore
from attnscore.scoring import dot_product_scores


def _docstring_reference():
    """The plain code quoted in attention's docstring, executed as written."""
    doc = attnscore.attention.__doc__
    start = doc.index("        def attention(")
    block = doc[start : doc.index("\n\n", start)]
    namespace = {"torch": torch}
    exec(textwrap.dedent(block), namespace)
    return namespace["attention"]


@pytest.mark.parametrize("shape", [(2,), (2, 3)])
def test_attention_equals_the_reference_code_in_its_docstring(shape):
    reference = _docstring_reference()
    q, k, v = (torch.randn(2, s, 4, dtype=torch.float64) for s in (3, 5, 5))
    lengths = torch.tensor([0, 4]) if shape == (2,) else torch.tensor([[1, 0, 3], [3, 2, 4]])
    k[0, 4:] = float("nan")  # padding of element 0: no query attends it
    v[0, 4:] = float("nan")
    expected = reference(q, k, v, dot_product_scores, lengths)
    got = attnscore.attention(q, k, v, dot_product_scores, lengths)
    torch.testing.assert_close(got, expected)


def test_general_attention_checks_the_weight_shape():
    q, k, v = torch.randn(2, 1, 3), torch.randn(2, 4, 5), torch.randn(2, 4, 6)
    with pytest.raises(ValueError, match=r"Expected `W_a` of shape \(3, 5\), but got \(5, 3\)"):
        attnscore.general_attention(q, k, v, torch.randn(5, 3))


@pytest.mark.parametrize(
    "forward",
    [
        attnscore.Attention.forward,
        attnscore.AdditiveAttention.forward,
        attnscore.DotProductAttention.forward,
        attnscore.MultiplicativeAttention.forward,
        attnscore.CosineAttention.forward,
        attnscore.MultiHeadAttention.forward,
    ],
)
def test_every_public_forward_documents_its_shapes(forward):
    text = pydoc.render_doc(forward)
    assert "Define the computation performed at every call" not in text
    assert "(..., n, q)" in text or "(B, n, q)" in text
    assert "Returns:" in text and "Raises:" in text


def test_attention_with_a_callable_allows_queries_and_keys_of_other_sizes():
    """A user's scoring callable may project: q and k need not share d (the notebook's
    low-rank example), and it is called with (queries, keys) only."""
    W_q, W_k = torch.randn(3, 20, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    q, k = torch.randn(2, 1, 20, dtype=torch.float64), torch.randn(2, 10, 2, dtype=torch.float64)
    v = torch.randn(2, 10, 4, dtype=torch.float64)
    lengths = torch.tensor([2, 6])

    def low_rank(queries, keys, lengths=None):  # a keyword named `lengths` stays unset
        assert lengths is None
        return (queries @ W_q.T) @ (keys @ W_k.T).transpose(-1, -2)

    out, w = attnscore.attention(q, k, v, low_rank, lengths, return_weights=True)
    scores = (q @ W_q.T) @ (k @ W_k.T).transpose(1, 2)
    allowed = torch.arange(10) < lengths[:, None, None]
    expected = torch.softmax(scores.masked_fill(~allowed, -torch.inf), -1)
    torch.testing.assert_close(w, expected)
    torch.testing.assert_close(out, expected @ v)
