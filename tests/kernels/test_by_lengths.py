"""The CPU's C kernel of dot-product attention by lengths (``flash_lengths`` and its
backward, :mod:`attnscore.kernels._cpu`): every mask that lengths express, layouts, dtypes,
tiles and chunks, threads, garbage in what it never reads, its logsumexps, training through
it, no mask at all (every length m), and where it runs. References: the float64 row-by-row
formulation of test_dot_dispatch."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import torch.nn.functional as F
from test_dot_dispatch import MASKS, TOL, _inputs, reference

import attnscore
from attnscore import kernels as K
from attnscore._mask import compact
from attnscore.kernels import _attention, _cpu
from attnscore.masking import build_mask

pytestmark = pytest.mark.skipif(
    _cpu.load_library() is None, reason="C kernels unavailable (disabled, or no compiler)"
)

KERNEL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LAYOUTS = {
    "3-D": dict(batch=(3,)),
    "4-D heads": dict(batch=(3, 2)),
    "heads inner": dict(batch=(3, 2), heads_inner=True),
}


KERNEL = "c_by_lengths"


@pytest.fixture
def kernel_calls(thresholds):
    """The kernel at every size (no small-call pass first, causal masking at any work);
    the implementations chosen in the test, in order (:func:`attnscore.kernels.explaining`)."""
    thresholds(small_work=-1, unpadded_work=0, unpadded_inference=0)
    with K.explaining() as seen:
        yield seen.choices


def _ran(choices):
    """Whether the kernel ran some call of ``choices`` (and forget them)."""
    ran = any(c.chosen == KERNEL for c in choices)
    choices.clear()
    return ran


def _case(layout, n, m, dtype, mask_kind, *, d=24, dv=40, seed=0):
    spec = LAYOUTS[layout]
    q, k, v, g = _inputs(spec["batch"], n, m, d, dv, seed=seed, heads_inner="heads_inner" in spec)
    batch = tuple(q.shape[:-2])
    kwargs = MASKS[mask_kind](batch, n, m, g)
    if mask_kind == "lengths per head" and len(batch) == 1:
        kwargs = MASKS["lengths (B, n)"](batch, n, m, g)
    mask = build_mask(torch.Size(batch), n, m, q.device, **kwargs)
    return [t.to(dtype) for t in (q, k, v)], mask, g


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize(
    "mask_kind",
    [
        "lengths (B,)",
        "lengths (B, n)",
        "lengths per head",
        "causal",
        "causal + lengths",
        "causal + lengths (B, n)",
        "query lengths",
        "all",
    ],
)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(21, 37), (37, 21), (5, 37)], ids=["n<m", "n>m", "n<8"])
def test_inference_matches_the_reference(dtype, mask_kind, layout, shape, kernel_calls):
    """Tiles of 8 queries with a partial last one, 2 panels of keys with a partial last,
    d = 24 and dv = 40 (padded inside to 32 and 64), and fewer queries than a tile (taken
    row by row): the kernel runs and matches float64."""
    n, m = shape
    (q, k, v), mask, _ = _case(layout, n, m, dtype, mask_kind)
    with torch.no_grad():
        out = K.dot_product_attention(q, k, v, mask, scale=0.3)
    assert _ran(kernel_calls)
    assert out.dtype == dtype and out.shape == (*q.shape[:-1], 40)
    expected = reference(q, k, v, mask, 0.3)
    torch.testing.assert_close(out.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])
    idle = mask.idle_queries().expand(q.shape[:-1])
    assert torch.all(out[idle] == 0)


@pytest.mark.parametrize("python_threads", [False, True], ids=["C driver", "Python threads"])
@pytest.mark.parametrize("threads", [1, 3])
def test_chunks_of_sorted_queries_over_threads(
    threads, python_threads, kernel_calls, thresholds, monkeypatch
):
    """Few examples and heads: each (example, head) is cut into chunks of its sorted
    queries (here of 8), which the threads take one at a time as they finish one, on the C
    driver's OpenMP threads or on Python threads sharing the task counter; same result as
    the reference either way."""
    thresholds(by_lengths_chunk=8, min_work_per_thread=1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    (q, k, v), mask, _ = _case("3-D", 45, 50, torch.float32, "lengths (B, n)")
    threading = K.python_threads() if python_threads else contextlib.nullcontext()
    with torch.no_grad(), threading:
        out = K.dot_product_attention(q[:1], k[:1], v[:1], _first(mask), scale=0.3)
    assert _ran(kernel_calls)
    expected = reference(q[:1], k[:1], v[:1], _first(mask), 0.3)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def _first(mask):
    """The mask of the batch's first example."""
    return build_mask(
        torch.Size([1]), mask.n, mask.m, torch.device("cpu"), valid_lens=mask.lengths[:1]
    )


