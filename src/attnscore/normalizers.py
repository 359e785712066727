"""Probability functions: masked scores -> attention weights.

Each normalizer maps scores (..., n, m) and an :class:`~attnscore.masking.AttentionMask` to
weights of the same shape and dtype that are zero at masked positions and all zero in rows
with no allowed key. ``softmax`` is the default; ``sparsemax`` and ``entmax15`` need the
optional ``entmax`` package (``pip install attnscore[entmax]``); ``hardmax`` puts all
weight on the best allowed key.

A normalizer may be an object with parameters (:class:`Softmax` with a temperature); a
*softmax-like* one, the softmax of its scores times a factor it declares, runs on the fused
paths of the dot-product family (:func:`score_factor`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ._checks import check_registration, compute_dtype
from ._mask import AttentionMask
from .kernels import _ops

__all__ = [
    "NORMALIZERS",
    "Normalizer",
    "Softmax",
    "get_normalizer",
    "hardmax",
    "normalizer_names",
    "register_normalizer",
    "score_factor",
    "softmax",
]

Normalizer = Callable[[Tensor, "AttentionMask | None"], Tensor]


def softmax(scores: Tensor, mask: AttentionMask | None) -> Tensor:
    """Masked softmax (see :func:`attnscore.masked_softmax`).

    >>> from attnscore.masking import AttentionMask
    >>> softmax(torch.zeros(1, 1, 3), AttentionMask(n=1, m=3, lengths=torch.tensor([[2]])))
    tensor([[[0.5000, 0.5000, 0.0000]]])
    """
    if mask is None or mask.unmasked:
        return _ops.softmax(scores)  # 16-bit: reduced in float32 too
    if mask.attend is None:
        assert mask.lengths is not None
        return _ops.masked_softmax(scores, mask.lengths)
    dense = mask.dense()
    assert dense is not None
    return _ops.masked_softmax_dense(scores, dense)


class Softmax:
    """Masked softmax of the scores divided by a ``temperature``: weights
    ``softmax(scores / temperature)`` over the allowed keys (..., n, m), in the scores'
    dtype and device; rows with no allowed key are zeros (zero gradients).

    A temperature above 1 flattens the weights, below 1 sharpens them; 1 is
    :func:`softmax`. Softmax-like (:attr:`score_factor` is 1 / temperature): the fused paths
    of the dot-product family run it, their scale multiplied by the factor.

    Args:
        temperature: a positive finite number.

    Raises:
        TypeError: ``temperature`` is not a real number.
        ValueError: ``temperature`` is not positive and finite.

    Source: Hinton, Vinyals and Dean, "Distilling the Knowledge in a Neural Network" (2015);
    D2L "Attention Scoring Functions" (masked softmax).

    >>> from attnscore.masking import AttentionMask
    >>> mask = AttentionMask(n=1, m=3, lengths=torch.tensor([[2]]))
    >>> Softmax(2.0)(torch.tensor([[[0.0, 2.0, 9.0]]]), mask)
    tensor([[[0.2689, 0.7311, 0.0000]]])
    """

    __slots__ = ("temperature",)

    def __init__(self, temperature: float = 1.0) -> None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise TypeError(
                f"Expected `temperature` to be a real number, but got "
                f"{type(temperature).__name__} instead."
            )
        if not math.isfinite(temperature) or temperature <= 0:
            raise ValueError(
                f"Expected `temperature` > 0 and finite, but got {temperature!r} instead."
            )
        self.temperature = float(temperature)

    @property
    def score_factor(self) -> float:
        """The factor on the scores inside the softmax: 1 / temperature."""
        return 1.0 / self.temperature

    def __call__(self, scores: Tensor, mask: AttentionMask | None) -> Tensor:
        """``softmax(scores / temperature)`` over the keys ``mask`` allows (see the class)."""
        factor = self.score_factor
        return softmax(scores if factor == 1.0 else scores * factor, mask)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Softmax) and other.temperature == self.temperature

    def __hash__(self) -> int:
        return hash((Softmax, self.temperature))

    def __repr__(self) -> str:
        return f"Softmax(temperature={self.temperature!r})"


def score_factor(normalizer: Normalizer) -> float | None:
    """The factor a softmax-like ``normalizer`` applies to the scores inside its softmax (1
    for :func:`softmax`, 1 / temperature for :class:`Softmax`, a user's object's
    ``score_factor`` attribute); None for every other normalizer (sparsemax, hardmax, ...),
    which the fused paths do not run.

    >>> score_factor(softmax), score_factor(Softmax(4.0)), score_factor(hardmax)
    (1.0, 0.25, None)
    """
    if normalizer is softmax:
        return 1.0
    factor = getattr(normalizer, "score_factor", None)
    return float(factor) if isinstance(factor, (int, float)) else None


def hardmax(scores: Tensor, mask: AttentionMask | None) -> Tensor:
    """One-hot weights on the highest-scoring allowed key (the first one on ties).

    Not differentiable: the gradient is zero everywhere. Rows whose allowed scores hold a
    NaN give NaN weights (the NaN is not hidden); rows with no allowed key give zeros.

    >>> from attnscore.masking import AttentionMask
    >>> scores = torch.tensor([[[1.0, 3.0, 9.0], [2.0, 0.0, 0.0]]])
    >>> hardmax(scores, AttentionMask(n=2, m=3, lengths=torch.tensor([[2, 0]])))
    tensor([[[0., 1., 0.],
             [0., 0., 0.]]])
    """
    dense = None if mask is None else mask.dense()
    x = scores if dense is None else scores.masked_fill(~dense, float("-inf"))
    best = x.argmax(dim=-1, keepdim=True)
    weights = torch.zeros_like(scores).scatter_(-1, best, 1.0)
    if dense is not None:
        weights = weights.masked_fill(~dense.any(dim=-1, keepdim=True), 0.0)
    has_nan = torch.isnan(x).any(dim=-1, keepdim=True)
    return torch.where(has_nan, torch.full_like(weights, float("nan")), weights).detach()


def _sparse_family(name: str) -> Normalizer:
    """Wrap an ``entmax`` mapping so that it respects masks."""

    def normalize(scores: Tensor, mask: AttentionMask | None) -> Tensor:
        try:
            import entmax
        except ImportError as err:  # optional dependency
            raise ImportError(
                f"normalizer={name!r} needs the optional package `entmax`: "
                "pip install 'attnscore[entmax]'"
            ) from err
        fn: Callable[..., Tensor] = getattr(entmax, name)
        x = scores.to(compute_dtype(scores.dtype))
        dense = None if mask is None else mask.dense()
        if dense is None:
            return fn(x, dim=-1).to(scores.dtype)
        # sparsemax zeroes every score below max - 1 and entmax15 every score below max - 2,
        # so this finite fill gives masked keys exactly zero weight without the -inf
        # arithmetic that breaks their sorting-based thresholds.
        top = x.masked_fill(~dense, float("-inf")).amax(dim=-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        x = torch.where(dense, x, (top - 4.0).detach())
        weights = fn(x, dim=-1).masked_fill(~dense, 0.0)
        return weights.masked_fill(~dense.any(dim=-1, keepdim=True), 0.0).to(scores.dtype)

    normalize.__name__ = name
    normalize.__doc__ = f"Masked ``entmax.{name}`` (needs the optional `entmax` package)."
    return normalize


NORMALIZERS: dict[str, Normalizer] = {}
"""The registered normalizers by name (:func:`register_normalizer`)."""


def register_normalizer(name: str, normalizer: Normalizer, *, replace: bool = False) -> None:
    """Register ``normalizer`` under ``name``: every ``normalizer=`` argument and the
    ``--normalizer`` option then take the name.

    Args:
        name: a word, such as ``"my_normalizer"``.
        normalizer: ``(scores (..., n, m), mask: AttentionMask | None) -> weights`` of the
            scores' shape and dtype, zero where the mask forbids and on rows with nothing
            allowed (the test suite checks every registered normalizer against a
            reference of its own: add one to ``tests/core/test_normalizers_and_masks.py``).
        replace: allow replacing an existing registration.

    Raises:
        ValueError: ``name`` is not a word or is registered already.
        TypeError: ``normalizer`` is not callable.

    >>> register_normalizer("uniform", lambda s, mask: softmax(s * 0, mask))
    >>> "uniform" in normalizer_names()
    True
    >>> del NORMALIZERS["uniform"]
    """
    signature = ("normalizer", normalizer, "(scores, mask) -> weights")
    check_registration(name, NORMALIZERS, "normalizer", replace, signature)
    NORMALIZERS[name] = normalizer


def normalizer_names() -> list[str]:
    """The registered normalizer names, sorted.

    >>> normalizer_names()
    ['entmax15', 'hardmax', 'softmax', 'sparsemax']
    """
    return sorted(NORMALIZERS)


register_normalizer("softmax", softmax)
register_normalizer("hardmax", hardmax)
register_normalizer("sparsemax", _sparse_family("sparsemax"))
register_normalizer("entmax15", _sparse_family("entmax15"))


def get_normalizer(normalizer: str | Normalizer) -> Normalizer:
    """Resolve a registered normalizer's name (:func:`normalizer_names`).

    A callable ``(scores, mask) -> weights`` is returned as it is.

    Raises:
        ValueError: an unknown name.

    >>> get_normalizer("hardmax") is hardmax
    True
    """
    if callable(normalizer):
        return normalizer
    try:
        return NORMALIZERS[normalizer]
    except KeyError:
        raise ValueError(
            f"Expected `normalizer` to be one of {sorted(NORMALIZERS)} or a callable, but got "
            f"{normalizer!r} instead."
        ) from None
