"""Which implementation runs dot-product attention: the one place that chooses.

An *implementation* (:class:`Implementation`) is one way to run an attention call: the C
kernel by lengths, PyTorch's SDPA, flash attention's varlen kernel, the plain formulation,
... Each says what it takes in :meth:`~Implementation.supports`, which returns None where
it runs a call and otherwise the reason it declines, read from the call alone
(:class:`AttentionCall`: its tensors, mask, scale, dropout and what has been found out
about them). The candidates of a device type are a priority list (:data:`PRIORITY`): the
first that takes a call runs it (:func:`choose`). The lists are the design; the sizes at
which a kernel pays are data (:data:`attnscore.kernels.THRESHOLDS`), read by the
``supports`` methods.

Control is public, in the manner of ``torch.nn.attention.sdpa_kernel``:

- :func:`use` restricts (and optionally orders) the candidates inside a ``with`` block, in
  the current thread; a call that none of them takes raises an error listing every
  candidate's reason, as xformers' dispatcher does;
- :func:`explain` runs a call and reports, for each attention it ran, which implementation
  ran it and why each one ahead of it declined;
- every choice is logged at DEBUG level by the ``attnscore`` logger.

Implementations live next to their kernels (``_cpu``, ``_sdpa``, ``_varlen``,
``_attention``) and are named here by ``"module:Class"``, imported on first use (the CUDA
module needs Triton).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from .. import _thresholds
from .._checks import in_transform, value_range
from .._mask import AttentionMask, compact

_log = logging.getLogger("attnscore")
_DEBUG = logging.DEBUG

Projection = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]

#: Device type -> its candidates for dot-product attention, first choice first. Device types
#: without a row use ``"*"``'s.
PRIORITY: dict[str, tuple[str, ...]] = {
    "cpu": ("c_small", "c_by_lengths", "flash_cut", "flash_grouped", "sdpa", "plain"),
    "cuda": ("flash_varlen", "sdpa", "plain"),
    "*": ("sdpa", "plain"),
}

#: Implementation name -> where it lives, ``"module:Class"`` of this package (imported on
#: first use: the CUDA kernels need Triton).
WHERE: dict[str, str] = {
    "c_small": "_cpu:SmallPass",
    "c_by_lengths": "_cpu:ByLengths",
    "flash_cut": "_cpu:CutExamples",
    "flash_grouped": "_cpu:GroupedExamples",
    "flash_varlen": "_varlen:FlashVarlen",
    "sdpa": "_sdpa:Sdpa",
    "plain": "_attention:Plain",
}


#: What :func:`explain` names a call that no implementation of dot-product attention ran:
#: the scorer's own pipeline (scores, normalizer, dropout, weighted sum) ran it.
PIPELINE = "pipeline"

Runner = Callable[[Tensor, Tensor, Tensor], Tensor | None]
"""(q, k, v) -> output: an implementation's run of the calls of one plan (:func:`planned`);
None where it declines once it ran (as :meth:`Implementation.run`)."""


class AttentionCall:
    """One call of dot-product attention, as the implementations see it.

    ``q`` (B, H, n, d) or, for calls with nothing padded, (B, n, d); ``k`` (..., m, d),
    ``v`` (..., m, dv): one float dtype and device, padding already inert where it was not
    finite (``finite`` says whether that left every entry finite). ``mask``: laid out over
    (B, H) (:class:`~attnscore._mask.AttentionMask`). ``project`` (q, k) -> (q', k'):
    scorers whose scores are dot products of projections (general, cosine), applied only
    by the implementation that runs the call (:meth:`projected`); ``inert`` (q, k, v) ->
    (q, k, v): the caller's zeroing of padding, applied with it where lengths are taken.
    ``bias``: a float score bias broadcastable to (B, H, n, m), or None. ``kind``: what the
    mask asks: ``"none"``, ``"causal"`` (causal masking alone), ``"boolean"`` (an
    ``attend_mask``, with anything) or ``"lengths"`` (key or query lengths, with or without
    causal masking).

    Facts that cost a read of the lengths (``shortest``, the lengths :func:`compact
    <attnscore._mask.compact>`) are found once, on first use, and shared by every
    candidate (or given: ``lengths``, (compact lengths, the shortest), by a caller that read
    them); an implementation may keep what its ``supports`` worked out (``notes``) for its
    ``run``.
    """

    __slots__ = (
        "_lengths",
        "_projected",
        "_shortest",
        "_sizes",
        "_work",
        "bias",
        "device",
        "dropout_p",
        "finite",
        "inert",
        "k",
        "kind",
        "mask",
        "needs_grad",
        "notes",
        "project",
        "q",
        "ran",
        "scale",
        "traced",
        "v",
    )

    def __init__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: AttentionMask,
        *,
        scale: float,
        dropout_p: float = 0.0,
        bias: Tensor | None = None,
        project: Projection | None = None,
        inert: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]] | None = None,
        finite: bool = True,
        traced: bool | None = None,
        lengths: tuple[Tensor, int] | None = None,
    ) -> None:
        self.q, self.k, self.v, self.mask = q, k, v, mask
        self.scale, self.dropout_p, self.bias = scale, dropout_p, bias
        self.project, self.inert, self.finite = project, inert, finite
        self.device = "cpu" if q.is_cpu else q.device.type
        if mask.attend is not None:
            self.kind = "boolean"
        elif mask.lengths is None:
            self.kind = "none"
        elif mask.causal and mask.key_lengths is None and mask.query_lengths is None:
            self.kind = "causal"
        else:
            self.kind = "lengths"
        self.traced = in_transform(q, k, v) if traced is None else traced
        self.needs_grad = torch.is_grad_enabled() and (
            project is not None or q.requires_grad or k.requires_grad or v.requires_grad
        )
        self.notes: dict[str, Any] = {}
        # (a caller that read the lengths passes them compact, with the shortest)
        self._lengths: Tensor | None = None if lengths is None else lengths[0]
        self._shortest: int | None = None if lengths is None else lengths[1]
        self._sizes: tuple[int, int, int, int, int] | None = None
        self._work: int | None = None
        self._projected: tuple[Tensor, Tensor, Tensor] | None = None
        #: The implementation that ran the call (set by :func:`choose`).
        self.ran: Implementation | None = None

    @property
    def sizes(self) -> tuple[int, int, int, int, int]:
        """(pairs, n, m, d, dv): the (example, head) pairs B·H (B for 3-D inputs), queries,
        keys, and the head sizes of k and v (read once with :attr:`work`: each ``.shape``
        makes a torch.Size)."""
        if self._sizes is None:
            qs, ks = self.q.shape, self.k.shape
            pairs, n, m, d = qs[0] if len(qs) == 3 else qs[0] * qs[1], qs[-2], ks[-2], ks[-1]
            dv = self.v.shape[-1]
            self._sizes = (pairs, n, m, d, dv)
            self._work = pairs * n * m * (d + dv) if qs[-1] else 0
        return self._sizes

    @property
    def work(self) -> int:
        """Multiply-adds of the whole call: (B·H) · n · m · (d + dv); 0 where q has no
        features."""
        if self._work is None:
            self.sizes  # noqa: B018 (reads the work too)
        assert self._work is not None
        return self._work

    @property
    def lengths(self) -> Tensor:
        """The mask's lengths (B or 1, H or 1, n or 1), as small as they broadcast."""
        if self._lengths is None:
            assert self.mask.lengths is not None
            self._lengths = compact(self.mask.lengths)
        return self._lengths

    @property
    def read_lengths(self) -> bool:
        """Whether :attr:`shortest` is known already (a candidate read the lengths)."""
        return self._shortest is not None

    @property
    def shortest(self) -> int:
        """The shortest length of the mask (one read of the lengths)."""
        if self._shortest is None:
            self._shortest = value_range(self.lengths)[0]
        return self._shortest

    def drop_uncut_lengths(self) -> bool:
        """Make a call by lengths that cut no key (each at least m: every query attends
        every key) a call with no mask, where the lengths can be read (an eager CPU call:
        one read, which the candidates would make anyway); whether it did. Such lengths are
        padding that is not there: without the mask every candidate takes the call as it
        takes one with nothing padded (the mask's own path builds, lays out and applies a
        mask that changes nothing), and its result is the plain formulation's, NaN and zero
        rows included (no row is empty)."""
        if self.kind != "lengths" or self.device != "cpu" or self.traced:
            return False
        m = self.mask.m
        if self.shortest < m:
            return False
        self.mask, self.kind = AttentionMask(n=self.mask.n, m=m), "none"
        self._lengths = self._shortest = None
        self.notes["as"] = "none (lengths that cut no key)"
        return True

    def projected(self) -> tuple[Tensor, Tensor, Tensor]:
        """(q, k, v) as the scores read them: padding zeroed by ``inert`` and q, k through
        ``project``, where given (once per call)."""
        if self._projected is None:
            q, k, v = self.q, self.k, self.v
            if self.inert is not None:
                q, k, v = self.inert(q, k, v)
            if self.project is not None:
                q, k = self.project(q, k)
            self._projected = (q, k, v)
        return self._projected


