"""``torch.compile(module, fullgraph=True)`` of every module, in inference and in training,
with every kind of mask (issue 36, item 3).

Each test compiles one function that calls the module with all six mask kinds (none, key
lengths (B,), lengths (B, n), a boolean mask, causal, causal + lengths), so one whole-graph
capture covers them all, and checks outputs (and in training the gradients of the inputs
and parameters) against the plain formulation in float64 (``paths.REFERENCES``).

Backends: ``eager`` in inference: Dynamo captures the whole forward (``fullgraph=True`` makes
any graph break an error), propagating fake tensors through every op, the registered ops'
fake implementations included, and runs the graph eagerly. ``aot_eager`` in training:
AOTAutograd then traces the backward too, through the registered ops' autograd formulas.
Neither generates code (Inductor would add seconds of compilation per test and a C
compiler, and prove nothing more about whether the graph traces whole).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn

import attnscore
from attnscore.scoring import dot_product_scores
from paths import REFERENCES

B, N, M, D, V = 2, 3, 4, 4, 5


def _module(name: str) -> tuple[nn.Module, str]:
    """The module of a case and the registry name of its scores' reference."""
    torch.manual_seed(0)
    made: dict[str, tuple[nn.Module, str]] = {
        "AdditiveAttention": (attnscore.AdditiveAttention(D, D, 6, bias=True), "additive"),
        "DotProductAttention": (attnscore.DotProductAttention(), "scaled_dot"),
        "MultiplicativeAttention": (attnscore.MultiplicativeAttention(D, D), "general"),
        "CosineAttention": (attnscore.CosineAttention(learn_scale=True), "cosine"),
        "ScorerAttention": (attnscore.ScorerAttention("general_scaled", D, D), "general_scaled"),
        "Attention": (attnscore.Attention(dot_product_scores), "scaled_dot"),
        "MultiHeadAttention": (attnscore.MultiHeadAttention(8, 2, bias=True), "scaled_dot"),
    }
    module, ref = made[name]
    module(*_inputs()[:3])  # lazy sizes (multi-head's projections) are fixed by a call
    return module, ref


def _inputs():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(B, N, D, generator=g), torch.randn(B, M, D, generator=g)
    v = torch.randn(B, M, V, generator=g)
    lens = torch.tensor([4, 2])
    per_query = torch.tensor([[4, 0, 2], [1, 3, 4]])
    attend = torch.rand(B, N, M, generator=g) > 0.4
    return q, k, v, lens, per_query, attend


def _all_masks(module, q, k, v, lens, per_query, attend):
    """The module's output under each mask kind, in order."""
    return (
        module(q, k, v),
        module(q, k, v, lens),
        module(q, k, v, per_query),
        module(q, k, v, attend_mask=attend),
        module(q, k, v, causal=True),
        module(q, k, v, lens, causal=True),
    )


def _allowed(lens, per_query, attend):
    """Bool (B, n, m) of each mask kind, in :func:`_all_masks`' order."""
    keys = torch.arange(M)
    by_lens = (keys < lens[:, None, None]).expand(B, N, M)
    causal = (keys[None, :] <= torch.arange(N)[:, None]).expand(B, N, M)
    return (
        torch.ones(B, N, M, dtype=torch.bool),
        by_lens,
        keys < per_query[..., None],
        attend,
        causal,
        causal & by_lens,
    )


def _plain(scores, allowed, v):
    w = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
    return torch.where(allowed, w, 0.0) @ v


def _reference(module, ref, q, k, v, allowed):
    """Each mask kind's output in float64 from the formula, by the module's parameters
    (float64 copies; gradients reach them as ``.grad``)."""
    params = {n: p.detach().double().requires_grad_() for n, p in module.named_parameters()}
    params |= {n: b.double() for n, b in module.named_buffers()}
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    outs = []
    for mask in allowed:
        if isinstance(module, attnscore.MultiHeadAttention):

            def heads(x, name):
                x = x @ params[f"{name}.weight"].T + params[f"{name}.bias"]
                return x.unflatten(-1, (2, -1)).transpose(1, 2)

            qh, kh, vh = heads(q, "W_q"), heads(k, "W_k"), heads(v, "W_v")
            out = _plain(REFERENCES[ref]({}, qh, kh), mask[:, None], vh)
            out = out.transpose(1, 2).flatten(-2) @ params["W_o.weight"].T + params["W_o.bias"]
        else:
            own = {n.removeprefix("attention."): p for n, p in params.items()}
            out = _plain(REFERENCES[ref](own, q, k), mask, v)
        outs.append(out)
    return outs, (q, k, v), params


MODULES = [
    "AdditiveAttention",
    "DotProductAttention",
    "MultiplicativeAttention",
    "CosineAttention",
    "ScorerAttention",
    "Attention",
    "MultiHeadAttention",
]


@pytest.mark.parametrize("training", [False, True], ids=["no_grad", "training"])
@pytest.mark.parametrize("name", MODULES)
def test_compile_fullgraph_every_mask(name, training):
    torch._dynamo.reset()
    module, ref = _module(name)
    module.train(training)
    q, k, v, lens, per_query, attend = _inputs()
    if training:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    compiled = torch.compile(
        lambda *args: _all_masks(module, *args),
        backend="aot_eager" if training else "eager",
        fullgraph=True,
    )
    with contextlib.nullcontext() if training else torch.no_grad():
        got = compiled(q, k, v, lens, per_query, attend)
    want, ref_inputs, ref_params = _reference(
        module, ref, q, k, v, _allowed(lens, per_query, attend)
    )
    for kind, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-5, msg=f"mask kind {kind}")
    if not training:
        assert not any(g.requires_grad for g in got)
        return
    # one backward through all six: each output weighted differently
    weights = [
        torch.randn(w.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        for i, w in enumerate(want)
    ]
    sum(((g.double() * c).sum() for g, c in zip(got, weights, strict=True))).backward()
    sum(((w * c).sum() for w, c in zip(want, weights, strict=True))).backward()
    for t, r in zip((q, k, v), ref_inputs, strict=True):
        torch.testing.assert_close(t.grad.double(), r.grad, atol=1e-5, rtol=1e-5)
    for n, p in module.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref_params[n].grad, atol=1e-5, rtol=1e-5, msg=n)
