"""``score_bias``: a float tensor added to the scores before the normalizer, as SDPA adds a
float ``attn_mask`` (issue 36: transformers' custom 4-D masks, T5's position bias).

Checked against a float64 NumPy formulation (scores + bias, masked softmax over the allowed
keys, zero rows where none is allowed), on the fused path (no weights asked) and the plain
one (weights asked, a scoring callable), with every mask, 3-D to 5-D inputs, gradients
into the bias, NaN in padding, torch.compile (fullgraph) and the errors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnscore import attention, dot_product_attention
from attnscore.scoring import dot_product_scores
from reference import np_attention, np_masked_softmax_dense


def _inputs(batch: tuple[int, ...], n: int = 5, m: int = 6, d: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*batch, size, d, generator=g) for size in (n, m, m))
    return q, k, v


def _expected(q, k, v, bias, allowed=None):
    """float64: softmax over the allowed keys of q kᵀ / sqrt(d) + bias, then @ v."""
    q64, k64 = q.double().numpy(), k.double().numpy()
    scores = q64 @ np.swapaxes(k64, -1, -2) / np.sqrt(q.shape[-1]) + bias.double().numpy()
    if allowed is None:
        allowed = np.ones(scores.shape, dtype=bool)
    weights = np_masked_softmax_dense(scores, np.asarray(allowed))
    return torch.from_numpy(np_attention(weights, v.numpy())), torch.from_numpy(weights)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch", [(2,), (2, 3), (2, 3, 2)])
@pytest.mark.parametrize("masks", ["none", "valid_lens", "causal", "attend_mask"])
def test_bias_is_added_to_the_scores(batch: tuple[int, ...], masks: str) -> None:
    q, k, v = _inputs(batch)
    n, m = 5, 6
    bias = torch.randn(*batch[1:], n, m)  # broadcast over the batch
    options: dict = {}
    allowed = torch.ones(*batch, n, m, dtype=torch.bool)
    if masks == "valid_lens":
        lengths = torch.tensor([3, 0])  # example 1 attends nothing: zero rows
        options["valid_lens"] = lengths
        allowed &= torch.arange(m) < lengths.reshape(2, *[1] * (len(batch) + 1))
    elif masks == "causal":
        options["causal"] = True
        allowed &= torch.ones(n, m, dtype=torch.bool).tril()
    elif masks == "attend_mask":
        attend = torch.rand(*batch, n, m, generator=torch.Generator().manual_seed(1)) > 0.5
        attend[0, ..., 2, :] = False
        options["attend_mask"] = attend
        allowed &= attend
    expected, expected_weights = _expected(q, k, v, bias, allowed)
    out = dot_product_attention(q, k, v, score_bias=bias, **options)  # fused
    _close(out, expected)
    out, weights = dot_product_attention(q, k, v, score_bias=bias, return_weights=True, **options)
    _close(out, expected)
    _close(weights, expected_weights)
    plain = attention(
        q, k, v, lambda a, b: dot_product_scores(a, b, 0.5), score_bias=bias, **options
    )
    _close(plain, expected)  # d = 4: the same scale


def test_an_additive_mask_is_what_sdpa_computes() -> None:
    q, k, v = _inputs((2, 3))
    allowed = torch.rand(2, 1, 5, 6, generator=torch.Generator().manual_seed(2)) > 0.3
    allowed[..., 0] = True
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=additive)
    torch.testing.assert_close(dot_product_attention(q, k, v, score_bias=additive), expected)
    _close(
        dot_product_attention(q, k, v, score_bias=additive),
        _expected(q, k, v, 0 * additive, allowed)[0],
    )


def test_gradients_reach_the_bias_and_padding_stays_inert() -> None:
    q, k, v = _inputs((2, 2))
    k[1, :, 4:] = float("nan")  # padded keys and values hold garbage
    v[1, :, 4:] = float("nan")
    lengths = torch.tensor([6, 4])
    for weights in (False, True):
        bias = torch.randn(2, 1, 5, 6, requires_grad=True)
        out = dot_product_attention(q, k, v, lengths, score_bias=bias, return_weights=weights)
        out = out[0] if weights else out
        assert torch.isfinite(out).all()
        (grad,) = torch.autograd.grad(out.square().sum(), bias)
        assert torch.isfinite(grad).all() and (grad[1, ..., 4:] == 0).all()
        b64 = bias.detach().double().requires_grad_()
        q64, k64, v64 = (t.double().nan_to_num() for t in (q, k, v))
        scores = (q64 @ k64.mT / 2 + b64).masked_fill(
            torch.arange(6) >= lengths[:, None, None, None], float("-inf")
        )
        expected = torch.softmax(scores, -1) @ v64
        (expected_grad,) = torch.autograd.grad(expected.square().sum(), b64)
        torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-4, atol=1e-6)


def test_fullgraph_compile_with_a_bias() -> None:
    q, k, v = _inputs((2, 3))
    bias = torch.randn(2, 1, 5, 6)
    attend = torch.ones(2, 1, 5, 6, dtype=torch.bool).tril()

    def fn(q, k, v, bias, attend):
        return dot_product_attention(q, k, v, score_bias=bias, attend_mask=attend)

    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, bias, attend), fn(q, k, v, bias, attend))


def test_bad_biases_are_refused() -> None:
    q, k, v = _inputs((2,))
    with pytest.raises(TypeError, match=r"`score_bias` .* got torch.bool .* `attend_mask`"):
        dot_product_attention(q, k, v, score_bias=torch.ones(5, 6, dtype=torch.bool))
    with pytest.raises(
        TypeError, match=r"`score_bias` to have a floating-point dtype, but got torch.int64"
    ):
        dot_product_attention(q, k, v, score_bias=torch.ones(5, 6, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"`score_bias` broadcastable to .*\(2, 5, 6\).* shape \(5, 5\)"
    ):
        dot_product_attention(q, k, v, score_bias=torch.zeros(5, 5))
    with pytest.raises(ValueError, match=r"`score_bias` broadcastable .* shape \(3, 5, 6\)"):
        dot_product_attention(q, k, v, score_bias=torch.zeros(3, 5, 6))
    with pytest.raises(TypeError, match=r"Expected `score_bias` to be a torch.Tensor"):
        dot_product_attention(q, k, v, score_bias=[0.0])


def test_torch_export_with_a_bias() -> None:
    q, k, v = _inputs((2, 3))
    bias = torch.randn(2, 1, 5, 6)
    attend = torch.rand(2, 1, 5, 6, generator=torch.Generator().manual_seed(3)) > 0.3

    class Attend(torch.nn.Module):
        def forward(self, q, k, v, bias, attend):
            return dot_product_attention(q, k, v, score_bias=bias, attend_mask=attend)

    program = torch.export.export(Attend(), (q, k, v, bias, attend))
    allowed = attend.expand(2, 3, 5, 6).numpy()
    _close(program.module()(q, k, v, bias, attend), _expected(q, k, v, bias, allowed)[0])


def test_nan_in_an_attended_value_reaches_only_its_feature() -> None:
    # Inputs that are not finite take the plain formulation, bias included.
    q, k, v = _inputs((2, 3))
    v[0, 1, 2, 1] = float("nan")
    bias = torch.randn(5, 6)
    allowed = torch.ones(5, 6, dtype=torch.bool).tril(1)
    out = dot_product_attention(q, k, v, score_bias=bias, attend_mask=allowed)
    nan = torch.zeros(out.shape, dtype=torch.bool)
    nan[0, 1, 1:, 1] = True  # queries 1.. attend key 2 (tril(1))
    assert torch.equal(torch.isnan(out), nan)
    expected, _ = _expected(q, k, v.nan_to_num(), bias, allowed.numpy())
    torch.testing.assert_close(out[~nan].double(), expected[~nan], rtol=1e-5, atol=1e-6)
