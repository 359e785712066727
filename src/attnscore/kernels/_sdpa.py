"""PyTorch's own attention kernel (``scaled_dot_product_attention``, SDPA) under the
library's guarantees: the one place that calls it.

Dot-product attention runs here whenever there is nothing to skip: no mask, causal
masking alone (``is_causal``), boolean masks, and key lengths where skipping does not pay
(:func:`masked`), and every call with a score bias, which goes to SDPA as its float mask
(:func:`biased`); :class:`Sdpa` is its entry in the priority lists of
:mod:`attnscore.kernels._select`. What SDPA does not
promise by itself, this module adds:

- **Padding is inert.** Keys that no query may attend, their values, and queries that may
  attend nothing are zeroed before the call, because SDPA reads them (a NaN there would
  reach the output and the gradients).
- **Rows with no key are zeros** with zero gradients, on every backend: where SDPA itself
  does not give zeros for a fully masked row (:func:`empty_rows_are_zero`), such rows
  attend key 0 inside the call and are zeroed after.

Shapes: B batch, H heads (or any flattened leading dimensions), n queries, m keys, d
query/key size, dv value size. Everything here takes the 4-D layout (B, H, n, d).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import LOOK_NUMEL, constant_when_compiling, garbage_in, in_transform
from .._mask import AttentionMask, compact
from . import _ops
from ._dispatch import enabled
from ._select import AttentionCall, Implementation, Runner


def as_4d(t: Tensor) -> Tensor:
    """(B, n, d) -> (B, 1, n, d); (B, H, n, d) as is; (B, ..., n, d) -> (B, prod(...), n, d)."""
    if t.ndim == 3:
        return t.unsqueeze(1)
    if t.ndim == 4:
        return t
    return t.reshape(t.shape[0], -1, *t.shape[-2:])


@constant_when_compiling
def empty_rows_are_zero(device_type: str) -> bool:
    """Whether SDPA on this device type returns zeros, with zero gradients, for a query whose
    mask allows no key (torch 2.5+ on the CPU does; some GPU backends give NaN). Probed once
    per device type with a tiny call (a constant for torch.compile)."""
    return _probe_empty_rows(device_type)


@functools.cache
def _probe_empty_rows(device_type: str) -> bool:
    if device_type != "cpu":
        return False  # several GPU kernels may serve one call: never rely on it there
    with torch.inference_mode(False), torch.enable_grad():
        q = torch.ones(1, 1, 2, 2, requires_grad=True)
        allowed = torch.tensor([[True, True], [False, False]])
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=allowed)
        (grad,) = torch.autograd.grad(out.sum(), (q,))
    return bool((out[0, 0, 1] == 0).all()) and bool(torch.isfinite(grad).all())


@constant_when_compiling
def nan_queries_show(device_type: str, dtype: torch.dtype, m: int) -> bool:
    """Whether SDPA on this device type and dtype gives a NaN output row for a query that
    holds NaN, over ``m`` keys, so that a result's check need not read the queries
    (:meth:`Sdpa.shows_queries`). PyTorch's CPU kernel returns zeros for it where m is
    below one vector of its dtype (a row reduced by its scalar tail alone drops the NaN:
    16 keys in float32 with AVX-512), so this holds from the smallest m from which the
    probe saw every call show it (:func:`_nan_queries_shown_from`); elsewhere False
    (several GPU kernels may serve one call). A constant for torch.compile."""
    return m >= _nan_queries_shown_from(device_type, dtype)


#: The key counts probed: each one up to 17, and both sides of 32 and 64 (a vector of
#: float32 or float64 on any x86 or Arm SIMD width holds at most 16 entries).
_PROBED_KEYS = (*range(1, 18), 31, 32, 33, 63, 64, 65)


@functools.cache
def _nan_queries_shown_from(device_type: str, dtype: torch.dtype) -> float:
    """The smallest probed m from which every probed call of SDPA over at least m keys
    shows a NaN query in its output row (inf where the largest does not, and off the CPU):
    one query and a tile of them, without a mask, with a boolean and a float mask and
    causal masking (the NaN in the last query, which attends every key), with and without
    gradients. Probed once per device type and dtype."""
    if device_type != "cpu":
        return math.inf
    generator = torch.Generator().manual_seed(0)
    shown_from = math.inf
    with torch.inference_mode(False):
        for m in reversed(_PROBED_KEYS):
            for n in (1, 24):
                sizes = (n, m, m)
                q, k, v = (torch.randn(1, 2, s, 16, generator=generator).to(dtype) for s in sizes)
                q[0, 0, n - 1, 1] = float("nan")
                allowed = torch.ones(n, m, dtype=torch.bool).tril(max(m - n, 0))
                bias = torch.zeros(n, m, dtype=dtype).masked_fill(~allowed, float("-inf"))
                masks: tuple[dict[str, Any], ...] = (
                    {},
                    {"attn_mask": allowed},
                    {"attn_mask": bias},
                    {"is_causal": True},
                )
                for grad in (False, True):
                    for kwargs in masks:
                        with torch.set_grad_enabled(grad):
                            q.requires_grad_(grad)
                            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
                        if not bool(out[0, 0, n - 1].isnan().all()):
                            return shown_from
            shown_from = m
    return shown_from


def unmasked(q: Tensor, k: Tensor, v: Tensor, *, scale: float, dropout_p: float) -> Tensor:
    """SDPA without a mask (4-D)."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale)


