"""Weights both ways with attnscore's PyTorch modules: from_torch / to_torch give equal
outputs and weights within 1e-5 in float32 (needs torch and attnscore)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from conftest import to_np

torch = pytest.importorskip("torch")
attnscore = pytest.importorskip("attnscore")

import attnscore_keras as ak  # noqa: E402

pytestmark = pytest.mark.torch
B, N, M = 2, 3, 5


def modules():
    torch.manual_seed(0)
    mha_tn = attnscore.MultiHeadAttention(8, 2, bias=True, query_size=6, key_size=4, value_size=3)
    return {
        "additive": (attnscore.AdditiveAttention(4, 6, 8), (6, 4, 3)),
        "additive_normalize": (attnscore.AdditiveAttention(4, 6, 8, normalize=True), (6, 4, 3)),
        "dot": (attnscore.DotProductAttention(), (4, 4, 3)),
        "dot_unscaled": (attnscore.DotProductAttention(scale=1.0), (4, 4, 3)),
        "general": (attnscore.MultiplicativeAttention(6, 4), (6, 4, 3)),
        "cosine": (attnscore.CosineAttention(scale=5.0, learn_scale=True), (4, 4, 3)),
        "multihead": (mha_tn, (6, 4, 3)),
        "multihead_additive": (
            attnscore.MultiHeadAttention(8, 2, scoring="additive", query_size=6),
            (6, 6, 6),
        ),
        "torch_nn_mha": (torch.nn.MultiheadAttention(8, 2, batch_first=True), (8, 8, 8)),
    }


MASKS = {
    "none": {},
    "lens": {"valid_lens": np.array([2, 0])},
    "all": {"valid_lens": np.array([[1, 4, 2], [3, 5, 0]]), "query_valid_lens": np.array([3, 2]),
            "causal": True},
}  # fmt: skip


def _torch_masks(masks):
    return {k: v if isinstance(v, bool) else torch.as_tensor(v) for k, v in masks.items()}


def _keras_masks(masks):
    return {
        k: v if isinstance(v, bool) else keras.ops.convert_to_tensor(v) for k, v in masks.items()
    }


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("name", list(modules()))
def test_from_torch_then_to_torch(name, mask):
    module, (q, k, v) = modules()[name]
    module.eval()
    if isinstance(module, torch.nn.MultiheadAttention):
        module = attnscore.MultiHeadAttention.from_torch(module)
    rng = np.random.default_rng(1)
    x = [rng.normal(size=(B, N, q)), rng.normal(size=(B, M, k)), rng.normal(size=(B, M, v))]
    x = [a.astype("float32") for a in x]
    masks = MASKS[mask]
    with torch.no_grad():
        expected = module(*(torch.from_numpy(a) for a in x), **_torch_masks(masks)).numpy()
    layer = ak.from_torch(module)
    got = to_np(layer(*x, **_keras_masks(masks)))
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    np.testing.assert_allclose(
        to_np(layer.attention_weights), module.attention_weights.numpy(), atol=1e-5, rtol=0
    )
    back = ak.to_torch(layer)
    ours = dict(module.state_dict())
    theirs = dict(back.state_dict())
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    with torch.no_grad():
        again = back(*(torch.from_numpy(a) for a in x), **_torch_masks(masks)).numpy()
    np.testing.assert_allclose(again, expected, atol=1e-6, rtol=0)


def test_to_torch_of_a_keras_trained_layer():
    layer = ak.MultiHeadAttention(8, 2, bias=True, scoring="general")
    x = np.random.default_rng(2).normal(size=(B, N, 8)).astype("float32")
    out = to_np(layer(x, x, x, np.array([3, 1])))
    module = ak.to_torch(layer)
    with torch.no_grad():
        expected = module(*(torch.from_numpy(x),) * 3, torch.tensor([3, 1])).numpy()
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=0)


def test_bad_modules_and_layers():
    with pytest.raises(TypeError, match=r"Expected `module` to be one of .* but got Linear"):
        ak.from_torch(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="Expected `module` with the softmax"):
        ak.from_torch(attnscore.DotProductAttention(normalizer="hardmax"))
    with pytest.raises(ValueError, match="Expected a built `layer`"):
        ak.to_torch(ak.AdditiveAttention(num_hiddens=3))
    with pytest.raises(TypeError, match="Expected `layer`"):
        ak.to_torch(keras.layers.Dense(2))
