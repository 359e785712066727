"""Dot-product attention (softmax of scaled q·k, then the weighted sum of values): which
kernel runs it.

One rule on every device: **where there is nothing to skip, PyTorch's own kernel runs**,
unless the device's own kernel measured faster on the same work.

============================================ ==============================================
mask                                         runs
============================================ ==============================================
none                                         ``scaled_dot_product_attention`` (SDPA); in
                                             eager code without dropout the backend's
                                             ``unpadded_attention`` where it measured
                                             faster (on the CPU, the C kernel by lengths
                                             with every length m: float16 always, float32
                                             and bfloat16 from a size on)
causal alone                                 SDPA with ``is_causal=True``; in eager code
                                             without dropout the backend's
                                             ``unpadded_attention`` (on the CPU, the C
                                             kernel by lengths 1, 2, ..., n)
a boolean ``attend_mask`` (with anything)    SDPA with the combined boolean mask
key lengths, query lengths (with or without  the device's backend (``dot_product_attention``
causal)                                      of the backend contract): on the CPU the C
                                             kernel by lengths (else a padding-free loop
                                             where skipping pays, or SDPA with the mask);
                                             elsewhere SDPA + mask
a score bias (with any of the above)         SDPA with a float mask: the bias where the
                                             mask allows, -inf elsewhere (the bias alone
                                             where nothing is masked); rows with no key
                                             zeros (:func:`~._sdpa.biased`)
============================================ ==============================================

SDPA always gets the 4-D layout (B, H, n, d) (3-D inputs get H = 1 as a view; more leading
dimensions are flattened into H), the layout its fused kernels take. Under ``torch.compile``,
tracing, fake tensors and ``torch.func`` transforms the lengths row runs SDPA + mask (no
data-dependent Python), and with kernels disabled (``ATTNSCORE_DISABLE_KERNELS=1``,
:func:`~attnscore.kernels.disabled`) every row runs SDPA with the boolean mask.

Small calls in inference by key lengths alone are offered whole, before any check, to the
device's small path (:func:`small_dot_product_attention`, and additive attention's
:func:`small_additive_attention`): a backend that takes them runs them in one step from
the caller's tensors; whatever it declines takes the checks and the table above.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import in_transform
from .._mask import AttentionMask
from .._softmax import softmax_dense
from . import _ops, _plain, _sdpa
from ._dispatch import (
    AdditiveProjection,
    Projection,
    backend_for,
    backend_function,
    enabled,
    exporting,
)

Inert = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]
"""(q, k, v) -> (q, k, v) with padding made harmless (see :func:`projected`)."""

__all__ = [
    "causal_alone",
    "declines",
    "dot_product_attention",
    "finite_inputs",
    "may_hold_garbage",
    "projected",
    "projected_call",
    "small_additive_attention",
    "small_dot_product_attention",
    "unpadded",
    "unpadded_call",
    "weighted_values",
]


def declines(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the fused dot-product path declines a call of q (..., n, d), k (..., m, d),
    v (..., m, dv), which the plain pipeline then runs: empty inputs (whose documented
    results the plain pipeline gives), and every call while ``torch.export`` traces
    (:func:`~._dispatch.exporting`): the plain formulation traces to plain operators that
    hold at every size, where the fused path's branches on sizes (empty or not, which side
    is smaller) would hold the program to the example's case."""
    if exporting():
        return True
    return min(q.numel(), q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]) == 0


def finite_inputs(*tensors: Tensor) -> bool:
    """Whether a fused kernel may take a call on these inputs: none holds NaN or inf.

    Fused kernels do not carry NaN as the plain maths does: SDPA, and the C kernels, which
    work on tiles of queries, multiply exact zero weights into the keys and values a query
    does not attend wherever another query of the tile attends them (0 x NaN is NaN), and
    SDPA returns zeros for a query that is NaN. The plain pipeline carries NaN exactly
    (masked scores are filled before the softmax, values reach only the queries that attend
    them: :func:`weighted_values`), so inputs that hold NaN or inf take it. One read of each
    input (the backend's ``all_finite``); taken as true where values cannot be read
    (tracing, transforms) or not without waiting for the device (off the CPU), which then
    run the kernels as they are."""
    if in_transform(*tensors):
        return True
    return backend_for(tensors[0], "all_finite")(tensors)  # type: ignore[no-any-return]


