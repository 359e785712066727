"""A module's ``attention_weights`` are the weights its call used.

Fast lanes (small calls by key lengths, calls with nothing padded, fused paths) compute
the weights only when asked, from the call's own tensors (no copy): the module holds them
until its next call, and reading the weights after one of them changed in place raises a
clear error instead of giving other weights. ``keep_weights="eager"`` computes them in the
call, ``"none"`` keeps nothing; with either the module keeps none of the caller's tensors.

Every case checks, against an independent float64 reference (the textbook formulation:
softmax of the masked scores, zero rows for queries that may attend nothing), computed
from copies of the inputs taken before the call, each ``keep_weights`` (see
:func:`_check_owned`).
"""

from __future__ import annotations

import gc
import math
import pickle
import weakref
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import attnscore
from attnscore import (
    AdditiveAttention,
    Attention,
    CosineAttention,
    DotProductAttention,
    MultiHeadAttention,
    MultiplicativeAttention,
    ScorerAttention,
    attention,
    make_scorer,
)

TOL = {"atol": 2e-5, "rtol": 1e-4}


def reference_weights(
    scores: Tensor,
    valid_lens: Tensor | None = None,
    *,
    query_valid_lens: Tensor | None = None,
    attend_mask: Tensor | None = None,
    causal: bool = False,
) -> Tensor:
    """softmax over the keys each query may attend of float64 ``scores`` (B, ..., n, m);
    rows with no such key are zero. ``valid_lens`` (B,) or (B, n) (shared by the other
    batch dimensions) or (B, ..., n); ``query_valid_lens`` (B,)."""
    *batch, n, m = scores.shape
    B, ones = batch[0], (1,) * (len(batch) - 1)
    rows, cols = torch.arange(n)[:, None], torch.arange(m)[None, :]
    allowed = torch.ones(scores.shape, dtype=torch.bool)
    if valid_lens is not None:
        lens = valid_lens.to(torch.int64)
        if lens.shape == (B,):
            lens = lens.reshape(B, *ones, 1)
        elif lens.shape == (B, n):
            lens = lens.reshape(B, *ones, n)
        allowed &= cols < lens[..., None]
    if causal:
        allowed &= cols <= rows
    if query_valid_lens is not None:
        real = rows < query_valid_lens.to(torch.int64).reshape(B, *ones, 1, 1)
        allowed &= real
    if attend_mask is not None:
        allowed &= attend_mask
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.where(allowed.any(dim=-1, keepdim=True), weights, 0.0)


def _double(t: Tensor) -> Tensor:
    return t.detach().to(torch.float64)


def scores_of(module: Attention, q: Tensor, k: Tensor) -> Tensor:
    """The textbook scores (..., n, m) of ``module`` in float64, from its parameters."""
    q, k = _double(q), _double(k)
    if isinstance(module, DotProductAttention):
        scale = 1.0 / math.sqrt(q.shape[-1]) if module.scale is None else module.scale
        return q @ k.transpose(-1, -2) * scale
    if isinstance(module, AdditiveAttention):
        qh = q @ _double(module.W_q.weight).T
        if module.b is not None:
            qh = qh + _double(module.b)
        kh = k @ _double(module.W_k.weight).T
        w = _double(module.w_v.weight).reshape(-1)
        if module.g is not None:
            w = _double(module.g) * w / w.norm()
        return torch.tanh(qh[..., :, None, :] + kh[..., None, :, :]) @ w
    if isinstance(module, CosineAttention):
        unit_q = q / q.norm(dim=-1, keepdim=True)
        unit_k = k / k.norm(dim=-1, keepdim=True)
        return _double(module.log_scale).exp() * unit_q @ unit_k.transpose(-1, -2)
    if isinstance(module, ScorerAttention) and module.spec.name in ("general", "general_scaled"):
        scores = q @ _double(module.W_a.weight) @ k.transpose(-1, -2)
        if module.spec.name == "general_scaled":
            scores = scores / math.sqrt(k.shape[-1])
        return scores
    assert type(module) is Attention  # the custom scorer below
    return -torch.cdist(q, k)


def _negative_distance(q: Tensor, k: Tensor) -> Tensor:
    return -torch.cdist(q, k)


D = 8  # the feature size of the 3-D cases

