"""A scorer whose scores are dot products of projections of the queries and keys declares
the projection and the scale in its registry spec, and every form runs it by that
declaration: the functional form by name, the named forms, ``make_scorer`` and
``ScorerAttention``, the textbook's classes and ``MultiHeadAttention(scoring=...)``.

Which implementation ran is seen through the public ``attnscore.kernels.explaining`` (what
``attnscore.explain`` reports); results are checked against float64 formulas.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

import attnscore
from attnscore import Param, kernels, registry

TOL = dict(atol=1e-5, rtol=1e-4)  # float32 results against float64 references


def textbook_scores(name: str, q, k, params) -> torch.Tensor:
    """float64 scores from each scorer's formula (never calling attnscore)."""
    q, k = q.double(), k.double()
    p = {key: t.detach().double() for key, t in params.items()}
    if name == "dot":
        return q @ k.mT
    if name == "scaled_dot":
        return q @ k.mT / math.sqrt(q.shape[-1])
    if name in ("general", "general_scaled"):
        scores = q @ p["W_a"] @ k.mT
        return scores / math.sqrt(k.shape[-1]) if name == "general_scaled" else scores
    assert name == "cosine"
    unit_q, unit_k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    return p["log_scale"].exp() * unit_q @ unit_k.mT


def reference(scores, v, lens=None) -> torch.Tensor:
    """float64 attention of ``scores`` (B, n, m) over the first ``lens`` (B,) keys; rows
    with none give zeros."""
    m = scores.shape[-1]
    allowed = torch.ones(scores.shape, dtype=torch.bool)
    if lens is not None:
        allowed = allowed & (torch.arange(m) < lens.view(-1, *[1] * (scores.ndim - 1)))
    weights = torch.softmax(scores.masked_fill(~allowed, -torch.inf), -1).nan_to_num(0.0)
    return weights @ v.double()


def run(call: Callable[[], torch.Tensor]) -> tuple[list[tuple[str, str]], torch.Tensor]:
    """The (implementation, route) of each dot-product attention ``call()`` ran, and its
    output."""
    with kernels.explaining() as seen:
        output = call()
    return [(c.chosen, c.route) for c in seen.choices], output


def took_dot_kernel(path: list[tuple[str, str]]) -> bool:
    """Whether an implementation of dot-product attention other than the plain formulation
    ran the call (the fast paths; the scorer's own pipeline records ``pipeline``)."""
    return any(chosen not in ("plain", "pipeline") for chosen, _ in path)


def inputs(q_size=8, k_size=5):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, q_size, generator=g)
    k = torch.randn(3, 6, k_size, generator=g)
    v = torch.randn(3, 6, 7, generator=g)
    return q, k, v, torch.tensor([0, 2, 5])


@pytest.mark.parametrize("name", ["dot", "scaled_dot", "general", "general_scaled", "cosine"])
def test_the_declared_projection_times_the_scale_is_the_score_formula(name):
    """Each built-in declaration holds: the score function is the formula, and the
    projections' dot products times the scale (None: 1/√d', d' the projected size) are
    the same scores."""
    spec = attnscore.get_scorer(name)
    q, k, _, _ = inputs(8, 8 if spec.same_feature_size else 5)
    q, k = q.double(), k.double()
    params = {"W_a": torch.randn(8, 5, dtype=torch.float64)} if "general" in name else {}
    if name == "cosine":
        params = {"log_scale": torch.tensor(0.7, dtype=torch.float64)}
    expected = textbook_scores(name, q, k, params)
    torch.testing.assert_close(spec.score(q, k, **params), expected)
    assert spec.projection is not None
    qp, kp = spec.projection(q, k, **params)
    scale = 1 / math.sqrt(qp.shape[-1]) if spec.scale is None else spec.scale
    torch.testing.assert_close(qp @ kp.mT * scale, expected)


