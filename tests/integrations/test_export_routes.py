"""The standard export routes on a user's model that holds an attnscore module (issue 36).

``torch.export.export(model, args, dynamic_shapes=...)`` and ``torch.onnx.export(model, args,
dynamic_shapes=..., dynamo=True)`` of a model with a Linear before and after the module, no
attnscore wrapper: each is exported once at the example sizes (B=2, n=3, m=5, n < m) and run
at two other sizes (n > m among them) with rows of length 0, lengths above m and NaN in the
padded keys and values. The program and ONNX Runtime, in a process that imports neither
torch nor attnscore, give the eager model's output within 1e-5 (float32). Each route exports
one model holding every case's model, one output each (an export pays seconds of fixed
cost; what each module traces to is the same), and each case's output is checked.
"""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn
from torch.export import Dim

import attnscore

Q, K, V, OUT = 6, 4, 5, 3  # feature sizes; OUT: the Linear after the module
EXAMPLE = ((2, 3, 5), [5, 2])
# Other sizes than the example's: length 0, lengths above m (9 > 7), n > m, B = 1.
SIZES = [((3, 4, 7), [9, 0, 2]), ((1, 6, 2), [0])]


class UserModel(nn.Module):
    """A user's model: a Linear on the queries, the attention module, a Linear after it."""

    def __init__(self, attention: nn.Module, out_size: int) -> None:
        super().__init__()
        self.before = nn.Linear(Q, Q)
        self.attention = attention
        self.after = nn.Linear(out_size, OUT)

    def forward(self, queries, keys, values, valid_lens):
        return self.after(self.attention(self.before(queries), keys, values, valid_lens))


def _attention(case: str) -> tuple[nn.Module, int]:
    """The attention module of a case and its output size; queries (Q) and keys (K) differ
    in size where the scorer allows it, else both are projected to K first."""
    if case == "multihead":
        return attnscore.MultiHeadAttention(num_hiddens=8, num_heads=2, bias=True), 8
    scorer, _, normalizer = case.partition("+")
    module = attnscore.make_scorer(scorer, Q, K, num_hiddens=7, normalizer=normalizer or "softmax")
    return module, V


def _model(case: str) -> nn.Module:
    torch.manual_seed(0)
    attention, out_size = _attention(case)
    model = UserModel(attention, out_size)
    if getattr(attention, "same_feature_size", False):
        model.before = nn.Linear(Q, K)  # q == k for dot-product-like scorers
    _eager(model, _example())  # lazy sizes (multi-head's projections) are fixed by a call
    return model.eval()


def _inputs(B: int, n: int, m: int, lengths: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, n, Q, generator=g)
    k = torch.randn(B, m, K, generator=g)
    v = torch.randn(B, m, V, generator=g)
    valid_lens = torch.tensor(lengths)
    padded = torch.arange(m) >= valid_lens[:, None]
    k[padded], v[padded] = float("nan"), float("nan")
    return q, k, v, valid_lens


def _dynamic_shapes():
    B, n, m = Dim("B"), Dim("n"), Dim("m")
    return ({0: B, 1: n}, {0: B, 1: m}, {0: B, 1: m}, {0: B})


CASES = [
    *attnscore.scorer_names(),
    "multihead",
    "scaled_dot+hardmax",
    "additive+sparsemax",
    pytest.param(
        "general+entmax15",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("entmax") is None, reason="entmax not installed"
        ),
    ),
]


def _eager(model, inputs):
    with torch.no_grad():
        return model(*inputs)


def _example():
    (B, n, m), lengths = EXAMPLE
    return _inputs(B, n, m, lengths, seed=1)


def _runnable_cases() -> list[str]:
    """The cases of CASES this environment runs (entmax15 needs entmax)."""
    cases = [param if isinstance(param, str) else param.values[0] for param in CASES]
    if importlib.util.find_spec("entmax") is None:
        cases.remove("general+entmax15")
    return cases


class EveryCase(nn.Module):
    """The user's models of the cases side by side, one output each: a model holding every
    case's module, so that one export (seconds of fixed cost, paid once) takes them all."""

    def __init__(self, cases: list[str]) -> None:
        super().__init__()
        self.models = nn.ModuleList(_model(case) for case in cases)

    def forward(self, queries, keys, values, valid_lens):
        return tuple(model(queries, keys, values, valid_lens) for model in self.models)


@pytest.fixture(scope="module")
def exported_cases():
    """``torch.export.export`` of :class:`EveryCase` at the example sizes: the cases, the
    program's call_function targets, and per other size the program's outputs and the
    eager model's (one per case)."""
    cases = _runnable_cases()
    model = EveryCase(cases).eval()
    program = torch.export.export(model, _example(), dynamic_shapes=_dynamic_shapes())
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    runs = []
    for i, (sizes, lengths) in enumerate(SIZES):
        inputs = _inputs(*sizes, lengths, seed=10 + i)
        runs.append((program.module()(*inputs), _eager(model, inputs)))
    return cases, targets, runs