MODULES: dict[str, Callable[[int], Attention]] = {
    "scaled_dot": lambda d: DotProductAttention(),
    "dot": lambda d: make_scorer("dot", d),
    "additive": lambda d: AdditiveAttention(d, d, 16),
    "additive_normalize": lambda d: AdditiveAttention(d, d, 16, normalize=True),
    "general": lambda d: MultiplicativeAttention(d, d),
    "general_lazy": lambda d: MultiplicativeAttention(d),
    "general_scaled": lambda d: ScorerAttention("general_scaled", d, d),
    "cosine": lambda d: CosineAttention(),
    "cosine_learned": lambda d: make_scorer("cosine", d),
    "custom": lambda d: Attention(_negative_distance),
}


@dataclass(frozen=True)
class Case:
    """A call: shapes (batch, n, m, d) and its masks."""

    batch: tuple[int, ...]
    n: int
    m: int
    d: int = D
    lens: str | None = None  # "example" (B,) or "query" (B, n)
    causal: bool = False
    attend: bool = False
    query_lens: bool = False


CASES = {
    "none_small": Case((2,), 5, 7),
    "none_mid_heads": Case((2, 4), 64, 64, 32),
    "causal_small": Case((2,), 6, 6, causal=True),
    "causal_fewer_queries": Case((2,), 3, 7, causal=True),
    "causal_mid_heads": Case((2, 4), 64, 64, 32, causal=True),
    "lens_small": Case((2,), 3, 10, lens="example"),
    "lens_decoder_step": Case((4,), 1, 20, lens="example"),
    "lens_mid_heads": Case((2, 4), 64, 64, 32, lens="example"),
    "lens_per_query": Case((2,), 5, 9, lens="query"),
    "lens_per_query_heads": Case((2, 4), 16, 24, 16, lens="query"),
    "lens_causal_heads": Case((2, 4), 64, 64, 32, lens="example", causal=True),
    "attend_mask_heads": Case((2, 4), 64, 64, 32, attend=True),
    "attend_mask_lens": Case((2,), 5, 9, lens="example", attend=True),
    "query_lens": Case((2,), 6, 9, query_lens=True),
    "query_lens_and_lens": Case((2, 4), 16, 24, 16, lens="example", query_lens=True),
}


