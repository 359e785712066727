"""Bad input: one TypeError or ValueError, "Expected ..., but got ... instead", naming
the argument."""

from __future__ import annotations

import re

import attnscore_keras as ak
import numpy as np
import pytest

q, k, v = (
    np.ones((2, 3, 4), "float32"),
    np.ones((2, 5, 4), "float32"),
    np.ones((2, 5, 6), "float32"),
)

CALLS = [
    ("queries", TypeError, lambda: ak.DotProductAttention()(np.ones((2, 3, 4), "int32"), k, v)),
    ("queries", ValueError, lambda: ak.DotProductAttention()(np.ones((3, 4), "float32"), k, v)),
    ("keys", ValueError, lambda: ak.DotProductAttention()(q, np.ones((2, 5, 3), "float32"), v)),
    ("values", ValueError, lambda: ak.DotProductAttention()(q, k, np.ones((2, 4, 6), "float32"))),
    ("keys", ValueError, lambda: ak.DotProductAttention()(q, np.ones((3, 5, 4), "float32"), v)),
    ("valid_lens", TypeError, lambda: ak.DotProductAttention()(q, k, v, np.ones((2,), bool))),
    ("valid_lens", ValueError, lambda: ak.DotProductAttention()(q, k, v, np.array([1, -1]))),
    ("valid_lens", ValueError, lambda: ak.DotProductAttention()(q, k, v, np.array([1.5, 2.0]))),
    ("valid_lens", ValueError, lambda: ak.DotProductAttention()(q, k, v, np.array([1, 2, 3]))),
    ("query_valid_lens", ValueError,
     lambda: ak.DotProductAttention()(q, k, v, query_valid_lens=np.array([1, 2, 3]))),
    ("attend_mask", TypeError,
     lambda: ak.DotProductAttention()(q, k, v, attend_mask=np.zeros((3, 5), "float32"))),
    ("attend_mask", ValueError,
     lambda: ak.DotProductAttention()(q, k, v, attend_mask=np.ones((3, 4), bool))),
    ("causal", TypeError, lambda: ak.DotProductAttention()(q, k, v, causal="yes")),
    ("queries", ValueError, lambda: ak.AdditiveAttention(4, 5, 8)(q, k, v)),
    ("keys", ValueError, lambda: ak.MultiplicativeAttention(4, 3)(q, k, v)),
    ("queries", ValueError, lambda: ak.MultiHeadAttention(4, 2)(np.ones((2, 1, 3, 4), "float32"),
                                                                 np.ones((2, 1, 5, 4), "float32"),
                                                                 np.ones((2, 1, 5, 4), "float32"))),
    ("num_hiddens", ValueError, lambda: ak.MultiHeadAttention(5, 2)),
    ("num_heads", ValueError, lambda: ak.MultiHeadAttention(4, 0)),
    ("scoring", ValueError, lambda: ak.MultiHeadAttention(4, 2, scoring="bilinear")),
    ("dropout", ValueError, lambda: ak.DotProductAttention(dropout=1.0)),
    ("scale", TypeError, lambda: ak.DotProductAttention(scale="big")),
    ("scale", ValueError, lambda: ak.CosineAttention(scale=0)),
    ("num_hiddens", ValueError, lambda: ak.AdditiveAttention(4, 4)),
    ("normalizer", ValueError, lambda: ak.DotProductAttention(normalizer="sparsemax")),
    ("X", ValueError, lambda: ak.masked_softmax(np.ones((2, 3), "float32"))),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "error", "call"), CALLS, ids=[f"{i}-{c[0]}" for i, c in enumerate(CALLS)]
)
def test_bad_input_raises_one_clear_error_naming_it(name, error, call):
    with pytest.raises(error) as caught:
        call()
    message = str(caught.value)
    assert f"`{name}`" in message, message
    assert re.search(r"Expected .*but got .* instead", message, re.S), message
