"""Attention modules and functions against the textbook code, float64 NumPy and SDPA."""

from __future__ import annotations

import copy
import math
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attnscore
from attnscore import (
    AdditiveAttention,
    Attention,
    CosineAttention,
    DotProductAttention,
    MultiHeadAttention,
    MultiplicativeAttention,
)
from reference import (
    D2LAdditiveAttention,
    D2LDotProductAttention,
    broadcast_lengths,
    np_additive_scores,
    np_attention,
    np_dot_scores,
    np_masked_softmax,
    np_masked_softmax_dense,
)

TOY_EXPECTED = torch.tensor([[[2.0, 3.0, 4.0, 5.0]], [[10.0, 11.0, 12.0, 13.0]]])


def toy(query_size):
    queries = torch.normal(0, 1, (2, 1, query_size))
    keys = torch.ones((2, 10, 2))
    values = torch.arange(40, dtype=torch.float32).reshape(1, 10, 4).repeat(2, 1, 1)
    return queries, keys, values, torch.tensor([2, 6])


def test_additive_toy_example():
    q, k, v, lens = toy(20)
    attention = AdditiveAttention(key_size=2, query_size=20, num_hiddens=8, dropout=0.1).eval()
    torch.testing.assert_close(attention(q, k, v, lens), TOY_EXPECTED)
    w = attention.attention_weights
    torch.testing.assert_close(w[0, 0, :2], torch.full((2,), 0.5))
    torch.testing.assert_close(w[1, 0, :6], torch.full((6,), 1 / 6))
    assert torch.all(w[0, 0, 2:] == 0) and torch.all(w[1, 0, 6:] == 0)


def test_additive_lazy_sizes_toy_example():
    q, k, v, lens = toy(20)
    attention = AdditiveAttention(num_hiddens=8, dropout=0.1).eval()
    torch.testing.assert_close(attention(q, k, v, lens), TOY_EXPECTED)
    assert attention.W_q.weight.shape == (8, 20) and attention.W_k.weight.shape == (8, 2)


def test_dot_product_toy_example():
    _, k, v, lens = toy(20)
    q = torch.normal(0, 1, (2, 1, 2))
    attention = DotProductAttention(dropout=0.5).eval()
    torch.testing.assert_close(attention(q, k, v, lens), TOY_EXPECTED)


def test_textbook_state_dict_loads_strict():
    book = D2LAdditiveAttention(3, 5, 7, 0.0)
    ours = AdditiveAttention(3, 5, 7)
    ours.load_state_dict(book.state_dict(), strict=True)
    lazy = AdditiveAttention(num_hiddens=7)
    lazy.load_state_dict(book.state_dict(), strict=True)
    assert sorted(ours.state_dict()) == sorted(book.state_dict())
    q, k, v = torch.randn(2, 4, 5), torch.randn(2, 6, 3), torch.randn(2, 6, 2)
    torch.testing.assert_close(lazy(q, k, v), ours(q, k, v))


def _random_case(dtype=torch.float64, d_q=5, d_k=3):
    B, n, m = 3, 4, 6
    q = torch.randn(B, n, d_q, dtype=dtype)
    k = torch.randn(B, m, d_k, dtype=dtype)
    v = torch.randn(B, m, 2, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize(
    "lens",
    [None, torch.tensor([1, 6, 3]), torch.tensor([[1, 2, 3, 4], [6, 5, 1, 2], [3, 3, 3, 1]])],
)
def test_additive_matches_textbook_and_numpy(lens):
    q, k, v = _random_case()
    book = D2LAdditiveAttention(3, 5, 7, 0.0).double()
    ours = AdditiveAttention(3, 5, 7).double()
    ours.load_state_dict(book.state_dict())
    for t in (q, k, v):
        t.requires_grad_(True)
    out = ours(q, k, v, lens)
    out_book = book(q, k, v, lens)
    torch.testing.assert_close(out, out_book)
    torch.testing.assert_close(ours.attention_weights, book.attention_weights.detach())
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), [q, k, v, *ours.parameters()])
    grads_book = torch.autograd.grad((out_book * g).sum(), [q, k, v, *book.parameters()])
    for a, b in zip(grads, grads_book, strict=True):
        torch.testing.assert_close(a, b)
    scores = np_additive_scores(
        q.detach(),
        k.detach(),
        ours.W_q.weight.detach(),
        ours.W_k.weight.detach(),
        ours.w_v.weight.detach(),
    )
    L = np.full((3, 4), 6) if lens is None else broadcast_lengths(lens.numpy(), (3,), 4)
    np.testing.assert_allclose(
        out.detach().numpy(), np_attention(np_masked_softmax(scores, L), v.detach()), atol=1e-12
    )


