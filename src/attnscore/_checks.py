"""Input checks shared by the public entry points.

Every check raises with the message form "Expected <what>, but got <what> instead", names
the argument, and never changes its input.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch._C import _is_tracing  # torch.jit.is_tracing's test, without its Python wrapper
from torch._C._functorch import is_functorch_wrapped_tensor as _is_wrapped  # torch.func's test
from torch._C._functorch import maybe_current_level as _functorch_level

from ._thresholds import value

LOOK_NUMEL: int = value("look_numel")
"""The threshold ``look_numel`` (:data:`attnscore._thresholds.THRESHOLDS` says why)."""

_F = TypeVar("_F", bound=Callable[..., object])


def one_length_each(valid_lens: object, like: object) -> Any:
    """One key length for every example (a decoder's step): a Python ``int`` (not a bool)
    becomes (B,) int64 lengths on ``like``'s device, B being ``like``'s first size (``like``
    the queries, or the scores, of at least 3 dimensions). Anything else is returned as it
    is, for the checks that follow (a 0-d tensor among them: its shape is refused).

    >>> one_length_each(3, torch.zeros(2, 1, 4))
    tensor([3, 3])
    """
    if not isinstance(like, Tensor) or like.ndim < 3:
        return valid_lens
    if type(valid_lens) is int:
        if valid_lens < 0:
            raise ValueError(
                f"Expected `valid_lens` to be non-negative, but got {valid_lens} instead."
            )
        return torch.full((like.shape[0],), valid_lens, dtype=torch.int64, device=like.device)
    return valid_lens


def constant_when_compiling(fn: _F) -> _F:
    """``torch.compiler.assume_constant_result(fn)`` without importing ``torch._dynamo``
    (about 2 s) when attnscore is imported: the mark that decorator sets
    (``torch/_dynamo/decorators.py``), which torch.compile reads when it traces ``fn``.
    ``tests/test_startup.py`` checks that torch's decorator still sets this mark."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def in_functorch(tensor: Tensor) -> bool:
    """True for a tensor inside a ``torch.func`` transform (vmap, grad, ...)."""
    return bool(_is_wrapped(tensor))


def in_transform(*tensors: Tensor) -> bool:
    """True when these tensors are being traced or transformed rather than computed:
    ``torch.compile``, ``torch.jit.trace``, ``torch.func`` transforms, or fake tensors.

    Opaque kernels (C calls on ``data_ptr()``, Python loops over values) must step aside
    then, for the plain PyTorch ops that those systems can see through.
    """
    # is_compiling first: torch.compile knows it (a constant True) and traces no further.
    # A torch.func transform at work (a level on its stack) is one test for all tensors:
    # its wrapped tensors exist only then, and tensors it closes over take the plain ops too.
    if torch.compiler.is_compiling() or _is_tracing() or _functorch_level() is not None:
        return True
    # Plain tensors (the common case) are told apart by their exact type: no isinstance walk
    # (and no generator: this runs on every eager call).
    for t in tensors:  # noqa: SIM110
        if type(t) is not Tensor and isinstance(t, fake_tensor_type()):
            return True
    return False


@functools.cache
def fake_tensor_type() -> type:
    """``FakeTensor`` (torch.compile's and torch.export's shape propagation), imported on
    first use."""
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor


SMALL_VALUES: int = value("small_values")
"""The threshold ``small_values``, for :func:`value_range`."""


def value_range(t: Tensor) -> tuple[int, int]:
    """(smallest, largest) value of a non-empty integer CPU tensor, in one read: a
    ``.tolist()`` of up to :data:`SMALL_VALUES` values, else one ``aminmax``."""
    if t.numel() <= SMALL_VALUES:
        values = (t if t.ndim == 1 else t.flatten()).tolist()
        return int(min(values)), int(max(values))
    low, high = torch.aminmax(t)
    return int(low), int(high)


def check_tensor(x: object, name: str) -> Tensor:
    """Return ``x`` if it is a tensor, else raise ``TypeError`` naming ``name``."""
    if not isinstance(x, Tensor):
        raise TypeError(
            f"Expected `{name}` to be a torch.Tensor, but got {type(x).__name__} instead."
        )
    return x


def check_floating(x: object, name: str, *, min_ndim: int = 0) -> Tensor:
    """Check that ``x`` is a floating-point tensor with at least ``min_ndim`` dimensions."""
    x = check_tensor(x, name)
    if not x.is_floating_point():
        raise TypeError(
            f"Expected `{name}` to have a floating-point dtype, but got {x.dtype} instead."
        )
    if x.ndim < min_ndim:
        raise ValueError(
            f"Expected `{name}` to have at least {min_ndim} dimensions, but got shape "
            f"{tuple(x.shape)} instead."
        )
    return x


def check_dropout(p: object, name: str = "dropout") -> float:
    """Check a dropout probability: a real number in [0, 1)."""
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"Expected `{name}` to be a float in [0, 1), but got {p!r} instead.")
    if not 0.0 <= float(p) < 1.0:
        raise ValueError(f"Expected `{name}` to be in [0, 1), but got {p!r} instead.")
    return float(p)


