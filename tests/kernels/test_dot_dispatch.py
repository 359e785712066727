"""Dot-product attention's dispatch (attnscore.kernels._attention): every mask kind, every
layout and dtype, on each route (PyTorch's SDPA, SDPA with the boolean mask, the CPU's
padding-free loop, the plain twin), against a float64 reference written here row by row.

Also: which route runs for which mask (nothing to skip -> SDPA), garbage in padding, zero
rows and their gradients, and gradcheck of the loop.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import attnscore
from attnscore import kernels as K
from attnscore.kernels import _sdpa
from attnscore.masking import build_mask
from observed_backend import observed_cpu

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 4e-2, torch.float16: 6e-3}

# (name, build_mask keyword arguments as a function of (batch shape, n, m, generator))
MASKS = {
    "none": lambda b, n, m, g: {},
    "lengths (B,)": lambda b, n, m, g: {"valid_lens": _lengths((b[0],), m, g)},
    "lengths (B, n)": lambda b, n, m, g: {"valid_lens": _lengths((b[0], n), m, g)},
    "lengths per head": lambda b, n, m, g: {"valid_lens": _lengths((*b, n), m, g)},
    "bool": lambda b, n, m, g: {"attend_mask": torch.rand(*b, n, m, generator=g) < 0.6},
    "causal": lambda b, n, m, g: {"causal": True},
    "causal + lengths": lambda b, n, m, g: {"causal": True, "valid_lens": _lengths((b[0],), m, g)},
    "causal + lengths (B, n)": lambda b, n, m, g: {
        "causal": True,
        "valid_lens": _lengths((b[0], n), m, g),
    },
    "query lengths": lambda b, n, m, g: {"query_valid_lens": _lengths((b[0],), n, g)},
    "all": lambda b, n, m, g: {
        "valid_lens": _lengths((b[0],), m, g),
        "query_valid_lens": _lengths((b[0],), n, g),
        "causal": True,
    },
}
ROUTES = ["auto", "loop", "groups", "masked", "masked, looked", "plain"]
"""auto: as dispatched (at these sizes, without gradients: the small calls' C pass in
float64 and float32; the C kernel by lengths in 16-bit and in training,
tests/kernels/test_by_lengths.py); loop: the padding-free loop; groups: training with fewer
heads than threads (a flash call with the mask per group of examples of similar length,
keys cut to the group's longest); masked: SDPA + mask with the padding zeroed
unconditionally (small calls); masked, looked: the same with the padding looked at first
(large calls); plain: kernels disabled. Every route but auto and plain keeps the C kernel
by lengths out (it is what runs dropout, float64 and calls the kernel does not take)."""


def _lengths(shape, top, g):
    lengths = torch.randint(0, top + 1, shape, generator=g)
    lengths.view(-1)[0] = 0  # always an empty row
    if lengths.numel() > 1:
        lengths.view(-1)[1] = top
    return lengths


def reference(q, k, v, mask, scale):
    """float64, one query row at a time, from the dense boolean mask."""
    allowed = mask.dense()
    *batch, n, _ = q.shape
    m = k.shape[-2]
    if allowed is None:
        allowed = torch.ones(n, m, dtype=torch.bool)
    allowed = allowed.expand(*batch, n, m).reshape(-1, n, m)
    qf, kf, vf = (t.double().reshape(-1, *t.shape[-2:]) for t in (q, k, v))
    out = torch.zeros(qf.shape[0], n, vf.shape[-1], dtype=torch.float64)
    for r in range(qf.shape[0]):
        for i in range(n):
            keys = allowed[r, i].nonzero().flatten()
            if len(keys):
                w = torch.softmax((kf[r, keys] @ qf[r, i]) * scale, 0)
                out[r, i] = w @ vf[r, keys]
    return out.reshape(*batch, n, vf.shape[-1])


def _inputs(batch, n, m, d=8, dv=8, dtype=torch.float64, seed=0, heads_inner=False):
    g = torch.Generator().manual_seed(seed)
    if heads_inner:  # (B, n, H, d) in memory, as multi-head attention's projections give
        B, H = batch
        q, k, v = (
            torch.randn(B, s, H, c, generator=g).transpose(1, 2)
            for s, c in ((n, d), (m, d), (m, dv))
        )
    else:
        q, k, v = (torch.randn(*batch, s, c, generator=g) for s, c in ((n, d), (m, d), (m, dv)))
    return q.to(dtype), k.to(dtype), v.to(dtype), g


def _always_loop(thresholds):
    """The padding-free loop at any size: cutting always pays, and so do the backward's
    threads (with fewer heads than threads)."""
    thresholds(
        call_work=0,
        threads_work=0,
        small_work=-1,  # no call is small
        by_lengths_work=1 << 60,  # nor runs the C kernel
    )


def _groups(thresholds, monkeypatch, threads=3):
    """The grouped training route at any size: cutting pays, the loop's backward threads
    never do, and ``threads`` threads (groups of ceil(threads / H) examples)."""
    thresholds(call_work=0, threads_work=1 << 60, small_work=-1, by_lengths_work=1 << 60)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)


def run(route, q, k, v, mask, scale, thresholds, monkeypatch):
    if route == "loop":
        _always_loop(thresholds)
    elif route == "groups":
        _groups(thresholds, monkeypatch)
        if not any(t.requires_grad for t in (q, k, v)):  # the route is taken in training
            q = q.detach().requires_grad_(True)
    elif route.startswith("masked"):
        # cutting never pays
        thresholds(call_work=1 << 60, small_work=-1, by_lengths_work=1 << 60)
        if route == "masked, looked":
            thresholds(look_numel=0)  # as for large inputs
    if route == "plain":
        with K.disabled():
            return K.dot_product_attention(q, k, v, mask, scale=scale)
    return K.dot_product_attention(q, k, v, mask, scale=scale)


LAYOUTS = {
    "3-D": dict(batch=(3,)),
    "4-D heads": dict(batch=(3, 2)),
    "heads inner": dict(batch=(3, 2), heads_inner=True),
    "5-D": dict(batch=(2, 2, 2)),
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(5, 7), (7, 5)], ids=["n<m", "n>m"])
def test_every_route_matches_the_reference(
    route, mask_kind, layout, shape, thresholds, monkeypatch
):
    n, m = shape
    spec = LAYOUTS[layout]
    q, k, v, g = _inputs(spec["batch"], n, m, heads_inner=spec.get("heads_inner", False))
    batch = q.shape[:-2]
    kwargs = MASKS[mask_kind](tuple(batch), n, m, g)
    if mask_kind == "lengths per head" and len(batch) == 1:
        kwargs = MASKS["lengths (B, n)"](tuple(batch), n, m, g)
    mask = build_mask(torch.Size(batch), n, m, q.device, **kwargs)
    out = run(route, q, k, v, mask, 0.4, thresholds, monkeypatch)
    assert out.shape == (*batch, n, 8) and out.dtype == q.dtype
    torch.testing.assert_close(out, reference(q, k, v, mask, 0.4), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "mask_kind", ["none", "lengths (B,)", "lengths (B, n)", "causal + lengths"]
)
def test_dtypes(dtype, route, mask_kind, thresholds, monkeypatch):
    q, k, v, g = _inputs((4, 2), 9, 11, dtype=dtype, seed=1)
    mask = build_mask(q.shape[:-2], 9, 11, q.device, **MASKS[mask_kind]((4, 2), 9, 11, g))
    out = run(route, q, k, v, mask, 1 / math.sqrt(8), thresholds, monkeypatch)
    assert out.dtype == dtype
    expected = reference(q, k, v, mask, 1 / math.sqrt(8))
    torch.testing.assert_close(out.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("mask_kind", ["lengths (B,)", "lengths (B, n)", "bool", "all"])
def test_garbage_in_padding_changes_nothing(route, mask_kind, thresholds, monkeypatch):
    """NaN / inf in keys and values no query may attend, and in queries that attend nothing:
    same output as with clean padding, finite everywhere, zero gradients there."""
    q, k, v, g = _inputs((3, 2), 6, 8, seed=2)
    mask = build_mask(q.shape[:-2], 6, 8, q.device, **MASKS[mask_kind]((3, 2), 6, 8, g))
    padded = mask.padded_keys().unsqueeze(-1)
    idle = mask.idle_queries().unsqueeze(-1).expand_as(q)
    dirty = [
        torch.where(idle, float("nan"), q),
        torch.where(padded, float("nan"), k),
        torch.where(padded, float("inf"), v),
    ]
    qd, kd, vd = (t.clone().requires_grad_(True) for t in dirty)
    out = run(route, qd, kd, vd, mask, 0.5, thresholds, monkeypatch)
    torch.testing.assert_close(out, reference(q, k, v, mask, 0.5), atol=1e-10, rtol=1e-10)
    out.backward(torch.randn(out.shape, generator=g, dtype=out.dtype))
    wheres = (idle, padded.expand_as(k), padded.expand_as(v))
    for grad, where in zip((qd.grad, kd.grad, vd.grad), wheres, strict=True):
        assert torch.isfinite(grad).all()
        assert torch.all(grad[where] == 0)


@pytest.mark.parametrize("upstream", ["random", "a sum's"])
@pytest.mark.parametrize("value_size", [8, 6], ids=["dv=d", "dv!=d"])
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("mask_kind", ["lengths (B,)", "lengths (B, n)", "causal + lengths", "all"])
def test_gradients_match_the_reference(
    route, mask_kind, value_size, upstream, thresholds, monkeypatch
):
    """Gradients against the float64 reference, for a random upstream gradient and for a
    sum's (one value broadcast: strides 0, which the flash backward cannot read)."""
    q, k, v, g = _inputs((3, 2), 5, 7, dv=value_size, seed=3, heads_inner=True)
    mask = build_mask(q.shape[:-2], 5, 7, q.device, **MASKS[mask_kind]((3, 2), 5, 7, g))
    grad_out = torch.randn(3, 2, 5, value_size, generator=g, dtype=torch.float64)
    if upstream == "a sum's":
        grad_out = torch.tensor(1.5, dtype=torch.float64).expand(3, 2, 5, value_size)
    ours = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    theirs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    run(route, *ours, mask, 0.6, thresholds, monkeypatch).backward(grad_out)
    reference(*theirs, mask, 0.6).backward(grad_out)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("route", ["loop", "groups"])
@pytest.mark.parametrize("dropout", [False, True], ids=["one node", "through SDPA"])
@pytest.mark.parametrize("mask_kind", ["lengths (B,)", "lengths (B, n)", "causal + lengths"])
def test_loop_gradcheck(mask_kind, dropout, route, thresholds, monkeypatch):
    """Both forms of the loop and of the grouped path: one autograd node (no dropout) and
    SDPA's autograd (taken with dropout; checked here with dv != d, which the flash op does
    not take either)."""
    if route == "loop":
        _always_loop(thresholds)
    else:
        _groups(thresholds, monkeypatch)
    q, k, v, g = _inputs((2, 2), 3, 4, d=2, dv=3 if dropout else 2, seed=4)
    mask = build_mask(q.shape[:-2], 3, 4, q.device, **MASKS[mask_kind]((2, 2), 3, 4, g))
    args = [t.requires_grad_(True) for t in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda a, b, c: K.dot_product_attention(a, b, c, mask, scale=0.7), args
    )


def test_an_example_with_nothing_to_attend_still_gives_zero_gradients(thresholds, monkeypatch):
    _always_loop(thresholds)
    q, k, v, _ = _inputs((2,), 3, 4)
    mask = build_mask(torch.Size([2]), 3, 4, q.device, valid_lens=torch.tensor([0, 0]))
    args = [t.requires_grad_(True) for t in (q, k, v)]
    out = K.dot_product_attention(*args, mask, scale=1.0)
    assert torch.all(out == 0)
    grads = torch.autograd.grad(out.sum(), args)
    assert all(torch.all(grad == 0) for grad in grads)


# ---- which route runs -------------------------------------------------------------------


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Record the masks and flags of every scaled_dot_product_attention call (after the
    dispatch's one-off probe of SDPA, so that no test depends on running after another)."""
    _sdpa.empty_rows_are_zero("cpu")
    calls = []
    original = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        calls.append({"mask": attn_mask, "causal": is_causal, "q": q.shape, "k": k.shape})
        return original(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
        )

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return calls


def test_nothing_to_skip_is_one_sdpa_call(sdpa_calls, thresholds):
    """No mask, causal masking alone and lengths that cut no key: one call of SDPA without
    a mask (above the small pass's size, which takes such calls too)."""
    thresholds(small_work=-1)
    q, k, v, _ = _inputs((4,), 16, 16)
    full = torch.full((4,), 16)
    for kwargs, causal in (({}, False), ({"causal": True}, True), ({"valid_lens": full}, False)):
        sdpa_calls.clear()
        mask = build_mask(torch.Size([4]), 16, 16, q.device, **kwargs)
        K.dot_product_attention(q, k, v, mask, scale=0.3)
        assert len(sdpa_calls) == 1, kwargs
        assert sdpa_calls[0]["mask"] is None and sdpa_calls[0]["causal"] is causal
        assert sdpa_calls[0]["q"] == (4, 1, 16, 8)  # the 4-D layout


@pytest.mark.parametrize("bad", [None, "q", "k", "v"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_small_calls_without_a_mask_take_the_pass_and_carry_nan(bad, dtype):
    """A small inference call without a mask runs the C pass (every row over every key),
    plans kept (second call) too; NaN anywhere gives the float64 formulation's NaN (the
    pass declines, the next candidate runs), a NaN query its own row's, below the 16 keys
    where SDPA's CPU kernel hides it."""
    B, n, m, d = 3, 4, 7, 8
    module = attnscore.DotProductAttention().eval()
    for _ in range(2):
        q, k, v, _ = _inputs((B,), n, m, d=d, dv=d, dtype=torch.float64)
        if bad is not None:
            {"q": q, "k": k, "v": v}[bad][1, 2, 3] = math.nan
        with torch.no_grad():
            out = module(q.to(dtype), k.to(dtype), v.to(dtype))
        want = torch.softmax(q @ k.mT / math.sqrt(d), -1) @ v
        assert torch.equal(out.isnan(), want.isnan())
        tol = dict(atol=TOL[dtype], rtol=TOL[dtype])
        torch.testing.assert_close(out.double().nan_to_num(), want.nan_to_num(), **tol)
    q, k, v, _ = _inputs((B,), n, m, d=d, dv=d, dtype=dtype)
    with torch.no_grad():
        assert attnscore.explain(module, q, k, v).chosen == ["c_small"]


@pytest.mark.parametrize("bad", [None, "q", "k", "v"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("n", "m"), [(4, 7), (5, 5), (6, 3)])
def test_small_calls_with_causal_masking_alone_take_the_pass_and_carry_nan(bad, dtype, n, m):
    """A small inference call with causal masking alone (query i over keys 0..i, fewer,
    as many and more queries than keys; 3-D and 4-D) runs the C pass, plans kept (second
    call) too: output and weights as float64's masked formulation; NaN gives that
    formulation's NaN (the pass declines, the next candidate runs): a NaN key or value row
    only in the rows that attend it (each query's sum over its own keys)."""
    d = 8
    module = attnscore.DotProductAttention().eval()
    allowed = torch.arange(m) <= torch.arange(n).unsqueeze(1)
    for lead in [(3,), (2, 3)] * 2:
        g = torch.Generator().manual_seed(len(lead))
        q, k, v = (torch.randn(*lead, s, d, generator=g, dtype=torch.float64) for s in (n, m, m))
        if bad is not None:
            {"q": q, "k": k, "v": v}[bad][..., 1, 2, 2] = math.nan
        with torch.no_grad():
            out = module(q.to(dtype), k.to(dtype), v.to(dtype), causal=True)
        scores = (q @ k.mT / math.sqrt(d)).masked_fill(~allowed, -math.inf)
        weights = torch.softmax(scores, -1)
        # each query's sum over the keys it attends only (0 x NaN is NaN)
        seen = [weights[..., i : i + 1, : i + 1] @ v[..., : i + 1, :] for i in range(n)]
        want = torch.cat(seen, dim=-2)
        assert torch.equal(out.isnan(), want.isnan())
        tol = dict(atol=TOL[dtype], rtol=TOL[dtype])
        torch.testing.assert_close(out.double().nan_to_num(), want.nan_to_num(), **tol)
        if bad is None:
            torch.testing.assert_close(module.attention_weights.double(), weights, **tol)
            with torch.no_grad():
                ran = attnscore.explain(module, q.to(dtype), k.to(dtype), v.to(dtype), causal=True)
            assert ran.chosen == ["c_small"]


def test_causal_with_fewer_queries_never_reads_unseen_keys(sdpa_calls, thresholds):
    """Keys after the last query's are cut off before SDPA; the small pass (first) never
    reads them either."""
    q, k, v, _ = _inputs((2,), 3, 9)
    k[:, 3:], v[:, 3:] = float("nan"), float("nan")
    mask = build_mask(torch.Size([2]), 3, 9, q.device, causal=True)
    assert torch.isfinite(K.dot_product_attention(q, k, v, mask, scale=0.3)).all()
    assert sdpa_calls == []  # (the small pass ran it)
    thresholds(small_work=-1)
    out = K.dot_product_attention(q, k, v, mask, scale=0.3)
    assert torch.isfinite(out).all() and sdpa_calls[0]["k"][-2] == 3


class _FlashCalls(TorchDispatchMode):
    """Inside the block, ``calls`` gets ("forward" or "backward", *what(q, k, attn_mask))
    for each call of PyTorch's CPU flash-attention op, as ATen sees it."""

    def __init__(self, what):
        super().__init__()
        self.what, self.calls = what, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
            self.calls.append(("forward", *self.what(args[0], args[1], kwargs.get("attn_mask"))))
        elif packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
            self.calls.append(("backward", *self.what(args[1], args[2], kwargs.get("attn_mask"))))
        return func(*args, **kwargs)


def test_lengths_run_one_flash_call_per_example_on_cut_keys(thresholds, monkeypatch):
    """One flash call per example with all its heads, keys cut to its length; no mask
    inside the cut for per-example lengths; the backward likewise."""
    _always_loop(thresholds)
    q, k, v, _ = _inputs((3, 4), 6, 10)
    mask = build_mask(q.shape[:-2], 6, 10, q.device, valid_lens=torch.tensor([2, 10, 7]))
    q.requires_grad_(True)
    with _FlashCalls(lambda q, k, mask: (tuple(k.shape), mask, q.shape[2])) as recorder:
        K.dot_product_attention(q, k, v, mask, scale=0.3).sum().backward()
    calls = recorder.calls
    for step in ("forward", "backward"):
        made = sorted((c[1], c[3]) for c in calls if c[0] == step)
        assert made == sorted(((1, 4, L, 8), 6) for L in (2, 10, 7))  # every query, once
    assert all(c[2] is None for c in calls)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_small_inference_is_one_c_pass_and_training_no_sdpa_call(sdpa_calls, dtype):
    """A small call without gradients runs in one C pass (no SDPA, padding never read: NaN
    there changes nothing); with gradients, float64 takes one SDPA call with the mask and
    float32 the C kernel by lengths (no SDPA call)."""
    q, k, v, _ = _inputs((8,), 3, 20, dtype=dtype)
    lengths = torch.tensor([0, 1, 2, 5, 9, 12, 19, 20])
    mask = build_mask(torch.Size([8]), 3, 20, q.device, valid_lens=lengths)
    padded = (torch.arange(20) >= lengths[:, None]).unsqueeze(-1)
    k_dirty, v_dirty = k.masked_fill(padded, float("nan")), v.masked_fill(padded, float("inf"))
    out = K.dot_product_attention(q, k_dirty, v_dirty, mask, scale=0.3)
    assert sdpa_calls == []
    torch.testing.assert_close(
        out.double(), reference(q, k, v, mask, 0.3), atol=TOL[dtype], rtol=TOL[dtype]
    )
    K.dot_product_attention(q.requires_grad_(True), k, v, mask, scale=0.3)
    if dtype == torch.float64:
        assert len(sdpa_calls) == 1 and sdpa_calls[0]["mask"] is not None
    else:
        assert sdpa_calls == []


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_small_call_with_non_finite_values_where_attended_gives_the_plain_maths(sdpa_calls, value):
    """Where an attended key or value is not finite, the C pass hands the call to the
    general path, which gives the plain maths' result (NaN / inf exactly where the terms
    of the attending queries put them): SDPA's first result, not finite, is dropped, with
    and without gradients."""
    q, k, v, _ = _inputs((2,), 3, 5)
    mask = build_mask(torch.Size([2]), 3, 5, q.device, valid_lens=torch.tensor([4, 5]))
    allowed = torch.arange(5) < torch.tensor([4, 5]).view(2, 1, 1)
    for key, val in ((k.clone(), v), (k, v.clone())):
        (key if key is not k else val)[1, 2, 0] = value
        scores = (q.double() @ key.double().mT * 0.5).masked_fill(~allowed, float("-inf"))
        # the product is the plain one: what is not finite is attended (masked: finite)
        expected = torch.softmax(scores, -1) @ val.double()
        for grad in (True, False):
            sdpa_calls.clear()
            with torch.set_grad_enabled(grad):
                out = K.dot_product_attention(q.requires_grad_(grad), key, val, mask, scale=0.5)
            torch.testing.assert_close(out.detach().double(), expected, equal_nan=True)


def test_training_with_fewer_heads_than_threads_groups_examples_by_length(thresholds, monkeypatch):
    """Where the loop's backward would need threads whose start its work does not repay,
    training makes one flash call (forward and backward) per group of ceil(threads / H)
    examples of similar length, on keys cut to the group's longest, with the mask inside;
    inference keeps the loop (one call per example)."""
    thresholds(call_work=0, small_work=-1)  # cutting pays; the threads do not
    recorder = _FlashCalls(lambda q, k, mask: (q.shape[0], k.shape[2], mask is not None))
    calls = recorder.calls
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with recorder:
            q, k, v, _ = _inputs((3, 1), 6, 10)
            mask = build_mask(q.shape[:-2], 6, 10, q.device, valid_lens=torch.tensor([2, 10, 7]))
            K.dot_product_attention(q, k, v, mask, scale=0.3)
            assert sorted(c[1:3] for c in calls) == [(1, 2), (1, 7), (1, 10)]  # inference: loop
            calls.clear()
            q.requires_grad_(True)
            out = K.dot_product_attention(q, k, v, mask, scale=0.3)
            grad_out = torch.randn_like(out)
            out.backward(grad_out)
            # groups of 2 by length: examples (0, 2) on 7 keys, then example 1 on all 10
            groups = [(2, 7, True), (1, 10, True)]
            assert calls == [("forward", *g) for g in groups] + [("backward", *g) for g in groups]
            theirs = q.detach().clone().requires_grad_(True)
            reference(theirs, k, v, mask, 0.3).backward(grad_out)
            torch.testing.assert_close(q.grad, theirs.grad, atol=1e-10, rtol=1e-10)
    finally:
        torch.set_num_threads(old)


def test_empty_rows_probe_on_this_torch():
    """The CPU loop relies on SDPA giving zero rows for fully masked queries (torch >= 2.5);
    where it does not, every lengths call takes the masked route, which fixes rows itself."""
    probe = _sdpa.empty_rows_are_zero("cpu")
    assert isinstance(probe, bool)
    assert _sdpa.empty_rows_are_zero("cuda") is False


def test_loop_backward_leaves_no_thread_behind(thresholds, monkeypatch):
    """With fewer heads than threads the loop's backward runs examples on threads of its
    own; they end with it. (A live thread that has run a PyTorch op slows every later small
    op of the main thread, about 35 us each: measured with ``attnscore bench``.)"""
    import threading

    _always_loop(thresholds)  # the loop, threads in its backward, at a small shape
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        before = {t.ident for t in threading.enumerate()}
        q, k, v, g = _inputs((4, 1), 6, 9, dtype=torch.float32)
        mask = build_mask(q.shape[:-2], 6, 9, q.device, **MASKS["lengths (B,)"]((4, 1), 6, 9, g))
        args = [t.requires_grad_(True) for t in (q, k, v)]
        K.dot_product_attention(*args, mask, scale=0.5).sum().backward()
        assert all(t.grad is not None for t in args)
        left = [t.name for t in threading.enumerate() if t.ident not in before]
    finally:
        torch.set_num_threads(old)
    assert left == []


# ---- small module calls: one backend step from the caller's arguments --------------------


def _returns(wanted):
    """Whether the CPU backend's small path ``wanted`` took each call (returned a result),
    while the body of the fixture that yields it runs: True, False, or for lengths that cut
    no key what it returned then (``"nothing cut"``)."""
    results: list[bool | str] = []

    def seen(name, _args, out):
        if name == wanted:
            results.append(out if isinstance(out, str) else out is not None)

    with observed_cpu(seen):
        yield results


@pytest.fixture
def lane():
    """What the CPU backend's small-call dot-product attention returned, call by call."""
    yield from _returns("small_dot_product_attention")


@pytest.fixture
def lane_additive():
    """What the CPU backend's small-call additive attention returned, call by call."""
    yield from _returns("small_additive_attention")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("layout", ["3-D", "4-D heads", "heads inner"])
@pytest.mark.parametrize("lengths_shape", ["(B,)", "per row"])
def test_small_module_calls_run_whole_from_the_arguments(lane, dtype, layout, lengths_shape):
    """DotProductAttention in inference, small, by key lengths alone: one C pass from the
    tensors as given (strided heads too), lengths (B,) or one per row, NaN in the padding
    changing nothing, lengths above m meaning m; the weights, asked for afterwards, are
    the reference's."""
    import attnscore

    q, k, v, g = _inputs(**LAYOUTS[layout], n=4, m=6, dtype=dtype)
    batch = q.shape[:-2]
    if lengths_shape == "(B,)":
        lens = torch.tensor([0, 3, 9])
    else:
        lens = torch.randint(0, 8, (*batch, 4), generator=g)
    mask = build_mask(batch, 4, 6, q.device, valid_lens=lens)
    padded = torch.arange(6) >= mask.lengths.amax(-1)[..., None]  # keys no query attends
    k_dirty = k.masked_fill(padded[..., None], float("nan"))
    module = attnscore.DotProductAttention(dropout=0.3).eval()
    out = module(q, k_dirty, v, lens)
    assert lane == [True]
    scale = 1 / math.sqrt(q.shape[-1])
    tol = dict(atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out.double(), reference(q, k, v, mask, scale), **tol)
    allowed = mask.dense().expand(*batch, 4, 6)
    scores = (q.double() @ k.double().mT * scale).masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, -1).nan_to_num(0.0)
    torch.testing.assert_close(module.attention_weights.double(), weights, **tol)


def test_small_module_calls_decline_what_they_do_not_take(lane):
    """Dropout in training, lengths that cut nothing, strided lengths, a mask option, int32
    lengths, gradients: the general path (the reference's results); bfloat16 is taken
    whole too, by the kernel by lengths. Mixed dtypes, lengths of a wrong shape, negative
    lengths: the general path's errors."""
    import attnscore

    q, k, v, _ = _inputs((3,), 4, 6)
    lens = torch.tensor([1, 3, 6])
    module = attnscore.DotProductAttention(dropout=0.5)
    mask = build_mask(torch.Size([3]), 4, 6, q.device, valid_lens=lens)
    expected = reference(q, k, v, mask, 1 / math.sqrt(8))
    with torch.no_grad():
        module.train()(q, k, v, lens)  # dropout in training: declined before the backend
    module.eval()
    full = reference(q, k, v, build_mask(torch.Size([3]), 4, 6, q.device), 1 / math.sqrt(8))
    torch.testing.assert_close(module(q, k, v, torch.full((3,), 6)), full)  # nothing cut
    strided = lens.view(3, 1).expand(3, 4)
    torch.testing.assert_close(module(q, k, v, strided), expected)
    half = module(q.bfloat16(), k.bfloat16(), v.bfloat16(), lens).double()
    torch.testing.assert_close(half, expected, atol=4e-2, rtol=4e-2)
    assert lane == [True, False, True]  # (lengths that cut nothing: the pass, as no mask)
    torch.testing.assert_close(module(q, k, v, lens.int()), expected)  # never offered
    torch.testing.assert_close(module(q, k, v, lens, causal=False), expected)  # a mask option
    torch.testing.assert_close(module(q.requires_grad_(), k, v, lens).detach(), expected)
    assert lane == [True, False, True]
    q = q.detach()
    with pytest.raises(TypeError, match="Expected `keys` to have the dtype of `queries`"):
        module(q.float(), k, v, lens)
    with pytest.raises(ValueError, match=r"Expected `valid_lens` of shape \(3,\) or \(3, 4\)"):
        module(q, k, v, lens[:2])
    with pytest.raises(ValueError, match="Expected `valid_lens` to be non-negative, but got -1"):
        module(q, k, v, torch.tensor([1, -1, 2]))
    assert lane == [True, False, True, False, False, False]


def test_small_multi_head_inference_takes_the_one_step(lane):
    """MultiHeadAttention's heads (strided views of its projections) take the one step in
    inference (no_grad); the output matches the same module with kernels disabled."""
    import attnscore

    torch.manual_seed(0)
    mha = attnscore.MultiHeadAttention(16, 2).eval()
    x = torch.randn(2, 4, 16)
    lens = torch.tensor([2, 3])
    with torch.no_grad():
        out = mha(x, x, x, lens)
        assert lane == [True]
        with K.disabled():
            torch.testing.assert_close(out, mha(x, x, x, lens))


def _scores64(name, module, q, k):
    """float64 scores of the general and cosine scorers, from their formulas."""
    q, k = q.double(), k.double()
    if name == "general":
        return q @ module.W_a.weight.detach().double() @ k.mT
    s = module.log_scale.detach().double().exp()
    return s * (q / q.norm(dim=-1, keepdim=True)) @ (k / k.norm(dim=-1, keepdim=True)).mT


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("name", ["general", "cosine"])
def test_small_general_and_cosine_calls_run_whole(lane, name, dtype):
    """General and cosine attention are dot products of projected vectors: small inference
    calls run in the same C pass, padding (NaN here) never read; output and weights are
    the float64 formulas'. With gradients for the parameters they are not offered."""
    import attnscore

    torch.manual_seed(0)
    module = attnscore.make_scorer(name, 8, 6 if name == "general" else 8).to(dtype).eval()
    q, _, v, g = _inputs((3,), 4, 6, dtype=dtype)
    k = torch.randn(3, 6, 6 if name == "general" else 8, generator=g).to(dtype)
    lens = torch.tensor([0, 2, 5])
    padded = (torch.arange(6) >= lens[:, None])[..., None]
    with torch.no_grad():
        out = module(q, k.masked_fill(padded, float("nan")), v, lens)
    assert lane == [True]
    scores = _scores64(name, module, q, k).masked_fill(padded.mT, float("-inf"))
    weights = torch.softmax(scores, -1).nan_to_num(0.0)
    tol = dict(atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out.double(), weights @ v.double(), **tol)
    torch.testing.assert_close(module.attention_weights.double(), weights, **tol)
    out = module(q, k, v, lens)  # gradients for the parameters: the general path
    assert lane == [True] and out.requires_grad


def test_a_lazy_general_matrix_is_made_by_the_general_path(lane):
    """Without key_size, W_a is made by the first call (general path); later calls may
    take the small one."""
    import attnscore

    module = attnscore.MultiplicativeAttention(query_size=8).eval()
    q, k, v, _ = _inputs((2,), 3, 5)
    with torch.no_grad():
        first = module(q.float(), k.float(), v.float(), torch.tensor([2, 4]))
        second = module(q.float(), k.float(), v.float(), torch.tensor([2, 4]))
    assert lane == [True] and first.shape == second.shape == (2, 3, 8)
    torch.testing.assert_close(first, second)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("form", ["plain", "bias", "normalize"])
@pytest.mark.parametrize("layout", ["3-D", "4-D heads"])
def test_small_additive_calls_run_whole(lane_additive, dtype, form, layout):
    """Additive attention's small inference calls: the projections, then one C pass over
    each row's valid keys (NaN padding never read); output and weights are the float64
    textbook formula's, for Bahdanau's bias and the weight-normalised w_v too."""
    import attnscore

    torch.manual_seed(0)
    module = attnscore.AdditiveAttention(
        5, 7, 6, bias=form == "bias", normalize=form == "normalize"
    )
    module = module.to(dtype).eval()
    with torch.no_grad():  # a bias and a gain that are not their initial values
        for p in (module.b, module.g):
            if p is not None:
                p.add_(0.3)
    batch = LAYOUTS[layout]["batch"]
    g = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(*batch, s, c, generator=g).to(dtype) for s, c in ((3, 7), (6, 5), (6, 4))
    )
    lens = torch.tensor([0, 2, 5])
    padded = (torch.arange(6) >= lens.view(-1, *(1,) * len(batch)))[..., None]
    with torch.no_grad():
        out = module(q, k.masked_fill(padded, float("nan")), v, lens)
    assert lane_additive == [True]
    W_q, W_k = module.W_q.weight.detach().double(), module.W_k.weight.detach().double()
    w = module.w_v.weight.detach().double().reshape(-1)
    if module.g is not None:
        w = module.g.detach().double() * w / w.norm()
    qh = q.double() @ W_q.T + (0 if module.b is None else module.b.detach().double())
    feats = torch.tanh(qh.unsqueeze(-2) + (k.double() @ W_k.T).unsqueeze(-3))  # (.., n, m, h)
    scores = (feats @ w).masked_fill(padded.mT, float("-inf"))
    weights = torch.softmax(scores, -1).nan_to_num(0.0)
    tol = dict(atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out.double(), weights @ v.double(), **tol)
    torch.testing.assert_close(module.attention_weights.double(), weights, **tol)
    module(q, k, v, lens).sum().backward()  # gradients for the parameters: general path
    assert lane_additive == [True] and module.W_q.weight.grad is not None


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("lengths_kind", ["(B,)", "(B, n)"])
def test_the_route_for_sdpa_without_zero_rows(training, lengths_kind, monkeypatch, thresholds):
    """The route CUDA calls take (SDPA gives no zeros for a row with no key there: rows
    with no key attend key 0 in training, and are zeroed after), run here on the CPU with
    SDPA alone: NaN in padded keys and values and in queries that attend nothing changes
    nothing, rows with no key are zeros, and in training every gradient is float64's of the
    clean inputs (zeros for the padding)."""
    monkeypatch.setattr(_sdpa, "empty_rows_are_zero", lambda device_type: False)
    thresholds(small_work=-1)
    q, k, v, g = _inputs((3,), 5, 7, dtype=torch.float32)
    valid = (
        torch.tensor([0, 4, 7])
        if lengths_kind == "(B,)"
        else torch.tensor([[0, 1, 2, 0, 3], [4, 4, 0, 1, 2], [7, 7, 7, 7, 7]])
    )
    mask = build_mask(torch.Size([3]), 5, 7, q.device, valid_lens=valid)
    idle, padded = mask.idle_queries().unsqueeze(-1), mask.padded_keys().unsqueeze(-1)
    assert bool(idle.any()) and bool(padded.any())
    dirty = [q.masked_fill(idle, float("nan")), k.masked_fill(padded, float("nan"))]
    dirty.append(v.masked_fill(padded, float("inf")))
    args = [t.clone().requires_grad_(training) for t in dirty]
    with torch.set_grad_enabled(training), K.use("sdpa"):
        out = K.dot_product_attention(*args, mask, scale=0.3)
    expected = reference(q, k, v, mask, 0.3)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=2e-6)
    assert torch.all(out[idle.squeeze(-1)] == 0)
    if not training:
        return
    grad = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad((out * grad).sum(), args)
    clean = [t.double().requires_grad_(True) for t in (q, k, v)]
    want = torch.autograd.grad((reference(*clean, mask, 0.3) * grad.double()).sum(), clean)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5)


def test_a_call_like_an_earlier_one_keeps_its_choice_until_what_decided_changes(
    sdpa_calls, thresholds
):
    """Calls with nothing padded keep, per signature (sizes, strides, dtype, scale,
    dropout, gradients, threads), the implementation chosen for the first such call and its
    runner; later ones skip the selection. Setting a threshold, the tune file or the
    benchmark mode forgets every kept choice; explained calls take the selection (and
    record it). Every output is the float64 reference's."""
    from attnscore._thresholds import NEVER

    q, k, v, _ = _inputs((2, 4), 64, 64, dtype=torch.float32)
    want = reference(q, k, v, build_mask(torch.Size([2, 4]), 64, 64, q.device), 0.5)
    dot = attnscore.DotProductAttention(scale=0.5)

    def run(times: int) -> int:
        sdpa_calls.clear()
        for _ in range(times):
            out = dot(q, k, v)
            torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
        return len(sdpa_calls)

    thresholds(small_work=-1, by_lengths_work=0, unpadded_inference=0)
    assert run(3) == 0  # the kernel, chosen once
    thresholds(unpadded_inference=NEVER)
    assert run(3) == 3  # SDPA from the first call on
    assert attnscore.explain(dot, q, k, v).chosen == ["sdpa"]
    with attnscore.kernels.tuned("no-such-file.json"):
        assert run(2) == 2
    thresholds(unpadded_inference=0)
    assert run(2) == 0
    with attnscore.kernels.use("sdpa"):
        assert run(2) == 2
    assert run(2) == 0
    with attnscore.kernels.disabled():  # the C kernels off: SDPA
        assert run(2) == 2
    assert run(1) == 0
    k_t = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # other strides, same values
    sdpa_calls.clear()
    torch.testing.assert_close(dot(q, k_t, v).double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("bad", [None, "q", "k", "v"])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize(
    ("scoring", "dtype", "lengths"),
    [
        ("scaled_dot", torch.float32, "(B,)"),  # the small lane's
        ("scaled_dot", torch.float32, "(B, n) above m"),
        ("scaled_dot", torch.bfloat16, "(B,)"),  # the checked path's
        ("general", torch.float32, "(B,)"),
        ("cosine", torch.float32, "(B, n) above m"),
    ],
)
def test_lengths_that_cut_no_key_run_as_no_mask(scoring, dtype, lengths, grad, bad):
    """Key lengths of m or more (a batch with no padding) are no mask: the call runs as one
    with nothing padded (``explain``: the small pass or the unpadded lane, or the checked
    path's call as "none"), its output, gradients and weights the float64 formulation's
    without a mask, NaN in any input reaching the outputs and weights it reaches there."""
    B, H, n, m, d = 2, 3, 5, 7, 8
    g = torch.Generator().manual_seed(4)
    clean = [torch.randn(B, H, s, d, generator=g, dtype=torch.float64) for s in (n, m, m)]
    if bad is not None:
        clean["qkv".index(bad)][1, 2, 3, 4] = math.nan
    module = attnscore.make_scorer(scoring, query_size=d, key_size=d).eval()
    module = module.to(dtype)
    valid_lens = torch.full((B,), m) if lengths == "(B,)" else torch.full((B, n), m + 3)
    inputs = [t.to(dtype).requires_grad_(grad) for t in clean]
    with torch.set_grad_enabled(grad):
        out = module(*inputs, valid_lens)
        choice = attnscore.explain(module, *inputs, valid_lens).choices[0]
    ran_unmasked = choice.route in ("small lane", "unpadded lane")  # (the small pass: m each)
    assert ran_unmasked or "none (lengths that cut no key)" in choice.call
    ref = [t.detach().clone().requires_grad_(grad) for t in clean]
    qr, kr = ref[0], ref[1]
    if scoring == "general":
        qr = qr @ module.W_a.weight.detach().double()
    elif scoring == "cosine":
        scale = module.log_scale.detach().double().exp()
        qr, kr = scale * F.normalize(qr, dim=-1), F.normalize(kr, dim=-1)
    scale = 1 / math.sqrt(d) if scoring == "scaled_dot" else 1.0
    weights = torch.softmax(qr @ kr.mT * scale, -1)
    want = weights @ ref[2]
    tol = dict(atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(out.isnan(), want.isnan())
    torch.testing.assert_close(out.double().nan_to_num(), want.nan_to_num(), **tol)
    got_weights = module.attention_weights.double()
    assert torch.equal(got_weights.isnan(), weights.isnan())
    torch.testing.assert_close(got_weights.nan_to_num(), weights.detach().nan_to_num(), **tol)
    if grad:
        upstream = torch.randn(out.shape, generator=g, dtype=torch.float64)
        got = torch.autograd.grad(out, inputs, upstream.to(dtype))
        expected = torch.autograd.grad(want, ref, upstream)
        for a, b in zip(got, expected, strict=True):
            # With NaN in the inputs, gradients hold NaN only where the formulation's do
            # (docs/masks.md: a NaN output's gradient is the route's own: the scorers'
            # pipeline passes none back through it, the formulation's products do).
            assert not (a.isnan() & ~b.isnan()).any()
            if bad is None:
                torch.testing.assert_close(a.double(), b, **tol)


def test_projected_calls_keep_their_choice_with_their_own_projections(thresholds):
    """General and cosine attention with nothing padded keep, per signature, what took
    their first call (the kernel, run with each call's own projections, or their pipeline,
    which gives the weights too): every later call is the float64 reference's, the module's
    weights included, causal masking on the checked path."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 64, 32) for _ in range(3))
    general = attnscore.MultiplicativeAttention(32, 32)
    W = general.W_a.weight.detach().double()

    def want(causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        scores = q.double() @ W @ k.double().mT
        if causal:
            scores = scores.masked_fill(~torch.ones(64, 64, dtype=torch.bool).tril(), -math.inf)
        weights = torch.softmax(scores, -1)
        return weights @ v.double(), weights

    thresholds(small_work=-1, by_lengths_work=0, unpadded_inference=0)
    for grad in (True, False, True, False):  # the pipeline, the kernel (inference), again
        with torch.set_grad_enabled(grad):
            for causal in (False, True, False):
                out = general(q, k, v, causal=causal)
                out_ref, weights_ref = want(causal)
                torch.testing.assert_close(out.double(), out_ref, atol=2e-5, rtol=2e-5)
                weights = general.attention_weights.double()
                torch.testing.assert_close(weights, weights_ref, atol=2e-6, rtol=2e-5)
        with torch.no_grad():
            general.W_a.weight.mul_(0.5)  # in place: the choice stays, the projection follows
            W = general.W_a.weight.detach().double()


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_calls_by_lengths_keep_their_choice_whatever_the_lengths(grad, thresholds):
    """The lengths lane keeps its choice per signature and whether the lengths cut a key;
    each later call runs on its own lengths (output and gradients the float64 reference's,
    lengths that change, lengths that cut nothing, a query with none)."""
    thresholds(small_work=-1, by_lengths_work=0)
    dot = attnscore.DotProductAttention(scale=0.5)
    q, k, v, _ = _inputs((3, 2), 16, 24, dtype=torch.float32)
    q, k, v = (t.requires_grad_(grad) for t in (q, k, v))
    for lens in ([5, 24, 9], [1, 2, 3], [24, 24, 24], [0, 7, 24], [20, 3, 11]):
        valid_lens = torch.tensor(lens)
        with torch.set_grad_enabled(grad):
            out = dot(q, k, v, valid_lens)
        mask = build_mask(torch.Size([3, 2]), 16, 24, q.device, valid_lens=valid_lens)
        qd, kd, vd = (t.detach().double().requires_grad_(grad) for t in (q, k, v))
        want = reference(qd, kd, vd, mask, 0.5)
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5, msg=str(lens))
        if grad:
            g = torch.randn(want.shape, dtype=torch.float64)
            got = torch.autograd.grad(out, (q, k, v), g.float())
            expected = torch.autograd.grad(want, (qd, kd, vd), g)
            for a, b in zip(got, expected, strict=True):
                torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5, msg=str(lens))


@pytest.mark.parametrize("m", [40, 7], ids=["40 keys", "7 keys"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_the_result_check_reads_the_queries_only_where_sdpa_may_hide_a_nan_one(
    dtype, m, monkeypatch
):
    """Where the probe finds that SDPA gives a NaN row for a NaN query (off the CPU it says
    no; on it, below one vector of keys PyTorch's kernel gives zeros), the result check of
    a call SDPA ran reads its output alone (and nothing without a mask), else the queries
    too; a NaN query reaches exactly its own row either way (no mask, a boolean mask,
    causal masking)."""
    from attnscore.kernels import _cpu

    assert _sdpa.nan_queries_show("cuda", dtype, m) is False
    shows = _sdpa.nan_queries_show("cpu", dtype, m)
    read: list[torch.Tensor] = []
    scan = _cpu.all_finite
    monkeypatch.setattr(_cpu, "all_finite", lambda tensors: read.extend(tensors) or scan(tensors))
    q, k, v, _ = _inputs((2, 3), 24, m, dtype=dtype)
    attend = torch.rand(24, m, generator=torch.Generator().manual_seed(1)) > 0.3
    attend[:, 0] = True
    for masks in ({}, {"attend_mask": attend}, {"causal": True}):
        mask = build_mask(torch.Size([2, 3]), 24, m, q.device, **masks)
        read.clear()
        with K.use("sdpa", "plain", ordered=True):
            K.dot_product_attention(q, k, v, mask, scale=0.3)
        queries_read = any(t.data_ptr() == q.data_ptr() for t in read)
        if shows and not masks:  # nothing masked: exact by construction, nothing to look at
            assert not read
        else:
            assert read and queries_read is not shows, masks
        dirty = q.clone()
        dirty[1, 2, 5, 0] = float("nan")
        with K.use("sdpa", "plain", ordered=True):
            out = K.dot_product_attention(dirty, k, v, mask, scale=0.3)
        nan = torch.zeros(out.shape, dtype=torch.bool)
        nan[1, 2, 5] = True
        assert torch.equal(out.isnan(), nan), masks
