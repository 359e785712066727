"""Shared helpers: the backend under test, seeded data, NumPy views, gradients.

Run once per backend: ``KERAS_BACKEND=jax python -m pytest`` and
``KERAS_BACKEND=tensorflow python -m pytest`` (from attnscore-keras/).
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_ENABLE_X64", "1")  # the float64 references and gradients

import keras
import numpy as np
import pytest

BACKEND = keras.backend.backend()


def pytest_report_header(config):
    return f"keras {keras.__version__}, backend {BACKEND}"


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(params=["checked", "zeroed", "filled"])
def padding_path(request, monkeypatch):
    """Each of the ways a layer keeps NaN in unattended key and value rows out of its
    results, whatever n is and on every backend: "checked" (the products are checked, the
    path of calls with few queries), "zeroed" (the path of calls with many: the value
    rows are zeroed first, the key rows in the backward pass, the scores masked by a
    select) and "filled" (as "zeroed", but ``DotProductAttention`` with a mask of one row
    for every query zeroes the key rows and the queries of rows with no key first and
    adds FILL to the scores, as on JAX; other layers and masks as "zeroed")."""
    from attnscore_keras import layers

    limit = 10**9 if request.param == "checked" else -1
    monkeypatch.setattr(layers, "CHECKED_MAX_QUERIES", limit)
    filled = (BACKEND,) if request.param == "filled" else ()
    monkeypatch.setattr(layers, "FILLED_SCORES_BACKENDS", filled)
    return request.param


@pytest.fixture(params=["checked", "unrolled"])
def one_query_path(request, monkeypatch):
    """Each of the two ways ``DotProductAttention`` keeps NaN in unattended key and value
    rows out of a call with one query (float32, float64): "checked" (the products are
    checked, redone where not finite) and "unrolled" (the products written out key by
    key with the select inside, which a compiled JAX call with few keys takes), in eager
    and compiled calls alike, on every backend."""
    from attnscore_keras import layers

    if request.param == "checked":
        monkeypatch.setattr(layers, "UNROLLED_MAX_KEYS", -1)
    else:
        monkeypatch.setattr(layers, "staged", lambda: True)
    return request.param


def to_np(x):
    """A tensor (any backend, any float dtype) as a float64 NumPy array."""
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(x, "float64")))


def tensor(x, dtype):
    return keras.ops.convert_to_tensor(np.asarray(x, dtype=np.float64), dtype=dtype)


def gradients(fn, args):
    """The gradients of the scalar ``fn(*args)`` with respect to every tensor in ``args``
    (a list), as float64 NumPy arrays, by the backend's own autodiff."""
    if BACKEND == "jax":
        import jax

        grads = jax.grad(lambda xs: fn(*xs))(list(args))
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        xs = [tf.convert_to_tensor(a) for a in args]
        with tf.GradientTape() as tape:
            tape.watch(xs)
            y = fn(*xs)
        grads = tape.gradient(y, xs)
    else:  # torch backend
        import torch

        xs = [torch.as_tensor(a).clone().requires_grad_(True) for a in args]
        grads = torch.autograd.grad(fn(*xs), xs)
    return [to_np(g) for g in grads]


def compiled(fn):
    """``fn`` compiled by the backend: ``jax.jit`` or ``tf.function(jit_compile=True)``."""
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn, jit_compile=True)
    import torch

    return torch.compile(fn)
