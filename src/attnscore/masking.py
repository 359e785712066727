"""Masks and the masked softmax.

Every mask the library accepts (valid lengths per example or per query, query lengths,
boolean "may attend" masks, causal masking) is checked once at the public entry point and
turned into one canonical :class:`AttentionMask`; everything below trusts it.

Shape legend: B batch, n queries, m keys; ``...`` are leading batch dimensions (B, or
B and heads H).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import check_floating, check_tensor, in_functorch, one_length_each, value_range
from ._mask import AttentionMask, compact
from .kernels import _ops

__all__ = ["AttentionMask", "build_mask", "masked_softmax", "sequence_mask"]


def _check_values(t: Tensor, name: str) -> int | None:
    """Check that ``t`` holds non-negative whole numbers without a device sync; return the
    largest value where it was read on the way (CPU integer tensors in eager code), else None.

    Eager CPU tensors: a ValueError naming the first bad value. Other devices and
    ``torch.compile``: ``torch._assert_async`` (no sync, no graph break; a RuntimeError of
    the same wording). Under ``torch.func`` transforms values cannot steer Python: only
    shapes, dtypes and devices are checked there."""
    compiling = torch.compiler.is_compiling()
    if not compiling and in_functorch(t):
        return None
    floating = t.is_floating_point()
    if t.numel() == 0:
        return None
    if not floating and not compiling and t.device.type == "cpu":
        low, high = value_range(t)
        if low >= 0:  # the common case: one read
            return high
        raise ValueError(f"Expected `{name}` to be non-negative, but got {low!r} instead.")
    bad = ((t < 0) | ~torch.isfinite(t) | (t != torch.floor(t))) if floating else None
    ok = ~bad.any() if bad is not None else t.min() >= 0
    if compiling or t.device.type != "cpu":
        torch._assert_async(
            ok, f"Expected `{name}` to hold non-negative whole numbers, but got others."
        )
        return None
    if bool(ok):
        return None
    first = t[bad].flatten()[0].item() if bad is not None else t.min().item()
    if floating and (first != first or abs(first) == float("inf") or first % 1):
        raise ValueError(f"Expected `{name}` to hold whole numbers, but got {first!r} instead.")
    raise ValueError(f"Expected `{name}` to be non-negative, but got {t.min().item()!r} instead.")


def _check_lengths(lengths: object, name: str, device: torch.device) -> tuple[Tensor, int | None]:
    """Check that ``lengths`` holds non-negative whole numbers; return them as int64, with
    their largest value where the check read it (else None)."""
    t = check_tensor(lengths, name)
    if t.dtype != torch.int64 and (t.dtype == torch.bool or t.is_complex()):
        # A bool tensor here is most often a PyTorch mask passed positionally (the fourth
        # argument of nn.MultiheadAttention's forward and of SDPA): say where it goes.
        where = (
            "; a bool mask goes to `attend_mask=`, True = may attend, so "
            "nn.MultiheadAttention's key_padding_mask is `attend_mask=~key_padding_mask[:, "
            "None, :]`"
            if t.dtype == torch.bool and name == "valid_lens"
            else ""
        )
        raise TypeError(
            f"Expected `{name}` to be an integer tensor (or a floating tensor of whole "
            f"numbers{where}), but got dtype {t.dtype} instead."
        )
    if t.device != device:
        raise ValueError(
            f"Expected `{name}` on the device of the scores ({device}), but got {t.device} instead."
        )
    high = _check_values(t, name)
    return (t if t.dtype == torch.int64 else t.to(torch.int64)), high


def _canonical_lengths(
    valid_lens: object,
    batch_shape: torch.Size,
    n: int,
    m: int,
    device: torch.device,
    *,
    clamp: bool = True,
) -> Tensor:
    """Key lengths per query, int64 of shape (..., n) (an expanded view), clamped to m
    (``clamp=False``: for a consumer that clamps itself, such as the masked softmax op).

    Accepted shapes, ``batch_shape`` being (B, ...): (B,) one length per example; (B, n) one
    per query, shared across the other batch dimensions (heads); ``batch_shape + (n,)``.
    """
    t, high = _check_lengths(valid_lens, "valid_lens", device)
    full = (*batch_shape, n)
    B = batch_shape[0]
    ones = (1,) * (len(batch_shape) - 1)
    shape = tuple(t.shape)
    # Lengths above m mean "every key is valid" (documented), so clamping loses nothing;
    # lengths read on the way and found within m need no clamp.
    if clamp and (high is None or high > m):
        t = t.clamp(max=m)
    if shape == (B,):
        if high is not None:  # eager CPU lengths: one view instead of two
            return t.as_strided(full, (t.stride(0), *(0,) * (len(full) - 1)))
        t = t.view(B, *ones, 1)
    elif shape == (B, n):
        t = t.view(B, *ones, n) if ones else t
    elif shape != full:
        expected = f"({B},) or ({B}, {n})"
        if len(batch_shape) > 1:
            expected += f" or {full}"
        raise ValueError(
            f"Expected `valid_lens` of shape {expected} for scores of shape "
            f"{(*batch_shape, n, m)}, but got shape {tuple(t.shape)} instead."
        )
    return t.expand(full)


def build_mask(
    batch_shape: torch.Size,
    n: int,
    m: int,
    device: torch.device,
    *,
    valid_lens: Tensor | None = None,
    query_valid_lens: Tensor | None = None,
    attend_mask: Tensor | None = None,
    causal: bool = False,
) -> AttentionMask:
    """Check every mask input and combine them into one :class:`AttentionMask`.

    Args:
        batch_shape: leading dimensions (B, ...) of the scores (..., n, m).
        n, m: numbers of queries and keys.
        device: device of the scores; every mask must be on it.
        valid_lens: key lengths, int (or whole-number float) of shape (B,), (B, n) or
            ``batch_shape + (n,)``; lengths above m mean all keys are valid.
        query_valid_lens: query lengths, shape (B,) or ``batch_shape``; queries at or beyond
            it attend nothing (their weights and outputs are zero).
        attend_mask: bool, broadcastable to ``batch_shape + (n, m)``; **True = may attend**
            (see :class:`~attnscore.functional.MaskOptions` for PyTorch's masks).
        causal: query i may attend keys j <= i only (top-left alignment, as SDPA's
            ``is_causal``: when n > m the last queries see every key, when n < m the last
            m - n keys are seen by no query).

    Returns:
        The :class:`AttentionMask`: the folded per-query ``lengths`` and the parts they
        came from (``key_lengths``, ``query_lengths``, ``causal``), and ``attend``.

    Raises:
        TypeError: a mask of the wrong type or dtype.
        ValueError: a mask of the wrong shape, a negative or fractional length, or a mask
            on another device. On CUDA (and under ``torch.compile``) the values of lengths
            are checked on the device without a sync: a bad one raises RuntimeError there.

    >>> mask = build_mask(torch.Size([1]), 3, 4, torch.device("cpu"),
    ...                   valid_lens=torch.tensor([2]), causal=True)
    >>> mask.lengths   # query i attends keys j < lengths[..., i]
    tensor([[1, 2, 2]])
    """
    key_lengths = None
    if valid_lens is not None:
        key_lengths = _canonical_lengths(valid_lens, batch_shape, n, m, device)
    lengths = key_lengths
    full = (*batch_shape, n)
    if causal:
        if not isinstance(causal, bool):
            raise TypeError(f"Expected `causal` to be a bool, but got {causal!r} instead.")
        by_position = torch.arange(1, n + 1, device=device).clamp(max=m)
        # On the compact lengths (one per example, not a copy per head and query), so that
        # a kernel that broadcasts them builds no (B, H, n, m) mask from them.
        lengths = (
            by_position if lengths is None else torch.minimum(compact(lengths), by_position)
        ).expand(full)
    query_lengths = None
    if query_valid_lens is not None:
        query_lengths, _ = _check_lengths(query_valid_lens, "query_valid_lens", device)
        B = batch_shape[0]
        if query_lengths.shape == (B,):
            query_lengths = query_lengths.reshape(B, *(1,) * (len(batch_shape) - 1))
        elif query_lengths.shape != batch_shape:
            raise ValueError(
                f"Expected `query_valid_lens` of shape ({B},) or {tuple(batch_shape)}, but got "
                f"shape {tuple(query_lengths.shape)} instead."
            )
        is_real = torch.arange(n, device=device) < query_lengths.unsqueeze(-1)
        base = torch.full((), m, dtype=torch.int64, device=device) if lengths is None else lengths
        lengths = torch.where(is_real, compact(base), 0).expand(full)
    attend = None
    if attend_mask is not None:
        attend = check_tensor(attend_mask, "attend_mask")
        if attend.dtype != torch.bool:
            raise TypeError(
                "Expected `attend_mask` to be a bool tensor (True = may attend; an additive "
                "float mask of 0 and -inf is `attend_mask=mask == 0`), but got dtype "
                f"{attend.dtype} instead."
            )
        if attend.device != device:
            raise ValueError(
                f"Expected `attend_mask` on device {device}, but got {attend.device} instead."
            )
        try:
            torch.broadcast_shapes(attend.shape, (*batch_shape, n, m))
            ok = attend.ndim <= len(batch_shape) + 2
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"Expected `attend_mask` broadcastable to {(*batch_shape, n, m)}, but got shape "
                f"{tuple(attend.shape)} instead."
            )
    return AttentionMask(n, m, lengths, attend, key_lengths, query_lengths, causal)


def sequence_mask(X: Tensor, valid_len: Tensor, value: float = 0.0) -> Tensor:
    """Replace the entries of ``X`` at or beyond each row's valid length by ``value``.

    Args:
        X: tensor (..., m) of any dtype.
        valid_len: int (or whole-number float) lengths broadcastable to ``X.shape[:-1]``,
            usually (rows,) for X (rows, m); lengths above m keep the whole row.
        value: what padded entries become.

    Returns:
        A new tensor of ``X``'s shape and dtype (the textbook's version writes into ``X``).

    Raises:
        TypeError, ValueError: as :func:`build_mask` for bad lengths, or when ``valid_len``
            does not broadcast to ``X.shape[:-1]``.

    Source: D2L "Attention Scoring Functions" (``d2l.sequence_mask``).

    >>> sequence_mask(torch.ones(2, 3), torch.tensor([1, 2]))
    tensor([[1., 0., 0.],
            [1., 1., 0.]])
    """
    X = check_tensor(X, "X")
    if X.ndim < 1:
        raise ValueError("Expected `X` with at least 1 dimension, but got shape () instead.")
    lengths, _ = _check_lengths(valid_len, "valid_len", X.device)
    try:
        torch.broadcast_shapes(lengths.shape, X.shape[:-1])
        ok = lengths.ndim <= X.ndim - 1
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"Expected `valid_len` broadcastable to {tuple(X.shape[:-1])} for X of shape "
            f"{tuple(X.shape)}, but got shape {tuple(lengths.shape)} instead."
        )
    keep = torch.arange(X.shape[-1], device=X.device) < lengths.unsqueeze(-1)
    return X.masked_fill(~keep, value)


def masked_softmax(X: Tensor, valid_lens: Tensor | int | None = None) -> Tensor:
    """Softmax over the last axis of ``X``, ignoring positions beyond the valid lengths.

    For row ``X[b, i, :]`` with valid length L = ``valid_lens[b]`` (or ``valid_lens[b, i]``)
    the result is ``softmax(X[b, i, :L])`` followed by m - L exact zeros. Rows with L = 0
    are all zeros and get zero gradient (not the uniform weights of the textbook's -1e6
    trick, and not NaN). Whatever ``X`` holds at masked positions (even NaN or inf) changes
    neither the result nor the gradient.

    Args:
        X: scores (B, n, m) (more leading dimensions allowed: (B, ..., n, m)); float16,
            bfloat16, float32 or float64. 16-bit inputs are reduced in float32.
        valid_lens: None (plain softmax), or lengths of shape (B,) (one per example) or
            (B, n) (one per query), or (B, ..., n); integer tensor or floating tensor of
            whole numbers, on X's device; or one ``int`` (or 0-d tensor) for every
            example. Lengths above m mean "all valid".

    Returns:
        Attention weights of ``X``'s shape and dtype; each row sums to 1 over its valid
        positions (or is all zeros). Empty dimensions give an empty result.

    Raises:
        TypeError: ``X`` not a floating tensor, ``valid_lens`` not an integer-valued tensor.
        ValueError: ``X`` with fewer than 3 dimensions; ``valid_lens`` of the wrong shape,
            negative, fractional, or on another device.

    Source: D2L "Attention Scoring Functions", masked softmax operation.

    >>> X = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])
    >>> masked_softmax(X, torch.tensor([[2, 0]]))
    tensor([[[0.2689, 0.7311, 0.0000],
             [0.0000, 0.0000, 0.0000]]])
    """
    X = check_floating(X, "X", min_ndim=3)
    if valid_lens is None:
        return _ops.softmax(X)  # 16-bit: reduced in float32 too
    if isinstance(valid_lens, int):
        valid_lens = one_length_each(valid_lens, X)
    # Small calls: one backend step, where the lengths pass its checks (else those below).
    small = _ops.small_masked_softmax(X, valid_lens)
    if small is not None:
        return small
    *batch, n, m = X.shape
    lengths = _canonical_lengths(valid_lens, torch.Size(batch), n, m, X.device, clamp=False)
    return _ops.masked_softmax(X, lengths)
