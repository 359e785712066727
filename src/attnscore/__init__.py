"""attnscore: attention scoring functions and attention pooling for PyTorch.

The system of Dive into Deep Learning's section "Attention Scoring Functions": masked
softmax with valid lengths, additive and scaled dot-product attention, and heatmaps of
attention weights; plus general and cosine scoring, more masks, and fused CPU kernels.

>>> import attnscore, torch
>>> attnscore.masked_softmax(torch.zeros(1, 2, 4), torch.tensor([2]))
tensor([[[0.5000, 0.5000, 0.0000, 0.0000],
         [0.5000, 0.5000, 0.0000, 0.0000]]])
"""

from .functional import (
    additive_attention,
    attention,
    cosine_attention,
    dot_product_attention,
    general_attention,
)
from .kernels import explain
from .masking import masked_softmax, sequence_mask
from .modules import (
    AdditiveAttention,
    Attention,
    CosineAttention,
    DotProductAttention,
    MultiplicativeAttention,
    ScorerAttention,
    make_scorer,
)
from .multihead import MultiHeadAttention
from .normalizers import Softmax, normalizer_names, register_normalizer
from .plotting import show_heatmaps
from .registry import SCORERS, Param, ScorerSpec, get_scorer, register_scorer, scorer_names

__version__ = "0.1.0"

__all__ = [
    "SCORERS",
    "AdditiveAttention",
    "Attention",
    "CosineAttention",
    "DotProductAttention",
    "MultiHeadAttention",
    "MultiplicativeAttention",
    "Param",
    "ScorerAttention",
    "ScorerSpec",
    "Softmax",
    "__version__",
    "additive_attention",
    "attention",
    "cosine_attention",
    "dot_product_attention",
    "explain",
    "general_attention",
    "get_scorer",
    "make_scorer",
    "masked_softmax",
    "normalizer_names",
    "register_normalizer",
    "register_scorer",
    "scorer_names",
    "sequence_mask",
    "show_heatmaps",
]
