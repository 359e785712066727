"""Tests of attnscore.kernels: fast paths and plain twins against float64 references written
here, gradcheck of every autograd Function, masked rows, dtypes and padded garbage."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from attnscore import kernels as K
from observed_backend import observed_cpu

HAVE_C = K.available(torch.zeros(1))
needs_c = pytest.mark.skipif(not HAVE_C, reason="C kernels unavailable (disabled, or no compiler)")
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5, torch.float64: 1e-10}


@pytest.fixture(autouse=True)
def _seed_and_reset():
    torch.manual_seed(0)
    yield
    K.set_enabled(None)


def ref_masked_softmax(x: np.ndarray, lens: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    out = np.zeros_like(x)
    flat_x, flat_o = x.reshape(-1, x.shape[-1]), out.reshape(-1, x.shape[-1])
    for r, L in enumerate(lens.reshape(-1)):
        if L:
            e = np.exp(flat_x[r, :L] - flat_x[r, :L].max())
            flat_o[r, :L] = e / e.sum()
    return out


def ref_additive(qh, kh, w, lens):
    """float64 broadcast formula, masked with where (fine at test sizes)."""
    s = torch.tanh(qh[:, :, None, :] + kh[:, None, :, :]) @ w
    mask = torch.arange(kh.shape[1]) < lens[..., None]
    return torch.where(mask, s, 0.0)


def ref_dot(q, k, v, lens, scale):
    B, n = q.shape[0], q.shape[1]
    lens2 = lens[:, None].expand(B, n) if lens.dim() == 1 else lens
    out = torch.zeros(B, n, v.shape[2], dtype=torch.float64)
    for b in range(B):
        for i in range(n):
            L = int(lens2[b, i])
            if L:
                s = (k[b, :L].double() @ q[b, i].double()) * scale
                out[b, i] = torch.softmax(s, 0) @ v[b, :L].double()
    return out


def run(fast: bool, fn, *args, **kw):
    K.set_enabled(fast)
    try:
        return fn(*args, **kw)
    finally:
        K.set_enabled(None)


PATHS = [pytest.param(True, marks=needs_c, id="fast"), pytest.param(False, id="plain")]


# ---------------------------------------------------------------- masked softmax
@pytest.mark.parametrize("fast", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_softmax_matches_reference(fast, dtype):
    x = torch.randn(3, 5, 37, dtype=torch.float64)
    lens = torch.randint(0, 38, (3, 5))
    lens[0, 0], lens[1, 2] = 0, 37
    xt = x.to(dtype)
    y = run(fast, K.masked_softmax, xt, lens)
    assert y.dtype == dtype and y.shape == x.shape
    expected = ref_masked_softmax(xt.double().numpy(), lens.numpy())
    np.testing.assert_allclose(y.double().numpy(), expected, atol=TOL[dtype], rtol=0)
    assert torch.all(y[0, 0] == 0)


@pytest.mark.parametrize("fast", PATHS)
def test_masked_softmax_noncontiguous_and_garbage(fast):
    base = torch.randn(4, 30, 6)
    x = base.transpose(1, 2)  # (4, 6, 30), not contiguous
    lens = torch.randint(0, 31, (4, 6))
    clean = run(fast, K.masked_softmax, x.contiguous(), lens)
    dirty = x.clone()
    pad = torch.arange(30) >= lens[..., None]
    dirty[pad] = float("nan")
    dirty[..., -1][lens < 30] = float("inf")
    dirty.requires_grad_(True)
    y = run(fast, K.masked_softmax, dirty, lens)
    torch.testing.assert_close(y, clean, atol=1e-6, rtol=1e-5)
    assert torch.all(y[pad] == 0)
    y.backward(torch.randn_like(y))
    assert torch.isfinite(dirty.grad).all() and torch.all(dirty.grad[pad] == 0)
    assert torch.all(dirty.grad[lens == 0] == 0)


@needs_c
@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_softmax_fast_and_plain_gradients_agree(dtype):
    x = torch.randn(2, 7, 19).to(dtype)
    lens = torch.randint(0, 20, (2, 7))
    lens[1, 3] = 0
    g = torch.randn(2, 7, 19).to(dtype)
    grads = []
    for fast in (True, False):
        xx = x.clone().requires_grad_(True)
        run(fast, K.masked_softmax, xx, lens).backward(g)
        grads.append(xx.grad)
    assert grads[0].dtype == dtype
    torch.testing.assert_close(grads[0], grads[1], atol=TOL[dtype] * 4, rtol=TOL[dtype] * 4)


def _broadcast_gradients(shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Upstream gradients that are views of fewer numbers: a sum's (one value everywhere),
    one row repeated, every row its own."""
    m = shape[-1]
    return {
        "sum": torch.ones(()).expand(shape),
        "row": torch.randn(m).expand(shape),
        "dense": torch.randn(shape),
    }