@pytest.mark.parametrize(
    "lens",
    [None, torch.tensor([1, 6, 3]), torch.tensor([[1, 2, 3, 4], [6, 5, 1, 2], [3, 3, 3, 1]])],
)
def test_dot_product_matches_textbook_and_sdpa(lens):
    q, k, v = _random_case(d_q=3)
    ours = DotProductAttention()
    out = ours(q, k, v, lens)
    torch.testing.assert_close(out, D2LDotProductAttention(0.0)(q, k, v, lens))
    attend = None
    if lens is not None:
        L = torch.tensor(broadcast_lengths(lens.numpy(), (3,), 4))
        attend = (torch.arange(6) < L[..., None]).unsqueeze(1)
    sdpa = F.scaled_dot_product_attention(
        q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), attn_mask=attend
    ).squeeze(1)
    torch.testing.assert_close(out, sdpa)


def test_functional_forms_return_weights():
    q, k, v = _random_case(d_q=3)
    lens = torch.tensor([0, 6, 3])
    out, w = attnscore.dot_product_attention(q, k, v, lens, return_weights=True)
    ref = np_masked_softmax(np_dot_scores(q, k), broadcast_lengths(lens.numpy(), (3,), 4))
    np.testing.assert_allclose(w.numpy(), ref, atol=1e-12)
    np.testing.assert_allclose(out.numpy(), np_attention(ref, v), atol=1e-12)
    assert torch.all(out[0] == 0)
    W_q, W_k, w_v = (
        torch.randn(7, 3, dtype=q.dtype),
        torch.randn(7, 3, dtype=q.dtype),
        torch.randn(7, dtype=q.dtype),
    )
    out2, w2 = attnscore.additive_attention(q, k, v, W_q, W_k, w_v, lens, return_weights=True)
    ref2 = np_masked_softmax(
        np_additive_scores(q, k, W_q, W_k, w_v), broadcast_lengths(lens.numpy(), (3,), 4)
    )
    np.testing.assert_allclose(w2.numpy(), ref2, atol=1e-12)
    np.testing.assert_allclose(out2.numpy(), np_attention(ref2, v), atol=1e-12)
    assert isinstance(attnscore.dot_product_attention(q, k, v, lens), torch.Tensor)


@pytest.mark.parametrize(
    "make",
    [
        lambda: AdditiveAttention(3, 5, 7, dropout=0.5),
        lambda: MultiplicativeAttention(5, 3, dropout=0.5),
    ],
)
def test_dropout_only_in_training_and_weights_before_dropout(make):
    q, k, v = _random_case()
    attention = make().double()
    lens = torch.tensor([2, 6, 4])
    attention.eval()
    out_eval = attention(q, k, v, lens)
    w_eval = attention.attention_weights
    torch.testing.assert_close(attention(q, k, v, lens), out_eval)
    attention.train()
    out_train = attention(q, k, v, lens)
    assert not torch.allclose(out_train, out_eval)
    torch.testing.assert_close(attention.attention_weights, w_eval)
    torch.testing.assert_close(w_eval.sum(-1), torch.ones(3, 4, dtype=torch.float64))


MODULES = {
    "additive": lambda: AdditiveAttention(3, 3, 7),
    "additive_bias_normalize": lambda: AdditiveAttention(3, 3, 7, normalize=True),
    "dot": lambda: DotProductAttention(),
    "dot_unscaled": lambda: DotProductAttention(scale=1.0),
    "general": lambda: MultiplicativeAttention(3, 3),
    "cosine": lambda: CosineAttention(learn_scale=True),
}


