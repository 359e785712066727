"""attnscore: attention scoring functions and attention pooling for PyTorch.

The system of Dive into Deep Learning's section "Attention Scoring Functions": masked
softmax with valid lengths, additive and scaled dot-product attention, and heatmaps of
attention weights; plus general and cosine scoring, more masks, and fused CPU kernels.

>>> import attnscore, torch
>>> attnscore.masked_softmax(torch.zeros(1, 2, 4), torch.tensor([2]))
tensor([[[0.5000, 0.5000, 0.0000, 0.0000],
         [0.5000, 0.5000, 0.0000, 0.0000]]])
"""

from .functional import additive_attention, attention, dot_product_attention
from .masking import masked_softmax, sequence_mask
from .modules import (
    AdditiveAttention,
    Attention,
    CosineAttention,
    DotProductAttention,
    MultiplicativeAttention,
)
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
    "__version__",
    "additive_attention",
    "attention",
    "dot_product_attention",
    "masked_softmax",
    "sequence_mask",
    "show_heatmaps",
]
