"""Independent references the tests compare against: never the code under test.

* float64 NumPy formulations written from the formulas;
* the textbook's plain PyTorch formulation (D2L "Attention Scoring Functions"), rewritten
  here, including its -1e6 masking trick.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn


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


# ---- the textbook's PyTorch code, rewritten for comparison ----------------------------


def d2l_sequence_mask(X, valid_len, value=0.0):
    maxlen = X.size(1)
    mask = torch.arange(maxlen, dtype=torch.float32, device=X.device)[None, :] < valid_len[:, None]
    X[~mask] = value  # in place, as the book does
    return X


def d2l_masked_softmax(X, valid_lens):
    if valid_lens is None:
        return nn.functional.softmax(X, dim=-1)
    shape = X.shape
    if valid_lens.dim() == 1:
        valid_lens = torch.repeat_interleave(valid_lens, shape[1])
    else:
        valid_lens = valid_lens.reshape(-1)
    X = d2l_sequence_mask(X.reshape(-1, shape[-1]), valid_lens, value=-1e6)
    return nn.functional.softmax(X.reshape(shape), dim=-1)


class D2LAdditiveAttention(nn.Module):
    def __init__(self, key_size, query_size, num_hiddens, dropout):
        super().__init__()
        self.W_k = nn.Linear(key_size, num_hiddens, bias=False)
        self.W_q = nn.Linear(query_size, num_hiddens, bias=False)
        self.w_v = nn.Linear(num_hiddens, 1, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, queries, keys, values, valid_lens):
        queries, keys = self.W_q(queries), self.W_k(keys)
        features = torch.tanh(queries.unsqueeze(2) + keys.unsqueeze(1))
        scores = self.w_v(features).squeeze(-1)
        self.attention_weights = d2l_masked_softmax(scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)


class D2LDotProductAttention(nn.Module):
    def __init__(self, dropout):
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(self, queries, keys, values, valid_lens=None):
        d = queries.shape[-1]
        scores = torch.bmm(queries, keys.transpose(1, 2)) / math.sqrt(d)
        self.attention_weights = d2l_masked_softmax(scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)