def general_forms(name: str, W_a: torch.Tensor) -> dict[str, Callable[..., torch.Tensor]]:
    """Every form of a general scorer, with ``W_a`` (8, 5): (q, k, v, lens, **masks) -> out."""
    built = attnscore.make_scorer(name, 8, 5).eval()
    own = attnscore.ScorerAttention(name, 8, 5).eval()
    for module in (built, own):
        module.load_state_dict({"W_a.weight": W_a})
    return {
        "attention": lambda *a, **m: attnscore.attention(
            *a[:3], name, *a[3:], params={"W_a": W_a}, **m
        ),
        "make_scorer": built,
        "ScorerAttention": own,
    }


CALLS = {  # how a form is called: (valid_lens?, gradients?, masks)
    "small inference by lengths": (True, False, {}),
    "lengths with gradients": (True, True, {}),
    "nothing padded": (False, True, {}),
    "causal": (False, False, {"causal": True}),
}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("form", ["attention", "make_scorer", "ScorerAttention"])
def test_general_scaled_runs_the_path_of_general(form, call):
    """``general_scaled`` is fast by its registry entry alone: every form of it reaches the
    backend exactly as the same form of ``general`` does (a dot-product kernel takes the
    calls by lengths, and these small ones with causal masking: the C pass), and gives the
    float64 formula's output."""
    q, k, v, lens = inputs()
    W_a = torch.randn(8, 5, generator=torch.Generator().manual_seed(1))
    with_lens, grad, masks = CALLS[call]
    paths = {}
    for name in ("general", "general_scaled"):
        fn = general_forms(name, W_a)[form]
        args = (q, k, v, lens) if with_lens else (q, k, v)
        with torch.set_grad_enabled(grad):
            paths[name], out = run(lambda fn=fn, args=args: fn(*args, **masks))
        scores = textbook_scores(name, q, k, {"W_a": W_a})
        if masks.get("causal"):
            scores = scores.masked_fill(torch.ones(4, 6).triu(1).bool(), -torch.inf)
        expected = reference(scores, v, lens if with_lens else None)
        torch.testing.assert_close(out.detach().double(), expected, **TOL)
    assert paths["general_scaled"] == paths["general"]
    assert took_dot_kernel(paths["general"]) == (with_lens or call == "causal")


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_multi_head_general_scaled_runs_the_path_of_general(grad):
    """``MultiHeadAttention(scoring="general_scaled")`` takes the kernels that
    ``scoring="general"`` takes, heads by lengths, with the float64 formula's output."""
    x, _, _, lens = inputs(8, 8)
    paths, outs = {}, {}
    torch.manual_seed(0)
    first = attnscore.MultiHeadAttention(8, 2, scoring="general", query_size=8).eval()
    for name in ("general", "general_scaled"):
        mha = attnscore.MultiHeadAttention(8, 2, scoring=name, query_size=8).eval()
        mha.load_state_dict(first.state_dict())
        with torch.set_grad_enabled(grad):
            paths[name], outs[name] = run(lambda mha=mha: mha(x, x, x, lens))
        w = {key: t.detach().double() for key, t in mha.state_dict().items()}
        x64 = x.double()
        heads = []
        for h in range(2):
            sl = slice(4 * h, 4 * h + 4)
            qh, kh, vh = (x64 @ w[f"W_{p}.weight"].T[:, sl] for p in "qkv")
            scores = textbook_scores(name, qh, kh, {"W_a": w["attention.W_a.weight"]})
            heads.append(reference(scores, vh, lens))
        expected = torch.cat(heads, -1) @ w["W_o.weight"].T
        torch.testing.assert_close(outs[name].detach().double(), expected, **TOL)
    assert paths["general_scaled"] == paths["general"]
    assert took_dot_kernel(paths["general"])


