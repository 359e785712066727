"""attnscore: attention scoring functions and attention pooling for PyTorch.

The system of Dive into Deep Learning's section "Attention Scoring Functions": masked
softmax with valid lengths, additive and scaled dot-product attention, and heatmaps of
attention weights; plus general and cosine scoring, more masks, and fused CPU kernels.

>>> import attnscore, torch
>>> attnscore.masked_softmax(torch.zeros(1, 2, 4), torch.tensor([2]))
tensor([[[0.5000, 0.5000, 0.0000, 0.0000],
         [0.5000, 0.5000, 0.0000, 0.0000]]])
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# Where each public name lives. `import attnscore` imports none of them (nor torch): the
# first name read imports its module (PEP 562), so `attnscore --version` and `--help`
# answer at once, and a program pays for torch only when it uses the library.
_HOMES: dict[str, str] = {
    "additive_attention": "functional",
    "attention": "functional",
    "cosine_attention": "functional",
    "dot_product_attention": "functional",
    "general_attention": "functional",
    "explain": "kernels",
    "masked_softmax": "masking",
    "sequence_mask": "masking",
    "AdditiveAttention": "modules",
    "Attention": "modules",
    "CosineAttention": "modules",
    "DotProductAttention": "modules",
    "MultiplicativeAttention": "modules",
    "ScorerAttention": "modules",
    "make_scorer": "modules",
    "MultiHeadAttention": "multihead",
    "Softmax": "normalizers",
    "normalizer_names": "normalizers",
    "register_normalizer": "normalizers",
    "show_heatmaps": "plotting",
    "SCORERS": "registry",
    "Param": "registry",
    "ScorerSpec": "registry",
    "get_scorer": "registry",
    "register_scorer": "registry",
    "scorer_names": "registry",
}


def __getattr__(name: str) -> Any:
    """A public name (imported from its module on first use) or a submodule
    (``attnscore.kernels``, ``attnscore.bench``, ...)."""
    home = _HOMES.get(name)
    if home is not None:
        value = getattr(importlib.import_module(f".{home}", __name__), name)
        globals()[name] = value  # later reads are plain attribute reads
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # a submodule that exists failed to import: say why
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
