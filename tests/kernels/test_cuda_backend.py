"""The CUDA backend (issue 10): Triton kernels and SDPA + mask, against float64 references.

References are float64 textbook formulations written here (full scores, mask, softmax),
never the code under test; gradients are compared with autograd through those references
and checked numerically with ``torch.autograd.gradcheck``.

Without a GPU the kernels run under Triton's interpreter on CPU tensors. Triton decides
this when it is imported (its own ``tl`` helpers are decorated then) and checks it again
while a kernel runs, so this module imports triton with ``TRITON_INTERPRET=1`` set, removes
the variable at once, and sets it again only for the duration of each of its tests: other
tests never see it. With a GPU, the same tests run the compiled kernels on CUDA tensors.
Tests marked ``cuda`` (larger shapes, the hardware tanh) need a GPU and skip without one.
Every autotune candidate of the additive forward and every backward tile runs here (one
forced at a time); the plain PyTorch twins (``attnscore.kernels._plain``) are a second,
independent reference. The compiled form of the same kernels is checked by
tests/kernels/test_triton_aot.py.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import Tensor

from tool_modules import load_tool

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
INTERPRET = not HAS_CUDA

if INTERPRET and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "triton was imported before TRITON_INTERPRET=1 could be set; run "
        "`TRITON_INTERPRET=1 python -m pytest tests/test_cuda_backend.py`",
        allow_module_level=True,
    )
_saved = os.environ.get("TRITON_INTERPRET")
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    from attnscore.kernels import _cuda as K
finally:
    if _saved is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _saved

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture
def cuda_mod() -> ModuleType:
    """attnscore.kernels._cuda (its kernels interpreted without a GPU)."""
    return K


gpu_mod = cuda_mod


def on(t: Tensor) -> Tensor:
    """t on the device the kernels run on."""
    return t.to(DEVICE)


# ----------------------------------------------------------------- float64 references


def ref_masked_softmax(x: Tensor, lengths: Tensor) -> Tensor:
    """Textbook: mask the scores with -inf, softmax, zero the masked and empty rows."""
    keep = torch.arange(x.shape[-1], device=x.device) < lengths[..., None]
    z = torch.where(keep, x.double(), float("-inf"))
    w = torch.softmax(z, -1)
    return torch.where(keep, w, 0.0)  # empty rows: NaN -> 0 (and no gradient through them)


def ref_additive(qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor) -> Tensor:
    """Textbook: the full (B, n, m, h) tanh tensor, then w_v, then the mask."""
    feats = torch.tanh(qh.double()[:, :, None, :] + kh.double()[:, None, :, :])
    scores = feats @ w_v.double()
    keep = torch.arange(kh.shape[1], device=kh.device) < lengths[..., None]
    return torch.where(keep, scores, 0.0)


def ref_attention(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, scale: float) -> Tensor:
    B, n = q.shape[0], q.shape[1]
    lens = lengths[:, None].expand(B, n) if lengths.dim() == 1 else lengths
    scores = q.double() @ k.double().transpose(1, 2) * scale
    return ref_masked_softmax(scores, lens) @ v.double()


def _lengths(shape: tuple[int, ...], m: int, gen: torch.Generator) -> Tensor:
    lens = torch.randint(0, m + 1, shape, generator=gen)
    flat = lens.view(-1)
    flat[0] = 0  # always an empty row
    flat[-1] = m  # and a full one
    return lens


def _garbage(x: Tensor, keep: Tensor) -> Tensor:
    """x with NaN wherever keep is False."""
    return torch.where(keep, x, float("nan"))


def _budget(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 4e-3, torch.bfloat16: 3e-2}[
        dtype
    ]


# -------------------------------------------------------------------- masked softmax


def _force_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the looping kernels run at test sizes (rows longer than 16, blocks of 8)."""
    ts = sys.modules["attnscore.kernels._triton_softmax"]
    monkeypatch.setattr(ts, "_MAX_SINGLE", {})
    monkeypatch.setattr(ts, "_MAX_SINGLE_DEFAULT", 16)
    monkeypatch.setattr(ts, "_LOOP_BLOCK", 8)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    ("shape", "loop"),
    # m = 24 and 40 are multiples of every vector width (8, 4, 2 elements): those rows are
    # read in vectors, up to VEC - 1 positions past L (NaN here) that must not be used.
    [((2, 3, 7), False), ((5, 33), False), ((3, 29), True), ((4, 6, 24), False), ((5, 40), True)],
)
def test_masked_softmax_forward_and_backward(
    cuda_mod: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    loop: bool,
) -> None:
    if loop:
        _force_loop(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    m = shape[-1]
    lens = _lengths(shape[:-1], m, gen)
    keep = torch.arange(m) < lens[..., None]
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(dtype)
    g = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)

    y = cuda_mod.masked_softmax(on(_garbage(x, keep)), on(lens))
    xr = x.double().requires_grad_()
    yr = ref_masked_softmax(xr, lens)
    yr.backward(torch.where(keep, g.double(), 0.0))
    y = y.cpu()
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y[~keep], torch.zeros_like(y[~keep]))  # exact zeros, empty rows too
    assert (y.double() - yr.detach()).abs().max() <= _budget(dtype)

    dx = cuda_mod.masked_softmax_backward(on(_garbage(g, keep)), on(y), on(lens)).cpu()
    assert dx.dtype == dtype
    assert torch.equal(dx[~keep], torch.zeros_like(dx[~keep]))
    scale = 1 + float(xr.grad.abs().max())  # type: ignore[union-attr]
    assert (dx.double() - xr.grad).abs().max() <= _budget(dtype) * scale


