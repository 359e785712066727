"""The dispatch layer of attnscore.kernels: backend table, registered ops under compile,
export, FakeTensor and opcheck, what runs under torch.func, and double backward.

References are written here (float64 formulas), never taken from the code under test.
"""

from __future__ import annotations

import types

import pytest
import torch

import attnscore
from attnscore import kernels as K
from attnscore.kernels import _cpu, _dispatch, _ops, _plain
from observed_backend import observed_cpu

HAVE_C = K.available(torch.zeros(1))
needs_c = pytest.mark.skipif(not HAVE_C, reason="C kernels unavailable (disabled, or no compiler)")

FUNCTIONS = (
    "masked_softmax",
    "masked_softmax_backward",
    "additive_scores",
    "additive_scores_backward",
)


def ref_softmax(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    allowed = torch.arange(x.shape[-1]) < lengths[..., None]
    w = torch.softmax(x.double().masked_fill(~allowed, -torch.inf), -1)
    return torch.where(allowed, w, 0.0)


def ref_additive(qh, kh, w, lengths):
    s = (torch.tanh(qh[:, :, None, :] + kh[:, None, :, :]) * w).sum(-1)
    return torch.where(torch.arange(kh.shape[1]) < lengths[..., None], s, 0.0)


@pytest.fixture
def counted():
    """Count the dispatch's calls of the CPU backend's op functions (the C kernels)."""
    calls: dict[str, int] = dict.fromkeys(FUNCTIONS, 0)

    def count(name, _args, _result):
        if name in calls:
            calls[name] += 1

    with observed_cpu(count):
        yield calls


# ---- the backend table ---------------------------------------------------------------------


def test_cpu_row_and_plain_for_other_devices():
    assert K.backend_name("cpu", "masked_softmax") == "attnscore.kernels._cpu"
    assert K.backend_name("mps", "additive_scores").startswith("attnscore.kernels._plain")
    for name in _dispatch.FUNCTIONS:
        assert _dispatch.backend_function("xpu", name) is getattr(_plain, name)


def test_missing_backend_module_falls_back_to_plain():
    """The cuda row imports lazily: an ImportError (module or triton missing) means plain,
    and the report says why; leaving the block restores the device's own backend."""
    with K.use_backend("cpu", "attnscore.kernels._no_such_module"):
        assert _dispatch.backend_function("cpu", "masked_softmax") is _plain.masked_softmax
        assert "ModuleNotFoundError" in K.backend_name("cpu", "masked_softmax")
    assert K.backend_name("cpu", "masked_softmax") == "attnscore.kernels._cpu"


def test_a_backend_may_leave_functions_out():
    """A backend is a module with some of the contract's functions; the rest run plain."""
    calls = []

    def masked_softmax(x, lengths):
        calls.append(x.shape)
        return _plain.masked_softmax(x, lengths)

    backend = types.ModuleType("my_backend")
    backend.masked_softmax = masked_softmax  # type: ignore[attr-defined]
    x, lengths = torch.randn(2, 3, 5, requires_grad=True), torch.tensor([[1, 0, 5], [2, 3, 4]])
    with K.use_backend("cpu", backend):
        y = K.masked_softmax(x, lengths)
        y.backward(torch.randn_like(y))  # backward: not provided -> plain
    assert calls == [torch.Size([2, 3, 5])]
    torch.testing.assert_close(y.double(), ref_softmax(x.detach(), lengths))


# ---- registration --------------------------------------------------------------------------


def test_opcheck_masked_softmax():
    x = torch.randn(3, 4, 7, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([[0, 7, 2, 3], [1, 1, 5, 6], [7, 0, 0, 4]])
    torch.library.opcheck(_ops.masked_softmax_op, (x, lengths))
    g, y = torch.randn(3, 4, 7, dtype=torch.float64), ref_softmax(x.detach(), lengths)
    torch.library.opcheck(_ops.masked_softmax_backward_op, (g, y, lengths))


def test_opcheck_additive_scores():
    qh = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    kh = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([[0, 5, 2], [3, 1, 4]])
    torch.library.opcheck(_ops.additive_scores_op, (qh, kh, w, lengths))
    g = torch.randn(2, 3, 5, dtype=torch.float64)
    args = (g, qh.detach(), kh.detach(), w.detach(), lengths)
    torch.library.opcheck(_ops.additive_scores_backward_op, args)


def test_fake_tensors_see_the_ops():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 6, 9)
        lengths = torch.zeros(4, 6, dtype=torch.int64)
        assert K.masked_softmax(x, lengths).shape == (4, 6, 9)
        qh, kh, w = torch.empty(2, 3, 8), torch.empty(2, 5, 8), torch.empty(8)
        s = K.additive_scores(qh, kh, w, torch.zeros(2, 3, dtype=torch.int64))
        assert s.shape == (2, 3, 5)


def test_export_runs_the_plain_formulas():
    """While torch.export traces, the registered ops give way to their plain formulas: the
    program holds no attnscore op (it runs without attnscore, and exporters translate it)."""
    module = attnscore.AdditiveAttention(3, 4, 6).eval()
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 3), torch.randn(2, 5, 2)
    lengths = torch.tensor([2, 5])
    exported = torch.export.export(module, (q, k, v, lengths))
    targets = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert not [t for t in targets if "attnscore" in t], targets
    assert "aten.tanh.default" in targets
    torch.testing.assert_close(exported.module()(q, k, v, lengths), module(q, k, v, lengths))


