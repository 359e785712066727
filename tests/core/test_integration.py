"""Works where users put it: torch.compile, jit, torch.func, autocast, copies, threads.

Every path of ``paths.PATHS`` is exercised; module-only behaviour (state_dict, pickling,
``.double()``) on the paths that hold an ``nn.Module``.
"""

from __future__ import annotations

import copy
import pickle
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import attnscore
from attnscore import masked_softmax
from attnscore.scoring import dot_product_scores
from paths import PATHS, Path

MODULE_PATHS = [p for p in PATHS if p.build(4, 3, torch.float32).module is not None]


def _sizes(path: Path) -> tuple[int, int]:
    return (3, 3) if path.same_feature_size else (4, 3)


def _inputs(path: Path, dtype=torch.float32, b: int = 2, seed: int = 0):
    qs, ks = _sizes(path)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 3, qs, generator=gen, dtype=dtype)
    k = torch.randn(b, 5, ks, generator=gen, dtype=dtype)
    v = torch.randn(b, 5, 2, generator=gen, dtype=dtype)
    return q, k, v


# ---- torch.compile ---------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS, ids=str)
def test_compile_has_no_graph_break_and_matches_eager(path):
    """Whole-graph capture on every plain path (length checks are in-graph assertions):
    ``fullgraph=True`` makes any graph break an error, naming its reason."""
    torch._dynamo.reset()
    runner = path.build(*_sizes(path), torch.float32)
    q, k, v = _inputs(path)

    def fn(q, k, v, lens):
        return runner(q, k, v, lens)[0]

    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    for lens in (torch.tensor([2, 5]), torch.tensor([0, 9])):  # same graph, new values
        torch.testing.assert_close(compiled(q, k, v, lens), fn(q, k, v, lens))
    # The length check survives compilation (as an in-graph assertion: RuntimeError).
    with pytest.raises(RuntimeError, match=r"`valid_lens`.*non-negative whole numbers"):
        compiled(q, k, v, torch.tensor([1, -1]))