@pytest.mark.parametrize("fast", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["sum", "row", "dense"])
def test_masked_softmax_backward_of_broadcast_gradients(fast, dtype, kind):
    """dx = y * (g - sum_j g_j y_j) on valid positions, zeros beyond, whatever g's strides
    (the fast path reads one broadcast row once instead of copying it out)."""
    x = torch.randn(3, 5, 37, dtype=torch.float64).to(dtype).requires_grad_(True)
    lens = torch.randint(0, 38, (3, 5))
    lens[0, 0], lens[1, 2] = 0, 37
    g = _broadcast_gradients(x.shape)[kind].to(dtype)
    run(fast, K.masked_softmax, x, lens).backward(g)
    y = ref_masked_softmax(x.detach().double().numpy(), lens.numpy())
    g64 = g.double().numpy()
    expected = y * (g64 - (g64 * y).sum(-1, keepdims=True))
    np.testing.assert_allclose(x.grad.double().numpy(), expected, atol=TOL[dtype] * 4, rtol=0)


@pytest.mark.parametrize("fast", PATHS)
def test_masked_softmax_gradcheck(fast):
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    lens = torch.tensor([[0, 6, 2], [1, 4, 5]])
    K.set_enabled(fast)
    assert torch.autograd.gradcheck(lambda t: K.masked_softmax(t, lens), (x,))


@pytest.fixture
def small_calls():
    """What the CPU backend's small-call masked softmax returned, call by call."""
    results: list[bool] = []

    def seen(name, _args, out):
        if name == "small_masked_softmax":
            results.append(out is not None)

    with observed_cpu(seen):
        yield results


@needs_c
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["(B,)", "x.shape[:-1]"])
def test_small_masked_softmax_is_one_step_from_the_callers_lengths(small_calls, dtype, shape):
    """Small calls without gradients run whole from the lengths as given (one per example,
    or one per row), NaN in the padding changing nothing, lengths above m meaning m."""
    import attnscore

    B, H, n, m = 3, 2, 4, 7
    x = torch.randn(B, H, n, m, dtype=torch.float64)
    if shape == "(B,)":
        lens = torch.tensor([0, 3, m + 5])
        rows = lens[:, None, None].expand(B, H, n).clamp(max=m)
    else:
        lens = torch.randint(0, m + 3, (B, H, n))
        rows = lens.clamp(max=m)
    padded = torch.arange(m) >= rows[..., None]
    garbage = x.masked_fill(padded, float("nan")).to(dtype)
    with torch.no_grad():
        y = attnscore.masked_softmax(garbage, lens)
    assert small_calls == [True]
    assert y.dtype == dtype
    rounded = x.masked_fill(padded, 0.0).to(dtype).double()  # the inputs as the call saw them
    expected = ref_masked_softmax(rounded.numpy(), rows.numpy())
    np.testing.assert_allclose(y.double().numpy(), expected, atol=TOL[dtype], rtol=0)
    assert not y[padded].any()


@needs_c
def test_small_masked_softmax_declines_what_it_does_not_take(small_calls):
    """Gradients, large calls, strided scores, lengths of another shape or dtype, negative
    lengths: the general path (same results, its error for negative lengths)."""
    import attnscore

    x = torch.randn(2, 3, 5, dtype=torch.float64)
    lens = torch.tensor([2, 5])
    expected = ref_masked_softmax(x.numpy(), lens[:, None].expand(2, 3).numpy())
    strided = torch.randn(2, 5, 3, dtype=torch.float64).mT.copy_(x)
    for X, L in [(strided, lens), (x, lens[:, None].expand(2, 3)), (x, lens.to(torch.int32))]:
        np.testing.assert_allclose(attnscore.masked_softmax(X, L).numpy(), expected, atol=1e-12)
    assert small_calls == [False, False]  # int32 lengths never reach the backend
    y = attnscore.masked_softmax(x.requires_grad_(), lens)
    np.testing.assert_allclose(y.detach().numpy(), expected, atol=1e-12)
    big = torch.randn(64, 64, 64)
    attnscore.masked_softmax(big, torch.full((64,), 64))
    assert small_calls == [False, False, False]
    with pytest.raises(ValueError, match="Expected `valid_lens` to be non-negative, but got -1"):
        attnscore.masked_softmax(x.detach(), torch.tensor([2, -1]))
    assert small_calls[-1] is False


