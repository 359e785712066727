"""Weights both ways between attnscore's PyTorch modules and these Keras layers.

torch and attnscore are imported inside :func:`from_torch` and :func:`to_torch` only: the
package itself needs neither.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

from .layers import (
    AdditiveAttention,
    Attention,
    CosineAttention,
    DotProductAttention,
    MultiplicativeAttention,
)
from .multihead import MultiHeadAttention

__all__ = ["from_torch", "to_torch"]

_TORCH_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _numpy(tensor: Any) -> np.ndarray:
    """A torch tensor's values as a float64 NumPy array (exact for every float dtype)."""
    import torch

    return tensor.detach().to(device="cpu", dtype=torch.float64).numpy()


def _assign(variable: Any, value: np.ndarray, name: str) -> None:
    if tuple(variable.shape) != value.shape:
        raise ValueError(
            f"Expected `{name}` of shape {tuple(variable.shape)}, but got {value.shape} instead."
        )
    variable.assign(ops.cast(ops.convert_to_tensor(value), variable.dtype))


def _torch_dtype(module: Any) -> str:
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_floating_point():
            return str(tensor.dtype).removeprefix("torch.")
    return "float32"


def _sized(linear: Any, owner: str) -> Any:
    import torch

    if isinstance(linear, torch.nn.LazyLinear) and linear.has_uninitialized_params():
        raise ValueError(
            f"Expected `module` with its sizes known, but got {owner} with a lazy projection "
            "not sized yet instead: build it with its sizes or call it once first."
        )
    return linear.weight


def from_torch(module: Any, *, dtype: str | None = None) -> Any:
    """The Keras layer that computes what attnscore's PyTorch ``module`` computes.

    Its weights (copied, in the module's dtype unless ``dtype`` is given), sizes, dropout
    and options; for :class:`attnscore.MultiHeadAttention` its per-head scorer too. A
    ``torch.nn.MultiheadAttention`` converts through
    ``attnscore.MultiHeadAttention.from_torch``. Outputs agree within 1e-5 in float32 (see
    the tests); the layer takes batch-first inputs.

    Args:
        module: an ``attnscore`` ``AdditiveAttention``, ``DotProductAttention``,
            ``MultiplicativeAttention``, ``CosineAttention`` or ``MultiHeadAttention`` with
            the softmax normalizer, or a ``torch.nn.MultiheadAttention``.
        dtype: the layer's Keras dtype (policy name); default the module's.

    Returns:
        A built :mod:`attnscore_keras` layer; ``module`` is unchanged.

    Raises:
        TypeError: ``module`` is none of those.
        ValueError: another normalizer than the softmax; a lazy module not sized yet.

    Needs torch and attnscore (imported here only).
    """
    import torch

    import attnscore

    if isinstance(module, torch.nn.MultiheadAttention):
        module = attnscore.MultiHeadAttention.from_torch(module)
    dtype = dtype or _torch_dtype(module)
    kinds = (
        attnscore.AdditiveAttention,
        attnscore.DotProductAttention,
        attnscore.MultiplicativeAttention,
        attnscore.CosineAttention,
        attnscore.MultiHeadAttention,
    )
    if type(module) not in kinds:
        names = ", ".join(f"attnscore.{k.__name__}" for k in kinds)
        raise TypeError(
            f"Expected `module` to be one of {names} or torch.nn.MultiheadAttention, but got "
            f"{type(module).__name__} instead."
        )
    if isinstance(module, attnscore.MultiHeadAttention):
        return _mha_from_torch(module, dtype)
    if module.normalizer != "softmax":
        raise ValueError(
            "Expected `module` with the softmax normalizer (the one of attnscore_keras), but "
            f"got normalizer={module.normalizer!r} instead."
        )
    p = float(module.dropout.p)
    if isinstance(module, attnscore.AdditiveAttention):
        W_q, W_k = _sized(module.W_q, "AdditiveAttention"), _sized(module.W_k, "AdditiveAttention")
        h, q = W_q.shape
        k = W_k.shape[1]
        bias = module.b is not None
        layer: Any = AdditiveAttention(
            k, q, h, p, bias=bias, normalize=module.normalize, dtype=dtype
        )
        layer.build((None, None, q), (None, None, k), (None, None, 1))
        _assign(layer.W_q, _numpy(W_q).T, "W_q")
        _assign(layer.W_k, _numpy(W_k).T, "W_k")
        _assign(layer.w_v, _numpy(module.w_v.weight).T, "w_v")
        if bias:
            _assign(layer.b, _numpy(module.b), "b")
        if module.g is not None:
            _assign(layer.g, _numpy(module.g), "g")
        return layer
    if isinstance(module, attnscore.DotProductAttention):
        return DotProductAttention(p, scale=module.scale, dtype=dtype)
    if isinstance(module, attnscore.MultiplicativeAttention):
        W_a = _sized(module.W_a, "MultiplicativeAttention")
        q, k = W_a.shape
        layer = MultiplicativeAttention(q, k, p, dtype=dtype)
        layer.build((None, None, q), (None, None, k), (None, None, 1))
        _assign(layer.W_a, _numpy(W_a), "W_a")
        return layer
    log_scale = module.log_scale
    learn = isinstance(log_scale, torch.nn.Parameter)
    layer = CosineAttention(
        p, scale=float(np.exp(_numpy(log_scale))), learn_scale=learn, dtype=dtype
    )
    layer.build((None, None, 1), (None, None, 1), (None, None, 1))
    _assign(layer.log_scale, _numpy(log_scale), "log_scale")
    return layer


