"""The float64 NumPy reference the layers are tested against, written from the formulas
(not from the package): masks as a boolean (..., n, m) array, the masked softmax with
all-zero rows where nothing may be attended, and each scorer."""

from __future__ import annotations

import numpy as np


def allowed(B, n, m, *, lens=None, qlens=None, attend=None, causal=False, heads=None):
    """True where query i of example b may attend key j: shape (B, n, m), or (B, H, n, m)."""
    shape = (B, n, m) if heads is None else (B, heads, n, m)
    ok = np.ones(shape, dtype=bool)
    i, j = np.arange(n)[:, None], np.arange(m)[None, :]
    for b in range(B):
        if lens is not None:
            lb = np.asarray(lens[b])
            per_query = lb[:, None] if lb.ndim == 1 else lb
            ok[b] &= j < per_query
        if causal:
            ok[b] &= j <= i
        if qlens is not None:
            ok[b] &= i < qlens[b]
    if attend is not None:
        ok &= np.broadcast_to(attend, shape)
    return ok


def softmax(scores, ok):
    s = np.where(ok, scores, -np.inf)
    top = s.max(-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.where(ok, np.exp(np.where(ok, s, 0.0) - top), 0.0)
    total = e.sum(-1, keepdims=True)
    return e / np.where(total > 0, total, 1.0)


def dot_scores(q, k, scale=None):
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    return q @ np.swapaxes(k, -1, -2) * scale


def additive_scores(q, k, W_q, W_k, w_v, b=None, g=None):
    qh = q @ W_q + (0 if b is None else b)
    kh = k @ W_k
    w = w_v[:, 0]
    if g is not None:
        w = g * w / np.linalg.norm(w)
    return np.tanh(qh[..., :, None, :] + kh[..., None, :, :]) @ w


def general_scores(q, k, W_a):
    return q @ W_a @ np.swapaxes(k, -1, -2)


def cosine_scores(q, k, s):
    def unit(x):
        return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-300)

    return s * unit(q) @ np.swapaxes(unit(k), -1, -2)


def attention(scores, ok, values):
    """(output, weights) of the masked softmax of ``scores`` pooling ``values``."""
    w = softmax(scores, ok)
    # padded values may hold NaN: weights there are exactly 0, and so is their share
    v = np.where(np.isfinite(values), values, 0.0)
    return w @ v, w
