"""The scorer registry: one spec per scoring name, the single source of every front door.

A :class:`ScorerSpec` says what a scorer is: its score function, its parameters and their
shapes, its formula and source, and, where its scores are dot products of projections of
the queries and keys, those projections and their scale (what gives it every fast path).
Everything else comes from the spec: the module (:func:`attnscore.make_scorer`), the
functional form (:func:`attnscore.attention` with ``scoring="name"``),
``MultiHeadAttention(scoring=...)``, ``attnscore run --scoring``, the G2P model, the
benchmark and the test path registry.

The built-in scorers (``additive``, ``dot``, ``scaled_dot``, ...) are registered at the
end of this module; :func:`scorer_names` lists every registered name and
:func:`get_scorer` gives each one's formula and source (``attnscore run --help`` and the
docs' scorer table, docs/scorers.md, are generated from them). Names have the field's
meaning: ``scaled_dot`` is Vaswani et al.'s ``qᵀk / √d``.

This module imports no ``nn.Module``: the modules build on it, never the other way.

>>> {"additive", "dot", "scaled_dot"} <= set(scorer_names())
True
>>> spec = get_scorer("scaled_dot")
>>> spec.formula, spec.source
('qᵀk / √d', 'Vaswani et al. 2017, eq. 1')
>>> [(p.name, p.shape) for p in get_scorer("general").params]
[('W_a', ('query_size', 'key_size'))]
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

from torch import Tensor

from ._checks import check_registration
from ._engine import FusedPath, fused_dot_product
from .kernels import _ops
from .kernels._dispatch import Projection
from .scoring import (
    additive_scores,
    cosine_scores,
    default_scale,
    dot_product_scores,
    general_scores,
    unit_rows,
)

__all__ = [
    "SCORERS",
    "SIZE_NAMES",
    "Param",
    "ScorerSpec",
    "get_scorer",
    "register_scorer",
    "scorer_names",
    "unprojected",
]

#: The sizes a parameter's shape may name: q, k and h of the shape legend.
SIZE_NAMES = ("query_size", "key_size", "num_hiddens")

ScoreFunction = Callable[..., Tensor]
ProjectionFunction = Callable[..., tuple[Tensor, Tensor]]
"""``(queries (..., n, q), keys (..., m, k), **params) -> (q' (..., n, d'), k' (..., m, d'))``."""


def unprojected(queries: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
    """The projection of scorers that are dot products of the queries and keys themselves
    (``dot``, ``scaled_dot``): none. It gives the fused path of dot-product attention with
    every mask, dropout and score bias (:func:`attnscore.kernels.dot_product_attention`).

    >>> get_scorer("scaled_dot").projection is unprojected
    True
    """
    return queries, keys


@dataclass(frozen=True)
class Param:
    """One parameter of a scorer, as its score function receives it (by keyword).

    A 2-D parameter (out, in) is a matrix: modules hold it as ``nn.Linear(in, out,
    bias=False)`` (state_dict key ``name.weight``, PyTorch's initialisation,
    ``nn.LazyLinear`` while ``in`` is not known yet); any other shape is an
    ``nn.Parameter`` filled with ``init``.

    >>> Param("W_a", ("query_size", "key_size")).is_matrix
    True
    """

    name: str
    """The score function's keyword, and the module's attribute."""
    shape: tuple[int | str, ...]
    """One entry per dimension: a size name of :data:`SIZE_NAMES` or an int."""
    init: float = 0.0
    """The initial value of a parameter that is not a matrix."""

    @property
    def is_matrix(self) -> bool:
        """True for a 2-D (out, in) parameter, held by modules as a bias-free Linear."""
        return len(self.shape) == 2

    def resolve(self, sizes: Mapping[str, int | None]) -> tuple[int | None, ...]:
        """The shape with its size names replaced by ``sizes`` (None where unknown)."""
        return tuple(sizes.get(d) if isinstance(d, str) else d for d in self.shape)


@dataclass(frozen=True)
class ScorerSpec:
    """A registered scorer: the single source of its module and its functional form.

    >>> spec = get_scorer("scaled_dot")
    >>> spec.formula, spec.same_feature_size, spec.hidden_units
    ('qᵀk / √d', True, False)
    """

    name: str
    """The name ``scoring=`` arguments and ``--scoring`` options take."""
    score: ScoreFunction
    """``score(queries (..., n, q), keys (..., m, k), **params) -> scores (..., n, m)``,
    called with every parameter by keyword, and with ``lengths`` (int64 (..., n) or None:
    keys at j >= lengths[..., i] are masked afterwards, so they may be skipped) when it
    takes that keyword."""
    formula: str
    """The score a(q, k), for tables and ``--help``."""
    source: str
    """Where the scoring function comes from (paper, equation)."""
    params: tuple[Param, ...] = ()
    """The parameters, in order (the modules' ``parameters()`` order)."""
    same_feature_size: bool = False
    """Queries and keys must share their feature size d."""
    fused: FusedPath | None = field(default=None, compare=False)
    """A fused path for the whole pipeline with the softmax (see
    :func:`attnscore._engine.attend`): one given, or :func:`unprojected`'s; or None."""
    projection: ProjectionFunction | None = field(default=None, compare=False)
    """``(queries, keys, **params) -> (q' (..., n, d'), k' (..., m, d'))`` whose dot
    products times :attr:`scale` are the scores, or None: every form then runs as
    dot-product attention of the projections where a kernel takes it."""
    scale: float | None = 1.0
    """The factor on the projections' dot products; None: 1/√d' (Vaswani's scaling)."""
    takes_lengths: bool = field(init=False, compare=False)
    """True when :attr:`score` takes the ``lengths`` hint (read once from its signature)."""
    param_shapes: tuple[tuple[str, bool, tuple[int | str, ...]], ...] = field(
        init=False, compare=False, repr=False
    )
    """(name, whether a matrix, shape) per parameter, read once for the fast lanes' checks."""
    own_fused: bool = field(init=False, compare=False, repr=False, default=False)
    """True when :attr:`fused` is the fused path made from the declared projection (no
    user's): a fast lane may then run its calls as that path would."""
    _fused_unkept: FusedPath | None = field(init=False, compare=False, repr=False, default=None)
    # The default fused path of an unprojected scorer, made for callers that never ask for
    # the weights (fused_path(weights=False)); None where the fused path is a user's.

    def __post_init__(self) -> None:
        try:
            takes = "lengths" in inspect.signature(self.score).parameters
        except (TypeError, ValueError):  # a callable without a signature
            takes = False
        object.__setattr__(self, "takes_lengths", takes)
        shapes = tuple((p.name, p.is_matrix, p.shape) for p in self.params)
        object.__setattr__(self, "param_shapes", shapes)
        if self.fused is None and self.projection is unprojected:
            object.__setattr__(self, "fused", fused_dot_product(self.scale))
            object.__setattr__(self, "_fused_unkept", fused_dot_product(self.scale, weights=False))
            object.__setattr__(self, "own_fused", True)

    def __copy__(self) -> ScorerSpec:
        return self  # immutable: modules that are copied share their spec

    def __deepcopy__(self, memo: dict[int, object]) -> ScorerSpec:
        return self

    @property
    def hidden_units(self) -> bool:
        """True when a parameter has ``num_hiddens`` units (what ``--num-hiddens`` sets)."""
        return any("num_hiddens" in p.shape for p in self.params)

    def scores(
        self, queries: Tensor, keys: Tensor, params: Mapping[str, object], lengths: Tensor | None
    ) -> Tensor:
        """Scores (..., n, m) of checked inputs with parameters by name."""
        if self.takes_lengths:
            return self.score(queries, keys, **params, lengths=lengths)
        return self.score(queries, keys, **params)

    def projector(self, params: Mapping[str, object]) -> Projection:
        """:attr:`projection` bound to ``params`` (by name, as :attr:`score` takes them),
        :attr:`scale` folded into the projected queries: the projected paths run at scale 1
        (their kernels take the scale before projecting, and None needs d')."""
        assert self.projection is not None
        bound, scale = partial(self.projection, **params), self.scale
        if scale == 1.0:
            return bound

        def scaled(queries: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
            qp, kp = bound(queries, keys)
            return qp * (default_scale(qp.shape[-1]) if scale is None else scale), kp

        return scaled

    def fused_path(
        self, params: Mapping[str, object], factor: float = 1.0, *, weights: bool = True
    ) -> FusedPath | None:
        """The fused path of ``softmax(factor · scores)`` (``factor``: a softmax-like
        normalizer's, :func:`attnscore.normalizers.score_factor`): :attr:`fused` for the
        plain softmax, else dot-product attention of the :meth:`projector`'s vectors, else
        None (a user's :attr:`fused` runs the plain softmax only). ``weights=False``: for a
        caller that never asks for the weights (:func:`~attnscore._engine.fused_dot_product`)."""
        if self.projection is unprojected:
            if factor != 1.0:
                return fused_dot_product(self.scale, factor=factor, weights=weights)
            return self.fused if weights or self._fused_unkept is None else self._fused_unkept
        if self.fused is not None or self.projection is None:
            return self.fused if factor == 1.0 else None
        return fused_dot_product(1.0, self.projector(params), factor=factor, weights=weights)


SCORERS: dict[str, ScorerSpec] = {}


def _check_params(params: object, name: str) -> tuple[Param, ...]:
    if not isinstance(params, Sequence) or not all(isinstance(p, Param) for p in params):
        raise TypeError(f"Expected `params` to be a sequence of Param, but got {params!r} instead.")
    seen: set[str] = set()
    for p in params:
        bad = [d for d in p.shape if not (d in SIZE_NAMES or (type(d) is int and d > 0))]
        if not p.name.isidentifier() or p.name in seen or p.name == "lengths" or bad:
            raise ValueError(
                f"Expected `params` of scorer {name!r} with distinct identifier names other "
                f"than 'lengths' and shapes of positive ints or {list(SIZE_NAMES)}, but got "
                f"{p!r} instead."
            )
        seen.add(p.name)
    return tuple(params)


def register_scorer(
    name: str,
    score: ScoreFunction,
    *,
    formula: str,
    source: str,
    params: Sequence[Param] = (),
    same_feature_size: bool = False,
    fused: FusedPath | None = None,
    replace: bool = False,
    projection: ProjectionFunction | None = None,
    scale: float | None = 1.0,
) -> ScorerSpec:
    """Register a scorer under ``name`` and return its :class:`ScorerSpec`.

    The name then works everywhere a scorer is taken by name: :func:`attnscore.make_scorer`,
    :func:`attnscore.attention`, ``MultiHeadAttention(scoring=...)``, ``attnscore run``.

    Args:
        name: a word (letters, digits, underscores).
        score: ``(queries, keys, **params[, lengths]) -> scores``; see :class:`ScorerSpec`.
        formula: the score a(q, k), for tables and ``--help``.
        source: where the scoring function comes from (paper, equation).
        params: the parameters :attr:`ScorerSpec.score` takes, with their shapes.
        same_feature_size: queries and keys must share their feature size.
        fused: a fused path of your own (see :class:`ScorerSpec`).
        replace: allow replacing an existing registration.
        projection: ``(queries, keys, **params) -> (q', k')`` whose dot products times
            ``scale`` are the scores: every fast path then takes the scorer.
        scale: see :attr:`ScorerSpec.scale`.

    Raises:
        ValueError: ``name`` is not a word or is registered already; bad ``params``.
        TypeError: ``score`` or ``projection`` not callable, ``params`` not of
            :class:`Param`, ``scale`` neither a float nor None.

    >>> import attnscore
    >>> spec = register_scorer("neg_distance", lambda q, k: -torch.cdist(q, k),
    ...                        formula="-‖q - k‖", source="an example", same_feature_size=True)
    >>> attnscore.make_scorer("neg_distance", 4)(torch.randn(2, 3, 4), torch.randn(2, 5, 4),
    ...                                          torch.randn(2, 5, 6)).shape
    torch.Size([2, 3, 6])
    >>> del SCORERS["neg_distance"]
    """
    signature = ("score", score, "(queries, keys, **params) -> scores")
    check_registration(name, SCORERS, "scorer", replace, signature)
    if projection is not None:  # the same check, for the projection
        maps = "(queries, keys, **params) -> (q', k')"
        check_registration(name, {}, "scorer", replace, ("projection", projection, maps))
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"Expected `scale` to be a float or None, but got {scale!r} instead.")
    spec = ScorerSpec(
        name, score, formula, source, _check_params(params, name), bool(same_feature_size),
        fused, projection, None if scale is None else float(scale),
    )  # fmt: skip
    SCORERS[name] = spec
    return spec


def scorer_names() -> list[str]:
    """The registered scorer names, sorted.

    >>> "additive" in scorer_names()
    True
    """
    return sorted(SCORERS)


def get_scorer(name: str) -> ScorerSpec:
    """The :class:`ScorerSpec` registered as ``name``.

    Raises:
        ValueError: no scorer of that name, naming the registered ones.

    >>> get_scorer("dot").source
    'Luong et al. 2015, eq. 8 "dot"'
    """
    try:
        return SCORERS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"Expected `scoring` to be one of {scorer_names()}, but got {name!r} instead."
        ) from None


