"""Bad and unusual input at every public entry point: one clear error, or a documented result.

Tables, not one test per case: ``ERRORS`` holds input mutations that must raise an error
naming the argument ("Expected ..., but got ... instead"); ``RESULTS`` holds edge cases
with a documented result (empty dimensions, NaN, non-contiguous and expanded tensors).
Both run on every path of ``paths.PATHS``. (masked_softmax's own error table is in
test_masking.py, show_heatmaps' in test_plotting.py; ``attnscore run``'s is in
tests/cli/test_cli_run_bad_input.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnscore
from attnscore import masked_softmax, sequence_mask
from paths import PATHS, Path

B, N, M, V = 2, 3, 5, 2


def _inputs(path: Path, b: int = B, n: int = N, m: int = M, dtype=torch.float32):
    qs, ks = (3, 3) if path.same_feature_size else (4, 3)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, n, qs, generator=gen).to(dtype)
    k = torch.randn(b, m, ks, generator=gen).to(dtype)
    v = torch.randn(b, m, V, generator=gen).to(dtype)
    return q, k, v, torch.tensor([2, 5][:b] + [1] * max(0, b - 2))


def _replace(index: int, make):
    """A mutation replacing argument ``index`` of (q, k, v, valid_lens)."""

    def mutate(args):
        args = list(args)
        args[index] = make(*args)
        return args, {}

    return mutate


def _mask(name: str, make):
    def mutate(args):
        return list(args), {name: make(*args)}

    return mutate


Q, K, VALUES, LENS = range(4)
ERRORS = [
    ("queries 2-D", _replace(Q, lambda q, k, v, lens: q[0]), ValueError, r"`queries`.*at least 3"),
    ("keys 2-D", _replace(K, lambda q, k, v, lens: k[0]), ValueError, r"`keys`.*at least 3"),
    (
        "values 1-D",
        _replace(VALUES, lambda q, k, v, lens: v[0, 0]),
        ValueError,
        r"`values`.*at least",
    ),
    (
        "queries a list",
        _replace(Q, lambda q, k, v, lens: q.tolist()),
        TypeError,
        r"`queries`.*list",
    ),
    ("queries int", _replace(Q, lambda q, k, v, lens: q.long()), TypeError, r"`queries`.*float"),
    ("keys int", _replace(K, lambda q, k, v, lens: k.int()), TypeError, r"`keys`.*float"),
    ("values bool", _replace(VALUES, lambda q, k, v, lens: v > 0), TypeError, r"`values`.*float"),
    ("keys float64", _replace(K, lambda q, k, v, lens: k.double()), TypeError, r"`keys`.*dtype"),
    (
        "values complex",
        _replace(VALUES, lambda q, k, v, lens: v.to(torch.complex64)),
        TypeError,
        r"`values`.*float",
    ),
    (
        "values m-1",
        _replace(VALUES, lambda q, k, v, lens: v[:, 1:]),
        ValueError,
        r"`keys`.*`values`",
    ),
    ("keys batch 1", _replace(K, lambda q, k, v, lens: k[:1]), ValueError, r"`keys`.*`values`"),
    (
        "keys and values batch 1",
        lambda a: ([a[0], a[1][:1], a[2][:1], a[3]], {}),
        ValueError,
        r"`queries`.*`keys`.*batch",
    ),
    (
        "heads only on queries",
        _replace(Q, lambda q, k, v, lens: q.unsqueeze(1)),
        ValueError,
        r"`queries`.*`keys`.*batch",
    ),
    (
        "keys on meta",
        lambda a: ([a[0], a[1].to("meta"), a[2].to("meta"), a[3]], {}),
        ValueError,
        r"`keys`.*device",
    ),
    (
        "valid_lens (3,)",
        _replace(LENS, lambda q, k, v, lens: torch.tensor([1, 2, 3])),
        ValueError,
        r"`valid_lens`.*\(2,\) or \(2, 3\).*got shape \(3,\)",
    ),
    (
        "valid_lens (B, n, 1)",
        _replace(LENS, lambda q, k, v, lens: torch.ones(B, N, 1, dtype=torch.long)),
        ValueError,
        r"`valid_lens`.*shape",
    ),
    (
        "valid_lens 0-d",
        _replace(LENS, lambda q, k, v, lens: torch.tensor(2)),
        ValueError,
        r"`valid_lens`.*shape \(\)",
    ),
    (
        "valid_lens negative",
        _replace(LENS, lambda q, k, v, lens: torch.tensor([1, -3])),
        ValueError,
        r"`valid_lens`.*non-negative.*-3",
    ),
    (
        "valid_lens fractional",
        _replace(LENS, lambda q, k, v, lens: torch.tensor([1.0, 2.5])),
        ValueError,
        r"`valid_lens`.*whole numbers.*2\.5",
    ),
    (
        "valid_lens inf",
        _replace(LENS, lambda q, k, v, lens: torch.tensor([1.0, float("inf")])),
        ValueError,
        r"`valid_lens`.*whole numbers.*inf",
    ),
    (
        "valid_lens bool",
        _replace(LENS, lambda q, k, v, lens: torch.tensor([True, False])),
        TypeError,
        r"`valid_lens`.*bool",
    ),
    (
        "valid_lens a list",
        _replace(LENS, lambda q, k, v, lens: [1, 2]),
        TypeError,
        r"`valid_lens`.*torch\.Tensor.*list",
    ),
    (
        "valid_lens on meta",
        _replace(LENS, lambda q, k, v, lens: lens.to("meta")),
        ValueError,
        r"`valid_lens`.*device.*meta",
    ),
    (
        "query_valid_lens (B + 1,)",
        _mask("query_valid_lens", lambda q, k, v, lens: torch.ones(B + 1, dtype=torch.long)),
        ValueError,
        r"`query_valid_lens`.*shape",
    ),
    (
        "query_valid_lens negative",
        _mask("query_valid_lens", lambda q, k, v, lens: torch.tensor([1, -1])),
        ValueError,
        r"`query_valid_lens`.*non-negative",
    ),
    (
        "attend_mask float",
        _mask("attend_mask", lambda q, k, v, lens: torch.ones(B, N, M)),
        TypeError,
        r"`attend_mask`.*bool.*float32",
    ),
    (
        "attend_mask (B, N, M + 1)",
        _mask("attend_mask", lambda q, k, v, lens: torch.ones(B, N, M + 1, dtype=torch.bool)),
        ValueError,
        r"`attend_mask`.*broadcastable",
    ),
    (
        "attend_mask on meta",
        _mask(
            "attend_mask",
            lambda q, k, v, lens: torch.ones(B, N, M, dtype=torch.bool, device="meta"),
        ),
        ValueError,
        r"`attend_mask`.*device",
    ),
    ("causal 'yes'", _mask("causal", lambda q, k, v, lens: "yes"), TypeError, r"`causal`.*bool"),
]


@pytest.mark.parametrize(("case", "mutate", "error", "match"), ERRORS, ids=[e[0] for e in ERRORS])
@pytest.mark.parametrize("path", PATHS, ids=str)
def test_bad_input_raises_one_clear_error(path, case, mutate, error, match):
    runner = path.build(*((3, 3) if path.same_feature_size else (4, 3)), torch.float32)
    args, masks = mutate(_inputs(path))
    with pytest.raises(error, match=match) as info:
        runner(*args, **masks)
    message = str(info.value)
    assert message.startswith("Expected") and message.endswith("instead.")


def test_unknown_mask_keyword_is_rejected():
    q, k, v, lens = _inputs(PATHS[0])
    with pytest.raises(TypeError, match=r"Unexpected keyword.*key_padding_mask"):
        attnscore.dot_product_attention(q, k[..., :4], v, lens, key_padding_mask=None)


# ---- documented results -------------------------------------------------------------------


def _documented(path: Path, b: int, n: int, m: int, lens):
    runner = path.build(*((3, 3) if path.same_feature_size else (4, 3)), torch.float32)
    q, k, v, _ = _inputs(path, b, n, m)
    for t in (q, k, v):
        t.requires_grad_(True)
    out, w = runner(q, k, v, lens)
    return (q, k, v), out, w


EMPTY = [
    # (id, B, n, m, valid_lens): n = 0 or B = 0 give empty results; m = 0 gives zero output.
    ("n=0", B, 0, M, None),
    ("n=0 lens (B,)", B, 0, M, torch.tensor([1, 2])),
    ("n=0 lens (B, 0)", B, 0, M, torch.zeros(B, 0, dtype=torch.long)),
    ("B=0", 0, N, M, None),
    ("B=0 lens (0,)", 0, N, M, torch.zeros(0, dtype=torch.long)),
    ("m=0", B, N, 0, None),
    ("m=0 lens (B,)", B, N, 0, torch.tensor([0, 3])),
    ("m=0 lens (B, n)", B, N, 0, torch.ones(B, N, dtype=torch.long)),
    ("n=m=0", B, 0, 0, torch.tensor([1, 0])),
]


@pytest.mark.parametrize(("case", "b", "n", "m", "lens"), EMPTY, ids=[e[0] for e in EMPTY])
@pytest.mark.parametrize("path", PATHS, ids=str)
def test_empty_dimensions_documented_result(path, case, b, n, m, lens):
    inputs, out, w = _documented(path, b, n, m, lens)
    assert out.shape == (b, n, V) and w.shape == (b, n, m)
    assert torch.all(out == 0) and torch.all(w == 0)  # vacuous when empty
    out.sum().backward()  # and the backward pass runs, with finite zero gradients
    for t in inputs:
        assert t.grad is None or (torch.isfinite(t.grad).all() and torch.all(t.grad == 0))


@pytest.mark.parametrize("path", PATHS, ids=str)
def test_nan_in_valid_inputs_propagates(path):
    """NaN where it is attended is never hidden: the affected outputs are NaN."""
    runner = path.build(*((3, 3) if path.same_feature_size else (4, 3)), torch.float32)
    q, k, v, _ = _inputs(path)
    lens = torch.tensor([2, 5])
    q2 = q.clone()
    q2[0, 1, 0] = float("nan")
    out, _ = runner(q2, k, v, lens)
    assert torch.isnan(out[0, 1]).all() and torch.isfinite(out[1]).all()
    v2 = v.clone()
    v2[1, 4, 0] = float("nan")  # attended by every query of example 1
    out, _ = runner(q, k, v2, lens)
    assert torch.isnan(out[1, :, 0]).all() and torch.isfinite(out[0]).all()
    k2 = k.clone()
    k2[0, 0, 0] = float("nan")
    out, w = runner(q, k2, v, lens)
    # NaN spreads over the valid positions only: padded weights stay exactly 0.
    assert torch.isnan(w[0, :, :2]).all() and torch.all(w[0, :, 2:] == 0)
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1]).all()
    # A query that may attend nothing is inert, NaN or not (documented: zero output).
    out, _ = runner(q2, k, v, torch.tensor([[2, 0, 2], [5, 5, 5]]))
    assert torch.all(out[0, 1] == 0)


@pytest.mark.parametrize("path", PATHS, ids=str)
def test_non_contiguous_and_expanded_inputs_match_contiguous(path):
    runner = path.build(*((3, 3) if path.same_feature_size else (4, 3)), torch.float64)
    q, k, v, lens = (t.double() if t.is_floating_point() else t for t in _inputs(path))
    expected, w_expected = runner(q, k, v, lens)
    # Transposed storage: the same values, not contiguous.
    qt, kt, vt = (t.transpose(0, 2).contiguous().transpose(0, 2) for t in (q, k, v))
    assert not qt.is_contiguous()
    lens_t = torch.stack([lens, lens]).t()[:, 0]
    out, w = runner(qt, kt, vt, lens_t)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(w, w_expected)
    # Expanded (stride 0) keys, values and per-query lengths shared by the batch.
    k1, v1 = k[:1].expand(B, -1, -1), v[:1].expand(B, -1, -1)
    lens_e = torch.tensor([4]).expand(B, N)
    out, w = runner(q, k1, v1, lens_e)
    ref, w_ref = runner(q, k1.contiguous(), v1.contiguous(), lens_e.contiguous())
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(w, w_ref)


@pytest.mark.parametrize(
    "call",
    [
        lambda: attnscore.dot_product_attention(
            torch.randn(2, 3, 0), torch.randn(2, 4, 0), torch.randn(2, 4, 2), return_weights=True
        ),
        lambda: (
            lambda a: (a(torch.randn(2, 3, 0), torch.randn(2, 4, 0), torch.randn(2, 4, 2)), a)
        )(attnscore.DotProductAttention()),
    ],
    ids=["dot_product_attention", "DotProductAttention"],
)
def test_zero_feature_size_gives_uniform_weights(call):
    """d = 0: every score is the empty sum 0, so weights are uniform (regression: 1/sqrt(0))."""
    out, w = call()
    if not isinstance(w, torch.Tensor):
        w = w.attention_weights
    torch.testing.assert_close(w, torch.full((2, 3, 4), 0.25))
    assert out.shape == (2, 3, 2)


def _zero_feature_calls(dtype: torch.dtype):
    """(name, call(q, k, v, lens) -> output, query size) of the forms that take queries
    and keys of 0 features (W_a (q, 0) for general; W_q (h, 0), W_k (h, 0) for additive)."""
    shapes = {"W_a": (4, 0), "W_q": (3, 4), "W_k": (3, 0), "w_v": (3,)}
    W = {
        name: torch.randn(shape, dtype=dtype, requires_grad=True) for name, shape in shapes.items()
    }
    F = attnscore.functional
    return [
        ("dot_product_attention", lambda q, k, v, L: F.dot_product_attention(q, k, v, L), 0),
        ("cosine_attention", lambda q, k, v, L: F.cosine_attention(q, k, v, L), 0),
        ("general_attention", lambda q, k, v, L: F.general_attention(q, k, v, W["W_a"], L), 4),
        (
            "additive_attention",
            lambda q, k, v, L: F.additive_attention(q, k, v, W["W_q"], W["W_k"], W["w_v"], L),
            4,
        ),
        ("DotProductAttention", attnscore.DotProductAttention().to(dtype), 0),
        ("MultiplicativeAttention (lazy)", attnscore.MultiplicativeAttention(4).to(dtype), 4),
        ("CosineAttention", attnscore.CosineAttention().to(dtype), 0),
    ]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("form", range(7))
def test_zero_feature_size_trains_in_every_dtype(form, dtype):
    """Keys of 0 features train in every dtype (float16 used to fail in its product's
    backward: a reshape(-1, 0)). Every score is then an empty sum, 0 (tanh(0) = 0 for
    additive), so each query's output is the mean of its valid values."""
    name, call, query_size = _zero_feature_calls(dtype)[form]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, query_size, generator=gen).to(dtype).requires_grad_(True)
    k = torch.randn(2, 5, 0).to(dtype).requires_grad_(True)
    v = torch.randn(2, 5, 4, generator=gen).to(dtype).requires_grad_(True)
    lens = torch.tensor([2, 5])
    out = call(q, k, v, lens)
    (out.float() ** 2).sum().backward()
    v64 = v.detach().double()
    mean = torch.stack([v64[b, : int(lens[b])].mean(0) for b in range(2)])
    expected = mean[:, None].expand(2, 3, 4)
    # d(sum out^2)/dv: each valid value gets 2 * out / L from each of the 3 queries
    grad_v = torch.zeros_like(v64)
    for b in range(2):
        grad_v[b, : int(lens[b])] = 3 * 2 * mean[b] / int(lens[b])
    low = dtype in (torch.float16, torch.bfloat16)
    tol = {"rtol": 2e-2, "atol": 2e-2} if low else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(out.double(), expected, **tol, msg=name)
    torch.testing.assert_close(v.grad.double(), grad_v, **tol, msg=name)
    assert k.grad is None or k.grad.shape == k.shape
    assert q.grad is None or torch.isfinite(q.grad).all()