def test_what_it_never_reads_may_hold_anything(kernel_calls):
    """NaN in keys and values beyond each (example, head)'s longest length and in queries
    that attend nothing: the kernel reads none of them (nothing is zeroed first)."""
    (q, k, v), mask, _ = _case("4-D heads", 13, 40, torch.float32, "lengths per head")
    padded = mask.padded_keys().unsqueeze(-1)
    idle = mask.idle_queries().unsqueeze(-1)
    dirty = (q.masked_fill(idle, float("nan")), k.masked_fill(padded, float("nan")))
    with torch.no_grad():
        out = K.dot_product_attention(*dirty, v.masked_fill(padded, float("inf")), mask, scale=0.3)
    assert _ran(kernel_calls) and bool(padded.any()) and bool(idle.any())
    torch.testing.assert_close(out.double(), reference(q, k, v, mask, 0.3), atol=2e-5, rtol=2e-5)


def test_logsumexp_is_the_flash_ops(kernel_calls):
    """With ``logsumexp``, each row's log-sum-exp of its scaled scores over its own keys,
    float32, and 0 for rows of length 0 (what PyTorch's flash forward keeps)."""
    (q, k, v), mask, _ = _case("4-D heads", 19, 33, torch.float32, "lengths (B, n)", dv=24)
    lengths = compact(mask.lengths)  # (B, 1, n): the heads share them
    assert lengths.shape == (3, 1, 19)
    by = _cpu._ByLength.of(lengths, 19)
    _, lse = _cpu._by_lengths_forward(q, k, v, by, 0.3, logsumexp=True)
    scores = (q.double() @ k.double().mT) * 0.3
    allowed = mask.dense()
    expected = torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    expected = expected.masked_fill(~allowed.any(-1), 0.0)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:-1]
    torch.testing.assert_close(lse.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.fixture
def training_route(kernel_calls):
    """Training by lengths in the C kernel, forward and backward, at every size; the
    implementations chosen."""
    return kernel_calls


TRAINING_MASKS = [
    "lengths (B,)",
    "lengths (B, n)",
    "lengths per head",
    "causal",
    "causal + lengths",
    "causal + lengths (B, n)",
    "all",
]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("mask_kind", TRAINING_MASKS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(13, 17), (5, 37)], ids=["tiles", "n<8"])
def test_training_matches_the_reference(dtype, mask_kind, layout, shape, training_route):
    """Output and gradients of q, k and v against float64 (dv != d, partial tiles and
    panels), with garbage in what the kernel never reads (NaN in padded keys and idle
    queries, inf in padded values): finite, and zero gradients there."""
    n, m = shape
    (q, k, v), mask, g = _case(layout, n, m, dtype, mask_kind, d=16, dv=24, seed=3)
    padded = mask.padded_keys().unsqueeze(-1)
    idle = mask.idle_queries().unsqueeze(-1).expand(q.shape)
    dirty = [
        q.masked_fill(idle, float("nan")),
        k.masked_fill(padded, float("nan")),
        v.masked_fill(padded, float("inf")),
    ]
    ours = [t.detach().clone().requires_grad_(True) for t in dirty]
    theirs = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    out = K.dot_product_attention(*ours, mask, scale=0.25)
    expected = reference(*theirs, mask, 0.25)
    assert [c.chosen for c in training_route] == [KERNEL]
    grad = torch.randn(expected.shape, generator=g, dtype=torch.float64)
    out.backward(grad.to(dtype))
    expected.backward(grad)
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), expected.detach(), atol=tol, rtol=tol)
    wheres = (idle, padded.expand(k.shape), padded.expand(v.shape))
    for a, b, where in zip(ours, theirs, wheres, strict=True):
        assert torch.isfinite(a.grad).all() and torch.all(a.grad[where] == 0)
        torch.testing.assert_close(a.grad.double(), b.grad, atol=4 * tol, rtol=4 * tol)