def causal(q: Tensor, k: Tensor, v: Tensor, *, scale: float, dropout_p: float) -> Tensor:
    """SDPA with ``is_causal=True`` (top-left: query i attends keys j <= i). With fewer
    queries than keys the last m - n keys are seen by no query: they are cut off, never
    read (so whatever they hold cannot leak in) and never computed."""
    n, m = q.shape[-2], k.shape[-2]
    if n < m:
        k, v = k.narrow(-2, 0, n), v.narrow(-2, 0, n)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)


def _allowed(mask: AttentionMask, lengths: Tensor | None, m: int, device: torch.device) -> Tensor:
    """Bool (B or 1, H or 1, n or 1, m): True = may attend, as small as broadcasting allows
    (``lengths``: the mask's lengths, :func:`compact`)."""
    allowed: Tensor | None = None
    if lengths is not None:
        allowed = torch.arange(m, device=device) < lengths.unsqueeze(-1)
    if mask.attend is not None:
        allowed = mask.attend if allowed is None else allowed & mask.attend
    assert allowed is not None
    while allowed.ndim < 4:
        allowed = allowed.unsqueeze(0)
    return allowed


def padding_by_lengths(lengths: Tensor, m: int, *, look: bool) -> tuple[Tensor | None, int]:
    """The keys no query attends, read off lengths (B or 1, H or 1, n or 1)
    (:func:`compact`): bool (..., m, 1), and the first key that may be padded. Where the
    values may be read (``look``: CPU, eager), that is the shortest of the rows' longest
    lengths, and None comes back when nothing is padded; otherwise 0 and the padding
    always."""
    longest = lengths if lengths.shape[-1] == 1 else lengths.amax(-1, keepdim=True)
    first = int(longest.min()) if look else 0
    if first == m:
        return None, m
    return (torch.arange(m, device=lengths.device) >= longest).unsqueeze(-1), first


def _holds_garbage(k: Tensor, v: Tensor, padded: Tensor, first: int) -> bool:
    """Whether a padded key or value row (``padded``: bool (..., m, 1)) holds NaN or inf;
    rows before ``first`` (none of them padded) are not read, and values that are the keys
    (self-attention) are read once."""
    k, v = k[..., first:, :], v[..., first:, :]
    rows = padded[..., first:, 0]
    same = k.data_ptr() == v.data_ptr() and k.shape == v.shape and k.stride() == v.stride()
    return garbage_in(k, rows) or (not same and garbage_in(v, rows))


