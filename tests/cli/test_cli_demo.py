"""``attnscore demo``: the section's worked examples, printed, with their heatmaps."""

from __future__ import annotations

import re

from clitools import one_error_line

from attnscore.cli import main


def test_demo_prints_book_outputs_and_writes_heatmaps(tmp_path, capsys):
    out_dir = tmp_path / "demo"
    assert main(["demo", "--out", str(out_dir), "--seed", "3"]) == 0
    out = capsys.readouterr().out
    # additive, dot, general: the toy example's [[2, 3, 4, 5]] and [[10, 11, 12, 13]]
    assert out.count("[[[ 2.  3.  4.  5.]]") == 3
    assert out.count("[[10. 11. 12. 13.]]]") == 3
    assert "summation gives the same weights for every query: True" in out
    gap = float(re.search(r"largest difference between the two: ([0-9]+\.[0-9]+)", out).group(1))
    assert gap > 0.01  # exercise 1: distinct keys, different weights
    pngs = sorted(p.name for p in out_dir.glob("*.png"))
    assert len(pngs) == 6 and "additive_attention.png" in pngs
    assert all(str(out_dir / p) in out for p in pngs)
    assert all((out_dir / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert sorted(p.name for p in out_dir.iterdir()) == pngs  # no temporary files left


def test_demo_svg_format(tmp_path):
    assert main(["demo", "--out", str(tmp_path / "d"), "--format", "svg"]) == 0
    svgs = list((tmp_path / "d").glob("*.svg"))
    assert len(svgs) == 6 and all(b"<svg" in p.read_bytes()[:500] for p in svgs)


def test_demo_refuses_a_missing_parent_and_creates_nothing(tmp_path, capsys):
    out_dir = tmp_path / "no" / "such" / "demo"
    assert main(["demo", "--out", str(out_dir)]) == 2
    err = one_error_line(capsys.readouterr().err)
    assert f"folder {out_dir.parent} does not exist" in err
    assert not (tmp_path / "no").exists()


def test_demo_refuses_a_file_as_out(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert main(["demo", "--out", str(tmp_path / "f")]) == 2
    assert "is a file; expected a folder" in one_error_line(capsys.readouterr().err)
