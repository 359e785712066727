"""The scorer registry used across the library: one registration, every front door.

A scorer registered once (``register_scorer``) is usable by name through the module
(``make_scorer``), the functional form (``attention(..., scoring=name)``) and
``MultiHeadAttention(scoring=name)``; names mean what the registry says everywhere.
"""

from __future__ import annotations

import math

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
        lambda dropout, normalizer, **sizes: attnscore.Attention(
            neg_squared_distance, dropout, normalizer=normalizer
        ),
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


def test_attention_by_name_rejects_scorers_with_parameters():
    q = torch.randn(1, 2, 3)
    with pytest.raises(ValueError, match=r"Expected `scoring` to name a scorer without param"):
        attnscore.attention(q, q, q, "additive")
    with pytest.raises(ValueError, match=r"Expected `scoring` to be one of"):
        attnscore.attention(q, q, q, "no_such_scorer")


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
        attnscore.register_scorer(registered, spec.factory, formula="other", source="-")
    assert registry.SCORERS[registered] is spec
    new = attnscore.register_scorer(
        registered, spec.factory, formula="other", source="-", replace=True
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
