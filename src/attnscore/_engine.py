"""The attention pipeline engine (private): checked inputs in, output and weights out.

Every attention in the library runs the same steps (D2L eq. "attn-pooling")::

    prepared = prepare(queries, keys, values, valid_lens, **masks)   check once, zero padding
    scores   = scoring(queries, keys)                 (..., n, m)
    weights  = normalizer(scores, mask)               masked softmax by default
    output   = dropout(weights) @ values              (..., n, v)

Masks are checked once, in :func:`prepare`. Padding (keys no query may attend, their
values, queries that may attend nothing) never changes outputs, weights or gradients, even
NaN or inf: the plain pipeline zeroes it first (:func:`zero_padding`), fused paths never
read it or zero it themselves. A scorer's fused path for the whole pipeline
(:func:`fused_dot_product`) runs where the result is the same and the weights are not
needed at once. The public forms are in
:mod:`attnscore.functional` (its legend gives the shapes), the modules in
:mod:`attnscore.modules`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._C._functorch import is_functorch_wrapped_tensor
from typing_extensions import Unpack

from ._checks import LOOK_NUMEL, check_attention_inputs, check_dropout, garbage_in, in_transform
from ._habits import check_keywords
from ._mask import AttentionMask
from .kernels import _attention, _ops, _select
from .kernels._dispatch import Projection
from .masking import build_mask
from .normalizers import NORMALIZERS, Normalizer, Softmax, get_normalizer, score_factor, softmax
from .scoring import default_scale, dot_product_scores

Scoring = Callable[[Tensor, Tensor], Tensor]
WeightsFn = Callable[[], Tensor]
FusedPath = Callable[
    [Tensor, Tensor, Tensor, AttentionMask, float, "Tensor | None"],
    "tuple[Tensor, WeightsFn] | None",
]
"""(queries, keys, values, mask, dropout_p, score_bias) -> (output, weights function), or
None where the path declines the call (the plain pipeline runs it)."""


class MaskOptions(TypedDict, total=False):
    """Masks beyond ``valid_lens``, accepted by every attention function and module.

    Attributes:
        query_valid_lens: (B,) or (B, ...) lengths; queries at or beyond them get zero output.
        attend_mask: bool broadcastable to (..., n, m); **True = may attend** (as
            ``scaled_dot_product_attention``'s bool ``attn_mask``; ``nn.MultiheadAttention``'s
            ``key_padding_mask`` and bool ``attn_mask`` mean the opposite: True = ignore,
            True = not allowed).
        causal: query i attends keys j <= i only (top-left alignment, as SDPA's
            ``is_causal``).

    >>> from attnscore import dot_product_attention
    >>> masks: MaskOptions = {"causal": True}
    >>> q = torch.randn(1, 3, 4)
    >>> _, w = dot_product_attention(q, q, q, return_weights=True, **masks)
    >>> (w > 0).int()
    tensor([[[1, 0, 0],
             [1, 1, 0],
             [1, 1, 1]]], dtype=torch.int32)
    """

    query_valid_lens: Tensor | None
    attend_mask: Tensor | None
    causal: bool


MASK_NAMES = frozenset(MaskOptions.__annotations__)
"""The keywords of :class:`MaskOptions`."""


@dataclass(frozen=True)
class Prepared:
    """Checked inputs (as given: padding not yet zeroed) and their canonical mask."""

    queries: Tensor
    keys: Tensor
    values: Tensor
    mask: AttentionMask


def prepare(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    valid_lens: Tensor | None = None,
    *,
    same_feature_size: bool = False,
    **masks: Unpack[MaskOptions],
) -> Prepared:
    """Check inputs and masks once (the only checks of a call)."""
    check_keywords(masks, MASK_NAMES, "forward")  # the functional forms check theirs first
    q, k, v = check_attention_inputs(queries, keys, values, same_feature_size=same_feature_size)
    *batch, n, _ = q.shape
    mask = build_mask(torch.Size(batch), n, k.shape[-2], q.device, valid_lens=valid_lens, **masks)
    return Prepared(q, k, v, mask)


def zero_padding(prepared: Prepared, *, keys_and_queries: bool = True) -> Prepared:
    """Zero padded values and keys (keys no query may attend) and idle queries (queries that
    may attend no key) that hold NaN or inf, so that 0 * NaN cannot carry garbage stored
    there into outputs, weights or gradients of the plain pipeline.

    Values always; keys and queries only when ``keys_and_queries`` (their garbage reaches
    gradients only: normalizers never read a masked score). On the CPU nothing is copied
    unless some padding is not finite (finite garbage meets exact zeros); off the CPU (a
    look would cost a sync) and in calls of fewer than ``LOOK_NUMEL`` elements (queries,
    keys and values together), padding is zeroed unconditionally.
    """
    mask = prepared.mask
    if mask.unmasked:
        return prepared
    q, k, v = prepared.queries, prepared.keys, prepared.values
    if mask.attend is None:  # idle queries matter to the keys-and-queries zeroing only
        padded_keys = mask.padded_keys()
        idle = mask.idle_queries() if keys_and_queries else None
    else:  # one read of the boolean mask finds both
        dense = mask.dense()
        assert dense is not None
        _, row_any, col_any = _ops.mask_summary(dense if dense.ndim > 1 else dense[None], None)
        padded_keys, idle = ~col_any, ~row_any
    # Traced code never looks (and compares no sizes, which would hold an exported program
    # to them).
    look = (
        q.device.type == "cpu"
        and not in_transform(q)
        and q.numel() + k.numel() + v.numel() >= LOOK_NUMEL
    )

    def holds_garbage(rows: Tensor, t: Tensor) -> bool:
        return not look or garbage_in(t, rows)

    if padded_keys is not None and (not look or bool(padded_keys.any())):
        if holds_garbage(padded_keys, v):
            v = v.masked_fill(padded_keys.unsqueeze(-1), 0.0)
        if keys_and_queries and holds_garbage(padded_keys, k):
            k = k.masked_fill(padded_keys.unsqueeze(-1), 0.0)
    if (
        idle is not None
        and keys_and_queries
        and (not look or bool(idle.any()))
        and holds_garbage(idle, q)
    ):
        q = q.masked_fill(idle.unsqueeze(-1), 0.0)
    return Prepared(q, k, v, mask)


def attend(
    prepared: Prepared,
    scoring: Scoring,
    *,
    dropout_p: float = 0.0,
    normalizer: str | Normalizer = "softmax",
    fused: FusedPath | None = None,
    score_bias: Tensor | None = None,
    weights_asked: bool = False,
) -> tuple[Tensor, WeightsFn]:
    """Run the pipeline on prepared inputs; return the output and a weights function.

    ``score_bias`` (checked by :func:`attnscore._checks.check_score_bias`) is added to the
    scores before the normalizer, as SDPA adds a float ``attn_mask``; the mask still decides
    which keys may be attended. The weights function returns the (..., n, m) weights before
    dropout: the plain path's tensor (:class:`ComputedWeights`), or a fused path's
    recomputation from copies the call owns, only if asked (:func:`dot_weights_later`).
    ``fused`` runs for softmax-like normalizers only (:func:`~.normalizers.score_factor`),
    made for the normalizer's factor (``fused_dot_product(..., factor=)``), unless
    ``weights_asked`` (the caller's ``return_weights``).
    """
    dropout_p = check_dropout(dropout_p, "dropout_p")
    normalize = get_normalizer(normalizer)
    if fused is not None and not weights_asked and score_factor(normalize) is not None:
        before = _select.recorded()
        result = fused(
            prepared.queries, prepared.keys, prepared.values, prepared.mask, dropout_p, score_bias
        )
        if result is not None:
            return result
        if _select.recorded() == before:  # (the built-in fused paths record why they decline)
            _pipeline_ran(prepared.queries, "it declined the call")
    elif weights_asked:
        _pipeline_ran(prepared.queries, "the weights asked for (return_weights): it computes them")
    elif fused is None:
        _pipeline_ran(prepared.queries, "the scorer has none (its scores are no dot products)")
    else:
        _pipeline_ran(prepared.queries, "a normalizer that is not softmax-like")
    # Keys and queries matter to gradients only, but also to custom normalizers (which may
    # read masked scores) and to captured graphs (which may later run with gradients).
    built_in = normalize in NORMALIZERS.values() or type(normalize) is Softmax
    keys_and_queries = torch.is_grad_enabled() or not built_in or in_transform(prepared.queries)
    prepared = zero_padding(prepared, keys_and_queries=keys_and_queries)
    # In the inputs' dtype throughout, as the plain formulation computes it; the softmax
    # reduces 16-bit scores in float32.
    scores = scoring(prepared.queries, prepared.keys)
    if score_bias is not None:
        scores = scores + score_bias.to(scores.dtype)
    weights = normalize(scores, prepared.mask).to(prepared.values.dtype)
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0.0 else weights
    output = _attention.weighted_values(dropped, prepared.values, prepared.mask)
    return output, ComputedWeights(weights)


def _pipeline_ran(q: Tensor, why: str) -> None:
    """Record for :func:`attnscore.explain` (and the DEBUG log) that the scorer's own
    pipeline runs a call of queries ``q`` because the fused path does not (``why``)."""
    if not in_transform(q) and _select.watched():  # (compiled code records nothing)
        device = "cpu" if q.is_cpu else q.device.type
        _select.record(device, _select.PIPELINE, "checked", (("fused path", why),))


def _not_kept() -> Tensor:
    """The weights function of a fused call made with ``weights=False``."""
    raise RuntimeError("this call kept nothing to compute its attention weights from")


def fused_dot_product(
    scale: float | None,
    project: Projection | None = None,
    *,
    factor: float = 1.0,
    weights: bool = True,
) -> FusedPath:
    """The fused path of scaled dot-product attention.

    Runs :func:`attnscore.kernels.dot_product_attention` (PyTorch's SDPA wherever nothing
    can be skipped; on the CPU the C kernel by lengths, so padded keys cost nothing) and
    returns a weights function that recomputes the weights through the plain pipeline only
    when asked. Declines (returns None) for empty inputs, whose documented results the
    plain path gives, and while exporting (:func:`attnscore.kernels._attention.declines`).

    ``project`` (q, k) -> (q', k'): scorers whose scores are dot products of other vectors
    (general: q W_a; cosine: unit rows, the queries' times s) run as dot-product attention
    of those, with ``scale`` 1, where a kernel of the device skips work or is faster than
    their plain pipeline (:func:`attnscore.kernels._attention.projected`: no boolean mask,
    no dropout); elsewhere they decline. In training the padding is made inert once the
    call is taken (the projections' gradients read it).

    ``factor``: a softmax-like normalizer's factor on the scores
    (:func:`attnscore.normalizers.score_factor`), folded into the scale (and the score
    bias): the path of ``softmax(factor · scores)``.

    ``weights=False``: for a caller that never asks for the weights (the functions without
    ``return_weights``): the call copies nothing for them, and its weights function raises.
    """

    def fused(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttentionMask,
        dropout_p: float,
        score_bias: Tensor | None = None,
    ) -> tuple[Tensor, WeightsFn] | None:
        if _attention.declines(q, k, v):
            _pipeline_ran(q, "empty inputs, or exporting")
            return None
        scale_ = (default_scale(q.shape[-1]) if scale is None else scale) * factor
        if score_bias is not None and factor != 1.0:
            score_bias = score_bias * factor
        if project is None:
            out = _attention.dot_product_attention(
                q, k, v, mask, scale=scale_, dropout_p=dropout_p, score_bias=score_bias
            )
            if not weights:
                return out, _not_kept
            bias = None if score_bias is None else kept(score_bias)
            later = dot_weights_later(kept(q), kept(k), scale_, kept_mask(mask), bias=bias)
            return out, guarded(later, q, k, score_bias, mask.lengths, mask.attend)
        if dropout_p != 0.0 or mask.attend is not None or score_bias is not None:  # never taken
            _pipeline_ran(q, "a projected scorer with dropout, a boolean mask or a score bias")
            return None

        def inert(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            made = zero_padding(Prepared(q, k, v, mask))
            return made.queries, made.keys, made.values

        kept_projections = KeptProjections(project)
        projected = _attention.projected(
            q, k, v, mask, project=kept_projections, scale=scale_,
            inert=inert if torch.is_grad_enabled() else None,
        )  # fmt: skip
        if projected is None:
            return None
        if not weights:
            return projected, _not_kept
        qp, kp = kept_projections.owned(q, k)
        later = dot_weights_later(qp, kp, scale_, kept_mask(mask), q.shape[:-2])
        return projected, guarded(later, q, k, mask.lengths, mask.attend)

    return fused


class ComputedWeights:
    """The weights function of the plain path, which computed them. A caller keeping them
    past the call (``attention_weights``) keeps :attr:`weights` detached: their autograd
    graph holds the caller's tensors."""

    __slots__ = ("weights",)

    def __init__(self, weights: Tensor) -> None:
        self.weights = weights

    def __call__(self) -> Tensor:
        return self.weights


def detached(t: Tensor) -> Tensor:
    """``t`` without autograd history: detached where it may have some (a tensor that
    requires gradients, or a subclass), else ``t`` itself (a detach is an op of its own,
    which a GPU's host pays for)."""
    return t.detach() if t.requires_grad or type(t) is not Tensor else t


def owned(t: Tensor) -> Tensor:
    """A copy of ``t`` that the call owns: detached, without autograd history, in its own
    memory, so that later in-place changes of ``t`` do not reach it and keeping it does not
    keep ``t``. Dimensions broadcast by a zero stride (expanded lengths) stay broadcast,
    uncopied."""
    t = detached(t)
    if type(t) is Tensor and not in_transform(t):
        strides = t.stride()
        if 0 in strides:
            one = tuple(slice(0, 1) if stride == 0 else slice(None) for stride in strides)
            return t[one].clone().expand(t.shape)
    return t.clone()


def kept(t: Tensor, callers: tuple[Tensor, ...] | None = None) -> Tensor:
    """``t`` as a call keeps it to compute its weights later (:func:`guarded`): the call's
    own tensor, detached, no copy; a copy (:func:`owned`) only where ``t`` has no version
    counter to guard it by (an inference tensor, made under ``torch.inference_mode``) and
    while compiling; never a copy of an inference tensor the call made from ``callers``
    (a projection in memory of its own: nobody else writes to it)."""
    if torch.compiler.is_compiling():  # (traced: no state to read)
        return owned(t)
    if t.is_inference():  # a projection in memory of its own (``callers``: its inputs) as is
        return t if callers is not None and _new_memory(t, callers) else owned(t)
    # detached where it may carry autograd history (a fake tensor, which has none, never:
    # its ops are counted as a GPU's would be)
    return t.detach() if t.requires_grad or is_functorch_wrapped_tensor(t) else t


def _new_memory(t: Tensor, inputs: tuple[Tensor, ...]) -> bool:
    """Whether ``t`` lies in memory other than every one of ``inputs``'."""
    storage = t.untyped_storage().data_ptr()
    return all(x.untyped_storage().data_ptr() != storage for x in inputs)


def kept_mask(mask: AttentionMask) -> AttentionMask:
    """What the softmax reads of ``mask`` (its folded ``lengths`` and ``attend``), kept as
    :func:`kept` keeps tensors."""
    lengths, attend = mask.lengths, mask.attend
    lengths = None if lengths is None else kept(lengths)
    return AttentionMask(
        mask.n, mask.m, lengths, None if attend is None else kept(attend), causal=mask.causal
    )


#: What reading the weights of a call whose tensors changed afterwards raises.
STALE = (
    "attention_weights: a tensor of the last call (its queries, keys, lengths or mask) was "
    "changed in place after the call (a KV cache written in place?), so its weights can no "
    "longer be computed from it. Read attention_weights before changing the inputs, or set "
    "`keep_weights='eager'` on the module to compute the weights during each call."
)


VERSIONS = operator.attrgetter("_version")
"""The version counters of tensors (PyTorch's, bumped by every in-place write to a tensor or
a view of it): ``tuple(map(VERSIONS, tensors))``, read with no Python call per tensor."""


def refuse_if_changed(tensors: tuple[Tensor, ...], versions: tuple[int, ...]) -> None:
    """Raise ``RuntimeError`` (:data:`STALE`) where one of ``tensors`` changed in place since
    its ``versions`` were read (at the call): the weights computed from them now would not
    be the call's."""
    if tuple(map(VERSIONS, tensors)) != versions:
        raise RuntimeError(STALE)


def guarded(weights: WeightsFn, *tensors: Tensor | None) -> WeightsFn:
    """``weights``, refused once one of ``tensors`` (the call's inputs they are computed
    from; None and inference tensors, which :func:`kept` copied, skipped) changed in place
    after the call (:func:`refuse_if_changed`): never other weights than the call's."""
    if in_transform():  # traced: kept copies (:func:`kept`), no state to read
        return weights
    watched = tuple(
        t for t in tensors if t is not None and not in_transform(t) and not t.is_inference()
    )
    if not watched:
        return weights
    versions = tuple(map(VERSIONS, watched))

    def checked() -> Tensor:
        refuse_if_changed(watched, versions)
        return weights()

    return checked


class KeptProjections:
    """``project`` (q, k) -> (q', k'), keeping what it returned, so that a fused path's
    weights can be computed later from the projections the call made (:meth:`owned`)."""

    __slots__ = ("kept", "project")

    def __init__(self, project: Projection) -> None:
        self.project = project
        self.kept: tuple[Tensor, Tensor] | None = None

    def __call__(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        self.kept = projected = self.project(q, k)
        return projected

    def owned(self, queries: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
        """The projections the call made from the caller's ``queries`` and ``keys``,
        detached (kept as :func:`kept` keeps tensors: a projection returning a view of its
        input is guarded by the input's version); where the path did not project, the
        projections of ``queries`` and ``keys`` made now."""
        projected, self.kept = self.kept, None
        if projected is None:
            with torch.no_grad():
                projected = self.project(queries, keys)
        return kept(projected[0], (queries, keys)), kept(projected[1], (queries, keys))


def dot_weights_later(
    qp: Tensor,
    kp: Tensor,
    scale: float,
    mask: AttentionMask,
    batch: tuple[int, ...] | None = None,
    *,
    bias: Tensor | None = None,
) -> WeightsFn:
    """The weights function of a call that ran dot-product attention without computing its
    weights: ``softmax(qp kpᵀ · scale, mask)`` computed when asked from ``qp`` (..., n, d)
    and ``kp`` (..., m', d), which the call owns (:func:`owned`; the mask too,
    :func:`kept_mask`), guarded by the caller (:func:`guarded`). ``batch``: the weights' leading
    shape where the projections were laid out otherwise (4-D); m' < m: the keys causal
    masking left unseen were cut off (their weights are zero). ``bias``: the call's score
    bias (owned), added to the scores (its calls cut off no key)."""

    def weights() -> Tensor:
        n, seen = mask.n, kp.shape[-2]
        scores = dot_product_scores(qp, kp, scale)
        if batch is not None:
            scores = scores.reshape(*batch, n, seen)
        if bias is not None:
            scores = scores + bias.to(scores.dtype)
        if seen == mask.m:
            return softmax(scores, mask)
        cut = AttentionMask(n=n, m=seen, lengths=mask.lengths, causal=mask.causal)
        return F.pad(softmax(scores, cut), (0, mask.m - seen))

    return weights
