"""``nn.Module`` wrappers: parameters and configuration around the functional pipeline.

Each module's ``forward`` checks its inputs and masks once, computes scores, and runs the
shared pipeline (:func:`attnscore._engine.attend`). :class:`Attention` takes any scoring
callable; :class:`ScorerAttention` builds a registered scorer's parameters from its spec
(:mod:`attnscore.registry`), and the textbook's named classes are that module for their
scorer with the textbook's arguments. :func:`make_scorer` builds the module of any name.

Shapes as in the legend of :mod:`attnscore.functional`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import Unpack

from ._checks import check_dropout, one_length_each
from ._engine import (
    VERSIONS,
    ComputedWeights,
    FusedPath,
    KeptProjections,
    MaskOptions,
    WeightsFn,
    attend,
    detached,
    dot_weights_later,
    fused_dot_product,
    kept,
    owned,
    prepare,
    refuse_if_changed,
)
from ._lazy import LazyLinear
from ._projected import Kept, project_once
from .kernels._attention import (
    lengths_call,
    projected_call,
    small_additive_attention,
    small_dot_product_attention,
    unpadded_call,
)
from .kernels._dispatch import NOTHING_CUT, Projection
from .masking import build_mask
from .normalizers import Normalizer, get_normalizer, score_factor
from .registry import Param, ScorerSpec, get_scorer, unprojected
from .scoring import additive_scores_from_projections, dot_product_scores

__all__ = [
    "AdditiveAttention",
    "Attention",
    "CosineAttention",
    "DotProductAttention",
    "MultiplicativeAttention",
    "ScorerAttention",
    "make_scorer",
]


def _check_size(value: object, name: str, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Expected `{name}` to be a positive int, but got {value!r} instead.")
    return value


_INPUT_SIZES = ("query_size", "key_size")  # the sizes the first call's inputs tell


def _is_lazy(linear: nn.Module) -> bool:
    """An ``nn.LazyLinear`` whose weight is not materialised yet."""
    return isinstance(linear, nn.LazyLinear) and linear.has_uninitialized_params()


class Attention(nn.Module):
    """Attention pooling with any scoring function.

    ``forward(queries, keys, values, valid_lens=None, *, return_weights=False, **masks)``
    returns ``dropout(normalizer(scores, mask)) @ values``: queries (..., n, q), keys
    (..., m, k), values (..., m, v) -> output (..., n, v); dropout in training mode only.

    After each call, :attr:`attention_weights` holds that call's (..., n, m) weights before
    dropout (rows sum to 1 over the keys they may attend, or are zero without any),
    detached. ``keep_weights`` says how: ``"lazy"`` (default) fast paths compute them on
    first access from the call's own tensors, copying none (the module holds them until
    the next call); a tensor of the call changed in place before that access (a KV cache
    written in place) makes the access raise ``RuntimeError`` saying so, never give other
    weights. ``"eager"`` computes them during the call; ``"none"`` keeps nothing (the
    module holds no tensor of the call; reading them raises ``RuntimeError``). With several
    threads calling one module, they are the last call's (``forward`` keeps no other
    state).

    Args:
        scoring: a callable ``(queries, keys) -> scores (..., n, m)``: a plain function
            (e.g. :func:`attnscore.scoring.dot_product_scores`) or an ``nn.Module``, whose
            parameters then belong to this module. Subclasses leave it None and override
            :meth:`score`.
        dropout: dropout probability on the weights, in [0, 1).
        normalizer: ``"softmax"`` (default), ``"sparsemax"``, ``"entmax15"`` (optional
            ``entmax`` package), ``"hardmax"``, or a callable ``(scores, mask) -> weights``.
        keep_weights: ``"lazy"``, ``"eager"`` or ``"none"``: what :attr:`attention_weights`
            keeps (above).

    Raises:
        TypeError, ValueError: bad ``dropout``, ``normalizer`` or ``keep_weights`` here;
            bad inputs or masks in ``forward`` (see :func:`attnscore.functional.attention`).

    >>> attn = Attention(lambda q, k: -torch.cdist(q, k))   # a user's own scoring function
    >>> attn(torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)).shape
    torch.Size([2, 3, 6])
    """

    #: Whether queries and keys must share their feature size (dot-product-like scores).
    same_feature_size: bool = False
    #: What :attr:`attention_weights` keeps: ``"lazy"``, ``"eager"`` or ``"none"``.
    keep_weights = "lazy"

    def __init__(
        self,
        scoring: Callable[[Tensor, Tensor], Tensor] | None = None,
        dropout: float = 0.0,
        *,
        normalizer: str | Normalizer = "softmax",
        keep_weights: str = "lazy",
    ) -> None:
        super().__init__()
        if scoring is not None and not callable(scoring):
            raise TypeError(
                f"Expected `scoring` to be callable (queries, keys) -> scores, but got "
                f"{type(scoring).__name__} instead."
            )
        self.scoring = scoring
        self.dropout = nn.Dropout(check_dropout(dropout))
        get_normalizer(normalizer)  # fail at construction, not at the first call
        self.normalizer = normalizer
        self.keep_weights = _check_keep(keep_weights)
        # The last call's weights, or the function computing them (fast paths), or None: one
        # attribute, replaced whole, so that concurrent calls never mix two calls' halves.
        self._weights: Tensor | WeightsFn | None = None

    def score(self, queries: Tensor, keys: Tensor, lengths: Tensor | None) -> Tensor:
        """Scores (..., n, m) for checked queries (..., n, q) and keys (..., m, k).

        ``lengths`` (int64 (..., n) or None) is a hint: scores at keys j >= lengths[..., i]
        are masked afterwards, so a scorer may skip them.
        """
        if self.scoring is None:
            raise NotImplementedError(
                f"{type(self).__name__} has no scoring function: pass `scoring` or override "
                "`score`."
            )
        return self.scoring(queries, keys)

    def fused_path(self) -> FusedPath | None:
        """A fused implementation of the whole pipeline, if this scorer has one."""
        return None

    def forward(
        self,
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        valid_lens: Tensor | int | None = None,
        *,
        return_weights: bool = False,
        **masks: Unpack[MaskOptions],
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attention pooling of ``values`` by the weights of ``queries`` over ``keys``.

        Args:
            queries: (..., n, q) floating (``...`` is (B,) or (B, H)). keys: (..., m, k).
                values: (..., m, v). One dtype and device for all three; dot-product-like
                scorers need q == k.
            valid_lens: key lengths (B,) (one per example), (B, n) (one per query) or
                (..., n); int or whole-number float; or one ``int`` for every example (a
                decoder's step); lengths above m mean all keys.
            **masks: ``query_valid_lens``, ``attend_mask`` (bool, **True = may attend**),
                ``causal``: see :class:`attnscore.functional.MaskOptions`.
            return_weights: also return the weights (..., n, m), before dropout, as a
                tensor that carries gradients (for attention regularisation or supervision
                losses); the call then takes the plain path, which computes them anyway.

        Returns:
            output (..., n, v) in the inputs' dtype: ``dropout(weights) @ values`` with
            ``weights = normalizer(score(queries, keys), mask)``; with ``return_weights``,
            ``(output, weights)``. Queries that may attend no key give zero output and zero
            weights (and zero gradient). The weights, detached, are in
            :attr:`attention_weights` afterwards either way.

        Raises:
            TypeError: non-tensor or non-floating inputs, mixed dtypes, bad mask dtypes.
            ValueError: inconsistent shapes (or feature sizes unlike the parameters'),
                negative or fractional lengths, masks of the wrong shape or device.
        """
        # The previous call's weights go first, so that this call's buffers can reuse memory.
        self.__dict__["_weights"] = None
        lens = one_length_each(valid_lens, queries) if isinstance(valid_lens, int) else valid_lens
        taken = None
        if lens is not None and not masks and not return_weights:
            # a small call by key lengths may run whole in one step
            taken = self._small(queries, keys, values, lens)
        elif lens is None and not return_weights and masks.keys() <= {"causal"}:
            # so may a call with nothing padded (causal masking alone, or no mask)
            causal = masks.get("causal", False)
            taken = self._unpadded(queries, keys, values, causal) if type(causal) is bool else None
        if taken is not None:
            output, weights = taken
            self.__dict__["_weights"] = (
                weights if self.keep_weights == "lazy" else self._kept(weights)
            )
            return output
        prepared = prepare(
            queries, keys, values, lens, same_feature_size=self.same_feature_size, **masks
        )
        lengths = prepared.mask.lengths
        output, weights_fn = attend(
            prepared,
            lambda q, k: self.score(q, k, lengths),
            dropout_p=self.dropout.p if self.training else 0.0,
            normalizer=self.normalizer,
            fused=self.fused_path(),
            weights_asked=return_weights,
        )
        if return_weights:
            weights = weights_fn()
            self.__dict__["_weights"] = self._kept(weights.detach())
            return output, weights
        # Straight into __dict__ (nn.Module.__setattr__ is slow). Plain-path weights are kept
        # detached (their graph holds the caller's tensors), in a function still: a tensor
        # attribute set while exporting draws a warning.
        if type(weights_fn) is ComputedWeights:
            weights_fn = ComputedWeights(detached(weights_fn.weights))
        self.__dict__["_weights"] = (
            weights_fn if self.keep_weights == "lazy" else self._kept(weights_fn)
        )
        return output

    def _kept(self, weights: Tensor | WeightsFn) -> Tensor | WeightsFn | None:
        """What :attr:`keep_weights` keeps of a call's ``weights`` (or weights function):
        ``"eager"`` the weights, computed now; ``"none"`` nothing (:func:`_not_kept`)."""
        if self.keep_weights == "none":
            return _not_kept
        if isinstance(weights, Tensor) or type(weights) is ComputedWeights:
            return weights
        with torch.no_grad():
            return ComputedWeights(weights().detach())

    def _small(
        self, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor | None
    ) -> tuple[Tensor, Tensor | WeightsFn] | None:
        """The output and weights (or a weights function over copies the call owns) of a
        small call by key lengths alone, run whole by a fast path that takes the arguments
        unchecked; None where it declines (or a scorer has no such path)."""
        return None

    def _unpadded(
        self, queries: Tensor, keys: Tensor, values: Tensor, causal: bool
    ) -> tuple[Tensor, Tensor | WeightsFn] | None:
        """As :meth:`_small`, for a call with nothing padded (no mask, or causal alone)."""
        return None

    @property
    def attention_weights(self) -> Tensor | None:
        """The last call's weights (..., n, m), before dropout and detached; None before.

        One attribute per module, like ``nn.MultiheadAttention``'s: a module called by
        several threads at once holds the weights of whichever call set them last, and
        while a call is running (from its start until it returns) it holds None. Threads
        that share a module and need their own call's weights ask for them in the call:
        ``output, weights = module(..., return_weights=True)``.

        Raises:
            RuntimeError: a tensor of the call was changed in place since (``keep_weights``
                ``"lazy"``), or the module keeps no weights (``"none"``).
        """
        weights = self._weights
        if weights is None or isinstance(weights, Tensor):
            return weights
        with torch.no_grad():
            computed = weights().detach()
        self.__dict__["_weights"] = computed
        return computed

    def __getstate__(self) -> dict[str, object]:
        # The weights function is a closure (not picklable); keep the computed weights.
        self.attention_weights  # noqa: B018
        return self.__dict__.copy()

    def extra_repr(self) -> str:
        return f"normalizer={self.normalizer!r}" if self.normalizer != "softmax" else ""