@pytest.mark.parametrize("case", CASES)
def test_torch_export_of_a_model_holding_the_module(case, exported_cases):
    cases, targets, runs = exported_cases
    assert not [t for t in targets if "attnscore" in t], targets
    j = cases.index(case)
    for got, want in runs:
        assert torch.isfinite(want[j]).all()
        torch.testing.assert_close(got[j], want[j], atol=1e-5, rtol=1e-5)


# Runs in a fresh process: the inputs of each size (.npz, arrays in input order) through
# the model (.onnx), each size's outputs saved beside them; argv: the model, then the sizes.
_ORT_ONLY = """
import sys

import numpy as np
import onnxruntime as ort

session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
for name in sys.argv[2:]:
    arrays = np.load(f"{name}.npz")
    feeds = {i.name: arrays[str(n)] for n, i in enumerate(session.get_inputs())}
    np.savez(f"{name}.out.npz", *session.run(None, feeds))
assert "torch" not in sys.modules and "attnscore" not in sys.modules, sorted(sys.modules)
"""


# torch.onnx names the dimensions once per Dim; it notes each repeat of one.
@pytest.mark.filterwarnings("ignore:# The axis name:UserWarning")
def test_onnx_export_of_models_holding_the_modules_runs_without_torch(tmp_path):
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    # The exporter warns, for every export, that torchvision's ops have no translation.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    cases = _runnable_cases()
    model = EveryCase(cases).eval()
    path = tmp_path / "every-case.onnx"
    onnx_program = torch.onnx.export(
        model, _example(), dynamic_shapes=_dynamic_shapes(), dynamo=True, verbose=False
    )
    assert onnx_program is not None
    onnx_program.save(str(path))
    wanted: dict[str, tuple[torch.Tensor, ...]] = {}
    for i, (sizes, lengths) in enumerate(SIZES):
        inputs = _inputs(*sizes, lengths, seed=10 + i)
        name = str(tmp_path / f"size{i}")
        np.savez(f"{name}.npz", **{str(j): t.numpy() for j, t in enumerate(inputs)})
        wanted[name] = _eager(model, inputs)
    done = subprocess.run(
        [sys.executable, "-c", _ORT_ONLY, str(path), *wanted], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    for name, outputs in wanted.items():
        got = np.load(f"{name}.out.npz")
        assert len(got.files) == len(cases) == len(outputs)
        for j, (case, want) in enumerate(zip(cases, outputs, strict=True)):
            assert torch.isfinite(want).all(), case
            np.testing.assert_allclose(
                got[f"arr_{j}"], want.numpy(), atol=1e-5, rtol=1e-5, err_msg=f"{case} at {name}"
            )


class EveryMask(nn.Module):
    """A user's model calling one module with every mask kind: none, lengths (B, n), a
    boolean mask, causal, causal + lengths (B,), key and query lengths."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, queries, keys, values, lengths, attend):
        a = self.attention
        return (
            a(queries, keys, values),
            a(queries, keys, values, lengths),
            a(queries, keys, values, attend_mask=attend),
            a(queries, keys, values, causal=True),
            a(queries, keys, values, lengths[:, 0], causal=True),
            a(queries, keys, values, lengths[:, 0], query_valid_lens=lengths[:, 1]),
        )


def _mask_inputs(B: int, n: int, m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, size, K, generator=g) for size in (n, m, m))
    lengths = torch.randint(0, m + 2, (B, n), generator=g)  # 0 and above m among them
    return q, k, v, lengths, torch.rand(B, n, m, generator=g) > 0.4


@pytest.mark.parametrize("case", ["additive", "multihead"])
def test_torch_export_with_every_mask_kind(case):
    attention = _attention(case)[0] if case == "multihead" else attnscore.make_scorer(case, K, K)
    model = EveryMask(attention).eval()
    _eager(model, _mask_inputs(2, 3, 5, 0))  # lazy sizes
    B, n, m = Dim("B"), Dim("n"), Dim("m")
    shapes = ({0: B, 1: n}, {0: B, 1: m}, {0: B, 1: m}, {0: B, 1: n}, {0: B, 1: n, 2: m})
    program = torch.export.export(model, _mask_inputs(2, 3, 5, 1), dynamic_shapes=shapes)
    for sizes in ((3, 6, 4), (1, 2, 7)):  # n > m, then n < m with B = 1
        inputs = _mask_inputs(*sizes, seed=2)
        for kind, (got, want) in enumerate(
            zip(program.module()(*inputs), _eager(model, inputs), strict=True)
        ):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"mask kind {kind}")
