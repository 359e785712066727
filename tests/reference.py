"""Independent references the tests compare against: never the code under test.

* float64 NumPy formulations written from the formulas;
* the textbook's plain PyTorch formulation (D2L "Attention Scoring Functions", including
  its -1e6 masking trick), written once in :mod:`attnscore.textbook` and re-exported here.
"""

from __future__ import annotations

import math

import numpy as np

from attnscore import textbook


def np_masked_softmax(X: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Row-by-row float64 softmax over the first lengths[...] entries; zeros elsewhere.

    ``lengths`` has X.shape[:-1] (already broadcast).
    """
    X = np.asarray(X, dtype=np.float64)
    out = np.zeros_like(X)
    rows = math.prod(X.shape[:-1])  # not -1: numpy cannot infer it when m = 0
    flat_x = X.reshape(rows, X.shape[-1])
    flat_l = np.broadcast_to(lengths, X.shape[:-1]).reshape(rows)
    flat_o = out.reshape(rows, X.shape[-1])
    for r, (row, L) in enumerate(zip(flat_x, flat_l, strict=True)):
        L = int(min(L, X.shape[-1]))
        if L == 0:
            continue
        e = np.exp(row[:L] - row[:L].max())
        flat_o[r, :L] = e / e.sum()
    return out


def np_masked_softmax_dense(X: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """float64 softmax over the positions where ``allowed`` is True; zero rows if none."""
    X = np.asarray(X, dtype=np.float64)
    allowed = np.broadcast_to(allowed, X.shape)
    out = np.zeros_like(X)
    for idx in np.ndindex(*X.shape[:-1]):
        a = allowed[idx]
        if a.any():
            e = np.exp(X[idx][a] - X[idx][a].max())
            out[idx][a] = e / e.sum()
    return out


def broadcast_lengths(valid_lens: np.ndarray, batch_shape: tuple[int, ...], n: int) -> np.ndarray:
    """(B,) or (B, n) lengths to batch_shape + (n,)."""
    v = np.asarray(valid_lens)
    extra = (1,) * (len(batch_shape) - 1)
    v = v.reshape(v.shape[0], *extra, 1) if v.ndim == 1 else v.reshape(v.shape[0], *extra, n)
    return np.broadcast_to(v, (*batch_shape, n))


def np_attention(weights: np.ndarray, values: np.ndarray) -> np.ndarray:
    return np.einsum("...nm,...mv->...nv", weights, np.asarray(values, dtype=np.float64))


def np_additive_scores(q, k, W_q, W_k, w_v, b=None):
    """w_vᵀ tanh(W_q q + W_k k + b), float64, the textbook's broadcast form."""
    qh = np.asarray(q, np.float64) @ np.asarray(W_q, np.float64).T
    if b is not None:
        qh = qh + np.asarray(b, np.float64)
    kh = np.asarray(k, np.float64) @ np.asarray(W_k, np.float64).T
    feats = np.tanh(qh[..., :, None, :] + kh[..., None, :, :])
    return feats @ np.asarray(w_v, np.float64).reshape(-1)


def np_dot_scores(q, k, scale=None):
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return scale * (q @ np.swapaxes(k, -1, -2))


# ---- the textbook's PyTorch code: one copy, in attnscore.textbook ---------------------
# Re-exported under the names the tests use. It is not the code under test: it is the
# book's formulation (with its -1e6 trick), which the library must agree with where the
# book is right, and differ from where it is not (length-0 rows).

d2l_sequence_mask = textbook.sequence_mask
d2l_masked_softmax = textbook.masked_softmax
D2LAdditiveAttention = textbook.AdditiveAttention
D2LDotProductAttention = textbook.DotProductAttention