def test_masked_softmax_errors():
    with pytest.raises(TypeError, match=r"Expected .* but got"):
        K.masked_softmax(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"Expected .* but got"):
        K.masked_softmax(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"Expected .* but got"):
        K.masked_softmax(torch.zeros(2, 3), torch.zeros(3, dtype=torch.int64))


def test_disable_env(monkeypatch):
    """The variable is read at import and again by set_enabled(None)."""
    monkeypatch.setenv("ATTNSCORE_DISABLE_KERNELS", "1")
    assert K.enabled()  # not read again yet
    K.set_enabled(None)
    assert not K.enabled() and not K.available(torch.zeros(1))
    monkeypatch.setenv("ATTNSCORE_DISABLE_KERNELS", "0")
    K.set_enabled(None)
    assert K.enabled()
    with K.disabled():
        assert not K.available(torch.zeros(1))


# ---------------------------------------------------------------- additive scores
def _additive_inputs(dtype=torch.float64, B=2, n=5, m=9, h=6):
    qh = torch.randn(B, n, h, dtype=torch.float64)
    kh = torch.randn(B, m, h, dtype=torch.float64)
    w = torch.randn(h, dtype=torch.float64)
    lens = torch.randint(0, m + 1, (B, n))
    lens[0, 1] = 0
    lens[1, 0] = m
    return qh.to(dtype), kh.to(dtype), w.to(dtype), lens


@pytest.mark.parametrize("fast", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_additive_matches_reference(fast, dtype):
    qh, kh, w, lens = _additive_inputs(dtype)
    s = run(fast, K.additive_scores, qh, kh, w, lens)
    assert s.dtype == dtype and s.shape == (2, 5, 9)
    expected = ref_additive(qh.double(), kh.double(), w.double(), lens)
    tol = TOL[dtype] * 10
    torch.testing.assert_close(s.double(), expected, atol=tol, rtol=tol)
    assert torch.all(s[0, 1] == 0)


@pytest.mark.parametrize("fast", PATHS)
def test_additive_gradients_and_garbage(fast):
    qh, kh, w, lens = _additive_inputs(B=3, n=4, m=11, h=5)
    lens[2] = torch.tensor([0, 3, 7, 2])  # keys 7.. of element 2 are padding for every row
    g = torch.randn(3, 4, 11, dtype=torch.float64)
    expected = [t.clone().requires_grad_(True) for t in (qh, kh, w)]
    ref_additive(*expected, lens).backward(g)
    dirty_kh = kh.clone()
    dirty_kh[2, 7:] = float("nan")
    dirty_kh[2, 9] = float("inf")
    got = [t.clone().requires_grad_(True) for t in (qh, dirty_kh, w)]
    s = run(fast, K.additive_scores, *got, lens)
    torch.testing.assert_close(s, ref_additive(qh, kh, w, lens))
    s.backward(g)
    for e, o in zip(expected, got, strict=True):
        torch.testing.assert_close(o.grad, e.grad)
    assert torch.all(got[1].grad[2, 7:] == 0)


@pytest.mark.parametrize("fast", PATHS)
def test_additive_gradcheck(fast):
    qh, kh, w, lens = _additive_inputs(B=2, n=3, m=4, h=3)
    args = [t.requires_grad_(True) for t in (qh, kh, w)]
    K.set_enabled(fast)
    assert torch.autograd.gradcheck(lambda a, b, c: K.additive_scores(a, b, c, lens), args)


def test_additive_plain_chunks(thresholds):
    """Force tiny blocks so the chunked twin's blocking logic is exercised."""
    from attnscore.kernels import _plain

    thresholds(plain_chunk_elements=1)
    qh, kh, w, lens = _additive_inputs(B=2, n=7, m=5, h=3)
    args = [t.requires_grad_(True) for t in (qh, kh, w)]
    expected = ref_additive(qh, kh, w, lens)
    torch.testing.assert_close(_plain.additive_scores_dense(*args, lens), expected)
    assert torch.autograd.gradcheck(
        lambda a, b, c: _plain.additive_scores_dense(a, b, c, lens), args
    )
    # the blocked backend functions (the plain backend of the registered op)
    torch.testing.assert_close(_plain.additive_scores(qh, kh, w, lens), expected)
    g = torch.randn_like(expected)
    grads = torch.autograd.grad(ref_additive(*args, lens), args, g)
    for got, want in zip(_plain.additive_scores_backward(g, qh, kh, w, lens), grads, strict=True):
        torch.testing.assert_close(got, want)


def test_additive_errors():
    qh, kh, w, lens = _additive_inputs()
    with pytest.raises(ValueError, match=r"Expected .* but got"):
        K.additive_scores(qh, kh[:, :, :2], w, lens)
    with pytest.raises(ValueError, match=r"Expected .* but got"):
        K.additive_scores(qh, kh, w, lens[:, :2])
    with pytest.raises(TypeError, match=r"Expected .* but got"):
        K.additive_scores(qh, kh, w, lens.float())


# ---------------------------------------------------------------- build
@needs_c
def test_build_info_and_threads():
    info = K.build_info().as_dict()
    assert info["path"] and info["error"] is None
    # multi-threaded split gives the same result as one thread
    x = torch.randn(64, 4096)
    lens = torch.randint(0, 4097, (64,))
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = K.masked_softmax(x, lens)
        torch.set_num_threads(2)
        two = K.masked_softmax(x, lens)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)


