"""MultiHeadAttention against torch.nn.MultiheadAttention and per-head references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnscore import DotProductAttention, MultiHeadAttention
from reference import broadcast_lengths, np_dot_scores, np_masked_softmax


def _copy_from_torch(ours: MultiHeadAttention, theirs: torch.nn.MultiheadAttention, x) -> None:
    ours(x, x, x)  # materialise the lazy projections
    E = theirs.embed_dim
    w_q, w_k, w_v = theirs.in_proj_weight.detach().split(E)
    with torch.no_grad():
        for mine, w in ((ours.W_q, w_q), (ours.W_k, w_k), (ours.W_v, w_v)):
            mine.weight.copy_(w)
        ours.W_o.weight.copy_(theirs.out_proj.weight)
        if theirs.in_proj_bias is not None:
            b_q, b_k, b_v = theirs.in_proj_bias.detach().split(E)
            for mine, b in ((ours.W_q, b_q), (ours.W_k, b_k), (ours.W_v, b_v)):
                mine.bias.copy_(b)
            ours.W_o.bias.copy_(theirs.out_proj.bias)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_torch_multihead_attention(bias, causal):
    B, n, E, H = 3, 5, 12, 3
    x = torch.randn(B, n, E)
    theirs = torch.nn.MultiheadAttention(E, H, bias=bias, batch_first=True).eval()
    ours = MultiHeadAttention(E, H, bias=bias).eval()
    _copy_from_torch(ours, theirs, x)
    lens = torch.tensor([5, 2, 1])
    key_padding_mask = torch.arange(n) >= lens[:, None]  # theirs: True = ignore
    causal_mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1) if causal else None
    ref, ref_w = theirs(
        x,
        x,
        x,
        key_padding_mask=key_padding_mask,
        attn_mask=causal_mask,
        average_attn_weights=False,
    )
    out = ours(x, x, x, lens, causal=causal)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.attention_weights, ref_w, atol=1e-5, rtol=1e-5)


def test_heads_equal_independent_single_head_attention():
    B, n, m, E, H = 2, 3, 4, 6, 2
    q, kv = torch.randn(B, n, E, dtype=torch.float64), torch.randn(B, m, E, dtype=torch.float64)
    mha = MultiHeadAttention(E, H).double()
    lens = torch.tensor([[1, 2, 4], [0, 3, 3]])
    out = mha(q, kv, kv, lens)
    d = E // H
    Q, K, V = mha.W_q(q), mha.W_k(kv), mha.W_v(kv)
    heads = []
    for h in range(H):
        s = slice(h * d, (h + 1) * d)
        w = np_masked_softmax(
            np_dot_scores(Q[..., s].detach(), K[..., s].detach()),
            broadcast_lengths(lens.numpy(), (B,), n),
        )
        heads.append(w @ V[..., s].detach().numpy())
        np.testing.assert_allclose(mha.attention_weights[:, h].numpy(), w, atol=1e-12)
    expected = np.concatenate(heads, -1) @ mha.W_o.weight.detach().numpy().T
    np.testing.assert_allclose(out.detach().numpy(), expected, atol=1e-12)
    assert torch.all(mha.attention_weights[1, :, 0] == 0)


@pytest.mark.parametrize("scoring", ["scaled_dot", "dot", "additive", "general", "cosine"])
def test_every_scoring_gradcheck_and_padding(scoring):
    B, n, m, E, H = 2, 3, 4, 4, 2
    mha = MultiHeadAttention(E, H, scoring=scoring, bias=True).double()
    q = torch.randn(B, n, 3, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(B, m, 5, dtype=torch.float64, requires_grad=True)
    lens = torch.tensor([2, 4])
    mha(q, kv, kv, lens)
    assert torch.autograd.gradcheck(lambda a, b: mha(a, b, b, lens), (q, kv))
    dirty = kv.detach().clone()
    dirty[0, 2:] = float("nan")
    torch.testing.assert_close(mha(q, dirty, dirty, lens), mha(q, kv, kv, lens))


def test_custom_inner_attention_and_masks():
    mha = MultiHeadAttention(8, 2, scoring=DotProductAttention(scale=1.0))
    x = torch.randn(2, 3, 8)
    attend = torch.tensor([[True, False, True]] * 3)
    out = mha(x, x, x, attend_mask=attend.expand(2, 3, 3))
    assert torch.all(mha.attention_weights[..., 1] == 0)
    torch.testing.assert_close(out, mha(x, x, x, attend_mask=attend))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_hiddens": 10, "num_heads": 3}, "multiple of `num_heads`"),
        ({"num_hiddens": 8, "num_heads": 0}, "num_heads"),
        ({"num_hiddens": 8, "num_heads": 2, "scoring": "nope"}, "scoring"),
    ],
)
def test_bad_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(**kwargs)


def test_queries_must_be_3d():
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(2, 1, 3, 8)
    with pytest.raises(ValueError, match=r"`queries` of shape \(B, n, q\).*\(2, 1, 3, 8\)"):
        mha(x, x, x)


@pytest.mark.parametrize("name", ["queries", "keys", "values"])
def test_feature_sizes_are_fixed_by_the_first_call(name):
    """Issue 21.4: the size the lazy projections took, named, not a matmul error."""
    mha = MultiHeadAttention(16, 2)
    x = torch.randn(2, 3, 16)
    mha(x, x, x)
    inputs = {"queries": x, "keys": x, "values": x} | {name: torch.randn(2, 3, 12)}
    with pytest.raises(ValueError, match=rf"`{name}` with last dimension 16 \(the projection"):
        mha(**inputs)


def test_inputs_of_another_dtype_than_the_module_are_named():
    mha = MultiHeadAttention(16, 2)
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"module's dtype torch.float32, but got torch.float64"):
        mha(x, x, x)
    assert mha.double()(x, x, x).dtype == torch.float64
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast mixes dtypes by design
        assert MultiHeadAttention(16, 2)(x.float(), x.float(), x.float()).dtype == torch.bfloat16


def test_a_kept_memory_follows_every_parameter_of_a_parametrized_projection():
    """A projection that is not a plain ``nn.Linear`` (here ``W_k`` parametrized by a
    scale of its own) is kept while every one of its parameters comes back unchanged, and
    projected again once one of them, not its weight, changes in place: never a stale
    projection."""
    from torch import nn
    from torch.nn.utils import parametrize

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.s = nn.Parameter(torch.tensor(1.0))

        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w * self.s

    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4).eval()
    x, memory = torch.randn(2, 1, 16), torch.randn(2, 7, 16)
    mha(x, memory, memory)  # sizes the projections
    parametrize.register_parametrization(mha.W_k, "weight", Scaled())
    calls = []
    mha.W_k.register_forward_hook(lambda module, args, out: calls.append(out))

    def unkept():  # with gradients nothing is kept: the reference
        with torch.enable_grad():
            return mha(x, memory, memory).detach()

    with torch.no_grad():
        first = mha(x, memory, memory)
        assert torch.equal(mha(x, memory, memory), first) and len(calls) == 1
        mha.W_k.parametrizations.weight[0].s.mul_(3.0)
        again = mha(x, memory, memory)
    assert len(calls) == 2
    torch.testing.assert_close(again, unkept())
    assert not torch.allclose(again, first)


def test_a_decoders_memory_is_projected_once():
    """Cross-attention without gradients projects the keys and values once while the same
    tensors come back unchanged (the decoder's steps over one encoder output), each again
    once it or its projection changes in place or another tensor comes; with gradients and
    for self-attention at every call. Every output is a fresh module's."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, bias=True).eval()
    x, memory = torch.randn(2, 1, 16), torch.randn(2, 7, 16)
    lens = torch.tensor([5, 7])
    seen = []
    for linear in (mha.W_k, mha.W_v):
        linear.register_forward_hook(lambda module, args, out: seen.append(module))

    def step(*args, **kwargs):
        out = mha(*args, **kwargs)
        fresh = MultiHeadAttention(16, 4, bias=True)
        fresh.load_state_dict(mha.state_dict())
        torch.testing.assert_close(out, fresh(*args, **kwargs))
        return len(seen)

    with torch.no_grad():
        assert step(x, memory, memory, lens) == 2
        assert step(x, memory, memory, lens) == 2  # the same memory: no projection
        assert step(x, memory, memory) == 2
        memory.mul_(2.0)
        assert step(x, memory, memory) == 4  # changed in place: projected again
        mha.W_v.bias.add_(1.0)
        assert step(x, memory, memory) == 5  # the values alone projected again
        assert step(x, memory.clone(), memory) == 6  # other keys: the keys alone
        assert step(x, x, x) == 8 and step(x, x, x) == 10  # self-attention
    assert step(x, memory, memory) == 12 and step(x, memory, memory) == 14  # gradients
