"""``attnscore bench`` and ``python -m attnscore.bench``: options, exit codes, the JSON,
the smoke run, and the peak-RSS child (attnscore.cli.bench over attnscore.bench)."""

from __future__ import annotations

import json
import runpy
import sys

import pytest
import torch

from attnscore import bench
from attnscore.bench import _core, matrix
from attnscore.cli._usage import ArgumentParser, UsageError
from attnscore.cli.bench import add_parser, handle, main


def test_quick_run_is_a_smoke_run(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--quick", "--threads", "1", "--cases", "masked_softmax", "additive_memory"]
    assert main([*argv, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "Smoke run" in table and "no target verdicts" in table
    assert "| masked_softmax | lengths (B,) | float32 | fwd |" in table
    assert "| additive_memory |" in table and "slower than their PyTorch baseline" in table
    assert "| met |" not in table and "**NO**" not in table and "| yes |" not in table
    result = json.loads(out.read_text())
    rows = [row for row in result["rows"] if row["case"] == "masked_softmax"]
    assert len(rows) == 3 * 3 * 2  # masks x dtypes x steps
    first = next(r for r in rows if r["mask"] == "lengths (B,)" and r["dtype"] == "float32")
    assert set(first["median_s"]) == {"attnscore", "softmax", "textbook"}
    assert [c["vs"] for c in first["targets"]] == ["softmax", "softmax", "textbook"]
    assert all(c["met"] is None for row in result["rows"] for c in row["targets"])
    (memory,) = [row for row in result["rows"] if row["case"] == "additive_memory"]
    assert memory["peak_rss_mib"]["attnscore"] > 0
    assert result["torch"] == torch.__version__


@pytest.mark.parametrize(
    ("bound", "code", "verdict"), [(1e-9, 1, "| **NO** |"), (1e9, 0, "| yes |")]
)
def test_full_run_judges_targets(monkeypatch, capsys, bound, code, verdict):
    monkeypatch.setitem(matrix.SHAPES["cpu"], "masked_softmax", {"B": 2, "n": 3, "m": 8})
    monkeypatch.setattr(matrix, "targets", lambda *cell: [_core.Target("time", bound, "softmax")])
    monkeypatch.setitem(bench.MIN_RUN_TIME, ("cpu", False), 0.001)
    assert main(["--cases", "masked_softmax", "--no-memory", "--threads", "1"]) == code
    out, err = capsys.readouterr()
    assert "Smoke run" not in out and "| met |" in out and verdict in out
    assert "| masked_softmax | fwd | 9 |" in out and "| masked_softmax | fwd+bwd | 9 |" in out
    assert out.count("| masked_softmax | ") == 2 + 18  # summary rows, then the cells
    assert ("target(s) missed" in err) == (code == 1)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "cuda"], "no GPU"),
        (["--device", "tpu"], "--device"),
        (["--threads", "0"], "--threads"),
        (["--cases", "nope"], "--cases: expected names among ['masked_softmax'"),
        (["--json", "out.txt"], "--json"),
    ],
)
def test_bad_options_exit_2_with_one_line(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if argv[0] in ("--json", "--cases"):  # refused before anything is measured
        monkeypatch.setattr(bench, "run", _no_run)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and message in err
    assert not list(tmp_path.iterdir())


def _no_run(**kwargs):
    raise AssertionError("bench ran although its options were bad")


def test_add_parser_joins_the_command_tree():
    parser = ArgumentParser(prog="attnscore")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "--quick", "--cases", "masked_softmax"])
    assert args.handler is handle and args.quick and args.device == "cpu"
    with pytest.raises(UsageError, match="--threads"):
        parser.parse_args(["bench", "--threads", "x"])


def _vmhwm_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def test_child_prints_its_peak_rss(capsys):
    """``--child CASE IMPL``: what each peak-RSS subprocess runs, here in this process."""
    old = torch.get_num_threads()
    try:
        assert main(["--child", "additive_memory", "attnscore", "--quick", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(old)
    peak = float(capsys.readouterr().out)
    assert 0 < peak <= _vmhwm_mib()


def test_python_dash_m_bench_in_process(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["attnscore.bench", "--threads", "0"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("attnscore.bench", run_name="__main__")
    assert done.value.code == 2
    out, err = capsys.readouterr()
    assert (
        out == ""
        and err == "attnscore bench: error: --threads: expected a positive integer, but got '0'\n"
    )
