"""Dot-product attention by lengths that skips padded key blocks: PyTorch's
``flex_attention`` with a block mask written straight from the lengths.

SDPA with a dense mask reads and multiplies every key, padded or not. ``flex_attention``
works on (query block x key block) tiles and visits only the tiles a block mask lists, so
with lengths the key blocks wholly beyond every length of a query block are never read.
The block mask comes from the lengths in a few small tensor ops (no (n, m) mask is built):
for each query block, the key blocks below the shortest length of its queries are *full*
(no masking inside), those up to the longest length *partial* (the mask function
``kv_idx < lengths[b, h, q_idx]`` applies), the rest absent.

Shapes: q (B, H, n, d), k (B, H, m, d), v (B, H, m, dv); lengths (B, H, n) int64 in [0, m]
(expanded views welcome). A query of length 0 gets zeros with zero gradients
(``flex_attention`` returns 0 for a row that attends nothing).

The caller guarantees finite inputs: a padded key inside a partial block is multiplied by
an exact zero weight, which a NaN would survive.

On CUDA the compiled ``flex_attention`` runs (compiled once per dtype and head size with
dynamic shapes, so new batch and sequence sizes and new lengths do not recompile). On the
CPU the eager one runs, forward only (PyTorch has no CPU backward for it): the test
suite's route to this module's block masks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from .._mask import AttentionMask
from .._thresholds import value
from ._dispatch import enabled
from ._sdpa import inert_by_mask
from ._select import AttentionCall, Implementation

__all__ = ["BLOCK", "FLEX_MIN_KEYS", "Flex", "attention", "block_mask", "flex_takes"]

BLOCK = 128
"""Query and key block size of the block mask (``flex_attention``'s default tile)."""


# Where flex_attention with a block mask from the lengths replaces SDPA with the dense mask:
# (dtype, whether the call trains) -> the fewest keys m. Empty: it measured slower than
# SDPA with the dense mask everywhere (attnscore._thresholds, ``flex_min_keys``).
FLEX_MIN_KEYS: Mapping[tuple[torch.dtype, bool], int] = value("flex_min_keys")


def flex_takes(q: Tensor, k: Tensor, mask: AttentionMask, dropout_p: float) -> str | None:
    """None where :func:`attention` (``flex_attention``, padding skipped) runs these 4-D
    inputs, q (B, H, n, d) and k (B, H, m, d), with ``mask`` (lengths over (B, H)); else why
    SDPA with the dense mask runs them."""
    if dropout_p != 0.0:
        return "dropout (flex_attention has none)"
    if mask.lengths is None or mask.attend is not None:
        return "a boolean mask (no lengths to skip by)"
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    least = FLEX_MIN_KEYS.get((q.dtype, training))
    step = "forward + backward" if training else "forward"
    if least is None:
        return f"{q.dtype} {step} (SDPA with the mask measured faster)"
    if k.shape[-2] < least:
        return f"{k.shape[-2]} keys, fewer than {least} (SDPA with the mask measured faster)"
    if not q.is_cuda:
        return "not a CUDA tensor (flex_attention has no CPU backward)"
    return None


def _blocks(size: int) -> int:
    return -(-size // BLOCK)


def block_mask(lengths: Tensor, B: int, H: int, n: int, m: int) -> Any:
    """The ``BlockMask`` of ``lengths`` (int64 in [0, m], broadcastable to (B, H, n)): query
    i attends keys
    j < lengths[b, h, i]; key blocks beyond the longest length of a query block are absent.

    Source: the block-sparse format of ``torch.nn.attention.flex_attention.BlockMask``
    (``from_kv_blocks``), built from lengths instead of by evaluating a mask function on
    every (query, key) pair."""
    from torch.nn.attention.flex_attention import BlockMask

    q_blocks, k_blocks = _blocks(n), _blocks(m)
    pad = q_blocks * BLOCK - n
    by_block = lengths.expand(B, H, n)
    # Rows past n (the last query block's tail) count as neither the longest nor the
    # shortest length of their block.
    padded = torch.nn.functional.pad(by_block, (0, pad), value=0)
    shortest = torch.nn.functional.pad(by_block, (0, pad), value=m)
    longest = padded.view(B, H, q_blocks, BLOCK).amax(-1)
    shortest = shortest.view(B, H, q_blocks, BLOCK).amin(-1)
    # Key blocks [0, full) lie below every length of the block; [full, seen) hold a
    # length's end for some query of it (a last block shorter than BLOCK is partial).
    full = shortest // BLOCK
    seen = (longest + BLOCK - 1) // BLOCK
    order = torch.arange(k_blocks, device=lengths.device, dtype=torch.int32)
    order = order.expand(B, H, q_blocks, k_blocks)
    partial_indices = (order + full.unsqueeze(-1).to(torch.int32)).clamp(max=k_blocks - 1)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # May be asked about the padded tail of the last query block: length 0 there.
        return kv_idx < padded[b, h, q_idx]

    return BlockMask.from_kv_blocks(
        (seen - full).to(torch.int32),
        partial_indices.contiguous(),
        full.to(torch.int32),
        order.contiguous(),
        BLOCK_SIZE=BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(n, m),
    )


@functools.cache
def _compiled() -> Callable[..., Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    compiled: Callable[..., Tensor] = torch.compile(flex_attention, dynamic=True)
    return compiled


def attention(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, *, scale: float) -> Tensor:
    """Dot-product attention, query i over keys j < lengths[b, h, i]: q (B, H, n, d), k (B,
    H, m, d), v (B, H, m, dv), lengths int64 in [0, m] broadcastable to (B, H, n) -> (B, H,
    n, dv) in q's dtype; rows of length 0 are zeros (zero gradients). Inputs must be finite
    (see the module docstring), else NaN may reach other queries. Differentiable on CUDA;
    on the CPU forward only (eager).

    Source: ``torch.nn.attention.flex_attention`` with :func:`block_mask`; D2L "Attention
    Scoring Functions" (scaled dot-product attention with valid lengths)."""
    from torch.nn.attention.flex_attention import flex_attention

    B, H, n = q.shape[:3]
    mask = block_mask(lengths, B, H, n, k.shape[-2])
    if q.is_cuda:
        return _compiled()(q, k, v, block_mask=mask, scale=scale)
    out: Tensor = flex_attention(q, k, v, block_mask=mask, scale=scale)  # eager: forward only
    return out


class Flex(Implementation):
    """:func:`attention` for calls by lengths on CUDA, where it measured faster than SDPA
    with the dense mask (:data:`FLEX_MIN_KEYS`, :func:`flex_takes`). Padded keys inside a
    visited block meet exact zero weights: they are zeroed first, without looking (a look
    is a device sync), since 0 x NaN is NaN."""

    name = "flex"
    summary = "flex_attention with a block mask from the lengths: padded key blocks never read"
    kinds = frozenset({"lengths"})

    def supports(self, call: AttentionCall) -> str | None:
        if not enabled():
            return "kernels disabled"
        if call.traced:
            return "traced or transformed"
        if not call.finite:
            return "inputs hold NaN or inf"
        if call.bias is not None or call.project is not None:
            return "a score bias or a projected scorer"
        if call.kind != "lengths":
            return f"no lengths to skip by (mask: {call.kind})"
        return flex_takes(call.q, call.k, call.mask, call.dropout_p)

    def run(self, call: AttentionCall) -> Tensor:
        assert call.mask.lengths is not None
        q, k, v = inert_by_mask(call.q, call.k, call.v, call.mask)
        return attention(q, k, v, call.mask.lengths, scale=call.scale)
