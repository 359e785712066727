"""torch.export programs and ONNX files of the attention modules (issue 18, part 2), through
attnscore's own export_program and export_onnx.

Each module is exported once at the example sizes (B=2, n=3, m=5) and compared with the
eager module at two other sizes, rows of length 0 and NaN in the padding included: the
exported program in-process, the multi-head module's ONNX file in ONNX Runtime, in a process
that imports only onnxruntime and numpy. Every registered scorer, the normalizers and the
ONNX files of the other modules go through the standard routes (torch.export.export,
torch.onnx.export) in tests/integrations/test_export_routes.py, which export the same modules
with the same exporter; tests/cli/test_cli_export.py runs export_onnx's additive file.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import attnscore
from attnscore.integrations.export import (
    INPUT_NAMES,
    export_onnx,
    export_program,
)

Q, K, V = 6, 4, 5  # feature sizes (additive attention: q != k)
EXAMPLE = (2, 3, 5)  # B, n, m traced
# Other sizes than the example's, each with a row of length 0 (B = 1: only that row).
SIZES = [((3, 4, 7), [7, 0, 2]), ((1, 6, 2), [0])]


def _modules() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    mha = attnscore.MultiHeadAttention(num_hiddens=8, num_heads=2, bias=True)
    return {
        "additive": attnscore.AdditiveAttention(key_size=K, query_size=Q, num_hiddens=8),
        "dot": attnscore.DotProductAttention(),
        "multihead": mha,
    }


def _inputs(B: int, n: int, m: int, lengths: list[int], name: str, seed: int = 0):
    """queries, keys, values (float32) and valid_lens (int64); NaN in the padded keys and
    values, which must change nothing."""
    g = torch.Generator().manual_seed(seed)
    q_size = K if name == "dot" else Q
    q = torch.randn(B, n, q_size, generator=g)
    k = torch.randn(B, m, K, generator=g)
    v = torch.randn(B, m, V, generator=g)
    valid_lens = torch.tensor(lengths)
    padded = torch.arange(m) >= valid_lens[:, None]
    k[padded], v[padded] = float("nan"), float("nan")
    return q, k, v, valid_lens


def _example(name: str):
    B, n, m = EXAMPLE
    return _inputs(B, n, m, [5, 2], name, seed=1)


@pytest.fixture(scope="module")
def exported():
    """name -> (module in eval mode, its ExportedProgram)."""
    modules = _modules()
    return {
        name: (module.eval(), export_program(module, _example(name)))
        for name, module in modules.items()
    }


def _eager(module, inputs) -> torch.Tensor:
    with torch.no_grad():
        return module(*inputs)


@pytest.mark.parametrize("name", ["additive", "dot", "multihead"])
@pytest.mark.parametrize(("sizes", "lengths"), SIZES)
def test_program_equals_eager_at_other_sizes(exported, name, sizes, lengths):
    module, program = exported[name]
    inputs = _inputs(*sizes, lengths, name)
    got = program.module()(*inputs)
    want = _eager(module, inputs)
    assert got.shape == want.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if name != "multihead":  # length 0: zeros (multi-head: W_o's bias)
        assert (got[torch.tensor(lengths) == 0] == 0).all()


@pytest.mark.parametrize("name", ["additive", "dot", "multihead"])
def test_program_holds_plain_pytorch_ops_only(exported, name):
    _, program = exported[name]
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not [t for t in targets if "attnscore" in t or "dropout" in t], targets


def test_per_query_lengths_and_fixed_sizes():
    module = attnscore.DotProductAttention().eval()
    q, k, v, _ = _inputs(*EXAMPLE, [5, 5], "dot")  # no NaN padding: all keys may be read
    per_query = torch.tensor([[5, 0, 1], [2, 2, 0]])
    program = export_program(module, (q, k, v, per_query))
    q2, k2, v2, _ = _inputs(3, 4, 6, [6, 6, 6], "dot", seed=3)  # no NaN padding here
    lengths = torch.tensor([[6, 0, 1, 3], [0, 0, 0, 0], [2, 6, 5, 1]])
    torch.testing.assert_close(
        program.module()(q2, k2, v2, lengths), _eager(module, (q2, k2, v2, lengths))
    )
    fixed = export_program(module, (q, k, v), dynamic=False)
    torch.testing.assert_close(fixed.module()(q, k, v), _eager(module, (q, k, v)))
    with pytest.raises(Exception, match="queries"):  # sizes fixed to the example's
        fixed.module()(q2, k2, v2)


def test_export_under_disabled_kernels_is_the_same_program():
    module = _modules()["additive"].eval()
    with attnscore.kernels.disabled():
        program = export_program(module, _example("additive"))
    inputs = _inputs(*SIZES[0][0], SIZES[0][1], "additive")
    torch.testing.assert_close(program.module()(*inputs), _eager(module, inputs))


def test_export_keeps_the_modules_mode_and_weights():
    module = attnscore.AdditiveAttention(key_size=K, query_size=Q, num_hiddens=8, dropout=0.5)
    inputs = _example("additive")
    module.eval()(*inputs)
    weights = module.attention_weights
    module.train()
    program = export_program(module, inputs)
    assert module.training and module.dropout.training
    assert module.attention_weights is weights
    # exported in eval mode: dropout off, the program is deterministic
    out = program.module()(*inputs)
    torch.testing.assert_close(out, program.module()(*inputs))
    torch.testing.assert_close(out, _eager(module.eval(), inputs))


def test_lazy_sizes_are_fixed_by_the_example():
    module = attnscore.AdditiveAttention(num_hiddens=8)  # key and query sizes lazy
    inputs = _example("additive")
    program = export_program(module, inputs)
    other = _inputs(*SIZES[0][0], SIZES[0][1], "additive")
    torch.testing.assert_close(program.module()(*other), _eager(module, other))


@pytest.mark.parametrize(
    ("module", "inputs", "kwargs", "error", "message"),
    [
        (len, "example", {}, TypeError, r"`module` to be an nn.Module.*but got builtin_function"),
        ("dot", torch.ones(2, 3, 4), {}, TypeError, r"`example_inputs`.*but got Tensor"),
        ("dot", (torch.ones(2, 3, 4),) * 2, {}, TypeError, r"`example_inputs`.*tuple of Tensor"),
        ("dot", "2-D", {}, ValueError, r"`queries` of shape \(B, n, q\).*\(3, 4\)"),
        ("dot", "float lengths", {}, ValueError, r"`valid_lens`.*integer.*float32"),
        ("dot", "B=1", {}, ValueError, r"at least 2 .*B=1"),
        ("dot", "example", {"dynamic": "yes"}, TypeError, r"`dynamic` to be a bool"),
        ("additive", "wrong k", {}, ValueError, r"`keys` with last dimension key_size=4"),
    ],
)
def test_bad_arguments_one_clear_error(module, inputs, kwargs, error, message):
    modules = _modules()
    module = modules.get(module, module) if isinstance(module, str) else module
    q, k, v, lengths = _example("dot")
    inputs = {
        "example": (q, k, v, lengths),
        "2-D": (q[0], k, v),
        "float lengths": (q, k, v, lengths.float()),
        "B=1": (q[:1], k[:1], v[:1]),
        "wrong k": (torch.ones(2, 3, Q), torch.ones(2, 5, 3), torch.ones(2, 5, V)),
    }.get(inputs, inputs)
    with pytest.raises(error, match=message):
        export_program(module, inputs, **kwargs)


# ---- ONNX ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ort():
    """onnxruntime (the ``[onnx]`` extra), with onnx and onnxscript for exporting."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    return pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory, exported, ort):
    """The multi-head module's .onnx file, written by export_onnx."""
    path = tmp_path_factory.mktemp("onnx") / "multihead.onnx"
    export_onnx(exported["multihead"][0], _example("multihead"), path)
    return path