class Implementation:
    """One way to run dot-product attention (subclasses, one instance each).

    ``name`` is what :func:`use` and :func:`explain` call it; ``summary`` says in a line what
    it is. :meth:`supports` returns None where it runs a call, else why not (in words a user
    can act on); :meth:`run` runs a call it supports and returns the output (..., n, dv),
    or None where it finds only then that it cannot (the next candidate runs the call).
    A projected call's None from the last candidate means: the caller's own pipeline.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    #: The mask kinds (:attr:`AttentionCall.kind`) it may take: a call of another kind is
    #: never offered to its ``supports`` (:func:`choose` says why it declines).
    kinds: ClassVar[frozenset[str]] = frozenset({"none", "causal", "lengths", "boolean"})
    #: Whether its verdict weighs the lengths' values beyond whether they cut any key (what
    #: cutting per example saves): a choice it took part in is not kept (:func:`planned`).
    weighs_lengths: ClassVar[bool] = False

    def supports(self, call: AttentionCall) -> str | None:
        raise NotImplementedError

    def run(self, call: AttentionCall) -> Tensor | None:
        raise NotImplementedError

    def padding_inert(self, call: AttentionCall) -> bool:
        """Whether NaN or inf in the call's padding (keys and values that no query of their
        (example, head) attends) reaches none of its gradients when it runs the call: it
        never reads them, or makes them inert itself. Where it does, a training call on
        inputs presumed finite needs a look at them (:func:`~._attention.result_exact`);
        elsewhere its result tells (a non-finite query, key or value that some query
        attends shows in that query's output). False unless the implementation says so."""
        return False

    def prepare(self, call: AttentionCall) -> Runner | None:
        """A runner for the calls of :func:`planned`'s key that ``call`` has (the same mask
        kind, sizes, strides, dtype, scale, dropout and gradients): what :meth:`run` would
        do for them, with what depends only on those worked out once. None (the default):
        :meth:`run` it is."""
        return None

    def shows_queries(self, call: AttentionCall) -> bool:
        """Whether NaN or inf in a query that attends some key shows in that query's output
        when it runs the call, so that its result tells without a read of the queries
        (some versions of SDPA returned zeros for a NaN query: it is probed). False unless
        the implementation says so."""
        return False

    def __repr__(self) -> str:
        return f"<attention implementation {self.name!r}: {self.summary}>"


class NoImplementationError(RuntimeError):
    """No implementation allowed by :func:`use` takes a call; the message lists why each
    declined."""


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` decided for one call: the ``device`` type, the implementation
    that ran it (``chosen``), and (name, reason) for each candidate ahead of it that
    declined; ``route`` says which entry asked (``"checked"``, or a fast lane's name). Where
    the call was explained: ``call`` (its mask kind and sizes) and ``rows``, (name,
    verdict) for every candidate of the device in priority order."""

    device: str
    chosen: str
    declined: tuple[tuple[str, str], ...] = ()
    route: str = "checked"
    call: str = ""
    rows: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        lines = [f"attention on {self.device} ({self.route}): {self.chosen}"]
        if self.call:
            lines.append(f"  call: {self.call}")
        if not self.rows:
            return "\n".join(lines + [f"  declined {n}: {why}" for n, why in self.declined])
        width = max(len(name) for name, _ in self.rows)
        lines += [f"  {i}. {n:<{width}}  {v}" for i, (n, v) in enumerate(self.rows, 1)]
        return "\n".join(lines)


@dataclass
class Explanation:
    """The choices of the calls :func:`explain` ran, in order: one per attention, naming
    the implementation of dot-product attention that ran it, or :data:`PIPELINE` where the
    scorer's own pipeline did (additive attention, another normalizer, weights asked for,
    a projected call no implementation took)."""

    choices: list[Choice] = field(default_factory=list)

    @property
    def chosen(self) -> list[str]:
        """The implementation of each attention, in order."""
        return [c.chosen for c in self.choices]

    def __str__(self) -> str:
        if not self.choices:
            return "no attention ran"
        return "\n".join(str(c) for c in self.choices)


class _Local(threading.local):
    """This thread's :func:`use` restriction and :func:`explaining` record. Defaults live
    on the class: a miss on a ``threading.local`` (``getattr`` with a default) raises and
    catches inside, which every call of :func:`choose` would pay."""

    only: tuple[tuple[str, ...], bool] | None = None
    recording: list[Choice] | None = None
    recorded = 0  # choices recorded so far (see recorded())


_local = _Local()
_instances: dict[str, Implementation | None] = {}
_lists: dict[str, tuple[Implementation, ...]] = {}
_lock = threading.Lock()


def _load(name: str) -> Implementation | None:
    if name not in _instances:
        module, cls = WHERE[name].split(":")
        try:
            impl = getattr(importlib.import_module(f"{__package__}.{module}"), cls)()
        except ImportError:  # a module whose dependency is missing: its kernels are not there
            impl = None
        _instances[name] = impl
    return _instances[name]


def implementations(device_type: str) -> tuple[Implementation, ...]:
    """The candidates of ``device_type``, first choice first (those that can be imported)."""
    found = _lists.get(device_type)
    if found is None:
        with _lock:
            names = PRIORITY.get(device_type, PRIORITY["*"])
            found = tuple(i for i in map(_load, names) if i is not None)
            _lists[device_type] = found
    return found


@contextlib.contextmanager
def use(*names: str, ordered: bool = False) -> Iterator[None]:
    """Run the body with dot-product attention restricted to the implementations ``names``
    (in this thread; nests: the inner block's list applies).

    Without ``ordered`` they keep the device's priority order; with it, ``names`` is the
    order. A call that none of them takes raises :class:`NoImplementationError` with every
    candidate's reason. Fast lanes that run small or unpadded calls before the checks stand
    aside inside the block, so that the restriction applies to every call.

    Raises:
        ValueError: a name that is no implementation (the error lists the names).

    >>> import torch, attnscore
    >>> q = torch.randn(2, 3, 8)
    >>> with attnscore.kernels.use("plain"):
    ...     attnscore.dot_product_attention(q, q, q, torch.tensor([1, 3])).shape
    torch.Size([2, 3, 8])
    """
    known = set(WHERE)
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(
            f"Expected `names` among {sorted(known)}, but got {list(names)!r} instead."
        )
    previous = _local.only
    _local.only = (tuple(names), ordered)
    try:
        yield
    finally:
        _local.only = previous


def restricted() -> bool:
    """Whether a :func:`use` block is active in this thread (fast lanes then stand aside)."""
    return _local.only is not None


_by_kind: dict[tuple[str, str], tuple[Implementation, ...]] = {}


def _of_kind(device: str, kind: str) -> tuple[Implementation, ...]:
    """The candidates of ``device`` that take masks of ``kind`` (kept)."""
    found = tuple(i for i in implementations(device) if kind in i.kinds)
    _by_kind[device, kind] = found
    return found


def watched() -> bool:
    """Whether choices are being recorded (:func:`explaining`) or logged in this thread."""
    return _local.recording is not None or _log.isEnabledFor(_DEBUG)


def _candidates(
    call: AttentionCall, only: tuple[tuple[str, ...], bool] | None
) -> Sequence[Implementation]:
    """The candidates for ``call`` under :func:`use`'s ``only`` (names, ordered), watched."""
    listed = implementations(call.device)
    if only is None:
        return listed
    names, ordered = only
    if ordered:
        by_name = {i.name: i for i in listed}
        return [by_name[n] for n in names if n in by_name]
    return [i for i in listed if i.name in names]


def choose(
    call: AttentionCall,
    *,
    route: str = "checked",
    lane: bool = False,
    plan: Hashable | None = None,
    kept: Plan | None = None,
) -> Tensor | None:
    """Run ``call`` on the first candidate of its device that takes it; its output, or
    None where a projected call falls to the caller's own pipeline (recorded as
    :data:`PIPELINE`). ``route`` names the entry for :func:`explain` and the log; a
    ``lane``'s None is not recorded (the checked path then runs the call and records its
    choice). ``plan``: the key under which :func:`planned` keeps the choice for the calls
    like this one (a caller that knows every candidate's verdict follows from it): a choice
    kept runs the call without the selection (unless it declines once it ran). ``kept``:
    that choice, where the caller looked it up already.

    Raises:
        NoImplementationError: inside :func:`use`, where no allowed candidate takes the call.
    """
    if call.drop_uncut_lengths():
        plan = kept = None  # (decided by the lengths' values, which no plan's key holds)
    # Traced calls (compiled ones among them) record and log nothing: the choice is made
    # while tracing, and torch.compile does not trace logging.
    if kept is None and plan is not None:
        kept = planned(plan)
    if kept is not None:  # what took the first call of this key, without the selection
        out = kept.impl.run(call)
        if out is not None or kept.impl.name == "plain":
            call.ran = kept.impl
            return out
    only = _local.only
    seen = not call.traced and watched()
    candidates: Sequence[Implementation]
    if only is None and not seen:  # (the common case) skip the other mask kinds' ones
        candidates = _by_kind.get((call.device, call.kind)) or _of_kind(call.device, call.kind)
    else:
        candidates = _candidates(call, only)
    declined: list[tuple[str, str]] = []
    declined_late = weighed = False
    for impl in candidates:
        # (offered every candidate only when explained, logged or restricted)
        why = impl.supports(call) if call.kind in impl.kinds else _other_kind(impl, call.kind)
        weighed = weighed or (impl.weighs_lengths and call.kind in impl.kinds)
        if why is None:
            out = impl.run(call)
            call.ran = impl
            if out is not None or impl.name == "plain":
                if plan is not None and only is None and not (declined_late or weighed):
                    _keep_plan(plan, impl, call, out)
                if seen and (out is not None or not lane):  # None: a projected call handed back
                    chosen = impl.name if out is not None else PIPELINE
                    rows = _rows(call, candidates, declined, impl.name, chosen)
                    record(call.device, chosen, route, declined, _described(call), rows)
                return out
            why = call.notes.pop("declined", "declined once it ran")
            declined_late = True  # (on what it read: a plan would skip that reading)
        declined.append((impl.name, why))
    reasons = "; ".join(f"{name}: {why}" for name, why in declined) or "none allowed here"
    raise NoImplementationError(
        f"No implementation allowed by attnscore.kernels.use takes this attention call "
        f"on {call.device} ({reasons})."
    )


class Plan:
    """What :func:`choose` decided for the calls of one key: the implementation, its
    runner (:meth:`Implementation.prepare`; its :meth:`~Implementation.run` where it has
    none; None for calls by lengths and projected calls with gradients, whose caller runs
    ``impl`` on its own call, or its own pipeline where that is ``plain``), and what it
    declares about them (:meth:`~Implementation.padding_inert`,
    :meth:`~Implementation.shows_queries`), which the caller's result check reads. A
    projected call's runner takes the projections (q', k', v); ``projections`` is their
    (shape, strides) it was made for: the key holds the inputs' layout, not the one a
    projection gives them, which the caller compares."""

    __slots__ = ("impl", "padding_inert", "projections", "run", "shows_queries")

    def __init__(
        self,
        impl: Implementation,
        run: Runner | None,
        inert: bool,
        shows: bool,
        projections: tuple[object, ...] | None = None,
    ) -> None:
        self.impl, self.run, self.padding_inert, self.shows_queries = impl, run, inert, shows
        self.projections = projections


def projections_layout(qp: Tensor, kp: Tensor) -> tuple[object, ...]:
    """The layout of a call's projections that a projected plan's runner was made for."""
    return (qp.shape, qp.stride(), kp.shape, kp.stride())


#: Plans by key (:func:`planned`); forgotten whenever what decides changes (:func:`replan`,
#: and :func:`_stamp`: the thresholds, the benchmark mode).
_plans: dict[Hashable, Plan] = {}
_PLANS_KEPT = 256
_plans_stamp: list[tuple[int, bool]] = [(-1, False)]


def _stamp() -> tuple[int, bool]:
    """What every plan depends on beyond its key: the thresholds' changes so far and
    whether :data:`attnscore.kernels.benchmark` measures."""
    return _thresholds.changes, bool(sys.modules[__package__].benchmark)


def planned(key: Hashable) -> Plan | None:
    """The plan :func:`choose` kept for the calls of ``key``, or None: none yet, or calls
    that :func:`use` restricts or that are explained or logged (they take :func:`choose`,
    which records them). The key is the caller's: every fact on which the candidates'
    verdicts and the runner depend (mask kind, sizes, strides, dtype, scale, dropout,
    gradients, threads, :func:`~._dispatch.enabled`); the thresholds, the tune file and
    the benchmark mode are not in it: changing them forgets every plan (:func:`replan`).
    Like ``torch.backends.cudnn.benchmark``'s choices, kept per process."""
    if _local.only is not None or _local.recording is not None or _log.isEnabledFor(_DEBUG):
        return None
    plan = _plans.get(key)
    if plan is not None and _plans_stamp[0] != _stamp():
        _plans.clear()
        return None
    return plan


def _keep_plan(
    key: Hashable, impl: Implementation, call: AttentionCall, out: Tensor | None
) -> None:
    """Keep what ran ``call`` for the calls of ``key``: ``impl`` and its runner (for a
    projected call, one that takes the projections, and their layout); for a call by
    lengths or a projected one with gradients, ``impl`` alone (a runner would need the
    call's lengths, or the key would need to say which parameters require gradients: the
    caller runs ``impl`` on its call; ``plain``, which handed a projected call back (``out``
    None): the caller's pipeline)."""
    stamp = _stamp()
    if len(_plans) >= _PLANS_KEPT or _plans_stamp[0] != stamp:
        _plans.clear()
        _plans_stamp[0] = stamp
    inert, shows = impl.padding_inert(call), impl.shows_queries(call)
    if out is None or call.kind == "lengths" or (call.project is not None and call.needs_grad):
        _plans[key] = Plan(impl, None, inert, shows)
        return
    mask, scale, dropout_p = call.mask, call.scale, call.dropout_p
    target, projections = call, None
    if call.project is not None:  # inference: the runner takes the projections it ran on
        qp, kp, v = call.projected()
        target = AttentionCall(qp, kp, v, mask, scale=scale, dropout_p=dropout_p, traced=False)
        projections = projections_layout(qp, kp)
    run = impl.prepare(target)
    if run is None:  # (the closure keeps none of the call's tensors: the mask has none)

        def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            again = AttentionCall(q, k, v, mask, scale=scale, dropout_p=dropout_p, traced=False)
            out = impl.run(again)
            assert out is not None  # (it ran the first call of the key)
            return out

    _plans[key] = Plan(impl, run, inert, shows, projections)


def replan() -> None:
    """Forget every kept plan (:func:`planned`): the thresholds, the tune file or the
    benchmark mode changed."""
    _plans.clear()


def _described(call: AttentionCall) -> str:
    pairs, n, m, d, dv = call.sizes
    head = f"d {d}" if d == dv else f"d {d}, dv {dv}"
    step = "training" if call.needs_grad else "inference"
    dtype = str(call.q.dtype).removeprefix("torch.")
    mask = call.notes.get("as", call.kind)
    return f"mask {mask}, B·H {pairs}, n {n}, m {m}, {head}, {dtype}, {step}"


def _rows(
    call: AttentionCall,
    candidates: Sequence[Implementation],
    declined: list[tuple[str, str]],
    ran: str,
    chosen: str,
) -> tuple[tuple[str, str], ...]:
    """Every candidate of the call's device, in priority order, with its verdict."""
    reasons, rows = dict(declined), []
    for impl in implementations(call.device):
        name = impl.name
        if name == ran:
            measured = call.notes.get("measured") if name == "c_by_lengths" else None
            verdict = "chosen" if chosen == name else "handed the call to the scorer's pipeline"
            verdict += f" ({measured})" if measured else ""
        elif name in reasons:
            verdict = f"declined: {reasons[name]}"
        elif impl not in candidates:
            verdict = "excluded by attnscore.kernels.use"
        else:
            verdict = f"not asked ({ran} took the call first)"
        rows.append((name, verdict))
    return tuple(rows)


def _other_kind(impl: Implementation, kind: str) -> str:
    return f"a {kind} mask (it takes {', '.join(sorted(impl.kinds))})"


def record(
    device: str,
    chosen: str,
    route: str,
    declined: Sequence[tuple[str, str]] = (),
    call: str = "",
    rows: tuple[tuple[str, str], ...] = (),
) -> None:
    """Note that ``route`` ran an attention call (described by ``call``) on ``chosen`` after
    the candidates ``declined`` (name, reason) declined it, every candidate's verdict in
    ``rows``: for :func:`explaining` and the DEBUG log."""
    _local.recorded += 1
    recording = _local.recording
    if recording is not None:
        recording.append(Choice(device, chosen, tuple(declined), route, call, rows))
    if _log.isEnabledFor(_DEBUG):
        ahead = "; ".join(f"{n}: {w}" for n, w in declined)
        _log.debug(
            "attention on %s (%s): %s%s", device, route, chosen, f" ({ahead})" if ahead else ""
        )


def recorded() -> int:
    """How many choices :func:`record` has noted in this thread: a caller compares two
    readings to see whether what it called recorded its choice."""
    return _local.recorded


@contextlib.contextmanager
def explaining() -> Iterator[Explanation]:
    """Collect the choices of every dot-product attention the body runs, in this thread,
    into the :class:`Explanation` it yields (what :func:`explain` does for one call).

    >>> import torch, attnscore
    >>> q = torch.randn(2, 3, 8)
    >>> with attnscore.kernels.explaining() as seen:
    ...     _ = attnscore.dot_product_attention(q, q, q, torch.tensor([1, 3]))
    ...     _ = attnscore.dot_product_attention(q, q, q, causal=True, dropout_p=0.5)
    >>> seen.chosen
    ['c_small', 'sdpa']
    """
    previous = _local.recording
    found = Explanation()
    _local.recording = found.choices
    try:
        yield found
    finally:
        _local.recording = previous


def explain(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Explanation:
    """Run ``fn(*args, **kwargs)`` once (a module, or a function such as
    :func:`attnscore.dot_product_attention`) and say, for each dot-product attention it ran,
    which implementation ran it and why each one ahead of it declined.

    The call runs as it would (gradients, training mode and all, with its effects, e.g. a
    module's ``attention_weights``); its result is discarded. ``print`` the explanation for
    a readable report; :attr:`Explanation.chosen` lists the implementations.

    >>> import torch, attnscore
    >>> q = torch.randn(2, 3, 8)
    >>> attnscore.explain(attnscore.dot_product_attention, q, q, q, torch.tensor([1, 3])).chosen
    ['c_small']
    """
    with explaining() as found:
        fn(*args, **kwargs)
    return found


def markdown() -> str:
    """The priority lists as docs/architecture.md shows them (a markdown table, one row per
    device and candidate): ``python -c "from attnscore.kernels._select import markdown;
    print(markdown(), end='')"``."""
    rows = ["| device | # | implementation | what it is | class |", "|---|---|---|---|---|"]
    for device, names in PRIORITY.items():
        for rank, name in enumerate(names, 1):
            impl = _load(name)
            summary = impl.summary if impl is not None else "(not importable here)"
            rows.append(f"| `{device}` | {rank} | `{name}` | {summary} | `{WHERE[name]}` |")
    return "\n".join(rows) + "\n"
