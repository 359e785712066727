"""Property test: any memory layout of any argument gives the same attention.

Kernels read raw memory, so a layout they do not expect gives garbage rather than an error
(lengths made as (n, B) and then transposed once returned ``torch.empty``'s contents). Here
hypothesis draws, for every path of ``paths.PATHS``, the layout of each of queries, keys,
values and lengths (contiguous, made transposed, expanded over the batch, sliced with a
step, at an offset in a larger storage), a size that reaches the fused kernels (the small
pass, the kernel by lengths in float32 training) and a dtype, and checks output, weights
and input gradients against the plain maths in float64 on contiguous copies; the masked
softmax likewise, scores and lengths in any layout.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from attnscore import masked_softmax
from paths import PATHS, Path, allowed_keys, plain_attention

LAYOUTS = ["contiguous", "transposed", "expanded", "sliced", "offset"]
TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-10}


def lay_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The values of ``t`` in another memory layout, through differentiable ops (so that
    gradients reach ``t``). ``expanded`` keeps only the first example and repeats it: the
    caller draws it where sharing one example's values is what it means."""
    if layout == "contiguous" or t.ndim == 0:
        return t
    if layout == "transposed":  # laid out with the last dimension first
        order = list(range(t.ndim))[::-1]
        return t.permute(order).contiguous().permute(order)
    if layout == "expanded":
        return t[:1].expand(t.shape)
    if layout == "sliced":  # every other element of a tensor twice as long in its last dim
        return torch.stack([t, torch.zeros_like(t)], dim=-1)[..., 0]
    if layout == "offset":  # the same layout, three elements into a larger storage
        flat = torch.cat([t.new_zeros(3), t.reshape(-1)])
        return flat[3:].view(t.shape)
    raise AssertionError(layout)


@st.composite
def cases(draw):
    B = draw(st.integers(1, 3))
    batch = (B,) if draw(st.booleans()) else (B, draw(st.integers(1, 3)))
    n = draw(st.integers(1, 24))
    m = draw(st.integers(1, 40))
    kind = draw(st.sampled_from(["1d", "2d"] + (["full"] if len(batch) > 1 else [])))
    shape = {"1d": (B,), "2d": (B, n), "full": (*batch, n)}[kind]
    lens = draw(st.lists(st.integers(0, m + 3), min_size=math.prod(shape), max_size=99999))
    lens = torch.tensor(lens[: math.prod(shape)], dtype=torch.int64).reshape(shape)
    layouts = [draw(st.sampled_from(LAYOUTS)) for _ in range(4)]
    return batch, n, m, lens, layouts


SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check(path: Path, case, dtype: torch.dtype, seed: int, training: bool) -> None:
    batch, n, m, lens, layouts = case
    qs, ks = (8, 8) if path.same_feature_size else (8, 6)
    runner = path.build(qs, ks, dtype)
    gen = torch.Generator().manual_seed(seed)
    values = [
        torch.randn(*batch, rows, size, generator=gen, dtype=torch.float64).to(dtype)
        for rows, size in ((n, qs), (m, ks), (m, 5))
    ]
    # an expanded tensor repeats its first example: the values are that
    values = [t[:1].expand(t.shape).contiguous() if how == "expanded" else t
              for t, how in zip(values, layouts, strict=False)]  # fmt: skip
    if layouts[3] == "expanded":
        lens = lens[:1].expand(lens.shape).contiguous()
    leaves = [t.requires_grad_(training) for t in values]
    lens_in = lay_out(lens, layouts[3])
    with torch.set_grad_enabled(training):
        laid = [lay_out(t, how) for t, how in zip(leaves, layouts, strict=False)]
        out, weights = runner(*laid, lens_in)
    params = {name: t.detach().double() for name, t in runner.params.items()}
    refs = [t.detach().double().requires_grad_(training) for t in values]
    ref_out, ref_w = plain_attention(path, params, *refs, lens)
    tol = {"rtol": TOLERANCE[dtype], "atol": TOLERANCE[dtype]}
    torch.testing.assert_close(out.detach().double(), ref_out.detach(), **tol)
    torch.testing.assert_close(weights.detach().double(), ref_w.detach(), **tol)
    if not training or not out.requires_grad:
        return
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out * g.to(dtype)).sum(), laid, allow_unused=True)
    ref_grads = torch.autograd.grad((ref_out * g).sum(), refs, allow_unused=True)
    for got, want in zip(grads, ref_grads, strict=True):
        if got is None or want is None:
            continue
        torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize("path", PATHS, ids=str)
@SETTINGS
@given(
    case=cases(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    training=st.booleans(),
    seed=st.integers(0, 2**16),
)
# lengths (B, H, n) made as (n, H, B) and transposed: the kernel by lengths read them as
# laid out (before the fix: outputs near 1e33, or NaN)
@example(
    case=(
        (2, 3),
        16,
        40,
        torch.arange(96).reshape(2, 3, 16) % 44,
        ["contiguous"] * 3 + ["transposed"],
    ),
    dtype=torch.float32,
    training=True,
    seed=0,
)
def test_any_layout_gives_the_plain_maths(path, case, dtype, training, seed):
    """Non-contiguous queries, keys, values and lengths: output, weights and gradients equal
    the float64 plain maths on contiguous copies."""
    _check(path, case, dtype, seed, training)


@pytest.mark.parametrize("layout", ["transposed", "expanded", "sliced", "offset"])
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_lengths_of_every_layout_reach_the_kernel_by_lengths(layout, training):
    """The case that returned garbage: (B, H, n) lengths made as (B, n, H) and transposed,
    float32, 4 heads, 40 keys (the C kernel by lengths in inference and training)."""
    from paths import _registry_path

    path = _registry_path("scaled_dot")
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(0, 44, (2, 3, 16), generator=gen)
    case = ((2, 3), 16, 40, lens, ["contiguous", "contiguous", "contiguous", layout])
    _check(path, case, torch.float32, 7, training)


@SETTINGS
@given(
    case=cases(),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    training=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_masked_softmax_of_any_layout(case, dtype, training, seed):
    """Scores and lengths in any layout: the masked softmax and its gradient equal float64's
    on contiguous copies."""
    batch, n, m, lens, layouts = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, n, m, generator=gen, dtype=torch.float64).to(dtype)
    if layouts[0] == "expanded":
        x = x[:1].expand(x.shape).contiguous()
    if layouts[3] == "expanded":
        lens = lens[:1].expand(lens.shape).contiguous()
    x.requires_grad_(training)
    with torch.set_grad_enabled(training):
        laid = lay_out(x, layouts[0])
        out = masked_softmax(laid, lay_out(lens, layouts[3]))
    x64 = x.detach().double().requires_grad_(training)
    allowed = allowed_keys(lens, batch, n, m)
    ref = torch.softmax(x64.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    tol = {torch.float32: 2e-6, torch.float64: 1e-12, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out.detach().double(), ref.detach(), rtol=tol, atol=tol)
    if training:
        g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        (got,) = torch.autograd.grad((out * g.to(dtype)).sum(), laid)
        (want,) = torch.autograd.grad((ref * g).sum(), x64)
        torch.testing.assert_close(got.double(), want, rtol=4 * tol, atol=4 * tol)
