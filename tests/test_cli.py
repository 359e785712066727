"""The attnscore command: demo, run, and its errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import attnscore
from attnscore.cli import main


def test_demo_prints_book_outputs_and_writes_heatmaps(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--seed", "3"]) == 0
    out = capsys.readouterr().out
    # additive, dot, general: the toy example's [[2, 3, 4, 5]] and [[10, 11, 12, 13]]
    assert out.count("[[[ 2.  3.  4.  5.]]") == 3
    assert out.count("[[10. 11. 12. 13.]]]") == 3
    assert "summation gives the same weights for every query: True" in out
    gap = float(re.search(r"largest difference between the two: ([0-9]+\.[0-9]+)", out).group(1))
    assert gap > 0.01  # exercise 1: distinct keys, different weights
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert len(pngs) == 6 and "additive_attention.png" in pngs
    assert all(str(tmp_path / p) in out for p in pngs)


def _write_inputs(path, **overrides):
    arrays = {
        "queries": np.random.default_rng(0).normal(size=(2, 3, 4)).astype(np.float32),
        "keys": np.random.default_rng(1).normal(size=(2, 5, 4)).astype(np.float32),
        "values": np.random.default_rng(2).normal(size=(2, 5, 6)).astype(np.float32),
        "valid_lens": np.array([2, 5]),
    }
    arrays.update(overrides)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    np.savez(path, **arrays)


@pytest.mark.parametrize("scoring", ["dot", "additive"])
def test_run_writes_output_weights_and_heatmap(tmp_path, scoring):
    src = tmp_path / "in.npz"
    _write_inputs(src)
    out, png = tmp_path / "out.npz", tmp_path / "w.png"
    code = main(
        [
            "run",
            "--input",
            str(src),
            "--scoring",
            scoring,
            "--output",
            str(out),
            "--heatmap",
            str(png),
        ]
    )
    assert code == 0 and png.stat().st_size > 1000
    with np.load(out) as data:
        weights, output = data["weights"], data["output"]
    assert output.shape == (2, 3, 6) and weights.shape == (2, 3, 5)
    assert np.all(weights[0, :, 2:] == 0)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)
    with np.load(src) as data:
        np.testing.assert_allclose(output, weights @ data["values"], rtol=1e-5, atol=1e-6)


def test_run_accepts_pt(tmp_path):
    src = tmp_path / "in.pt"
    torch.save(
        {
            "queries": torch.randn(1, 2, 3),
            "keys": torch.randn(1, 4, 3),
            "values": torch.randn(1, 4, 2),
        },
        src,
    )
    assert main(["run", "--input", str(src), "--output", str(tmp_path / "o.npz")]) == 0


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: None, "no such file"),
        (lambda p: p.write_bytes(b"PK\x03\x04 truncated"), "cannot read"),
        (lambda p: _write_inputs(p, keys=None), r"lacks array\(s\) \['keys'\]"),
        (lambda p: _write_inputs(p, valid_lens=np.array([1, 2, 3])), "valid_lens"),
        (lambda p: _write_inputs(p, valid_lens=np.array([1, -2])), "non-negative"),
        (lambda p: _write_inputs(p, keys=np.zeros((2, 5, 3), np.float32)), "feature size"),
    ],
)
def test_run_bad_input_one_line_exit_2_no_output(tmp_path, capsys, setup, message):
    src = tmp_path / "in.npz"
    setup(src)
    out = tmp_path / "out.npz"
    assert main(["run", "--input", str(src), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists() and list(tmp_path.glob(".out*")) == []


def test_truncated_npz_file(tmp_path, capsys):
    src = tmp_path / "full.npz"
    _write_inputs(src)
    cut = tmp_path / "cut.npz"
    cut.write_bytes(src.read_bytes()[:200])
    assert main(["run", "--input", str(cut)]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_python_dash_m(tmp_path):
    # The package of this checkout, even when another copy is installed.
    src = str(Path(attnscore.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "attnscore", "run", "--input", str(tmp_path / "missing.npz")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("attnscore: error: --input")