@pytest.mark.parametrize("python_threads", [False, True], ids=["C driver", "Python threads"])
def test_training_over_threads(python_threads, training_route, thresholds, monkeypatch):
    """The backward's tasks, one per (example, head), shared by 3 threads (OpenMP or
    Python): gradients as the reference's."""
    thresholds(min_work_per_thread=1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    (q, k, v), mask, g = _case("4-D heads", 30, 41, torch.float32, "lengths (B, n)", seed=6)
    ours = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    theirs = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    grad = torch.randn(*q.shape[:-1], 40, generator=g, dtype=torch.float64)
    threading = K.python_threads() if python_threads else contextlib.nullcontext()
    with threading:
        K.dot_product_attention(*ours, mask, scale=0.3).backward(grad.float())
    reference(*theirs, mask, 0.3).backward(grad)
    assert [c.chosen for c in training_route] == [KERNEL]
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("python_threads", [False, True], ids=["C driver", "Python threads"])
def test_the_threads_order_of_tasks_changes_no_bit(
    python_threads, training_route, thresholds, monkeypatch
):
    """Threads sharing the tasks take the ones with the most work first (example lengths
    1 to 41 here: tasks of unequal work); each task's arithmetic is its own, so output and
    gradients are the same bits as one thread taking them in index order."""
    thresholds(min_work_per_thread=1)
    (q, k, v), mask, g = _case("4-D heads", 30, 41, torch.float32, "lengths (B,)", seed=7)
    grad = torch.randn(*q.shape[:-1], 40, generator=g)

    def run(threads: int) -> list[torch.Tensor]:
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        threading = K.python_threads() if python_threads else contextlib.nullcontext()
        with threading:
            out = K.dot_product_attention(*leaves, mask, scale=0.3)
            out.backward(grad)
        return [out.detach(), *(t.grad for t in leaves)]

    one, three = run(1), run(3)
    assert [c.chosen for c in training_route] == [KERNEL, KERNEL]
    assert len(set(mask.lengths.flatten().tolist())) > 1  # (tasks of unequal work)
    for a, b in zip(one, three, strict=True):
        assert torch.equal(a, b)


def test_where_it_runs(kernel_calls):
    """Lengths of every kind and causal alone, in inference and training: the kernel. Not:
    float64, more keys than ``_BY_LENGTHS_KEYS``, dropout."""
    (q, k, v), by_query, _ = _case("4-D heads", 16, 24, torch.float32, "lengths (B, n)")
    causal = build_mask(q.shape[:-2], 16, 24, q.device, causal=True)
    by_example = build_mask(q.shape[:-2], 16, 24, q.device, valid_lens=torch.tensor([3, 24, 9]))

    def runs(mask, q=q, k=k, v=v, **kwargs):
        K.dot_product_attention(q, k, v, mask, scale=0.3, **kwargs)
        return _ran(kernel_calls)

    for grad in (False, True):
        q.requires_grad_(grad)
        assert runs(by_query) and runs(causal) and runs(by_example)
        assert not runs(by_query, *(t.double() for t in (q, k, v)))
        assert not runs(by_query, dropout_p=0.5) and not runs(causal, dropout_p=0.5)
    with K.thresholds(by_lengths_keys=23):
        assert not runs(by_query) and not runs(causal)


def test_training_with_a_sums_gradient(training_route):
    """The upstream gradient of a sum (one value broadcast, no stride along rows or
    columns) read as it comes: gradients as the reference's."""
    (q, k, v), mask, _ = _case("heads inner", 11, 19, torch.float32, "causal + lengths", seed=8)
    ours = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    theirs = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    K.dot_product_attention(*ours, mask, scale=0.3).sum().backward()
    reference(*theirs, mask, 0.3).sum().backward()
    assert [c.chosen for c in training_route] == [KERNEL]
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-4, rtol=1e-4)


def _general_and_cosine_weights(name, module, q, k, mask):
    """float64: q W_a k^T (general) or s cos(q, k) (cosine), then the masked softmax."""
    q, k = q.double(), k.double()
    if name == "general":
        scores = q @ module.W_a.weight.double() @ k.mT
    else:
        s = module.log_scale.double().exp()
        scores = s * F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).mT
    allowed = mask.dense()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.nan_to_num(torch.softmax(scores, dim=-1))


def _general_and_cosine_reference(name, module, q, k, v, mask):
    """float64: :func:`_general_and_cosine_weights` @ V."""
    return _general_and_cosine_weights(name, module, q, k, mask) @ v.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask_kind", ["lengths (B, n)", "causal + lengths"])
@pytest.mark.parametrize("name", ["general", "cosine"])
def test_general_and_cosine_run_as_dot_products_of_their_projections(
    name, mask_kind, dtype, training_route
):
    """General (q W_a) and cosine (unit rows, s times the queries') by lengths run the
    kernel on their projections: output and gradients (inputs and parameters) as float64's,
    with NaN in padded keys and idle queries (zeroed before the projections' gradients read
    them)."""
    (q, k, v), mask, g = _case("3-D", 13, 17, torch.float32, mask_kind, d=16, dv=8, seed=9)
    module = attnscore.make_scorer(name, 16).to(dtype)
    padded = mask.padded_keys().unsqueeze(-1)
    idle = mask.idle_queries().unsqueeze(-1)
    ours = [
        q.masked_fill(idle, float("nan")).to(dtype).requires_grad_(True),
        k.masked_fill(padded, float("nan")).to(dtype).requires_grad_(True),
        v.to(dtype).requires_grad_(True),
    ]
    kwargs = {"causal": True} if mask_kind.startswith("causal") else {}
    out = module(*ours, mask.key_lengths[:, 0] if kwargs else mask.lengths, **kwargs)
    assert [c.chosen for c in training_route] == [KERNEL]
    theirs = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    reference_module = attnscore.make_scorer(name, 16).double()
    reference_module.load_state_dict(module.state_dict())
    expected = _general_and_cosine_reference(name, reference_module, *theirs, mask)
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    grad = torch.randn(expected.shape, generator=g, dtype=torch.float64)
    out.backward(grad.to(dtype))
    expected.backward(grad)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.isfinite(a.grad).all()
        torch.testing.assert_close(a.grad.double(), b.grad, atol=4 * tol, rtol=4 * tol)
    for p in module.parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all()