def inert(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    padded: Tensor | None,
    idle: Tensor | None,
    *,
    look: bool,
    first: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v with their padding made inert for a kernel that reads it: padded keys and
    their values (``padded``: bool (..., m, 1)) and idle queries (``idle``: bool (..., n, 1))
    zeroed where some of them hold NaN or inf when ``look`` (finite garbage meets exact
    zeros: harmless; keys before ``first`` are none of them padded and not read), and
    unconditionally otherwise (CUDA, tracing, small calls). Copies only what it zeroes."""
    if padded is not None and (
        not look or (bool(padded[..., first:, :].any()) and _holds_garbage(k, v, padded, first))
    ):  # looked: k and v are read only where some key is padded
        k, v = k.masked_fill(padded, 0.0), v.masked_fill(padded, 0.0)
    if idle is not None and (not look or garbage_in(q, idle[..., 0])):
        q = q.masked_fill(idle, 0.0)
    return q, k, v


def inert_by_mask(
    q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v with the keys (and values) no query of ``mask`` attends and the queries that
    attend nothing zeroed, without looking (:func:`inert` with ``look=False``): copies."""
    padded, idle = mask.padded_keys(), mask.idle_queries()
    return inert(
        q,
        k,
        v,
        None if padded is None else padded.unsqueeze(-1),
        None if idle is None else idle.unsqueeze(-1),
        look=False,
    )


def masked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: AttentionMask,
    *,
    scale: float,
    dropout_p: float,
    lengths: Tensor | None = None,
    has_idle: bool | None = None,
) -> Tensor:
    """SDPA with the boolean form of ``mask`` (lengths and/or ``attend``), q (B, H, n, d).

    Zeroes padded keys and values and idle queries first where they are not finite (on the
    CPU only then; elsewhere always, since looking would cost a sync), and makes rows with
    no allowed key zeros. In large CPU calls the mask goes to SDPA in its additive form,
    which SDPA would otherwise make from the boolean one (``torch.where``, more slowly): by
    lengths alone, one C pass writes it straight from the lengths; with a boolean mask, one
    C pass over that mask writes it and finds the padding. A caller that has read the
    lengths already may pass them :func:`compact` (``lengths``) and say whether some query
    attends no key (``has_idle``), which saves small calls the ops that find out.
    """
    m = k.shape[-2]
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    # Whether the padding is looked at before it is zeroed: not without a sync (CUDA), not
    # while tracing, and not in small calls, where the looking costs more than the zeroing.
    look = (
        q.device.type == "cpu" and not in_transform(q, k, v) and k.numel() + v.numel() >= LOOK_NUMEL
    )
    if lengths is None and mask.lengths is not None:
        lengths = compact(mask.lengths)
    attn_mask: Tensor
    idle: Tensor | None
    first = 0  # the first key that may be padding
    keyless = False  # whether rows with no key were given key 0 already
    padded: Tensor | None = None  # bool (..., m, 1): keys no query attends; None: none
    if look and mask.attend is not None:  # one C pass: the additive mask SDPA would make
        # anyway, and where the padding is
        additive, row_any, col_any = _ops.mask_summary(
            _allowed(mask, lengths, m, q.device), q.dtype
        )
        assert additive is not None
        attn_mask = additive
        padded, idle = ~col_any.unsqueeze(-1), ~row_any.unsqueeze(-1)
    elif mask.attend is None:  # lengths: the padding is read off the lengths themselves
        assert lengths is not None
        # Looked-at (large) calls get the additive mask written straight from the lengths
        # (SDPA would build it from the boolean one in two more passes); small ones the
        # boolean mask, made in one op.
        if look:  # lengths (B or 1, H or 1, n or 1) -> (..., m)
            attn_mask = _ops.lengths_mask(lengths, m, q.dtype)
            padded, first = padding_by_lengths(lengths, m, look=True)
        else:  # few ops: each costs microseconds of the host, which GPU calls wait for
            # Rows with no key attend key 0 inside the call where SDPA would not give
            # zeros itself and a gradient flows (zeroed after): lengths raised to 1 write
            # that mask in one op. Without gradients such rows are overwritten whatever SDPA
            # gives them, NaN included.
            keyless = grad and has_idle is not False and not empty_rows_are_zero(q.device.type)
            positions = torch.arange(m, device=q.device)
            allowed = positions < (lengths.clamp_min(1) if keyless else lengths).unsqueeze(-1)
            attn_mask = allowed.view(*(1,) * (4 - allowed.ndim), *allowed.shape)
            if lengths.shape[-1] == 1:  # one length per (example, head): not allowed
                padded = (positions >= lengths).unsqueeze(-1)
            else:
                padded, _ = padding_by_lengths(lengths, m, look=False)
        idle = None if has_idle is False else (lengths == 0).unsqueeze(-1)
    else:
        attn_mask = _allowed(mask, lengths, m, q.device)
        _, row_any, col_any = _ops.mask_summary(attn_mask, None)
        padded, idle = ~col_any.unsqueeze(-1), ~row_any.unsqueeze(-1)
    if look and idle is not None and not bool(idle.any()):
        idle = None  # looked: every query attends some key
    # Rows SDPA itself does not make zeros are zeroed after, attending key 0 inside the call
    # where a gradient flows; without one, zeroing the output overwrites whatever SDPA
    # gives them from whatever their queries hold (no need to zero those).
    fix = idle if idle is not None and not empty_rows_are_zero(q.device.type) else None
    q, k, v = inert(q, k, v, padded, idle if fix is None or grad else None, look=look, first=first)
    if fix is not None and grad and not keyless:
        if attn_mask.dtype != torch.bool:
            attn_mask = attn_mask == 0
        attn_mask = attn_mask | (fix & (torch.arange(m, device=q.device) == 0))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale
    )
    return out if fix is None else out.masked_fill(fix, 0.0)


