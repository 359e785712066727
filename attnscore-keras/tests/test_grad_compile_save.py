"""Gradients against float64 finite differences; compiled calls (jax.jit,
tf.function(jit_compile=True)) against eager ones; get_config and model.save/load_model."""

from __future__ import annotations

import attnscore_keras as ak
import keras
import numpy as np
import pytest

from conftest import compiled, gradients, tensor, to_np

B, N, M, D = 2, 3, 4, 4
MASKS = {
    "lens": {"valid_lens": np.array([3, 0])},
    "all": {
        "valid_lens": np.array([[1, 4, 2], [3, 3, 0]]),
        "query_valid_lens": np.array([3, 2]),
        "causal": True,
    },
}


def layer_of(kind):
    return {
        "dot": lambda: ak.DotProductAttention(dtype="float64"),
        "additive": lambda: ak.AdditiveAttention(D, D, 5, normalize=True, dtype="float64"),
        "general": lambda: ak.MultiplicativeAttention(D, D, dtype="float64"),
        "cosine": lambda: ak.CosineAttention(learn_scale=True, dtype="float64"),
        "multihead": lambda: ak.MultiHeadAttention(4, 2, bias=True, dtype="float64"),
    }[kind]()


def _masks(masks):
    return {
        k: v if isinstance(v, bool) else keras.ops.convert_to_tensor(v) for k, v in masks.items()
    }


GRAD_CASES = [(kind, "all") for kind in ("dot", "additive", "general", "cosine", "multihead")]
GRAD_CASES += [("dot", "lens"), ("multihead", "lens")]


@pytest.mark.parametrize(("kind", "mask"), GRAD_CASES)
def test_gradients_match_float64_finite_differences(kind, mask, rng, padding_path):
    """The directional derivative along a random direction of the inputs and the weights
    together, against central differences."""
    layer = layer_of(kind)
    q, k, v = rng.normal(size=(B, N, D)), rng.normal(size=(B, M, D)), rng.normal(size=(B, M, D))
    masks = _masks(MASKS[mask])
    layer(tensor(q, "float64"), tensor(k, "float64"), tensor(v, "float64"), **masks)
    R = rng.normal(size=(B, N, layer.compute_output_shape((B, N, D), None, (B, M, D))[-1]))
    trainable = [to_np(w) for w in layer.trainable_variables]
    others = [w.value for w in layer.non_trainable_variables]

    def loss(*xs):
        qx, kx, vx, *ws = xs
        out, _ = layer.stateless_call(list(ws), others, qx, kx, vx, **masks)
        return keras.ops.sum(out * keras.ops.convert_to_tensor(R))

    args = [q, k, v, *trainable]
    grads = gradients(loss, [tensor(a, "float64") for a in args])
    for _ in range(1):  # one random direction: every entry of every gradient counts
        direction = [rng.normal(size=np.shape(a)) for a in args]
        eps = 1e-6

        def at(sign, direction=direction, eps=eps):
            moved = [
                tensor(a + sign * eps * d, "float64") for a, d in zip(args, direction, strict=True)
            ]
            return float(to_np(loss(*moved)))

        numeric = (at(1) - at(-1)) / (2 * eps)
        analytic = sum(float(np.sum(g * d)) for g, d in zip(grads, direction, strict=True))
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(numeric)), (numeric, analytic)
    assert all(np.isfinite(g).all() for g in grads)


def test_gradient_of_an_empty_row_is_zero_and_nan_padding_gives_finite_gradients(rng):
    layer = ak.MultiHeadAttention(4, 2, bias=True, dtype="float64")
    q, k, v = rng.normal(size=(B, N, D)), rng.normal(size=(B, M, D)), rng.normal(size=(B, M, D))
    k[0, 2:] = np.nan
    v[0, 2:] = np.inf
    q[1, 2] = np.nan  # beyond query_valid_lens
    masks = _masks({"valid_lens": np.array([2, 4]), "query_valid_lens": np.array([3, 2])})
    layer(tensor(q, "float64"), tensor(k, "float64"), tensor(v, "float64"), **masks)
    ws = [w.value for w in layer.trainable_variables]

    def loss(qx, kx, vx, *wx):
        out, _ = layer.stateless_call(list(wx), [], qx, kx, vx, **masks)
        return keras.ops.sum(out)

    grads = gradients(loss, [tensor(q, "float64"), tensor(k, "float64"), tensor(v, "float64"), *ws])
    assert all(np.isfinite(g).all() for g in grads)
    assert np.all(grads[1][0, 2:] == 0) and np.all(grads[2][0, 2:] == 0)


