"""Property-based tests: search for inputs that break the guarantees, on every path.

Shapes, lengths (1-D and 2-D, zero, above m), leading dimensions (B,) and (B, H), dtypes
and garbage in padding are drawn by hypothesis; every path of ``paths.PATHS`` is checked
against the plain maths written in ``paths.py`` (float64) and, for 16-bit dtypes, within
an error budget set by the same plain maths run naively in that dtype.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from attnscore import masked_softmax
from paths import GROUPS, PATHS, Path, allowed_keys, plain_attention, plain_masked_softmax
from reference import broadcast_lengths, np_masked_softmax

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
LOW = [torch.float16, torch.bfloat16]
GARBAGE = [float("nan"), float("inf"), -float("inf"), 3e38, -3e38]


@st.composite
def shapes(draw, *, max_n: int = 4, max_m: int = 6):
    """(batch_shape, n, m, valid_lens) with lengths (B,), (B, n) or batch_shape + (n,)."""
    B = draw(st.integers(1, 3))
    batch = (B,) if draw(st.booleans()) else (B, draw(st.integers(1, 2)))
    n = draw(st.integers(0, max_n))
    m = draw(st.integers(0, max_m))
    kinds = ["1d", "2d"] + (["full"] if len(batch) > 1 else [])
    kind = draw(st.sampled_from(kinds))
    lens_shape = {"1d": (B,), "2d": (B, n), "full": (*batch, n)}[kind]
    count = math.prod(lens_shape)
    lens = draw(st.lists(st.integers(0, m + 2), min_size=count, max_size=count))
    return batch, n, m, torch.tensor(lens, dtype=torch.int64).reshape(lens_shape)


def full_lengths(lens: torch.Tensor, batch: tuple[int, ...], n: int) -> np.ndarray:
    if lens.ndim == len(batch) + 1 and len(batch) > 1:
        return lens.numpy().copy()
    return broadcast_lengths(lens.numpy(), batch, n).copy()


# ---- masked softmax ------------------------------------------------------------------


@SETTINGS
@given(shapes(), st.sampled_from(FLOATS), st.integers(0, 2**16))
@example(((1, 1), 0, 0, torch.tensor([0])), torch.float16, 0)  # m = 0 (broke the reference)
def test_masked_softmax_rows_sum_to_one_and_zero_beyond(case, dtype, seed):
    batch, n, m, lens = case
    gen = torch.Generator().manual_seed(seed)
    X = (torch.randn(*batch, n, m, generator=gen, dtype=torch.float64) * 4).to(dtype)
    out = masked_softmax(X, lens)
    assert out.dtype == dtype and out.shape == X.shape and torch.isfinite(out).all()
    L = torch.from_numpy(full_lengths(lens, batch, n)).clamp(max=m)
    beyond = torch.arange(m) >= L.unsqueeze(-1)
    assert torch.all(out[beyond] == 0)  # exactly zero, not tiny
    sums = out.double().sum(-1)
    eps = torch.finfo(dtype).eps
    expected = (L > 0).double()
    assert torch.allclose(sums, expected, atol=4 * m * eps, rtol=0)
    # The masked result equals the softmax of the truncated row.
    ref = torch.from_numpy(np_masked_softmax(X.double().numpy(), L.numpy()))
    tol = 1e-12 if dtype == torch.float64 else 2 * eps
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0)


@SETTINGS
@given(shapes(), st.sampled_from([torch.float32, torch.float64]), st.integers(0, 2**16))
def test_masked_softmax_garbage_and_zero_lengths(case, dtype, seed):
    """Masked positions hold garbage: nothing changes; L = 0 rows: zero, zero gradient."""
    batch, n, m, lens = case
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(*batch, n, m, generator=gen, dtype=dtype)
    L = torch.from_numpy(full_lengths(lens, batch, n)).clamp(max=m)
    masked = torch.arange(m) >= L.unsqueeze(-1)
    garbage = torch.tensor(GARBAGE, dtype=dtype)[torch.randint(0, 5, X.shape, generator=gen)]
    dirty = torch.where(masked, garbage, X)
    g = torch.randn(X.shape, generator=gen, dtype=dtype)
    results = []
    for x in (X, dirty):
        x = x.clone().requires_grad_(True)
        out = masked_softmax(x, lens)
        (out * g).sum().backward()
        results.append((out, x.grad))
    (clean, clean_grad), (out, grad) = results
    torch.testing.assert_close(out, clean, rtol=0, atol=0)
    torch.testing.assert_close(grad, clean_grad, rtol=0, atol=0)
    assert torch.isfinite(grad).all() and torch.all(grad[masked] == 0)
    empty = L == 0
    assert torch.all(out[empty] == 0) and torch.all(grad[empty] == 0)


# ---- every path: padding, permutation, references ---------------------------------------


def _inputs(path: Path, batch, n, m, seed, dtype=torch.float64, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    qs, ks = (3, 3) if path.same_feature_size else (4, 3)

    def randn(*shape):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    return randn(*batch, n, qs), randn(*batch, m, ks), randn(*batch, m, 2), gen


def _run_with_grads(runner, q, k, v, lens, g):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, weights = runner(q, k, v, lens)
    params = runner.trainable()
    grads = torch.autograd.grad((out * g).sum(), [q, k, v, *params], allow_unused=True)
    grads = [
        torch.zeros_like(t) if d is None else d
        for t, d in zip([q, k, v, *params], grads, strict=True)
    ]
    return out.detach(), weights.detach(), grads


def _check_padding_is_inert(path: Path, case, seed: int) -> None:
    batch, n, m, lens = case
    runner = path.build(*((3, 3) if path.same_feature_size else (4, 3)), torch.float64)
    q, k, v, gen = _inputs(path, batch, n, m, seed)
    L = torch.from_numpy(full_lengths(lens, batch, n)).clamp(max=m)
    # Padding: keys no query of the row may attend (j >= the row's longest length).
    longest = L.amax(-1, keepdim=True) if n else torch.zeros(*batch, 1, dtype=torch.int64)
    pad = (torch.arange(m) >= longest).unsqueeze(-1)
    choose = torch.randint(0, len(GARBAGE), (2, *k.shape[:-1], 1), generator=gen)
    junk = torch.tensor(GARBAGE, dtype=torch.float64)
    k2 = torch.where(pad, junk[choose[0]].expand_as(k), k)
    v2 = torch.where(pad, junk[choose[1]].expand(*v.shape), v)
    g = torch.randn(*batch, n, 2, generator=gen, dtype=torch.float64)
    clean = _run_with_grads(runner, q, k, v, lens, g)
    dirty = _run_with_grads(runner, q, k2, v2, lens, g)
    tight = {"rtol": 0, "atol": 1e-13}
    torch.testing.assert_close(dirty[0], clean[0], **tight)
    torch.testing.assert_close(dirty[1], clean[1], **tight)
    for a, b in zip(dirty[2], clean[2], strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **tight)
    for grad in dirty[2][1:3]:
        assert torch.all(grad.masked_select(pad) == 0)
    # Queries with no valid key: zero output, zero weights, zero query gradient.
    idle = L == 0
    assert torch.all(dirty[0][idle] == 0) and torch.all(dirty[1][idle] == 0)
    assert torch.all(dirty[2][0][idle] == 0)
    # And everything equals the plain maths in float64.
    params = {name: t.detach() for name, t in runner.params.items()}
    ref_out, ref_w = plain_attention(path, params, q, k, v, lens)
    torch.testing.assert_close(dirty[1], ref_w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dirty[0], ref_out, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("path", PATHS, ids=str)
@SETTINGS
@given(case=shapes(), seed=st.integers(0, 2**16))
# Found by hypothesis: n = 0 with valid_lens crashed in AttentionMask.padded_keys, and
# additive scoring crashed on n = 0 (torch.cat of no chunks).
@example(case=((1, 1), 0, 0, torch.tensor([0])), seed=0)
@example(case=((2,), 0, 3, torch.zeros(2, 0, dtype=torch.int64)), seed=0)
@example(case=((1,), 0, 2, torch.tensor([1])), seed=0)
def test_padding_changes_nothing(path, case, seed):
    """Garbage in padded keys/values changes no output, weight or gradient."""
    _check_padding_is_inert(path, case, seed)


def _check_permutation(path: Path, case, seed: int) -> None:
    batch, n, m, lens = case
    # One length per example, so that each row has one set of valid keys to permute.
    if lens.ndim > 1:
        lens = lens.flatten(1).amax(-1) if lens.numel() else lens.new_zeros(batch[0])
    runner = path.build(*((3, 3) if path.same_feature_size else (4, 3)), torch.float64)
    q, k, v, gen = _inputs(path, batch, n, m, seed)
    perm = torch.arange(m).repeat(batch[0], 1)
    for b in range(batch[0]):
        L = min(int(lens[b]), m)
        perm[b, :L] = torch.randperm(L, generator=gen)
    index = perm.reshape(batch[0], *(1,) * (len(batch) - 1), m, 1)

    def gather(t):
        return t.gather(-2, index.expand(*batch, m, t.shape[-1]))

    out, w = (t.detach() for t in runner(q, k, v, lens))
    out_p, w_p = (t.detach() for t in runner(q, gather(k), gather(v), lens))
    torch.testing.assert_close(out_p, out, rtol=1e-12, atol=1e-12)
    w_index = perm.reshape(batch[0], *(1,) * (len(batch) - 1), 1, m).expand(*batch, n, m)
    torch.testing.assert_close(w_p, w.gather(-1, w_index), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("path", PATHS, ids=str)
@SETTINGS
@given(case=shapes(), seed=st.integers(0, 2**16))
@example(case=((1, 1), 0, 0, torch.tensor([0])), seed=0)  # n = m = 0, found by hypothesis
def test_permuting_valid_keys_with_values_changes_nothing(path, case, seed):
    _check_permutation(path, case, seed)


def _max_abs(t: torch.Tensor) -> float:
    return t.abs().max().item() if t.numel() else 0.0


def _low_precision_errors(path: Path, dtype: torch.dtype, case, seed: int, scale: float):
    """(our error, naive error) against the float64 reference, for output and weights.

    The naive error is the largest of: the path's reference formula run plainly in
    ``dtype``, and the float64 computation with its scores perturbed by relative errors of
    up to eps of ``dtype`` (four seeded draws). The second measures how much storing
    scores at that precision can move this example's result at all: with nearly tied keys
    the rounding of the scores alone moves the output a lot, whichever formula computes
    them, and one plain formula may round luckily where another does not.
    """
    batch, n, m, lens = case
    runner = path.build(*((3, 3) if path.same_feature_size else (4, 3)), dtype)
    q, k, v, _ = _inputs(path, batch, n, m, seed, dtype=dtype, scale=scale)
    with torch.no_grad():
        out, w = runner(q, k, v, lens)
    assert out.dtype == dtype and w.dtype == dtype
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    params = {name: t.detach() for name, t in runner.params.items()}
    params64 = {a: t.double() for a, t in params.items()}
    q64, k64, v64 = q.double(), k.double(), v.double()
    ref = plain_attention(path, params64, q64, k64, v64, lens)
    # The same plain maths run naively in the low-precision dtype ...
    candidates = [plain_attention(path, params, q, k, v, lens)]
    # ... and the exact maths with scores perturbed at that precision.
    allowed = allowed_keys(lens, tuple(q.shape[:-2]), q.shape[-2], k.shape[-2])
    v_kept = torch.where(allowed.any(-2).unsqueeze(-1), v64, torch.zeros_like(v64))
    scores = path.reference(params64, q64, k64)
    gen = torch.Generator().manual_seed(seed)
    eps = torch.finfo(dtype).eps
    for _ in range(4):
        noise = (torch.rand(scores.shape, generator=gen, dtype=torch.float64) * 2 - 1) * eps
        weights = plain_masked_softmax(scores * (1 + noise), allowed)
        candidates.append((weights @ v_kept, weights))
    ours = [_max_abs(a.double() - r) for a, r in zip((out, w), ref, strict=True)]
    theirs = [max(_max_abs(c[i].double() - ref[i]) for c in candidates) for i in range(2)]
    return ours, theirs, ref


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("path", PATHS, ids=str)
@settings(max_examples=15, deadline=None)
@given(case=shapes(), seed=st.integers(0, 2**16), scale=st.sampled_from([1.0, 8.0]))
# Found by hypothesis: general scores near 41, two nearly tied keys 0.79 apart; bfloat16
# scores (0.25 apart there) move the output by about 0.8 whatever computes them.
@example(
    case=((3, 2), 2, 5, torch.tensor([[[0, 0], [0, 0]], [[0, 0], [0, 0]], [[4, 0], [0, 0]]])),
    seed=2265,
    scale=8.0,
)
# Found by hypothesis: float16 q·k that cancels (terms near 64, sums near 5); scaling q by
# 1/sqrt(3) before the products rounded it first and put the output at 5x the plain error.
@example(case=((2,), 1, 4, torch.tensor([0, 4])), seed=12211, scale=8.0)
def test_low_precision_within_budget(path, dtype, case, seed, scale):
    """Finite, and within 3x the naive error (+ a few ulps of the output) of float64."""
    ours, theirs, ref = _low_precision_errors(path, dtype, case, seed, scale)
    eps = torch.finfo(dtype).eps
    for name, a, b, r in zip(("output", "weights"), ours, theirs, ref, strict=True):
        floor = 2 * eps * max(1.0, _max_abs(r))
        assert a <= 3 * b + floor, f"{name}: error {a:.3g} > budget 3 x {b:.3g} + {floor:.3g}"


@pytest.mark.parametrize("group", sorted(GROUPS))
@SETTINGS
@given(case=shapes(), seed=st.integers(0, 2**16))
def test_paths_of_one_group_agree(group, case, seed):
    """Paths computing the same maths (plain, functional, later fused) agree, weights too."""
    batch, n, m, lens = case
    results = []
    for path in GROUPS[group]:
        runner = path.build(*((3, 3) if path.same_feature_size else (4, 3)), torch.float64)
        q, k, v, _ = _inputs(path, batch, n, m, seed)
        results.append([t.detach() for t in runner(q, k, v, lens)])
    for other in results[1:]:
        torch.testing.assert_close(other[0], results[0][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(other[1], results[0][1], rtol=1e-12, atol=1e-12)