def may_hold_garbage(*tensors: Tensor) -> bool:
    """Whether these inputs may hold NaN or inf, so that their padding must be zeroed: on
    the CPU in eager code, one read (:func:`finite_inputs`); where values cannot be read
    (tracing) or not without a device sync (off the CPU), always."""
    if in_transform(*tensors) or not tensors[0].is_cpu:
        return True
    return not finite_inputs(*tensors)


def weighted_values(weights: Tensor, values: Tensor, mask: AttentionMask) -> Tensor:
    """``weights (..., n, m) @ values (..., m, dv)`` where each query sums only the values
    of the keys its mask lets it attend: NaN or inf in a value reaches exactly the queries
    that attend it, at its feature, as each term ``w_ij v_jc`` would (a plain product
    multiplies the masked zeros in: 0 x NaN is NaN). Finite values (read once) take the
    plain product; traced calls too."""
    if mask.unmasked or in_transform(weights, values) or finite_inputs(values):
        return _ops.matmul(weights, values)
    allowed = mask.dense()
    assert allowed is not None
    out = _ops.matmul(weights, values.masked_fill(~torch.isfinite(values), 0.0))
    w = weights.detach()

    def reach(rows: Tensor, cols: Tensor) -> Tensor:  # whether row i meets column c
        return torch.matmul(rows.to(torch.float32), cols.to(torch.float32)) > 0

    pos, neg = allowed & (w > 0), allowed & (w < 0)
    plus, minus = torch.isposinf(values), torch.isneginf(values)
    nan = reach(allowed, torch.isnan(values)) | reach(allowed & ~(w > 0) & ~(w < 0), plus | minus)
    up, down = reach(pos, plus) | reach(neg, minus), reach(pos, minus) | reach(neg, plus)
    out = out.masked_fill(up, float("inf")).masked_fill(down, float("-inf"))
    return out.masked_fill(nan | (up & down), float("nan"))


def _mask_4d(mask: AttentionMask, batch: tuple[int, ...], heads: int) -> AttentionMask:
    """The mask over (B, H) for inputs of batch shape ``batch`` reshaped by
    :func:`~._sdpa.as_4d`."""
    B = batch[0]

    def lengths_4d(t: Tensor | None) -> Tensor | None:
        if t is None:
            return None
        return t.unsqueeze(1) if len(batch) == 1 else t.reshape(B, heads, t.shape[-1])

    query_lengths = mask.query_lengths
    if query_lengths is not None:
        query_lengths = query_lengths.reshape(B, -1)
    attend = mask.attend
    if attend is not None:
        if len(batch) == 1 and attend.ndim == 3:  # (B, n, m) of 3-D inputs
            attend = attend.unsqueeze(1)
        elif len(batch) > 2:
            attend = attend.expand(*batch, mask.n, mask.m).reshape(B, heads, mask.n, mask.m)
    lengths = lengths_4d(mask.lengths)
    same = mask.key_lengths is mask.lengths  # key lengths alone: one reshape serves both
    return AttentionMask(
        n=mask.n,
        m=mask.m,
        lengths=lengths,
        attend=attend,
        key_lengths=lengths if same else lengths_4d(mask.key_lengths),
        query_lengths=query_lengths,
        causal=mask.causal,
    )


def _bias_4d(bias: Tensor, batch: tuple[int, ...], n: int, m: int) -> Tensor:
    """A score bias broadcastable to (*batch, n, m) laid out for inputs reshaped by
    :func:`~._sdpa.as_4d` (still broadcastable, expanded only where leading dimensions are
    flattened)."""
    if len(batch) > 2:
        return bias.expand(*batch, n, m).reshape(batch[0], -1, n, m)
    while bias.ndim < len(batch) + 2:
        bias = bias.unsqueeze(0)
    return bias.unsqueeze(1) if len(batch) == 1 else bias


def _inert_unless_finite(
    q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask
) -> tuple[tuple[Tensor, Tensor, Tensor], bool]:
    """(q, k, v, whether a fused kernel may take them): as they are where they are finite
    (:func:`finite_inputs`), else with their padding made inert (:func:`~._sdpa.inert_by_mask`), and
    whether that left them finite (if not, some query attends what is not: the plain
    formulation's case)."""
    if finite_inputs(q, k, v):
        return (q, k, v), True
    inert = _sdpa.inert_by_mask(q, k, v, mask)  # whatever is left is attended
    return inert, finite_inputs(*inert)