def biased(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: AttentionMask,
    bias: Tensor,
    *,
    scale: float,
    dropout_p: float,
) -> Tensor:
    """SDPA with a score bias (float, broadcastable to (B, H, n, m), cast to q's dtype) added
    to the scores, as its float ``attn_mask``: the bias itself where nothing is masked,
    else the bias where ``mask`` allows and -inf where it does not. Rows with no allowed
    key attend every key with their bias inside the call (finite, whatever SDPA does with a
    row of -inf) and are zeroed after, with zero gradients. The caller has made the padding
    inert where it is not finite. No data-dependent Python: tracing takes it as it is."""
    bias = bias.to(q.dtype)
    if mask.unmasked:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale
        )
    lengths = None if mask.lengths is None else compact(mask.lengths)
    allowed = _allowed(mask, lengths, k.shape[-2], q.device)
    idle = ~allowed.any(dim=-1, keepdim=True)
    attn_mask = torch.where(allowed | idle, bias, float("-inf"))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale
    )
    return out.masked_fill(idle, 0.0)


class Sdpa(Implementation):
    """PyTorch's SDPA under the guarantees above: without a mask, ``is_causal`` for causal
    masking alone, the mask (:func:`masked`) or the score bias (:func:`biased`) otherwise.
    It takes every call with finite inputs but projected ones (general, cosine), whose own
    pipeline measured faster than SDPA of their projections (1.4x-2x in bfloat16), except by
    lengths on the CPU in eager code, where the kernels ahead of it take most calls."""

    name = "sdpa"
    summary = "PyTorch's scaled_dot_product_attention, padding zeroed, empty rows zeros"

    def supports(self, call: AttentionCall) -> str | None:
        if not call.finite:
            return "inputs hold NaN or inf (SDPA's tiles would carry them to other queries)"
        if call.project is not None and (
            call.device != "cpu" or call.kind != "lengths" or call.traced or not enabled()
        ):
            return (
                "a projected scorer: its own pipeline measured faster than SDPA of the projections"
            )
        return None

    def shows_queries(self, call: AttentionCall) -> bool:
        return nan_queries_show(call.device, call.q.dtype, call.k.shape[-2])

    def padding_inert(self, call: AttentionCall) -> bool:
        # A mask: :func:`masked` zeroes the padding where it is not finite. Causal masking
        # alone leaves keys no query sees only with fewer queries than keys; a score bias
        # leaves the padding to the caller.
        if call.bias is not None:
            return False
        return call.kind != "causal" or call.q.shape[-2] >= call.k.shape[-2]

    def prepare(self, call: AttentionCall) -> Runner | None:
        kind = call.kind
        if kind not in ("none", "causal") or call.bias is not None or call.project or call.inert:
            return None
        sdpa = unmasked if kind == "none" else causal
        scale, dropout_p = call.scale, call.dropout_p
        if call.q.ndim == 4:
            return functools.partial(sdpa, scale=scale, dropout_p=dropout_p)
        if call.q.ndim != 3:
            return None

        def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # (B, n, d): views, inline
            q4, k4, v4 = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
            return sdpa(q4, k4, v4, scale=scale, dropout_p=dropout_p).squeeze(1)

        return run

    def run(self, call: AttentionCall) -> Tensor:
        q, k, v = call.projected() if call.project or call.inert else (call.q, call.k, call.v)
        mask, scale, p = call.mask, call.scale, call.dropout_p
        if call.bias is not None:
            return biased(q, k, v, mask, call.bias, scale=scale, dropout_p=p)
        kind = call.kind
        if kind == "none" or kind == "causal":  # in the 4-D layout SDPA's fused kernels take
            sdpa = unmasked if kind == "none" else causal
            if q.ndim == 3:  # (B, n, d), the common case of small calls: views, inline
                q4, k4, v4 = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
                return sdpa(q4, k4, v4, scale=scale, dropout_p=p).squeeze(1)
            return sdpa(as_4d(q), as_4d(k), as_4d(v), scale=scale, dropout_p=p)
        if kind == "lengths" and call.read_lengths:  # what an implementation ahead read
            has_idle = call.shortest == 0
            return masked(
                q, k, v, mask, scale=scale, dropout_p=p, lengths=call.lengths, has_idle=has_idle
            )
        return masked(q, k, v, mask, scale=scale, dropout_p=p)