class ScorerAttention(Attention):
    """Attention with a registered scorer: its parameters, built from the scorer's spec.

    The module of every name of :func:`attnscore.scorer_names` (:func:`make_scorer` builds
    it; the named classes below are it with the textbook's arguments). Each parameter of the
    spec (:class:`attnscore.registry.Param`) becomes an attribute of its name: a matrix
    (out, in) an ``nn.Linear(in, out, bias=False)`` (an ``nn.LazyLinear`` while ``in`` is
    None, until the first call or ``load_state_dict``), any other an ``nn.Parameter``.
    Scores are ``spec.score(queries, keys, **parameters)``; a projection the spec declares
    runs on the fast paths of dot-product attention.

    Args:
        scoring: a registered scorer's name or its :class:`~attnscore.registry.ScorerSpec`.
        query_size: q; may be None where only a matrix's input size depends on it.
        key_size: k; likewise.
        num_hiddens: h, for scorers with hidden units.
        dropout, normalizer, keep_weights: as :class:`Attention`.

    Shapes: queries (..., n, q), keys (..., m, k), values (..., m, v) -> (..., n, v).

    Raises:
        ValueError: an unknown name; a size that is not a positive int; in ``forward``,
            queries or keys whose feature size differs from the parameters'.
        TypeError: a size the parameters need left None.

    >>> attention = ScorerAttention("general", query_size=3, key_size=5)  # W_a (q, k)
    >>> attention.W_a
    Linear(in_features=5, out_features=3, bias=False)
    >>> attention(torch.randn(2, 1, 3), torch.randn(2, 4, 5), torch.randn(2, 4, 6)).shape
    torch.Size([2, 1, 6])
    """

    def __init__(
        self,
        scoring: str | ScorerSpec,
        query_size: int | None = None,
        key_size: int | None = None,
        num_hiddens: int | None = None,
        dropout: float = 0.0,
        *,
        normalizer: str | Normalizer = "softmax",
        keep_weights: str = "lazy",
    ) -> None:
        super().__init__(dropout=dropout, normalizer=normalizer, keep_weights=keep_weights)
        spec = scoring if isinstance(scoring, ScorerSpec) else get_scorer(scoring)
        self.spec = spec
        self.same_feature_size = spec.same_feature_size
        given = {"query_size": query_size, "key_size": key_size, "num_hiddens": num_hiddens}
        sizes = {name: _check_size(size, name, optional=True) for name, size in given.items()}
        for param in spec.params:
            self._add(param, sizes)

    def _add(self, param: Param, sizes: dict[str, int | None]) -> None:
        shape = param.resolve(sizes)
        needed = [d for d, size in zip(param.shape, shape, strict=True) if size is None]
        if param.is_matrix and shape[0] is not None and param.shape[1] in _INPUT_SIZES:
            needed = []  # an input's size alone may wait for the first call
        if needed:
            raise TypeError(
                f"{type(self).__name__} needs `{needed[0]}` (a dimension of {param.name} "
                f"{param.shape}), but got None."
            )
        module: nn.Module | nn.Parameter
        if param.is_matrix:
            out, inp = shape
            assert out is not None
            module = nn.Linear(inp, out, bias=False) if inp else LazyLinear(out, bias=False)
        else:
            module = nn.Parameter(torch.full(shape, param.init))  # type: ignore[arg-type]
        setattr(self, param.name, module)

    def parameters_by_name(self) -> dict[str, Tensor]:
        """The spec's parameters as its score function takes them (matrices (out, in)).

        >>> ScorerAttention("cosine").parameters_by_name()["log_scale"].exp().round()
        tensor(10., grad_fn=<RoundBackward0>)
        """
        return {
            p.name: _held(_submodule(self, p.name), "weight")
            if p.is_matrix
            else _held(self, p.name)
            for p in self.spec.params
        }

    def check_features(self, queries: Tensor, keys: Tensor) -> None:
        """Name the argument whose feature size or dtype differs from the parameters' (where
        PyTorch would fail inside a matrix product; autocast casts dtypes), and materialise
        matrices whose input size waited for the first call."""
        inputs = {"query_size": ("queries", queries), "key_size": ("keys", keys)}
        for param in self.spec.params:
            if not param.is_matrix:
                continue
            linear = getattr(self, param.name)
            if _is_lazy(linear) and param.shape[1] in inputs:
                linear(inputs[str(param.shape[1])][1][..., :1, :])  # in: the first call's
            weight = linear.weight
            for size_name, expected in zip(param.shape, weight.shape, strict=True):
                name, x = inputs.get(str(size_name), ("", None))
                if x is not None and x.shape[-1] != expected:
                    raise ValueError(
                        f"Expected `{name}` with last dimension {size_name}={expected}, but got "
                        f"shape {tuple(x.shape)} instead."
                    )
            if weight.dtype != queries.dtype and not torch.is_autocast_enabled(queries.device.type):
                raise TypeError(
                    f"Expected `queries`, `keys` and `values` of the module's dtype {weight.dtype} "
                    f"(its parameters'), but got {queries.dtype} instead: convert the module with "
                    f"`.to({queries.dtype})` or the inputs with `.to({weight.dtype})`."
                )

    def score(self, queries: Tensor, keys: Tensor, lengths: Tensor | None) -> Tensor:
        self.check_features(queries, keys)
        return self.spec.scores(queries, keys, self.parameters_by_name(), lengths)

    def fused_path(self) -> FusedPath | None:
        """The spec's fused path (:meth:`~attnscore.registry.ScorerSpec.fused_path`) with this
        module's parameters, once made (the plain path makes lazy ones), for its
        normalizer's factor (softmax-like ones only)."""
        factor = score_factor(get_normalizer(self.normalizer))
        spec, scale = self.spec, self._dot_scale()
        if factor is None:
            return None
        if spec.projection is unprojected:
            if scale != spec.scale:  # DotProductAttention's own
                return fused_dot_product(scale, factor=factor)
            return spec.fused_path({}, factor)
        if spec.projection is None or self._lazy():
            return spec.fused if factor == 1.0 else None
        params = self.parameters_by_name()
        return fused_dot_product(1.0, _checked(self, spec.projector(params)), factor=factor)

    def _dot_scale(self) -> float | None:
        """The factor on the dot products of the queries and keys themselves."""
        return self.spec.scale

    def _lazy(self) -> bool:
        """Whether a matrix waits for the first call to know its input size."""
        return any(p.is_matrix and _is_lazy(_submodule(self, p.name)) for p in self.spec.params)

    def _offered(self, queries: object, keys: object, *, small: bool) -> tuple[int, int] | None:
        """The feature sizes (q, k) of a call a fast lane may take, else None: the softmax,
        plain tensors of 3 or more dimensions (one d where the spec says so), for ``small``
        calls no dropout at work."""
        if self.normalizer != "softmax" or type(queries) is not Tensor or type(keys) is not Tensor:
            return None
        qs, ks = queries.shape, keys.shape  # (read once: each read makes a torch.Size)
        if len(qs) < 3 or len(ks) < 3 or (self.same_feature_size and qs[-1] != ks[-1]):
            return None
        dropout = self._modules["dropout"]  # (no attribute lookup call)
        if small and self.training and isinstance(dropout, nn.Dropout) and dropout.p > 0.0:
            return None
        return qs[-1], ks[-1]

    def _lane(
        self, queries: Tensor, keys: Tensor, *, small: bool
    ) -> tuple[Projection | None, float] | None:
        """(projection, scale) the lanes run for a call (:meth:`_offered`): (None, scale) for
        unprojected scorers, else (:meth:`~attnscore.registry.ScorerSpec.projector`, 1); None
        unless the parameters are made, on the queries' device, matrices of their dtype and
        sizes, and (``small``) not being trained."""
        spec = self.spec
        projection = spec.projection
        sizes = None if projection is None else self._offered(queries, keys, small=small)
        if sizes is None:
            return None
        qd, kd = sizes
        if projection is unprojected:
            scale = self._dot_scale()  # (None: default_scale(qd), inline on every lane call)
            return None, 1.0 / math.sqrt(max(qd, 1)) if scale is None else scale
        # One pass over the parameters: a lane runs this on every call.
        grad = small and torch.is_grad_enabled()
        dtype, on_cpu = queries.dtype, queries.is_cpu
        held_all: list[Tensor] = []
        for name, matrix, shape in spec.param_shapes:
            if matrix:
                linear = _submodule(self, name)
                if type(linear) is not nn.Linear and _is_lazy(linear):
                    return None
                held = _held(linear, "weight")
                if held.dtype != dtype:
                    return None
            else:
                held = _held(self, name)
            if grad and held.requires_grad:
                return None
            if not (on_cpu and held.is_cpu) and held.device != queries.device:
                return None
            if shape:  # (the spec's sizes by name: the queries' and keys' are checked)
                got = held.shape
                if len(got) != len(shape):
                    return None
                for want, size in zip(shape, got, strict=True):
                    if size != (
                        want if type(want) is int
                        else qd if want == "query_size"
                        else kd if want == "key_size"
                        else size
                    ):  # fmt: skip
                        return None
            held_all.append(held)
        # The projection bound to these tensors, made again only when one is another object
        # (a replaced parameter, a parametrization's new tensor): a lane's every call reads it.
        kept = self.__dict__.get("_projector")  # (tensors compared by identity, not ==)
        if kept is None or not all(map(operator.is_, kept[0], held_all)):
            params = {name: t for (name, _, _), t in zip(spec.param_shapes, held_all, strict=True)}
            kept = (held_all, spec.projector(params))
            if not torch.compiler.is_compiling():  # (a traced module's state stays as it was)
                self.__dict__["_projector"] = kept
        return kept[1], 1.0

    def _small(
        self, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor | None
    ) -> tuple[Tensor, Tensor | WeightsFn] | None:
        """Small inference calls by key lengths (:meth:`_lane`), one C pass on the CPU
        (:func:`~attnscore.kernels._attention.small_dot_product_attention`); lengths that
        cut no key (read there) as a call with nothing padded (:meth:`_unpadded`)."""
        lane = self._lane(queries, keys, small=True)
        if lane is None:
            return None
        project, scale = lane
        m = keys.shape[-2]
        if (
            project is None
            and self.spec.own_fused
            and torch.is_grad_enabled()
            and (queries.requires_grad or keys.requires_grad or values.requires_grad)
        ):  # training: the lane by lengths (the small pass is inference only)
            by_lengths = lengths_call(queries, keys, values, valid_lens, scale=scale)
            if by_lengths is None:
                return None
            return by_lengths[0], _weights_later(queries, keys, scale, m, valid_lens)
        projections = None if project is None else KeptProjections(project)
        taken = small_dot_product_attention(queries, keys, values, valid_lens, scale, projections)
        if taken is NOTHING_CUT:  # lengths that cut no key: no mask
            return self._unpadded(queries, keys, values, False)
        if not isinstance(taken, tuple):
            return None
        output, weights = taken  # the weights the pass wrote, if it did
        if weights is not None:
            return output, weights
        # from the call's projections, or its queries and keys (guarded, not copied)
        qp, kp = (queries, keys) if projections is None else projections.owned(queries, keys)
        return output, _weights_later(qp, kp, scale, m, valid_lens, guard=(queries, keys))

    def _unpadded(
        self, queries: Tensor, keys: Tensor, values: Tensor, causal: bool
    ) -> tuple[Tensor, Tensor | WeightsFn] | None:
        """Calls with nothing padded (:meth:`_lane`), eager, dropout as SDPA's, run as the
        checked path would (:func:`~attnscore.kernels._attention.unpadded_call`,
        :func:`~attnscore.kernels._attention.projected_call`)."""
        lane = self._lane(queries, keys, small=False)
        if lane is None:
            return None
        project, scale = lane
        dropout_p = _dropout_p(self)
        n, m = queries.shape[-2], keys.shape[-2]
        if project is None:
            output = unpadded_call(
                queries, keys, values, causal=causal, scale=scale, dropout_p=dropout_p
            )
            if output is None:
                return None
            seen = keys[..., :n, :] if causal and n < m else keys  # no query sees the rest
            return output, _weights_later(queries, seen, scale, m, causal=causal)
        projections = KeptProjections(project)
        projected = projected_call(
            queries, keys, values, causal=causal, project=projections, dropout_p=dropout_p
        )
        if projected is None:
            return None
        output, weights = projected
        if weights is not None:  # kept without its graph, which holds the caller's tensors
            return output, ComputedWeights(detached(weights))
        qp, kp = projections.owned(queries, keys)
        return output, _weights_later(qp, kp, 1.0, m, causal=causal, guard=(queries, keys))

    def __getstate__(self) -> dict[str, object]:
        # A spec may hold a user's lambda (not picklable): pickle its name.
        state = super().__getstate__()
        state["spec"] = self.spec.name
        state.pop("_projector", None)  # only a cache, bound to this object's tensors
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        if isinstance(state.get("spec"), str):
            state["spec"] = get_scorer(str(state["spec"]))
        super().__setstate__(state)  # type: ignore[no-untyped-call]

    def extra_repr(self) -> str:
        own = f"scoring={self.spec.name!r}" if type(self) is ScorerAttention else ""
        return ", ".join(filter(None, [own, super().extra_repr()]))


