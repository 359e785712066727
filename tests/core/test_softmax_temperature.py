"""The softmax with a temperature (``attnscore.Softmax``): a normalizer with a parameter,
softmax-like, so the fused paths run it.

Every output, gradient and kept weight is held against the masked softmax of scores / T
written here in float64 (the textbook formulation: fill the masked scores, softmax, weight
the values); ``attnscore.explain`` shows that the implementations the plain softmax gets
run it too.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnscore
from attnscore import Softmax
from attnscore.normalizers import score_factor
from paths import ref_additive, ref_cosine, ref_dot, ref_general

B, N, M, D = 3, 5, 7, 8


def _inputs(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, M, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, M, D, generator=gen, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _allowed(mask_kind, valid_lens):
    """Bool (B, N, M): the keys each query may attend."""
    allowed = torch.ones(B, N, M, dtype=torch.bool)
    if mask_kind in ("lengths", "causal + lengths"):
        allowed &= torch.arange(M) < valid_lens.view(B, 1, 1)
    if mask_kind in ("causal", "causal + lengths"):
        allowed &= torch.arange(M) <= torch.arange(N).view(N, 1)
    return allowed


def _reference(scores, allowed, v, temperature):
    """softmax(scores / T) over the allowed keys, float64; rows with none: zeros."""
    filled = (scores / temperature).masked_fill(~allowed, -math.inf)
    weights = torch.softmax(filled, -1).nan_to_num(0.0)
    return weights @ v, weights


_SCORES = {"dot": ref_dot(None), "general": ref_general, "cosine": ref_cosine}


def _scores(name, q, k, module):
    """The scorer's own scores in float64, from the module's parameters (tests/paths.py)."""
    params = {n: t.double() for n, t in [*module.named_parameters(), *module.named_buffers()]}
    return _SCORES.get(name, ref_additive)(params, q, k)


def _module(name, temperature):
    normalizer = Softmax(temperature)
    if name == "dot":
        return attnscore.DotProductAttention(normalizer=normalizer)
    if name == "general":
        return attnscore.MultiplicativeAttention(D, D, normalizer=normalizer)
    if name == "cosine":
        return attnscore.CosineAttention(normalizer=normalizer)
    return attnscore.AdditiveAttention(D, D, 6, normalizer=normalizer)


@pytest.mark.parametrize("name", ["dot", "general", "cosine", "additive"])
@pytest.mark.parametrize("mask_kind", ["none", "lengths", "causal", "causal + lengths"])
@pytest.mark.parametrize("temperature", [0.25, 3.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_outputs_gradients_and_weights_match_the_tempered_softmax(
    name, mask_kind, temperature, dtype
):
    torch.manual_seed(0)
    module = _module(name, temperature).to(dtype)
    q, k, v = _inputs(dtype)
    valid_lens = torch.tensor([0, 4, 7])
    options = {"causal": True} if "causal" in mask_kind else {}
    lens = valid_lens if "lengths" in mask_kind else None
    out = module(q, k, v, lens, **options)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (out.double() * grad).sum().backward()

    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    scores = _scores(name, ref_in[0], ref_in[1], module)
    want, weights = _reference(scores, _allowed(mask_kind, valid_lens), ref_in[2], temperature)
    (want * grad).sum().backward()
    tol = {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 2e-4, "atol": 2e-5}
    torch.testing.assert_close(out.double(), want.detach(), **tol)
    torch.testing.assert_close(module.attention_weights.double(), weights.detach(), **tol)
    for got, ref in zip((q, k, v), ref_in, strict=True):
        torch.testing.assert_close(got.grad.double(), ref.grad, **tol)


@pytest.mark.parametrize("name", ["dot", "general", "cosine"])
@pytest.mark.parametrize("training", [False, True])
def test_the_fused_paths_run_it(name, training):
    """The implementations that run the plain softmax's call run the tempered one's."""
    q, k, v = _inputs(torch.float32)
    lens = torch.tensor([2, 5, 7])
    with torch.set_grad_enabled(training):
        tempered = attnscore.explain(_module(name, 2.0), q, k, v, lens).chosen
        plain = attnscore.explain(_module(name, 1.0), q, k, v, lens).chosen
    assert tempered == plain != []


def test_functional_form_with_score_bias():
    """``attnscore.dot_product_attention`` with a score bias: softmax((scores + bias) / T)."""
    q, k, v = _inputs()
    bias = torch.randn(B, N, M, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    lens = torch.tensor([1, 4, 7])
    out = attnscore.dot_product_attention(q, k, v, lens, score_bias=bias, normalizer=Softmax(0.5))
    scores = q.detach() @ k.detach().mT / math.sqrt(D) + bias
    want, _ = _reference(scores, _allowed("lengths", lens), v.detach(), 0.5)
    torch.testing.assert_close(out.detach(), want, rtol=1e-10, atol=1e-10)


def test_temperature_one_is_the_softmax_and_the_factor():
    q, k, v = _inputs()
    lens = torch.tensor([3, 0, 7])
    one = attnscore.DotProductAttention(normalizer=Softmax(1.0))(q, k, v, lens)
    torch.testing.assert_close(one, attnscore.DotProductAttention()(q, k, v, lens))
    assert score_factor(Softmax(4.0)) == 0.25
    assert score_factor(attnscore.normalizers.hardmax) is None
    assert Softmax(2) == Softmax(2.0) and Softmax(2.0) != Softmax(3.0)


@pytest.mark.parametrize(
    ("temperature", "error", "words"),
    [
        (0.0, ValueError, "`temperature` > 0 and finite, but got 0.0"),
        (-1.0, ValueError, "`temperature` > 0 and finite, but got -1.0"),
        (math.inf, ValueError, "`temperature` > 0 and finite, but got inf"),
        (math.nan, ValueError, "`temperature` > 0 and finite, but got nan"),
        ("2", TypeError, "`temperature` to be a real number, but got str"),
        (True, TypeError, "`temperature` to be a real number, but got bool"),
    ],
)
def test_bad_temperatures_are_refused(temperature, error, words):
    with pytest.raises(error, match=words):
        Softmax(temperature)
