"""Every layer against the float64 NumPy reference, with every mask kind, in every dtype;
exact zero rows; NaN in padding; dropout."""

from __future__ import annotations

import attnscore_keras as ak
import keras
import numpy as np
import pytest

import reference as ref
from conftest import tensor, to_np

B, N, M, D, V = 2, 3, 5, 4, 6
LENS = np.array([2, 0])  # example 1 attends nothing
QUERY_LENS = np.array([[1, 5, 0], [4, 3, 2]])
MASKS = {
    "none": {},
    "lens": {"valid_lens": LENS},
    "lens_per_query": {"valid_lens": QUERY_LENS},
    "query_lens": {"query_valid_lens": np.array([2, 1])},
    "attend_mask": {"attend_mask": np.random.default_rng(1).random((B, N, M)) < 0.6},
    "causal": {"causal": True},
    "all": {
        "valid_lens": np.array([4, 3]),
        "query_valid_lens": np.array([3, 2]),
        "attend_mask": np.random.default_rng(2).random((N, M)) < 0.7,
        "causal": True,
    },
}
TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 1e-2, "bfloat16": 6e-2}
KINDS = ["dot", "additive", "general", "cosine"]


def make(kind, dtype):
    if kind == "dot":
        return ak.DotProductAttention(dtype=dtype)
    if kind == "additive":
        return ak.AdditiveAttention(D, D, 8, bias=True, dtype=dtype)
    if kind == "general":
        return ak.MultiplicativeAttention(D, D, dtype=dtype)
    return ak.CosineAttention(scale=4.0, dtype=dtype)


def reference_scores(layer, q, k):
    if isinstance(layer, ak.DotProductAttention):
        return ref.dot_scores(q, k, layer.scale)
    if isinstance(layer, ak.AdditiveAttention):
        b = None if layer.b is None else to_np(layer.b)
        return ref.additive_scores(q, k, to_np(layer.W_q), to_np(layer.W_k), to_np(layer.w_v), b)
    if isinstance(layer, ak.MultiplicativeAttention):
        return ref.general_scores(q, k, to_np(layer.W_a))
    return ref.cosine_scores(q, k, np.exp(to_np(layer.log_scale)))


def mask_kwargs(masks):
    return {
        key: (v if isinstance(v, bool) else keras.ops.convert_to_tensor(v))
        for key, v in masks.items()
    }


def numpy_allowed(masks, B, n, m):
    return ref.allowed(
        B, n, m,
        lens=None if "valid_lens" not in masks else [
            np.full(n, lb) if np.ndim(lb) == 0 else lb for lb in masks["valid_lens"]
        ],
        qlens=masks.get("query_valid_lens"),
        attend=masks.get("attend_mask"),
        causal=masks.get("causal", False),
    )  # fmt: skip


# float32: every mask kind; float64 (exactness) and 16 bits (float32 softmax): two each
CASES = [(m, "float32") for m in MASKS] + [
    (m, dt) for dt in ("float64", "float16", "bfloat16") for m in ("lens_per_query", "all")
]


@pytest.mark.parametrize(("mask", "dtype"), CASES, ids=[f"{m}-{dt}" for m, dt in CASES])
@pytest.mark.parametrize("kind", KINDS)
def test_layer_matches_the_float64_reference(kind, mask, dtype, rng, padding_path):
    q, k, v = rng.normal(size=(B, N, D)), rng.normal(size=(B, M, D)), rng.normal(size=(B, M, V))
    layer = make(kind, dtype)
    masks = MASKS[mask]
    out = layer(tensor(q, dtype), tensor(k, dtype), tensor(v, dtype), **mask_kwargs(masks))
    assert keras.backend.standardize_dtype(out.dtype) == dtype
    # the reference sees the inputs as the layer saw them (rounded to its dtype)
    q16, k16, v16 = (to_np(tensor(x, dtype)) for x in (q, k, v))
    ok = numpy_allowed(masks, B, N, M)
    expected, weights = ref.attention(reference_scores(layer, q16, k16), ok, v16)
    np.testing.assert_allclose(to_np(out), expected, atol=TOL[dtype], rtol=TOL[dtype])
    np.testing.assert_allclose(to_np(layer.attention_weights), weights, atol=TOL[dtype])
    # exactly zero where not allowed, and rows with nothing allowed are zero rows
    assert np.all(to_np(layer.attention_weights)[~ok] == 0)
    empty = ~ok.any(-1)
    assert np.all(to_np(out)[empty] == 0)