@pytest.mark.parametrize("name", ["general", "cosine", "scaled_dot", "dot"])
def test_every_form_of_a_scorer_runs_one_path(name):
    """The textbook's class and ``ScorerAttention`` of one name run one path (the spec's),
    and so do the functional form by name and the named functional form."""
    spec = attnscore.get_scorer(name)
    q, k, v, lens = inputs(8, 8 if spec.same_feature_size else 5)
    textbook = attnscore.make_scorer(name, 8, k.shape[-1]).eval()
    own = attnscore.ScorerAttention(name, 8, k.shape[-1]).eval()
    own.load_state_dict(textbook.state_dict())
    params = {key: t.detach() for key, t in own.parameters_by_name().items()}
    named: Callable[..., torch.Tensor] = {
        "general": lambda *a: attnscore.general_attention(*a[:3], params["W_a"], *a[3:]),
        "cosine": lambda *a: attnscore.cosine_attention(*a, scale=params["log_scale"].exp()),
        "scaled_dot": attnscore.dot_product_attention,
        "dot": lambda *a: attnscore.dot_product_attention(*a, scale=1.0),
    }[name]
    expected = reference(textbook_scores(name, q, k, params), v, lens)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            modules = [run(lambda m=m: m(q, k, v, lens)) for m in (textbook, own)]
            functions = [
                run(lambda: attnscore.attention(q, k, v, name, lens, params=params)),
                run(lambda: named(q, k, v, lens)),
            ]
        for path, out in (*modules, *functions):
            torch.testing.assert_close(out.detach().double(), expected, **TOL)
            assert took_dot_kernel(path)
        assert modules[0][0] == modules[1][0]
        assert functions[0][0] == functions[1][0]
        # the module and the functional form by name run one implementation (the module
        # may take it on a lane before the checks)
        assert [c for c, _ in modules[0][0]] == [c for c, _ in functions[0][0]]


def low_rank(queries, keys, U, V):
    """A user's scorer: (U q)ᵀ (V k) / √h, the reference formula."""
    return (queries @ U.T) @ (keys @ V.T).mT / math.sqrt(U.shape[0])


LOW_RANK_PARAMS = (
    Param("U", ("num_hiddens", "query_size")),
    Param("V", ("num_hiddens", "key_size")),
)


@pytest.fixture(params=["declared", "not declared"])
def user_scorer(request):
    """``low_rank`` registered with its projection (U q, V k) and scale None (1/√h), or
    without them."""
    declared = request.param == "declared"
    name = "low_rank_test"
    projection = (lambda queries, keys, U, V: (queries @ U.T, keys @ V.T)) if declared else None
    attnscore.register_scorer(
        name, low_rank, params=LOW_RANK_PARAMS, formula="(U q)ᵀ (V k) / √h",
        source="a test", projection=projection, scale=None,
    )  # fmt: skip
    yield name, declared
    del registry.SCORERS[name]


def test_a_users_declared_projection_gets_the_fast_paths(user_scorer):
    """A scorer registered with ``projection=`` runs dot-product kernels through the module,
    the functional form and multi-head attention, with the float64 formula's output; the
    same scorer without the declaration runs the plain pipeline (same output)."""
    name, declared = user_scorer
    q, k, v, lens = inputs()
    module = attnscore.make_scorer(name, 8, 5, num_hiddens=6).eval()
    params = {key: t.detach() for key, t in module.parameters_by_name().items()}
    h64 = {key: t.double() for key, t in params.items()}
    scores = (q.double() @ h64["U"].T) @ (k.double() @ h64["V"].T).mT / math.sqrt(6)
    expected = reference(scores, v, lens)
    calls = {
        "module, inference": lambda: torch.no_grad()(module)(q, k, v, lens),
        "module, gradients": lambda: module(q, k, v, lens),
        "functional": lambda: attnscore.attention(q, k, v, name, lens, params=params),
    }
    for call in calls.values():
        path, out = run(call)
        torch.testing.assert_close(out.detach().double(), expected, **TOL)
        assert took_dot_kernel(path) == declared
    mha = attnscore.MultiHeadAttention(8, 2, scoring=name, query_size=8).eval()
    with torch.no_grad():
        path, _ = run(lambda: mha(q, q, q, lens))
    assert took_dot_kernel(path) == declared


