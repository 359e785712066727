"""Build, load a checkpoint, run: every module, lazily sized and sized up front, alone and
inside a user's model (issue 36.4).

A checkpoint here is what a user writes: ``torch.save(model.state_dict(), file)``, read back
with ``torch.load(file, weights_only=True)`` into a freshly built model of other random
weights. The loaded model must hold the trained model's tensors and compute its outputs.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
import torch
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
from paths import NegSquaredDistance

Q, K, V = 4, 3, 2  # feature sizes of queries, keys and values (q = k for dot products)


def _scorer(name: str, lazy: bool) -> Callable[[], nn.Module]:
    same = attnscore.get_scorer(name).same_feature_size
    if not lazy:
        return lambda: make_scorer(name, Q, Q if same else K, num_hiddens=5)
    return lambda: ScorerAttention(name, Q, num_hiddens=5)  # the key size from the call


def _sized_by_keys(name: str) -> bool:
    """Whether a scorer has a matrix whose input size the keys may give (a lazy form)."""
    return any(p.is_matrix and p.shape[1] == "key_size" for p in attnscore.get_scorer(name).params)


MODULES: list[tuple[str, Callable[[], nn.Module], bool]] = [
    # (id, build, whether queries and keys share one size)
    ("additive eager", lambda: AdditiveAttention(K, Q, 5), False),
    ("additive lazy", lambda: AdditiveAttention(num_hiddens=5), False),
    ("additive lazy bias", lambda: AdditiveAttention(num_hiddens=5, bias=True), False),
    ("additive weight norm", lambda: AdditiveAttention(K, Q, 5, normalize=True), False),
    ("dot product", lambda: DotProductAttention(scale=0.5), True),
    ("general eager", lambda: MultiplicativeAttention(Q, K), False),
    ("general lazy", lambda: MultiplicativeAttention(Q), False),
    ("cosine learned", lambda: CosineAttention(learn_scale=True), True),
    ("cosine fixed", lambda: CosineAttention(scale=3.0), True),
    ("user scoring module", lambda: Attention(NegSquaredDistance()), True),
    *(
        (
            f"registry {name} {'lazy' if lazy else 'eager'}",
            _scorer(name, lazy),
            attnscore.get_scorer(name).same_feature_size,
        )
        for name in attnscore.scorer_names()
        for lazy in (False, True)
        if _sized_by_keys(name) or not lazy
    ),
    *(
        (f"multi-head {scoring} {form}", build, False)
        for scoring in attnscore.scorer_names()
        for form, build in (
            ("lazy", lambda s=scoring: MultiHeadAttention(8, 2, bias=True, scoring=s)),
            (
                "eager",
                lambda s=scoring: MultiHeadAttention(
                    8, 2, scoring=s, query_size=Q, key_size=K, value_size=V
                ),
            ),
        )
    ),
]


class UserModel(nn.Module):
    """A user's model that contains an attention module: embeddings in, a head out."""

    def __init__(self, attention: nn.Module, same_size: bool) -> None:
        super().__init__()
        self.embed_q = nn.Linear(6, Q)
        self.embed_k = nn.Linear(6, Q if same_size else K)
        self.attention = attention
        self.head = nn.LazyLinear(1)  # the attention's output size: V, or E multi-head

    def forward(self, x: torch.Tensor, y: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        values = y[..., :V]
        return self.head(self.attention(self.embed_q(x), self.embed_k(y), values, lens))


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (
        torch.randn(2, 3, 6, generator=gen),
        torch.randn(2, 5, 6, generator=gen),
        torch.tensor([5, 2]),
    )


def _through_a_file(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, torch.Tensor] = torch.load(buffer, weights_only=True)
    return loaded


def _train_step(model: nn.Module, *inputs: torch.Tensor) -> None:
    """One optimiser step, so that the checkpoint holds weights no fresh model has."""
    optimiser = torch.optim.SGD(model.parameters(), lr=0.5)
    model(*inputs).square().sum().backward()
    optimiser.step()


@pytest.mark.parametrize(("build", "same"), [m[1:] for m in MODULES], ids=[m[0] for m in MODULES])
def test_build_load_run_inside_a_user_model(build, same):
    x, y, lens = _inputs()
    torch.manual_seed(0)
    trained = UserModel(build(), same)
    trained(x, y, lens)  # sizes lazy parts
    _train_step(trained, x, y, lens)
    state = _through_a_file(trained.state_dict())

    torch.manual_seed(1)  # other random weights
    fresh = UserModel(build(), same)
    fresh.load_state_dict(state)  # strict: every key, nothing more
    for name, tensor in fresh.state_dict().items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0, msg=name)
    torch.testing.assert_close(fresh.eval()(x, y, lens), trained.eval()(x, y, lens))
    assert "in_features=0" not in repr(fresh)


