"""Bad and unusual input at every public entry point: one clear error, or a documented result.

Tables, not one test per case: ``ERRORS`` holds input mutations that must raise an error
naming the argument ("Expected ..., but got ... instead"); ``RESULTS`` holds edge cases
with a documented result (empty dimensions, NaN, non-contiguous and expanded tensors).
Both run on every path of ``paths.PATHS``; the CLI table runs ``attnscore run``.
(masked_softmax's own error table is in test_masking.py, show_heatmaps' in
test_plotting.py.)
"""

from __future__ import annotations

import re
from pathlib import Path as FilePath

import numpy as np
import pytest
import torch

import attnscore
from attnscore import masked_softmax, sequence_mask
from attnscore.cli import main
from paths import PATHS, Path

B, N, M, V = 2, 3, 5, 2


def _inputs(path: Path, b: int = B, n: int = N, m: int = M, dtype=torch.float32):
    qs, ks = (3, 3) if path.same_feature_size else (4, 3)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, n, qs, generator=gen).to(dtype)
    k = torch.randn(b, m, ks, generator=gen).to(dtype)
    v = torch.randn(b, m, V, generator=gen).to(dtype)
    return q, k, v, torch.tensor([2, 5][:b] + [1] * max(0, b - 2))


def _replace(index: int, make):
    """A mutation replacing argument ``index`` of (q, k, v, valid_lens)."""

    def mutate(args):
        args = list(args)
        args[index] = make(*args)
        return args, {}

    return mutate


def _mask(name: str, make):
    def mutate(args):
        return list(args), {name: make(*args)}

    return mutate


Q, K, VALUES, LENS = range(4)
ERRORS = [
    ("queries 2-D", _replace(Q, lambda q, k, v, lens: q[0]), ValueError, r"`queries`.*at least 3"),
    ("keys 2-D", _replace(K, lambda q, k, v, lens: k[0]), ValueError, r"`keys`.*at least 3"),
    (
        "values 1-D",
        _replace(VALUES, lambda q, k, v, lens: v[0, 0]),
        ValueError,
        r"`values`.*at least",
    ),
    (
        "queries a list",
        _replace(Q, lambda q, k, v, lens: q.tolist()),
        TypeError,
        r"`queries`.*list",
    ),
    ("queries int", _replace(Q, lambda q, k, v, lens: q.long()), TypeError, r"`queries`.*float"),
    ("keys int", _replace(K, lambda q, k, v, lens: k.int()), TypeError, r"`keys`.*float"),
    ("values bool", _replace(VALUES, lambda q, k, v, lens: v > 0), TypeError, r"`values`.*float"),
    ("keys float64", _replace(K, lambda q, k, v, lens: k.double()), TypeError, r"`keys`.*dtype"),
    (
        "values complex",
        _replace(VALUES, lambda q, k, v, lens: v.to(torch.complex64)),
        TypeError,
        r"`values`.*float",
    ),
    (
        "values m-1",
        _replace(VALUES, lambda q, k, v, lens: v[:, 1:]),
        ValueError,
        r"`keys`.*`values`",
    ),
    ("keys batch 1", _replace(K, lambda q, k, v, lens: k[:1]), ValueError, r"`keys`.*`values`"),
    (
        "keys and values batch 1",
        lambda a: ([a[0], a[1][:1], a[2][:1], a[3]], {}),
        ValueError,
        r"`queries`.*`keys`.*batch",
    ),
    (
        "heads only on queries",
        _replace(Q, lambda q, k, v, lens: q.unsqueeze(1)),
        ValueError,
        r"`queries`.*`keys`.*batch",
    ),
    (
        "keys on meta",
        lambda a: ([a[0], a[1].to("meta"), a[2].to("meta"), a[3]], {}),
        ValueError,
        r"`keys`.*device",
    ),
    (
        "valid_lens (3,)",
        _replace(LENS, lambda q, k, v, lens: torch.tensor([1, 2, 3])),
        ValueError,
        r"`valid_lens`.*\(2,\) or \(2, 3\).*got shape \(3,\)",
    ),
    (
        "valid_lens (B, n, 1)",
        _replace(LENS, lambda q, k, v, lens: torch.ones(B, N, 1, dtype=torch.long)),
        ValueError,
        r"`valid_lens`.*shape",
    ),
    (
        "valid_lens 0-d",
        _replace(LENS, lambda q, k, v, lens: torch.tensor(2)),
        ValueError,
        r"`valid_lens`.*shape \(\)",
    ),
    (
        "valid_lens negative",
        _replace(LENS, lambda q, k, v, lens: torch.tensor([1, -3])),
        ValueError,
        r"`valid_lens`.*non-negative.*-3",
    ),
    (
        "valid_lens fractional",
        _replace(LENS, lambda q, k, v, lens: torch.tensor([1.0, 2.5])),
        ValueError,
        r"`valid_lens`.*whole numbers.*2\.5",
    ),
    (
        "valid_lens inf",
        _replace(LENS, lambda q, k, v, lens: torch.tensor([1.0, float("inf")])),
        ValueError,
        r"`valid_lens`.*whole numbers.*inf",
    ),
    (
        "valid_lens bool",
        _replace(LENS, lambda q, k, v, lens: torch.tensor([True, False])),
        TypeError,
        r"`valid_lens`.*bool",
    ),
    (
        "valid_lens a list",
        _replace(LENS, lambda q, k, v, lens: [1, 2]),
        TypeError,
        r"`valid_lens`.*torch\.Tensor.*list",
    ),
    (
        "valid_lens on meta",
        _replace(LENS, lambda q, k, v, lens: lens.to("meta")),
        ValueError,
        r"`valid_lens`.*device.*meta",
    ),
    (
        "query_valid_lens (B + 1,)",
        _mask("query_valid_lens", lambda q, k, v, lens: torch.ones(B + 1, dtype=torch.long)),
        ValueError,
        r"`query_valid_lens`.*shape",
    ),
    (
        "query_valid_lens negative",
        _mask("query_valid_lens", lambda q, k, v, lens: torch.tensor([1, -1])),
        ValueError,
        r"`query_valid_lens`.*non-negative",
    ),
    (
        "attend_mask float",
        _mask("attend_mask", lambda q, k, v, lens: torch.ones(B, N, M)),
        TypeError,
        r"`attend_mask`.*bool.*float32",
    ),
    (
        "attend_mask (B, N, M + 1)",
        _mask("attend_mask", lambda q, k, v, lens: torch.ones(B, N, M + 1, dtype=torch.bool)),
        ValueError,
        r"`attend_mask`.*broadcastable",
    ),
    (
        "attend_mask on meta",
        _mask(
            "attend_mask",
            lambda q, k, v, lens: torch.ones(B, N, M, dtype=torch.bool, device="meta"),
        ),
        ValueError,
        r"`attend_mask`.*device",
    ),
    ("causal 'yes'", _mask("causal", lambda q, k, v, lens: "yes"), TypeError, r"`causal`.*bool"),
]


