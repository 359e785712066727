"""PyTorch's attention arguments at attnscore's entry points: one TypeError naming the
argument and attnscore's equivalent (issue 36.5).

``EQUIVALENTS`` is this test's own table: for every argument of
``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention`` (constructor and forward)
that an entry point does not take under the same name, what its error must say. The
completeness tests check that the table misses no argument of PyTorch's (read from PyTorch
itself) and that docs/coming_from_pytorch.md has a row for each.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnscore
from attnscore import (
    AdditiveAttention,
    Attention,
    CosineAttention,
    DotProductAttention,
    MultiHeadAttention,
    MultiplicativeAttention,
    ScorerAttention,
    make_scorer,
)
from attnscore.functional import MaskOptions, PoolingOptions
from attnscore.scoring import dot_product_scores

DOCS = Path(__file__).resolve().parents[2] / "docs" / "coming_from_pytorch.md"
q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 2)
lens = torch.tensor([5, 2])

# ---- the entry points, by what they are --------------------------------------------------

Call = Callable[..., object]


def _functional() -> dict[str, tuple[Call, Call]]:
    """name -> (call with keywords, the function whose signature says what it takes)."""
    W = torch.randn(5, 4)
    return {
        "attention(callable)": (
            lambda **kw: attnscore.attention(q, k, v, dot_product_scores, lens, **kw),
            attnscore.attention,
        ),
        "attention(name)": (
            lambda **kw: attnscore.attention(
                q, k, v, "general", lens, params={"W_a": torch.randn(4, 4)}, **kw
            ),
            attnscore.attention,
        ),
        "additive_attention": (
            lambda **kw: attnscore.additive_attention(q, k, v, W, W, W[:, 0], lens, **kw),
            attnscore.additive_attention,
        ),
        "dot_product_attention": (
            lambda **kw: attnscore.dot_product_attention(q, k, v, lens, **kw),
            attnscore.dot_product_attention,
        ),
        "general_attention": (
            lambda **kw: attnscore.general_attention(q, k, v, torch.randn(4, 4), lens, **kw),
            attnscore.general_attention,
        ),
        "cosine_attention": (
            lambda **kw: attnscore.cosine_attention(q, k, v, lens, **kw),
            attnscore.cosine_attention,
        ),
    }


def _modules() -> dict[str, nn.Module]:
    modules: dict[str, nn.Module] = {
        "AdditiveAttention": AdditiveAttention(4, 4, 5),
        "AdditiveAttention lazy": AdditiveAttention(num_hiddens=5),
        "DotProductAttention": DotProductAttention(),
        "MultiplicativeAttention": MultiplicativeAttention(4, 4),
        "CosineAttention": CosineAttention(),
        "ScorerAttention": ScorerAttention("general_scaled", 4, 4),
        "Attention": Attention(dot_product_scores),
    }
    for name in attnscore.scorer_names():
        modules[f"make_scorer({name!r})"] = make_scorer(name, 4, 4)
    return modules


def _multihead() -> dict[str, nn.Module]:
    return {
        "MultiHeadAttention lazy": MultiHeadAttention(8, 2),
        "MultiHeadAttention sized": MultiHeadAttention(8, 2, query_size=4),
    }


ENTRY_POINTS: dict[str, dict[str, tuple[Call, Call]]] = {
    "function": _functional(),
    "forward": {
        name: (lambda module=module, **kw: module(q, k, v, lens, **kw), module.forward)
        for name, module in _modules().items()
    },
    "multihead forward": {
        name: (lambda module=module, **kw: module(q, k, v, lens, **kw), module.forward)
        for name, module in _multihead().items()
    },
    "MultiHeadAttention": {
        "MultiHeadAttention(8, 2, ...)": (
            lambda **kw: MultiHeadAttention(8, 2, **kw),
            inspect.unwrap(MultiHeadAttention.__init__),
        ),
    },
}

# ---- what each refused argument's error must say, by entry point ---------------------------

_CALL_ARGS = {
    "query": r"`queries`, the first argument",
    "key": r"`keys`, the second argument",
    "value": r"`values`, the third argument",
    "key_padding_mask": (
        r"True = ignore.*`valid_lens=\(~key_padding_mask\)\.sum\(1\)`.*True = may attend, "
        r"`attend_mask=~key_padding_mask\[:, None, :\]`"
    ),
    "is_causal": r"`causal=True`",
    "need_weights": r"`return_weights=True`",
    "average_attn_weights": r"every head \(B, H, n, m\).*`weights\.mean\(dim=1\)`",
    "enable_gqa": r"`keys\.repeat_interleave\(H // H_kv, dim=-3\)`",
    "attn_mask": (
        r"`attend_mask`.*True = may attend: `attend_mask=attn_mask` for "
        r"F\.scaled_dot_product_attention's.*`attend_mask=~attn_mask` for "
        r"nn\.MultiheadAttention's.*`attend_mask=attn_mask == 0`"
    ),
}
EQUIVALENTS: dict[str, dict[str, str]] = {
    "function": _CALL_ARGS
    | {
        "scale": r"dot_product_attention takes `scale=`",  # the forms without a scale
        "dropout": r"the functional forms take `dropout_p`",
    },
    "forward": _CALL_ARGS
    | {
        "dropout_p": r"set when it is built \(`dropout=`\).*training mode only",
        "scale": r"`DotProductAttention\(scale=\.\.\.\)`",
    },
    "multihead forward": _CALL_ARGS
    | {
        "dropout_p": r"set when it is built \(`dropout=`\).*training mode only",
        "scale": r"`MultiHeadAttention\(\.\.\., scoring=DotProductAttention\(scale=\.\.\.\)\)`",
        "attn_mask": (
            r"True = may attend, the opposite of nn\.MultiheadAttention's bool attn_mask.*"
            r"`attend_mask=~attn_mask`.*`~attn_mask\.view\(B, H, n, m\)`"
        ),
        "need_weights": r"`return_weights=True`.*every head \(B, H, n, m\).*`weights\.mean",
    },
    "MultiHeadAttention": {
        "embed_dim": r"`num_hiddens`.*`query_size`.*MultiHeadAttention\(E, H, bias=True, "
        r"query_size=E\).*from_torch",
        "kdim": r"`key_size`",
        "vdim": r"`value_size`",
        "batch_first": r"batch-first \(B, n, E\) always.*`x\.transpose\(0, 1\)`",
        "add_bias_kv": r"no equivalent",
        "add_zero_attn": r"no equivalent.*zero weights",
        "device": r"`MultiHeadAttention\(\.\.\.\)\.to\(device\)`",
        "dtype": r"`MultiHeadAttention\(\.\.\.\)\.to\(dtype\)`",
    },
}


def _takes(signature_of: Call, where: str, name: str) -> bool:
    """Whether an entry point takes ``name`` itself (then it means what PyTorch's does)."""
    parameters = inspect.signature(signature_of).parameters
    named = {p for p, info in parameters.items() if info.kind is not info.VAR_KEYWORD}
    options = PoolingOptions if where == "function" else MaskOptions
    return name in named or (where != "MultiHeadAttention" and name in options.__annotations__)


CASES = [
    pytest.param(where, entry, name, pattern, id=f"{entry}-{name}")
    for where, entries in ENTRY_POINTS.items()
    for entry, (_, signature_of) in entries.items()
    for name, pattern in EQUIVALENTS[where].items()
    if not _takes(signature_of, where, name)
]


@pytest.mark.parametrize(("where", "entry", "name", "pattern"), CASES)
def test_a_pytorch_argument_gets_one_error_naming_the_equivalent(where, entry, name, pattern):
    call, _ = ENTRY_POINTS[where][entry]
    with pytest.raises(TypeError) as info:
        call(**{name: None})
    message = str(info.value)
    assert message.startswith(f"Unexpected keyword argument `{name}` (")
    assert re.search(r"\((F\.scaled_dot_product_attention|nn\.MultiheadAttention)'s", message)
    assert re.search(pattern, message), message


def test_the_issue_36_calls():
    x = torch.randn(2, 5, 32)
    with pytest.raises(TypeError, match=r"`embed_dim` .*`num_hiddens`"):
        MultiHeadAttention(embed_dim=32, num_heads=4)
    with pytest.raises(TypeError, match=r"`batch_first` .*batch-first \(B, n, E\) always"):
        MultiHeadAttention(32, 4, batch_first=True)
    mha = MultiHeadAttention(32, 4)
    for name, equivalent in [
        ("need_weights", "return_weights=True"),
        ("attn_mask", "attend_mask=~attn_mask"),
        ("key_padding_mask", "attend_mask=~key_padding_mask"),
        ("is_causal", "causal=True"),
    ]:
        with pytest.raises(TypeError, match=rf"`{name}` .*`{re.escape(equivalent)}"):
            mha(x, x, x, **{name: True})


def test_a_pytorch_mask_passed_where_lengths_go_is_sent_to_attend_mask():
    """The fourth positional argument is key_padding_mask in nn.MultiheadAttention's forward
    and attn_mask in SDPA; attnscore's is valid_lens, lengths."""
    key_padding_mask = torch.arange(5) >= lens[:, None]
    pattern = r"`valid_lens`.*a bool mask goes to `attend_mask=`, True = may attend.*torch\.bool"
    with pytest.raises(TypeError, match=pattern):
        MultiHeadAttention(8, 2)(q, k, v, key_padding_mask)
    with pytest.raises(TypeError, match=pattern):
        attnscore.dot_product_attention(q, k, v, torch.ones(3, 5, dtype=torch.bool))
    additive = torch.zeros(3, 5).masked_fill(torch.rand(3, 5) < 0.5, -torch.inf)
    with pytest.raises(TypeError, match=r"float mask of 0 and -inf is `attend_mask=mask == 0`"):
        attnscore.dot_product_attention(q, k, v, attend_mask=additive)


def test_other_unknown_keywords_list_what_is_taken():
    with pytest.raises(TypeError, match=r"\['colour'\]: expected keywords among \[.*'causal'"):
        attnscore.dot_product_attention(q, k, v, colour=1)
    with pytest.raises(TypeError, match=r"\['colour'\]: expected keywords among \[.*'value_size'"):
        MultiHeadAttention(8, 2, colour=1)
    # a PyTorch argument beside an unknown one: the PyTorch one is named, with its equivalent
    with pytest.raises(TypeError, match=r"`is_causal` .*`causal=True`"):
        DotProductAttention()(q, k, v, colour=1, is_causal=True)


def test_accepted_keywords_still_work():
    """The keywords attnscore shares with PyTorch keep their meaning (not refused)."""
    out = attnscore.dot_product_attention(q, k, v, dropout_p=0.0, scale=0.5)
    assert out.shape == (2, 3, 2)
    mha = MultiHeadAttention(8, num_heads=2, dropout=0.1, bias=True)
    assert mha.attention.dropout.p == 0.1 and mha.W_q.bias is not None


# ---- completeness: every argument of PyTorch's, in the table and in the docs ---------------


def _sdpa_arguments() -> list[str]:
    """F.scaled_dot_product_attention's arguments, from the signature line of its docstring
    (a builtin: inspect cannot read it)."""
    doc = F.scaled_dot_product_attention.__doc__ or ""
    head = doc[doc.index("(") + 1 : doc.index(")")]
    return [part.split("=")[0].strip() for part in head.split(",") if part.strip()]


def _mha_arguments(method: Callable[..., object]) -> list[str]:
    return [p for p in inspect.signature(method).parameters if p != "self"]


PYTORCH = {
    "SDPA": (_sdpa_arguments(), ("function", "forward")),
    "MHA()": (_mha_arguments(nn.MultiheadAttention.__init__), ("MultiHeadAttention",)),
    "MHA.forward": (_mha_arguments(nn.MultiheadAttention.forward), ("multihead forward",)),
}


def test_pytorch_arguments_were_read():
    assert _sdpa_arguments() == [
        "query",
        "key",
        "value",
        "attn_mask",
        "dropout_p",
        "is_causal",
        "scale",
        "enable_gqa",
    ]
    assert "key_padding_mask" in PYTORCH["MHA.forward"][0]
    assert "batch_first" in PYTORCH["MHA()"][0]


@pytest.mark.parametrize("api", PYTORCH)
def test_every_pytorch_argument_is_taken_or_refused_with_its_equivalent(api):
    arguments, wheres = PYTORCH[api]
    for where in wheres:
        for entry, (_, signature_of) in ENTRY_POINTS[where].items():
            for name in arguments:
                assert _takes(signature_of, where, name) or name in EQUIVALENTS[where], (
                    f"{api} argument {name!r} at {entry}: neither taken nor in EQUIVALENTS"
                )


def _docs_rows() -> list[list[str]]:
    rows = []
    for line in DOCS.read_text().splitlines():
        if line.startswith("| ") and not line.startswith("| PyTorch"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


@pytest.mark.parametrize("api", PYTORCH)
def test_every_pytorch_argument_has_a_row_in_the_docs(api):
    rows = _docs_rows()
    arguments, _ = PYTORCH[api]
    for name in arguments:
        matching = [r for r in rows if r[0] == api and r[1].startswith(f"`{name}`")]
        assert matching, f"docs/coming_from_pytorch.md has no row for {api} `{name}`"
        assert all(r[2] for r in matching), f"{api} `{name}`: no attnscore equivalent given"
