"""Dot-product attention (softmax of scaled q·k, then the weighted sum of values): its
entries, each of which describes the call (:class:`~._select.AttentionCall`) and lets
:func:`~._select.choose` run it on the first implementation of the device's priority list
that takes it (:data:`~._select.PRIORITY`).

One rule on every device: **where there is nothing to skip, PyTorch's own kernel runs**
(``sdpa``), unless a kernel of the device measured faster on the same work; inputs that
hold NaN or inf run the plain formulation (``plain``, :class:`Plain`), which carries them
exactly. Inputs reach the implementations in the 4-D layout (B, H, n, d) that SDPA's fused
kernels take (3-D inputs get H = 1 as a view; more leading dimensions are flattened into
H).

The entries: :func:`dot_product_attention` (checked inputs, any mask, a score bias);
:func:`projected` (scorers that are dot products of projections: general, cosine); and
the fast lanes that take eager calls whole from the caller's arguments before the checks
(:func:`unpadded_call`, :func:`projected_call`, :func:`small_dot_product_attention`),
which decline (None) whatever is not well-formed, so that the checks name it. Inside
:func:`attnscore.kernels.use` the small lane stands aside and the others obey it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import in_transform, value_range
from .._mask import AttentionMask
from .._softmax import softmax_dense
from . import _ops, _sdpa
from ._dispatch import (
    AdditiveProjection,
    NothingCut,
    Projection,
    backend_for,
    enabled,
    exporting,
)
from ._select import (
    AttentionCall,
    Implementation,
    choose,
    implementations,
    planned,
    projections_layout,
    record,
    restricted,
    watched,
)

Inert = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]
"""(q, k, v) -> (q, k, v) with padding made harmless (see :func:`projected`)."""


def declines(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the fused dot-product path declines a call of q (..., n, d), k (..., m, d),
    v (..., m, dv), which the plain pipeline then runs: empty inputs, and every call while
    ``torch.export`` traces (:func:`~._dispatch.exporting`), where the fused path's branches
    on sizes would hold the program to the example's case."""
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
    them: :func:`weighted_values`), so inputs that hold NaN or inf take it. The backend's
    ``all_finite`` (true off the CPU: reading would wait for the device); true where values
    cannot be read (tracing, transforms)."""
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


class Plain(Implementation):
    """Dot-product attention as the plain formulation computes it: masked scores filled
    before the softmax, values summed over attended keys only (:func:`weighted_values`), so
    NaN or inf reach exactly the queries that attend them. It takes every call: the last
    candidate on every device, and the one for inputs that hold NaN or inf (whose padding
    :func:`_inert_unless_finite` has made inert: the gradients of the scores' product read
    it). A projected scorer's call it hands back (None): the scorer's own pipeline runs it."""

    name = "plain"
    summary = "the textbook formulation; carries NaN and inf exactly"

    def supports(self, call: AttentionCall) -> str | None:
        return None

    def run(self, call: AttentionCall) -> Tensor | None:
        if call.project is not None:
            return None
        scores = _ops.matmul(call.q, call.k.transpose(-1, -2)) * call.scale
        if call.bias is not None:
            scores = scores + call.bias.to(scores.dtype)
        weights = softmax_dense(scores, call.mask.dense())
        p = call.dropout_p
        return weighted_values(F.dropout(weights, p) if p > 0.0 else weights, call.v, call.mask)


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
    if presumed_finite(q, k, v):
        out, call = _run(q, k, v, mask, scale, dropout_p, score_bias, True)
        if result_exact(call, q, k, v, out):
            return out
    # Inputs to look at first, or something the result read is not finite: the plain
    # formulation must carry NaN and inf exactly (padding made inert, the rest as it is).
    (q, k, v), finite = _inert_unless_finite(q, k, v, mask)
    return _run(q, k, v, mask, scale, dropout_p, score_bias, finite)[0]


def presumed_finite(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether a call runs before anything looks at its inputs, its result checked instead
    (:func:`result_exact`): eager calls on the CPU, in inference and in training. The NaN
    contract then costs a read of the queries and the output, never of the keys and values
    (a decode step's whole cache, a training step's keys)."""
    return q.is_cpu and not in_transform(q, k, v)


