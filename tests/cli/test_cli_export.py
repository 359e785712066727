"""``attnscore export``: a registered scorer's module as .onnx or .pt2; bad arguments give
one line, exit 2 and no file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from clitools import one_error_line

import attnscore
from attnscore.cli import main


def _inputs(q: int, k: int, v: int, B: int = 3, n: int = 4, m: int = 6):
    g = torch.Generator().manual_seed(5)
    return (
        torch.randn(B, n, q, generator=g),
        torch.randn(B, m, k, generator=g),
        torch.randn(B, m, v, generator=g),
        torch.tensor([m, 0, 2][:B]),
    )


def test_export_onnx_runs_in_onnx_runtime(tmp_path, capsys):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    out = tmp_path / "additive.onnx"
    argv = ["export", "--scoring", "additive", "--query-size", "6", "--key-size", "4"]
    assert main([*argv, "--value-size", "3", "--num-hiddens", "5", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    torch.manual_seed(0)  # the command's --seed
    module = attnscore.make_scorer("additive", 6, 4, num_hiddens=5).eval()
    inputs = _inputs(6, 4, 3)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    names = ("queries", "keys", "values", "valid_lens")
    (got,) = session.run(None, {name: t.numpy() for name, t in zip(names, inputs, strict=True)})
    with torch.no_grad():
        want = module(*inputs).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert [p.name for p in tmp_path.iterdir()] == ["additive.onnx"]


def test_export_pt2_multihead_loads_and_equals_eager(tmp_path):
    out = tmp_path / "mha.pt2"
    argv = ["export", "--scoring", "scaled_dot", "--heads", "2", "--num-hiddens", "8"]
    assert main([*argv, "--query-size", "5", "--out", str(out)]) == 0
    program = torch.export.load(out)
    module = attnscore.MultiHeadAttention(8, 2).eval()
    module(*_inputs(5, 5, 5))  # sizes fixed, then the exported weights
    module.load_state_dict(program.state_dict)
    inputs = _inputs(5, 5, 5, B=2, n=7, m=3)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(*inputs), module(*inputs))


def test_export_refuses_an_existing_file_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "dot.pt2"
    out.write_bytes(b"mine")
    argv = ["export", "--scoring", "dot", "--out", str(out)]
    assert main(argv) == 2
    assert "exists; pass --overwrite" in one_error_line(capsys.readouterr().err)
    assert out.read_bytes() == b"mine"
    assert main([*argv, "--overwrite"]) == 0
    assert torch.export.load(out).module() is not None
    assert [p.name for p in tmp_path.iterdir()] == ["dot.pt2"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scoring", "additive", "--out", "a.txt"], r"--out: expected a file ending in "),
        (["--scoring", "nope", "--out", "a.onnx"], r"--scoring: invalid choice: 'nope'"),
        (["--out", "a.pt2"], r"required: --scoring"),
        (["--scoring", "dot", "--out", "no/such/a.pt2"], r"--out: folder no/such does not"),
        (["--scoring", "additive", "--query-size", "0", "--out", "a.pt2"], r"--query-size: exp"),
        (["--scoring", "dot", "--num-hiddens", "4", "--out", "a.pt2"], r"no hidden layer"),
        (["--scoring", "scaled_dot", "--key-size", "3", "--out", "a.pt2"], r"one size"),
        (
            ["--scoring", "dot", "--heads", "3", "--num-hiddens", "8", "--out", "a.pt2"],
            r"--num-hiddens: Expected `num_hiddens` to be a multiple of `num_heads` \(3\)",
        ),
    ],
)
def test_bad_arguments_one_line_exit_2_no_file(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(["export", *argv]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert __import__("re").search(message, err), err
    assert list(tmp_path.iterdir()) == []


def test_help_shows_formats_and_defaults(capsys):
    assert main(["export", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for shown in (".onnx", ".pt2", "(default: 8)", "(default: float32)", "--overwrite"):
        assert shown in text