def test_register_scorer_checks_the_declaration():
    with pytest.raises(TypeError, match=r"Expected `projection` to be callable .* but got int"):
        attnscore.register_scorer("bad_projection", low_rank, formula="-", source="-", projection=1)
    with pytest.raises(TypeError, match=r"Expected `scale` to be a float or None, but got '2'"):
        attnscore.register_scorer("bad_scale", low_rank, formula="-", source="-", scale="2")
    assert "bad_projection" not in attnscore.scorer_names()
    assert "bad_scale" not in attnscore.scorer_names()


@pytest.mark.parametrize("declared", [False, True], ids=["fused alone", "with projection"])
def test_a_fused_path_given_at_registration_is_still_taken(declared):
    """``fused=`` keeps working: the module and the functional form offer their calls to
    it (here it declines each, so the plain pipeline gives the float64 formula's output),
    also where a projection is declared beside it."""
    offered = []

    def fused(q, k, v, mask, dropout_p, score_bias=None):
        offered.append(q.shape)
        return None

    name = "fused_test"
    attnscore.register_scorer(
        name, lambda queries, keys: queries @ keys.mT, formula="qᵀk", source="a test",
        same_feature_size=True, fused=fused,
        projection=registry.unprojected if declared else None,
    )  # fmt: skip
    try:
        q, k, v, lens = inputs(8, 8)
        expected = reference(textbook_scores("dot", q, k, {}), v, lens)
        with torch.enable_grad():  # the fused path, not the small inference lane
            outs = [
                attnscore.make_scorer(name, 8)(q.requires_grad_(), k, v, lens),
                attnscore.attention(q, k, v, name, lens),
            ]
        for out in outs:
            torch.testing.assert_close(out.detach().double(), expected, **TOL)
        assert offered == [q.shape, q.shape]
    finally:
        del registry.SCORERS[name]


@pytest.mark.parametrize("name", ["general", "cosine"])
@pytest.mark.parametrize("change", ["replaced", "converted", "assigned data"])
def test_the_lanes_read_the_parameters_of_each_call(name, change):
    """The fast lanes bind a scorer's projection to its parameters once and reuse it: a
    parameter replaced by another object, the module converted (``.to``: the same objects,
    new data) or a parameter's ``.data`` assigned, the next call computes with the new
    values, in every lane (small by lengths, nothing padded, causal)."""
    torch.manual_seed(0)
    module = attnscore.ScorerAttention(name, query_size=8, key_size=8).eval()
    q, k, v = torch.randn(2, 3, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 4)
    lens = torch.tensor([2, 5])
    calls = {
        "lengths": lambda: module(q, k, v, lens),
        "none": lambda: module(q, k, v),
        "causal": lambda: module(q, k, v, causal=True),
    }
    with torch.no_grad():
        for call in calls.values():
            call()  # the lanes bind the projection to today's parameters
        param_name = "W_a" if name == "general" else "log_scale"
        holder = module.W_a if name == "general" else module
        attribute = "weight" if name == "general" else "log_scale"
        old = getattr(holder, attribute)
        new = torch.randn_like(old) if name == "general" else old + 0.7
        if change == "replaced":
            setattr(holder, attribute, torch.nn.Parameter(new))
        elif change == "converted":
            module.double()
            q, k, v = q.double(), k.double(), v.double()
            getattr(holder, attribute).copy_(new.double())
        else:
            getattr(holder, attribute).data = new
        params = {param_name: getattr(holder, attribute)}
        scores = textbook_scores(name, q, k, params)
        for mask, call in calls.items():
            path, out = run(call)
            expected = reference(
                scores.masked_fill(torch.ones(3, 5).triu(1).bool(), -torch.inf)
                if mask == "causal"
                else scores,
                v,
                lens if mask == "lengths" else None,
            )
            assert path, mask  # a lane or the checked path ran dot-product attention
            torch.testing.assert_close(out.double(), expected, **TOL)