def _plain_maths(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: AttentionMask,
    *,
    scale: float,
    dropout_p: float,
    score_bias: Tensor | None = None,
) -> Tensor:
    """Dot-product attention as the plain formulation computes it, for inputs that hold
    NaN or inf (:func:`finite_inputs`): masked scores filled before the softmax, values
    summed over attended keys only (:func:`weighted_values`). The caller has made the
    padding inert (:func:`_inert_unless_finite`: the gradients of the scores' product read
    it)."""
    scores = _ops.matmul(q, k.transpose(-1, -2)) * scale
    if score_bias is not None:
        scores = scores + score_bias.to(scores.dtype)
    weights = softmax_dense(scores, mask.dense())
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0.0 else weights
    return weighted_values(dropped, v, mask)


def dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: AttentionMask,
    *,
    scale: float,
    dropout_p: float,
    score_bias: Tensor | None = None,
) -> Tensor:
    """Dot-product attention of checked inputs q (..., n, d), k (..., m, d), v (..., m, dv)
    with a checked ``mask`` (from :func:`attnscore.masking.build_mask`) and an optional
    checked ``score_bias`` broadcastable to (..., n, m), added to the scores; -> (..., n, dv).

    Rows with no key are zeros with zero gradients; padding (keys no query attends, queries
    that attend nothing) changes nothing, whatever it holds.
    """
    (q, k, v), finite = _inert_unless_finite(q, k, v, mask)
    if not finite:
        return _plain_maths(q, k, v, mask, scale=scale, dropout_p=dropout_p, score_bias=score_bias)
    batch = q.shape[:-2]
    q4, k4, v4 = _sdpa.as_4d(q), _sdpa.as_4d(k), _sdpa.as_4d(v)
    if score_bias is not None:
        mask4 = _mask_4d(mask, tuple(batch), q4.shape[1])
        bias4 = _bias_4d(score_bias, tuple(batch), mask.n, mask.m)
        out = _sdpa.biased(q4, k4, v4, mask4, bias4, scale=scale, dropout_p=dropout_p)
    elif mask.unmasked or causal_alone(mask):
        out = unpadded(q4, k4, v4, causal=mask.causal, scale=scale, dropout_p=dropout_p)
    else:
        mask4 = _mask_4d(mask, tuple(batch), q4.shape[1])
        if mask.attend is not None or not enabled() or in_transform(q, k, v):
            fn = _plain.dot_product_attention
        else:
            fn = backend_for(q, "dot_product_attention")
        out = fn(q4, k4, v4, mask4, scale=scale, dropout_p=dropout_p)
    return out.reshape(*batch, *out.shape[-2:]) if q.ndim != 4 else out


def causal_alone(mask: AttentionMask) -> bool:
    """Whether ``mask`` is causal masking and nothing else."""
    return (
        mask.causal
        and mask.key_lengths is None
        and mask.query_lengths is None
        and mask.attend is None
    )


def unpadded(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    scale: float,
    dropout_p: float,
    project: Projection | None = None,
) -> Tensor:
    """Attention with nothing padded (4-D), no mask or causal masking alone: in eager code
    without dropout the backend's ``unpadded_attention`` where it takes the call, else SDPA
    (``is_causal`` when causal) of the inputs, projected first by ``project`` if given."""
    out = _unpadded_kernel(q, k, v, causal, scale, dropout_p, project, in_transform(q, k, v))
    if out is not None:
        return out
    if project is not None:
        q, k = project(q, k)
    if causal:
        return _sdpa.causal(q, k, v, scale=scale, dropout_p=dropout_p)
    return _sdpa.unmasked(q, k, v, scale=scale, dropout_p=dropout_p)


def _unpadded_kernel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    scale: float,
    dropout_p: float,
    project: Projection | None,
    traced: bool,
) -> Tensor | None:
    """The backend's ``unpadded_attention`` of (B, H, n, d) or (B, n, d) inputs where it
    may run (eager code, kernels enabled, no dropout) and takes the call; else None."""
    if dropout_p != 0.0 or traced or not enabled():
        return None
    fn = backend_for(q, "unpadded_attention")
    out: Tensor | None = fn(q, k, v, causal=causal, scale=scale, project=project)
    return out