@pytest.mark.parametrize(("case", "mutate", "error", "match"), ERRORS, ids=[e[0] for e in ERRORS])
@pytest.mark.parametrize("path", PATHS, ids=str)
def test_bad_input_raises_one_clear_error(path, case, mutate, error, match):
    runner = path.build(*((3, 3) if path.same_feature_size else (4, 3)), torch.float32)
    args, masks = mutate(_inputs(path))
    with pytest.raises(error, match=match) as info:
        runner(*args, **masks)
    message = str(info.value)
    assert message.startswith("Expected") and message.endswith("instead.")


def test_unknown_mask_keyword_is_rejected():
    q, k, v, lens = _inputs(PATHS[0])
    with pytest.raises(TypeError, match=r"Unexpected keyword.*key_padding_mask"):
        attnscore.dot_product_attention(q, k[..., :4], v, lens, key_padding_mask=None)


# ---- documented results -------------------------------------------------------------------


def _documented(path: Path, b: int, n: int, m: int, lens):
    runner = path.build(*((3, 3) if path.same_feature_size else (4, 3)), torch.float32)
    q, k, v, _ = _inputs(path, b, n, m)
    for t in (q, k, v):
        t.requires_grad_(True)
    out, w = runner(q, k, v, lens)
    return (q, k, v), out, w


EMPTY = [
    # (id, B, n, m, valid_lens): n = 0 or B = 0 give empty results; m = 0 gives zero output.
    ("n=0", B, 0, M, None),
    ("n=0 lens (B,)", B, 0, M, torch.tensor([1, 2])),
    ("n=0 lens (B, 0)", B, 0, M, torch.zeros(B, 0, dtype=torch.long)),
    ("B=0", 0, N, M, None),
    ("B=0 lens (0,)", 0, N, M, torch.zeros(0, dtype=torch.long)),
    ("m=0", B, N, 0, None),
    ("m=0 lens (B,)", B, N, 0, torch.tensor([0, 3])),
    ("m=0 lens (B, n)", B, N, 0, torch.ones(B, N, dtype=torch.long)),
    ("n=m=0", B, 0, 0, torch.tensor([1, 0])),
]


