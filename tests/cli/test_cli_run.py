"""``attnscore run``: results, heatmaps, output files, bad input files."""

from __future__ import annotations

import io
import math
import os
import re
import stat
import zipfile

import numpy as np
import pytest
import torch
from clitools import one_error_line, write_inputs

from attnscore.cli import main
from attnscore.registry import SCORERS, register_scorer, scorer_names


def _reference(queries, keys, values, valid_lens, scale):
    """Masked softmax(scale * q k^T) @ v in float64, the textbook's formulation."""
    q, k, v = (torch.as_tensor(a, dtype=torch.float64) for a in (queries, keys, values))
    scores = q @ k.transpose(-1, -2) * scale
    m = scores.shape[-1]
    lengths = torch.as_tensor(valid_lens).reshape(-1, 1, 1)
    scores = scores.masked_fill(torch.arange(m).reshape(1, 1, m) >= lengths, -1e6)
    weights = torch.softmax(scores, -1)
    return (weights @ v).numpy(), weights.numpy()


@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_num_hiddens_must_be_positive_one_line(tmp_path, capsys, value):
    # This gave a traceback (exit 1) before. (What python -m adds: test_cli_root.py.)
    src = tmp_path / "in.npz"
    write_inputs(src)
    argv = ["run", "--input", str(src), "--scoring", "additive", "--num-hiddens", value]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--num-hiddens: expected a positive integer" in one_error_line(err)


# --- run: results -----------------------------------------------------------------------