@pytest.mark.parametrize("name", ["general", "cosine"])
def test_general_and_cosine_keep_their_plain_path_elsewhere(name, kernel_calls, thresholds):
    """No mask at a size where the kernel did not measure faster than SDPA, a boolean mask,
    dropout, or the weights asked for: the plain pipeline (no kernel call)."""
    thresholds(unpadded_work=1 << 22, unpadded_inference=1 << 17)
    (q, k, v), mask, _ = _case("3-D", 13, 17, torch.float32, "lengths (B, n)", d=16, dv=8)
    module = attnscore.make_scorer(name, 16, dropout=0.5)
    lengths = mask.lengths
    with torch.no_grad():
        module.eval()
        module(q, k, v, lengths)
        assert _ran(kernel_calls)
        module(q, k, v)
        module(q, k, v, attend_mask=mask.dense())
        module(q, k, v, lengths, return_weights=True)
        module.train()
        module(q, k, v, lengths)
    assert not _ran(kernel_calls)


# ---- no mask: every length m -----------------------------------------------------------


@pytest.fixture
def unmasked_calls(kernel_calls):
    """The kernel without a mask at every size (where it measured faster is tested apart)."""
    return kernel_calls


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(21, 37), (37, 21)], ids=["n<m", "n>m"])
def test_no_mask_matches_the_reference(dtype, layout, shape, unmasked_calls):
    """No mask: the kernel with every length m, output and gradients of q, k and v as
    float64's (partial tiles and panels, dv != d)."""
    n, m = shape
    (q, k, v), mask, g = _case(layout, n, m, dtype, "none", d=16, dv=24, seed=4)
    assert mask.unmasked
    ours = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    theirs = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    with torch.no_grad():
        inference = K.dot_product_attention(q, k, v, mask, scale=0.25)
    out = K.dot_product_attention(*ours, mask, scale=0.25)
    assert [c.chosen for c in unmasked_calls] == [KERNEL] * 2
    expected = reference(*theirs, mask, 0.25)
    tol = TOL[dtype]
    for result in (inference, out):
        assert result.dtype == dtype
        torch.testing.assert_close(result.double(), expected.detach(), atol=tol, rtol=tol)
    grad = torch.randn(expected.shape, generator=g, dtype=torch.float64)
    out.backward(grad.to(dtype))
    expected.backward(grad)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=4 * tol, rtol=4 * tol)