@needs_c
@pytest.mark.parametrize("openmp", [True, False], ids=["openmp-drivers", "python-threads"])
def test_both_parallel_runners_match_the_references(thresholds, openmp):
    """The row ranges run on torch's OpenMP threads (C drivers) or on Python threads; both
    must give the float64 reference, forward and backward, with two ranges or more."""
    from attnscore.kernels import _build, _cpu

    if openmp and not _build.parallel_in_c():
        pytest.skip("the kernels were not built with torch's OpenMP runtime here")
    thresholds(min_work_per_thread=1)  # always split
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    threads = contextlib.nullcontext() if openmp else K.python_threads()
    try:
        with threads:
            x = torch.randn(5, 7, 33, dtype=torch.float64)
            lens = torch.randint(0, 34, (5, 7))
            y = _cpu.masked_softmax(x, lens)
            np.testing.assert_allclose(y.numpy(), ref_masked_softmax(x.numpy(), lens.numpy()))
            g = torch.randn_like(x)
            dx = _cpu.masked_softmax_backward(g, y, lens)
            yr = torch.tensor(ref_masked_softmax(x.numpy(), lens.numpy()))
            np.testing.assert_allclose(dx, yr * (g - (g * yr).sum(-1, keepdim=True)), atol=1e-12)

            qh, kh, w = (torch.randn(3, 6, 4), torch.randn(3, 9, 4), torch.randn(4))
            qh, kh, w = (t.double().requires_grad_() for t in (qh, kh, w))
            alens = torch.randint(0, 10, (3, 6))
            s = _cpu.additive_scores(qh.detach(), kh.detach(), w.detach(), alens)
            ref = ref_additive(qh, kh, w, alens)
            torch.testing.assert_close(s, ref.detach())
            gs = torch.randn_like(s)
            got = _cpu.additive_scores_backward(gs, qh.detach(), kh.detach(), w.detach(), alens)
            want = torch.autograd.grad(ref, (qh, kh, w), gs)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b)
    finally:
        torch.set_num_threads(old)


@pytest.fixture(scope="module")
def plain_build(tmp_path_factory):
    """The library without an OpenMP runtime (``CFLAGS``, ``LDFLAGS``), compiled once into an
    empty cache folder: (the folder, the library, whether it was compiled, what the folder
    held afterwards); None without a C compiler. test_build_compiles_into_an_empty_cache_once
    checks that build; the ATTNSCORE_OPENMP=0 process finds it there (the same cache key)
    instead of compiling it a second time."""
    from attnscore.kernels import _build

    cc = _build._compiler()
    if cc is None:
        return None
    cache = tmp_path_factory.mktemp("plain-build") / "cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ATTNSCORE_CACHE", str(cache))
        path, compiled = _build._build(cc, _build.CFLAGS, _build.LDFLAGS)
    return cache, path, compiled, sorted(cache.iterdir())


