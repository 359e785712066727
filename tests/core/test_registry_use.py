"""The scorer registry used across the library: one registration, every front door.

A scorer registered once (``register_scorer``) is usable by name through the module
(``make_scorer``), the functional form (``attention(..., scoring=name)``) and
``MultiHeadAttention(scoring=name)``; names mean what the registry says everywhere.
"""

from __future__ import annotations

import copy
import math
import pickle
from contextlib import contextmanager

import numpy as np
import pytest
import torch

import attnscore
from attnscore import registry
from attnscore.cli import main
from paths import REFERENCES


def neg_squared_distance(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return -(q.unsqueeze(-2) - k.unsqueeze(-3)).pow(2).sum(-1)


@pytest.fixture
def registered():
    name = "neg_sq_distance"
    attnscore.register_scorer(
        name,
        neg_squared_distance,
        formula="-‖q - k‖²",
        source="a test",
        same_feature_size=True,
    )
    yield name
    del registry.SCORERS[name]


def ref_attention(q, k, v, lengths):
    """float64, from the formula: softmax of -‖q - k‖² over the first lengths keys."""
    q, k, v = q.double(), k.double(), v.double()
    scores = -((q[..., :, None, :] - k[..., None, :, :]) ** 2).sum(-1)
    allowed = torch.arange(k.shape[-2]) < lengths.reshape(-1, *[1] * (q.ndim - 2))[..., None]
    w = torch.softmax(scores.masked_fill(~allowed, -torch.inf), -1)
    return torch.where(allowed, w, 0.0) @ v


def test_every_registered_scorer_has_a_test_reference():
    assert set(attnscore.scorer_names()) <= set(REFERENCES)


def test_a_registered_scorer_works_through_every_front_door(registered):
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
    lengths = torch.tensor([2, 5])
    expected = ref_attention(q, k, v, lengths)
    assert registered in attnscore.scorer_names()
    module = attnscore.make_scorer(registered, 4)
    torch.testing.assert_close(module(q, k, v, lengths), expected.float())
    out = attnscore.attention(q, k, v, registered, lengths)
    torch.testing.assert_close(out, expected.float())

    mha = attnscore.MultiHeadAttention(8, 2, scoring=registered).eval()
    x, y = torch.randn(2, 3, 5), torch.randn(2, 4, 5)
    got = mha(x, y, y, torch.tensor([1, 4]))
    heads = []
    for h in range(2):
        sl = slice(4 * h, 4 * h + 4)
        heads.append(
            ref_attention(
                (x @ mha.W_q.weight.T)[..., sl],
                (y @ mha.W_k.weight.T)[..., sl],
                (y @ mha.W_v.weight.T)[..., sl],
                torch.tensor([1, 4]),
            )
        )
    expected_mha = torch.cat(heads, -1) @ mha.W_o.weight.double().T
    torch.testing.assert_close(got.double(), expected_mha.detach(), atol=1e-5, rtol=1e-5)


def test_attention_by_name_checks_the_params_against_the_spec():
    q, k = torch.randn(1, 2, 3), torch.randn(1, 4, 5)
    with pytest.raises(ValueError, match=r"`params` with the tensors \['W_k', 'W_q', 'w_v'\] of"):
        attnscore.attention(q, q, q, "additive")
    with pytest.raises(ValueError, match=r"`params` .*\['W_a'\].*but got \['W_a', 'extra'\]"):
        attnscore.attention(q, k, k, "general", params={"W_a": torch.ones(3, 5), "extra": q})
    with pytest.raises(ValueError, match=r"Expected `W_a` of shape \(3, 5\), but got \(5, 3\)"):
        attnscore.attention(q, k, k, "general", params={"W_a": torch.ones(5, 3)})
    with pytest.raises(ValueError, match=r"`w_v` of shape \(1, 7\), but got \(1, 6\)"):
        params = {"W_q": torch.ones(7, 3), "W_k": torch.ones(7, 5), "w_v": torch.ones(1, 6)}
        attnscore.attention(q, k, k, "additive", params=params)
    with pytest.raises(TypeError, match=r"Expected `W_a` to be a torch.Tensor, but got list"):
        attnscore.attention(q, k, k, "general", params={"W_a": [[1.0]]})
    with pytest.raises(TypeError, match=r"`params` only with a registered scorer's name"):
        attnscore.attention(q, q, q, neg_squared_distance, params={})
    with pytest.raises(ValueError, match=r"Expected `scoring` to be one of"):
        attnscore.attention(q, q, q, "no_such_scorer")


SIZES = ("query_size", "key_size")


@contextmanager
def temporarily(name, score, params):
    """``score`` registered as ``name`` with ``params`` for the ``with`` block."""
    attnscore.register_scorer(name, score, params=params, formula="-", source="a test")
    try:
        yield attnscore.get_scorer(name)
    finally:
        del registry.SCORERS[name]


def bilinear_tanh(queries, keys, U, V):
    """A scorer with parameters of three sizes: tanh(U q)ᵀ tanh(V k)."""
    return torch.tanh(queries @ U.T) @ torch.tanh(keys @ V.T).transpose(-1, -2)


def test_a_scorer_with_parameters_needs_only_its_function_and_registration(tmp_path):
    """The spec alone gives the module (parameters of the declared shapes, checked sizes),
    the functional form (params by name) and the CLI."""
    name = "test_bilinear_tanh"
    U, V = (attnscore.Param(n, ("num_hiddens", size)) for n, size in zip("UV", SIZES, strict=True))
    with temporarily(name, bilinear_tanh, (U, V)) as spec:
        assert spec.hidden_units and not spec.takes_lengths
        module = attnscore.make_scorer(name, 3, 5, num_hiddens=7).eval()
        assert isinstance(module, attnscore.ScorerAttention)
        assert module.U.weight.shape == (7, 3) and module.V.weight.shape == (7, 5)
        q, k, v = torch.randn(2, 4, 3), torch.randn(2, 6, 5), torch.randn(2, 6, 2)
        lengths = torch.tensor([3, 6])
        U, V = module.U.weight.double(), module.V.weight.double()
        scores = torch.tanh(q.double() @ U.T) @ torch.tanh(k.double() @ V.T).transpose(1, 2)
        allowed = torch.arange(6) < lengths[:, None, None]
        w = torch.softmax(scores.masked_fill(~allowed, -torch.inf), -1)
        expected = (w @ v.double()).float()
        torch.testing.assert_close(module(q, k, v, lengths), expected)
        got = attnscore.attention(
            q, k, v, name, lengths, params={"U": module.U.weight, "V": module.V.weight}
        )
        torch.testing.assert_close(got, expected)
        with pytest.raises(ValueError, match=r"`keys` with last dimension key_size=5"):
            module(q, q, q)
        with pytest.raises(TypeError, match=r"needs `num_hiddens` \(a dimension of U"):
            attnscore.ScorerAttention(name, query_size=3, key_size=5)
        lazy = attnscore.ScorerAttention(name, num_hiddens=7)  # sizes from the first call
        assert lazy(q, k, v).shape == (2, 4, 2) and lazy.V.weight.shape == (7, 5)
        copied = pickle.loads(pickle.dumps(module))
        torch.testing.assert_close(copied(q, k, v, lengths), expected)

        src, out = tmp_path / "in.npz", tmp_path / "out.npz"
        np.savez(src, queries=q.numpy(), keys=k.numpy(), values=v.numpy())
        argv = ["run", "--input", str(src), "--scoring", name, "--num-hiddens", "7"]
        assert main([*argv, "--output", str(out)]) == 0


def test_attention_by_name_dot_is_unscaled_and_scaled_dot_is_scaled():
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 2)
    for name, scale in (("dot", 1.0), ("scaled_dot", 1 / math.sqrt(4))):
        w = torch.softmax((q.double() @ k.double().transpose(1, 2)) * scale, -1)
        expected = (w @ v.double()).float()
        torch.testing.assert_close(attnscore.attention(q, k, v, name), expected)