def test_where_nothing_padded_runs_it(kernel_calls, thresholds, monkeypatch):
    """Without a mask or with causal masking alone, the kernel runs only where it measured
    faster than SDPA: float32 and bfloat16 in inference from ``_UNPADDED_INFERENCE`` on,
    in training from ``_UNPADDED_WORK`` on with an (example, head) per thread, either with
    a tile of queries and heads up to 128 (causal masking from ``_UNPADDED_WORK`` on at any
    shape); float16 from the small calls' size on; decoder steps (fewer than 8 queries,
    no mask, inference) from ``decode_work`` (float32) and ``decode_work_bf16`` on. Never
    with dropout, in float64, or with kernels disabled."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    thresholds(small_work=1 << 14, unpadded_work=1 << 22, unpadded_inference=1 << 17)
    thresholds(decode_work=1 << 18, decode_work_bf16=1 << 15)
    g = torch.Generator().manual_seed(5)

    def runs(B, H, n, m, d, dtype=torch.float32, grad=False, causal=False, **kwargs):
        q, k, v = (torch.randn(B, H, s, d, generator=g).to(dtype) for s in (n, m, m))
        mask = build_mask(torch.Size([B, H]), n, m, q.device, causal=causal)
        with torch.set_grad_enabled(grad):
            K.dot_product_attention(q.requires_grad_(grad), k, v, mask, scale=0.1, **kwargs)
        return _ran(kernel_calls)

    big = (2, 4, 64, 128, 32)  # B H n m d: 2^22 multiply-adds, the training threshold
    small = (2, 4, 64, 127, 32)  # just below
    mid = (1, 1, 32, 32, 64)  # 2^17, the inference threshold
    below = (1, 1, 32, 31, 64)
    for causal in (False, True):
        assert runs(*big, causal=causal) and runs(*big, dtype=torch.bfloat16, causal=causal)
        assert runs(*big, grad=True, causal=causal) and not runs(*small, grad=True, causal=causal)
        assert runs(*small, causal=causal) and runs(*mid, causal=causal)
        assert runs(*mid, dtype=torch.bfloat16, causal=causal) and not runs(*below, causal=causal)
        assert not runs(*big, causal=causal, dropout_p=0.5)
        assert not runs(*big, dtype=torch.float64, causal=causal)
        assert runs(1, 1, 4, 32, 64, dtype=torch.float16, causal=causal)  # 2^14 multiply-adds
        assert not runs(1, 1, 4, 31, 64, dtype=torch.float16, causal=causal)

    # general and cosine with causal masking (their plain pipeline skips nothing): any size
    def projected(q, k, v, causal):
        mask = build_mask(q.shape[:-2], q.shape[-2], k.shape[-2], q.device, causal=causal)
        _attention.projected(q, k, v, mask, project=lambda a, b: (a, b), scale=0.1)
        return _ran(kernel_calls)

    q, k, v = (torch.randn(2, 4, 64, 32) for _ in range(3))
    q.requires_grad_(True)  # training: 2^20 multiply-adds are below its threshold
    assert not runs(2, 4, 64, 64, 32, grad=True, causal=True)
    assert projected(q, k, v, causal=True) and not projected(q, k, v, causal=False)
    with torch.no_grad():  # without a mask in inference: from its threshold (bfloat16
        # where the build multiplies bfloat16 on AVX512-BF16, else never)
        assert projected(q, k, v, causal=False)
        bf16 = [t.bfloat16() for t in (q, k, v)]
        assert projected(*bf16, causal=False) == _cpu.bf16_dots()
    # bfloat16 training keeps the pipeline
    assert not projected(
        *(t.detach().bfloat16().requires_grad_(True) for t in (q, k, v)), causal=False
    )
    # decoder steps by their own thresholds: 2^18 multiply-adds, 2^15 in bfloat16
    assert runs(1, 8, 1, 256, 64) and not runs(1, 8, 1, 255, 64)
    assert runs(1, 4, 4, 16, 64, dtype=torch.bfloat16)
    assert not runs(1, 4, 4, 15, 64, dtype=torch.bfloat16)
    assert not runs(1, 8, 1, 256, 64, grad=True) and not runs(1, 8, 1, 256, 160)  # d > 128
    # else a tile of queries and heads up to 128, causal masking from the training threshold
    assert runs(4, 8, 4, 4096, 32, causal=True) and not runs(8, 1, 4, 1024, 32, causal=True)
    assert not runs(1, 2, 64, 128, 160) and runs(1, 2, 64, 128, 160, causal=True)  # d > 128
    assert runs(1, 2, 64, 128, 128) and not runs(1, 1, 128, 128, 128, grad=True)
    assert runs(1, 1, 128, 128, 128) and runs(1, 1, 128, 128, 128, grad=True, causal=True)
    with K.disabled():
        assert not runs(*big) and not runs(*big, causal=True)


@pytest.mark.parametrize("name", ["general", "cosine"])
def test_general_and_cosine_without_a_mask(name, unmasked_calls):
    """General and cosine attention without a mask, where the kernel runs: on their
    projections, output and gradients (inputs and parameters) as float64's."""
    (q, k, v), mask, g = _case("3-D", 13, 17, torch.float32, "none", d=16, dv=8, seed=2)
    module = attnscore.make_scorer(name, 16)
    ours = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = module(*ours)
    with torch.no_grad():
        inference = module(q, k, v)
    assert [c.chosen for c in unmasked_calls] == [KERNEL] * 2
    theirs = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    reference_module = attnscore.make_scorer(name, 16).double()
    reference_module.load_state_dict(module.state_dict())
    expected = _general_and_cosine_reference(name, reference_module, *theirs, mask)
    for result in (out, inference):
        torch.testing.assert_close(result.double(), expected.detach(), atol=2e-5, rtol=2e-5)
    grad = torch.randn(expected.shape, generator=g, dtype=torch.float64)
    out.backward(grad.float())
    expected.backward(grad)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-4, rtol=1e-4)
    parameters = dict(module.named_parameters())
    for pname, p in reference_module.named_parameters():
        torch.testing.assert_close(parameters[pname].grad.double(), p.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("first", ["general", "cosine"])
def test_a_kept_plan_runs_only_projections_of_its_layout(first, unmasked_calls):
    """Inference calls of one layout share a plan whatever their scorer, but not the layout
    of their projections: general's q W_a is contiguous, cosine's unit rows keep the
    queries' strides (here a transposed view). Whichever scorer made the plan, the other's
    calls run right (the lane compares the layouts and otherwise takes the selection),
    and a plan's runner serves later calls of its own scorer."""
    (q, k, v), mask, _ = _case("3-D", 16, 24, torch.float32, "none", d=16, dv=8, seed=8)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strides (., 1, n)
    order = [first, "cosine" if first == "general" else "general"]
    modules = {name: attnscore.make_scorer(name, 16).eval() for name in order}
    with torch.no_grad():
        for name in [*order, *order]:
            out = modules[name](q, k, v)
            reference = attnscore.make_scorer(name, 16).double()
            reference.load_state_dict(modules[name].state_dict())
            expected = _general_and_cosine_reference(name, reference, q.double(), k, v, mask)
            torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    assert _ran(unmasked_calls)


@pytest.mark.parametrize("name", ["general", "cosine"])
def test_general_and_cosine_without_a_mask_in_bfloat16(name, unmasked_calls):
    """Without a mask in bfloat16, general and cosine take the kernel in inference where the
    build multiplies bfloat16 on AVX512-BF16 (it measured faster than their pipeline of
    PyTorch's bfloat16 GEMMs), else keep the pipeline; in training always the pipeline;
    float32 takes the kernel either way. Output (and the kernel's weights) as float64's to
    bfloat16's rounding."""
    (q, k, v), mask, _ = _case("3-D", 16, 16, torch.float32, "none", d=8, dv=8, seed=4)
    doubled = [t.double() for t in (q, k, v)]
    module = attnscore.make_scorer(name, 8)
    reference = attnscore.make_scorer(name, 8).double()
    reference.load_state_dict(module.state_dict())
    with torch.no_grad():
        out = module.bfloat16()(q.bfloat16(), k.bfloat16(), v.bfloat16())
        assert _ran(unmasked_calls) == _cpu.bf16_dots()
        weights = module.attention_weights
        module.float()(q, k, v)
        assert _ran(unmasked_calls)
        expected = _general_and_cosine_reference(name, reference, *doubled, mask)
    tol = TOL[torch.bfloat16]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    assert weights.dtype == torch.bfloat16 and weights.shape == (*q.shape[:-1], 16)
    ones = torch.ones(q.shape[:-1], dtype=torch.float64)
    torch.testing.assert_close(weights.double().sum(-1), ones, atol=1e-2, rtol=0)
    trained = module.bfloat16()
    trained(*(t.bfloat16().requires_grad_(True) for t in (q, k, v))).sum().backward()
    assert not _ran(unmasked_calls)


# ---- inference by key lengths from the caller's tensors --------------------------------


def _record(monkeypatch, owner, name, mark):
    """A list that gets ``mark`` at each call of ``owner.<name>`` (which still runs): how a
    test sees that a call took the checked path (its checks, its padding zeroed)."""
    calls = []
    real = getattr(owner, name)

    def recording(*args, **kwargs):
        calls.append(mark)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    return calls


@pytest.fixture
def checked(caplog):
    """How many attentions the checked path has run so far in the test: its choices as the
    ``attnscore`` logger gives them at DEBUG (the route ``checked``; the lanes log theirs).
    A call the checked path refuses (its errors) runs none."""
    caplog.set_level(logging.DEBUG, logger="attnscore")

    def count():
        return sum(r.name == "attnscore" and "(checked)" in r.getMessage() for r in caplog.records)

    return count


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask_kind", ["lengths (B,)", "lengths per head"])
@pytest.mark.parametrize("name", ["scaled_dot", "general", "cosine"])
def test_inference_by_key_lengths_skips_the_layers(
    name, mask_kind, layout, dtype, kernel_calls, checked
):
    """Inference by key lengths alone above the small pass's size (here: every size) and
    in 16 bits: the kernel by lengths straight from the caller's tensors (strided heads
    too), no checks or mask built first; NaN in padded keys changes nothing; the output
    and the weights asked for afterwards are the call's: zero where masked, rows summing
    to 1."""
    (q, k, v), mask, _ = _case(layout, 13, 37, dtype, mask_kind, d=16, dv=24, seed=7)
    lens = mask.key_lengths.expand(q.shape[:-1]).contiguous()  # one per query row
    if mask_kind == "lengths (B,)":
        lens = lens.reshape(len(lens), -1)[:, 0].contiguous()
    k_dirty = k.masked_fill(mask.padded_keys().unsqueeze(-1), float("nan"))
    module = attnscore.make_scorer(name, 16).to(dtype).eval()
    with torch.no_grad():
        out = module(q, k_dirty, v, lens)
    assert _ran(kernel_calls) and checked() == 0
    reference_module = attnscore.make_scorer(name, 16).double()
    reference_module.load_state_dict(module.state_dict())
    if name == "scaled_dot":
        expected = reference(q, k, v, mask, 0.25)
    else:
        expected = _general_and_cosine_reference(name, reference_module, q, k, v, mask)
    torch.testing.assert_close(out.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])
    assert out.shape == (*q.shape[:-1], 24) and out.dtype == dtype
    weights = module.attention_weights  # the call's (from copies it kept or wrote)
    assert weights.shape == (*q.shape[:-1], 37) and checked() == 0
    assert torch.all(weights.masked_select(~mask.dense()) == 0)
    torch.testing.assert_close(
        weights.double().sum(-1),
        (mask.lengths.expand(weights.shape[:-1]) > 0).double(),
        atol=TOL[dtype],
        rtol=0,
    )