def projected(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: AttentionMask,
    *,
    project: Projection,
    scale: float,
    inert: Inert | None = None,
) -> Tensor | None:
    """Dot-product attention of ``project(q, k)`` (scorers whose scores are dot products of
    other vectors: general, cosine) where a kernel of the device skips work or measured
    faster than SDPA, without dropout: no mask or causal alone where the backend's
    ``unpadded_attention`` takes the call, lengths on the CPU (its kernel by lengths). None
    elsewhere (boolean masks; SDPA of the projections measured slower than the plain
    pipeline, 1.4x-2x in bfloat16): the caller then runs its plain pipeline. ``inert`` (q,
    k, v) -> (q, k, v): the caller's zeroing of padding (in training the projections'
    gradients read it), applied only once lengths are taken; with nothing padded, keys no
    query sees (causal, n < m) are cut off, never projected or read."""
    if mask.attend is not None or not enabled() or in_transform(q, k, v):
        return None
    (q, k, v), finite = _inert_unless_finite(q, k, v, mask)
    if not finite:  # the plain pipeline carries NaN exactly
        return None
    batch = q.shape[:-2]
    if mask.unmasked or causal_alone(mask):
        k, v = _seen(q, k, v, mask.causal)
        if q.ndim > 4:  # the contract takes (B, n, d) and (B, H, n, d)
            q, k, v = _sdpa.as_4d(q), _sdpa.as_4d(k), _sdpa.as_4d(v)
        fn = backend_for(q, "unpadded_attention")
        out: Tensor | None = fn(q, k, v, causal=mask.causal, scale=scale, project=project)
    elif q.is_cpu:
        if inert is not None:
            q, k, v = inert(q, k, v)
        q4, k4, v4 = _sdpa.as_4d(q), _sdpa.as_4d(k), _sdpa.as_4d(v)
        mask4 = _mask_4d(mask, tuple(batch), q4.shape[1])
        q4, k4 = project(q4, k4)
        out = backend_function("cpu", "dot_product_attention")(
            q4, k4, v4, mask4, scale=scale, dropout_p=0.0
        )
    else:
        return None
    if out is None or out.ndim == len(batch) + 2:
        return out
    return out.reshape(*batch, *out.shape[-2:])


