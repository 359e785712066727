"""MultiHeadAttention.from_torch and to_torch against the real nn.MultiheadAttention
(issue 36.4), in float64: weights, biases, sizes, batch_first, key padding and attention
masks (each with its polarity turned), per-head and averaged weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnscore import AdditiveAttention, DotProductAttention, MultiHeadAttention

B, N, M, E, H = 3, 4, 6, 8, 2


def _torch_module(bias: bool, kdim: int, vdim: int, batch_first: bool) -> nn.MultiheadAttention:
    module = nn.MultiheadAttention(
        E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first, dtype=torch.float64
    )
    if bias:  # PyTorch starts its biases at zero: make them count
        with torch.no_grad():
            module.in_proj_bias.normal_()
            module.out_proj.bias.normal_()
    return module.eval()


def _masks(attn_mask_kind: str):
    """nn.MultiheadAttention's masks (True = ignore, True = not allowed, or additive) and
    attnscore's attend_mask for both (True = may attend). Key 0 stays allowed everywhere,
    as PyTorch gives NaN for a query with no key to attend (attnscore gives zeros)."""
    gen = torch.Generator().manual_seed(3)
    lens = torch.tensor([6, 3, 1])
    key_padding_mask = torch.arange(M) >= lens[:, None]  # (B, m), True = ignore
    if attn_mask_kind == "none":
        return key_padding_mask, None, ~key_padding_mask[:, None, :]
    blocked = torch.rand(B, H, N, M, generator=gen) < 0.4
    blocked[..., 0] = False
    if attn_mask_kind == "bool (n, m)":
        theirs, ours = blocked[0, 0], ~blocked[0, 0]
    elif attn_mask_kind == "bool (B*H, n, m)":
        theirs, ours = blocked.flatten(0, 1), ~blocked
    else:  # additive float masks of 0 and -inf (both: PyTorch deprecates mixing kinds)
        theirs = torch.zeros(N, M, dtype=torch.float64).masked_fill(blocked[0, 0], -torch.inf)
        padding = torch.zeros(B, M, dtype=torch.float64).masked_fill(key_padding_mask, -torch.inf)
        return padding, theirs, (theirs == 0) & (padding == 0)[:, None, None, :]
    return key_padding_mask, theirs, ours & ~key_padding_mask[:, None, None, :]


def _inputs(kdim: int, vdim: int):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(B, N, E, generator=gen, dtype=torch.float64)
    k = torch.randn(B, M, kdim, generator=gen, dtype=torch.float64)
    v = torch.randn(B, M, vdim, generator=gen, dtype=torch.float64)
    return q, k, v


def _theirs(module: nn.MultiheadAttention, q, k, v, **kwargs):
    """nn.MultiheadAttention's call on batch-first inputs, in its own layout."""
    if not module.batch_first:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    out, weights = module(q, k, v, **kwargs)
    return (out if module.batch_first else out.transpose(0, 1)), weights


SIZES = [(E, E), (5, 7)]  # one in_proj_weight, or q/k/v_proj_weight
MASKS = ["none", "bool (n, m)", "bool (B*H, n, m)", "float (n, m)"]


