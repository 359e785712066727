"""``attnscore run`` on bad and unusual input files: one clear line, exit 2, nothing written.

(Moved from tests/test_bad_input.py, whose tables cover the library's entry points.)
"""

from __future__ import annotations

import re
from pathlib import Path as FilePath

import numpy as np
import pytest
import torch

from attnscore.cli import main


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
