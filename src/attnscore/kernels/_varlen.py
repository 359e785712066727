"""Dot-product attention by key lengths that never reads a padded key: the variable-length
flash-attention kernel on the padded layout, with no copy and no mask.

A variable-length (``varlen``) attention kernel takes sequences laid end to end: queries in
rows ``[cu_q[s], cu_q[s+1])`` attend keys in rows ``[cu_k[s], cu_k[s+1])`` of the same
tensors. Padded inputs are one such layout already, once every (example, head) pair of
(B, H, n, d) is read as one sequence of n rows, (B·H·n, 1, d), a view. What is left is to
keep the padded keys out: each pair ``i`` with key length ``L`` becomes two sequences,

- ``2i``: its n queries over its keys ``[i·m, i·m + L)``;
- ``2i + 1``: no query, over the padded keys ``[i·m + L, (i + 1)·m)``,

so that no query reads a padded key, and the backward gives padded keys exact zero
gradients (no query of their sequence). Nothing is zeroed and nothing is masked: NaN in the
padding cannot reach the output. A pair of length 0 has no key: flash attention writes
zeros for its queries, with zero gradients. Causal masking is not offered (the kernel aligns
it to the bottom right of each sequence; attnscore's is top-left).

Source: Dao, "FlashAttention-2" (2023), the variable-length interface
(``flash_attn_varlen_func``), here through PyTorch's own build of it
(``aten::_flash_attention_forward``, with its autograd formula); D2L "Attention Scoring
Functions" (scaled dot-product attention with valid lengths).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from .._thresholds import value
from ._dispatch import enabled
from ._select import AttentionCall, Implementation

__all__ = ["VARLEN_MIN_KEYS", "FlashVarlen", "attention", "sequences"]

#: (dtype, whether the call trains) -> the fewest keys m from which this kernel replaces
#: SDPA with the dense mask on CUDA (attnscore._thresholds, ``varlen_min_keys``).
VARLEN_MIN_KEYS: Mapping[tuple[torch.dtype, bool], int] = value("varlen_min_keys")

#: (rows of q, rows of k, rows of v, cu_q, cu_k, longest query sequence, longest key
#: sequence, dropout_p, scale) -> output rows: the varlen kernel (flash attention on CUDA;
#: tests give a reference).
Kernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int, int, float, float], Tensor]


@functools.lru_cache(maxsize=64)
def _offsets(pairs: int, n: int, m: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """int32 (2·pairs + 1,) each: the query offsets ``[0, n, n, 2n, 2n, ...]`` and the key
    offsets before lengths, ``[0, 0, m, m, 2m, ...]`` (kept: a new call of these sizes
    reuses them; made outside inference mode, since a training call saves them)."""
    with torch.inference_mode(False):
        s = torch.arange(2 * pairs + 1, device=device, dtype=torch.int32)
        return (s + 1) // 2 * n, s // 2 * m


def sequences(lengths: Tensor, pairs: int, n: int, m: int) -> tuple[Tensor, Tensor]:
    """The offsets of the sequences described in the module docstring: ``lengths`` int64 in
    [0, m], one per (example, head) pair (``pairs`` of them, in any shape) -> (cu_q, cu_k),
    int32 (2·pairs + 1,) on ``lengths``' device."""
    cu_q, base = _offsets(pairs, n, m, lengths.device)
    cu_k = base.clone()
    cu_k[1::2] += lengths.reshape(pairs).to(torch.int32)
    return cu_q, cu_k


def _flash(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    max_q: int,
    max_k: int,
    dropout_p: float,
    scale: float,
) -> Tensor:
    out: Tensor = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, False, False, scale=scale
    )[0]
    return out


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Tensor,
    *,
    scale: float,
    dropout_p: float = 0.0,
    kernel: Kernel = _flash,
) -> Tensor:
    """Dot-product attention of q (B, H, n, d) over keys j < lengths of k (B, H, m, d), v
    (B, H, m, d): ``lengths`` int64 in [0, m] broadcastable to (B, H, 1) (one per example
    and head) -> (B, H, n, d) in q's dtype. Pairs of length 0 give zeros with zero
    gradients; padded keys are never read and get zero gradients. Dropout on the weights
    with probability ``dropout_p`` (the kernel's own generator).

    Runs on CUDA in float16 and bfloat16 with d a multiple of 8 up to 256 (what
    :class:`FlashVarlen` checks); ``kernel`` is for the tests' reference on the CPU.
    Contiguous inputs are viewed, others copied once into that layout.

    Source: see the module docstring."""
    B, H, n, d = q.shape
    m = k.shape[-2]
    pairs = B * H
    cu_q, cu_k = sequences(lengths.expand(B, H, 1), pairs, n, m)
    q, k, v = (t.expand(B, H, t.shape[-2], d).reshape(-1, 1, d) for t in (q, k, v))
    return kernel(q, k, v, cu_q, cu_k, n, m, dropout_p, scale).view(B, H, n, d)


@functools.cache
def _flash_here(index: int) -> bool:
    """Whether PyTorch's flash attention runs on CUDA device ``index`` (sm80 or newer)."""
    return torch.backends.cuda.is_flash_attention_available() and (
        torch.cuda.get_device_capability(index) >= (8, 0)
    )


class FlashVarlen(Implementation):
    """:func:`attention` for calls by one key length per example (and head) on CUDA, in
    float16 and bfloat16, from the key counts where it measured faster than SDPA with the
    dense mask (:data:`VARLEN_MIN_KEYS`); scorers that declare a projection (general,
    cosine) run on their projections. The attention reads no padding; in training a
    projected call's padding is zeroed first (``call.inert``): the projections' gradients
    read it."""

    name = "flash_varlen"
    summary = (
        "flash attention's variable-length kernel on the padded layout: padded keys never read"
    )
    kinds = frozenset({"lengths"})

    def supports(self, call: AttentionCall) -> str | None:
        if not enabled():
            return "kernels disabled"
        if call.traced:
            return "traced or transformed"
        if call.bias is not None:
            return "a score bias"
        if call.kind != "lengths":
            return f"no lengths to skip by (mask: {call.kind})"
        if call.lengths.shape[-1] != 1:
            return "lengths that differ between queries (causal masking, query lengths, (B, n))"
        q, k, v = call.q, call.k, call.v
        if q.dtype not in (torch.float16, torch.bfloat16):
            return f"{q.dtype} (flash attention takes float16 and bfloat16)"
        d = k.shape[-1]  # (the size of the projections too: general, cosine)
        if v.shape[-1] != d or d % 8 or d > 256:
            return (
                f"sizes d={d}, dv={v.shape[-1]} (flash attention: equal, a multiple of 8, <= 256)"
            )
        if not _flash_here(q.device.index or 0):
            return "flash attention is not built for this GPU (sm80 or newer)"
        least = VARLEN_MIN_KEYS.get((q.dtype, call.needs_grad))
        step = "forward + backward" if call.needs_grad else "forward"
        if least is None:
            return f"{q.dtype} {step} (SDPA with the mask measured faster)"
        if k.shape[-2] < least:
            return f"{k.shape[-2]} keys, fewer than {least} (SDPA with the mask measured faster)"
        return None

    def run(self, call: AttentionCall) -> Tensor:
        q, k, v = call.projected() if call.project or call.inert else (call.q, call.k, call.v)
        return attention(q, k, v, call.lengths, scale=call.scale, dropout_p=call.dropout_p)