def _mha_from_torch(module: Any, dtype: str) -> MultiHeadAttention:
    linears = (module.W_q, module.W_k, module.W_v, module.W_o)
    weights = [_sized(linear, "MultiHeadAttention") for linear in linears]
    E = weights[3].shape[0]
    bias = module.W_q.bias is not None
    inner = from_torch(module.attention, dtype=dtype)
    layer = MultiHeadAttention(
        E,
        module.num_heads,
        inner.dropout_rate,
        bias,
        scoring=inner,
        query_size=weights[0].shape[1],
        key_size=weights[1].shape[1],
        value_size=weights[2].shape[1],
        dtype=dtype,
    )
    q, k, v = (w.shape[1] for w in weights[:3])
    layer.build((None, None, q), (None, None, k), (None, None, v))
    for name, linear, weight in zip("qkvo", linears, weights, strict=True):
        _assign(getattr(layer, f"W_{name}"), _numpy(weight).T, f"W_{name}")
        if bias:
            _assign(getattr(layer, f"b_{name}"), _numpy(linear.bias), f"b_{name}")
    return layer


def _tensor(variable: Any, dtype: Any) -> Any:
    import torch

    value = np.asarray(ops.convert_to_numpy(ops.cast(variable, "float64")))
    return torch.from_numpy(value).to(dtype)


def to_torch(layer: Any) -> Any:
    """attnscore's PyTorch module that computes what the Keras ``layer`` computes.

    Its weights (copied, in the layer's variable dtype), sizes, dropout and options, in
    eval mode (Keras layers take ``training`` per call).

    Args:
        layer: a built :class:`AdditiveAttention`, :class:`MultiplicativeAttention`,
            :class:`CosineAttention` (built on a call or by ``build``),
            :class:`DotProductAttention` or :class:`MultiHeadAttention` of this package.

    Returns:
        A new ``attnscore`` module; ``layer`` is unchanged.

    Raises:
        TypeError: ``layer`` is not one of those.
        ValueError: a layer with weights that is not built yet.

    Needs torch and attnscore (imported here only).
    """
    import torch

    import attnscore

    kinds = (
        AdditiveAttention,
        DotProductAttention,
        MultiplicativeAttention,
        CosineAttention,
        MultiHeadAttention,
    )
    if type(layer) not in kinds:
        names = ", ".join(f"attnscore_keras.{k.__name__}" for k in kinds)
        raise TypeError(f"Expected `layer` to be one of {names}, but got {type(layer).__name__}.")
    if not layer.built and not isinstance(layer, DotProductAttention):
        raise ValueError(
            f"Expected a built `layer`, but got a {type(layer).__name__} not built yet instead: "
            "call it once or call its `build` first."
        )
    dtype = getattr(torch, keras.backend.standardize_dtype(layer.variable_dtype))
    if isinstance(layer, MultiHeadAttention):
        inner = to_torch(layer.attention)
        module = attnscore.MultiHeadAttention(
            layer.num_hiddens,
            layer.num_heads,
            layer.dropout_rate,
            layer.use_bias,
            scoring=inner,
            query_size=layer.query_size,
            key_size=layer.key_size,
            value_size=layer.value_size,
        ).to(dtype)
        with torch.no_grad():
            for name in "qkvo":
                linear = getattr(module, f"W_{name}")
                linear.weight.copy_(_tensor(getattr(layer, f"W_{name}"), dtype).T)
                if layer.use_bias:
                    linear.bias.copy_(_tensor(getattr(layer, f"b_{name}"), dtype))
        return module.eval()
    assert isinstance(layer, Attention)
    p = layer.dropout_rate
    torch_module: Any
    with torch.no_grad():
        if isinstance(layer, AdditiveAttention):
            torch_module = attnscore.AdditiveAttention(
                layer.key_size,
                layer.query_size,
                layer.num_hiddens,
                p,
                bias=layer.bias,
                normalize=layer.normalize,
            ).to(dtype)
            torch_module.W_q.weight.copy_(_tensor(layer.W_q, dtype).T)
            torch_module.W_k.weight.copy_(_tensor(layer.W_k, dtype).T)
            torch_module.w_v.weight.copy_(_tensor(layer.w_v, dtype).T)
            if layer.b is not None:
                torch_module.b.copy_(_tensor(layer.b, dtype))
            if layer.g is not None:
                torch_module.g.copy_(_tensor(layer.g, dtype))
        elif isinstance(layer, DotProductAttention):
            torch_module = attnscore.DotProductAttention(p, scale=layer.scale).to(dtype)
        elif isinstance(layer, MultiplicativeAttention):
            torch_module = attnscore.MultiplicativeAttention(
                layer.query_size, layer.key_size, p
            ).to(dtype)
            torch_module.W_a.weight.copy_(_tensor(layer.W_a, dtype))
        else:
            torch_module = attnscore.CosineAttention(
                p, scale=layer.scale, learn_scale=layer.learn_scale
            ).to(dtype)
            torch_module.log_scale.copy_(_tensor(layer.log_scale, dtype))
    return torch_module.eval()