@pytest.mark.parametrize(("case", "b", "n", "m", "lens"), EMPTY, ids=[e[0] for e in EMPTY])
@pytest.mark.parametrize("path", PATHS, ids=str)
def test_empty_dimensions_documented_result(path, case, b, n, m, lens):
    inputs, out, w = _documented(path, b, n, m, lens)
    assert out.shape == (b, n, V) and w.shape == (b, n, m)
    assert torch.all(out == 0) and torch.all(w == 0)  # vacuous when empty
    out.sum().backward()  # and the backward pass runs, with finite zero gradients
    for t in inputs:
        assert t.grad is None or (torch.isfinite(t.grad).all() and torch.all(t.grad == 0))


@pytest.mark.parametrize("path", PATHS, ids=str)
def test_nan_in_valid_inputs_propagates(path):
    """NaN where it is attended is never hidden: the affected outputs are NaN."""
    runner = path.build(*((3, 3) if path.same_feature_size else (4, 3)), torch.float32)
    q, k, v, _ = _inputs(path)
    lens = torch.tensor([2, 5])
    q2 = q.clone()
    q2[0, 1, 0] = float("nan")
    out, _ = runner(q2, k, v, lens)
    assert torch.isnan(out[0, 1]).all() and torch.isfinite(out[1]).all()
    v2 = v.clone()
    v2[1, 4, 0] = float("nan")  # attended by every query of example 1
    out, _ = runner(q, k, v2, lens)
    assert torch.isnan(out[1, :, 0]).all() and torch.isfinite(out[0]).all()
    k2 = k.clone()
    k2[0, 0, 0] = float("nan")
    out, w = runner(q, k2, v, lens)
    # NaN spreads over the valid positions only: padded weights stay exactly 0.
    assert torch.isnan(w[0, :, :2]).all() and torch.all(w[0, :, 2:] == 0)
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1]).all()
    # A query that may attend nothing is inert, NaN or not (documented: zero output).
    out, _ = runner(q2, k, v, torch.tensor([[2, 0, 2], [5, 5, 5]]))
    assert torch.all(out[0, 1] == 0)


@pytest.mark.parametrize("path", PATHS, ids=str)
def test_non_contiguous_and_expanded_inputs_match_contiguous(path):
    runner = path.build(*((3, 3) if path.same_feature_size else (4, 3)), torch.float64)
    q, k, v, lens = (t.double() if t.is_floating_point() else t for t in _inputs(path))
    expected, w_expected = runner(q, k, v, lens)
    # Transposed storage: the same values, not contiguous.
    qt, kt, vt = (t.transpose(0, 2).contiguous().transpose(0, 2) for t in (q, k, v))
    assert not qt.is_contiguous()
    lens_t = torch.stack([lens, lens]).t()[:, 0]
    out, w = runner(qt, kt, vt, lens_t)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(w, w_expected)
    # Expanded (stride 0) keys, values and per-query lengths shared by the batch.
    k1, v1 = k[:1].expand(B, -1, -1), v[:1].expand(B, -1, -1)
    lens_e = torch.tensor([4]).expand(B, N)
    out, w = runner(q, k1, v1, lens_e)
    ref, w_ref = runner(q, k1.contiguous(), v1.contiguous(), lens_e.contiguous())
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(w, w_ref)


@pytest.mark.parametrize(
    "call",
    [
        lambda: attnscore.dot_product_attention(
            torch.randn(2, 3, 0), torch.randn(2, 4, 0), torch.randn(2, 4, 2), return_weights=True
        ),
        lambda: (
            lambda a: (a(torch.randn(2, 3, 0), torch.randn(2, 4, 0), torch.randn(2, 4, 2)), a)
        )(attnscore.DotProductAttention()),
    ],
    ids=["dot_product_attention", "DotProductAttention"],
)
def test_zero_feature_size_gives_uniform_weights(call):
    """d = 0: every score is the empty sum 0, so weights are uniform (regression: 1/sqrt(0))."""
    out, w = call()
    if not isinstance(w, torch.Tensor):
        w = w.attention_weights
    torch.testing.assert_close(w, torch.full((2, 3, 4), 0.25))
    assert out.shape == (2, 3, 2)