def result_exact(call: AttentionCall, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> bool:
    """Whether ``call``, run on q, k, v presumed finite (:func:`presumed_finite`), gave what
    the plain formulation gives, output and gradients. Without gradients, and in training
    on an implementation whose padding reaches no gradient
    (:meth:`~._select.Implementation.padding_inert`): its queries and output finite
    (:func:`result_finite`). Otherwise its inputs finite (:func:`finite_inputs`): a finite
    output does not make the backward's products finite where padding is read (a padded key
    of -inf gives the queries a finite output, and 0 x -inf in the gradient of their
    scores). The queries are read only where the implementation hides a query's NaN
    (:meth:`~._select.Implementation.shows_queries`). Nothing is read without a mask (or
    score bias) or gradients, where the queries' NaN shows: every query attends every key,
    so a NaN or inf in a key or value reaches, in every implementation, the outputs it
    reaches in the plain formulation (all rows, or its feature in all rows). Not their
    gradients: a backward that recomputes the weights differs from the plain one's where
    the output is not finite (the values' gradients of a row of NaN weights). Off the CPU
    (and where values cannot be read) true: nothing is read."""
    ran = call.ran
    if ran is None:
        return result_finite(q, out)
    unmasked = call.kind == "none" and call.bias is None
    inert, shows = ran.padding_inert(call), ran.shows_queries(call)
    return _exact(call.needs_grad, inert, shows, q, k, v, out, unmasked=unmasked)


def _exact(
    needs_grad: bool,
    inert: bool,
    shows: bool,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    *,
    unmasked: bool,
) -> bool:
    """:func:`result_exact` given what the implementation that ran declares (``inert``:
    its padding reaches no gradient; ``shows``: its output shows a NaN query) and whether
    the call has neither a mask nor a score bias (``unmasked``)."""
    if unmasked and shows and not needs_grad:
        return True  # exact by construction: nothing to look at
    if needs_grad and not inert:
        return finite_inputs(q, k, v)
    return result_finite(None if shows else q, out)


def result_finite(q: Tensor | None, out: Tensor) -> bool:
    """Whether a fused call on inputs presumed finite (:func:`presumed_finite`) gave what the
    plain formulation gives: its queries (unless None) and output finite. Non-finite keys
    or values that a query's result reads make its output non-finite in every
    implementation (SDPA adds its mask to NaN scores, 0 x NaN is NaN in the products, the C
    kernels keep NaN through their softmax); what none reads changes nothing. A NaN query
    is the one case a result may hide (some versions of SDPA returned zeros for it), hence
    the queries' read where the implementation that ran does not show it
    (:meth:`~._select.Implementation.shows_queries`)."""
    return backend_for(out, "all_finite")((out,) if q is None else (q, out))  # type: ignore[no-any-return]


def _run(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: AttentionMask,
    scale: float,
    dropout_p: float,
    score_bias: Tensor | None,
    finite: bool,
) -> tuple[Tensor, AttentionCall]:
    """:func:`dot_product_attention` on inputs whose padding is inert unless ``finite``;
    (output, the call as the implementations saw it)."""
    batch = tuple(q.shape[:-2])
    q4, k4, v4 = _sdpa.as_4d(q), _sdpa.as_4d(k), _sdpa.as_4d(v)
    # (causal masking alone needs no mask laid out where its implementations take it whole)
    if not (mask.unmasked or (finite and score_bias is None and causal_alone(mask))):
        mask = _mask_4d(mask, batch, q4.shape[1])
    bias = None if score_bias is None else _bias_4d(score_bias, batch, mask.n, mask.m)
    call = AttentionCall(
        q4, k4, v4, mask, scale=scale, dropout_p=dropout_p, bias=bias, finite=finite
    )
    out = choose(call)
    assert out is not None  # not projected: some implementation runs it
    return (out.reshape(*batch, *out.shape[-2:]) if q.ndim != 4 else out), call


def causal_alone(mask: AttentionMask) -> bool:
    """Whether ``mask`` is causal masking and nothing else."""
    return (
        mask.causal
        and mask.key_lengths is None
        and mask.query_lengths is None
        and mask.attend is None
    )


def _nothing_padded(q: Tensor, m: int, causal: bool, *, eager: bool = False) -> AttentionMask:
    """The mask of a call with nothing padded, queries q (..., n, d) and m keys: none, or
    causal masking alone, whose lengths are 1, 2, ..., n (at most m). Kept in eager code
    (nothing writes to it; a CPU tensor's by sizes alone: making its device costs a fifth of
    a microsecond), made anew while compiling (which traces through no cache); ``eager``:
    the caller knows it is not compiling (the lanes)."""
    device = "cpu" if q.is_cpu else q.device
    if not eager and torch.compiler.is_compiling():
        return _unpadded_mask(q.shape[-2], m, causal, device)
    return _kept_unpadded_mask(q.shape[-2], m, causal, device)


def _unpadded_mask(n: int, m: int, causal: bool, device: torch.device | str) -> AttentionMask:
    if not causal:
        return AttentionMask(n=n, m=m)
    lengths = torch.arange(1, n + 1, device=device).clamp_(max=m)
    return AttentionMask(n=n, m=m, lengths=lengths, causal=True)


_kept_unpadded_mask = functools.lru_cache(maxsize=256)(_unpadded_mask)


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
    other vectors: general, cosine) where an implementation skips work or measured faster
    than the scorer's own pipeline (the candidates' ``supports`` say where: no boolean
    mask, no dropout); None elsewhere: the caller then runs its own pipeline. ``inert``
    (q, k, v) -> (q, k, v): the caller's zeroing of padding (in training the projections'
    gradients read it), applied only once lengths are taken; with nothing padded, keys no
    query sees (causal, n < m) are cut off, never projected or read. The NaN contract as in
    :func:`dot_product_attention`: run first where the result tells (:func:`result_exact`)."""
    if presumed_finite(q, k, v):
        out, call = _projected_run(q, k, v, mask, project, scale, inert, True)
        if out is None or result_exact(call, q, k, v, out):
            return out
    (q, k, v), finite = _inert_unless_finite(q, k, v, mask)
    return _projected_run(q, k, v, mask, project, scale, inert, finite)[0]


def _projected_run(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: AttentionMask,
    project: Projection,
    scale: float,
    inert: Inert | None,
    finite: bool,
) -> tuple[Tensor | None, AttentionCall]:
    """:func:`projected` on inputs whose padding is inert unless ``finite``; (output or
    None, the call as the implementations saw it)."""
    batch = q.shape[:-2]
    if mask.unmasked or causal_alone(mask):
        k, v = _seen(q, k, v, mask.causal)
        if q.ndim > 4:  # the implementations take (B, n, d) and (B, H, n, d)
            q, k, v = _sdpa.as_4d(q), _sdpa.as_4d(k), _sdpa.as_4d(v)
        mask = _nothing_padded(q, k.shape[-2], mask.causal)
        call = AttentionCall(q, k, v, mask, scale=scale, project=project, finite=finite)
    else:
        q4, k4, v4 = _sdpa.as_4d(q), _sdpa.as_4d(k), _sdpa.as_4d(v)
        inert4 = None
        if inert is not None:
            made = inert

            def inert4(*_: Tensor) -> tuple[Tensor, Tensor, Tensor]:
                return tuple(_sdpa.as_4d(t) for t in made(q, k, v))  # type: ignore[return-value]

        mask4 = _mask_4d(mask, tuple(batch), q4.shape[1])
        call = AttentionCall(
            q4, k4, v4, mask4, scale=scale, project=project, inert=inert4, finite=finite
        )
    out = choose(call)
    if out is None or out.ndim == len(batch) + 2:
        return out, call
    return out.reshape(*batch, *out.shape[-2:]), call


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
    if not (ndim == 3 or ndim == 4) or len(ks) != ndim or len(vs) != ndim:
        return False
    return (  # (sizes one by one: a slice of a torch.Size is a new torch.Size, slow)
        ks[0] == qs[0] == vs[0]
        and (ndim == 3 or ks[1] == qs[1] == vs[1])
        and vs[-2] == ks[-2]
        and (not same_d or ks[-1] == qs[-1])
        and 0 not in qs
        and 0 not in ks
        and 0 not in vs
        and dtype.is_floating_point
        and k.dtype == dtype
        and v.dtype == dtype
        and ((q.is_cpu and k.is_cpu and v.is_cpu) or (k.device == q.device == v.device))
        and not in_transform(q, k, v)
    )


def _eager_layout(q: object, k: object, v: object) -> tuple[object, ...] | None:
    """The sizes, strides, dtypes and devices of plain CPU tensors q, k, v in eager code:
    every fact :func:`_well_formed` reads, so that a lane's key holding them (:func:`planned`)
    is kept only for well-formed calls; None for anything else (the lane then checks)."""
    if not (
        type(q) is Tensor
        and type(k) is Tensor
        and type(v) is Tensor
        and q.is_cpu
        and not in_transform(q, k, v)
    ):
        return None
    return (
        *(q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride()),
        *(q.dtype, k.dtype, v.dtype, k.is_cpu, v.is_cpu),
    )


def unpadded_call(
    q: object, k: object, v: object, *, causal: bool, scale: float, dropout_p: float
) -> Tensor | None:
    """An eager call of dot-product attention with nothing padded (no mask, or causal
    masking alone), taken whole from the caller's arguments before the checks and the
    mask (at mid sizes those layers cost as much as the work), on the implementation the
    checked path would choose. Only well-formed calls are taken (:func:`_well_formed`, one
    d for q and k); None for every other call, which then takes the checks (and their
    errors), and for calls whose inputs are not all finite (the checked path carries them;
    the call finds out after it ran: :func:`result_exact`)."""
    key = plan = None
    layout = _eager_layout(q, k, v)
    if layout is not None:  # (and so q, k, v are tensors)
        assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
        # Every fact the choice and the runner depend on (:func:`planned`).
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        threads = torch.get_num_threads()
        key = ("unpadded", causal, *layout, scale, dropout_p, grad, threads, enabled())
        plan = planned(key)
        if plan is not None and plan.run is not None:
            done = plan.run(q, k, v)  # the choice for the first such call
            if done is None:  # (declined once it ran: not finite; the checked path carries it)
                return None
            inert, shows = plan.padding_inert, plan.shows_queries
            exact = _exact(grad, inert, shows, q, k, v, done, unmasked=not causal)
            return done if exact else None
    # (a plan is kept for well-formed calls only, and its key holds every fact read here)
    if plan is None and not _well_formed(q, k, v, same_d=True):
        return None
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    call = AttentionCall(
        q,
        k,
        v,
        _nothing_padded(q, k.shape[-2], causal, eager=True),
        scale=scale,
        dropout_p=dropout_p,
        traced=False,
    )
    out = choose(call, route="unpadded lane", plan=key, kept=plan)
    assert out is not None
    return out if result_exact(call, q, k, v, out) else None


def lengths_call(
    q: object, k: object, v: object, valid_lens: object, *, scale: float
) -> tuple[Tensor, int] | None:
    """An eager CPU call of dot-product attention by key lengths alone, taken whole from the
    caller's arguments before the checks, the mask and the fused path (at mid sizes those
    layers cost as much as the work), on the implementation the checked path would choose:
    q (B, n, d) or (B, H, n, d), k and v alike, ``valid_lens`` int64 (B,), (B, n) or q's
    (B, H, n), none negative, none above m. Returns (output, the shortest length); None for
    every other call, which then takes the checks (and their errors), and for inputs that
    are not all finite (:func:`unpadded_call`)."""
    if not _well_formed(q, k, v, same_d=True) or type(valid_lens) is not Tensor:
        return None
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    qs, ls = q.shape, valid_lens.shape
    if not (q.is_cpu and valid_lens.is_cpu and valid_lens.dtype == torch.int64 and ls):
        return None
    B, n, m, heads = qs[0], qs[-2], k.shape[-2], len(qs) == 4
    H = qs[1] if heads else 1
    if ls == (B,):
        lengths = valid_lens.view(B, 1, 1)
    elif ls == (B, n) or (heads and ls == qs[:-1]):
        lengths = valid_lens.view(B, -1, n)
    else:
        return None
    shortest, longest = value_range(valid_lens)  # (the checks' one read of the lengths)
    if shortest < 0 or longest > m:
        return None
    full = lengths.expand(B, H, n)
    mask = AttentionMask(n=n, m=m, lengths=full, key_lengths=full)
    q4, k4, v4 = (q, k, v) if heads else (q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1))
    call = AttentionCall(q4, k4, v4, mask, scale=scale, traced=False, lengths=(lengths, shortest))
    # The facts the choice depends on (:func:`planned`): of the lengths, their layout and
    # whether they cut any key (implementations that weigh more of them keep no plan).
    sizes = (qs, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, ls)
    threads = torch.get_num_threads()
    key = ("lengths", *sizes, shortest < m, scale, call.needs_grad, threads, enabled())
    out = choose(call, route="lengths lane", plan=key)
    assert out is not None
    if not heads:
        out = out.squeeze(1)
    return (out, shortest) if result_exact(call, q, k, v, out) else None


def projected_call(
    q: object, k: object, v: object, *, causal: bool, project: Projection, dropout_p: float
) -> tuple[Tensor, Tensor | None] | None:
    """:func:`unpadded_call` for scorers whose scores are dot products of projections
    (general, cosine: ``project`` (q, k) -> (q', k'), scale 1): the implementation chosen
    for it where one takes the call (output, None: weights not computed); else without a
    mask their plain pipeline, ``softmax(q' k'ᵀ)`` then dropout and the
    weighted sum (output, weights), the formulation PyTorch users write (which measured
    faster than SDPA of the projections in bfloat16). None for causal masking the
    implementations do not take and for calls that are not well-formed
    (:func:`_well_formed`): they take the checked path. The caller checks that
    ``project`` can run on q and k."""
    key = plan = None
    layout = _eager_layout(q, k, v)
    if layout is not None:  # the facts the choice depends on (:func:`planned`), not the
        # projection's (its parameters' gradients too: grad mode, not requires_grad)
        grad, threads = torch.is_grad_enabled(), torch.get_num_threads()
        key = ("projected", causal, *layout, dropout_p, grad, threads, enabled())
        plan = planned(key)
        assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
        # No implementation took the first such call: the pipeline, without a call made.
        if plan is not None and plan.impl.name == "plain":
            return None if causal else _projected_pipeline(q, k, v, project, dropout_p)
        if plan is not None and plan.run is not None:  # inference: its runner, on the
            # projections (of the layout it was made for: the key holds the inputs')
            seen_k, seen_v = _seen(q, k, v, causal)
            qp, kp = project(q, seen_k)
            if projections_layout(qp, kp) == plan.projections:
                done = plan.run(qp, kp, seen_v)
                if done is None:  # (declined once it ran: the checked path carries it)
                    return None
                inert, shows = plan.padding_inert, plan.shows_queries
                exact = _exact(False, inert, shows, q, seen_k, seen_v, done, unmasked=not causal)
                return (done, None) if exact else None
    # (a plan is kept for well-formed calls only, and its key holds every fact read here)
    if plan is None and not _well_formed(q, k, v, same_d=False):
        return None
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    seen_k, seen_v = _seen(q, k, v, causal)
    mask = _nothing_padded(q, seen_k.shape[-2], causal, eager=True)
    call = AttentionCall(
        q, seen_k, seen_v, mask, scale=1.0, dropout_p=dropout_p, project=project, traced=False
    )
    out = choose(call, route="unpadded lane", lane=causal, plan=key, kept=plan)
    if out is not None:  # (keys no query sees are cut off: nothing padded)
        return (out, None) if result_exact(call, q, seen_k, seen_v, out) else None
    if causal:  # the checked path: its pipeline masks the scores
        return None
    return _projected_pipeline(q, k, v, project, dropout_p)


def _projected_pipeline(
    q: Tensor, k: Tensor, v: Tensor, project: Projection, dropout_p: float
) -> tuple[Tensor, Tensor]:
    """:func:`projected_call`'s plain pipeline without a mask: (output, weights)."""
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
) -> tuple[Tensor, Tensor | None] | NothingCut | None:
    """The backend contract's ``small_dot_product_attention`` for calls :func:`_offered`
    takes (outside :func:`attnscore.kernels.use`): its result, or
    :data:`~._dispatch.NOTHING_CUT` (the caller then runs the call as one with nothing
    padded); None for every other call, which then takes the checks and
    :func:`dot_product_attention`. The caller checks that ``project`` can run."""
    if not _offered(q, k, v, valid_lens) or restricted():
        return None
    assert isinstance(q, Tensor)
    taken = backend_for(q, "small_dot_product_attention")(q, k, v, valid_lens, scale, project)
    if isinstance(taken, tuple) and watched():
        assert isinstance(k, Tensor) and isinstance(v, Tensor)
        _record_small(q, k, v, _SMALL_LANE[taken[1] is None])
    return taken  # type: ignore[no-any-return]


def _record_small(q: Tensor, k: Tensor, v: Tensor, chosen: str) -> None:
    """Record for :func:`attnscore.explain` what the small lane ran, described as
    :func:`~._select.choose` describes its calls: the lane runs before the selection."""
    *_, n, d = q.shape
    m, dv = k.shape[-2], v.shape[-1]
    head = f"d {d}" if d == dv else f"d {d}, dv {dv}"
    dtype = str(q.dtype).removeprefix("torch.")
    call = f"mask lengths, B·H {q.numel() // (n * d)}, n {n}, m {m}, {head}, {dtype}, inference"
    ran = "chosen (the small lane: inference by key lengths from the caller's tensors, "
    ran += "before the selection)"
    device = "cpu" if q.is_cpu else q.device.type
    rows = tuple(
        (i.name, ran if i.name == chosen else f"not asked ({chosen} took the call first)")
        for i in implementations(device)
    )
    record(device, chosen, "small lane", call=call, rows=rows)


#: Which implementation a small lane's result came from: the small pass writes the weights,
#: the kernel by lengths does not.
_SMALL_LANE = {False: "c_small", True: "c_by_lengths"}


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
