"""The plain PyTorch masked softmax: the one reference path every fast path is a twin of.

A leaf module so that both :mod:`attnscore.masking` and :mod:`attnscore.kernels` (whose
plain twins run on other devices) use this single implementation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import compute_dtype


def softmax_dense(scores: Tensor, attend: Tensor | None) -> Tensor:
    """Plain PyTorch masked softmax; ``attend`` is bool broadcastable to scores, or None."""
    x = scores.to(compute_dtype(scores.dtype))
    if attend is None:
        return torch.softmax(x, dim=-1).to(scores.dtype)
    # The lowest finite value, not -inf or -1e6: exp(lowest - row max) is exactly 0 in every
    # dtype, and a fully masked row stays finite (uniform) until it is zeroed below, so no
    # NaN reaches the forward or the backward pass.
    x = x.masked_fill(~attend, torch.finfo(x.dtype).min)
    weights = torch.softmax(x, dim=-1)
    # Zero every masked position, not only fully masked rows: a NaN among the valid scores
    # then stays within the valid positions, as on the fused path.
    weights = weights.masked_fill(~attend, 0.0)
    return weights.to(scores.dtype)
