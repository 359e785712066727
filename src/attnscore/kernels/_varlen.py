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
zeros for its queries, with zero gradients.

Causal masking with key lengths (query i attends keys j <= i and j < L) takes two calls,
because the kernel aligns causal masking to the bottom right of each sequence and attnscore
to the top left: the two agree on square sequences only. With s = min(L, n), the first call
(causal) runs queries [0, s) over keys [0, s), a square; the second (not causal) queries
[s, n) over keys [0, L), every one of which they may attend. Each pair is three sequences in
each call; queries a call does not run meet no key there (zeros), and the outputs add up.

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

from .._mask import compact
from .._thresholds import value
from ._dispatch import enabled
from ._select import AttentionCall, Implementation

#: (dtype, whether the call trains) -> the fewest keys m from which this kernel replaces
#: SDPA with the dense mask on CUDA (attnscore._thresholds, ``varlen_min_keys``).
VARLEN_MIN_KEYS: Mapping[tuple[torch.dtype, bool], int] = value("varlen_min_keys")
#: The same for causal masking with key lengths (two calls; ``varlen_causal_min_keys``).
VARLEN_CAUSAL_MIN_KEYS: Mapping[tuple[torch.dtype, bool], int] = value("varlen_causal_min_keys")

#: (rows of q, rows of k, rows of v, cu_q, cu_k, longest query sequence, longest key
#: sequence, dropout_p, scale, causal) -> output rows: the varlen kernel (flash attention on
#: CUDA; tests give a reference).
Kernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int, int, float, float, bool], Tensor]


@functools.lru_cache(maxsize=64)
def _offsets(pairs: int, n: int, m: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """int32 (2·pairs + 1,) the query offsets ``[0, n, n, 2n, 2n, ...]`` and the key
    offsets before lengths, ``[0, 0, m, m, 2m, ...]``, and the places of the lengths in
    them, ``[1, 3, 5, ...]`` (int64 (pairs,)). Kept: a new call of these sizes reuses them
    (made outside inference mode, since a training call saves them)."""
    with torch.inference_mode(False):
        s = torch.arange(2 * pairs + 1, device=device, dtype=torch.int32)
        odd = torch.arange(1, 2 * pairs, 2, device=device)
        return (s + 1) // 2 * n, s // 2 * m, odd


def sequences(lengths: Tensor, pairs: int, n: int, m: int) -> tuple[Tensor, Tensor]:
    """The offsets of the sequences described in the module docstring: ``lengths`` int64 in
    [0, m], one per (example, head) pair (``pairs`` of them, in any shape) -> (cu_q, cu_k),
    int32 (2·pairs + 1,) on ``lengths``' device."""
    cu_q, base, odd = _offsets(pairs, n, m, lengths.device)
    # One op on the host where a copy and an update of the odd places took three.
    return cu_q, base.index_add(0, odd, lengths.reshape(pairs).to(torch.int32))


def _rows(t: Tensor, B: int, H: int, d: int) -> Tensor:
    """(B or 1, H or 1, s, d) -> (B·H·s, 1, d), one row per position of each pair."""
    if t.shape[0] != B or t.shape[1] != H:
        t = t.expand(B, H, t.shape[-2], d)
    return t.reshape(-1, 1, d)


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
    causal: bool,
) -> Tensor:
    out: Tensor = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, False, scale=scale
    )[0]
    return out


