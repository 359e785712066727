"""Input checks: one ``TypeError`` or ``ValueError`` per bad input, naming the argument.

Shapes and dtypes are checked from the static shapes Keras knows (symbolic inputs, traced
calls under ``jax.jit`` and ``tf.function`` included; unknown dimensions are skipped).
The values of lengths (non-negative whole numbers) are checked only where they are
concrete (eager calls); inside a compiled call a negative length attends nothing.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

FLOATS = ("float16", "bfloat16", "float32", "float64")
SIXTEEN_BITS = ("float16", "bfloat16")


def dtype_of(x: Any) -> str:
    """The Keras name of ``x``'s dtype (``"float32"``, ``"int64"``, ...)."""
    return str(keras.backend.standardize_dtype(x.dtype))


def shape_of(x: Any) -> tuple[int | None, ...]:
    """``x``'s static shape, None for dimensions unknown while tracing."""
    return tuple(None if d is None else int(d) for d in x.shape)


def as_tensor(x: Any, name: str) -> Any:
    """``x`` as a backend tensor (NumPy arrays and lists converted), or a TypeError."""
    if x is None or isinstance(x, (str, bytes, dict)):
        raise TypeError(f"Expected `{name}` to be a tensor, but got {type(x).__name__} instead.")
    if ops.is_tensor(x) or isinstance(x, keras.KerasTensor):
        return x
    try:
        return ops.convert_to_tensor(x)
    except Exception as error:  # backends raise their own types for unconvertible input
        raise TypeError(
            f"Expected `{name}` to be a tensor, but got {type(x).__name__} instead."
        ) from error


def check_floating(x: Any, name: str, *, min_ndim: int = 3) -> Any:
    """``x`` as a floating tensor of at least ``min_ndim`` dimensions."""
    x = as_tensor(x, name)
    dtype = dtype_of(x)
    if dtype not in FLOATS:
        raise TypeError(
            f"Expected `{name}` to be a floating tensor (one of {', '.join(FLOATS)}), but got "
            f"dtype {dtype} instead."
        )
    if len(x.shape) < min_ndim:
        raise ValueError(
            f"Expected `{name}` with at least {min_ndim} dimensions, but got shape "
            f"{shape_of(x)} instead."
        )
    return x


def same(a: int | None, b: int | None) -> bool:
    """Whether two static dimensions may be equal (unknown ones may)."""
    return a is None or b is None or a == b


def check_attention_inputs(
    queries: Any, keys: Any, values: Any, *, same_feature_size: bool
) -> tuple[Any, Any, Any]:
    """Queries (..., n, q), keys (..., m, k), values (..., m, v): one floating dtype, the
    same leading dimensions, as many keys as values; q == k where ``same_feature_size``."""
    queries = check_floating(queries, "queries")
    keys = check_floating(keys, "keys")
    values = check_floating(values, "values")
    qs, ks, vs = shape_of(queries), shape_of(keys), shape_of(values)
    for name, x in (("keys", keys), ("values", values)):
        if dtype_of(x) != dtype_of(queries):
            raise TypeError(
                f"Expected `{name}` of the queries' dtype {dtype_of(queries)}, but got "
                f"{dtype_of(x)} instead."
            )
    for name, shape in (("keys", ks), ("values", vs)):
        if len(shape) != len(qs) or not all(map(same, shape[:-2], qs[:-2])):
            raise ValueError(
                f"Expected `{name}` with the queries' leading dimensions {qs[:-2]}, but got "
                f"shape {shape} instead."
            )
    if not same(ks[-2], vs[-2]):
        raise ValueError(
            f"Expected `values` with as many rows as `keys` ({ks[-2]}), but got shape {vs} instead."
        )
    if same_feature_size and not same(qs[-1], ks[-1]):
        raise ValueError(
            f"Expected `keys` with the queries' feature size {qs[-1]}, but got shape {ks} instead."
        )
    return queries, keys, values


def is_concrete(x: Any) -> bool:
    """Whether ``x`` holds values now (an eager tensor), not a symbol or a tracer."""
    if isinstance(x, keras.KerasTensor):
        return False
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return not isinstance(x, jax.core.Tracer)
    if backend == "tensorflow":
        import tensorflow as tf

        return bool(tf.executing_eagerly()) and hasattr(x, "numpy")
    if backend == "torch":
        import torch

        return not torch.compiler.is_compiling()
    return True


def check_lengths(x: Any, name: str) -> Any:
    """Lengths as an int32 tensor: an integer tensor, or a floating one of whole numbers;
    non-negative (checked where the values are concrete)."""
    x = as_tensor(x, name)
    dtype = dtype_of(x)
    if dtype == "bool" or not (dtype.startswith(("int", "uint")) or dtype in FLOATS):
        hint = (
            "; a bool mask goes to `attend_mask=` (True = may attend)"
            if dtype == "bool" and name == "valid_lens"
            else ""
        )
        raise TypeError(
            f"Expected `{name}` to be an integer tensor (or a floating tensor of whole "
            f"numbers{hint}), but got dtype {dtype} instead."
        )
    if is_concrete(x):
        values = np.asarray(ops.convert_to_numpy(x))
        if values.size:
            if dtype in FLOATS:
                bad = values[~np.isfinite(values) | (values != np.floor(values))]
                if bad.size:
                    raise ValueError(
                        f"Expected `{name}` to hold whole numbers, but got {bad.flat[0]!r} instead."
                    )
            if values.min() < 0:
                raise ValueError(
                    f"Expected `{name}` to be non-negative, but got {values.min()!r} instead."
                )
    return ops.cast(x, "int32")


def check_size(value: object, name: str, *, optional: bool = False) -> int | None:
    """A positive int (or None where ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"Expected `{name}` to be a positive int, but got {value!r} instead.")
    return int(value)


def check_dropout(value: object) -> float:
    """A dropout probability in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"Expected `dropout` to be a float in [0, 1), but got {value!r} instead.")
    return float(value)


def check_normalizer(value: object) -> str:
    """``"softmax"``, the one normalizer of the Keras layers."""
    if value != "softmax":
        raise ValueError(
            "Expected `normalizer` to be 'softmax' (the one normalizer of attnscore_keras; "
            f"the others are attnscore's, for PyTorch), but got {value!r} instead."
        )
    return "softmax"