# ---- calls with nothing padded, from the caller's tensors ------------------------------


@pytest.mark.parametrize("route", ["sdpa", "kernel"])
@pytest.mark.parametrize("causal", [False, True], ids=["no mask", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_nothing_padded_skips_the_layers(grad, layout, causal, route, checked, request):
    """DotProductAttention without a mask or with causal masking alone, eager: straight to
    SDPA or the kernel (which takes (B, n, d) as it is in inference), no checks or mask
    built first; output and gradients as float64's, and the weights asked for afterwards
    computed from the copies the call kept."""
    calls = request.getfixturevalue("kernel_calls") if route == "kernel" else None
    (q, k, v), mask, _ = _case(layout, 13, 17, torch.float32, "causal" if causal else "none")
    module = attnscore.DotProductAttention()
    ours = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
    theirs = [t.detach().double().requires_grad_(grad) for t in (q, k, v)]
    kwargs = {"causal": True} if causal else {}
    with torch.set_grad_enabled(grad):
        out = module(*ours, **kwargs)
    expected = reference(*theirs, mask, 24**-0.5)
    assert checked() == 0 and (calls is None or _ran(calls))
    assert out.shape == (*q.shape[:-1], 40)
    torch.testing.assert_close(out.double(), expected.detach(), atol=2e-5, rtol=2e-5)
    if grad:
        out.backward(torch.ones_like(out))
        expected.backward(torch.ones_like(expected))
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-4, rtol=1e-4)
    weights = module.attention_weights  # from copies the call kept: no checked path
    assert checked() == 0 and weights.shape == (*q.shape[:-1], 17)
    if causal:
        assert torch.all(weights[..., 0, 1:] == 0)


def test_nothing_padded_declines_what_it_does_not_take(checked):
    """Mixed dtypes, mismatched shapes, another normalizer, the weights asked for, a mask
    option given as None, empty inputs: the checked path (and its errors)."""
    q, k, v = (torch.randn(2, 5, 8) for _ in range(3))
    module = attnscore.DotProductAttention()
    with pytest.raises(TypeError, match="Expected `keys` to have the dtype of `queries`"):
        module(q, k.double(), v)
    with pytest.raises(ValueError, match="same feature size"):
        module(q, k[..., :4], v)
    with pytest.raises(ValueError, match="agree on every dimension"):
        module(q, k, v[:, :3])
    assert checked() == 0  # refused by the checked path's checks: nothing ran
    module(q, k, v, return_weights=True)
    module(q, k, v, query_valid_lens=None)
    module(q[:, :0], k, v)
    attnscore.DotProductAttention(normalizer="sparsemax")(q, k, v)
    assert checked() == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", ["general", "cosine"])
def test_general_and_cosine_nothing_padded_skip_the_layers(name, grad, layout, dtype, checked):
    """General and cosine attention without a mask, eager, where the kernel does not take
    them (below its size; bfloat16 always): their plain pipeline on the projections straight
    from the caller's tensors, no checks or mask built first, and the weights it computed
    kept; output, weights and gradients (inputs and parameters) as float64's."""
    (q, k, v), mask, g = _case(layout, 13, 17, torch.float32, "none", d=16, dv=8, seed=3)
    module = attnscore.make_scorer(name, 16)
    reference_module = attnscore.make_scorer(name, 16).double()
    reference_module.load_state_dict(module.state_dict())
    module = module.to(dtype)
    ours = [t.detach().to(dtype).clone().requires_grad_(grad) for t in (q, k, v)]
    theirs = [t.detach().double().requires_grad_(grad) for t in (q, k, v)]
    with torch.set_grad_enabled(grad):
        out = module(*ours)
    weights = module.attention_weights
    assert checked() == 0 and out.dtype == dtype
    expected_weights = _general_and_cosine_weights(name, reference_module, *theirs[:2], mask)
    expected = expected_weights @ theirs[2]
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), expected.detach(), atol=tol, rtol=tol)
    torch.testing.assert_close(weights.double(), expected_weights.detach(), atol=tol, rtol=tol)
    assert not weights.requires_grad
    if grad:
        upstream = torch.randn(expected.shape, generator=g, dtype=torch.float64)
        out.backward(upstream.to(dtype))
        expected.backward(upstream)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a.grad.double(), b.grad, atol=10 * tol, rtol=10 * tol)
        parameters = dict(module.named_parameters())
        for pname, p in reference_module.named_parameters():
            assert parameters[pname].grad is not None, pname
            torch.testing.assert_close(
                parameters[pname].grad.double(), p.grad, atol=10 * tol, rtol=10 * tol
            )


