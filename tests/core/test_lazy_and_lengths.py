"""Never-called lazy modules move (``.to``, ``.to_empty``) and save as plain tensors; one
``int`` key length serves every example; ``attention_weights`` under threads."""

from __future__ import annotations

import io
import threading

import pytest
import torch

import attnscore
from attnscore import AdditiveAttention, DotProductAttention, MultiHeadAttention


def _plain_attention(q, k, v, lens):
    """The textbook's computation in float64, written here: scaled dot product, keys at or
    past each example's length masked out."""
    scores = q.double() @ k.double().mT / q.shape[-1] ** 0.5
    keep = torch.arange(k.shape[-2]) < lens.view(-1, *(1,) * (scores.ndim - 1))
    weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1)
    return weights @ v.double()


def test_never_called_multihead_moves_to_meta_and_runs_there():
    mha = MultiHeadAttention(4, 2).to("meta")
    q = torch.randn(2, 3, 5, device="meta")
    out = mha(q, q, q)
    assert out.shape == (2, 3, 4) and out.device.type == "meta"
    assert mha.W_q.weight.shape == (4, 5) and mha.W_q.weight.device.type == "meta"


def test_never_called_modules_to_empty_and_to_dtype_stay_lazy():
    mha = MultiHeadAttention(4, 2).to_empty(device="cpu")
    q, kv = torch.randn(2, 3, 5), torch.randn(2, 6, 7)
    assert mha(q, kv, kv).shape == (2, 3, 4) and mha.W_k.weight.shape == (4, 7)
    additive = AdditiveAttention(num_hiddens=8).to(torch.float64)
    out = additive(q.double(), kv.double(), kv.double())
    assert out.dtype == torch.float64 and additive.W_k.weight.dtype == torch.float64


@pytest.mark.parametrize(
    "make", [lambda: MultiHeadAttention(4, 2), lambda: AdditiveAttention(num_hiddens=8)]
)
def test_a_never_called_module_saves_and_loads_with_weights_only(make):
    buffer = io.BytesIO()
    torch.save(make().state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert all(isinstance(t, torch.Tensor) for t in state.values())
    fresh = make()
    fresh.load_state_dict(state)  # strict: nothing missing, it stays lazy
    q, kv = torch.randn(2, 3, 4), torch.randn(2, 6, 4)
    assert fresh(q, kv, kv).shape[:2] == (2, 3)
    with pytest.raises(RuntimeError, match="Missing key"):
        fresh.load_state_dict(state)  # a called module has weights: the file has none


def test_one_int_length_serves_every_example():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 4), torch.randn(3, 6, 4), torch.randn(3, 6, 5)
    expected = _plain_attention(q, k, v, torch.tensor([4, 4, 4]))
    for out in (
        DotProductAttention()(q, k, v, 4),
        attnscore.dot_product_attention(q, k, v, 4),
        attnscore.attention(q, k, v, "scaled_dot", 4),
    ):
        torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=1e-5)
    weights = attnscore.masked_softmax(torch.zeros(3, 2, 6), 2)
    torch.testing.assert_close(weights[..., :2], torch.full((3, 2, 2), 0.5))
    assert weights[..., 2:].abs().sum() == 0
    mha = MultiHeadAttention(4, 2, query_size=4).eval()
    torch.testing.assert_close(mha(q, k, k, 4), mha(q, k, k, torch.tensor([4, 4, 4])))


@pytest.mark.parametrize("bad", [-1, True, 2.5])
def test_a_bad_scalar_length_is_refused_naming_it(bad):
    q = torch.randn(2, 1, 4)
    with pytest.raises((TypeError, ValueError), match="Expected `valid_lens`"):
        DotProductAttention()(q, q, q, bad)


def test_attention_weights_are_the_finished_calls_and_return_weights_is_per_call():
    """Threads sharing a module: each call's own weights come back with return_weights;
    the attribute holds a finished call's weights once every call has returned."""
    module = DotProductAttention().eval()
    torch.manual_seed(0)
    inputs = [(torch.randn(2, 3, 4), torch.randn(2, 5, 4)) for _ in range(4)]
    results: dict[int, torch.Tensor] = {}

    def call(i: int) -> None:
        q, k = inputs[i]
        for _ in range(20):
            _, weights = module(q, k, k, torch.tensor([2, 5]), return_weights=True)
            results[i] = weights

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (q, k) in enumerate(inputs):
        expected = DotProductAttention().eval()(q, k, k, torch.tensor([2, 5]), return_weights=True)
        torch.testing.assert_close(results[i], expected[1])
    assert any(torch.equal(module.attention_weights, results[i]) for i in results)