def causal_sequences(lengths: Tensor, pairs: int, n: int, m: int) -> tuple[Tensor, Tensor, Tensor]:
    """The offsets of the two calls of causal masking with key lengths (module docstring):
    ``lengths`` int64 in [0, m], one per pair -> (cu_q, cu_k of the causal call, cu_k of
    the other), int32 (3·pairs + 1,). Pair i's sequences, queries and keys:

    - causal call: [i·n, i·n + s) over [i·m, i·m + s); [i·n + s, (i + 1)·n) over no key;
      no query over [i·m + s, (i + 1)·m);
    - other call: [i·n, i·n + s) over no key; [i·n + s, (i + 1)·n) over [i·m, i·m + L); no
      query over [i·m + L, (i + 1)·m).
    """
    rows_q, rows_k, _ = _offsets(pairs, n, m, lengths.device)  # i·n and i·m at even places
    starts_q, starts_k = rows_q[:-1:2].unsqueeze(1), rows_k[:-1:2].unsqueeze(1)
    L = lengths.reshape(pairs, 1).to(torch.int32)
    s = L.clamp(max=n)
    zero = torch.zeros_like(L)

    def laid(starts: Tensor, steps: tuple[Tensor, ...], end: Tensor) -> Tensor:
        return torch.cat(((starts + torch.cat(steps, 1)).reshape(-1), end))

    cu_q = laid(starts_q, (zero, s, zero + n), rows_q[-1:])
    cu_k_causal = laid(starts_k, (zero, s, s), rows_k[-1:])
    cu_k_other = laid(starts_k, (zero, zero, L), rows_k[-1:])
    return cu_q, cu_k_causal, cu_k_other


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Tensor,
    *,
    scale: float,
    dropout_p: float = 0.0,
    causal: bool = False,
    kernel: Kernel = _flash,
) -> Tensor:
    """Dot-product attention of q (B, H, n, d) over keys j < lengths of k (B, H, m, d), v
    (B, H, m, d), and with ``causal`` over keys j <= i too (top-left): ``lengths`` int64 in
    [0, m] broadcastable to (B, H, 1) (one per example and head) -> (B, H, n, d) in q's
    dtype. Queries with no key give zeros with zero gradients; padded keys are never read
    and get zero gradients. Dropout on the weights with probability ``dropout_p`` (the
    kernel's own generator).

    Runs on CUDA in float16 and bfloat16 with d a multiple of 8 up to 256 (what
    :class:`FlashVarlen` checks); ``kernel`` is for the tests' reference on the CPU.
    Contiguous inputs are viewed, others copied once into that layout.

    Source: see the module docstring."""
    B, H, n, d = q.shape
    m = k.shape[-2]
    pairs = B * H
    # Each op costs the host microseconds (it launches the kernels): expand only what is
    # broadcast, so that the common call (one length per example, k and v of q's batch) is
    # views alone.
    if lengths.numel() != pairs:
        lengths = lengths.expand(B, H, 1)
    q, k, v = (_rows(t, B, H, d) for t in (q, k, v))
    if not causal:
        cu_q, cu_k = sequences(lengths, pairs, n, m)
        return kernel(q, k, v, cu_q, cu_k, n, m, dropout_p, scale, False).view(B, H, n, d)
    cu_q, cu_k_causal, cu_k_other = causal_sequences(lengths, pairs, n, m)
    square = kernel(q, k, v, cu_q, cu_k_causal, n, m, dropout_p, scale, True)
    rest = kernel(q, k, v, cu_q, cu_k_other, n, m, dropout_p, scale, False)
    return (square + rest).view(B, H, n, d)


@functools.cache
def _flash_here(index: int) -> bool:
    """Whether PyTorch's flash attention runs on CUDA device ``index`` (sm80 or newer)."""
    return torch.backends.cuda.is_flash_attention_available() and (
        torch.cuda.get_device_capability(index) >= (8, 0)
    )


class FlashVarlen(Implementation):
    """:func:`attention` for calls by one key length per example (and head), with or
    without causal masking, on CUDA, in float16 and bfloat16, from the key counts where it
    measured faster than SDPA with the dense mask (:data:`VARLEN_MIN_KEYS`,
    :data:`VARLEN_CAUSAL_MIN_KEYS`). Scorers that declare a projection (general, cosine)
    run on their projections. The attention reads no padding; in training a projected
    call's padding is zeroed first (``call.inert``): the projections' gradients read it."""

    name = "flash_varlen"
    summary = (
        "flash attention's variable-length kernel on the padded layout: padded keys never read"
    )
    kinds = frozenset({"lengths"})

    def padding_inert(self, call: AttentionCall) -> bool:
        return True  # padded keys are never read

    def supports(self, call: AttentionCall) -> str | None:
        if not enabled():
            return "kernels disabled"
        if call.traced:
            return "traced or transformed"
        if call.bias is not None:
            return "a score bias"
        if call.kind != "lengths":
            return f"no lengths to skip by (mask: {call.kind})"
        key_lengths = None  # set: causal masking with key lengths, the two-call route
        if call.lengths.shape[-1] != 1:
            key_lengths = self._key_lengths(call)
            if key_lengths is None:
                return "lengths that differ between queries (query lengths, (B, n) key lengths)"
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
        table = VARLEN_MIN_KEYS if key_lengths is None else VARLEN_CAUSAL_MIN_KEYS
        least = table.get((q.dtype, call.needs_grad))
        step = "forward + backward" if call.needs_grad else "forward"
        if least is None:
            return f"{q.dtype} {step} (SDPA with the mask measured faster)"
        if k.shape[-2] < least:
            return f"{k.shape[-2]} keys, fewer than {least} (SDPA with the mask measured faster)"
        call.notes["key_lengths"] = key_lengths
        return None

    @staticmethod
    def _key_lengths(call: AttentionCall) -> Tensor | None:
        """Causal masking with one key length per pair, (B or 1, H or 1, 1); else None."""
        mask = call.mask
        if not mask.causal or mask.query_lengths is not None or mask.key_lengths is None:
            return None
        key_lengths = compact(mask.key_lengths)
        return key_lengths if key_lengths.shape[-1] == 1 else None

    def run(self, call: AttentionCall) -> Tensor:
        q, k, v = call.projected() if call.project or call.inert else (call.q, call.k, call.v)
        p, key_lengths = call.dropout_p, call.notes["key_lengths"]  # (what supports found)
        if key_lengths is None:  # causal masking too, if any, is in these lengths
            return attention(q, k, v, call.lengths, scale=call.scale, dropout_p=p)
        return attention(q, k, v, key_lengths, scale=call.scale, dropout_p=p, causal=True)