@pytest.mark.parametrize("kind", KINDS)
def test_heads_layout_and_lengths_per_head(kind, rng, padding_path):
    """(B, H, n, d) inputs, lengths (B,), (B, n) and (B, H, n)."""
    H = 2
    q, k, v = (rng.normal(size=(B, H, s, d)) for s, d in ((N, D), (M, D), (M, V)))
    layer = make(kind, "float64")
    for lens in (np.array([3, 1]), QUERY_LENS, rng.integers(0, M + 2, size=(B, H, N))):
        out = layer(tensor(q, "float64"), tensor(k, "float64"), tensor(v, "float64"), lens)
        full = np.broadcast_to(
            lens.reshape(B, 1, 1) if lens.ndim == 1 else lens[:, None] if lens.ndim == 2 else lens,
            (B, H, N),
        )
        ok = np.arange(M) < full[..., None]
        expected, _ = ref.attention(reference_scores(layer, q, k), ok, v)
        np.testing.assert_allclose(to_np(out), expected, atol=1e-12)


def _multihead_reference(mha, H, E, q, k, v, masks):
    """(output, weights, allowed) of ``mha``'s maths in NumPy float64 on its own weights
    and the inputs q, k, v: heads projected, the float64 reference attention, W_o."""

    def heads(x, w, b):
        y = x @ to_np(w) + to_np(b)
        return y.reshape(B, -1, H, E // H).transpose(0, 2, 1, 3)

    qh, kh, vh = heads(q, mha.W_q, mha.b_q), heads(k, mha.W_k, mha.b_k), heads(v, mha.W_v, mha.b_v)
    ok = numpy_allowed(masks, B, N, M)[:, None]
    o, w = ref.attention(reference_scores(mha.attention, qh, kh), ok, vh)
    expected = o.transpose(0, 2, 1, 3).reshape(B, N, E) @ to_np(mha.W_o) + to_np(mha.b_o)
    return expected, w, ok


@pytest.mark.parametrize("scoring", ["scaled_dot", "dot", "additive", "general", "cosine"])
@pytest.mark.parametrize("mask", ["none", "lens", "lens_per_query", "all"])
def test_multihead_matches_the_float64_reference(scoring, mask, rng):
    H, E = 2, 8
    q, k, v = rng.normal(size=(B, N, 5)), rng.normal(size=(B, M, 3)), rng.normal(size=(B, M, 7))
    mha = ak.MultiHeadAttention(E, H, bias=True, scoring=scoring, dtype="float64")
    masks = MASKS[mask]
    out = mha(
        tensor(q, "float64"), tensor(k, "float64"), tensor(v, "float64"), **mask_kwargs(masks)
    )

    expected, w, _ = _multihead_reference(mha, H, E, q, k, v, masks)
    np.testing.assert_allclose(to_np(out), expected, atol=1e-12)
    np.testing.assert_allclose(to_np(mha.attention_weights), np.broadcast_to(w, (B, H, N, M)))


# Every scorer in every dtype: a scorer with weights takes the layer's dtype policy (its
# weights were float32 in a 16-bit layer, and TensorFlow refused to add them to 16 bits).
MHA_DTYPE_CASES = [
    (scoring, dt)
    for scoring in ("scaled_dot", "additive", "general", "cosine")
    for dt in ("float32", "float16", "bfloat16")
]


@pytest.mark.parametrize(("scoring", "dtype"), MHA_DTYPE_CASES)
@pytest.mark.parametrize("mask", ["lens", "lens_per_query", "all"])
def test_multihead_in_every_dtype_matches_the_float64_reference(scoring, mask, dtype, rng):
    """Multi-head attention in float32 and 16 bits (softmax in float32) against the float64
    reference on the layer's own rounded weights and inputs: queries with no key get a
    zero attention output (the result is b_o, bit for bit) and exactly zero weights."""
    H, E = 2, 8
    q, k, v = rng.normal(size=(B, N, 5)), rng.normal(size=(B, M, 3)), rng.normal(size=(B, M, 7))
    mha = ak.MultiHeadAttention(E, H, bias=True, scoring=scoring, dtype=dtype)
    masks = MASKS[mask]
    args = [tensor(x, dtype) for x in (q, k, v)]
    out = to_np(mha(*args, **mask_kwargs(masks)))
    q, k, v = (to_np(x) for x in args)

    expected, w, ok = _multihead_reference(mha, H, E, q, k, v, masks)
    np.testing.assert_allclose(out, expected, atol=4 * TOL[dtype], rtol=4 * TOL[dtype])
    weights = to_np(mha.attention_weights)
    np.testing.assert_allclose(weights, np.broadcast_to(w, weights.shape), atol=TOL[dtype])
    assert np.all(weights[~np.broadcast_to(ok, weights.shape)] == 0)
    empty = ~ok[:, 0].any(-1)
    assert empty.any()
    np.testing.assert_array_equal(out[empty], np.broadcast_to(to_np(mha.b_o), out[empty].shape))


@pytest.mark.parametrize("kind", [*KINDS, "multihead"])
def test_nan_in_padding_reaches_no_output(kind, rng, padding_path):
    q, k, v = rng.normal(size=(B, N, D)), rng.normal(size=(B, M, D)), rng.normal(size=(B, M, D))
    lens = np.array([2, 4])
    k[0, 2:], v[0, 2:], k[1, 4], v[1, 4] = np.nan, np.inf, np.nan, np.nan
    layer = ak.MultiHeadAttention(4, 2, bias=True) if kind == "multihead" else make(kind, "float32")
    out = layer(tensor(q, "float32"), tensor(k, "float32"), tensor(v, "float32"), lens)
    assert np.isfinite(to_np(out)).all()
    clean = k.copy(), v.copy()
    for x in clean:
        x[~np.isfinite(x)] = 7.0
    same = layer(
        tensor(q, "float32"), tensor(clean[0], "float32"), tensor(clean[1], "float32"), lens
    )
    np.testing.assert_array_equal(to_np(out), to_np(same))


def test_masked_softmax_textbook_cases():
    X = tensor(np.random.default_rng(3).random((2, 2, 4)), "float32")
    w = to_np(ak.masked_softmax(X, np.array([2, 3])))
    assert np.all(w[0, :, 2:] == 0) and np.all(w[1, :, 3:] == 0)
    np.testing.assert_allclose(w.sum(-1), 1, rtol=1e-6)
    w = to_np(ak.masked_softmax(X, np.array([[1, 3], [2, 0]])))
    np.testing.assert_array_equal(w[0, 0], [1, 0, 0, 0])
    np.testing.assert_array_equal(w[1, 1], [0, 0, 0, 0])
    np.testing.assert_allclose(to_np(ak.masked_softmax(X)).sum(-1), 1, rtol=1e-6)
    # float lengths of whole numbers, lengths above m
    w2 = to_np(ak.masked_softmax(X, np.array([2.0, 9.0])))
    np.testing.assert_allclose(w2[1].sum(-1), 1, rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_masked_softmax_sixteen_bits_large_scores(dtype):
    """Scores near the dtype's largest value: no overflow, no NaN, exact zeros."""
    big = 6e4 if dtype == "float16" else 3e38
    X = np.array([[[big, -big, 0.0, big]]])
    w = to_np(ak.masked_softmax(tensor(X, dtype), np.array([3])))
    np.testing.assert_array_equal(w, [[[1.0, 0.0, 0.0, 0.0]]])


def test_sequence_mask():
    out = to_np(ak.sequence_mask(np.ones((2, 3)), np.array([1, 2]), value=-1))
    np.testing.assert_array_equal(out, [[1, -1, -1], [1, 1, -1]])


def test_dropout_on_the_weights_in_training_only(rng, padding_path):
    q, k, v = rng.normal(size=(4, 6, D)), rng.normal(size=(4, 8, D)), rng.normal(size=(4, 8, V))
    layer = ak.DotProductAttention(dropout=0.5, dtype="float64")
    args = (tensor(q, "float64"), tensor(k, "float64"), tensor(v, "float64"))
    eval_out = to_np(layer(*args))
    np.testing.assert_array_equal(eval_out, to_np(layer(*args, training=False)))
    train_out = to_np(layer(*args, training=True))
    assert not np.allclose(train_out, eval_out)
    # weights stay the pre-dropout ones; the output is dropped weights (x2) @ values
    w = to_np(layer.attention_weights)
    np.testing.assert_allclose(w.sum(-1), 1)
    assert np.isfinite(train_out).all()


ONE_QUERY_MASKS = {
    "lens": {"valid_lens": np.array([3, 0])},
    "lens_per_query": {"valid_lens": np.array([[5], [2]])},
    "query_lens": {"valid_lens": np.array([4, 5]), "query_valid_lens": np.array([0, 1])},
    "attend_mask": {"attend_mask": np.array([[[True, False, True, True, False]]] * B)},
    "attend_mask_shared": {"attend_mask": np.array([[False, True, True, False, True]])},
    "causal": {"causal": True, "valid_lens": np.array([3, 1])},
    "all": {
        "valid_lens": np.array([4, 2]),
        "query_valid_lens": np.array([1, 1]),
        "attend_mask": np.array([[True, True, False, True, True]]),
    },
}


@pytest.mark.parametrize("compile_it", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mask", list(ONE_QUERY_MASKS))
def test_one_query_matches_the_float64_reference(mask, dtype, compile_it, rng, one_query_path):
    """A decoder step (n = 1) through each of the dot layer's two paths, every mask kind,
    (B, 1, d) and (B, H, 1, d) queries: outputs and weights against the float64
    reference, exact zero rows where nothing is allowed."""
    from conftest import compiled

    masks = ONE_QUERY_MASKS[mask]
    for heads in (None, 2):
        lead = (B,) if heads is None else (B, heads)
        q, k, v = (rng.normal(size=(*lead, s, d)) for s, d in ((1, D), (M, D), (M, V)))
        layer = ak.DotProductAttention(dtype=dtype)

        def call(qx, kx, vx, layer=layer, masks=masks):
            return layer(qx, kx, vx, **mask_kwargs(masks))

        fn = compiled(call) if compile_it else call
        out = to_np(fn(*(tensor(x, dtype) for x in (q, k, v))))
        ok = numpy_allowed(masks, B, 1, M)
        if heads is not None:
            ok = np.broadcast_to(ok[:, None], (B, heads, 1, M))
        qr, kr, vr = (to_np(tensor(x, dtype)) for x in (q, k, v))
        expected, weights = ref.attention(ref.dot_scores(qr, kr), ok, vr)
        np.testing.assert_allclose(out, expected, atol=TOL[dtype], rtol=TOL[dtype])
        if not compile_it:
            np.testing.assert_allclose(to_np(layer.attention_weights), weights, atol=TOL[dtype])
        assert np.all(out[~ok.any(-1)] == 0)