# ---- masked_softmax and sequence_mask: what the test_masking table lacks ---------------------


@pytest.mark.parametrize(
    ("shape", "lens"),
    [((2, 0, 4), torch.tensor([1, 2])), ((0, 3, 4), None), ((2, 3, 0), torch.tensor([0, 2]))],
)
def test_masked_softmax_empty_dimensions(shape, lens):
    out = masked_softmax(torch.randn(shape), lens)
    assert out.shape == shape


def test_masked_softmax_non_contiguous_and_expanded():
    X = torch.randn(4, 3, 2).transpose(0, 2)  # (2, 3, 4), not contiguous
    lens = torch.tensor([[3, 1, 0]]).expand(2, 3)
    torch.testing.assert_close(masked_softmax(X, lens), masked_softmax(X.contiguous(), lens))


@pytest.mark.parametrize(
    ("X", "valid_len", "error", "match"),
    [
        (np.ones((2, 3)), torch.tensor([1, 2]), TypeError, r"`X`.*torch\.Tensor.*ndarray"),
        (torch.tensor(1.0), torch.tensor(1), ValueError, r"`X`.*at least 1 dimension"),
        (torch.ones(2, 3), torch.tensor([1, -2]), ValueError, r"`valid_len`.*non-negative"),
        (torch.ones(2, 3), torch.tensor([0.5, 1.0]), ValueError, r"`valid_len`.*whole"),
        (torch.ones(2, 3), torch.tensor([[1, 2]]), ValueError, r"`valid_len`.*broadcastable"),
        (torch.ones(2, 3), torch.tensor([1, 2], device="meta"), ValueError, r"`valid_len`.*device"),
    ],
)
def test_sequence_mask_errors(X, valid_len, error, match):
    with pytest.raises(error, match=match):
        sequence_mask(X, valid_len)


def test_sequence_mask_any_dtype_and_empty():
    assert sequence_mask(torch.ones(0, 3), torch.zeros(0, dtype=torch.long)).shape == (0, 3)
    out = sequence_mask(torch.ones(2, 3, dtype=torch.int32), torch.tensor([1, 3]), value=-1)
    assert out.tolist() == [[1, -1, -1], [1, 1, 1]]


# ---- the CLI: attnscore run ------------------------------------------------------------------


def _npz(path: FilePath, **arrays) -> None:
    base = {
        "queries": np.ones((2, 3, 4), np.float32),
        "keys": np.ones((2, 5, 4), np.float32),
        "values": np.ones((2, 5, 6), np.float32),
    }
    base.update(arrays)
    np.savez(path, **{k: v for k, v in base.items() if v is not None})


def _pt(path: FilePath, obj) -> None:
    torch.save(obj, path)


def _good_pt(path: FilePath) -> None:
    _pt(
        path,
        {
            "queries": torch.ones(1, 2, 3),
            "keys": torch.ones(1, 4, 3),
            "values": torch.ones(1, 4, 2),
        },
    )


def _truncate(make, size: int):
    def setup(path: FilePath) -> None:
        make(path)
        path.write_bytes(path.read_bytes()[:size])

    return setup