def test_multihead_default_is_scaled_dot_and_dot_is_unscaled():
    """Names mean what the registry says, in MultiHeadAttention too (no shim, no warning)."""
    default = attnscore.MultiHeadAttention(8, 2).eval()
    assert default.attention.scale is None  # scaled: 1/sqrt(d)
    dot = attnscore.MultiHeadAttention(8, 2, scoring="dot").eval()
    assert isinstance(dot.attention, attnscore.DotProductAttention) and dot.attention.scale == 1


@pytest.mark.parametrize("name", ["two words", "", "dash-name", 3])
def test_register_scorer_refuses_names_that_are_not_words(name):
    with pytest.raises(ValueError, match=r"Expected `name` to be a word like 'my_scorer'"):
        attnscore.register_scorer(name, lambda **arguments: None, formula="-", source="-")
    assert name not in registry.SCORERS


def test_register_scorer_refuses_a_taken_name_unless_replacing(registered):
    spec = registry.SCORERS[registered]
    with pytest.raises(ValueError, match=rf"`name`.*'{registered}', which is registered already"):
        attnscore.register_scorer(registered, spec.score, formula="other", source="-")
    assert registry.SCORERS[registered] is spec
    new = attnscore.register_scorer(
        registered, spec.score, formula="other", source="-", replace=True
    )
    assert registry.SCORERS[registered] is new and new.formula == "other"


