#!/usr/bin/env python
"""Seeded differential fuzz of attnscore's C kernels, through the public API only.

Every case draws, at random: an entry point (``masked_softmax``, the functional forms, the
modules, ``MultiHeadAttention``), a dtype, a mask, how the lengths are laid out in memory,
how queries / keys / values are laid out, a magnitude, garbage (NaN or inf) in padding or
NaN in attended positions, training or inference, and a size (small: the single C pass;
mid: the kernel by lengths, SDPA, the plain pipeline). The library's results are compared
with an independent float64 reference written here (the textbook formulation: scores, a
masked softmax that fills masked positions, zero weights and output for queries with no
key), and gradients with the reference's autograd in float64. Low precision is held to a
budget made of the error of the same plain maths run in that dtype, plus a few of the
dtype's eps scaled by the magnitude of the scores (see :func:`tolerance`).

Checks (failure kinds): ``error`` (the call raised), ``value`` (outputs / weights outside
the budget, or non-finite where the reference is finite), ``grad`` (input or parameter
gradients), ``exact`` (what the library documents as exact zeros: masked weights, output
of queries with no key, gradients of padding), ``padding`` (NaN or inf stored in padding
reached a result), ``nan`` (NaN in an attended position did not reach exactly the queries
that attend it).

Usage::

    python tools/fuzz_kernels.py                         # 2000 cases, 1 and 2 threads
    python tools/fuzz_kernels.py --cases 500 --seed 3 --threads 1
    python tools/fuzz_kernels.py --seed 0 --case 17 -v   # rerun one case, show it

Exit status 1 on any failure; each failing case gets a one-line reproduction.
Needs only the installed package (and torch); nothing from the tests.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# OpenMP threads that spin after each parallel region compete with the main thread on a
# shared machine (measured: a 2-thread pass 5x slower); the kernels' results do not depend
# on it. Set before torch loads libgomp; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from torch import Tensor

import attnscore
from attnscore import functional as AF

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
APIS = (
    "masked_softmax",
    "f.dot_product_attention",
    "f.additive_attention",
    "f.general_attention",
    "f.cosine_attention",
    "DotProductAttention",
    "AdditiveAttention",
    "MultiplicativeAttention",
    "CosineAttention",
    "MultiHeadAttention",
)
MASKS = (
    "none",
    "lens_B",
    "lens_Bn",
    "lens_BHn",
    "query_lens",
    "causal",
    "causal_lens",
    "attend_mask",
)
LENS_LAYOUTS = ("contiguous", "transposed", "expanded", "strided", "offset", "int32", "float")
LAYOUTS = ("contiguous", "transposed", "sliced", "expanded", "offset")
MAGNITUDES = ("tiny", "normal", "large", "denormal")
SPECIALS = ("none", "pad_nan", "pad_inf", "nan")  # nan: NaN where it is attended
MODES = ("train", "no_grad", "inference_mode")
SIZES = ("small", "mid")
DIMENSIONS = (
    "api",
    "dtype",
    "mask",
    "lens_layout",
    "layout",
    "magnitude",
    "special",
    "mode",
    "size",
)
CHECKS = ("error", "value", "grad", "exact", "padding", "nan")

DENORMAL = {"float64": 1e-310, "float32": 1e-40, "bfloat16": 3e-39, "float16": 3e-6}
MAGNITUDE = {"tiny": 1e-3, "normal": 1.0, "large": 30.0}


# ---- the case: what is drawn ---------------------------------------------------------------


@dataclass
class Case:
    """One drawn case: its categories, sizes and options, and its tensors (logical values,
    float64, already rounded to the case's dtype)."""

    index: int
    api: str
    dtype: str
    mask: str
    lens_layout: str
    layout: str
    magnitude: str
    special: str
    mode: str
    size: str
    weights: bool = False  # return_weights
    four_d: bool = False  # (B, H, n, d) inputs to a single-head form
    B: int = 1
    H: int = 1  # heads (4-D inputs, multi-head); 1 otherwise
    n: int = 1
    m: int = 1
    dq: int = 1
    dk: int = 1
    dv: int = 1
    hidden: int = 1
    options: dict[str, Any] = field(default_factory=dict)
    t: dict[str, Tensor] = field(default_factory=dict)  # logical tensors (float64)
    clean: dict[str, Tensor] = field(default_factory=dict)  # before garbage was put in
    key_lens: Tensor | None = None
    query_lens: Tensor | None = None
    attend: Tensor | None = None
    causal: bool = False
    allowed: Tensor | None = None  # (B, H, n, m) bool, True = attended
    nan_flags: dict[str, Tensor] = field(default_factory=dict)
    garbage_at: str = ""

    def label(self) -> str:
        dims = " ".join(f"{d}={getattr(self, d)}" for d in DIMENSIONS)
        shape = f"B={self.B} H={self.H} n={self.n} m={self.m} d={self.dq}/{self.dk}/{self.dv}"
        extra = " weights" if self.weights else ""
        where = f" garbage@{self.garbage_at}" if self.garbage_at else ""
        return f"{dims} {shape}{extra}{where}"

    @property
    def heads_api(self) -> bool:
        return self.api == "MultiHeadAttention"


def _pick(
    rng: random.Random, choices: Iterable[str], weights: dict[str, float] | None = None
) -> str:
    items = list(choices)
    w = [(weights or {}).get(c, 1.0) for c in items]
    return rng.choices(items, w)[0]


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


def draw(seed: int, index: int) -> Case:
    """Draw case ``index`` of ``seed`` (the same on every run and machine)."""
    rng = random.Random(seed * 1_000_003 + index)
    api = _pick(rng, APIS, {"masked_softmax": 1.5, "MultiHeadAttention": 1.2})
    c = Case(
        index=index,
        api=api,
        dtype=_pick(rng, DTYPES),
        mask="none",
        lens_layout="contiguous",
        layout=_pick(rng, LAYOUTS, {"contiguous": 2.0}),
        magnitude=_pick(rng, MAGNITUDES, {"normal": 3.0}),
        special=_pick(rng, SPECIALS, {"none": 3.0}),
        mode=_pick(rng, MODES, {"train": 1.5}),
        size=_pick(rng, SIZES, {"small": 1.5}),
    )
    c.four_d = not c.heads_api and rng.random() < 0.4
    masks = list(MASKS)
    if api == "masked_softmax":
        masks = ["none", "lens_B", "lens_Bn", "lens_BHn"]
    if not c.four_d:
        masks.remove("lens_BHn")
    c.mask = _pick(rng, masks, {"none": 0.6, "lens_B": 1.5, "lens_Bn": 1.5})
    c.lens_layout = _pick(rng, LENS_LAYOUTS, {"contiguous": 2.0})
    c.weights = api not in ("masked_softmax",) and rng.random() < 0.25
    _draw_sizes(c, rng)
    _draw_options(c, rng)
    if c.key_lens is None and c.query_lens is None:
        c.lens_layout = "n/a"
    _make_tensors(c, rng, torch.Generator().manual_seed(seed * 1_000_003 + index))
    return c


def _draw_sizes(c: Case, rng: random.Random) -> None:
    c.B = rng.randint(2 if c.layout == "expanded" else 1, 3)
    c.H = rng.randint(1, 3) if (c.four_d or c.heads_api) else 1
    if c.size == "small":
        c.n, c.m = rng.randint(1, 8), rng.randint(1, 8)
        c.dq = rng.randint(1, 8)
    else:
        c.n, c.m = _log_uniform(rng, 9, 300), _log_uniform(rng, 9, 300)
        c.dq = rng.randint(8, 64)
    if c.api in (
        "f.additive_attention",
        "AdditiveAttention",
        "f.general_attention",
        "MultiplicativeAttention",
    ):  # queries and keys of their own sizes
        c.dk = max(1, c.dq + rng.randint(-3, 3))
    else:
        c.dk = c.dq
    c.dv = rng.randint(1, 8) if c.size == "small" else rng.randint(4, 64)
    c.hidden = rng.randint(1, 8) if c.size == "small" else rng.randint(4, 16)
    if c.heads_api:  # model size E = H * head size; input sizes differ
        c.hidden = c.H * (rng.randint(1, 4) if c.size == "small" else rng.randint(4, 16))
        c.dk = rng.randint(1, 8) if c.size == "small" else rng.randint(8, 48)
        c.dv = rng.randint(1, 8) if c.size == "small" else rng.randint(8, 48)
    # Keep the reference (float64 with autograd, the (n, m, h) tensor of additive scores)
    # and the 16-bit plain maths cheap.
    features = c.hidden if "dditive" in c.api else c.dk
    if c.heads_api:
        features = c.hidden // c.H
    budget = 3_000_000 if "dditive" not in c.api else 600_000
    while c.B * c.H * c.n * c.m * (features + c.dv) > budget:
        if c.B > 1:
            c.B -= 1
        elif c.H > 1 and not c.heads_api:
            c.H -= 1
        elif c.n >= c.m:
            c.n = max(9, c.n * 3 // 4)
        else:
            c.m = max(9, c.m * 3 // 4)


def _lens_values(rng: random.Random, shape: tuple[int, ...], top: int) -> Tensor:
    """Lengths in [0, top + 3]: 0, exactly top and above top often."""
    values = []
    for _ in range(math.prod(shape)):
        r = rng.random()
        if r < 0.15:
            values.append(0)
        elif r < 0.3:
            values.append(top)
        elif r < 0.4:
            values.append(top + rng.randint(1, 3))
        else:
            values.append(rng.randint(0, top))
    return torch.tensor(values, dtype=torch.int64).reshape(shape)


def _draw_options(c: Case, rng: random.Random) -> None:
    B, H, n, m = c.B, c.H, c.n, c.m
    expand = c.lens_layout == "expanded"
    key_shape: tuple[int, ...] | None = None
    if c.mask in ("lens_B", "query_lens", "causal_lens", "attend_mask"):
        key_shape = (B,)
        if c.mask == "causal_lens" and rng.random() < 0.5:
            key_shape = (B, n)
        if c.mask in ("query_lens", "attend_mask") and rng.random() < 0.5:
            key_shape = None
    elif c.mask == "lens_Bn":
        key_shape = (B, n)
    elif c.mask == "lens_BHn":
        key_shape = (B, H, n)
    if key_shape is not None:
        if expand:  # one value along the last dimension, which the layout expands
            c.key_lens = _lens_values(rng, (*key_shape[:-1], 1), m).expand(key_shape).clone()
        else:
            c.key_lens = _lens_values(rng, key_shape, m)
    if c.mask == "query_lens":
        shape = (B, H) if (c.four_d and rng.random() < 0.5) else (B,)
        c.query_lens = _lens_values(rng, shape, n)
    c.causal = c.mask in ("causal", "causal_lens")
    if c.mask == "attend_mask":
        if c.heads_api:
            shape = rng.choice([(n, m), (B, n, m), (B, H, n, m)])
        elif c.four_d:
            shape = rng.choice([(n, m), (B, 1, n, m), (B, H, n, m)])
        else:
            shape = rng.choice([(n, m), (B, n, m)])
        gen = torch.Generator().manual_seed(rng.getrandbits(48))
        c.attend = torch.rand(shape, generator=gen) < 0.7
        if n > 1 and rng.random() < 0.5:  # a row that attends nothing
            c.attend[..., rng.randrange(n), :] = False
    options: dict[str, Any] = {}
    if c.api == "f.dot_product_attention":
        options["scale"] = rng.choice([None, None, 1.0, 0.5])
    elif c.api == "DotProductAttention":
        options["scale"] = rng.choice([None, None, 1.0, 0.3])
    elif c.api == "f.cosine_attention":
        options["scale"] = rng.choice([10.0, 5.0, 1.0])
    elif c.api == "CosineAttention":
        options["scale"] = rng.choice([10.0, 4.0])
        options["learn_scale"] = rng.random() < 0.5
    elif c.api == "f.additive_attention":
        options["bias"] = rng.random() < 0.5
        options["w_v_2d"] = rng.random() < 0.5
    elif c.api == "AdditiveAttention":
        options["bias"] = rng.random() < 0.5
        options["normalize"] = rng.random() < 0.25
    elif c.api == "MultiHeadAttention":
        options["bias"] = rng.random() < 0.5
        options["scoring"] = rng.choice(["scaled_dot", "scaled_dot", "dot"])
    c.options = options


def _data(gen: torch.Generator, shape: tuple[int, ...], scale: float, dtype: torch.dtype) -> Tensor:
    """Normal values times ``scale``, rounded to ``dtype``, held as float64."""
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).double()


def _make_tensors(c: Case, rng: random.Random, gen: torch.Generator) -> None:
    dtype = DTYPES[c.dtype]
    mag = DENORMAL[c.dtype] if c.magnitude == "denormal" else MAGNITUDE[c.magnitude]
    lead = (c.B, c.H) if c.four_d else (c.B,)
    expanded = c.layout == "expanded" and c.special == "none"
    if c.layout == "expanded" and not expanded:
        c.layout = "contiguous"  # garbage needs entries of their own

    def data(*shape: int) -> Tensor:
        if expanded:  # one example's values, expanded over the batch
            return _data(gen, (1, *shape[1:]), mag, dtype).expand(shape).clone()
        return _data(gen, shape, mag, dtype)

    t: dict[str, Tensor] = {}
    if c.api == "masked_softmax":
        t["x"] = data(*lead, c.n, c.m)
    else:
        t["q"] = data(*lead, c.n, c.dq)
        t["k"] = data(*lead, c.m, c.dk)
        t["v"] = data(*lead, c.m, c.dv)

    def param(*shape: int, fan_in: int) -> Tensor:
        return _data(gen, shape, 1.0 / math.sqrt(max(fan_in, 1)), dtype)

    h = c.hidden
    o = c.options
    if c.api in ("f.additive_attention", "AdditiveAttention"):
        t["W_q"] = param(h, c.dq, fan_in=c.dq)
        t["W_k"] = param(h, c.dk, fan_in=c.dk)
        t["w_v"] = param(h, fan_in=h)
        if o.get("bias"):
            t["b"] = param(h, fan_in=1) * 0.5
        if o.get("normalize"):
            t["g"] = (torch.rand((), generator=gen, dtype=torch.float64) + 0.5).to(dtype).double()
    elif c.api in ("f.general_attention", "MultiplicativeAttention"):
        t["W_a"] = param(c.dq, c.dk, fan_in=max(c.dq, c.dk))
    elif c.api == "CosineAttention":
        t["log_scale"] = torch.tensor(math.log(o["scale"])).to(dtype).double()
    elif c.heads_api:
        E = h
        for name, fan in (("W_q", c.dq), ("W_k", c.dk), ("W_v", c.dv), ("W_o", E)):
            t[f"{name}.weight"] = param(E, fan, fan_in=fan)
            if o.get("bias"):
                t[f"{name}.bias"] = param(E, fan_in=1) * 0.5
    c.allowed = _allowed(c)
    c.clean = {k: v.clone() for k, v in t.items()}
    c.t = t
    if c.special != "none":
        _put_garbage(c, rng)


def _allowed(c: Case) -> Tensor:
    """(B, H, n, m) bool: which keys each query attends (the textbook's mask)."""
    B, H, n, m = c.B, c.H, c.n, c.m
    allowed = torch.ones(B, H, n, m, dtype=torch.bool)
    cols = torch.arange(m)
    if c.key_lens is not None:
        L = c.key_lens
        L = L.reshape(B, 1, 1) if L.ndim == 1 else (L.reshape(B, 1, n) if L.ndim == 2 else L)
        allowed &= cols < L[..., None]
    if c.causal:
        allowed &= cols[None, :] <= torch.arange(n)[:, None]
    if c.query_lens is not None:
        ql = c.query_lens.reshape(B, 1) if c.query_lens.ndim == 1 else c.query_lens
        allowed &= (torch.arange(n) < ql[..., None])[..., None]
    if c.attend is not None:
        a = c.attend
        if not c.four_d and a.ndim == 3:  # (B, n, m): every head
            a = a[:, None]
        allowed &= a
    return allowed


def _put_garbage(c: Case, rng: random.Random) -> None:
    """NaN or inf in padding (``pad_nan``, ``pad_inf``), or NaN in attended positions
    (``nan``); records where, and for ``nan`` which rows must turn NaN."""
    assert c.allowed is not None
    allowed, t = c.allowed, c.t
    B, H = c.B, c.H
    nan = c.special in ("pad_nan", "nan")

    def bad() -> float:
        return math.nan if nan else rng.choice([math.inf, -math.inf])

    places: list[str] = []
    if c.api == "masked_softmax":
        x = t["x"] if c.four_d else t["x"][:, None]
        want = ~allowed if c.special != "nan" else allowed
        spots = want.nonzero().tolist()
        rng.shuffle(spots)
        flags = torch.zeros_like(allowed)
        for b, hh, i, j in spots[: rng.randint(1, 4)]:
            x[b, hh, i, j] = bad()
            flags[b, hh, i, j] = True
            places.append(f"x[{b},{hh},{i},{j}]")
        c.nan_flags["x"] = flags
    else:
        if c.heads_api:  # a row of the inputs feeds every head
            key_used = allowed.any(dim=2).any(dim=1, keepdim=True)  # (B, 1, m)
            query_used = allowed.any(dim=3).any(dim=1, keepdim=True)  # (B, 1, n)
        else:
            key_used = allowed.any(dim=2)  # (B, H, m)
            query_used = allowed.any(dim=3)  # (B, H, n)
        attended = c.special == "nan"
        for name, used in (("k", key_used), ("v", key_used), ("q", query_used)):
            x = t[name] if c.four_d else t[name][:, None]  # (B, H | 1, rows, d)
            spots = (used if attended else ~used).nonzero().tolist()
            rng.shuffle(spots)
            flags = torch.zeros_like(used)
            # NaN in an attended key or value is documented to propagate; in a query it
            # is not (PyTorch's SDPA gives such a row zeros): queries get padding only.
            if spots and rng.random() < 0.7 and not (attended and name == "q"):
                for b, hh, r in spots[: rng.randint(1, 2)]:
                    col = rng.randrange(x.shape[-1])
                    if rng.random() < 0.3 and not attended:
                        x[b, hh, r, :] = bad()
                    else:
                        x[b, hh, r, col] = bad()
                    flags[b, hh, r] = True
                    places.append(f"{name}[{b},{hh},{r}]")
            c.nan_flags[name] = flags
    if not places:  # nothing to hold garbage: the case is a plain one
        c.special = "none"
        c.nan_flags = {}
    c.garbage_at = ",".join(places[:4]) + ("..." if len(places) > 4 else "")
    del B, H


# ---- the reference: textbook formulation, in float64 (or the case's dtype: "plain") --------


class _GradNoise(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by (1 + u): the rounding of the
    backward's own arithmetic at that point (it breaks cancellations as rounding does)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, u: Tensor) -> Tensor:
        ctx.save_for_backward(u)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (u,) = ctx.saved_tensors
        return grad * (1.0 + u), None


class _NoisyTanh(torch.autograd.Function):
    """tanh whose backward's 1 - t^2 is taken from t times (1 + u): in saturated units the
    derivative is a cancellation, as it is in any dtype's arithmetic."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, u: Tensor) -> Tensor:
        t = torch.tanh(x)
        ctx.save_for_backward(t, u)
        return t

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        t, u = ctx.saved_tensors
        return grad * (1.0 - (t * (1.0 + u)) ** 2), None


class _SoftmaxD(torch.autograd.Function):
    """Softmax whose backward's row term D = sum_j P_ij g_ij is off by u * sum_j P_ij |g_ij|
    (u per row): the error of a kernel that takes D as rowsum(dO * O) from a rounded O. It
    is what a saturated row's gradient is made of (the exact one cancels to 0)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, u: Tensor) -> Tensor:
        p = torch.softmax(x, dim=-1)
        ctx.save_for_backward(p, u)
        return p

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        p, u = ctx.saved_tensors
        pg = p * grad
        d = pg.sum(dim=-1, keepdim=True) + u * pg.abs().sum(dim=-1, keepdim=True)
        return pg - p * d, None


class Noise:
    """A rounding model of the case's dtype for the float64 reference: at each point where
    the library's arithmetic rounds, values (and, in the backward, their gradients) are
    multiplied by (1 + eps * u), u uniform in [-1, 1]; softmax rows also by a common factor
    (1 + eps * max|score| * u), the error of a log-sum-exp that a kernel recomputes. The
    exact model (``eps`` 0) changes nothing."""

    def __init__(self, gen: torch.Generator | None = None, eps: float = 0.0) -> None:
        self.gen, self.eps = gen, eps

    def _u(self, shape: torch.Size | tuple[int, ...]) -> Tensor:
        return (torch.rand(shape, generator=self.gen, dtype=torch.float64) * 2.0 - 1.0) * self.eps

    def __call__(self, x: Tensor) -> Tensor:
        if not self.eps:
            return x
        x = x * (1.0 + self._u(x.shape))
        return _GradNoise.apply(x, self._u(x.shape)) if x.requires_grad else x

    def tanh(self, x: Tensor) -> Tensor:
        if not self.eps or not x.requires_grad:
            return torch.tanh(x)
        return _NoisyTanh.apply(x, self._u(x.shape))

    def rows(self, w: Tensor, scores: Tensor, allowed: Tensor) -> Tensor:
        if not self.eps:
            return w
        top = scores.detach().abs().masked_fill(~allowed, 0).amax(dim=-1, keepdim=True)
        return w * (1.0 + top * self._u(top.shape))


EXACT = Noise()


def _scores(c: Case, t: dict[str, Tensor], z: Noise) -> Tensor:
    """Scores (B, H, n, m) of the textbook formulation; for the multi-head module, per head.
    ``z`` is applied where a computation in the case's dtype rounds."""
    api = c.api
    if c.heads_api:
        E = c.hidden

        def proj(x: Tensor, name: str) -> Tensor:
            y = x @ t[f"{name}.weight"].T
            if f"{name}.bias" in t:
                y = y + t[f"{name}.bias"]
            return z(y).unflatten(-1, (c.H, E // c.H)).transpose(1, 2)

        q, k = proj(t["q"], "W_q"), proj(t["k"], "W_k")
        scale = 1.0 if c.options["scoring"] == "dot" else 1.0 / math.sqrt(E // c.H)
        return z((q @ k.transpose(-1, -2)) * scale)
    q, k = (t["q"], t["k"]) if c.four_d else (t["q"][:, None], t["k"][:, None])
    if api in ("f.dot_product_attention", "DotProductAttention"):
        scale = c.options["scale"]
        scale = 1.0 / math.sqrt(max(c.dq, 1)) if scale is None else scale
        return z((q @ k.transpose(-1, -2)) * scale)
    if api in ("f.general_attention", "MultiplicativeAttention"):
        return z(z(q @ t["W_a"]) @ k.transpose(-1, -2))
    if api in ("f.cosine_attention", "CosineAttention"):
        tiny = torch.finfo(DTYPES[c.dtype]).tiny  # the library's documented clamp
        qu = z(q / q.norm(dim=-1, keepdim=True).clamp(min=tiny))
        ku = z(k / k.norm(dim=-1, keepdim=True).clamp(min=tiny))
        s = t["log_scale"].exp() if "log_scale" in t else c.options["scale"]
        return z((qu * s) @ ku.transpose(-1, -2))
    if api in ("f.additive_attention", "AdditiveAttention"):
        qh = q @ t["W_q"].T
        if "b" in t:
            qh = qh + t["b"]
        kh = k @ t["W_k"].T
        w = t["w_v"]
        if "g" in t:
            w = t["g"] * w / w.norm()
        return z(z(z.tanh(z(qh)[..., :, None, :] + z(kh)[..., None, :, :])) @ w)
    raise AssertionError(api)


def _masked_softmax(scores: Tensor, allowed: Tensor, z: Noise = EXACT) -> Tensor:
    """Softmax over the allowed keys, zeros elsewhere and in rows with none."""
    some = allowed.any(dim=-1, keepdim=True)
    filled = scores.masked_fill(~allowed, -math.inf).masked_fill(~some, 0.0)
    if z.eps and filled.requires_grad:
        return _SoftmaxD.apply(filled, z._u((*filled.shape[:-1], 1))) * allowed
    return torch.softmax(filled, dim=-1) * allowed


def reference(c: Case, t: dict[str, Tensor], z: Noise = EXACT) -> tuple[dict[str, Tensor], float]:
    """The results (``out``, ``weights``) of the textbook formulation on tensors ``t``
    (any dtype: float64 for the reference, the case's dtype for the plain maths), and the
    largest score that is attended. ``z``: see :func:`_scores`."""
    assert c.allowed is not None
    allowed = c.allowed
    t = {k: z(v) for k, v in t.items()}
    if c.api == "masked_softmax":
        x = t["x"] if c.four_d else t["x"][:, None]
        w = z(z.rows(_masked_softmax(x, allowed, z), x, allowed))
        smax = float(x.detach().double().abs().masked_fill(~allowed, 0).amax()) if x.numel() else 0
        return {"out": w if c.four_d else w[:, 0]}, smax
    scores = _scores(c, t, z)
    w = z(z.rows(_masked_softmax(scores, allowed, z), scores, allowed))
    smax = float(scores.detach().double().abs().masked_fill(~allowed, 0).amax())
    if c.heads_api:
        E = c.hidden
        v = t["v"] @ t["W_v.weight"].T
        if "W_v.bias" in t:
            v = v + t["W_v.bias"]
        heads = z(w @ z(v).unflatten(-1, (c.H, E // c.H)).transpose(1, 2))
        out = heads.transpose(1, 2).flatten(-2) @ t["W_o.weight"].T
        if "W_o.bias" in t:
            out = out + t["W_o.bias"]
        return {"out": z(out), "weights": w}, smax
    v = t["v"] if c.four_d else t["v"][:, None]
    out = z(w @ v)
    if not c.four_d:
        out, w = out[:, 0], w[:, 0]
    return {"out": out, "weights": w}, smax


# ---- the library's side: layouts, then the public call ------------------------------------


def _layout(x: Tensor, layout: str, rng: random.Random, dtype: torch.dtype) -> Tensor:
    """``x`` (logical values) in ``dtype``, laid out as ``layout`` says (same values)."""
    y = x.to(dtype)
    if layout == "transposed" and y.ndim >= 2:
        return y.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "sliced" and y.ndim >= 2:
        if rng.random() < 0.5:  # every other row
            big = torch.zeros(*y.shape[:-2], 2 * y.shape[-2], y.shape[-1], dtype=dtype)
            big[..., ::2, :] = y
            return big[..., ::2, :]
        big = torch.zeros(*y.shape[:-1], 2 * y.shape[-1], dtype=dtype)  # every other column
        big[..., 1::2] = y
        return big[..., 1::2]
    if layout == "expanded" and y.ndim >= 3 and y.shape[0] > 1 and bool((y == y[:1]).all()):
        return y[:1].expand(y.shape)
    if layout == "offset":
        offset = rng.randint(1, 7)
        flat = torch.zeros(y.numel() + offset, dtype=dtype)
        flat[offset:] = y.flatten()
        return flat[offset:].view(y.shape)
    return y.contiguous()


def _lens_layout(lens: Tensor, layout: str, rng: random.Random) -> Tensor:
    if layout == "int32":
        return lens.to(torch.int32)
    if layout == "float":
        return lens.to(rng.choice([torch.float32, torch.float64]))
    if layout == "transposed":
        if lens.ndim == 1:  # a column of a (B, 2) tensor
            return torch.stack([lens, torch.zeros_like(lens)], dim=1)[:, 0]
        return (
            lens.permute(*reversed(range(lens.ndim)))
            .contiguous()
            .permute(*reversed(range(lens.ndim)))
        )
    if layout == "expanded":
        if lens.ndim >= 1 and bool((lens == lens[..., :1]).all()):
            return lens[..., :1].expand(lens.shape)
        return lens
    if layout == "strided":
        big = torch.full((*lens.shape[:-1], 3 * lens.shape[-1]), -5, dtype=lens.dtype)
        big[..., ::3] = lens
        return big[..., ::3]
    if layout == "offset":
        offset = rng.randint(1, 3)
        flat = torch.full((lens.numel() + offset,), -5, dtype=lens.dtype)
        flat[offset:] = lens.flatten()
        return flat[offset:].view(lens.shape)
    return lens.contiguous()


GRAD_INPUTS = {"masked_softmax": ("x",)}


def _module(c: Case, dtype: torch.dtype) -> torch.nn.Module:
    o = c.options
    module: torch.nn.Module
    if c.api == "DotProductAttention":
        module = attnscore.DotProductAttention(scale=o["scale"])
    elif c.api == "AdditiveAttention":
        module = attnscore.AdditiveAttention(
            c.dk, c.dq, c.hidden, bias=o["bias"], normalize=o["normalize"]
        )
    elif c.api == "MultiplicativeAttention":
        module = attnscore.MultiplicativeAttention(c.dq, c.dk)
    elif c.api == "CosineAttention":
        module = attnscore.CosineAttention(scale=o["scale"], learn_scale=o["learn_scale"])
    else:
        module = attnscore.MultiHeadAttention(c.hidden, c.H, bias=o["bias"], scoring=o["scoring"])
        with torch.no_grad():  # materialise the lazy projections
            module(torch.zeros(1, 1, c.dq), torch.zeros(1, 1, c.dk), torch.zeros(1, 1, c.dv))
    module = module.to(dtype)
    tensors = dict(module.named_parameters())
    tensors.update(dict(module.named_buffers()))
    names = {  # the reference's names of the module's tensors
        "W_q.weight": "W_q",
        "W_k.weight": "W_k",
        "w_v.weight": "w_v",
        "W_a.weight": "W_a",
    }
    with torch.no_grad():
        for name, held in tensors.items():
            ref_name = name if c.heads_api else names.get(name, name)
            if ref_name in c.t:
                held.copy_(c.t[ref_name].reshape(held.shape))
    if c.api == "AdditiveAttention" and o["bias"] and "b" not in c.t:
        raise AssertionError("bias drawn but not made")
    module.train(c.mode == "train")
    return module


def _param_name(c: Case, name: str) -> str:
    if c.heads_api:
        return name
    return {"W_q.weight": "W_q", "W_k.weight": "W_k", "w_v.weight": "w_v", "W_a.weight": "W_a"}.get(
        name, name
    )


def call_library(
    c: Case, rng: random.Random, module: torch.nn.Module | None
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Run the case through the public API (``module``: the case's module, built outside
    ``no_grad`` / ``inference_mode`` as a user builds it); return its results and the
    tensors whose gradients may be compared (by the reference's names)."""
    dtype = DTYPES[c.dtype]
    train = c.mode == "train"
    inputs: dict[str, Tensor] = {}
    for name in ("x", "q", "k", "v"):
        if name in c.t:
            base = _layout(c.t[name], c.layout, rng, dtype)
            if train:  # the gradient is taken with respect to the view the call gets
                base = base.detach().requires_grad_()  # keeps the layout's strides
                inputs[name] = base
            else:
                inputs[name] = base
    lens = None if c.key_lens is None else _lens_layout(c.key_lens, c.lens_layout, rng)
    masks: dict[str, Any] = {}
    if c.query_lens is not None:
        masks["query_valid_lens"] = _lens_layout(c.query_lens, c.lens_layout, rng)
    if c.causal:
        masks["causal"] = True
    if c.attend is not None:
        masks["attend_mask"] = c.attend
    if c.weights:
        masks["return_weights"] = True
    grads: dict[str, Tensor] = dict(inputs) if train else {}
    api, o = c.api, c.options
    params: dict[str, Tensor] = {}
    if api.startswith("f."):
        for name in ("W_q", "W_k", "w_v", "b", "W_a"):
            if name in c.t:
                p = c.t[name].to(dtype)
                if name == "w_v" and o.get("w_v_2d"):
                    p = p.reshape(1, -1)
                params[name] = p.requires_grad_(train)
        grads.update({k: v for k, v in params.items() if train})
    q, k, v = inputs.get("q"), inputs.get("k"), inputs.get("v")
    result: Any
    if api == "masked_softmax":
        result = attnscore.masked_softmax(inputs["x"], lens)
    elif api == "f.dot_product_attention":
        result = AF.dot_product_attention(q, k, v, lens, scale=o["scale"], **masks)
    elif api == "f.additive_attention":
        p = params
        result = AF.additive_attention(
            q, k, v, p["W_q"], p["W_k"], p["w_v"], lens, bias=p.get("b"), **masks
        )
    elif api == "f.general_attention":
        result = AF.general_attention(q, k, v, params["W_a"], lens, **masks)
    elif api == "f.cosine_attention":
        result = AF.cosine_attention(q, k, v, lens, scale=o["scale"], **masks)
    else:
        assert module is not None
        if train:
            for name, p in module.named_parameters():
                if p.requires_grad:
                    grads[_param_name(c, name)] = p
        result = module(q, k, v, lens, **masks)
    out: dict[str, Tensor] = {}
    if isinstance(result, tuple):
        out["out"], out["weights"] = result
    else:
        out["out"] = result
    return out, grads


# ---- comparing -----------------------------------------------------------------------------


@dataclass
class Expected:
    """The reference's results and gradients (float64), with the plain maths' error per
    tensor, which rows must be NaN, and which entries must be exact zeros."""

    results: dict[str, Tensor]
    grads: dict[str, Tensor]
    plain_err: dict[str, float]
    sens: dict[str, float]
    smax: float
    nan_rows: dict[str, Tensor]
    zeros: dict[str, Tensor]
    upstream: dict[str, Tensor]


def _max_err(a: Tensor, b: Tensor, sel: Tensor | None) -> float:
    d = (a.double() - b.double()).abs()
    if sel is not None:
        d = d[sel]
    if d.numel() == 0:
        return 0.0
    return float(d.max())


def _reference_grads(
    c: Case,
    t: dict[str, Tensor],
    upstream: dict[str, Tensor],
    names: Iterable[str],
    z: Noise = EXACT,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    names = [k for k in names if k in t]
    leaves = {k: v.detach().clone().requires_grad_(k in names) for k, v in t.items()}
    with torch.enable_grad():
        results, _ = reference(c, leaves, z)
        if names:
            keys = [k for k in upstream if k in results]
            gs = torch.autograd.grad(
                [results[k] for k in keys],
                [leaves[k] for k in names],
                [upstream[k].to(results[k].dtype) for k in keys],
                allow_unused=True,
            )
        else:
            gs = ()
    grads = {
        k: torch.zeros_like(leaves[k]) if g is None else g for k, g in zip(names, gs, strict=True)
    }
    return {k: v.detach() for k, v in results.items()}, grads


def grad_names(c: Case) -> list[str]:
    names = [k for k in ("x", "q", "k", "v") if k in c.t]
    if c.api.startswith("f."):
        names += [k for k in ("W_q", "W_k", "w_v", "b", "W_a") if k in c.t]
    elif c.api != "masked_softmax":
        for name in c.t:
            if name in names:
                continue
            if name == "log_scale" and not c.options.get("learn_scale"):
                continue
            if c.heads_api and c.special in ("pad_nan", "pad_inf") and name[:3] != "W_o":
                continue  # nn.Linear's weight gradient reads every input row (0 * NaN)
            names.append(name)
    return names


def _shapes(c: Case) -> dict[str, tuple[int, ...]]:
    lead = (c.B, c.H) if c.four_d else (c.B,)
    if c.api == "masked_softmax":
        return {"out": (*lead, c.n, c.m)}
    if c.heads_api:
        return {"out": (c.B, c.n, c.hidden), "weights": (c.B, c.H, c.n, c.m)}
    return {"out": (*lead, c.n, c.dv), "weights": (*lead, c.n, c.m)}


NOISE_DRAWS = 2


def expect(c: Case, gen: torch.Generator) -> Expected:
    """Compute what the library must give for case ``c``: the float64 reference, its
    gradients, and the budget's parts (the plain maths' error in the case's dtype, and how
    far the reference moves when every rounding point of the formulation is perturbed by
    the dtype's eps: cancellation, saturated softmax rows, long sums)."""
    assert c.allowed is not None
    dtype = DTYPES[c.dtype]
    train = c.mode == "train"
    shapes = _shapes(c)
    want = ["out"] + (["weights"] if c.weights else [])
    upstream = {
        k: torch.randn(shapes[k], generator=gen, dtype=torch.float64).to(dtype).double()
        for k in want
    }
    names = grad_names(c) if train else []
    results, grads = _reference_grads(c, c.clean, upstream, names)
    _, smax = reference(c, c.clean)
    results = {k: results[k] for k in want}
    nan_rows = _nan_rows(c)
    keep = {k: ~_row_mask(nan_rows[k], results[k]) for k in results if k in nan_rows}
    plain_err: dict[str, float] = {}

    def spread(
        other: dict[str, Tensor], other_grads: dict[str, Tensor], into: dict[str, float]
    ) -> None:
        for k in results:
            err = _max_err(other[k], results[k], keep.get(k))
            into[k] = max(into.get(k, 0.0), err)
        for k in grads:
            err = _max_err(other_grads[k], grads[k], None)
            into["grad " + k] = max(into.get("grad " + k, 0.0), err)

    if dtype != torch.float64:
        low = {k: v.to(dtype) for k, v in c.clean.items()}
        ups = {k: v.to(dtype) for k, v in upstream.items()}
        spread(*_reference_grads(c, low, ups, names), plain_err)
    sens: dict[str, float] = {}
    eps = torch.finfo(dtype).eps
    for _ in range(NOISE_DRAWS):
        spread(*_reference_grads(c, c.clean, upstream, names, Noise(gen, eps)), sens)
    return Expected(results, grads, plain_err, sens, smax, nan_rows, _zeros(c, results), upstream)


def _row_mask(rows: Tensor, like: Tensor) -> Tensor:
    return rows[..., None].expand(like.shape)


def _nan_rows(c: Case) -> dict[str, Tensor]:
    """Rows (of ``out`` and ``weights``) that must be NaN: those that attend a NaN."""
    if c.special != "nan":
        return {}
    assert c.allowed is not None
    allowed = c.allowed
    f = c.nan_flags
    if c.api == "masked_softmax":
        rows = (allowed & f["x"]).any(dim=-1)
        return {"out": rows if c.four_d else rows[:, 0]}
    some = allowed.any(dim=-1)

    def hits(flags: Tensor) -> Tensor:  # (B, H|1, m) -> rows (B, H, n) attending one
        return (allowed & flags[:, :, None, :]).any(dim=-1)

    w_rows = hits(f["k"]) | (f["q"] & some)
    o_rows = w_rows | hits(f["v"])
    if c.heads_api:
        return {"out": o_rows.any(dim=1), "weights": w_rows}
    if not c.four_d:
        return {"out": o_rows[:, 0], "weights": w_rows[:, 0]}
    return {"out": o_rows, "weights": w_rows}


def _zeros(c: Case, results: dict[str, Tensor]) -> dict[str, Tensor]:
    """Entries that must be exactly zero (masked weights, output of queries with no key,
    gradients of padding)."""
    assert c.allowed is not None
    allowed = c.allowed
    nan_rows = _nan_rows(c)
    zeros: dict[str, Tensor] = {}

    def squeeze(x: Tensor) -> Tensor:
        return x if (c.four_d or c.heads_api) else x[:, 0]

    masked = squeeze(~allowed)
    if c.api == "masked_softmax":
        zeros["out"] = masked
        if c.mode == "train":
            zeros["grad x"] = masked
    else:
        if "weights" in results:
            zeros["weights"] = masked
        idle = ~allowed.any(dim=-1)  # (B, H, n)
        if c.heads_api:
            idle_rows = idle.all(dim=1)  # (B, n) idle in every head
            padded = ~allowed.any(dim=2).any(dim=1)  # (B, m)
        else:
            idle_rows, padded = squeeze(idle), squeeze(~allowed.any(dim=2))
            zeros["out"] = _row_mask(idle_rows, results["out"])
        if c.mode == "train":
            zeros["grad q"] = _row_mask(idle_rows, c.t["q"])
            zeros["grad k"] = _row_mask(padded, c.t["k"])
            zeros["grad v"] = _row_mask(padded, c.t["v"])
    for k, rows in nan_rows.items():
        if k in zeros:
            zeros[k] = zeros[k] & ~_row_mask(rows, zeros[k])
    return zeros


def tolerance(c: Case, exp: Expected, key: str, ref: Tensor, sel: Tensor | None) -> float:
    """The budget of tensor ``key``: 4x the error of the plain maths in the case's dtype,
    plus 8x (gradients: 16x) how far the float64 reference moves under the dtype's rounding model
    (:class:`Noise`), plus the dtype's eps times the tensor's magnitude (its final rounding)
    and a few subnormal steps per reduced term (denormal inputs)."""
    dtype = DTYPES[c.dtype]
    fi = torch.finfo(dtype)
    vals = ref.abs() if sel is None else ref.abs()[sel]
    mag = float(vals.max()) if vals.numel() else 0.0
    length = max(c.m, c.dq, c.dk, c.dv, c.hidden, c.n if key.startswith("grad") else 1)
    perr = exp.plain_err.get(key, 0.0)
    sens = exp.sens.get(key, 0.0)
    perr = perr if math.isfinite(perr) else 0.0
    sens = sens if math.isfinite(sens) else 0.0
    subnormal = fi.smallest_normal * fi.eps
    grow = 16.0 if key.startswith("grad") else 8.0  # a backward rounds more, and per row
    return 4.0 * perr + grow * sens + fi.eps * mag + 4.0 * (length + 1) * subnormal


def compare(
    c: Case, exp: Expected, got: dict[str, Tensor], grads: dict[str, Tensor]
) -> list[tuple[str, str]]:
    """Failures as (check, message)."""
    failures: list[tuple[str, str]] = []
    garbage = c.special in ("pad_nan", "pad_inf")
    for key, ref in [*exp.results.items(), *(("grad " + k, g) for k, g in exp.grads.items())]:
        if key.startswith("grad "):
            g = grads.get(key[5:])
            if g is None:
                continue
            if key[5:] not in ("x", "q", "k", "v") and g.numel() == ref.numel():
                g = g.reshape(ref.shape)  # w_v (1, h) as the reference's (h,)
        else:
            g = got[key]
        if tuple(g.shape) != tuple(ref.shape):
            failures.append(
                ("value", f"{key}: shape {tuple(g.shape)}, expected {tuple(ref.shape)}")
            )
            continue
        if g.dtype != DTYPES[c.dtype] and key in ("out", "weights"):
            failures.append(("value", f"{key}: dtype {g.dtype}, expected {c.dtype}"))
        g = g.detach().double()
        # Where the plain maths in the case's dtype is off by half the result's magnitude,
        # that dtype cannot compute it (float16 gradients of large inputs overflow or
        # cancel): nothing is asked of the library there.
        magnitude = float(ref.abs().max()) if ref.numel() else 0.0
        if c.dtype != "float64" and exp.plain_err.get(key, 0.0) >= 0.5 * magnitude > 0:
            continue
        sel = None
        rows = exp.nan_rows.get(key)
        if rows is not None:
            got_rows = torch.isnan(g).any(dim=-1)
            if not torch.equal(got_rows, rows):
                missing = int((rows & ~got_rows).sum())
                extra = int((got_rows & ~rows).sum())
                failures.append(
                    ("nan", f"{key}: {missing} rows attending a NaN are not NaN, {extra} rows "
                     f"not attending one are NaN")
                )  # fmt: skip
            sel = ~_row_mask(rows | got_rows, g)
        finite = torch.isfinite(g) if sel is None else (torch.isfinite(g) | ~sel)
        if not bool(finite.all()):
            bad = int((~finite).sum())
            check = "padding" if garbage else ("nan" if c.special == "nan" else "value")
            if key.startswith("grad") and check == "value":
                check = "grad"
            failures.append((check, f"{key}: {bad} non-finite where the reference is finite"))
            sel = finite if sel is None else sel & finite
        zeros = exp.zeros.get(key)
        if zeros is not None:
            z = zeros if sel is None else zeros & sel
            nonzero = int((g[z] != 0).sum())
            if nonzero:
                failures.append(("exact", f"{key}: {nonzero} entries not exactly 0"))
        err = _max_err(g, ref, sel)
        tol = tolerance(c, exp, key, ref, sel)
        kind = (c.dtype, "grad" if key.startswith("grad") else key)
        RATIOS[kind] = max(RATIOS.get(kind, 0.0), err / tol if tol > 0 else math.inf * err)
        if not err <= tol:
            check = "grad" if key.startswith("grad") else "value"
            failures.append((check, f"{key}: max error {err:.3g} > budget {tol:.3g}"))
    return failures


#: The largest error / budget ratio seen, by (dtype, result): how close the budget is.
RATIOS: dict[tuple[str, str], float] = {}


# ---- running -------------------------------------------------------------------------------


@dataclass
class Outcome:
    case: Case
    threads: int
    failures: list[tuple[str, str]]
    seconds: float


def run_case(c: Case, exp: Expected, threads: int, seed: int) -> list[tuple[str, str]]:
    """Failures of case ``c`` run on ``threads`` threads. Non-finite results of a case with
    garbage in its padding are blamed on the padding only where the same call without the
    garbage gives finite ones (else they are the arithmetic's: an overflow)."""
    failures = _run_case(c, exp, threads, seed)
    if not any(check == "padding" for check, _ in failures):
        return failures
    clean = Case(**{**c.__dict__, "t": c.clean, "special": "none", "nan_flags": {}})
    again = {msg for _, msg in _run_case(clean, exp, threads, seed)}
    return [
        (("grad" if msg.startswith("grad") else "value"), msg + " (also without the garbage)")
        if check == "padding" and msg in again
        else (check, msg)
        for check, msg in failures
    ]


def _run_case(c: Case, exp: Expected, threads: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random((seed * 1_000_003 + c.index) * 7 + threads)
    try:
        module = None if c.api in APIS[:5] else _module(c, DTYPES[c.dtype])
        if c.mode == "train":
            got, inputs = call_library(c, rng, module)
            names = [k for k in exp.grads if k in inputs]
            outs = [got[k] for k in exp.upstream if k in got]
            ups = [exp.upstream[k].to(got[k].dtype) for k in exp.upstream if k in got]
            if c.special == "nan":  # NaN that is attended: forward only
                grads: dict[str, Tensor] = {}
            else:
                gs = torch.autograd.grad(outs, [inputs[k] for k in names], ups, allow_unused=True)
                grads = {
                    k: (torch.zeros_like(inputs[k]) if g is None else g)
                    for k, g in zip(names, gs, strict=True)
                }
        else:
            ctx = torch.no_grad() if c.mode == "no_grad" else torch.inference_mode()
            with ctx:
                got, _ = call_library(c, rng, module)
            grads = {}
    except Exception as exc:  # the library raised: a failure of its own
        return [("error", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")]
    if c.special == "nan":
        exp = Expected(
            exp.results,
            {},
            exp.plain_err,
            exp.sens,
            exp.smax,
            exp.nan_rows,
            exp.zeros,
            exp.upstream,
        )
    return compare(c, exp, got, grads)


def _threads(values: list[str]) -> list[int]:
    out: list[int] = []
    for v in values:
        for part in v.split(","):
            if part.strip():
                n = int(part)
                if n not in (1, 2):
                    raise argparse.ArgumentTypeError("--threads takes 1 and/or 2")
                if n not in out:
                    out.append(n)
    return out or [1, 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=2000, help="number of cases (2000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draw (0)")
    parser.add_argument(
        "--threads", nargs="*", default=["1", "2"], help="torch threads: 1, 2 or both (1 2)"
    )
    parser.add_argument(
        "--case", type=int, action="append", help="run only this case index (repeatable)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print every case")
    parser.add_argument(
        "--stats", action="store_true", help="print the largest error/budget ratios"
    )
    parser.add_argument(
        "--max-repro", type=int, default=200, help="reproduction lines printed at most (200)"
    )
    args = parser.parse_args(argv)
    threads = _threads(args.threads)
    indices = args.case if args.case else list(range(args.cases))
    warnings.simplefilter("ignore")
    start = time.perf_counter()
    # One pass per thread count (switching torch's thread count per case costs more than
    # the cases: libgomp restarts its pool); each pass draws and computes its references.
    failures: dict[int, list[tuple[int, str, str]]] = {i: [] for i in indices}
    cases: dict[int, Case] = {}
    for t in threads:
        torch.set_num_threads(t)
        for index in indices:
            c = draw(args.seed, index)
            cases[index] = c
            try:
                exp = expect(c, torch.Generator().manual_seed(args.seed * 7919 + index))
            except Exception as exc:  # a bug of the fuzz itself: say so, loudly
                print(f"fuzz error in case {index} ({c.label()}): {exc!r}", file=sys.stderr)
                raise
            for check, msg in run_case(c, exp, t, args.seed):
                failures[index].append((t, check, msg))
    counts: dict[str, Counter[str]] = {d: Counter() for d in DIMENSIONS}
    failed: dict[str, Counter[str]] = {d: Counter() for d in DIMENSIONS}
    by_check: Counter[str] = Counter()
    by_threads: Counter[int] = Counter()
    repros: list[str] = []
    n_failed = 0
    for index in indices:
        c, case_failures = cases[index], failures[index]
        for d in DIMENSIONS:
            counts[d][getattr(c, d)] += 1
        if args.verbose:
            status = "FAIL" if case_failures else "ok"
            print(f"case {index}: {status} {c.label()}")
            for t, check, msg in case_failures:
                print(f"    threads={t} [{check}] {msg}")
        if not case_failures:
            continue
        n_failed += 1
        for d in DIMENSIONS:
            failed[d][getattr(c, d)] += 1
        for check in sorted({f[1] for f in case_failures}):
            by_check[check] += 1
        for t in sorted({f[0] for f in case_failures}):
            by_threads[t] += 1
        ts = " ".join(str(t) for t in sorted({f[0] for f in case_failures}))
        checks = ",".join(sorted({f[1] for f in case_failures}))
        repros.append(
            f"python tools/fuzz_kernels.py --seed {args.seed} --case {index} --threads {ts} -v"
            f"  # [{checks}] {c.label()} :: {case_failures[0][2]}"
        )
    seconds = time.perf_counter() - start
    _report(counts, failed, by_check, by_threads, threads, len(indices), n_failed, seconds)
    if args.stats:
        print("largest error / budget: " + ", ".join(
            f"{d} {k} {r:.3g}" for (d, k), r in sorted(RATIOS.items())))  # fmt: skip
    if repros:
        print(f"\nfailing cases ({len(repros)}); reproduce each with:")
        for line in repros[: args.max_repro]:
            print(line)
        if len(repros) > args.max_repro:
            print(f"... and {len(repros) - args.max_repro} more")
    return 1 if n_failed else 0


def _report(
    counts: dict[str, Counter[str]],
    failed: dict[str, Counter[str]],
    by_check: Counter[str],
    by_threads: Counter[int],
    threads: list[int],
    total: int,
    n_failed: int,
    seconds: float,
) -> None:
    print(f"attnscore kernel fuzz: {total} cases x threads {threads}, {seconds:.1f} s")
    print(f"{'category':<16} {'value':<26} {'cases':>6} {'failed':>7}")
    for d in DIMENSIONS:
        for value, n in sorted(counts[d].items()):
            bad = failed[d][value]
            mark = " <" if bad else ""
            print(f"{d:<16} {value:<26} {n:>6} {bad:>7}{mark}")
    print("failures by check (cases): " + (", ".join(
        f"{k}={by_check[k]}" for k in CHECKS if by_check[k]) or "none"))  # fmt: skip
    print("failures by threads (cases): " + (", ".join(
        f"{t}={by_threads[t]}" for t in threads if by_threads[t]) or "none"))  # fmt: skip
    print(f"total: {total} cases, {n_failed} failed")


if __name__ == "__main__":
    sys.exit(main())