@pytest.mark.parametrize("looked", [False, True], ids=["small: zeroed", "large: looked at"])
@pytest.mark.parametrize("name", sorted(MODULES))
def test_padded_garbage_changes_nothing(name, looked, thresholds):
    if looked:  # padding is looked at (read for NaN/inf) before zeroing, as in large calls
        thresholds(look_numel=0)
    attention = MODULES[name]().double()
    q, k, v = _random_case(d_q=3)
    lens = torch.tensor([2, 0, 4])
    k2, v2 = k.clone(), v.clone()
    k2[0, 2:] = float("nan")
    v2[0, 2:] = float("inf")
    k2[2, 4:] = -float("inf")
    v2[2, 4:] = float("nan")
    k2[1], v2[1] = float("nan"), float("nan")

    def run(keys, values):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, keys, values))
        out = attention(qq, kk, vv, lens)
        attention.zero_grad()
        (
            out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
        ).sum().backward()
        param_grads = [p.grad.clone() for p in attention.parameters() if p.grad is not None]
        return out, attention.attention_weights, qq.grad, kk.grad, vv.grad, param_grads

    clean, dirty = run(k, v), run(k2, v2)
    for a, b in zip(clean[:3], dirty[:3], strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(clean[5], dirty[5], strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(clean[3][:, :4][[0, 2]][:, :2], dirty[3][:, :4][[0, 2]][:, :2])
    assert torch.isfinite(dirty[3]).all() and torch.isfinite(dirty[4]).all()
    assert torch.all(dirty[3][0, 2:] == 0) and torch.all(dirty[4][1] == 0)
    assert torch.all(dirty[0][1] == 0) and torch.all(dirty[1][1] == 0)
    with torch.no_grad():  # without gradients only the values are zeroed
        torch.testing.assert_close(attention(q, k2, v2, lens), clean[0].detach())


def test_padding_off_the_cpu_is_zeroed_without_looking(thresholds, monkeypatch):
    """Off the CPU a look would cost a device sync: the padding is zeroed unconditionally,
    whatever the size (meta tensors stand in for a device here)."""
    from attnscore import _engine
    from attnscore.masking import build_mask

    thresholds(look_numel=0)  # as large as calls come

    def no_look(*args):
        raise AssertionError("looked at padding off the CPU")

    monkeypatch.setattr(_engine, "garbage_in", no_look)
    q, k, v = (torch.empty(3, 4, 5, device="meta") for _ in range(3))
    mask = build_mask(torch.Size([3]), 4, 4, torch.device("meta"), valid_lens=torch.tensor(
        [0, 2, 4], device="meta"))  # fmt: skip
    zeroed = _engine.zero_padding(_engine.Prepared(q, k, v, mask))
    assert zeroed.queries is not q and zeroed.keys is not k and zeroed.values is not v


@pytest.mark.parametrize("name", sorted(MODULES))
def test_gradcheck(name):
    attention = MODULES[name]().double()
    q, k, v = (t.requires_grad_(True) for t in _random_case(d_q=3))
    lens = torch.tensor([[1, 2, 0, 6], [3, 3, 3, 3], [6, 1, 5, 2]])
    assert torch.autograd.gradcheck(lambda a, b, c: attention(a, b, c, lens), (q, k, v))


def test_general_and_cosine_match_numpy():
    q, k, v = _random_case(d_q=5, d_k=3)
    lens = torch.tensor([1, 6, 3])
    L = broadcast_lengths(lens.numpy(), (3,), 4)
    general = MultiplicativeAttention(5, 3).double()
    W = general.W_a.weight.detach().numpy()
    scores = q.numpy() @ W @ np.swapaxes(k.numpy(), -1, -2)
    np.testing.assert_allclose(
        general(q, k, v, lens).detach().numpy(),
        np_attention(np_masked_softmax(scores, L), v),
        atol=1e-12,
    )
    kc = torch.randn(3, 6, 5, dtype=torch.float64)
    kc[0, 0] = 0.0  # a zero key scores 0, not NaN
    cosine = CosineAttention(scale=4.0)
    qn = q.numpy() / np.linalg.norm(q.numpy(), axis=-1, keepdims=True)
    kn = kc.numpy() / np.maximum(np.linalg.norm(kc.numpy(), axis=-1, keepdims=True), 1e-300)
    cos = 4.0 * qn @ np.swapaxes(kn, -1, -2)
    np.testing.assert_allclose(
        cosine(q, kc, v, lens).numpy(), np_attention(np_masked_softmax(cos, L), v), atol=1e-12
    )


def test_additive_scores_with_a_bias_match_numpy():
    q, k, _ = _random_case(d_q=5, d_k=3)
    W_q, W_k = torch.randn(7, 5, dtype=q.dtype), torch.randn(7, 3, dtype=q.dtype)
    w_v, bias = torch.randn(7, dtype=q.dtype), torch.randn(7, dtype=q.dtype)
    got = attnscore.scoring.additive_scores(q, k, W_q, W_k, w_v, bias=bias)
    expected = np_additive_scores(q, k, W_q, W_k, w_v, bias)
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-12)
    assert not np.allclose(expected, np_additive_scores(q, k, W_q, W_k, w_v))


def test_general_infers_the_key_size_on_its_first_call():
    q, k, v = _random_case(d_q=5, d_k=3)
    lens = torch.tensor([1, 6, 3])
    general = MultiplicativeAttention(5).double()  # key_size=None: W_a is lazy
    out = general(q, k, v, lens)
    W = general.W_a.weight.detach().numpy()
    assert W.shape == (5, 3)
    scores = q.numpy() @ W @ np.swapaxes(k.numpy(), -1, -2)
    L = broadcast_lengths(lens.numpy(), (3,), 4)
    np.testing.assert_allclose(
        out.detach().numpy(), np_attention(np_masked_softmax(scores, L), v), atol=1e-12
    )
    with pytest.raises(ValueError, match=r"keys.*key_size=3"):
        general(q, torch.randn(3, 6, 4, dtype=torch.float64), v, lens)


def test_dot_product_repr_shows_scale_and_normalizer():
    assert "scale=1.0\n" in repr(DotProductAttention(scale=1.0))
    assert "scale=None, normalizer='hardmax'" in repr(DotProductAttention(normalizer="hardmax"))


def test_generic_attention_with_user_scorer_module():
    class Negdist(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.temperature = torch.nn.Parameter(torch.tensor(2.0, dtype=torch.float64))

        def forward(self, q, k):
            return -torch.cdist(q, k) / self.temperature

    attention = Attention(Negdist())
    assert [n for n, _ in attention.named_parameters()] == ["scoring.temperature"]
    q, k, v = _random_case(d_q=3)
    lens = torch.tensor([2, 6, 1])
    scores = -np.linalg.norm(q.numpy()[:, :, None] - k.numpy()[:, None], axis=-1) / 2.0
    expected = np_attention(np_masked_softmax(scores, broadcast_lengths(lens.numpy(), (3,), 4)), v)
    np.testing.assert_allclose(attention(q, k, v, lens).detach().numpy(), expected, atol=1e-12)


def test_masks_query_lengths_attend_mask_causal():
    q, k, v = _random_case(d_q=3)
    B, n, m = 3, 4, 6
    lens = torch.tensor([5, 2, 6])
    q_lens = torch.tensor([4, 1, 3])
    attend = torch.rand(B, n, m) > 0.3
    attention = DotProductAttention()
    out = attention(q, k, v, lens, query_valid_lens=q_lens, attend_mask=attend, causal=True)
    allowed = np.arange(m) < broadcast_lengths(lens.numpy(), (B,), n)[..., None]
    allowed &= np.arange(n)[:, None] < q_lens.numpy()[:, None, None]
    allowed &= attend.numpy()
    allowed &= np.arange(m)[None, :] <= np.arange(n)[:, None]  # top-left causal
    w = np_masked_softmax_dense(np_dot_scores(q, k), allowed)
    np.testing.assert_allclose(attention.attention_weights.numpy(), w, atol=1e-12)
    np.testing.assert_allclose(out.numpy(), np_attention(w, v), atol=1e-12)
    assert torch.all(out[1, 1:] == 0)  # padded queries give zero output


@pytest.mark.parametrize(("n", "m"), [(3, 5), (5, 3), (4, 4)])
def test_causal_alignment_matches_sdpa(n, m):
    q, k, v = (
        torch.randn(2, n, 4, dtype=torch.float64),
        torch.randn(2, m, 4, dtype=torch.float64),
        torch.randn(2, m, 3, dtype=torch.float64),
    )
    out = attnscore.dot_product_attention(q, k, v, causal=True)
    ref = F.scaled_dot_product_attention(
        q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), is_causal=True
    ).squeeze(1)
    torch.testing.assert_close(out, ref)


def test_heads_layout_broadcasts_lengths_over_heads():
    B, H, n, m, d = 2, 3, 4, 5, 6
    q, k, v = (torch.randn(B, H, s, d, dtype=torch.float64) for s in (n, m, m))
    lens = torch.tensor([2, 5])
    out = attnscore.dot_product_attention(q, k, v, lens)
    for h in range(H):
        torch.testing.assert_close(
            out[:, h], attnscore.dot_product_attention(q[:, h], k[:, h], v[:, h], lens)
        )
    attend = (torch.arange(m) < lens[:, None])[:, None, None, :]
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=attend))


