"""Every way to call attention, as a registry that tests parametrise over.

A *path* builds a runner ``(queries, keys, values, valid_lens=None, **masks) -> (output,
weights)`` with known parameters, and brings an independent *reference* for its scores,
written here in plain PyTorch from the formula (never calling attnscore), so that tests
can recompute the whole attention in float64 or naively in a low-precision dtype.

The registered scorers (:mod:`attnscore.registry`) are paths by their registry names, each
with its reference in ``REFERENCES``. To test a new way of calling attention (a fused
kernel, multi-head attention), add an entry to ``PATHS``; paths that compute the same maths
share a ``group`` and are checked to agree, weights included.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

import attnscore
from attnscore import get_scorer, kernels, make_scorer, scorer_names
from attnscore.scoring import dot_product_scores

Params = dict[str, Tensor]


@dataclass
class Runner:
    """One attention callable with its tensors (parameters and buffers) by name."""

    call: Callable[..., tuple[Tensor, Tensor]]
    params: Params
    module: nn.Module | None = None

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, valid_lens=None, **masks):
        return self.call(q, k, v, valid_lens, **masks)

    def trainable(self) -> list[Tensor]:
        return [p for p in self.params.values() if p.requires_grad]


@dataclass(frozen=True)
class Path:
    """A way to call attention: ``build(query_size, key_size, dtype)`` -> Runner."""

    name: str
    build: Callable[[int, int, torch.dtype], Runner]
    reference: Callable[[Params, Tensor, Tensor], Tensor]  # plain scores (..., n, m)
    same_feature_size: bool = False
    group: str = ""

    def __str__(self) -> str:
        return self.name


def _seeded(make: Callable[[], nn.Module], dtype: torch.dtype) -> nn.Module:
    """Build a module with parameters that depend on nothing but the path (seed 0)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        module = make()
    return module.to(dtype)


def _module_runner(make: Callable[[], nn.Module], dtype: torch.dtype) -> Runner:
    module = _seeded(make, dtype)

    def call(q, k, v, valid_lens=None, **masks):
        out = module(q, k, v, valid_lens, **masks)
        return out, module.attention_weights

    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    return Runner(call, tensors, module)


# ---- independent score references (plain formulas) -----------------------------------


def ref_additive(p: Params, q: Tensor, k: Tensor) -> Tensor:
    """w_vᵀ tanh(W_q q + b + W_k k), the textbook's broadcast (..., n, m, h) form."""
    qh = q @ p["W_q.weight"].T
    if "b" in p:
        qh = qh + p["b"]
    w = p["w_v.weight"].reshape(-1)
    if "g" in p:
        w = p["g"] * w / torch.sqrt((w * w).sum())
    feats = torch.tanh(qh.unsqueeze(-2) + (k @ p["W_k.weight"].T).unsqueeze(-3))
    return (feats * w).sum(-1)


def ref_dot(scale: float | None) -> Callable[[Params, Tensor, Tensor], Tensor]:
    def scores(p: Params, q: Tensor, k: Tensor) -> Tensor:
        s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        return (q.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1) * s

    return scores


def ref_general(p: Params, q: Tensor, k: Tensor) -> Tensor:
    return ((q @ p["W_a.weight"]).unsqueeze(-2) * k.unsqueeze(-3)).sum(-1)


def ref_general_scaled(p: Params, q: Tensor, k: Tensor) -> Tensor:
    return ref_general(p, q, k) / math.sqrt(k.shape[-1])


def ref_cosine(p: Params, q: Tensor, k: Tensor) -> Tensor:
    def unit(x: Tensor) -> Tensor:
        norm = torch.sqrt((x * x).sum(-1, keepdim=True))
        return torch.where(norm > 0, x / norm, torch.zeros_like(x))

    return torch.exp(p["log_scale"]) * (unit(q).unsqueeze(-2) * unit(k).unsqueeze(-3)).sum(-1)