def test_a_registered_scorer_works_through_the_cli(registered, tmp_path, capsys):
    """`attnscore run --scoring NAME` runs a scorer registered at run time."""

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, s, d, generator=gen) for s, d in ((3, 4), (5, 4), (5, 6)))
    lengths = torch.tensor([2, 5])
    src, out = tmp_path / "in.npz", tmp_path / "out.npz"
    np.savez(src, queries=q.numpy(), keys=k.numpy(), values=v.numpy(), valid_lens=lengths)
    argv = ["run", "--input", str(src), "--scoring", registered, "--output", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    with np.load(out, allow_pickle=False) as data:
        got = torch.from_numpy(data["output"])
    torch.testing.assert_close(got, ref_attention(q, k, v, lengths).float())


@pytest.mark.parametrize(
    ("params", "error", "match"),
    [
        ([("W", ("query_size",))], TypeError, r"`params` to be a sequence of Param"),
        ([attnscore.Param("W", ("heads",))], ValueError, r"`params` of scorer 'bad'.*'heads'"),
        ([attnscore.Param("W", (0,))], ValueError, r"shapes of positive ints"),
        ([attnscore.Param("lengths", ())], ValueError, r"other than 'lengths'"),
        ([attnscore.Param("W", ()), attnscore.Param("W", ())], ValueError, r"distinct"),
        ([attnscore.Param("not a name", ())], ValueError, r"identifier names"),
    ],
)
def test_register_scorer_checks_params(params, error, match):
    with pytest.raises(error, match=match):
        attnscore.register_scorer(
            "bad", neg_squared_distance, formula="-", source="-", params=params
        )
    assert "bad" not in registry.SCORERS


def test_register_scorer_refuses_a_score_that_is_not_callable():
    with pytest.raises(TypeError, match=r"Expected `score` to be callable.*but got str"):
        attnscore.register_scorer("bad", "q @ k", formula="-", source="-")
    assert "bad" not in registry.SCORERS


def test_a_spec_reads_the_lengths_hint_from_the_signature():
    assert registry.SCORERS["additive"].takes_lengths
    assert not registry.SCORERS["general"].takes_lengths
    # a builtin without a signature gets no hint rather than an error
    spec = registry.ScorerSpec("builtin", torch.matmul, "-", "-")
    assert not spec.takes_lengths


def test_copied_modules_share_their_spec_and_still_score():
    module = attnscore.make_scorer("general", 3, 5)
    q, k, v = torch.randn(2, 4, 3), torch.randn(2, 6, 5), torch.randn(2, 6, 2)
    for copied in (copy.copy(module), copy.deepcopy(module)):
        assert copied.spec is module.spec
        torch.testing.assert_close(copied(q, k, v), module(q, k, v))


def test_dot_product_attention_with_its_own_scale_matches_the_formula():
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 2)
    lengths = torch.tensor([2, 5])
    scores = (q.double() @ k.double().transpose(1, 2)) * 0.3
    allowed = torch.arange(5) < lengths[:, None, None]
    w = torch.softmax(scores.masked_fill(~allowed, -torch.inf), -1)
    got = attnscore.dot_product_attention(q, k, v, lengths, scale=0.3)
    torch.testing.assert_close(got, (w @ v.double()).float())


def test_only_input_sizes_may_wait_for_the_first_call():
    A = attnscore.Param("A", ("num_hiddens", "query_size"))
    B = attnscore.Param("B", ("key_size", "num_hiddens"))  # an output of a size from inputs
    with temporarily("test_hidden_in", lambda q, k, A, B: (q @ A.T @ B.T) @ k.mT, (A, B)) as spec:
        with pytest.raises(TypeError, match=r"needs `num_hiddens` \(a dimension of A"):
            attnscore.ScorerAttention(spec, key_size=4)
        with pytest.raises(TypeError, match=r"needs `key_size` \(a dimension of B"):
            attnscore.ScorerAttention(spec, num_hiddens=3)  # B's output size is not an input's
        module = attnscore.ScorerAttention(spec, key_size=4, num_hiddens=3)  # q from the call
        assert module(torch.randn(2, 5, 6), torch.randn(2, 7, 4), torch.randn(2, 7, 1)).shape == (
            2,
            5,
            1,
        )
        assert module.A.weight.shape == (3, 6)