@needs_c
def test_openmp_can_be_switched_off(plain_build):
    """ATTNSCORE_OPENMP=0 builds without an OpenMP runtime: the kernels run on Python threads."""
    code = (
        "import torch; from attnscore.kernels import _build; _build.load_library(); "
        "i = _build.build_info(); print(i.openmp, _build.parallel_in_c(), i.error)"
    )
    env = {**os.environ, "ATTNSCORE_OPENMP": "0", "ATTNSCORE_CACHE": str(plain_build[0])}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", "False", "None"]


def test_available_only_for_float_cpu_tensors():
    assert not K.available(torch.zeros(2, dtype=torch.int64))
    assert not K.available(torch.zeros(2, device="meta"))


def test_input_check_messages_name_the_argument():
    with pytest.raises(ValueError, match=r"Expected `lengths` on cpu, but got meta instead"):
        K.masked_softmax(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64, device="meta"))
    with pytest.raises(TypeError, match=r"Expected `mask` to be an AttentionMask"):
        K.dot_product_attention(*(torch.zeros(1, 2, 3),) * 3, torch.tensor([2]), scale=1.0)


@needs_c
def test_large_outputs_and_several_threads_match_the_reference():
    """Outputs of 4 MiB and more take the huge-page hint; enough work splits the rows over
    threads, whose partial key and w_v gradients are summed."""
    from attnscore.kernels import _cpu

    x = torch.randn(256, 4096)  # 4 MiB of float32
    lens = torch.randint(0, 4097, (256,))
    qh, kh, w, alens = _additive_inputs(B=2, n=64, m=64, h=16)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        work = alens.reshape(-1) * 16 + 1
        assert len(_cpu._split(work.numel(), lambda: work, 2, 1 << 30)) == 2
        y = K.masked_softmax(x, lens)
        args = [t.clone().requires_grad_(True) for t in (qh, kh, w)]
        g = torch.randn(2, 64, 64, dtype=torch.float64)
        K.additive_scores(*args, alens).backward(g)
        # a second multi-threaded call reuses the thread pool
        again = K.additive_scores(qh, kh, w, alens)
    finally:
        torch.set_num_threads(old)
    np.testing.assert_allclose(y.numpy(), ref_masked_softmax(x.numpy(), lens.numpy()), atol=1e-6)
    expected = [t.clone().requires_grad_(True) for t in (qh, kh, w)]
    ref_additive(*expected, alens).backward(g)
    for got, want in zip(args, expected, strict=True):
        torch.testing.assert_close(got.grad, want.grad)
    torch.testing.assert_close(again, ref_additive(qh, kh, w, alens))