@pytest.mark.parametrize("attn_mask_kind", MASKS)
@pytest.mark.parametrize(("kdim", "vdim"), SIZES, ids=["kdim=vdim=E", "kdim=5 vdim=7"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_from_torch_computes_what_torch_does(batch_first, bias, kdim, vdim, attn_mask_kind):
    theirs = _torch_module(bias, kdim, vdim, batch_first)
    ours = MultiHeadAttention.from_torch(theirs)
    assert not ours.training and ours.W_q.weight.dtype == torch.float64
    q, k, v = _inputs(kdim, vdim)
    key_padding_mask, attn_mask, attend_mask = _masks(attn_mask_kind)
    expected, expected_w = _theirs(
        theirs,
        q,
        k,
        v,
        key_padding_mask=key_padding_mask,
        attn_mask=attn_mask,
        average_attn_weights=False,
    )
    out, weights = ours(q, k, v, attend_mask=attend_mask, return_weights=True)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weights, expected_w, rtol=1e-12, atol=1e-12)
    # need_weights' default average over heads
    _, averaged = _theirs(theirs, q, k, v, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
    torch.testing.assert_close(weights.mean(dim=1), averaged, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_key_padding_at_the_end_is_key_lengths(batch_first):
    theirs = _torch_module(True, E, E, batch_first)
    ours = MultiHeadAttention.from_torch(theirs)
    q, k, v = _inputs(E, E)
    key_padding_mask, _, _ = _masks("none")
    expected, _ = _theirs(theirs, q, k, v, key_padding_mask=key_padding_mask)
    valid_lens = (~key_padding_mask).sum(1)
    torch.testing.assert_close(ours(q, k, v, valid_lens), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("kdim", "vdim"), SIZES, ids=["kdim=vdim=E", "kdim=5 vdim=7"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_to_torch_computes_what_ours_does(batch_first, bias, kdim, vdim):
    ours = MultiHeadAttention(E, H, bias=bias, query_size=E, key_size=kdim, value_size=vdim)
    ours = ours.double().eval()
    if bias:
        with torch.no_grad():
            for linear in (ours.W_q, ours.W_k, ours.W_v, ours.W_o):
                linear.bias.normal_()
    theirs = ours.to_torch(batch_first=batch_first)
    assert theirs.batch_first is batch_first and not theirs.training
    q, k, v = _inputs(kdim, vdim)
    key_padding_mask, attn_mask, attend_mask = _masks("bool (n, m)")
    expected, expected_w = _theirs(
        theirs,
        q,
        k,
        v,
        key_padding_mask=key_padding_mask,
        attn_mask=attn_mask,
        average_attn_weights=False,
    )
    out, weights = ours(q, k, v, attend_mask=attend_mask, return_weights=True)
    torch.testing.assert_close(expected, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(expected_w, weights, rtol=1e-12, atol=1e-12)
    back = MultiHeadAttention.from_torch(theirs)  # the round trip keeps every tensor
    assert back.state_dict().keys() == ours.state_dict().keys()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, ours.state_dict()[name]), name


def test_dropout_and_training_mode_carry_over():
    theirs = nn.MultiheadAttention(E, H, dropout=0.25)
    ours = MultiHeadAttention.from_torch(theirs)
    assert ours.training and ours.attention.dropout.p == 0.25
    back = ours.eval().to_torch()
    assert not back.training and back.dropout == 0.25


def test_a_lazy_module_converts_after_its_first_call():
    ours = MultiHeadAttention(E, H, bias=True)
    with pytest.raises(ValueError, match=r"lazy module.*query_size=.*call it once"):
        ours.to_torch()
    x = torch.randn(B, N, E)
    ours(x, x, x)
    torch.testing.assert_close(ours.to_torch()(x, x, x)[0], ours(x, x, x))


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: nn.Linear(E, E), TypeError, r"`module` to be a torch.nn.MultiheadAttention"),
        (
            lambda: nn.MultiheadAttention(E, H, add_bias_kv=True),
            ValueError,
            r"without add_bias_kv .*no equivalent",
        ),
        (
            lambda: nn.MultiheadAttention(E, H, add_zero_attn=True),
            ValueError,
            r"without add_zero_attn",
        ),
    ],
)
def test_from_torch_refuses_what_it_cannot_compute(make, error, match):
    with pytest.raises(error, match=match):
        MultiHeadAttention.from_torch(make())


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: MultiHeadAttention(E, H, scoring="additive", query_size=E), r"'scaled_dot'"),
        (
            lambda: MultiHeadAttention(E, H, scoring=DotProductAttention(scale=1.0), query_size=E),
            r"'scaled_dot'",
        ),
        (lambda: MultiHeadAttention(E, H, normalizer="sparsemax", query_size=E), r"softmax"),
        (
            lambda: MultiHeadAttention(E, H, scoring=AdditiveAttention(num_hiddens=4)),
            r"'scaled_dot'",
        ),
        (lambda: MultiHeadAttention(E, H, query_size=5), r"num_hiddens=8 .*query_size=5"),
    ],
)
def test_to_torch_refuses_what_torch_cannot_compute(make, match):
    with pytest.raises(ValueError, match=match):
        make().to_torch()