def test_masked_softmax_gradcheck(cuda_mod: ModuleType) -> None:
    lens = on(torch.tensor([[0, 1, 3], [5, 2, 4]]))

    class MS(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> Tensor:
            y = cuda_mod.masked_softmax(x, lens)
            ctx.save_for_backward(y)
            return y  # type: ignore[no-any-return]

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            (y,) = ctx.saved_tensors
            return cuda_mod.masked_softmax_backward(g, y, lens)  # type: ignore[no-any-return]

    x = on(torch.randn(2, 3, 5, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(MS.apply, (x,))


@pytest.mark.parametrize(
    ("m", "dtype", "vec"),
    [(1024, torch.float32, 4), (1024, torch.bfloat16, 8), (1024, torch.float16, 8),
     (1024, torch.float64, 2), (300, torch.float32, 4), (300, torch.bfloat16, 4),
     (302, torch.float32, 2), (7, torch.float16, 1)],
)  # fmt: skip
def test_masked_softmax_vector_width(
    cuda_mod: ModuleType, m: int, dtype: torch.dtype, vec: int
) -> None:
    """16 bytes of elements per vector, halved until the width divides m (rows start on a
    vector boundary); the launch declares it to the kernel."""
    ts = sys.modules["attnscore.kernels._triton_softmax"]
    assert ts._vec(m, dtype) == vec
    x = torch.empty(3, m, dtype=dtype, device="meta")
    launch = ts.fwd_launch(x, torch.empty(3, dtype=torch.int64, device="meta"), x)
    assert launch.meta["VEC"] == vec


def test_masked_softmax_matches_plain_twin(
    cuda_mod: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from attnscore.kernels import _plain

    gen = torch.Generator().manual_seed(8)
    for loop in (False, True):
        if loop:
            _force_loop(monkeypatch)
        x = torch.randn(3, 5, 40, generator=gen, dtype=torch.float64)
        lens = _lengths((3, 5), 40, gen)
        g = torch.randn(3, 5, 40, generator=gen, dtype=torch.float64)
        y = cuda_mod.masked_softmax(on(x), on(lens)).cpu()
        y_plain = _plain.masked_softmax(x, lens)
        assert (y - y_plain).abs().max() <= 1e-12
        dx = cuda_mod.masked_softmax_backward(on(g), on(y), on(lens)).cpu()
        assert (dx - _plain.masked_softmax_backward(g, y_plain, lens)).abs().max() <= 1e-12


def test_masked_softmax_low_precision_within_twice_torch(cuda_mod: ModuleType) -> None:
    """16-bit: error at most ~2x (+1 ulp for the interpreter's rounding) that of torch's
    own float32-reduced softmax rounded to the same dtype."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 40, generator=gen, dtype=torch.float64) * 4
    lens = on(torch.full((4,), 40))
    ref = torch.softmax(x, -1)
    for dtype in (torch.float16, torch.bfloat16):
        xl = x.to(dtype)
        ours = cuda_mod.masked_softmax(on(xl), lens).cpu().double()
        theirs = torch.softmax(xl.float(), -1).to(dtype).double()
        err_theirs = (theirs - ref).abs().max()
        assert (ours - ref).abs().max() <= 3 * err_theirs + 1e-6


def test_masked_softmax_empty_shapes(cuda_mod: ModuleType) -> None:
    y = cuda_mod.masked_softmax(torch.randn(0, 5), torch.zeros(0, dtype=torch.int64))
    assert y.shape == (0, 5)
    y = cuda_mod.masked_softmax(torch.randn(3, 0), torch.zeros(3, dtype=torch.int64))
    assert y.shape == (3, 0)
    dx = cuda_mod.masked_softmax_backward(
        torch.randn(3, 0), torch.randn(3, 0), torch.zeros(3, dtype=torch.int64)
    )
    assert dx.shape == (3, 0)


# ------------------------------------------------------------------- additive scores


def _additive_inputs(
    B: int, n: int, m: int, h: int, dtype: torch.dtype, seed: int = 3
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    qh = (torch.randn(B, n, h, generator=gen, dtype=torch.float64) * 1.5).to(dtype)
    kh = (torch.randn(B, m, h, generator=gen, dtype=torch.float64) * 1.5).to(dtype)
    w_v = torch.randn(h, generator=gen, dtype=torch.float64).to(dtype)
    lens = _lengths((B, n), m, gen)
    lens[-1] = torch.randint(0, m // 2 + 1, (n,), generator=gen)  # keys of one element unused
    return qh, kh, w_v, lens


def _check_additive(
    cuda_mod: ModuleType, dtype: torch.dtype, B: int, n: int, m: int, h: int
) -> None:
    """Scores and gradients against the float64 textbook, with NaN wherever the kernels
    must not look, and exact zeros where the lengths say so."""
    qh, kh, w_v, lens = _additive_inputs(B, n, m, h, dtype)
    keep = torch.arange(m) < lens[..., None]  # (B, n, m)
    key_used = torch.arange(m) < lens.amax(1, keepdim=True)  # (B, m)
    # NaN garbage in keys nobody attends, in queries that attend nothing, in padded grads.
    kh_g = _garbage(kh, key_used[..., None])
    qh_g = _garbage(qh, (lens > 0)[..., None])
    scores = cuda_mod.additive_scores(on(qh_g), on(kh_g), on(w_v), on(lens)).cpu()

    qr, kr, wr = (t.double().clone().requires_grad_() for t in (qh, kh, w_v))
    ref = ref_additive(qr, kr, wr, lens)
    g = torch.randn(B, n, m, dtype=torch.float64).to(dtype)
    ref.backward(torch.where(keep, g.double(), 0.0))

    assert scores.dtype == dtype and scores.shape == (B, n, m)
    assert torch.equal(scores[~keep], torch.zeros_like(scores[~keep]))
    mag = float(ref.detach().abs().max())
    assert (scores.double() - ref.detach()).abs().max() <= _budget(dtype) * mag

    grads = cuda_mod.additive_scores_backward(
        on(_garbage(g, keep)), on(qh_g), on(kh_g), on(w_v), on(lens)
    )
    dq, dk, dw = (t.cpu() for t in grads)
    assert (dq.dtype, dk.dtype, dw.dtype) == (dtype, dtype, dtype)
    assert dq.is_contiguous() and dk.is_contiguous()
    assert torch.equal(dq[lens == 0], torch.zeros_like(dq[lens == 0]))  # zero grads
    assert torch.equal(dk[~key_used], torch.zeros_like(dk[~key_used]))
    for ours, theirs in ((dq, qr.grad), (dk, kr.grad), (dw, wr.grad)):
        assert theirs is not None
        scale = float(theirs.abs().max())
        assert (ours.double() - theirs).abs().max() <= _budget(dtype) * scale * 2


@pytest.mark.parametrize("dtype", FLOATS)
def test_additive_forward_and_backward(cuda_mod: ModuleType, dtype: torch.dtype) -> None:
    # Sizes cross every block of the (32, 32) tiles these small shapes get.
    _check_additive(cuda_mod, dtype, 2, 37, 45, 11)


def test_additive_nan_key_reaches_only_rows_attending_it(cuda_mod: ModuleType) -> None:
    """A NaN key that one query of a block attends: that query's scores and the key's own
    gradient may be NaN, every other query's scores and gradients stay exact."""
    qh, kh, w_v, _ = _additive_inputs(1, 6, 10, 4, torch.float64, seed=10)
    lens = torch.tensor([[10, 3, 0, 7, 5, 1]])
    kh_nan = kh.clone()
    kh_nan[0, 8] = float("nan")  # attended by query 0 only
    g = torch.randn(1, 6, 10, dtype=torch.float64)
    scores = cuda_mod.additive_scores(on(qh), on(kh_nan), on(w_v), on(lens)).cpu()
    dq, dk, _ = (t.cpu() for t in cuda_mod.additive_scores_backward(
        on(g), on(qh), on(kh_nan), on(w_v), on(lens)))  # fmt: skip
    qr, kr = qh.clone().requires_grad_(), kh.clone().requires_grad_()
    ref = ref_additive(qr, kr, w_v, lens)
    keep = torch.arange(10) < lens[..., None]
    ref.backward(torch.where(keep, g, 0.0))
    assert torch.isnan(scores[0, 0, 8])
    assert (scores[0, 1:] - ref.detach()[0, 1:]).abs().max() <= 1e-12
    assert qr.grad is not None and kr.grad is not None
    assert (dq[0, 1:] - qr.grad[0, 1:]).abs().max() <= 1e-12
    others = [j for j in range(10) if j != 8]
    assert torch.isnan(dk[0, 8]).all() and torch.isnan(dq[0, 0]).all()
    assert (dk[0, others] - kr.grad[0, others]).abs().max() <= 1e-12


def _additive_module() -> ModuleType:
    return sys.modules["attnscore.kernels._triton_additive"]


@pytest.mark.parametrize("config", range(5))
def test_additive_forward_each_autotune_config(
    cuda_mod: ModuleType, monkeypatch: pytest.MonkeyPatch, config: int
) -> None:
    """Each candidate alone (what the interpreter runs is the first after pruning), at
    sizes that cross its tiles; the backward runs on its own tiling."""
    ta = _additive_module()
    cfg = ta.FWD_CONFIGS[config]
    monkeypatch.setattr(ta._fwd_kernel, "configs", [cfg])
    bi, bj = cfg.kwargs["BI"], cfg.kwargs["BJ"]
    _check_additive(cuda_mod, torch.float32, 2, bi + 5, bj + 7, 3)


@pytest.mark.parametrize("tile", range(4))
def test_additive_backward_each_tile(
    cuda_mod: ModuleType, monkeypatch: pytest.MonkeyPatch, tile: int
) -> None:
    ta = _additive_module()
    bi, bj, warps = ta.BWD_TILES[tile]
    monkeypatch.setattr(ta, "BWD_TILES", ((bi, bj, warps),))
    _check_additive(cuda_mod, torch.float32, 2, bi + 3, bj + 9, 3)


def test_additive_matches_plain_twin(cuda_mod: ModuleType) -> None:
    from attnscore.kernels import _plain

    qh, kh, w_v, lens = _additive_inputs(2, 37, 45, 11, torch.float64, seed=9)
    g = torch.randn(2, 37, 45, dtype=torch.float64)
    ours = cuda_mod.additive_scores(on(qh), on(kh), on(w_v), on(lens)).cpu()
    assert (ours - _plain.additive_scores(qh, kh, w_v, lens)).abs().max() <= 1e-12
    grads = cuda_mod.additive_scores_backward(on(g), on(qh), on(kh), on(w_v), on(lens))
    plain = _plain.additive_scores_backward(g, qh, kh, w_v, lens)
    for a, b in zip(grads, plain, strict=True):
        assert (a.cpu() - b).abs().max() <= 1e-11 * (1 + float(b.abs().max()))


def _programs(B: int, n: int, m: int, bi: int, bj: int) -> int:
    return B * -(-n // bi) * -(-m // bj)


@pytest.mark.parametrize(
    "shape", [(8, 128, 512, 128), (4, 1024, 1024, 256), (4, 100, 300, 100), (1, 5, 7, 3)]
)
def test_additive_launches_fill_the_gpu_and_bound_memory(
    cuda_mod: ModuleType, shape: tuple[int, int, int, int]
) -> None:
    """Forward candidates and the backward tile have >= 264 programs (2 per SM of an H100)
    whenever some tile can; the backward's tile has the fewest partial sums among those."""
    ta = _additive_module()
    B, n, m, h = shape
    meta = {"dtype": torch.float32, "device": "meta"}
    qh, kh, w = torch.empty(B, n, h, **meta), torch.empty(B, m, h, **meta), torch.empty(h, **meta)
    lens = torch.empty(B, n, dtype=torch.int64, device="meta")
    fwd = ta.fwd_launch(qh, kh, w, lens, torch.empty(B, n, m, **meta), approx=False)
    grids = [_programs(B, n, m, c.kwargs["BI"], c.kwargs["BJ"]) for c in ta.FWD_CONFIGS]
    got = [fwd.grid(v)[0] for v in fwd.variants()]
    if max(grids) >= 264:
        assert got and min(got) >= 264 and len(got) == sum(x >= 264 for x in grids)
    else:
        assert got == [max(grids)]
    launch, bufs = ta.bwd_launch(torch.empty(B, n, m, **meta), qh, kh, w, lens, approx=False)
    programs = launch.grid({})[0]
    floats = sum(b.numel() for b in bufs)
    full = [(bi, bj) for bi, bj, _ in ta.BWD_TILES if _programs(B, n, m, bi, bj) >= 264]
    if full:
        assert programs >= 264
        fewest = min(h * B * (n * -(-m // bj) + m * -(-n // bi)) for bi, bj in full)
        assert floats - programs * h == fewest  # dq and dk partials (dw: one per program)
    else:
        assert programs == max(_programs(B, n, m, bi, bj) for bi, bj, _ in ta.BWD_TILES)
    if shape == (4, 1024, 1024, 256):  # ADDITIVE_LARGE: the extra memory stays bounded
        assert floats * 4 <= 100 * 2**20


def test_additive_gradcheck(cuda_mod: ModuleType) -> None:
    lens = on(torch.tensor([[0, 2, 4], [3, 1, 0]]))

    class Add(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, qh: Tensor, kh: Tensor, w_v: Tensor) -> Tensor:
            ctx.save_for_backward(qh, kh, w_v)
            return cuda_mod.additive_scores(qh, kh, w_v, lens)  # type: ignore[no-any-return]

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            qh, kh, w_v = ctx.saved_tensors
            return cuda_mod.additive_scores_backward(g, qh, kh, w_v, lens)  # type: ignore[no-any-return]

    qh = on(torch.randn(2, 3, 3, dtype=torch.float64)).requires_grad_()
    kh = on(torch.randn(2, 4, 3, dtype=torch.float64)).requires_grad_()
    w_v = on(torch.randn(3, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(Add.apply, (qh, kh, w_v))


def test_additive_float32_meets_issue_tanh_rule(cuda_mod: ModuleType) -> None:
    """Issue 10: float32 scores within 2e-4 relative of a float64 reference (exact tanh),
    over pre-activations from tiny to saturated (|qh + kh| up to ~40)."""
    qh, kh, w_v, lens = _additive_inputs(1, 9, 40, 33, torch.float64, seed=5)
    qh = qh * torch.logspace(-6, 1, 33, dtype=torch.float64)
    kh = kh * torch.logspace(1, -6, 33, dtype=torch.float64)
    ref = ref_additive(qh, kh, w_v, lens)
    ours = cuda_mod.additive_scores(on(qh.float()), on(kh.float()), on(w_v.float()), on(lens)).cpu()
    assert (ours.double() - ref).abs().max() <= 2e-4 * ref.abs().max()
    assert (ours.double() - ref).abs().max() <= 1e-5 * ref.abs().max()  # in fact far inside


def test_additive_empty_and_bad_shapes(cuda_mod: ModuleType) -> None:
    qh, kh, w_v = on(torch.randn(2, 3, 4)), on(torch.randn(2, 0, 4)), on(torch.randn(4))
    lens = on(torch.zeros(2, 3, dtype=torch.int64))
    assert cuda_mod.additive_scores(qh, kh, w_v, lens).shape == (2, 3, 0)
    dq, dk, dw = cuda_mod.additive_scores_backward(on(torch.randn(2, 3, 0)), qh, kh, w_v, lens)
    assert not dq.any() and dk.shape == (2, 0, 4) and not dw.any()


def test_tanh_error_table(cuda_mod: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """The documented tanh errors: the exact kernel measured, the hardware tanh emulated
    (every value off by the bound in the direction that adds up: its error is then
    bound * max_ij sum_h |w_h tanh_ijh|, computed here directly)."""
    if HAS_CUDA:  # the study feeds CPU tensors to the kernel, as the interpreter runs it
        pytest.skip("the tanh error study runs the kernel under Triton's interpreter")
    te = load_tool("tanh_error")  # tools/tanh_error.py, outside the package

    def kernel(qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor) -> Tensor:
        return cuda_mod.additive_scores(qh, kh, w_v, lengths)  # type: ignore[no-any-return]

    shape = (1, 4, 8, 16)
    rows = {(r.tanh, r.dtype, r.how): r for r in te.table(kernel, shape)}
    exact = rows["exact", "float32", "the kernel under the interpreter"]
    assert exact.tanh_error <= 1e-6 and exact.score_error <= 2e-6
    qh, kh, w_v, _ = te.inputs(*shape)
    t = torch.tanh(qh[:, :, None, :] + kh[:, None, :, :])
    ref = t @ w_v
    spread = float((t * w_v).abs().sum(-1).max() / ref.abs().max())
    for bound, name in te.BOUNDS:
        worst = rows["approx", "float32", f"emulated: {name}, worst-case signs"]
        random = rows["approx", "float32", f"emulated: {name}, random signs"]
        assert worst.tanh_error == bound
        assert abs(worst.score_error - bound * spread) <= 1e-6 + 1e-3 * bound * spread
        assert random.score_error < worst.score_error
    for dtype in ("bfloat16", "float16"):
        rounding = rows["exact", dtype, "float64 sum rounded to the dtype"].score_error
        assert 0 < rounding <= {"bfloat16": 2**-8, "float16": 2**-11}[dtype]
        hw = rows["approx", dtype, "emulated: hardware bound, worst-case signs"].score_error
        assert hw <= rounding + te.HARDWARE_BOUND * spread * 2
    assert te.main(["--shape", *map(str, shape)]) == 0
    assert "| exact | float32 | the kernel under the interpreter |" in capsys.readouterr().out


def test_tanh_error_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    te = load_tool("tanh_error")  # tools/tanh_error.py, outside the package

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert te.main([]) == 2


def test_tanh_mode(cuda_mod: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ATTNSCORE_TANH", raising=False)
    assert cuda_mod.tanh_mode() == "auto"
    monkeypatch.setenv("ATTNSCORE_TANH", " Approx ")
    assert cuda_mod.tanh_mode() == "approx"
    x = torch.randn(2)
    assert not cuda_mod._approx(x)  # never on CPU / under the interpreter
    monkeypatch.setenv("ATTNSCORE_TANH", "fast")
    with pytest.raises(ValueError, match="Expected ATTNSCORE_TANH to be 'auto', 'exact' or"):
        cuda_mod.tanh_mode()


@pytest.mark.parametrize(
    ("mode", "dtypes", "hardware"),
    [
        ("auto", (torch.bfloat16,), True),
        ("auto", (torch.float16, torch.bfloat16, torch.float16), True),
        ("auto", (torch.float32,), False),
        ("auto", (torch.bfloat16, torch.bfloat16, torch.float32), False),
        ("exact", (torch.bfloat16,), False),
        ("approx", (torch.float32,), True),
        ("approx", (torch.float32, torch.float64), False),
        ("auto", (torch.float64,), False),
    ],
)
def test_hardware_tanh_choice(
    cuda_mod: ModuleType, mode: str, dtypes: tuple[torch.dtype, ...], hardware: bool
) -> None:
    """Default: the hardware tanh for 16-bit inputs only; float32 on request; never float64."""
    assert cuda_mod.uses_hardware_tanh(*dtypes, mode=mode) is hardware


def test_approx_on_cuda_tensors_follows_the_mode(
    cuda_mod: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device check passes for CUDA tensors outside the interpreter (meta stand-ins
    here, no GPU needed), and then the mode and dtypes decide."""

    class FakeCuda:
        def __init__(self, dtype: torch.dtype) -> None:
            self.dtype = dtype
            self.device = torch.device("cuda")

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("ATTNSCORE_TANH", raising=False)
    assert cuda_mod._approx(FakeCuda(torch.bfloat16), FakeCuda(torch.bfloat16))
    assert not cuda_mod._approx(FakeCuda(torch.float32))
    monkeypatch.setenv("ATTNSCORE_TANH", "approx")
    assert cuda_mod._approx(FakeCuda(torch.float32))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not cuda_mod._approx(FakeCuda(torch.float32))


def test_launch_lets_the_autotuner_choose_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside the interpreter an autotuned launch goes through the autotuner with the
    grid as a function of the chosen meta-parameters; inside, the first candidate runs."""
    from attnscore.kernels._triton_launch import Launch

    calls: list[tuple[str, Any, tuple[Any, ...], dict[str, Any]]] = []

    class Kernel:  # a @triton.jit function: launched by kernel[grid](...)
        def __init__(self, who: str) -> None:
            self.who = self.__name__ = who

        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **meta: Any) -> None:
                calls.append((self.who, grid, args, meta))

            return launch

    class Tuner(Kernel):  # triton.autotune's wrapper: no __name__, the function in .fn
        def __init__(self) -> None:
            self.who = "autotuner"
            self.fn = Kernel("first candidate")

    launch = Launch(Tuner(), (1, 2), {"ACC": "f32"},
                    lambda meta: (meta["BI"] * 10,), ({"BI": 3}, {"BI": 4}))  # fmt: skip
    assert launch.name == "first candidate"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    launch.run()
    who, grid, args, meta = calls.pop()
    assert (who, args, meta, grid({"BI": 4})) == ("autotuner", (1, 2), {"ACC": "f32"}, (40,))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launch.run()
    assert calls.pop() == ("first candidate", (30,), (1, 2), {"ACC": "f32", "BI": 3})


# -------------------------------------------------------- dot-product attention (SDPA)


def _dot(
    mod: ModuleType, q: Tensor, k: Tensor, v: Tensor, lens: Tensor, *, scale: float,
    dropout_p: float,
) -> Tensor:  # fmt: skip
    """Dot-product attention on (B, n, d) inputs with (B,) or (B, n) lengths, on the CUDA
    priority list's SDPA route (with the mask), whatever the tensors' device."""
    from attnscore import kernels
    from attnscore.masking import build_mask

    B, n, m = q.shape[0], q.shape[1], k.shape[1]
    mask = build_mask(torch.Size([B]), n, m, q.device, valid_lens=lens)
    with kernels.use("sdpa"):
        return kernels.dot_product_attention(q, k, v, mask, scale=scale, dropout_p=dropout_p)


@pytest.mark.parametrize("per_query", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_dot_product_attention(cuda_mod: ModuleType, per_query: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    B, n, m, d, dv = 3, 5, 7, 4, 6
    q, k, v = (
        torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)
        for s in ((B, n, d), (B, m, d), (B, m, dv))
    )
    lens = _lengths((B, n) if per_query else (B,), m, gen)
    scale = 0.4
    qs, ks, vs = (on(t).clone().requires_grad_() for t in (q, k, v))
    out = _dot(cuda_mod, qs, ks, vs, on(lens), scale=scale, dropout_p=0.0)
    qr, kr, vr = (t.double().clone().requires_grad_() for t in (q, k, v))
    ref = ref_attention(qr, kr, vr, lens, scale)
    gout = torch.randn(B, n, dv, generator=gen, dtype=torch.float64)
    ref.backward(gout)
    out.backward(on(gout.to(dtype)))
    out = out.detach().cpu()
    lens2 = lens[:, None].expand(B, n) if lens.dim() == 1 else lens
    assert out.dtype == dtype and out.shape == (B, n, dv)
    assert torch.equal(out[lens2 == 0], torch.zeros_like(out[lens2 == 0]))
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]
    assert (out.double() - ref.detach()).abs().max() <= tol
    assert qs.grad is not None
    assert not qs.grad.cpu()[lens2 == 0].any()
    for ours, theirs in ((qs.grad, qr.grad), (ks.grad, kr.grad), (vs.grad, vr.grad)):
        assert ours is not None and theirs is not None
        ours = ours.cpu()
        assert torch.isfinite(ours).all()
        assert (ours.double() - theirs).abs().max() <= tol * (1 + float(theirs.abs().max()))


def test_dot_product_attention_edges(cuda_mod: ModuleType) -> None:
    """Length-0 rows: zeros with zero gradients; dropout keeps the rest finite."""
    q = on(torch.randn(2, 3, 4)).requires_grad_()
    k, v = on(torch.randn(2, 6, 4)), on(torch.randn(2, 6, 5))
    lens = on(torch.tensor([6, 0]))
    out = _dot(cuda_mod, q, k, v, lens, scale=0.5, dropout_p=0.5)
    assert out.shape == (2, 3, 5) and torch.isfinite(out).all() and not out[1].any()
    out.sum().backward()
    assert q.grad is not None and not q.grad[1].any()


# ------------------------------------------------------------------------ on a GPU


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", FLOATS)
def test_gpu_kernels_match_reference(gpu_mod: ModuleType, dtype: torch.dtype) -> None:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(6)
    for shape in ((4, 9, 1000), (3, 10000)):  # one-block and looping softmax kernels
        lens = _lengths(shape[:-1], shape[-1], gen)
        x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        y = gpu_mod.masked_softmax(x.to(dev), lens.to(dev)).cpu()
        assert (y.double() - ref_masked_softmax(x, lens)).abs().max() <= _budget(dtype) * 4
        g = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        dx = gpu_mod.masked_softmax_backward(g.to(dev), y.to(dev), lens.to(dev)).cpu()
        yd = y.double()
        keep = torch.arange(shape[-1]) < lens[..., None]
        gd = torch.where(keep, g.double(), 0.0)
        want = yd * (gd - (gd * yd).sum(-1, keepdim=True))
        assert (dx.double() - want).abs().max() <= _budget(dtype) * 4 * (1 + want.abs().max())

    qh, kh, w_v, lens = _additive_inputs(2, 70, 90, 40, dtype)
    scores = gpu_mod.additive_scores(qh.to(dev), kh.to(dev), w_v.to(dev), lens.to(dev))
    ref = ref_additive(qh, kh, w_v, lens)
    assert (scores.cpu().double() - ref).abs().max() <= _budget(dtype) * 2 * ref.abs().max()
    grads = gpu_mod.additive_scores_backward(
        torch.ones(2, 70, 90, dtype=dtype, device=dev), *(t.to(dev) for t in (qh, kh, w_v, lens))
    )
    assert all(torch.isfinite(t).all() for t in grads)


@pytest.mark.cuda
@needs_cuda
def test_gpu_approx_tanh_error(gpu_mod: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records how far the hardware tanh is from float64 (issue 10's 2e-4 rule)."""
    monkeypatch.setenv("ATTNSCORE_TANH", "approx")
    qh, kh, w_v, lens = _additive_inputs(2, 64, 128, 128, torch.float64, seed=7)
    ref = ref_additive(qh, kh, w_v, lens)
    dev = torch.device("cuda")
    ours = gpu_mod.additive_scores(
        qh.float().to(dev), kh.float().to(dev), w_v.float().to(dev), lens.to(dev)
    )
    rel = float((ours.cpu().double() - ref).abs().max() / ref.abs().max())
    print(f"tanh.approx.f32: max error {rel:.2e} of max |score|")
    assert rel < 1e-2


@pytest.mark.cuda
@needs_cuda
def test_gpu_additive_backward_is_deterministic(gpu_mod: ModuleType) -> None:
    """Partial sums added by torch.sum in a fixed order: bitwise equal run to run."""
    dev = torch.device("cuda")
    qh, kh, w_v, lens = (t.to(dev) for t in _additive_inputs(4, 300, 500, 64, torch.float32))
    g = torch.randn(4, 300, 500, device=dev)
    first = gpu_mod.additive_scores_backward(g, qh, kh, w_v, lens)
    for _ in range(3):
        again = gpu_mod.additive_scores_backward(g, qh, kh, w_v, lens)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


@pytest.mark.cuda
@needs_cuda
def test_gpu_dot_product_attention(gpu_mod: ModuleType) -> None:
    dev = torch.device("cuda")
    q, k, v = (torch.randn(4, 33, 16, device=dev) for _ in range(3))
    lens = torch.tensor([0, 1, 20, 33], device=dev)
    out = _dot(gpu_mod, q, k, v, lens, scale=0.25, dropout_p=0.0)
    ref = ref_attention(q.cpu(), k.cpu(), v.cpu(), lens.cpu(), 0.25)
    assert (out.cpu().double() - ref).abs().max() <= 1e-4
    assert torch.isfinite(out).all()