# ---------------------------------------------------------------- building the C library
_FAILING_CC = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "failing-cc 1.0"; exit 0; fi
echo "failing-cc: error: something broke" >&2
exit 1
"""


@pytest.fixture
def first_load(monkeypatch, tmp_path):
    """load_library as on its first call in a fresh process, with an empty cache; the loaded
    library and its build info come back after the test."""
    from attnscore.kernels import _build

    monkeypatch.setattr(_build, "_tried", False)
    monkeypatch.setattr(_build, "_lib", None)
    monkeypatch.setattr(_build, "state", _build._State())
    monkeypatch.setattr(_build, "_info", _build.BuildInfo())
    monkeypatch.setenv("ATTNSCORE_CACHE", str(tmp_path / "cache"))
    return _build


def test_build_compiles_into_an_empty_cache_once(first_load, plain_build, monkeypatch):
    import ctypes

    if plain_build is None:
        pytest.skip("no C compiler")
    cache, path, compiled, held = plain_build  # built into an empty cache by the fixture
    assert compiled and path.suffix == ".so"
    assert held == [path]  # no temporary file left behind
    assert hasattr(ctypes.CDLL(str(path)), "masked_softmax_f32")
    # cached: not compiled again
    monkeypatch.setenv("ATTNSCORE_CACHE", str(cache))
    cc = first_load._compiler()
    assert first_load._build(cc, first_load.CFLAGS, first_load.LDFLAGS) == (path, False)


def test_failed_build_warns_once_and_everything_falls_back(first_load, tmp_path, monkeypatch):
    import warnings

    cc = tmp_path / "failing-cc"
    cc.write_text(_FAILING_CC)
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    with pytest.raises(RuntimeError, match="failing-cc failed: failing-cc: error: something broke"):
        first_load._build(str(cc), first_load.CFLAGS, first_load.LDFLAGS)
    assert list((tmp_path / "cache").iterdir()) == []  # the half-built file is removed

    K.set_enabled(True)
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    lens = torch.tensor([2, 0, 6])
    with pytest.warns(RuntimeWarning, match=r"C kernels unavailable.*something broke"):
        y = K.masked_softmax(x, lens)
    assert first_load.build_info().error.startswith("RuntimeError: ")
    assert first_load.build_info().path is None and not K.available(x)
    np.testing.assert_allclose(
        y.detach().numpy(), ref_masked_softmax(x.detach().numpy(), lens.numpy()), atol=1e-12
    )
    qh, kh, w, alens = _additive_inputs(B=2, n=3, m=4, h=3)
    args = [t.requires_grad_(True) for t in (qh, kh, w)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not on every call
        torch.testing.assert_close(K.additive_scores(*args, alens), ref_additive(qh, kh, w, alens))
        assert torch.autograd.gradcheck(lambda t: K.masked_softmax(t, lens), (x,))
        assert torch.autograd.gradcheck(lambda a, b, c: K.additive_scores(a, b, c, alens), args)


def test_no_compiler_leaves_the_kernels_unavailable(first_load, tmp_path, monkeypatch):
    from attnscore.kernels import _cpu

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, gcc or clang on it
    with pytest.warns(RuntimeWarning, match=r"no C compiler found"):
        assert first_load.load_library() is None
    with pytest.raises(RuntimeError, match="C kernels are not available"):
        _cpu._lib()


def test_cache_folder_and_cpu_flags(first_load, tmp_path, monkeypatch):
    import platform

    assert first_load._cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("ATTNSCORE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert first_load._cache_dir() == tmp_path / "xdg" / "attnscore"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert first_load._cache_dir() == tmp_path / "home" / ".cache" / "attnscore"

    def no_proc(*args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr(first_load, "open", no_proc, raising=False)
    assert first_load._cpu_flags() == platform.processor()


@pytest.mark.parametrize("value", ["0", "false", "no"])
def test_openmp_switch_values_turn_the_openmp_build_off(first_load, monkeypatch, value):
    monkeypatch.setenv("ATTNSCORE_OPENMP", value)
    assert not first_load._want_openmp()


# ---------------------------------------------------------------- softmax by a boolean mask
from attnscore.kernels import _ops  # noqa: E402

MASK_SHAPES = {
    "full": (3, 4, 9),
    "shared by the batch": (4, 9),
    "per example": (3, 1, 9),
    "per key": (9,),
}


def ref_softmax_dense(x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """float64, row by row: softmax over the allowed entries, zeros elsewhere."""
    allowed = allowed.expand(x.shape)
    out = torch.zeros(x.shape, dtype=torch.float64)
    xf, af, of = (
        x.double().reshape(-1, x.shape[-1]),
        allowed.reshape(-1, x.shape[-1]),
        out.view(-1, x.shape[-1]),
    )
    for r in range(xf.shape[0]):
        keep = af[r].nonzero().flatten()
        if len(keep):
            of[r, keep] = torch.softmax(xf[r, keep], 0)
    return out


@pytest.mark.parametrize("fast", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MASK_SHAPES)
def test_masked_softmax_dense_matches_reference(fast, dtype, shape):
    x = torch.randn(3, 4, 9).to(dtype)
    allowed = torch.rand(MASK_SHAPES[shape]) < 0.5
    if shape == "full":
        allowed[0, 1] = False  # a row that allows nothing
    dirty = torch.where(allowed.expand(x.shape), x, float("nan")).requires_grad_(True)
    y = run(fast, _ops.masked_softmax_dense, dirty, allowed)
    assert y.dtype == dtype and y.shape == x.shape
    expected = ref_softmax_dense(x, allowed)
    np.testing.assert_allclose(y.double().detach().numpy(), expected.numpy(), atol=TOL[dtype])
    assert torch.all(y[~allowed.expand(x.shape)] == 0)
    g = torch.randn(3, 4, 9).to(dtype)
    y.backward(g)
    x64 = x.double().requires_grad_(True)
    ref_softmax_dense_grad = torch.autograd.grad(
        (_softmax64(x64, allowed) * g.double()).sum(), x64
    )[0]
    assert torch.isfinite(dirty.grad).all()
    np.testing.assert_allclose(
        dirty.grad.double().numpy(), ref_softmax_dense_grad.numpy(), atol=TOL[dtype] * 4
    )


def _softmax64(x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Differentiable float64 reference: -inf fill, softmax, rows with nothing allowed 0."""
    allowed = allowed.expand(x.shape)
    w = torch.softmax(x.masked_fill(~allowed, -torch.inf), -1)
    return torch.where(allowed, w, 0.0)