def _general_scaled(queries: Tensor, keys: Tensor, W_a: Tensor) -> Tensor:
    """General scores divided by √d, d the keys' feature size: the scaling that keeps dot
    products of unit-variance vectors at unit variance, applied to the bilinear form."""
    return general_scores(queries, keys, W_a) / math.sqrt(keys.shape[-1])


def _general_projection(queries: Tensor, keys: Tensor, W_a: Tensor) -> tuple[Tensor, Tensor]:
    """(q W_a, k): the vectors whose dot products are the general scores."""
    return _ops.matmul(queries, W_a), keys


def _cosine_by_log_scale(queries: Tensor, keys: Tensor, log_scale: Tensor) -> Tensor:
    """Cosine scores with the scale kept as its logarithm, so that a learned one stays > 0."""
    return cosine_scores(queries, keys, log_scale.exp().to(queries.dtype))


def _cosine_projection(queries: Tensor, keys: Tensor, log_scale: Tensor) -> tuple[Tensor, Tensor]:
    """(s q/‖q‖, k/‖k‖): the vectors whose dot products are the cosine scores."""
    return unit_rows(queries) * log_scale.exp().to(queries.dtype), unit_rows(keys)


register_scorer(
    "additive", additive_scores, formula="w_vᵀ tanh(W_q q + W_k k)",
    source="Bahdanau et al. 2015, eq. A.1.2",
    params=(  # in the textbook's order, which parameters() and optimizer states keep
        Param("W_k", ("num_hiddens", "key_size")), Param("W_q", ("num_hiddens", "query_size")),
        Param("w_v", (1, "num_hiddens")),
    ),
)  # fmt: skip
register_scorer(
    "dot", partial(dot_product_scores, scale=1.0), projection=unprojected, formula="qᵀk",
    source='Luong et al. 2015, eq. 8 "dot"', same_feature_size=True,
)  # fmt: skip
register_scorer(
    "scaled_dot", partial(dot_product_scores, scale=None), projection=unprojected, scale=None,
    formula="qᵀk / √d", source="Vaswani et al. 2017, eq. 1", same_feature_size=True,
)  # fmt: skip
_W_A = (Param("W_a", ("query_size", "key_size")),)
"""The general scorers' one parameter."""

register_scorer(
    "general", general_scores, params=_W_A, formula="qᵀ W_a k",
    source='Luong et al. 2015, eq. 8 "general"', projection=_general_projection,
)  # fmt: skip
register_scorer(
    "general_scaled", _general_scaled, params=_W_A, formula="qᵀ W_a k / √d",
    source='Luong et al. 2015, eq. 8 "general", scaled as Vaswani et al. 2017, eq. 1',
    projection=_general_projection, scale=None,
)  # fmt: skip
register_scorer(
    "cosine", _cosine_by_log_scale, projection=_cosine_projection,
    params=(Param("log_scale", (), init=math.log(10.0)),), formula="s · cos(q, k), s learned",
    source="Liu et al. 2022 (Swin Transformer V2), eq. 2", same_feature_size=True,
)  # fmt: skip