def test_hardmax_and_sparsemax_respect_masks():
    scores_q = torch.tensor([[[3.0, 1.0, 2.0, 9.0], [0.0, 0.0, 0.0, 0.0]]])
    v = torch.eye(4).unsqueeze(0)
    lens = torch.tensor([[3, 0]])
    out = attnscore.attention(
        scores_q, torch.eye(4).unsqueeze(0), v, lambda q, k: q, lens, normalizer="hardmax"
    )
    assert out.tolist() == [[[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]]
    pytest.importorskip("entmax")
    for name in ("sparsemax", "entmax15"):
        w = attnscore.attention(
            scores_q, torch.eye(4).unsqueeze(0), v, lambda q, k: q, lens, normalizer=name
        )
        assert w[0, 0, 3] == 0 and torch.all(w[0, 1] == 0)
        torch.testing.assert_close(w[0, 0].sum(), torch.tensor(1.0))
    # sparsemax of [3, 1, 2]: tau = 2, so weights [1, 0, 0]
    w = attnscore.attention(
        scores_q, torch.eye(4).unsqueeze(0), v, lambda q, k: q, lens, normalizer="sparsemax"
    )
    torch.testing.assert_close(w[0, 0], torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_state_and_copies():
    attention = AdditiveAttention(3, 5, 7)
    q, k, v = _random_case(dtype=torch.float32)
    out = attention(q, k, v, torch.tensor([1, 2, 3]))
    clone = pickle.loads(pickle.dumps(attention))
    torch.testing.assert_close(clone.attention_weights, attention.attention_weights)
    torch.testing.assert_close(clone(q, k, v, torch.tensor([1, 2, 3])), out)
    torch.testing.assert_close(copy.deepcopy(attention)(q, k, v, torch.tensor([1, 2, 3])), out)
    doubled = copy.deepcopy(attention).double()
    torch.testing.assert_close(
        doubled(q.double(), k.double(), v.double(), torch.tensor([1, 2, 3])).float(), out
    )


def _randn(*shapes):
    return [torch.randn(*shape) for shape in shapes]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: DotProductAttention()(*_randn((2, 3, 4), (2, 5, 3), (2, 5, 2))),
            ValueError,
            "same feature size",
        ),
        (
            lambda: DotProductAttention()(*_randn((2, 3, 4), (2, 5, 4), (2, 6, 2))),
            ValueError,
            r"keys.*values",
        ),
        (
            lambda: DotProductAttention()(*_randn((2, 3, 4), (3, 5, 4), (3, 5, 2))),
            ValueError,
            "batch dimensions",
        ),
        (lambda: DotProductAttention()(*_randn((3, 4), (5, 4), (5, 2))), ValueError, "at least 3"),
        (
            lambda: DotProductAttention()(
                torch.randn(2, 3, 4), torch.randn(2, 5, 4).double(), torch.randn(2, 5, 2)
            ),
            TypeError,
            "dtype",
        ),
        (
            lambda: DotProductAttention()(
                torch.randint(0, 2, (2, 3, 4)), torch.randn(2, 5, 4), torch.randn(2, 5, 2)
            ),
            TypeError,
            "queries.*floating",
        ),
        (
            lambda: DotProductAttention()(
                *_randn((2, 3, 4), (2, 5, 4), (2, 5, 2)),
                torch.tensor([1, 2, 3]),
            ),
            ValueError,
            "valid_lens",
        ),
        (
            lambda: DotProductAttention()(
                *_randn((2, 3, 4), (2, 5, 4), (2, 5, 2)),
                attend_mask=torch.ones(2, 3, 5),
            ),
            TypeError,
            "attend_mask.*bool",
        ),
        (
            lambda: DotProductAttention()(
                *_randn((2, 3, 4), (2, 5, 4), (2, 5, 2)),
                attend_mask=torch.ones(2, 3, 4, dtype=torch.bool),
            ),
            ValueError,
            "attend_mask",
        ),
        (
            lambda: DotProductAttention()(
                *_randn((2, 3, 4), (2, 5, 4), (2, 5, 2)),
                query_valid_lens=torch.tensor([1]),
            ),
            ValueError,
            "query_valid_lens",
        ),
        (
            lambda: AdditiveAttention(2, 20, 8)(*_randn((2, 1, 19), (2, 5, 2), (2, 5, 2))),
            ValueError,
            r"queries.*query_size=20.*\(2, 1, 19\)",
        ),
        (
            lambda: MultiplicativeAttention(20, 2)(*_randn((2, 1, 20), (2, 5, 3), (2, 5, 2))),
            ValueError,
            r"keys.*key_size=2",
        ),
        (
            lambda: MultiplicativeAttention(20, 2)(*_randn((2, 1, 19), (2, 5, 2), (2, 5, 2))),
            ValueError,
            r"queries.*query_size=20.*\(2, 1, 19\)",
        ),
        (lambda: DotProductAttention(scale="0.5"), TypeError, r"`scale`.*float or None.*'0.5'"),
        (lambda: DotProductAttention(scale=True), TypeError, r"`scale`.*float or None.*True"),
        (lambda: CosineAttention(scale=0.0), ValueError, r"`scale`.*positive float.*0.0"),
        (lambda: CosineAttention(scale=True), ValueError, r"`scale`.*positive float.*True"),
        (lambda: AdditiveAttention(2, 20), TypeError, "num_hiddens"),
        (
            lambda: AdditiveAttention(2, 20, 8)(
                *(t.double() for t in _randn((2, 1, 20), (2, 5, 2), (2, 5, 2)))
            ),
            TypeError,
            r"module's dtype torch.float32 \(its parameters'\), but got torch.float64",
        ),
        (
            lambda: MultiplicativeAttention(20, 2)(
                *(t.double() for t in _randn((2, 1, 20), (2, 5, 2), (2, 5, 2)))
            ),
            TypeError,
            r"convert the module with `.to\(torch.float64\)`",
        ),
        (lambda: AdditiveAttention(2, 20, 0), ValueError, "num_hiddens.*0"),
        (lambda: DotProductAttention(dropout=1.5), ValueError, r"dropout.*\[0, 1\).*1.5"),
        (lambda: DotProductAttention(dropout="0.1"), TypeError, r"`dropout`.*float.*'0.1'"),
        (lambda: DotProductAttention(normalizer="nope"), ValueError, "normalizer"),
        (lambda: Attention(scoring=3), TypeError, "scoring"),
        (
            lambda: attnscore.dot_product_attention(
                *_randn((2, 3, 4), (2, 5, 4), (2, 5, 2)), dropout_p=-0.1
            ),
            ValueError,
            "dropout_p",
        ),
    ],
)
def test_bad_input_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_scaled_scores_have_unit_variance():
    d = 256
    q, k = torch.randn(1, 2000, d, dtype=torch.float64), torch.randn(1, 1, d, dtype=torch.float64)
    scores = attnscore.scoring.dot_product_scores(q, k)
    assert abs(scores.var().item() - 1.0) < 0.15
    assert abs(attnscore.scoring.dot_product_scores(q, k, 1.0).var().item() / d - 1.0) < 0.15
    assert math.isclose(float(DotProductAttention(scale=1.0).scale), 1.0)