def _seen(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    """Keys and values that some query sees with nothing padded: under causal masking with
    fewer queries than keys, the first n (the rest are cut off, as SDPA's ``is_causal``
    path does: never read, zero gradients whatever they hold)."""
    n = q.shape[-2]
    if causal and n < k.shape[-2]:
        return k[..., :n, :], v[..., :n, :]
    return k, v


def _well_formed(q: object, k: object, v: object, *, same_d: bool) -> bool:
    """Whether a call's arguments pass the checked path's input checks as they are, in
    eager code: plain floating tensors of one dtype and device, (B, n, d) or (B, H, n, d),
    k and v alike but for their last dimension, q's batch dimensions k's (and with
    ``same_d`` its d), nothing empty. The unchecked lanes take only such calls."""
    if not (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor):
        return False
    qs, ks, vs = q.shape, k.shape, v.shape
    ndim, dtype = len(qs), q.dtype
    return (
        (ndim == 3 or ndim == 4)
        and len(ks) == ndim
        and len(vs) == ndim
        and ks[:-2] == qs[:-2]
        and vs[:-1] == ks[:-1]
        and (not same_d or ks[-1] == qs[-1])
        and 0 not in qs
        and 0 not in ks
        and 0 not in vs
        and dtype.is_floating_point
        and k.dtype == dtype
        and v.dtype == dtype
        and k.device == q.device
        and v.device == q.device
        and not in_transform(q, k, v)
    )


def unpadded_call(
    q: object, k: object, v: object, *, causal: bool, scale: float, dropout_p: float
) -> tuple[Tensor, Tensor, Tensor] | None:
    """An eager call of dot-product attention with nothing padded (no mask, or causal
    masking alone), taken whole from the caller's arguments before the checks and the
    mask (at mid sizes those layers cost as much as the work): :func:`unpadded` of them,
    exactly what the checked path runs. Only well-formed calls are taken
    (:func:`_well_formed`, one d for q and k); None for every other call, which then takes
    the checks (and their errors). Returns (output, copies of q and k): what the call keeps
    to compute its weights later, made in the same read as the check that its inputs are
    finite (:func:`finite_inputs`; inputs that are not take the checked path)."""
    if not _well_formed(q, k, v, same_d=True):
        return None
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    finite, q_kept, k_kept = backend_for(q, "finite_copies")(q, k, v)
    if not finite:  # eager (well-formed): finite_inputs
        return None
    out = _unpadded_kernel(q, k, v, causal, scale, dropout_p, None, False)
    if out is not None:
        return out, q_kept, k_kept
    q4, k4, v4 = _sdpa.as_4d(q), _sdpa.as_4d(k), _sdpa.as_4d(v)
    sdpa = _sdpa.causal if causal else _sdpa.unmasked
    out = sdpa(q4, k4, v4, scale=scale, dropout_p=dropout_p)
    return (out if q.ndim == 4 else out.squeeze(1)), q_kept, k_kept


def projected_call(
    q: object, k: object, v: object, *, causal: bool, project: Projection, dropout_p: float
) -> tuple[Tensor, Tensor | None] | None:
    """:func:`unpadded_call` for scorers whose scores are dot products of projections
    (general, cosine: ``project`` (q, k) -> (q', k'), scale 1): the backend's
    ``unpadded_attention`` where it takes the call (output, None: weights not computed);
    else without a mask their plain pipeline, ``softmax(q' k'ᵀ)`` then dropout and the
    weighted sum (output, weights), the formulation PyTorch users write (which measured
    faster than SDPA of the projections in bfloat16). None for causal masking the kernel
    does not take and for calls that are not well-formed (:func:`_well_formed`): they take
    the checked path. The caller checks that ``project`` can run on q and k."""
    if not _well_formed(q, k, v, same_d=False):
        return None
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    if not backend_for(q, "all_finite")((q, k, v)):  # eager (well-formed): finite_inputs
        return None
    if causal:
        seen_k, seen_v = _seen(q, k, v, causal)
        out = _unpadded_kernel(q, seen_k, seen_v, causal, 1.0, dropout_p, project, False)
        return None if out is None else (out, None)
    out = _unpadded_kernel(q, k, v, causal, 1.0, dropout_p, project, False)
    if out is not None:
        return out, None
    qp, kp = project(q, k)
    weights = _ops.softmax(_ops.matmul(qp, kp.transpose(-1, -2)))
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0.0 else weights
    return _ops.matmul(dropped, v), weights


def _offered(q: object, k: object, v: object, valid_lens: object) -> bool:
    """Whether a call may go to a backend's small path: plain tensors in eager code with
    kernels enabled, no gradient to compute, int64 lengths."""
    return (
        type(q) is Tensor
        and type(k) is Tensor
        and type(v) is Tensor
        and type(valid_lens) is Tensor
        and valid_lens.dtype == torch.int64
        and q.ndim >= 3
        and not (
            torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        )
        and enabled()
        and not in_transform(q, k, v)
    )


def small_dot_product_attention(
    q: object,
    k: object,
    v: object,
    valid_lens: object,
    scale: float,
    project: Projection | None = None,
) -> tuple[Tensor, Tensor | None] | None:
    """A small eager inference call by key lengths, whole in one backend step from the
    caller's arguments as they came (unchecked: the backend contract's
    ``small_dot_product_attention`` takes only what fits and checks the lengths it reads):
    (output, the weights where the backend wrote them, else None). None for every other
    call, which then takes the checks and :func:`dot_product_attention`.
    ``project`` (q, k) -> (q', k'): scorers that are dot products of other vectors (general,
    cosine), applied once the call is taken; the caller checks that it can run."""
    if not _offered(q, k, v, valid_lens):
        return None
    assert isinstance(q, Tensor)
    fn = backend_for(q, "small_dot_product_attention")
    return fn(q, k, v, valid_lens, scale, project)  # type: ignore[no-any-return]


def small_additive_attention(
    q: object, k: object, v: object, valid_lens: object, hidden: int, project: AdditiveProjection
) -> tuple[Tensor, Tensor] | None:
    """Additive attention's :func:`small_dot_product_attention`: ``project`` (q, k) -> (qh,
    kh, w_v), applied once the backend takes the call; ``hidden`` = h."""
    if not _offered(q, k, v, valid_lens):
        return None
    assert isinstance(q, Tensor)
    fn = backend_for(q, "small_additive_attention")
    return fn(q, k, v, valid_lens, hidden, project)  # type: ignore[no-any-return]