@pytest.mark.parametrize("name", ["general", "cosine"])
def test_general_and_cosine_nothing_padded_dropout_and_causal(name, checked, kernel_calls):
    """Dropout in training: the plain pipeline's, on the weights (the same draws as
    dropout of float64's weights). Causal masking, which the kernel takes: straight to it;
    with dropout it is not taken (the checked path runs)."""
    (q, k, v), mask, _ = _case("3-D", 13, 17, torch.float32, "none", d=16, dv=8, seed=4)
    module = attnscore.make_scorer(name, 16, dropout=0.5)
    reference_module = attnscore.make_scorer(name, 16).double()
    reference_module.load_state_dict(module.state_dict())
    torch.manual_seed(5)
    with torch.no_grad():
        out = module(q, k, v)
    weights = _general_and_cosine_weights(name, reference_module, q, k, mask)
    torch.manual_seed(5)
    expected = F.dropout(weights.float(), 0.5).double() @ v.double()
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    assert checked() == 0 and not _ran(kernel_calls)
    module(q, k, v, causal=True)  # dropout at work: not taken
    assert checked() == 1 and not _ran(kernel_calls)
    module.eval()
    with torch.no_grad():
        out = module(q, k, v, causal=True)
    assert checked() == 1 and _ran(kernel_calls)
    (_, _, _), causal_mask, _ = _case("3-D", 13, 17, torch.float32, "causal", d=16, dv=8)
    expected = _general_and_cosine_reference(name, reference_module, q, k, v, causal_mask)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_general_and_cosine_nothing_padded_declines_what_does_not_fit(checked):
    """Feature sizes or a dtype unlike the parameters', a ``W_a`` still lazy, keys of
    another size for cosine: the checked path (and its errors); once ``W_a`` is made, the
    lane."""
    q, k, v = (torch.randn(2, 5, 8) for _ in range(3))
    general = attnscore.MultiplicativeAttention(query_size=8)  # key_size waits: lazy W_a
    general(q, k, v)
    assert checked() == 1
    general(q, k, v)
    assert checked() == 1
    with pytest.raises(ValueError, match="queries"):
        general(q[..., :4], k, v)
    with pytest.raises(TypeError, match="dtype"):
        general(q.double(), k.double(), v.double())
    with pytest.raises(ValueError):
        attnscore.CosineAttention()(q, k[..., :4], v)
    # The checked path refuses all three: the first two in W_a's own size and dtype check,
    # after the route is chosen; cosine's keys in the input checks, before.
    assert checked() == 3