# ---- the decoder's keys: projected once ---------------------------------------------------


def _counted_additive():
    module = AdditiveAttention(4, 3, 8).eval()
    calls = []
    module.W_k.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape))
    return module, calls


def _fresh_scores(module, q, k):
    """The textbook's scores from the module's current weights (no cache involved)."""
    feats = torch.tanh(module.W_q(q).unsqueeze(2) + module.W_k(k).unsqueeze(1))
    return module.w_v(feats).squeeze(-1)


def _plain_softmax(scores, lens):
    allowed = torch.arange(scores.shape[-1]) < lens[:, None, None]
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)


def test_decoder_steps_project_the_same_keys_once():
    module, calls = _counted_additive()
    keys, lens = torch.randn(2, 6, 4), torch.tensor([3, 6])
    with torch.no_grad():
        for _ in range(3):  # three decoder steps over the same encoder outputs
            q = torch.randn(2, 1, 3)
            out = module(q, keys, keys, lens)
            expected = _plain_softmax(_fresh_scores(module, q, keys), lens) @ keys
            torch.testing.assert_close(out, expected)
    assert len(calls) == 1 + 3  # one projection for the steps, plus the references'


@pytest.mark.parametrize("change", ["keys in place", "W_k in place", "other keys", "grad"])
def test_kept_keys_projection_is_never_stale(change):
    module, calls = _counted_additive()
    keys, lens = torch.randn(2, 6, 4), torch.tensor([3, 6])
    q = torch.randn(2, 1, 3)
    with torch.no_grad():
        module(q, keys, keys, lens)
        if change == "keys in place":
            keys.mul_(-2.0)
        elif change == "W_k in place":
            module.W_k.weight.add_(1.0)
        elif change == "other keys":
            keys = keys.clone() * 3.0
    with torch.set_grad_enabled(change == "grad"):
        out = module(q, keys, keys, lens)
    expected = _plain_softmax(_fresh_scores(module, q, keys), lens) @ keys
    torch.testing.assert_close(out, expected)
    assert len(calls) == 3  # projected again (and once for the reference)
    if change == "grad":
        assert module._keys_cache is None and out.requires_grad