class NegSquaredDistance(nn.Module):
    """A user's own scorer with a parameter: -t · ‖q - k‖²."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.tensor(0.5))

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        return -self.t * (q.unsqueeze(-2) - k.unsqueeze(-3)).pow(2).sum(-1)


def ref_negdist(p: Params, q: Tensor, k: Tensor) -> Tensor:
    return -p["scoring.t"] * ((q.unsqueeze(-2) - k.unsqueeze(-3)) ** 2).sum(-1)


# ---- builders --------------------------------------------------------------------------


def _additive_module(qs: int, ks: int, dtype: torch.dtype, **kw) -> nn.Module:
    return _seeded(lambda: attnscore.AdditiveAttention(ks, qs, 5, **kw), dtype)


def _additive_functional(qs: int, ks: int, dtype: torch.dtype) -> Runner:
    # Same parameters as the module path, so the two must agree exactly.
    module = _additive_module(qs, ks, dtype)
    p = {name: t.detach().clone().requires_grad_(True) for name, t in module.named_parameters()}

    def call(q, k, v, valid_lens=None, **masks):
        return attnscore.additive_attention(
            q,
            k,
            v,
            p["W_q.weight"],
            p["W_k.weight"],
            p["w_v.weight"],
            valid_lens,
            return_weights=True,
            **masks,
        )

    return Runner(call, p)


def _dot_functional(qs: int, ks: int, dtype: torch.dtype) -> Runner:
    def call(q, k, v, valid_lens=None, **masks):
        return attnscore.dot_product_attention(q, k, v, valid_lens, return_weights=True, **masks)

    return Runner(call, {})


def _generic_functional(qs: int, ks: int, dtype: torch.dtype) -> Runner:
    def call(q, k, v, valid_lens=None, **masks):
        return attnscore.attention(
            q, k, v, dot_product_scores, valid_lens, return_weights=True, **masks
        )

    return Runner(call, {})


def _general_functional(qs: int, ks: int, dtype: torch.dtype) -> Runner:
    # The registry's module's parameters, so both paths of the group agree exactly.
    module = _seeded(lambda: make_scorer("general", qs, ks, num_hiddens=5), dtype)
    p = {"W_a.weight": module.W_a.weight.detach().clone().requires_grad_(True)}

    def call(q, k, v, valid_lens=None, **masks):
        return attnscore.general_attention(
            q, k, v, p["W_a.weight"], valid_lens, return_weights=True, **masks
        )

    return Runner(call, p)


def _cosine_functional(qs: int, ks: int, dtype: torch.dtype) -> Runner:
    module = _seeded(lambda: make_scorer("cosine", qs, ks, num_hiddens=5), dtype)
    p = {"log_scale": module.log_scale.detach().clone().requires_grad_(True)}

    def call(q, k, v, valid_lens=None, **masks):
        scale = p["log_scale"].exp()
        return attnscore.cosine_attention(
            q, k, v, valid_lens, scale=scale, return_weights=True, **masks
        )

    return Runner(call, p)


# Independent score references of the registered scorers, by registry name. A scorer
# registered in attnscore.registry without an entry here fails test_every_scorer_is_tested.
REFERENCES: dict[str, Callable[[Params, Tensor, Tensor], Tensor]] = {
    "additive": ref_additive,
    "dot": ref_dot(1.0),
    "scaled_dot": ref_dot(None),
    "general": ref_general,
    "general_scaled": ref_general_scaled,
    "cosine": ref_cosine,
}


def _registry_path(name: str) -> Path:
    """The module the registry builds for ``name`` (h = 5 where it has hidden units)."""
    spec = get_scorer(name)

    def build(qs: int, ks: int, dt: torch.dtype) -> Runner:
        return _module_runner(lambda: make_scorer(name, qs, ks, num_hiddens=5), dt)

    return Path(f"scorer:{name}", build, REFERENCES[name], spec.same_feature_size, group=name)


def _registry_functional_path(name: str) -> Path:
    """``attention(..., name, params=...)``, the functional form from the spec, with the
    registry module's parameters (so that the group's paths agree exactly)."""
    spec = get_scorer(name)

    def build(qs: int, ks: int, dt: torch.dtype) -> Runner:
        module = _seeded(lambda: make_scorer(name, qs, ks, num_hiddens=5), dt)
        state = {id(t): key for key, t in module.named_parameters()}
        spec_params = module.parameters_by_name()
        p = {state[id(t)]: t.detach().clone().requires_grad_(True) for t in spec_params.values()}

        def call(q, k, v, valid_lens=None, **masks):
            params = {n: p[state[id(t)]] for n, t in spec_params.items()}
            return attnscore.attention(
                q, k, v, name, valid_lens, params=params, return_weights=True, **masks
            )

        return Runner(call, p)

    return Path(f"attention({name!r})", build, REFERENCES[name], spec.same_feature_size, name)


PATHS: list[Path] = [_registry_path(name) for name in scorer_names() if name in REFERENCES]
PATHS += [_registry_functional_path(name) for name in scorer_names() if name in REFERENCES]
PATHS += [
    Path(
        "AdditiveAttention(normalize)",
        lambda qs, ks, dt: _module_runner(
            lambda: attnscore.AdditiveAttention(ks, qs, 5, normalize=True), dt
        ),
        ref_additive,
        group="additive(normalize)",
    ),
    Path(
        "Attention(user module)",
        lambda qs, ks, dt: _module_runner(lambda: attnscore.Attention(NegSquaredDistance()), dt),
        ref_negdist,
        same_feature_size=True,
    ),
    Path("additive_attention", _additive_functional, ref_additive, group="additive"),
    # (name, build, reference, same_feature_size, group)
    Path("dot_product_attention", _dot_functional, ref_dot(None), True, "scaled_dot"),
    Path("attention(dot_product_scores)", _generic_functional, ref_dot(None), True, "scaled_dot"),
    Path("general_attention", _general_functional, ref_general, False, "general"),
    Path("cosine_attention", _cosine_functional, ref_cosine, True, "cosine"),
]


def _on_plain_path(path: Path) -> Path:
    """The same path with the fast kernels switched off: both must agree everywhere."""

    def build(qs: int, ks: int, dt: torch.dtype) -> Runner:
        runner = path.build(qs, ks, dt)

        def call(q, k, v, valid_lens=None, **masks):
            with kernels.disabled():
                return runner.call(q, k, v, valid_lens, **masks)

        return Runner(call, runner.params, runner.module)

    return replace(path, name=f"{path.name} [plain]", build=build)


# Paths that have a fused kernel get a plain twin in the same group.
_FAST = (
    "scorer:additive",
    "scorer:scaled_dot",
    "AdditiveAttention(normalize)",
    "additive_attention",
)
PATHS += [_on_plain_path(p) for p in PATHS if p.name in _FAST]

GROUPS: dict[str, list[Path]] = {}
for _path in PATHS:
    if _path.group:
        GROUPS.setdefault(_path.group, []).append(_path)
GROUPS = {name: paths for name, paths in GROUPS.items() if len(paths) > 1}


# ---- the plain masked attention every path is checked against ----------------------------


def allowed_keys(valid_lens: Tensor | None, batch_shape: tuple[int, ...], n: int, m: int):
    """Bool (..., n, m): True where query i may attend key j (j < its length)."""
    if valid_lens is None:
        return torch.ones((*batch_shape, n, m), dtype=torch.bool)
    lens = valid_lens.to(torch.int64)
    extra = len(batch_shape) - 1
    if lens.ndim == 1:
        lens = lens.reshape(-1, *(1,) * extra, 1)
    elif lens.ndim == 2:
        lens = lens.reshape(lens.shape[0], *(1,) * extra, n)
    return (torch.arange(m) < lens.unsqueeze(-1)).expand(*batch_shape, n, m)


def plain_masked_softmax(scores: Tensor, allowed: Tensor) -> Tensor:
    """Softmax over allowed keys in the scores' own dtype; rows with none allowed are 0."""
    x = scores.masked_fill(~allowed, float("-inf"))
    w = torch.softmax(x, dim=-1)
    return torch.where(allowed, w, torch.zeros_like(w))


def plain_attention(path: Path, params: Params, q, k, v, valid_lens):
    """(output, weights) of the plain maths, in the dtype of q, k, v and params."""
    allowed = allowed_keys(valid_lens, tuple(q.shape[:-2]), q.shape[-2], k.shape[-2])
    # Keys nobody attends do not enter the scores at all (so garbage there is harmless).
    scores = path.reference(params, q, k)
    weights = plain_masked_softmax(scores, allowed)
    v = torch.where(allowed.any(-2).unsqueeze(-1), v, torch.zeros_like(v))
    return weights @ v, weights