def _feeds(inputs) -> dict[str, np.ndarray]:
    return {name: t.numpy() for name, t in zip(INPUT_NAMES, inputs, strict=False)}


# Runs in a fresh process: every case's inputs (.npz) through its model (.onnx), outputs
# saved beside them; argv: the folder, then case=model pairs.
_ORT_ONLY = """
import sys

import numpy as np
import onnxruntime as ort

folder = sys.argv[1]
for pair in sys.argv[2:]:
    case, model = pair.split("=")
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    feeds = dict(np.load(f"{folder}/{case}.npz"))
    np.save(f"{folder}/{case}.out.npy", session.run(None, feeds)[0])
assert "torch" not in sys.modules and "attnscore" not in sys.modules, sorted(sys.modules)
"""


def test_onnx_file_runs_without_torch_or_attnscore(exported, onnx_file, ort, tmp_path):
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == list(INPUT_NAMES)
    module, _ = exported["multihead"]
    wanted = {}
    for i, (sizes, lengths) in enumerate(SIZES):
        inputs = _inputs(*sizes, lengths, "multihead")
        np.savez(tmp_path / f"case{i}.npz", **_feeds(inputs))
        wanted[f"case{i}"] = _eager(module, inputs).numpy()
    pairs = [f"{case}={onnx_file}" for case in wanted]
    done = subprocess.run(
        [sys.executable, "-c", _ORT_ONLY, str(tmp_path), *pairs], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    for case, want in wanted.items():
        got = np.load(tmp_path / f"{case}.out.npy")
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_onnx_bad_arguments_leave_no_file(ort, tmp_path):
    module = attnscore.DotProductAttention()
    with pytest.raises(ValueError, match=r"`path` ending in \.onnx.*model\.txt"):
        export_onnx(module, _example("dot"), tmp_path / "model.txt")
    one_example = tuple(t[:1] for t in _example("dot"))
    with pytest.raises(ValueError, match="at least 2"):
        export_onnx(module, one_example, tmp_path / "model.onnx")
    assert list(tmp_path.iterdir()) == []