def check_attention_inputs(
    queries: object, keys: object, values: object, *, same_feature_size: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """Check queries (..., n, q), keys (..., m, k) and values (..., m, v) against each other.

    All three must be floating tensors of one dtype and device with at least 3 dimensions,
    equal leading (batch) dimensions, and as many keys as values; with ``same_feature_size``
    q == k (dot-product scores). Under ``torch.autocast`` for their device, inputs of
    different dtypes are first cast to its dtype, as PyTorch's own ops are (an RNN's and a
    ``Linear``'s outputs may differ there).
    """
    q = check_floating(queries, "queries", min_ndim=3)
    k = check_floating(keys, "keys", min_ndim=3)
    v = check_floating(values, "values", min_ndim=3)
    if not (q.dtype == k.dtype == v.dtype) and q.device == k.device == v.device:
        device_type = q.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    for name, t in (("keys", k), ("values", v)):
        if t.dtype != q.dtype:
            raise TypeError(
                f"Expected `{name}` to have the dtype of `queries` ({q.dtype}), but got "
                f"{t.dtype} instead."
            )
        if t.device != q.device:
            raise ValueError(
                f"Expected `{name}` on the device of `queries` ({q.device}), but got "
                f"{t.device} instead."
            )
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            "Expected `keys` (..., m, k) and `values` (..., m, v) to agree on every dimension "
            f"but the last, but got keys {tuple(k.shape)} and values {tuple(v.shape)} instead."
        )
    if q.shape[:-2] != k.shape[:-2]:
        raise ValueError(
            "Expected `queries` (..., n, q) and `keys` (..., m, k) to have the same batch "
            f"dimensions, but got queries {tuple(q.shape)} and keys {tuple(k.shape)} instead."
        )
    if same_feature_size and q.shape[-1] != k.shape[-1]:
        raise ValueError(
            "Expected `queries` and `keys` to have the same feature size d for dot-product "
            f"scores, but got queries {tuple(q.shape)} and keys {tuple(k.shape)} instead."
        )
    return q, k, v


def check_score_bias(bias: object, queries: Tensor, m: int) -> Tensor:
    """Check ``score_bias`` against queries (..., n, d) and m keys: a floating tensor on the
    queries' device, broadcastable to the scores (..., n, m). A boolean one is refused with
    the option that takes it (``attend_mask``)."""
    bias = check_tensor(bias, "score_bias")
    scores = (*queries.shape[:-1], m)
    if bias.dtype == torch.bool:
        raise TypeError(
            "Expected `score_bias` to have a floating-point dtype (added to the scores, as "
            "SDPA adds a float `attn_mask`), but got torch.bool instead; a boolean mask "
            "(True = may attend) is `attend_mask`."
        )
    if not bias.is_floating_point():
        raise TypeError(
            f"Expected `score_bias` to have a floating-point dtype, but got {bias.dtype} instead."
        )
    if bias.device != queries.device:
        raise ValueError(
            f"Expected `score_bias` on the device of `queries` ({queries.device}), but got "
            f"{bias.device} instead."
        )
    try:
        broadcast = torch.broadcast_shapes(bias.shape, scores)
    except RuntimeError:
        broadcast = None
    if broadcast != torch.Size(scores):
        raise ValueError(
            f"Expected `score_bias` broadcastable to the scores (..., n, m) = {scores}, but got "
            f"shape {tuple(bias.shape)} instead."
        )
    return bias


def check_registration(
    name: object,
    registry: Mapping[str, object],
    kind: str,
    replace: bool,
    function: tuple[str, object, str],
) -> str:
    """Check what is about to be registered as a ``kind`` (``"scorer"``, ``"normalizer"``):
    ``name`` a word, not taken unless ``replace``; ``function`` = (argument, value, what it
    maps) a callable. Raises ValueError (the name) or TypeError (the function)."""
    if not isinstance(name, str) or not name.replace("_", "a").isalnum():
        raise ValueError(
            f"Expected `name` to be a word like 'my_{kind}', but got {name!r} instead."
        )
    if name in registry and not replace:
        raise ValueError(
            f"Expected `name` to be a new {kind} name, but got {name!r}, which is registered "
            "already (pass replace=True to replace it)."
        )
    argument, value, maps = function
    if not callable(value):
        raise TypeError(
            f"Expected `{argument}` to be callable {maps}, but got {type(value).__name__} instead."
        )
    return name


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype reductions run in: float32 for 16-bit floats, else ``dtype`` itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def all_finite(t: Tensor) -> bool:
    """Whether every value of a CPU tensor ``t`` is finite, in one reduction: its sum carries
    any NaN or infinity (an overflowing sum of huge values says no too, which only sends the
    caller on to :func:`bad_rows`)."""
    return math.isfinite(float(t.detach().sum()))


def garbage_in(t: Tensor, rows: Tensor) -> bool:
    """Whether a row of a CPU tensor ``t`` (..., r, d) that ``rows`` (bool, broadcastable
    to (..., r)) selects holds a NaN or an infinity: one reduction of the whole of ``t``
    when it is clean (:func:`all_finite`), row by row (:func:`bad_rows`) only when not."""
    return not all_finite(t) and bool((rows & bad_rows(t)).any())


def bad_rows(t: Tensor) -> Tensor:
    """Bool (...): the rows of ``t`` (..., d) that hold a NaN or an infinity, from the row
    sums (an overflowing sum flags a row of huge values too: harmlessly zeroed as well).
    Finite garbage in padding changes nothing (it meets exact zeros); 0 * NaN and 0 * inf
    are NaN."""
    return ~torch.isfinite(t.sum(dim=-1))