@pytest.mark.parametrize("name", ["general", "cosine"])
def test_general_and_cosine_causal_never_read_the_keys_no_query_sees(name, kernel_calls):
    """Causal masking with fewer queries than keys, in training: the last m - n keys, seen
    by no query, are cut off before the projections, so whatever they hold (NaN here)
    leaves outputs and every gradient as float64's, theirs exactly zero."""
    (q, k, v), mask, g = _case("3-D", 9, 17, torch.float32, "causal", d=16, dv=8, seed=6)
    k_dirty, v_dirty = k.clone(), v.clone()
    k_dirty[:, 9:], v_dirty[:, 9:] = float("nan"), float("inf")
    module = attnscore.make_scorer(name, 16)
    reference_module = attnscore.make_scorer(name, 16).double()
    reference_module.load_state_dict(module.state_dict())
    ours = [t.detach().clone().requires_grad_(True) for t in (q, k_dirty, v_dirty)]
    theirs = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    out = module(*ours, causal=True)
    assert _ran(kernel_calls)
    expected = _general_and_cosine_reference(name, reference_module, *theirs, mask)
    torch.testing.assert_close(out.double(), expected.detach(), atol=2e-5, rtol=2e-5)
    upstream = torch.randn(expected.shape, generator=g, dtype=torch.float64)
    out.backward(upstream.float())
    expected.backward(upstream)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-4, rtol=1e-4)
    assert torch.all(ours[1].grad[:, 9:] == 0) and torch.all(ours[2].grad[:, 9:] == 0)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernel", "kernels disabled"])
@pytest.mark.parametrize("name", ["general", "cosine"])
def test_general_and_cosine_zero_padding_once(name, kernels, kernel_calls, monkeypatch):
    """Training by key lengths: the padding is zeroed once, by the fused path once it has
    taken the call or else by the plain path (not first by a fused path that then
    declines); NaN in padded keys and values leaves the gradients finite."""
    import attnscore._engine as engine

    zeroings = _record(monkeypatch, engine, "zero_padding", 1)
    (q, k, v), mask, _ = _case("3-D", 13, 17, torch.float32, "lengths (B,)", d=16, dv=8)
    padded = mask.padded_keys().unsqueeze(-1)
    k, v = k.masked_fill(padded, float("nan")), v.masked_fill(padded, float("nan"))
    lens = mask.key_lengths.reshape(len(q), -1)[:, 0].contiguous()
    module = attnscore.make_scorer(name, 16)
    ours = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    with K.disabled() if not kernels else contextlib.nullcontext():
        module(*ours, lens).sum().backward()
    assert zeroings == [1] and _ran(kernel_calls) == kernels
    assert all(torch.isfinite(t.grad).all() for t in ours)