@pytest.mark.parametrize(("build", "same"), [m[1:] for m in MODULES], ids=[m[0] for m in MODULES])
def test_build_load_run_alone(build, same):
    x, y, lens = _inputs()
    q, k, v = x[..., :Q], y[..., : Q if same else K], y[..., :V]
    torch.manual_seed(0)
    trained = build()
    trained(q, k, v, lens)
    torch.manual_seed(1)
    fresh = build()
    fresh.load_state_dict(_through_a_file(trained.state_dict()))
    torch.testing.assert_close(fresh(q, k, v, lens), trained(q, k, v, lens))
    if isinstance(fresh, MultiHeadAttention):  # the sizes are the checkpoint's, and checked
        with pytest.raises(ValueError, match=r"`keys` with last dimension 3 \(the projection"):
            fresh(q, y[..., : K + 1], v, lens)


def test_the_issue_36_reproduction():
    """The normal build-load-run workflow failed: ``Expected 'queries' with last dimension 0
    (fixed by the first call)``, from a lazy projection that load_state_dict filled."""
    x = torch.randn(2, 5, 32)
    m = MultiHeadAttention(32, 4)
    m(x, x, x)
    f = MultiHeadAttention(32, 4)
    f.load_state_dict(m.state_dict())
    torch.testing.assert_close(f(x, x, x), m(x, x, x))
    assert f.W_q.in_features == 32


@pytest.mark.parametrize("bias", [False, True])
def test_multi_head_sized_up_front_has_its_parameters_at_construction(bias):
    mha = MultiHeadAttention(8, 2, bias=bias, query_size=5, key_size=3, value_size=7)
    shapes = {name: tuple(p.shape) for name, p in mha.named_parameters()}
    expected = {"W_q.weight": (8, 5), "W_k.weight": (8, 3), "W_v.weight": (8, 7)}
    expected["W_o.weight"] = (8, 8)
    if bias:
        expected |= {f"W_{x}.bias": (8,) for x in "qkvo"}
    assert shapes == expected
    assert sum(p.numel() for p in mha.parameters()) == sum(
        torch.Size(s).numel() for s in expected.values()
    )
    # key_size defaults to query_size, and value_size to key_size (as kdim and vdim)
    assert MultiHeadAttention(8, 2, query_size=5).W_v.in_features == 5
    assert MultiHeadAttention(8, 2, query_size=5, key_size=3).W_v.in_features == 3


@pytest.mark.parametrize("scoring", attnscore.scorer_names())
def test_lazy_and_eager_checkpoints_load_into_each_other(scoring):
    """One set of state_dict keys: a checkpoint of the textbook's lazy form loads into a
    module sized up front and back."""
    q, kv = torch.randn(2, 3, 5), torch.randn(2, 4, 5)
    lazy = MultiHeadAttention(8, 2, bias=True, scoring=scoring)
    lazy(q, kv, kv)
    eager = MultiHeadAttention(8, 2, bias=True, scoring=scoring, query_size=5)
    assert eager.state_dict().keys() == lazy.state_dict().keys()
    eager.load_state_dict(lazy.state_dict())
    torch.testing.assert_close(eager(q, kv, kv), lazy(q, kv, kv))
    again = MultiHeadAttention(8, 2, bias=True, scoring=scoring)
    again.load_state_dict(eager.state_dict())
    torch.testing.assert_close(again(q, kv, kv), lazy(q, kv, kv))


def test_a_checkpoint_of_a_module_never_called_leaves_it_lazy():
    fresh = MultiHeadAttention(8, 2)
    assert "(W_q): LazyLinear(in_features=None, out_features=8, bias=False)" in repr(fresh)
    fresh.load_state_dict(MultiHeadAttention(8, 2).state_dict())
    x = torch.randn(2, 3, 6)
    assert fresh(x, x, x).shape == (2, 3, 8)  # sized by its first call, as before
    assert fresh.W_q.in_features == 6


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"query_size": 0}, "`query_size` to be a positive int"),
        ({"key_size": 2.0}, "`key_size` to be a positive int"),
        ({"value_size": True}, "`value_size` to be a positive int"),
    ],
)
def test_bad_sizes_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(8, 2, **kwargs)