# ---- compiled code keeps the C kernels ----------------------------------------------------


@needs_c
def test_compiled_additive_attention_calls_the_c_kernels(counted):
    torch._dynamo.reset()
    module = attnscore.AdditiveAttention(4, 4, 8)
    q = torch.randn(2, 3, 4, requires_grad=True)
    k, v = torch.randn(2, 5, 4), torch.randn(2, 5, 2)
    lengths = torch.tensor([2, 5])
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v, lengths)
    (grad_q,) = torch.autograd.grad(out.sum(), q)
    # forward and backward of both ops ran in C
    assert counted == dict.fromkeys(FUNCTIONS, 1)
    expected = module(q, k, v, lengths)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grad_q, torch.autograd.grad(expected.sum(), q)[0])


@needs_c
def test_compiled_masked_softmax_graph_holds_the_op():
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    x, lengths = torch.randn(2, 3, 6), torch.tensor([[1, 0, 6], [2, 3, 4]])
    compiled = torch.compile(attnscore.masked_softmax, backend=backend, fullgraph=True)
    y = compiled(x, lengths)
    torch.testing.assert_close(y.double(), ref_softmax(x, lengths))
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes]
    assert any("attnscore.masked_softmax" in t for t in targets), targets


# ---- where the plain twin runs instead ------------------------------------------------------


def test_vmap_and_func_grad_run_the_plain_twin(counted):
    """torch.func transforms cannot take the registered ops (no vmap rule): the plain
    PyTorch twin runs there, with the same results."""
    x, lengths = torch.randn(3, 2, 4, 6), torch.randint(0, 7, (3, 2, 4))
    out = torch.func.vmap(K.masked_softmax)(x, lengths)
    torch.testing.assert_close(out.double(), ref_softmax(x, lengths))
    grad = torch.func.grad(lambda t: (K.masked_softmax(t, lengths) ** 2).sum())(x)
    t = x.double().requires_grad_(True)
    (expected,) = torch.autograd.grad((ref_softmax(t, lengths) ** 2).sum(), t)
    torch.testing.assert_close(grad.double(), expected)
    assert counted["masked_softmax"] == 0 and counted["masked_softmax_backward"] == 0


def test_disabled_runs_the_plain_twin(counted):
    x, lengths = torch.randn(2, 5), torch.tensor([3, 0])
    with K.disabled():
        y = K.masked_softmax(x, lengths)
    assert counted["masked_softmax"] == 0
    torch.testing.assert_close(y.double(), ref_softmax(x, lengths))


# ---- a softmax without a mask ----------------------------------------------------------------

# 2^17 elements (torch.softmax's), 2^18 (the kernel's in inference), 2^19 (training), as
# the sizes the tests set (the shipped ones are per CPU: on a CPU they do not name, none).
_BELOW, _INFERENCE, _TRAINING = (2, 256, 256), (4, 256, 256), (8, 256, 256)


@pytest.fixture
def softmax_sizes(thresholds):  # type: ignore[no-untyped-def]
    """The kernel's softmax without a mask from 2^18 elements in inference, 2^19 in
    training, on any CPU."""
    thresholds(softmax_inference=1 << 18, softmax_training=1 << 19)


def _unmasked_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.double(), dim=-1)


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [_BELOW, _INFERENCE], ids=["below", "kernel"])
def test_unmasked_softmax_in_inference(softmax_sizes, counted, dtype, shape):
    """masked_softmax without lengths (and the softmax normalizer without a mask) runs the C
    kernel with every length m where it measured faster than torch.softmax, with the same
    result; below that size torch.softmax."""
    if dtype == torch.float16 and _cpu._softmax_dtype(dtype) != dtype:
        pytest.skip("no _Float16 in this compiler: float16 keeps torch.softmax")
    x = (torch.randn(shape) * 4).to(dtype)
    tol = {2: {"atol": 2e-3, "rtol": 1e-2}, 4: {"atol": 1e-6, "rtol": 1e-5}}.get(dtype.itemsize, {})
    for y in (attnscore.masked_softmax(x), attnscore.normalizers.softmax(x, None)):
        assert y.dtype == dtype
        torch.testing.assert_close(y.double(), _unmasked_reference(x), **tol)
    assert counted["masked_softmax"] == (2 if shape == _INFERENCE else 0)