@pytest.mark.parametrize("compile_it", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", ["dot", "additive", "general", "cosine", "multihead"])
def test_nan_and_inf_in_padded_keys_and_values_reach_no_gradient(
    kind, compile_it, rng, padding_path
):
    """NaN and inf in the key and value rows no query attends (lengths (B,) with a 0, and
    (B, n)): the outputs and the gradients of queries, keys, values and weights are those
    of the same call with 7.0 there (bit for bit), the padded rows' gradients are 0, and a
    query that attends nothing has a zero output row and a zero gradient."""
    layer = layer_of(kind)
    q, k, v = rng.normal(size=(B, N, D)), rng.normal(size=(B, M, D)), rng.normal(size=(B, M, D))
    for lens in (np.array([2, 0]), np.array([[1, 2, 0], [3, 1, 2]])):
        longest = lens.reshape(B, -1).max(-1)
        bad_k, bad_v = k.copy(), v.copy()
        for b, used in enumerate(longest):
            bad_k[b, used:] = np.nan
            bad_v[b, used:] = [np.inf, -np.inf, np.nan, 1.0][:D] if b else np.nan
        clean_k, clean_v = (np.where(np.isfinite(x), x, 7.0) for x in (bad_k, bad_v))
        layer(tensor(q, "float64"), tensor(k, "float64"), tensor(v, "float64"), lens)
        ws = [w.value for w in layer.trainable_variables]
        R = keras.ops.convert_to_tensor(rng.normal(size=(B, N, D)))
        lens_t = keras.ops.convert_to_tensor(lens)

        def loss(qx, kx, vx, *wx, lens_t=lens_t, R=R):
            out, _ = layer.stateless_call(list(wx), [], qx, kx, vx, lens_t)
            return keras.ops.sum(out * R)

        fn = compiled(loss) if compile_it else loss
        grads = _same_as_clean(fn, q, (bad_k, bad_v), (clean_k, clean_v), ws)
        for b, used in enumerate(longest):
            assert np.all(grads[1][b, used:] == 0) and np.all(grads[2][b, used:] == 0)
        empty = np.broadcast_to(lens.reshape(B, -1), (B, N)) == 0
        assert np.all(grads[0][empty] == 0)
        out = layer(*(tensor(x, "float64") for x in (q, bad_k, bad_v)), lens)
        assert np.all(to_np(out)[empty] == 0) and np.isfinite(to_np(out)).all()


def _same_as_clean(fn, q, bad, clean, weights=()):
    """``fn(q, k, v, *weights)`` (a scalar loss, float64) on the keys and values ``bad``
    (NaN or inf in padded rows) and ``clean`` (7.0 there): the same finite value and, bit
    for bit, the same finite gradients (of q, k, v and the weights). Returns the bad
    call's gradients."""
    results = []
    for kx, vx in (bad, clean):
        args = [tensor(x, "float64") for x in (q, kx, vx)] + list(weights)
        results.append((to_np(fn(*args)), gradients(fn, args)))
    (value, grads), (clean_value, clean_grads) = results
    assert np.isfinite(value) and value == clean_value
    for g, clean_g in zip(grads, clean_grads, strict=True):
        assert np.isfinite(g).all()
        np.testing.assert_array_equal(g, clean_g)
    return grads


@pytest.mark.parametrize("compile_it", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", ["dot", "additive", "general", "cosine"])
def test_a_non_finite_query_with_no_key_gets_a_zero_row(kind, compile_it, rng, padding_path):
    """A query that may attend no key (key lengths (B,) with a 0) gets a zero output row
    even where it holds NaN or inf (the dot layer's "filled" scores are built from zeroed
    queries there), the other rows those of the call with 7.0 there, bit for bit; the
    dot layer's gradient of that query is zero too."""
    layer = layer_of(kind)
    q, k, v = rng.normal(size=(B, N, D)), rng.normal(size=(B, M, D)), rng.normal(size=(B, M, D))
    bad_q = q.copy()
    bad_q[1, 0], bad_q[1, 2, 1] = np.nan, -np.inf
    clean_q = np.where(np.isfinite(bad_q), bad_q, 7.0)
    lens = keras.ops.convert_to_tensor(np.array([3, 0]))
    layer(tensor(q, "float64"), tensor(k, "float64"), tensor(v, "float64"), lens)
    ws = [w.value for w in layer.trainable_variables]
    R = keras.ops.convert_to_tensor(rng.normal(size=(B, N, D)))

    def call(qx, kx, vx, *wx):
        out, _ = layer.stateless_call(list(wx), [], qx, kx, vx, lens)
        return out

    fn = compiled(call) if compile_it else call
    outs = [to_np(fn(*(tensor(x, "float64") for x in (qx, k, v)), *ws)) for qx in (bad_q, clean_q)]
    np.testing.assert_array_equal(outs[0], outs[1])
    assert np.all(outs[0][1] == 0)
    if kind == "dot":
        args = [tensor(x, "float64") for x in (bad_q, k, v)]
        grads = gradients(lambda *xs: keras.ops.sum(fn(*xs) * R), args)
        assert np.all(grads[0][1] == 0) and np.isfinite(grads[0]).all()


@pytest.mark.parametrize("compile_it", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("scale", [None, 1.0])
def test_one_query_with_nan_padding_matches_the_clean_call(scale, compile_it, rng, one_query_path):
    """A decoder step (n = 1, the dot layer's paths that run the softmax on (B, m), checked
    and unrolled): NaN and inf in the padded keys and values change no output and no
    gradient (bit for bit against 7.0 there), padded rows get zero gradients, a row with
    no key is zero."""
    layer = ak.DotProductAttention(scale=scale, dtype="float64")
    m = 5
    q, k, v = rng.normal(size=(B, 1, D)), rng.normal(size=(B, m, D)), rng.normal(size=(B, m, D))
    R = keras.ops.convert_to_tensor(rng.normal(size=(B, 1, D)))
    for lens in (np.array([3, 0]), np.array([[5], [2]])):
        used = lens.reshape(-1)
        bad_k, bad_v = k.copy(), v.copy()
        for b, n_used in enumerate(used):
            bad_k[b, n_used:] = np.nan
            bad_v[b, n_used:] = np.inf
        clean_k, clean_v = (np.where(np.isfinite(x), x, 7.0) for x in (bad_k, bad_v))
        lens_t = keras.ops.convert_to_tensor(lens)

        def loss(qx, kx, vx, lens_t=lens_t):
            return keras.ops.sum(layer(qx, kx, vx, lens_t) * R)

        fn = compiled(loss) if compile_it else loss
        grads = _same_as_clean(fn, q, (bad_k, bad_v), (clean_k, clean_v))
        for b, n_used in enumerate(used):
            assert np.all(grads[1][b, n_used:] == 0) and np.all(grads[2][b, n_used:] == 0)
        out = to_np(layer(*(tensor(x, "float64") for x in (q, bad_k, bad_v)), lens_t))
        assert np.isfinite(out).all()
        assert np.all(out[used == 0] == 0) and np.all(grads[0][used == 0] == 0)


@pytest.mark.parametrize("kind", ["dot", "additive", "general", "cosine", "multihead"])
def test_compiled_call_matches_eager(kind, rng, padding_path):
    layer = layer_of(kind)
    q, k, v = rng.normal(size=(B, N, D)), rng.normal(size=(B, M, D)), rng.normal(size=(B, M, D))
    args = [tensor(x, "float64") for x in (q, k, v)]
    lens = keras.ops.convert_to_tensor(np.array([[1, 4, 2], [3, 0, 0]]))
    attend = keras.ops.convert_to_tensor(rng.random((N, M)) < 0.8)
    eager = to_np(layer(*args, lens, attend_mask=attend, causal=True))
    fast = compiled(lambda q, k, v, lens, a: layer(q, k, v, lens, attend_mask=a, causal=True))
    np.testing.assert_allclose(to_np(fast(*args, lens, attend)), eager, atol=1e-12)


@pytest.mark.parametrize("kind", ["dot", "additive", "general", "cosine", "multihead"])
def test_get_config_round_trip(kind):
    layer = layer_of(kind)
    again = type(layer).from_config(layer.get_config())
    assert again.get_config() == layer.get_config()


def test_multihead_with_a_layer_as_scorer_serialises():
    mha = ak.MultiHeadAttention(4, 2, scoring=ak.AdditiveAttention(2, 2, 3, bias=True))
    again = ak.MultiHeadAttention.from_config(mha.get_config())
    assert isinstance(again.attention, ak.AdditiveAttention) and again.attention.bias


@pytest.mark.parametrize("scoring", ["scaled_dot", "additive"])
def test_model_saves_and_loads(scoring, tmp_path, rng):
    """A functional model with the layers, masks as inputs, saved as .keras and loaded."""
    q_in, kv_in = keras.Input((N, 6)), keras.Input((M, 6))
    lens_in = keras.Input((), dtype="int32")
    heads = ak.MultiHeadAttention(8, 2, dropout=0.1, bias=True, scoring=scoring)(
        q_in, kv_in, kv_in, lens_in, causal=True
    )
    pooled = ak.AdditiveAttention(8, 8, 4)(heads, heads, heads, lens_in)
    model = keras.Model([q_in, kv_in, lens_in], pooled)
    x = [rng.normal(size=(B, N, 6)).astype("float32"), rng.normal(size=(B, M, 6)).astype("float32"),
         np.array([2, 4], dtype="int32")]  # fmt: skip
    before = to_np(model.predict(x, verbose=0))
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(to_np(loaded.predict(x, verbose=0)), before)
    assert [w.name for w in loaded.weights] == [w.name for w in model.weights]


def test_a_model_trains(rng):
    """fit: dropout in training, gradients through the masks, a compiled train step."""
    q_in, lens_in = keras.Input((N, 4)), keras.Input((), dtype="int32")
    out = ak.MultiHeadAttention(4, 2, dropout=0.2, bias=True)(q_in, q_in, q_in, lens_in)
    model = keras.Model([q_in, lens_in], out)
    model.compile(optimizer="sgd", loss="mse")
    x = [rng.normal(size=(8, N, 4)).astype("float32"), rng.integers(0, N + 1, 8).astype("int32")]
    history = model.fit(x, np.zeros((8, N, 4), "float32"), epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


@pytest.mark.parametrize("mask", ["lens", "all"])
def test_one_query_gradients_match_float64_finite_differences(mask, rng, one_query_path):
    """A decoder step (n = 1) through each of the dot layer's two paths: the directional
    derivative of the queries, keys and values together against central differences,
    with every mask kind at once (key lengths, query lengths, attend mask)."""
    masks = _masks(
        {"valid_lens": np.array([3, 0])}
        if mask == "lens"
        else {
            "valid_lens": np.array([[4], [3]]),
            "query_valid_lens": np.array([1, 0]),
            "attend_mask": np.array([[True, False, True, True, True]]),
        }
    )
    m = 5
    args = [rng.normal(size=(B, 1, D)), rng.normal(size=(B, m, D)), rng.normal(size=(B, m, D))]
    R = keras.ops.convert_to_tensor(rng.normal(size=(B, 1, D)))
    layer = ak.DotProductAttention(dtype="float64")

    def loss(qx, kx, vx):
        return keras.ops.sum(layer(qx, kx, vx, **masks) * R)

    grads = gradients(loss, [tensor(a, "float64") for a in args])
    direction = [rng.normal(size=np.shape(a)) for a in args]
    eps = 1e-6

    def at(sign):
        moved = zip(args, direction, strict=True)
        return float(to_np(loss(*(tensor(a + sign * eps * d, "float64") for a, d in moved))))

    numeric = (at(1) - at(-1)) / (2 * eps)
    analytic = sum(float(np.sum(g * d)) for g, d in zip(grads, direction, strict=True))
    assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(numeric)), (numeric, analytic)
    assert all(np.isfinite(g).all() for g in grads)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="XLA's program read through JAX")
@pytest.mark.parametrize("m", [5, 48, 49])
def test_a_compiled_decoder_step_runs_no_conditional_up_to_the_unrolled_limit(m, rng):
    """The dot layer's compiled decoder step with key lengths takes the unrolled path (no
    conditional in the forward or the backward program) for up to UNROLLED_MAX_KEYS keys,
    and the checked path (conditionals) beyond."""
    import jax
    from attnscore_keras import layers

    layer = ak.DotProductAttention()
    q, k = (tensor(rng.normal(size=(B, s, D)), "float32") for s in (1, m))
    lens = keras.ops.convert_to_tensor(np.array([m, 2]))

    def loss(qx, kx, vx, lx):
        return keras.ops.sum(layer(qx, kx, vx, lx) ** 2)

    conditional = m > layers.UNROLLED_MAX_KEYS
    for fn in (jax.jit(lambda *a: layer(*a)), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))):
        text = fn.lower(q, k, k, lens).compile().as_text()
        assert ("conditional(" in text) == conditional