def _inputs(case: Case, generator: torch.Generator) -> dict[str, Tensor]:
    """The call's tensors: q, k, v and the masks the case names."""
    B, n, m = case.batch[0], case.n, case.m
    made = {
        "q": torch.randn(*case.batch, n, case.d, generator=generator),
        "k": torch.randn(*case.batch, m, case.d, generator=generator),
        "v": torch.randn(*case.batch, m, 5, generator=generator),
    }
    if case.lens == "example":
        made["valid_lens"] = torch.tensor([m // 2, m - 1, 0, m][:B])  # int64
    elif case.lens == "query":
        made["valid_lens"] = torch.randint(0, m + 1, (B, n), generator=generator)
    if case.query_lens:
        made["query_valid_lens"] = torch.tensor([n - 2, n][:B])
    if case.attend:
        shape = (B, 1, n, m) if len(case.batch) == 2 else (B, n, m)
        attend = torch.rand(shape, generator=generator) > 0.3
        attend[..., 0, :] = False  # a query that attends nothing
        made["attend_mask"] = attend
    return made


def _call(
    module: nn.Module, made: dict[str, Tensor], case: Case, *, return_weights: bool = False
) -> object:
    masks: dict[str, object] = {"causal": True} if case.causal else {}
    for name in ("query_valid_lens", "attend_mask"):
        if name in made:
            masks[name] = made[name]
    lens = made.get("valid_lens")
    return module(made["q"], made["k"], made["v"], lens, return_weights=return_weights, **masks)


def _change_in_place(made: dict[str, Tensor]) -> None:
    """What a caller may do to its tensors after the call."""
    with torch.no_grad():
        for t in made.values():
            if t.dtype == torch.bool:
                t.logical_not_()
            elif t.is_floating_point():
                t.add_(torch.randn_like(t)).mul_(3.0)
            else:
                t.add_(1).mul_(2)


def _reference(scores: Tensor, original: dict[str, Tensor], case: Case) -> Tensor:
    return reference_weights(
        scores,
        original.get("valid_lens"),
        query_valid_lens=original.get("query_valid_lens"),
        attend_mask=original.get("attend_mask"),
        causal=case.causal,
    )


def _collect(refs: Iterable[weakref.ref[Tensor]]) -> None:
    """A garbage collection where reference counting left some of ``refs`` alive (a full
    collection costs 0.1-0.3 s here)."""
    if any(ref() is not None for ref in refs):
        gc.collect()


def _check_owned(
    module: nn.Module,
    made: dict[str, Tensor],
    case: Case,
    expected: Callable[[dict[str, Tensor]], Tensor],
    *,
    return_weights: bool = False,
) -> None:
    """The weights of every ``keep_weights`` against ``expected(original inputs)``:

    - ``"lazy"`` (default): read after the call, the reference; read after the inputs
      changed in place, the reference or the clear error, never other weights;
    - ``"eager"``: the reference after the inputs changed in place and were dropped, and
      the module keeps none of them;
    - ``"none"``: the module keeps none of them, and reading raises."""
    inner = module.attention if isinstance(module, MultiHeadAttention) else module
    assert isinstance(inner, Attention)
    original = {name: t.detach().clone() for name, t in made.items()}
    grads = {name: t.requires_grad for name, t in made.items()}

    def fresh() -> dict[str, Tensor]:
        return {n: t.clone().requires_grad_(grads[n]) for n, t in original.items()}

    _call(module, fresh(), case, return_weights=return_weights)
    weights = module.attention_weights
    assert weights is not None and not weights.requires_grad
    torch.testing.assert_close(weights.double(), expected(original), **TOL)
    _call(module, made, case, return_weights=return_weights)
    _change_in_place(made)
    try:
        weights = module.attention_weights
    except RuntimeError as error:
        assert "changed in place after the call" in str(error)
    else:
        assert weights is not None
        torch.testing.assert_close(weights.double(), expected(original), **TOL)
    for keep in ("eager", "none"):
        inner.keep_weights = keep
        inputs = fresh()
        result = _call(module, inputs, case, return_weights=return_weights)
        _change_in_place(inputs)
        refs = {name: weakref.ref(t) for name, t in inputs.items()}
        del result
        inputs.clear()
        _collect(refs.values())
        alive = [name for name, ref in refs.items() if ref() is not None]
        assert not alive, f"keep_weights={keep!r}: the module keeps the caller's {alive}"
        if keep == "none":
            with pytest.raises(RuntimeError, match="keeps no weights"):
                module.attention_weights  # noqa: B018
            continue
        weights = module.attention_weights
        assert weights is not None and not weights.requires_grad
        torch.testing.assert_close(weights.double(), expected(original), **TOL)
    inner.keep_weights = "lazy"


MODES = ("inference", "training", "return_weights")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("module_name", list(MODULES))
def test_module_weights_are_the_calls_and_keep_no_input(
    module_name: str, case_name: str, mode: str
) -> None:
    case = CASES[case_name]
    generator = torch.Generator().manual_seed(zlib.crc32(f"{module_name} {case_name}".encode()))
    torch.manual_seed(7)
    module = MODULES[module_name](case.d)
    made = _inputs(case, generator)
    if mode == "training":  # gradients everywhere: the graph must not hold the inputs
        module.train()
        for name in ("q", "k", "v"):
            made[name].requires_grad_(True)
        context = torch.enable_grad()
    else:
        module.eval()
        context = torch.no_grad() if mode == "inference" else torch.enable_grad()
    if module_name == "general_lazy":  # the first call materialises W_a
        with torch.no_grad():
            _call(module, _inputs(case, generator), case)

    def expected(original: dict[str, Tensor]) -> Tensor:
        scores = scores_of(module, original["q"], original["k"])
        return _reference(scores, original, case)

    with context:
        _check_owned(module, made, case, expected, return_weights=mode == "return_weights")


@pytest.mark.parametrize("case_name", ["none_mid_heads", "causal_small", "lens_mid_heads"])
def test_fast_lanes_defer_the_weights(case_name: str) -> None:
    """The dot-product lanes these cases take compute no weights in the call (so the cases
    above test the deferred weights)."""
    case = CASES[case_name]
    module = DotProductAttention().eval()
    made = _inputs(case, torch.Generator().manual_seed(0))
    with torch.no_grad():
        _call(module, made, case)
    assert not isinstance(module.__dict__["_weights"], Tensor)


MHA_SCORERS = ("scaled_dot", "dot", "additive", "general", "cosine")
MHA_CASES = {
    "none": Case((2,), 64, 64),
    "causal": Case((2,), 64, 64, causal=True),
    "lens": Case((2,), 64, 64, lens="example"),
    "lens_small": Case((2,), 3, 10, lens="example"),
    "lens_per_query": Case((2,), 5, 9, lens="query"),
    "attend_mask": Case((2,), 16, 24, attend=True),
    "query_lens": Case((2,), 6, 9, lens="example", query_lens=True),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case_name", list(MHA_CASES))
@pytest.mark.parametrize("scoring", MHA_SCORERS)
def test_multihead_weights_are_the_calls_and_keep_no_input(
    scoring: str, case_name: str, mode: str
) -> None:
    """(B, n, E) inputs, 4 heads of 32: the weights (B, 4, n, m) are the reference's of the
    projections of the original inputs."""
    case = MHA_CASES[case_name]
    E, H = 128, 4
    case = Case(case.batch, case.n, case.m, E, case.lens, case.causal, case.attend, case.query_lens)
    torch.manual_seed(3)
    mha = MultiHeadAttention(E, H, scoring=scoring, bias=True)
    made = _inputs(
        case, torch.Generator().manual_seed(zlib.crc32(f"{scoring} {case_name}".encode()))
    )
    with torch.no_grad():
        mha(made["q"][:, :1], made["k"][:, :1], made["v"][:, :1])  # materialise the projections
    if mode == "training":
        mha.train()
        for name in ("q", "k", "v"):
            made[name].requires_grad_(True)
    else:
        mha.eval()
    inner = mha.attention

    def heads(x: Tensor, linear: nn.Linear) -> Tensor:
        projected = _double(x) @ _double(linear.weight).T + _double(linear.bias)
        return projected.unflatten(-1, (H, -1)).transpose(1, 2)

    def expected(original: dict[str, Tensor]) -> Tensor:
        scores = scores_of(inner, heads(original["q"], mha.W_q), heads(original["k"], mha.W_k))
        if "attend_mask" in original:  # (B, n, m): every head
            original = {**original, "attend_mask": original["attend_mask"].unsqueeze(1)}
        return _reference(scores, original, case)

    context = torch.no_grad() if mode == "inference" else torch.enable_grad()
    with context:
        _check_owned(mha, made, case, expected, return_weights=mode == "return_weights")


def test_additive_decoder_steps_keep_the_keys_projection_not_the_keys() -> None:
    """A decoder's steps pass the same keys: the second step reuses the module's cached
    projection. Its weights stay the step's after the keys change in place, and neither
    step keeps the keys."""
    torch.manual_seed(5)
    module = AdditiveAttention(D, D, 16).eval()
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(4, 20, D, generator=g)
    values = torch.randn(4, 20, 5, generator=g)
    lens = torch.tensor([20, 7, 1, 12])
    original_keys = keys.clone()
    steps = [torch.randn(4, 1, D, generator=g) for _ in range(3)]
    with torch.no_grad():
        for query in steps:
            module(query, keys, values, lens)
        # the small lane took the steps: its C pass wrote the weights it used
        assert isinstance(module.__dict__["_weights"], Tensor)
        keys.add_(torch.randn_like(keys))
        lens.zero_()
    refs = [weakref.ref(t) for t in (keys, values, lens, *steps)]
    last = steps[-1].clone()
    del keys, values, lens, steps, query
    _collect(refs)
    assert all(ref() is None for ref in refs)
    expected = reference_weights(
        scores_of(module, last, original_keys), torch.tensor([20, 7, 1, 12])
    )
    weights = module.attention_weights
    assert weights is not None
    torch.testing.assert_close(weights.double(), expected, **TOL)


@pytest.mark.parametrize("module_name", ["scaled_dot", "general", "cosine", "additive"])
def test_deferred_weights_survive_pickling(module_name: str) -> None:
    """``__getstate__`` computes the deferred weights (a closure does not pickle): they are
    the call's, after the inputs changed in place."""
    case = CASES["lens_small"]
    module = MODULES[module_name](case.d).eval()
    made = _inputs(case, torch.Generator().manual_seed(2))
    original = {name: t.clone() for name, t in made.items()}
    with torch.no_grad():
        _call(module, made, case)
    _change_in_place(made)
    restored = pickle.loads(pickle.dumps(module))
    expected = _reference(scores_of(module, original["q"], original["k"]), original, case)
    torch.testing.assert_close(restored.attention_weights.double(), expected, **TOL)


def test_parameters_changed_after_the_call_do_not_change_projected_weights() -> None:
    """Projected scorers keep the projections the call made: an optimizer step after the
    call (an in-place change of W_a) leaves the weights the call's."""
    case = CASES["lens_mid_heads"]
    module = MultiplicativeAttention(case.d, case.d).eval()
    made = _inputs(case, torch.Generator().manual_seed(4))
    with torch.no_grad():
        _call(module, made, case)
        expected = _reference(scores_of(module, made["q"], made["k"]), made, case)
        module.W_a.weight.mul_(-2.0)
    weights = module.attention_weights
    assert weights is not None
    torch.testing.assert_close(weights.double(), expected, **TOL)


class _Copies(TorchDispatchMode):
    """Records the shapes of the copies (clone, copy_) made under it."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.clone.default, torch.ops.aten.copy_.default):
            self.shapes.append(tuple(out.shape))
        return out


@pytest.mark.parametrize("scorer", ["dot", "scaled_dot"])
def test_functions_copy_no_input_for_weights_they_do_not_return(scorer: str) -> None:
    """Neither the functions (which never return a fused call's weights) nor the module
    (which computes them on access from the call's own tensors) copy queries or keys."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, 2, s, 16, generator=g) for s in (24, 40, 40))
    lengths = torch.tensor([5, 40, 0])
    module = ScorerAttention(scorer, query_size=16, key_size=16).eval()
    params = dict(module.named_parameters())
    for form, expect_copies in (
        (lambda: attention(q, k, v, scorer, lengths, params=params or None), False),
        (lambda: module(q, k, v, lengths), False),
    ):
        with torch.no_grad(), _Copies() as copies:
            form()
        shapes = {tuple(q.shape), tuple(k.shape)}
        copied = [s for s in copies.shapes if s in shapes]
        assert bool(copied) == expect_copies, (scorer, copies.shapes)


@pytest.mark.parametrize("lens", [None, [10, 64]], ids=["no_mask", "lengths"])
def test_a_cache_written_in_place_gives_the_clear_error(lens: list[int] | None) -> None:
    """A decode step against a KV cache: the weights read before the next write are the
    step's; read after it, one clear error that says how to keep them (never other
    weights); with ``keep_weights="eager"`` the step's; under ``torch.inference_mode``
    (no version counters) the call copies what it needs and gives the step's."""
    g = torch.Generator().manual_seed(11)
    keys, values = torch.randn(2, 4, 64, 16, generator=g), torch.randn(2, 4, 64, 8, generator=g)
    q = torch.randn(2, 4, 1, 16, generator=g)
    valid_lens = None if lens is None else torch.tensor(lens)
    expected = reference_weights(
        _double(q) @ _double(keys).transpose(-1, -2) / 4.0,
        None if valid_lens is None else valid_lens,
    )
    module = DotProductAttention().eval()
    # (the one C pass of small calls writes its weights: steer past it)
    with torch.no_grad(), attnscore.kernels.thresholds(small_work=-1):
        module(q, keys, values, valid_lens)
        torch.testing.assert_close(module.attention_weights.double(), expected, **TOL)
        module(q, keys, values, valid_lens)
        keys[:, :, 5] = 1.0  # the next step writes the cache
        with pytest.raises(RuntimeError, match=r"changed in place after the call.*keep_weights"):
            module.attention_weights  # noqa: B018
        keys[:, :, 5] = torch.randn(2, 4, 16, generator=g)
    expected = reference_weights(
        _double(q) @ _double(keys).transpose(-1, -2) / 4.0,
        None if valid_lens is None else valid_lens,
    )
    eager = DotProductAttention(keep_weights="eager").eval()
    for mod, context in ((eager, torch.no_grad()), (module, torch.inference_mode())):
        with context:
            k, v, qi = keys.clone(), values.clone(), q.clone()
            mod(qi, k, v, valid_lens)
            k.add_(1.0)
        torch.testing.assert_close(mod.attention_weights.double(), expected, **TOL)


def test_keep_weights_is_checked() -> None:
    with pytest.raises(ValueError, match="Expected `keep_weights` among"):
        DotProductAttention(keep_weights="copy")
    with pytest.raises(ValueError, match="Expected `keep_weights` among"):
        MultiHeadAttention(8, 2, keep_weights=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [5, 256], ids=["small", "by_lengths"])
def test_inference_mode_weights_of_projected_scorers_are_the_calls(n: int) -> None:
    """Under ``torch.inference_mode`` (no version counters) a projected scorer keeps the
    projections its call made: in-place changes of the caller's queries and keys after the
    call do not reach its weights."""
    g = torch.Generator().manual_seed(12)
    torch.manual_seed(12)
    module = MultiplicativeAttention(8, 8).eval()
    q, k, v = (
        torch.randn(2, n, 8, generator=g),
        torch.randn(2, n, 8, generator=g),
        torch.randn(2, n, 4, generator=g),
    )
    lens = torch.randint(1, n + 1, (2, n), generator=g)
    expected = reference_weights(scores_of(module, q, k), lens)
    with torch.inference_mode():
        qi, ki, vi, li = q.clone(), k.clone(), v.clone(), lens.clone()
        module(qi, ki, vi, li)
        qi.mul_(-3.0)
        ki.add_(1.0)
        li.zero_()
    torch.testing.assert_close(module.attention_weights.double(), expected, **TOL)
