"""The textbook's PyTorch formulation, the reference attnscore is measured and tested against.

Dive into Deep Learning, section "Attention Scoring Functions" (PyTorch tab), rewritten
here once and used by ``attnscore bench`` and the test suite. It is kept as the book has
it, limits included (each docstring names them: ``-1e6`` fills, in-place masking, the whole
(B, n, m, h) features tensor, 3-D batches only), so comparisons are fair to the book.

Names, constructor arguments and ``state_dict`` keys (``W_q``, ``W_k``, ``w_v``) are the
book's, so a checkpoint of the book's ``AdditiveAttention`` loads here and into
:class:`attnscore.AdditiveAttention` with ``strict=True``: the library's own version (zero
rows for empty sequences, any batch shape, fused kernels), as are
:func:`attnscore.masked_softmax` and :class:`attnscore.DotProductAttention`.

>>> import torch
>>> masked_softmax(torch.zeros(1, 2, 4), torch.tensor([3]))
tensor([[[0.3333, 0.3333, 0.3333, 0.0000],
         [0.3333, 0.3333, 0.3333, 0.0000]]])
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["AdditiveAttention", "DotProductAttention", "masked_softmax", "sequence_mask"]


def sequence_mask(X: Tensor, valid_len: Tensor, value: float = 0.0) -> Tensor:
    """Overwrite, in place, the entries of each row of ``X`` past its valid length.

    Args:
        X: (R, m), any float dtype and device; modified in place.
        valid_len: (R,) integer lengths on ``X``'s device; entries ``j >= valid_len[r]``
            of row ``r`` are set to ``value``.
        value: the fill value.

    Returns:
        ``X`` itself.

    Source: D2L section "Sequence to Sequence Learning" (``d2l.sequence_mask``).
    """
    maxlen = X.size(1)
    positions = torch.arange(maxlen, dtype=torch.float32, device=X.device)
    mask = positions[None, :] < valid_len[:, None]
    X[~mask] = value
    return X


def masked_softmax(X: Tensor, valid_lens: Tensor | None) -> Tensor:
    """Softmax over the last axis of ``X`` with entries past the valid lengths masked.

    Args:
        X: scores (B, n, m), float. Modified in place when ``valid_lens`` is given (as in
            the book: pass a clone to keep it).
        valid_lens: None (plain softmax), (B,) lengths shared by a batch's n rows, or
            (B, n) per-row lengths.

    Returns:
        Weights (B, n, m), same dtype and device. Masked scores become ``-1e6`` before the
        softmax: padded entries get weight ~0, a row of length 0 is *uniform* (1/m each)
        rather than zero, and NaN in float16 (where ``-1e6`` overflows to ``-inf``).

    Source: D2L "Attention Scoring Functions", ``masked_softmax``.
    """
    if valid_lens is None:
        return nn.functional.softmax(X, dim=-1)
    shape = X.shape
    if valid_lens.dim() == 1:
        valid_lens = torch.repeat_interleave(valid_lens, shape[1])
    else:
        valid_lens = valid_lens.reshape(-1)
    X = sequence_mask(X.reshape(-1, shape[-1]), valid_lens, value=-1e6)
    return nn.functional.softmax(X.reshape(shape), dim=-1)


class AdditiveAttention(nn.Module):
    """Additive (Bahdanau) attention, ``a(q, k) = w_vᵀ tanh(W_q q + W_k k)``, as in the book.

    Args:
        key_size, query_size: k and q, the keys' and the queries' feature sizes.
        num_hiddens: h, the hidden units of the one-layer MLP.
        dropout: dropout on the attention weights (training mode only).

    Parameters ``W_q`` (h, q), ``W_k`` (h, k) and ``w_v`` (1, h), all ``nn.Linear``
    without bias. :attr:`attention_weights` holds the last call's (B, n, m) weights.

    Source: D2L "Attention Scoring Functions", ``AdditiveAttention``; Bahdanau et al. 2015.
    """

    attention_weights: Tensor

    def __init__(
        self, key_size: int, query_size: int, num_hiddens: int, dropout: float, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.W_k = nn.Linear(key_size, num_hiddens, bias=False)
        self.W_q = nn.Linear(query_size, num_hiddens, bias=False)
        self.w_v = nn.Linear(num_hiddens, 1, bias=False)
        self.dropout = nn.Dropout(dropout)

    # The two textbook classes' forwards and docstrings are alike (`duplicates`): kept as
    # the book has them, side by side, not merged.
    def forward(
        self, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor | None
    ) -> Tensor:
        """Attention pooling of ``values`` with additive scores.

        Args:
            queries: (B, n, q) float; keys (B, m, k), values (B, m, v) of its dtype and device.
            valid_lens: None, (B,) or (B, n), as :func:`masked_softmax`.

        Returns:
            (B, n, v). Memory grows as B·n·m·h: the (B, n, m, h) features tensor is
            built whole (and kept for the backward pass). A row of length 0 averages all
            m values (the ``-1e6`` fill), it is not zero.
        """
        queries, keys = self.W_q(queries), self.W_k(keys)
        # (B, n, 1, h) + (B, 1, m, h) -> (B, n, m, h)
        features = torch.tanh(queries.unsqueeze(2) + keys.unsqueeze(1))
        scores = self.w_v(features).squeeze(-1)  # (B, n, m)
        self.attention_weights = masked_softmax(scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)


class DotProductAttention(nn.Module):
    """Scaled dot-product attention, ``softmax(QKᵀ/√d) V``, as in the book.

    Args:
        dropout: dropout on the attention weights (training mode only).

    :attr:`attention_weights` holds the last call's (B, n, m) weights.

    Source: D2L "Attention Scoring Functions", ``DotProductAttention``; Vaswani et al.
    2017, eq. 1.
    """

    attention_weights: Tensor

    def __init__(self, dropout: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor | None = None
    ) -> Tensor:
        """Attention pooling of ``values`` with scores ``q·k/√d``.

        Args:
            queries: (B, n, d) float; keys (B, m, d), values (B, m, v) of its dtype and device.
            valid_lens: None, (B,) or (B, n), as :func:`masked_softmax`.

        Returns:
            (B, n, v); the (B, n, m) scores and weights are built whole. A row of length 0
            averages all m values.
        """
        d = queries.shape[-1]
        scores = torch.bmm(queries, keys.transpose(1, 2)) / math.sqrt(d)
        self.attention_weights = masked_softmax(scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)