# The built-in specs the textbook's classes stand for (captured at import, so a later
# registration replacing a name does not change these classes).
_ADDITIVE, _DOT, _SCALED_DOT, _GENERAL, _COSINE = map(
    get_scorer, ("additive", "dot", "scaled_dot", "general", "cosine")
)


class AdditiveAttention(ScorerAttention):
    """Additive (Bahdanau) attention, ``a(q, k) = w_vᵀ tanh(W_q q + W_k k [+ b])``.

    Bahdanau et al. 2015, eq. (A.1.2); D2L eq. "additive-attn". The registry's
    ``"additive"`` with the textbook's arguments. Parameters ``W_q``, ``W_k`` (``nn.Linear``,
    no bias) and ``w_v`` (``nn.Linear(num_hiddens, 1, bias=False)``) match the textbook's
    PyTorch class, so its state_dict loads with ``strict=True``. No (B, n, m, h) tensor is
    ever built.

    Args:
        key_size: k; None infers it on the first call (as the MXNet rendition and D2L's
            newer edition do, via ``nn.LazyLinear``).
        query_size: q; None infers it on the first call.
        num_hiddens: h, the hidden units of the scoring MLP (required).
        bias: add a learned bias ``b`` (h,) inside the tanh (Bahdanau's original form).
        normalize: weight-normalise ``w_v`` as ``g · w_v / ‖w_v‖`` with a learned scalar
            gain ``g`` (init 1/sqrt(h)); implies ``bias`` (TensorFlow Addons'
            ``BahdanauAttention(normalize=True)``; Salimans & Kingma 2016).
        dropout, normalizer, keep_weights: as :class:`Attention`.

    Shapes: queries (..., n, q), keys (..., m, k), values (..., m, v) -> (..., n, v).

    Raises:
        ValueError: sizes that are not positive ints.
        TypeError: missing ``num_hiddens``.

    >>> attention = AdditiveAttention(key_size=2, query_size=20, num_hiddens=8).eval()
    >>> queries, keys = torch.randn(2, 1, 20), torch.ones(2, 10, 2)
    >>> values = torch.arange(40.0).reshape(1, 10, 4).repeat(2, 1, 1)
    >>> attention(queries, keys, values, torch.tensor([2, 6])).detach().round(decimals=4)
    tensor([[[ 2.,  3.,  4.,  5.]],
    <BLANKLINE>
            [[10., 11., 12., 13.]]])
    """

    # Made from the spec's params (typed here for readers and type checkers); b, g below.
    W_k: nn.Linear
    W_q: nn.Linear
    w_v: nn.Linear
    b: nn.Parameter | None
    g: nn.Parameter | None

    def __init__(
        self,
        key_size: int | None = None,
        query_size: int | None = None,
        num_hiddens: int | None = None,
        dropout: float = 0.0,
        *,
        bias: bool = False,
        normalize: bool = False,
        normalizer: str | Normalizer = "softmax",
        keep_weights: str = "lazy",
    ) -> None:
        super().__init__(
            _ADDITIVE,
            query_size,
            key_size,
            num_hiddens,
            dropout,
            normalizer=normalizer,
            keep_weights=keep_weights,
        )
        h = self.w_v.in_features
        self._keys_cache: Kept | None = None  # (project_once: W_k keys, a decoder's)
        self.normalize = bool(normalize)
        b = nn.Parameter(torch.zeros(h)) if normalize or bias else None
        g = nn.Parameter(torch.tensor(1.0 / math.sqrt(h))) if normalize else None
        self.register_parameter("b", b)
        self.register_parameter("g", g)

    def score(self, queries: Tensor, keys: Tensor, lengths: Tensor | None) -> Tensor:
        self.check_features(queries, keys)
        return additive_scores_from_projections(*self._projections(queries, keys), lengths)

    def _projections(self, queries: Tensor, keys: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(W_q q [+ b], W_k k (kept for a decoder's repeated keys), w_v (h,), weight-
        normalised with ``normalize``): what the scores are made of."""
        qh = self.W_q(queries)
        if self.b is not None:
            qh = qh + self.b
        w = self.w_v.weight
        if self.g is not None:
            w = self.g * w / w.norm()
        return qh, project_once(self, "_keys_cache", self.W_k, keys), w.reshape(-1)

    def _small(
        self, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor | None
    ) -> tuple[Tensor, Tensor | WeightsFn] | None:
        """Small inference calls: the projections here, then one C pass over each query
        row's valid keys (see :func:`attnscore.kernels._attention.small_additive_attention`),
        which writes the weights it used."""
        if _is_lazy(self.W_q) or _is_lazy(self.W_k):
            return None
        W_q, W_k = self.W_q.weight, self.W_k.weight
        if (
            self._offered(queries, keys, small=True) is None
            or W_q.device != queries.device
            or queries.dtype != W_q.dtype
            or queries.shape[-1] != W_q.shape[1]
            or keys.shape[-1] != W_k.shape[1]
            or (torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()))
        ):
            return None
        return small_additive_attention(
            queries, keys, values, valid_lens, self.w_v.in_features, self._projections
        )

    def __getstate__(self) -> dict[str, object]:
        state = super().__getstate__()
        state["_keys_cache"] = None  # a weak reference: not picklable, and only a cache
        return state


class DotProductAttention(ScorerAttention):
    """Scaled dot-product attention, ``softmax(Q Kᵀ · scale) V``.

    Vaswani et al. 2017, eq. (1); D2L eq. "softmax_QK_V". The registry's ``"scaled_dot"``
    (``scale=None``) and ``"dot"`` (``scale=1.0``), and any other fixed scale.

    Args:
        dropout, normalizer, keep_weights: as :class:`Attention`.
        scale: None for 1/sqrt(d) (scaled dot product); 1.0 for Luong et al. 2015's "dot".

    Shapes: queries (..., n, d), keys (..., m, d), values (..., m, v) -> (..., n, v).

    Raises:
        TypeError: ``scale`` neither a float nor None.
        ValueError: in ``forward``, queries and keys of different d; see :class:`Attention`.

    >>> attention = DotProductAttention(dropout=0.5).eval()
    >>> queries, keys = torch.randn(2, 1, 2), torch.ones(2, 10, 2)
    >>> values = torch.arange(40.0).reshape(1, 10, 4).repeat(2, 1, 1)
    >>> attention(queries, keys, values, torch.tensor([2, 6])).round(decimals=4)
    tensor([[[ 2.,  3.,  4.,  5.]],
    <BLANKLINE>
            [[10., 11., 12., 13.]]])
    """

    def __init__(
        self,
        dropout: float = 0.0,
        *,
        scale: float | None = None,
        normalizer: str | Normalizer = "softmax",
        keep_weights: str = "lazy",
    ) -> None:
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
            raise TypeError(f"Expected `scale` to be a float or None, but got {scale!r} instead.")
        super().__init__(
            _SCALED_DOT, dropout=dropout, normalizer=normalizer, keep_weights=keep_weights
        )
        self.scale = None if scale is None else float(scale)

    def score(self, queries: Tensor, keys: Tensor, lengths: Tensor | None) -> Tensor:
        return dot_product_scores(queries, keys, self.scale)

    def _dot_scale(self) -> float | None:
        return self.scale

    def extra_repr(self) -> str:
        return ", ".join(filter(None, [f"scale={self.scale}", super().extra_repr()]))


def _weights_later(
    qp: Tensor,
    kp: Tensor,
    scale: float,
    m: int,
    valid_lens: Tensor | None = None,
    *,
    causal: bool = False,
    guard: tuple[Tensor, Tensor] | None = None,
) -> WeightsFn:
    """The weights of a fast lane's dot-product attention of ``qp`` (..., n, d) and ``kp``
    (..., m', d) by key lengths or causal masking, computed when asked
    (:func:`attnscore._engine.dot_weights_later`) from the call's own tensors, refused once
    one of them (or of ``guard``, the queries and keys projections were made from) changed
    in place (:func:`~attnscore._engine.refuse_if_changed`); copies of inference tensors (no version
    counter to guard them by) made now. ``m``: the number of keys."""
    tensors = (qp, kp) if valid_lens is None else (qp, kp, valid_lens)
    inference = any(map(Tensor.is_inference, tensors))
    if inference:  # copies, but of projections only those that share the caller's memory
        qp, kp = kept(qp, guard), kept(kp, guard)
        valid_lens = None if valid_lens is None else owned(valid_lens)

    def weights() -> Tensor:
        q, k = qp.detach(), kp.detach()
        n = q.shape[-2]
        mask = build_mask(q.shape[:-2], n, m, q.device, valid_lens=valid_lens, causal=causal)
        return dot_weights_later(q, k, scale, mask)()

    if inference:
        return weights
    watched = tensors if guard is None else (*tensors, *guard)
    versions = tuple(map(VERSIONS, watched))

    def checked() -> Tensor:
        refuse_if_changed(watched, versions)
        return weights()

    return checked


_KEEP = ("lazy", "eager", "none")


def _check_keep(keep_weights: object) -> str:
    if keep_weights not in _KEEP:
        raise ValueError(
            f"Expected `keep_weights` among {list(_KEEP)}, but got {keep_weights!r} instead."
        )
    return str(keep_weights)


def _not_kept() -> Tensor:
    """The weights function of a module that keeps no weights (``keep_weights="none"``)."""
    raise RuntimeError(
        "attention_weights: this module keeps no weights (keep_weights='none'); set "
        "`keep_weights='lazy'` or 'eager' to read them, or call it with return_weights=True."
    )


def _held(module: nn.Module, name: str) -> Tensor:
    """``module.<name>``, a tensor it holds (parameter or buffer), read from where
    ``nn.Module`` keeps it, past its attribute lookup (slow for a fast lane's every call);
    anything else held under that name (a parametrization, ...) through the lookup."""
    held: Tensor | None = module._parameters.get(name)
    if held is None:
        held = module._buffers.get(name)
    return held if held is not None else getattr(module, name)


def _submodule(module: nn.Module, name: str) -> nn.Module:
    """``module.<name>``, a submodule, as :func:`_held` reads tensors."""
    held = module._modules.get(name)
    return held if held is not None else getattr(module, name)


def _dropout_p(module: Attention) -> float:
    """The dropout probability at work in ``module``'s call: 0 in eval mode."""
    if not module.training:
        return 0.0
    dropout = _submodule(module, "dropout")
    assert isinstance(dropout, nn.Dropout)
    return dropout.p


def _checked(module: ScorerAttention, project: Projection) -> Projection:
    """``project`` after ``module``'s check of the feature sizes (the fused path's)."""

    def checked(queries: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
        module.check_features(queries, keys)
        return project(queries, keys)

    return checked


class MultiplicativeAttention(ScorerAttention):
    """General (multiplicative, bilinear) attention, ``a(q, k) = qᵀ W_a k``.

    Luong et al. 2015, eq. (8) "general": the registry's ``"general"``. Queries and keys
    may differ in size.

    Args:
        query_size: q (required).
        key_size: k; None infers it on the first call.
        dropout, normalizer, keep_weights: as :class:`Attention`.

    Shapes: queries (..., n, q), keys (..., m, k), values (..., m, v) -> (..., n, v).
    ``W_a`` is ``nn.Linear(key_size, query_size, bias=False)``.

    Raises:
        ValueError: sizes that are not positive ints; in ``forward``, feature sizes unlike
            ``W_a``'s.

    >>> attention = MultiplicativeAttention(query_size=20, key_size=2)
    >>> attention(torch.randn(2, 1, 20), torch.randn(2, 10, 2), torch.randn(2, 10, 4)).shape
    torch.Size([2, 1, 4])
    """

    W_a: nn.Linear  # made from the spec's params

    def __init__(
        self,
        query_size: int,
        key_size: int | None = None,
        dropout: float = 0.0,
        *,
        normalizer: str | Normalizer = "softmax",
        keep_weights: str = "lazy",
    ) -> None:
        _check_size(query_size, "query_size")
        super().__init__(
            _GENERAL,
            query_size,
            key_size,
            None,
            dropout,
            normalizer=normalizer,
            keep_weights=keep_weights,
        )


class CosineAttention(ScorerAttention):
    """Scaled cosine attention, ``a(q, k) = s · cos(q, k)`` with a fixed or learned s.

    Liu et al. 2022 (Swin Transformer V2), eq. (2), with s = 1/τ: the registry's
    ``"cosine"`` (which learns s). The scale is kept as its logarithm ``log_scale`` so
    that a learned one stays positive.

    Args:
        dropout, normalizer, keep_weights: as :class:`Attention`.
        scale: s, the inverse temperature (default 10).
        learn_scale: learn s (``log_scale`` a parameter; else a buffer).

    Shapes: queries (..., n, d), keys (..., m, d), values (..., m, v) -> (..., n, v).

    Raises:
        ValueError: ``scale`` not a positive float.

    >>> CosineAttention()(torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)).shape
    torch.Size([2, 3, 6])
    """

    log_scale: Tensor  # made from the spec's params

    def __init__(
        self,
        dropout: float = 0.0,
        *,
        scale: float = 10.0,
        learn_scale: bool = False,
        normalizer: str | Normalizer = "softmax",
        keep_weights: str = "lazy",
    ) -> None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
            raise ValueError(f"Expected `scale` to be a positive float, but got {scale!r} instead.")
        super().__init__(_COSINE, dropout=dropout, normalizer=normalizer, keep_weights=keep_weights)
        log_scale = torch.tensor(math.log(scale))
        if learn_scale:
            self.log_scale = nn.Parameter(log_scale)
        else:
            del self.log_scale
            self.register_buffer("log_scale", log_scale)


def make_scorer(
    name: str,
    query_size: int,
    key_size: int | None = None,
    *,
    num_hiddens: int | None = None,
    dropout: float = 0.0,
    normalizer: str | Normalizer = "softmax",
    keep_weights: str = "lazy",
) -> ScorerAttention:
    """Build the attention module of the scorer registered as ``name``.

    The built-in names give the textbook's classes (:class:`AdditiveAttention`,
    :class:`DotProductAttention` with scale 1 for ``"dot"``, :class:`MultiplicativeAttention`,
    :class:`CosineAttention` with a learned scale); any other registered name a
    :class:`ScorerAttention` from its spec.

    Args:
        name: a registered scorer name (see :func:`attnscore.scorer_names`).
        query_size: q, the queries' feature size.
        key_size: k, the keys' feature size (default: ``query_size``).
        num_hiddens: h for scorers with hidden units (additive; default: ``query_size``).
        dropout, normalizer, keep_weights: as :class:`Attention`.

    Returns:
        A module taking queries (..., n, q) and keys (..., m, k).

    Raises:
        ValueError: unknown name, or sizes that are not positive ints.

    >>> make_scorer("additive", query_size=20, key_size=2, num_hiddens=8)(
    ...     torch.randn(2, 1, 20), torch.randn(2, 10, 2), torch.randn(2, 10, 4)).shape
    torch.Size([2, 1, 4])
    >>> make_scorer("general", query_size=4, key_size=6)
    MultiplicativeAttention(
      (dropout): Dropout(p=0.0, inplace=False)
      (W_a): Linear(in_features=6, out_features=4, bias=False)
    )
    """
    spec = get_scorer(name)
    k = query_size if key_size is None else key_size
    h = query_size if num_hiddens is None else num_hiddens
    options: dict[str, Any] = {"normalizer": normalizer, "keep_weights": keep_weights}
    if spec is _ADDITIVE:
        return AdditiveAttention(k, query_size, h, dropout, **options)
    if spec is _DOT or spec is _SCALED_DOT:
        return DotProductAttention(dropout, scale=1.0 if spec is _DOT else None, **options)
    if spec is _GENERAL:
        return MultiplicativeAttention(query_size, k, dropout, **options)
    if spec is _COSINE:
        return CosineAttention(dropout, learn_scale=True, **options)
    return ScorerAttention(spec, query_size, k, h, dropout, **options)