@pytest.mark.parametrize("fast", PATHS)
@pytest.mark.parametrize("dtype", [None, *DTYPES])
def test_mask_summary(fast, dtype):
    allowed = torch.rand(2, 3, 5, 7) < 0.3
    allowed[0, 1, 2] = False
    allowed[1, :, :, 4] = False
    additive, row_any, col_any = run(fast, _ops.mask_summary, allowed, dtype)
    assert torch.equal(row_any, allowed.any(-1)) and torch.equal(col_any, allowed.any(-2))
    if dtype is None:
        assert additive is None
        return
    assert additive.dtype == dtype and additive.shape == allowed.shape
    assert torch.all(additive[allowed] == 0)
    assert torch.all(additive[~allowed] == float("-inf"))


@pytest.mark.parametrize("fast", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, m", [((2, 3, 4), 9), ((4, 1, 100), 300)], ids=["one", "split"])
def test_lengths_mask(fast, dtype, shape, m):
    """0 at the first lengths[...] keys, -inf after, row by row (the larger shape is split
    over threads)."""
    lengths = torch.randint(0, m + 1, shape)
    lengths.view(-1)[0], lengths.view(-1)[-1] = 0, m
    additive = run(fast, _ops.lengths_mask, lengths, m, dtype)
    assert additive.dtype == dtype and additive.shape == (*shape, m)
    for row, L in zip(additive.reshape(-1, m), lengths.reshape(-1).tolist(), strict=True):
        assert torch.all(row[:L] == 0) and torch.all(row[L:] == float("-inf"))


@pytest.mark.parametrize("fast", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_at_an_allowed_position_reaches_the_whole_row_only(fast, dtype):
    """NaN where it is attended is never hidden (the fast exp must not round it away)."""
    x = torch.randn(2, 3, 40).to(dtype)
    x[0, 1, 5] = float("nan")
    lens = torch.tensor([[20, 20, 20], [40, 40, 40]])
    y = run(fast, K.masked_softmax, x, lens)
    assert torch.isnan(y[0, 1, :20]).all() and torch.all(y[0, 1, 20:] == 0)
    assert torch.isfinite(y[0, 0]).all() and torch.isfinite(y[1]).all()
    allowed = torch.arange(40) < lens[..., None]
    dense = run(fast, _ops.masked_softmax_dense, x, allowed)
    assert torch.isnan(dense[0, 1, :20]).all() and torch.all(dense[0, 1, 20:] == 0)
    assert torch.isfinite(dense[1]).all()


# ---------------------------------------------------------------- float16 matrix products
def _half_product_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Largest error allowed for float16 a @ b accumulated in float32 and rounded once:
    half a float16 ulp of the exact product, plus float32 rounding over k terms."""
    exact = a.double() @ b.double()
    k = a.shape[-1]
    spread = a.double().abs() @ b.double().abs()
    return exact, exact.abs() * 2.0**-11 + spread * (k + 1) * 2.0**-24 + 2.0**-24


HALF_SHAPES = {
    "batched": ((3, 5, 7), (3, 7, 9)),
    "heads": ((2, 3, 5, 7), (2, 3, 7, 9)),
    "weight": ((3, 5, 7), (7, 130)),
    "matrix": ((5, 7), (7, 9)),
    "odd, many rows": ((6, 257, 33), (6, 33, 70)),
    "one column": ((1, 1, 300), (300, 1)),
}


@needs_c
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("shapes", list(HALF_SHAPES.values()), ids=list(HALF_SHAPES))
def test_float16_matmul_accumulates_in_float32(thresholds, shapes, strided, threads):
    """Every entry within half a float16 ulp of the exact product (plus float32 rounding),
    for contiguous and transposed operands, on one thread and split over two (ranges that
    cross batch entries)."""
    from attnscore.kernels import _cpu

    thresholds(min_work_per_thread=1)
    (sa, sb) = shapes
    a, b = torch.randn(*sa).half(), torch.randn(*sb).half()
    if strided:  # the same values, read through transposed strides
        a = a.mT.contiguous().mT
        b = b.mT.contiguous().mT
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = _cpu.matmul(a, b)
    finally:
        torch.set_num_threads(old)
    exact, bound = _half_product_bound(a, b)
    assert out.dtype == torch.float16 and out.shape == exact.shape
    assert torch.all((out.double() - exact).abs() <= bound)


def test_float16_matmul_empty_and_broadcast_shapes():
    """Empty sums are zeros, empty results empty; batch dimensions that broadcast, and an
    operand on another device, are torch.matmul's (same values, same errors)."""
    from attnscore.kernels import _cpu

    assert torch.all(_cpu.matmul(torch.ones(2, 3, 0).half(), torch.ones(2, 0, 4).half()) == 0)
    assert _cpu.matmul(torch.ones(2, 0, 5).half(), torch.ones(2, 5, 4).half()).shape == (2, 0, 4)
    a, b = torch.randn(2, 3, 4).half(), torch.randn(1, 4, 5).half()
    torch.testing.assert_close(_cpu.matmul(a, b), torch.matmul(a, b))
    with pytest.raises(RuntimeError):
        _cpu.matmul(torch.ones(2, 3, 4).half(), torch.ones(2, 5, 6).half())
    meta = torch.ones(2, 4, 5, dtype=torch.float16, device="meta")  # never read by C
    assert _cpu.matmul(a, meta).device == torch.matmul(a, meta).device


@pytest.mark.parametrize("fast", PATHS)
@pytest.mark.parametrize("weight", [False, True], ids=["batched", "weight"])
def test_float16_matmul_gradients(fast, weight):
    """Both gradients of a float16 product against float64 autograd on the same values."""
    a = torch.randn(3, 6, 5).half().requires_grad_()
    b = (torch.randn(5, 4) if weight else torch.randn(3, 5, 4)).half().requires_grad_()
    g = torch.randn(3, 6, 4).half()
    out = run(fast, _ops.matmul, a, b)
    ga, gb = run(fast, torch.autograd.grad, out, (a, b), g)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    want = torch.autograd.grad(a64 @ b64, (a64, b64), g.double())
    assert ga.dtype == gb.dtype == torch.float16
    for got, expected in zip((ga, gb), want, strict=True):
        torch.testing.assert_close(got.double(), expected, atol=4e-3, rtol=2e-3)


@needs_c
def test_float16_attention_products_run_in_the_c_kernel():
    """General attention in float16 on the CPU, plain path (the weights asked for; by
    lengths alone the call takes the kernel by lengths): its products (q W_a, scores,
    weights @ V, and their gradients) go to the backend's matmul, and the output and
    gradients match the float64 formulation."""
    import attnscore

    calls = []

    def seen(name, args, _out):
        if name == "matmul":
            calls.append((args[0].dtype, args[1].dtype))

    module = attnscore.make_scorer("general", 8, 8).half()
    q = torch.randn(2, 3, 8).half().requires_grad_()
    k, v = torch.randn(2, 5, 8).half(), torch.randn(2, 5, 4).half()
    lens = torch.tensor([2, 5])
    with observed_cpu(seen):
        out, _ = module(q, k, v, lens, return_weights=True)
        (gq,) = torch.autograd.grad(out.sum(), q)
    # forward: q W_a, scores, weights @ V; backward: the weights', q W_a's, q's and W_a's
    assert len(calls) == 3 + 4
    assert set(calls) == {(torch.float16, torch.float16)}
    W = module.W_a.weight.detach().double()
    q64 = q.detach().double().requires_grad_()
    scores = (q64 @ W) @ k.double().mT
    scores = scores.masked_fill(torch.arange(5) >= lens[:, None, None], float("-inf"))
    ref = torch.softmax(scores, -1) @ v.double()
    (gq64,) = torch.autograd.grad(ref.sum(), q64)
    torch.testing.assert_close(out.double(), ref, atol=4e-3, rtol=2e-3)
    torch.testing.assert_close(gq.double(), gq64, atol=8e-3, rtol=4e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_finite_reads_nan_and_inf_anywhere(dtype):
    """The one-reduction test the padding looks start with: any NaN or infinity (and a sum
    that overflows, which sends callers on to the row-by-row look) is 'not finite'."""
    from attnscore._checks import all_finite, bad_rows

    x = torch.randn(3, 5, 7).to(dtype)
    assert all_finite(x) and all_finite(x[:, :0])
    for value in (float("nan"), float("inf"), float("-inf")):
        dirty = x.clone()
        dirty[2, 4, 6] = value
        assert not all_finite(dirty)
        assert bad_rows(dirty).nonzero().tolist() == [[2, 4]]
    huge = torch.full((4,), torch.finfo(dtype).max, dtype=dtype)
    assert not all_finite(huge) and bad_rows(huge[None]).tolist() == [True]