def test_compile_aot_eager_forward_and_backward():
    torch._dynamo.reset()
    q, k, v = (torch.randn(2, s, 4, requires_grad=True) for s in (3, 5, 5))
    lens = torch.tensor([[1, 2, 0], [5, 4, 3]])

    def fn(q, k, v):
        return attnscore.dot_product_attention(q, k, v, lens, causal=True)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out, ref = compiled(q, k, v), fn(q, k, v)
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad(ref.sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(a, b)


# ---- TorchScript -------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_jit_script_is_not_supported_with_the_documented_error():
    """Documented in docs/architecture.md: the variadic mask options, Python scorers and
    their specs."""
    with pytest.raises(torch.jit.frontend.NotSupportedError, match="variable number of arg"):
        torch.jit.script(attnscore.Attention(dot_product_scores))
    with pytest.raises((torch.jit.frontend.NotSupportedError, ValueError, RuntimeError)):
        torch.jit.script(attnscore.DotProductAttention())


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.trace.*` is deprecated:DeprecationWarning")
def test_jit_trace_works_for_fixed_shapes():
    attention = attnscore.AdditiveAttention(3, 4, 5).eval()
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 3), torch.randn(2, 5, 2)
    lens = torch.tensor([2, 5])
    traced = torch.jit.trace(attention, (q, k, v, lens))
    q2 = torch.randn(2, 3, 4)
    torch.testing.assert_close(traced(q2, k, v, lens), attention(q2, k, v, lens))


# ---- torch.func --------------------------------------------------------------------------


FUNCTIONAL = {
    "dot_product_attention": lambda q, k, v, lens: attnscore.dot_product_attention(q, k, v, lens),
    "attention": lambda q, k, v, lens: attnscore.attention(q, k, v, dot_product_scores, lens),
    "additive_attention": lambda q, k, v, lens: attnscore.additive_attention(
        q, k, v, torch.ones(5, 4) / 4, torch.eye(5, 4), torch.linspace(-1, 1, 5), lens
    ),
}


@pytest.mark.parametrize("name", sorted(FUNCTIONAL))
def test_vmap_over_inputs_and_valid_lens(name):
    """Regression: vmap with batched valid_lens failed on the data-dependent length check."""
    fn = FUNCTIONAL[name]
    q, k, v = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 2)
    lens = torch.tensor([[1, 5], [0, 3], [2, 9]])
    out = torch.func.vmap(fn)(q, k, v, lens)
    expected = torch.stack([fn(q[i], k[i], v[i], lens[i]) for i in range(3)])
    torch.testing.assert_close(out, expected)


def test_vmap_masked_softmax_with_batched_lengths():
    X, lens = torch.randn(4, 2, 3, 5), torch.randint(0, 7, (4, 2, 3))
    out = torch.func.vmap(masked_softmax)(X, lens)
    torch.testing.assert_close(
        out, torch.stack([masked_softmax(x, n) for x, n in zip(X, lens, strict=True)])
    )


@pytest.mark.parametrize("name", sorted(FUNCTIONAL))
def test_func_grad_matches_autograd(name):
    fn = FUNCTIONAL[name]
    q, k, v = torch.randn(2, 4, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 2)
    lens = torch.tensor([0, 3])
    grad_q = torch.func.grad(lambda q: fn(q, k, v, lens).sum())(q)
    q_ = q.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(fn(q_, k, v, lens).sum(), q_)
    torch.testing.assert_close(grad_q, expected)
    assert torch.all(grad_q[0] == 0)  # no valid key: zero gradient
    per_example = torch.func.vmap(torch.func.grad(lambda q, n: fn(q, k[:1], v[:1], n).sum()))
    torch.testing.assert_close(
        per_example(q.unsqueeze(1), lens.unsqueeze(1)).squeeze(1)[1],
        torch.func.grad(lambda q: fn(q, k[:1], v[:1], lens[1:]).sum())(q[1:]).squeeze(0),
    )


# ---- autocast, copies, dtype conversion ---------------------------------------------------


@pytest.mark.parametrize("path", PATHS, ids=str)
def test_autocast_bfloat16_on_cpu(path):
    runner = path.build(*_sizes(path), torch.float32)
    q, k, v = _inputs(path)
    lens = torch.tensor([2, 5])
    expected, w_expected = (t.detach() for t in runner(q, k, v, lens))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, w = runner(q, k, v, lens)
    assert torch.isfinite(out).all() and torch.all(w[0, :, 2:] == 0)
    # bfloat16 keeps 8 bits: a few units of 2^-8 relative to the largest value.
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.float(), expected, atol=0.05 * scale, rtol=0.05)
    torch.testing.assert_close(w.float(), w_expected, atol=0.03, rtol=0.03)


@pytest.mark.parametrize("path", MODULE_PATHS, ids=str)
def test_deepcopy_pickle_and_state_dict_round_trips(path):
    runner = path.build(*_sizes(path), torch.float32)
    module = runner.module
    with torch.no_grad():  # parameters unlike those any fresh build starts from
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    q, k, v = _inputs(path)
    lens = torch.tensor([3, 1])
    expected = module(q, k, v, lens)
    for clone in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        torch.testing.assert_close(clone.attention_weights, module.attention_weights)
        torch.testing.assert_close(clone(q, k, v, lens), expected)
    fresh = path.build(*_sizes(path), torch.float32).module
    fresh.load_state_dict(module.state_dict(), strict=True)
    torch.testing.assert_close(fresh(q, k, v, lens), expected)


@pytest.mark.parametrize("path", MODULE_PATHS, ids=str)
def test_to_dtype_and_double(path):
    module = path.build(*_sizes(path), torch.float32).module
    q, k, v = _inputs(path)
    lens = torch.tensor([3, 0])
    expected = module(q, k, v, lens)
    for converted in (copy.deepcopy(module).double(), copy.deepcopy(module).to(torch.float64)):
        out = converted(q.double(), k.double(), v.double(), lens)
        assert out.dtype == torch.float64 and converted.attention_weights.dtype == torch.float64
        torch.testing.assert_close(out.float(), expected)
    half = copy.deepcopy(module).to(torch.bfloat16)
    out = half(q.bfloat16(), k.bfloat16(), v.bfloat16(), lens)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    with pytest.raises(TypeError, match="dtype"):  # a float64 module on float32 inputs
        copy.deepcopy(module).double()(q, k.double(), v, lens)


# ---- threads -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS, ids=str)
def test_concurrent_calls_match_serial_calls(path):
    """One module (or function) called from several threads gives the serial results.

    ``attention_weights`` is documented as the last call's, so only outputs and the weights
    returned with them by the functional forms are compared. Grad mode is per thread, so
    each worker enters no_grad itself (the same computation as the serial calls').
    """
    runner = path.build(*_sizes(path), torch.float32)
    calls = [(*_inputs(path, seed=s), torch.tensor([s % 6, 5 - s % 6])) for s in range(16)]

    def call(c):
        with torch.no_grad():
            return runner(*c)[0]

    serial = [call(c) for c in calls]
    with ThreadPoolExecutor(max_workers=4) as pool:
        threaded = list(pool.map(call, calls))
    for a, b in zip(threaded, serial, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