# ---- masked_softmax and sequence_mask: what the test_masking table lacks ---------------------


@pytest.mark.parametrize(
    ("shape", "lens"),
    [((2, 0, 4), torch.tensor([1, 2])), ((0, 3, 4), None), ((2, 3, 0), torch.tensor([0, 2]))],
)
def test_masked_softmax_empty_dimensions(shape, lens):
    out = masked_softmax(torch.randn(shape), lens)
    assert out.shape == shape


def test_masked_softmax_non_contiguous_and_expanded():
    X = torch.randn(4, 3, 2).transpose(0, 2)  # (2, 3, 4), not contiguous
    lens = torch.tensor([[3, 1, 0]]).expand(2, 3)
    torch.testing.assert_close(masked_softmax(X, lens), masked_softmax(X.contiguous(), lens))


@pytest.mark.parametrize(
    ("X", "valid_len", "error", "match"),
    [
        (np.ones((2, 3)), torch.tensor([1, 2]), TypeError, r"`X`.*torch\.Tensor.*ndarray"),
        (torch.tensor(1.0), torch.tensor(1), ValueError, r"`X`.*at least 1 dimension"),
        (torch.ones(2, 3), torch.tensor([1, -2]), ValueError, r"`valid_len`.*non-negative"),
        (torch.ones(2, 3), torch.tensor([0.5, 1.0]), ValueError, r"`valid_len`.*whole"),
        (torch.ones(2, 3), torch.tensor([[1, 2]]), ValueError, r"`valid_len`.*broadcastable"),
        (torch.ones(2, 3), torch.tensor([1, 2], device="meta"), ValueError, r"`valid_len`.*device"),
    ],
)
def test_sequence_mask_errors(X, valid_len, error, match):
    with pytest.raises(error, match=match):
        sequence_mask(X, valid_len)


def test_sequence_mask_any_dtype_and_empty():
    assert sequence_mask(torch.ones(0, 3), torch.zeros(0, dtype=torch.long)).shape == (0, 3)
    out = sequence_mask(torch.ones(2, 3, dtype=torch.int32), torch.tensor([1, 3]), value=-1)
    assert out.tolist() == [[1, -1, -1], [1, 1, 1]]


def test_show_heatmaps_without_rows_is_a_clear_error():
    with pytest.raises(ValueError, match=r"`matrices`.*rows, cols >= 1.*\(0, 1, 3, 3\)"):
        attnscore.show_heatmaps(torch.zeros(0, 1, 3, 3), "Keys", "Queries")