@needs_c
def test_unmasked_softmax_keeps_torch_nan_and_inf_rows(softmax_sizes, counted):
    """Rows holding NaN, +inf or only -inf come out as torch.softmax's (NaN); -inf entries
    among finite ones are exact zeros."""
    x = torch.randn(_INFERENCE, dtype=torch.float64)
    x[0, 0, 3], x[0, 1], x[0, 2, 5], x[0, 3, :5] = torch.nan, -torch.inf, torch.inf, -torch.inf
    y, expected = attnscore.masked_softmax(x), _unmasked_reference(x)
    assert counted["masked_softmax"] == 1
    assert torch.equal(y.isnan(), expected.isnan()) and y[0, :3].isnan().all()
    assert (y[0, 3, :5] == 0).all()
    torch.testing.assert_close(y.nan_to_num(), expected.nan_to_num())


@needs_c
@pytest.mark.parametrize(
    ("dtype", "shape", "kernel"),
    [
        (torch.float32, _TRAINING, True),
        (torch.bfloat16, _TRAINING, True),
        (torch.float32, _INFERENCE, False),
        (torch.float64, _TRAINING, False),
    ],
    ids=["fp32", "bf16", "fp32-below", "fp64"],
)
def test_unmasked_softmax_in_training(softmax_sizes, counted, dtype, shape, kernel):
    """In training the kernel runs the forward from 2^19 elements (float32, bfloat16,
    float16), PyTorch's softmax backward the backward; elsewhere torch.softmax. Gradients
    against float64's."""
    x = torch.randn(shape).to(dtype).requires_grad_(True)
    g = torch.randn(shape).to(dtype)
    y = attnscore.masked_softmax(x)
    (y * g).sum().backward()
    assert counted["masked_softmax"] == int(kernel)
    assert counted["masked_softmax_backward"] == 0
    xd = x.detach().double().requires_grad_(True)
    expected = _unmasked_reference(xd)
    (expected * g.double()).sum().backward()
    assert x.grad is not None
    tol = {"atol": 2e-3, "rtol": 2e-2} if dtype.itemsize == 2 else {"atol": 1e-6, "rtol": 1e-5}
    torch.testing.assert_close(y.double(), expected.detach(), **tol)
    torch.testing.assert_close(x.grad.double(), xd.grad, **tol)


@needs_c
def test_unmasked_softmax_double_backward(thresholds):
    """The kernel's softmax in training keeps double backward exact (float64, the kernel
    allowed at this size)."""
    thresholds(softmax_training=1, softmax_training_dtypes={torch.float64})
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(attnscore.masked_softmax, (x,))


@needs_c
def test_unmasked_softmax_of_strided_scores_is_torch_softmax(softmax_sizes, counted):
    """Scores that are not contiguous (a transposed view) take torch.softmax: a copy for
    the kernel would cost what it saves."""
    x = torch.randn(_INFERENCE, dtype=torch.float64).transpose(1, 2)
    torch.testing.assert_close(attnscore.masked_softmax(x), _unmasked_reference(x))
    assert counted["masked_softmax"] == 0


def test_unmasked_softmax_runs_torch_off_the_cpu_backend(softmax_sizes, counted):
    """The plain backend (other devices, and the CUDA backend) never takes the call, nor
    does any backend with kernels disabled."""
    x = torch.randn(_INFERENCE, dtype=torch.float64)
    assert not _plain.softmax_pays(x, False) and not _backends()["cuda"].softmax_pays(x, False)
    with K.disabled():
        y = attnscore.masked_softmax(x)
    torch.testing.assert_close(y, _unmasked_reference(x))
    assert counted["masked_softmax"] == 0


# ---- double backward ------------------------------------------------------------------------


@pytest.mark.parametrize("fast", [True, False], ids=["ops", "plain"])
def test_double_backward_additive(fast):
    """create_graph backward runs the plain backward formulas, which are differentiable."""
    qh = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    kh = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([[0, 5, 2], [3, 1, 4]])
    K.set_enabled(fast)
    try:
        assert torch.autograd.gradgradcheck(
            lambda a, b, c: K.additive_scores(a, b, c, lengths), (qh, kh, w)
        )
    finally:
        K.set_enabled(None)


# ---- the backend contract ---------------------------------------------------------------


def _backends():
    from attnscore.kernels import _cuda  # imports triton (the test extra has it)

    return {"plain": _plain, "cpu": _cpu, "cuda": _cuda}


@pytest.mark.parametrize("name", ["plain", "cpu", "cuda"])
def test_every_backend_implements_the_whole_contract(name):
    """Each backend module is a Backend (the typed Protocol): every contract function, with
    the Protocol's parameter names (so the dispatcher's keyword calls reach them)."""
    import inspect

    module = _backends()[name]
    assert isinstance(module, _dispatch.Backend)
    for function in _dispatch.FUNCTIONS:
        ours = inspect.signature(getattr(module, function))
        contract = inspect.signature(getattr(_dispatch.Backend, function))
        expected = [p for p in contract.parameters if p != "self"]
        assert list(ours.parameters) == expected, (name, function)