@pytest.mark.parametrize("scoring", ["scaled_dot", "additive", "general", "cosine"])
def test_run_writes_output_weights_and_heatmap(tmp_path, capsys, scoring):
    src = tmp_path / "in.npz"
    arrays = write_inputs(src)
    out, png = tmp_path / "out.npz", tmp_path / "w.png"
    argv = ["run", "--input", str(src), "--scoring", scoring]
    assert main([*argv, "--output", str(out), "--heatmap", str(png)]) == 0
    assert capsys.readouterr().err == ""
    assert png.read_bytes()[:4] == b"\x89PNG"
    with np.load(out) as data:
        weights, output = data["weights"], data["output"]
    assert output.shape == (2, 3, 6) and weights.shape == (2, 3, 5)
    assert np.all(weights[0, :, 2:] == 0)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(output, weights @ arrays["values"], rtol=1e-5, atol=1e-6)
    if scoring == "scaled_dot":
        ref_out, ref_w = _reference(
            arrays["queries"], arrays["keys"], arrays["values"], [2, 5], 1 / math.sqrt(4)
        )
        np.testing.assert_allclose(weights, ref_w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(output, ref_out, rtol=1e-5, atol=1e-5)


def test_run_default_is_scaled_dot_and_dot_is_unscaled(tmp_path, capsys):
    """``dot`` means what the registry says (Luong's unscaled qᵀk), with no warning."""
    src = tmp_path / "in.npz"
    arrays = write_inputs(src)
    for extra, scale in (([], 1 / math.sqrt(4)), (["--scoring", "dot"], 1.0)):
        _, ref_w = _reference(arrays["queries"], arrays["keys"], arrays["values"], [2, 5], scale)
        out = tmp_path / f"out{len(extra)}.npz"
        assert main(["run", "--input", str(src), "--output", str(out), *extra]) == 0
        assert capsys.readouterr().err == ""
        with np.load(out) as data:
            np.testing.assert_allclose(data["weights"], ref_w, rtol=1e-5, atol=1e-6)


def test_run_pt_in_and_out(tmp_path):
    src = tmp_path / "in.pt"
    queries, keys, values = torch.randn(1, 2, 3), torch.randn(1, 4, 3), torch.randn(1, 4, 2)
    torch.save({"queries": queries, "keys": keys, "values": values}, src)
    out = tmp_path / "o.pt"
    assert main(["run", "--input", str(src), "--output", str(out)]) == 0
    saved = torch.load(out, weights_only=True)
    assert set(saved) == {"output", "weights"}
    ref_out, ref_w = _reference(queries, keys, values, [4], 1 / math.sqrt(3))
    np.testing.assert_allclose(saved["weights"].numpy(), ref_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(saved["output"].numpy(), ref_out, rtol=1e-5, atol=1e-5)


def test_run_float64_inputs_with_a_parametrised_scorer(tmp_path):
    src = tmp_path / "in.npz"
    write_inputs(
        src,
        queries=np.random.default_rng(3).normal(size=(2, 3, 4)),
        keys=np.random.default_rng(4).normal(size=(2, 5, 4)),
        values=np.random.default_rng(5).normal(size=(2, 5, 6)),
    )
    out = tmp_path / "o.npz"
    assert main(["run", "--input", str(src), "--scoring", "additive", "--output", str(out)]) == 0
    with np.load(out) as data:
        assert data["output"].dtype == np.float64


def test_run_num_hiddens_sizes_the_additive_scorer(tmp_path, capsys):
    src = tmp_path / "in.npz"
    write_inputs(src)
    outs = []
    for h in ("1", "16"):
        out = tmp_path / f"o{h}.npz"
        argv = ["run", "--input", str(src), "--scoring", "additive", "--num-hiddens", h]
        assert main([*argv, "--output", str(out)]) == 0
        with np.load(out) as data:
            outs.append(data["weights"])
    assert not np.allclose(outs[0], outs[1])


@pytest.mark.parametrize("scoring", ["scaled_dot", "cosine", "general"])
def test_run_refuses_num_hiddens_without_a_hidden_layer(tmp_path, capsys, scoring):
    src = tmp_path / "in.npz"
    write_inputs(src)
    argv = ["run", "--input", str(src), "--scoring", scoring, "--num-hiddens", "4"]
    assert main(argv) == 2
    err = one_error_line(capsys.readouterr().err)
    assert f"--num-hiddens: the {scoring} scorer has no hidden layer" in err
    assert "applies to additive" in err


def test_run_help_lists_scorers_default_and_shapes(capsys):
    assert main(["run", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for name in scorer_names():
        assert name in out
    assert "default: scaled_dot" in out
    for shape in ("(B, n, q)", "(B, m, k)", "(B, m, v)", "(B,) or (B, n)"):
        assert shape in out


def test_run_normalizer_hardmax_puts_all_weight_on_the_best_allowed_key(tmp_path):
    src = tmp_path / "in.npz"
    arrays = write_inputs(src)
    out = tmp_path / "o.npz"
    argv = ["run", "--input", str(src), "--scoring", "scaled_dot", "--normalizer", "hardmax"]
    assert main([*argv, "--output", str(out)]) == 0
    _, ref_w = _reference(arrays["queries"], arrays["keys"], arrays["values"], [2, 5], 0.5)
    expected = (ref_w == ref_w.max(-1, keepdims=True)).astype(np.float32)
    with np.load(out) as data:
        np.testing.assert_array_equal(data["weights"], expected)
        np.testing.assert_allclose(data["output"], expected @ arrays["values"], rtol=1e-6)


def test_run_unknown_normalizer_is_one_line(tmp_path, capsys):
    src = tmp_path / "in.npz"
    write_inputs(src)
    assert main(["run", "--input", str(src), "--normalizer", "nope"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--normalizer: invalid choice: 'nope'" in one_error_line(err)


def test_a_newly_registered_scorer_runs_through_the_cli(tmp_path):
    """Issue 9.4: registered in one place, usable by `attnscore run --scoring NAME`."""

    def halved_dot(q, k):
        return q @ k.transpose(-1, -2) / 2

    name = "test_halved_dot"
    register_scorer(
        name,
        halved_dot,
        formula="qᵀk / 2",
        source="a test",
        same_feature_size=True,
    )
    try:
        src = tmp_path / "in.npz"
        arrays = write_inputs(src)
        out = tmp_path / "o.npz"
        assert main(["run", "--input", str(src), "--scoring", name, "--output", str(out)]) == 0
        ref_out, ref_w = _reference(
            arrays["queries"], arrays["keys"], arrays["values"], [2, 5], 0.5
        )
        with np.load(out) as data:
            np.testing.assert_allclose(data["weights"], ref_w, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(data["output"], ref_out, rtol=1e-5, atol=1e-5)
    finally:
        del SCORERS[name]
    assert name not in scorer_names()


def test_run_nan_input_warns_and_heatmap_shows_nan(tmp_path, capsys):
    src = tmp_path / "in.npz"
    keys = np.random.default_rng(1).normal(size=(2, 5, 4)).astype(np.float32)
    keys[1, 0, 0] = np.nan  # an attended key of example 1
    keys[0, 4, 0] = np.nan  # a masked key of example 0: harmless
    write_inputs(src, keys=keys)
    out, svg = tmp_path / "o.npz", tmp_path / "w.svg"
    assert main(["run", "--input", str(src), "--output", str(out), "--heatmap", str(svg)]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("attnscore: warning: ")
    assert "output holds 18 NaN, weights hold 15 NaN; --input's keys hold NaN or inf" in err
    with np.load(out) as data:
        assert np.isfinite(data["output"][0]).all() and np.isnan(data["output"][1]).all()
    assert b"<!-- NaN -->" in svg.read_bytes()  # the legend entry for the NaN colour


def test_run_finite_output_no_warning_despite_nan_in_padding(tmp_path, capsys):
    src = tmp_path / "in.npz"
    keys = np.random.default_rng(1).normal(size=(2, 5, 4)).astype(np.float32)
    values = np.random.default_rng(2).normal(size=(2, 5, 6)).astype(np.float32)
    keys[0, 3], values[0, 4] = np.nan, np.inf  # beyond valid_lens[0] = 2
    write_inputs(src, keys=keys, values=values)
    assert main(["run", "--input", str(src), "--output", str(tmp_path / "o.npz")]) == 0
    assert capsys.readouterr().err == ""


# --- run: heatmap -----------------------------------------------------------------------


def test_run_heatmap_titles_each_example(tmp_path, monkeypatch):
    from attnscore.cli import _files

    figures = []
    real = _files.save_figure

    def keep(fig, path, option, **kwargs):
        figures.append(fig)
        return real(fig, path, option, **kwargs)

    monkeypatch.setattr("attnscore.cli.run.save_figure", keep)
    src = tmp_path / "in.npz"
    write_inputs(
        src,
        queries=np.ones((11, 1, 4), np.float32),
        keys=np.ones((11, 5, 4), np.float32),
        values=np.ones((11, 5, 6), np.float32),
        valid_lens=np.arange(11) % 5 + 1,
    )
    assert main(["run", "--input", str(src), "--heatmap", str(tmp_path / "w.pdf")]) == 0
    assert (tmp_path / "w.pdf").read_bytes()[:5] == b"%PDF-"
    (fig,) = figures
    heatmaps = fig.axes[:-1]
    assert [ax.get_title() for ax in heatmaps] == [
        "example 0 (first 8 of 11)",
        *[f"example {i}" for i in range(1, 8)],
    ]
    assert all(ax.get_ylabel() == "Queries" for ax in heatmaps)
    ax = heatmaps[0]
    low, high = sorted(ax.get_ylim())
    assert [t for t in ax.get_yticks() if low <= t <= high] == [0.0]  # one query: one tick


# --- run: files -------------------------------------------------------------------------


@pytest.fixture
def umask():
    old = os.umask(0o022)
    os.umask(old)

    def set_umask(value):
        os.umask(value)

    yield set_umask
    os.umask(old)


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_run_file_modes_follow_the_umask(tmp_path, umask, mask, mode):
    src = tmp_path / "in.npz"
    write_inputs(src)
    umask(mask)
    out, png = tmp_path / "o.npz", tmp_path / "w.png"
    assert main(["run", "--input", str(src), "--output", str(out), "--heatmap", str(png)]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == mode
    assert stat.S_IMODE(png.stat().st_mode) == mode


@pytest.mark.parametrize(
    ("option", "name", "message"),
    [
        ("--heatmap", "w.jpg", "--heatmap: expected a file ending in .png, .pdf or .svg"),
        ("--output", "out.txt", "--output: expected a file ending in .npz or .pt"),
        ("--output", "nodir/o.npz", "--output: folder {tmp}/nodir does not exist"),
        ("--heatmap", "nodir/w.png", "--heatmap: folder {tmp}/nodir does not exist"),
        ("--output", ".", "is a folder"),
    ],
)
def test_run_refuses_output_paths_before_any_work(tmp_path, capsys, option, name, message):
    src = tmp_path / "in.npz"
    write_inputs(src)
    before = sorted(tmp_path.iterdir())
    other = ["--heatmap", str(tmp_path / "ok.png")] if option == "--output" else []
    other = other or ["--output", str(tmp_path / "ok.npz")]
    target = tmp_path / name if name != "." else tmp_path
    assert main(["run", "--input", str(src), option, str(target), *other]) == 2
    captured = capsys.readouterr()
    assert message.format(tmp=tmp_path) in one_error_line(captured.err)
    assert captured.out == ""
    assert sorted(tmp_path.iterdir()) == before  # nothing written, no folder created


def test_run_device_cpu(tmp_path):
    src = tmp_path / "in.npz"
    write_inputs(src)
    assert main(["run", "--input", str(src), "--device", "cpu"]) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_run_device_cuda_without_gpu_one_line(tmp_path, capsys):
    src = tmp_path / "in.npz"
    write_inputs(src)
    assert main(["run", "--input", str(src), "--device", "cuda"]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert "--device: CUDA was asked for, but no GPU is available" in err


def test_run_device_unknown(tmp_path, capsys):
    assert main(["run", "--input", str(tmp_path / "x.npz"), "--device", "tpu"]) == 2
    assert "--device: expected cpu, cuda or cuda:N" in one_error_line(capsys.readouterr().err)


# --- run: bad input files -----------------------------------------------------------------


def _save_npy_as_npz(p):
    with p.open("wb") as f:
        np.save(f, np.ones(3))


def _truncated_member(p):
    """A readable zip whose queries.npy member ends before its data does."""
    buf = io.BytesIO()
    np.save(buf, np.ones((2, 3, 4), np.float32))
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("queries.npy", buf.getvalue()[:-8])


@pytest.mark.parametrize(
    ("name", "setup", "message"),
    [
        ("in.npz", lambda p: None, "--input: no such file"),
        ("in.npz", lambda p: p.write_text("hello, world\n"), "it is not an .npz archive"),
        ("in.npz", lambda p: p.write_bytes(b"PK\x03\x04 truncated"), "not an .npz archive"),
        ("in.npz", _save_npy_as_npz, "not an .npz archive"),
        ("in.npz", _truncated_member, "a damaged .npz archive"),
        (
            "in.npz",
            lambda p: np.savez(p, queries=np.array(["a"]), keys=np.ones(2), values=np.ones(2)),
            "expected `queries` in .* to be numeric, but got dtype <U1",
        ),
        ("in.pt", lambda p: p.write_text("hello, world\n"), "not a file written by torch.save"),
        ("in.pt", lambda p: p.write_bytes(b"\x80\x02garbage"), "not a file written by torch.save"),
        ("in.pt", lambda p: torch.save([torch.ones(2)], p), "but it holds a list"),
        (
            "in.pt",
            lambda p: torch.save([np.ones(2)], p),
            r"holds objects other than tensors \(numpy\S*\), which are never unpickled",
        ),
        (
            "in.pt",
            lambda p: torch.save({"queries": 1, "keys": 2, "values": 3}, p),
            "expected `queries` in .* to be numeric, but got int",
        ),
        ("in.txt", lambda p: p.write_text("x"), "expected a .npz or .pt file, but got in.txt"),
        ("in.npz", lambda p: write_inputs(p, keys=None), r"lacks array\(s\) \['keys'\]"),
        ("in.npz", lambda p: write_inputs(p, valid_lens=np.array([1, 2, 3])), "valid_lens"),
        ("in.npz", lambda p: write_inputs(p, valid_lens=np.array([1, -2])), "non-negative"),
        (
            "in.npz",
            lambda p: write_inputs(p, keys=np.zeros((2, 5, 3), np.float32)),
            "feature size",
        ),
        ("in.npz", lambda p: write_inputs(p, queries=np.ones(4, np.float32)), r"\(B, n, q\)"),
    ],
)
def test_run_bad_input_one_clear_line_exit_2_no_output(tmp_path, capsys, name, setup, message):
    src = tmp_path / name
    setup(src)
    out = tmp_path / "out.npz"
    assert main(["run", "--input", str(src), "--output", str(out)]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert re.search(message, err), err
    assert "--input" in err
    assert "allow_pickle" not in err and "KeyError" not in err and "trust" not in err
    assert not out.exists() and list(tmp_path.glob(".out*")) == []


@pytest.mark.parametrize("scoring", ["additive", "general"])
def test_run_zero_feature_queries_with_a_sized_scorer(tmp_path, capsys, scoring):
    src = tmp_path / "in.npz"
    write_inputs(src, queries=np.ones((2, 3, 0), np.float32))
    out = tmp_path / "out.npz"
    assert main(["run", "--input", str(src), "--scoring", scoring, "--output", str(out)]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert f"--scoring {scoring}: Expected `query_size` to be a positive int, but got 0" in err
    assert not out.exists()


def test_truncated_npz_file(tmp_path, capsys):
    src = tmp_path / "full.npz"
    write_inputs(src)
    cut = tmp_path / "cut.npz"
    cut.write_bytes(src.read_bytes()[:200])
    assert main(["run", "--input", str(cut)]) == 2
    assert "not an .npz archive" in one_error_line(capsys.readouterr().err)
