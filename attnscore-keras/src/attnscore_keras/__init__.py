"""attnscore's attention layers for Keras 3: the same layers, masks and semantics as the
PyTorch package ``attnscore``, written in ``keras.ops`` (TensorFlow, JAX or PyTorch
backend), with no dependency on PyTorch.

Layers: :class:`AdditiveAttention`, :class:`DotProductAttention`,
:class:`MultiplicativeAttention`, :class:`CosineAttention`, :class:`MultiHeadAttention`;
functions: :func:`masked_softmax`, :func:`sequence_mask`, :func:`show_heatmaps`;
weights to and from attnscore's PyTorch modules: :func:`from_torch`, :func:`to_torch`
(these two import torch when called).
"""

from __future__ import annotations

from .convert import from_torch, to_torch
from .layers import (
    AdditiveAttention,
    Attention,
    CosineAttention,
    DotProductAttention,
    MultiplicativeAttention,
)
from .masking import masked_softmax, sequence_mask
from .multihead import MultiHeadAttention
from .plotting import show_heatmaps

__version__ = "0.1.0"

__all__ = [
    "AdditiveAttention",
    "Attention",
    "CosineAttention",
    "DotProductAttention",
    "MultiHeadAttention",
    "MultiplicativeAttention",
    "from_torch",
    "masked_softmax",
    "sequence_mask",
    "show_heatmaps",
    "to_torch",
]