def test_inference_mode_keys_are_projected_every_call():
    module, calls = _counted_additive()
    with torch.inference_mode():
        keys, q = torch.randn(2, 6, 4), torch.randn(2, 1, 3)
        module(q, keys, keys)
        module(q, keys, keys)
    assert len(calls) == 2


@pytest.mark.parametrize("name", sorted(MODULES))
def test_return_weights_gives_weights_that_carry_gradients(name):
    """Issue 21.5: weights for losses on them (alignment supervision, regularisers), on
    every module, those with a fused path included; finite differences check them."""
    attention = MODULES[name]().double().eval()
    q, k, v = (t.requires_grad_(True) for t in _random_case(d_q=3))
    lens = torch.tensor([[1, 2, 0, 6], [3, 3, 3, 3], [6, 1, 5, 2]])
    out, weights = attention(q, k, v, lens, return_weights=True)
    torch.testing.assert_close(out, attention(q, k, v, lens))
    torch.testing.assert_close(weights.detach(), attention.attention_weights)
    assert weights.requires_grad and weights.shape == (3, 4, 6)
    assert torch.all(weights[0, 2] == 0)  # a query with no valid key: zero weights
    torch.autograd.gradcheck(lambda a, b: attention(a, b, v, lens, return_weights=True)[1], (q, k))


def test_multihead_return_weights_per_head_with_gradients():
    mha = MultiHeadAttention(8, 2).double().eval()
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    lens = torch.tensor([2, 3])
    out, weights = mha(x, x, x, lens, return_weights=True)
    assert weights.shape == (2, 2, 3, 3) and weights.requires_grad
    torch.testing.assert_close(out, mha(x, x, x, lens))
    torch.testing.assert_close(weights.detach(), mha.attention_weights)
    torch.autograd.gradcheck(lambda a: mha(a, a, a, lens, return_weights=True)[1], (x,))