CLI_ERRORS = [
    # (id, input file name, setup(path), extra argv, message regex)
    ("missing file", "in.npz", lambda p: None, [], r"--input: no such file"),
    ("a folder", "in.npz", lambda p: p.mkdir(), [], r"--input: .* is a folder"),
    ("unknown suffix", "in.txt", lambda p: p.write_text("1 2 3"), [], r"expected a \.npz or \.pt"),
    ("empty npz", "in.npz", lambda p: p.write_bytes(b""), [], r"cannot read"),
    ("truncated npz", "in.npz", _truncate(_npz, 300), [], r"cannot read"),
    (
        "corrupt npz",
        "in.npz",
        lambda p: p.write_bytes(b"PK\x03\x04" + b"\x00" * 64),
        [],
        r"cannot read",
    ),
    ("npz of text", "in.npz", lambda p: p.write_text("queries,keys"), [], r"cannot read"),
    ("truncated pt", "in.pt", _truncate(_good_pt, 200), [], r"cannot read"),
    ("corrupt pt", "in.pt", lambda p: p.write_bytes(b"\x80\x02garbage"), [], r"cannot read"),
    ("pt not a dict", "in.pt", lambda p: _pt(p, [torch.ones(1)]), [], r"dict of tensors.*list"),
    (
        "pt with a non-tensor",
        "in.pt",
        lambda p: _pt(
            p, {"queries": 1, "keys": torch.ones(1, 2, 3), "values": torch.ones(1, 2, 3)}
        ),
        [],
        r"`queries`.*numeric, but got int",
    ),
    (
        "wrong array names",
        "in.npz",
        lambda p: np.savez(p, q=np.ones((1, 2, 3)), k=np.ones((1, 2, 3)), v=np.ones((1, 2, 3))),
        [],
        r"lacks array\(s\) \['queries', 'keys', 'values'\]; it has \['k', 'q', 'v'\]",
    ),
    (
        "object array",
        "in.npz",
        lambda p: _npz(p, valid_lens=np.array([None, 1])),
        [],
        r"cannot read",
    ),
    (
        "integer queries",
        "in.npz",
        lambda p: _npz(p, queries=np.ones((2, 3, 4), np.int64)),
        [],
        r"`queries`.*float",
    ),
    (
        "queries 2-D",
        "in.npz",
        lambda p: _npz(p, queries=np.ones((3, 4), np.float32)),
        [],
        r"`queries`.*at least 3",
    ),
    (
        "fractional valid_lens",
        "in.npz",
        lambda p: _npz(p, valid_lens=np.array([1.5, 2.0])),
        [],
        r"`valid_lens`.*whole",
    ),
    (
        # Found here: drawing empty weights crashed with a traceback after --output was written.
        "heatmap of no keys",
        "in.npz",
        lambda p: _npz(
            p, keys=np.ones((2, 0, 4), np.float32), values=np.ones((2, 0, 6), np.float32)
        ),
        [],
        r"--heatmap: nothing to draw.*\(2, 3, 0\)",
    ),
    (
        "additive, other key size",
        "in.npz",
        lambda p: _npz(p, keys=np.ones((2, 4, 4), np.float32)),
        ["--scoring", "additive"],
        r"`keys`.*`values`",
    ),
]


@pytest.mark.parametrize(
    ("case", "name", "setup", "extra", "message"), CLI_ERRORS, ids=[c[0] for c in CLI_ERRORS]
)
def test_cli_run_bad_input(tmp_path, capsys, case, name, setup, extra, message):
    src = tmp_path / name
    setup(src)
    out, png = tmp_path / "out" / "o.npz", tmp_path / "w.png"
    out.parent.mkdir()  # missing output folders are refused before the input is read
    argv = ["run", "--input", str(src), "--output", str(out), "--heatmap", str(png), *extra]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert re.search(message, captured.err), captured.err
    assert captured.err.startswith("attnscore: error: ") and captured.err.count("\n") == 1
    assert "Traceback" not in captured.err and captured.out == ""
    assert not out.exists() and not png.exists()
    leftovers = [p for p in tmp_path.rglob("*") if p.name.startswith((".o.npz", ".w.png"))]
    assert leftovers == []


def test_cli_run_empty_dimensions_write_documented_results(tmp_path):
    src = tmp_path / "in.npz"
    _npz(src, keys=np.ones((2, 0, 4), np.float32), values=np.ones((2, 0, 6), np.float32))
    assert main(["run", "--input", str(src), "--output", str(tmp_path / "o.npz")]) == 0
    with np.load(tmp_path / "o.npz") as data:
        assert data["weights"].shape == (2, 3, 0) and np.all(data["output"] == 0)


def test_show_heatmaps_without_rows_is_a_clear_error():
    with pytest.raises(ValueError, match=r"`matrices`.*rows, cols >= 1.*\(0, 1, 3, 3\)"):
        attnscore.show_heatmaps(torch.zeros(0, 1, 3, 3), "Keys", "Queries")


def test_cli_output_into_a_folder_is_a_one_line_error(tmp_path, capsys):
    src = tmp_path / "in.npz"
    _npz(src)
    folder = tmp_path / "taken"
    folder.mkdir()
    assert main(["run", "--input", str(src), "--output", str(folder)]) == 2
    err = capsys.readouterr().err
    assert re.search(r"--output.*taken", err) and err.count("\n") == 1
    assert (
        list(folder.iterdir()) == []
        and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    )


@pytest.mark.parametrize(
    "argv", [["run"], ["run", "--input", "x.npz", "--scoring", "cubic"], ["frobnicate"], []]
)
def test_cli_usage_errors_exit_2_without_traceback(capsys, argv):
    assert main(argv) == 2  # argparse's usage errors: one line, no usage block
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("attnscore: error: ")
    assert err.count("\n") == 1
