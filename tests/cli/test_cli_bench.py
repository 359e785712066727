"""``attnscore bench`` and ``python -m attnscore.bench``: options, exit codes, the JSON,
the smoke run, and the peak-RSS child (attnscore.cli.bench over attnscore.bench)."""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import pytest
import torch

from attnscore import bench
from attnscore.bench import _core, cpu, matrix
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
    assert set(result["cpu"]) == {"model", "flags", "capability"} and "gpu" not in result
    assert table.startswith(f"attnscore bench on {result['cpu']['model']} (")
    assert f", load average up to {result['load']['max_load_1min']:.1f} on " in table
    if result["kernel_build"]["path"] is not None:  # measured here only: see below
        assert result["kernel_cold_compile_s"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "cuda"], "no GPU"),
        (["--device", "tpu"], "--device"),
        (["--threads", "0"], "--threads"),
        (["--cases", "nope"], "--cases: Expected names among ['masked_softmax'"),
        (["--json", "out.txt"], "--json"),
        (["--plot", "out.txt"], "--plot: expected a file ending in .png, .pdf or .svg"),
        (["--from-json", "run.json", "--cases", "dot"], "--from-json: renders a saved run"),
    ],
)
def test_bad_options_exit_2_with_one_line(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if argv[0] in ("--json", "--cases", "--plot", "--from-json"):  # refused before measuring
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


SAVED = Path(__file__).resolve().parents[2] / "docs" / "bench" / "cpu-full-481b016.json"


def _fast_softmax_rows(monkeypatch):
    """The full run's masked_softmax rows at a tiny shape, timed briefly; the C kernels'
    cold compile (a fresh process compiling them into an empty cache) is measured by the
    smoke run above, and given here."""
    monkeypatch.setitem(matrix.SHAPES["cpu"], "masked_softmax", {"B": 2, "n": 3, "m": 8})
    monkeypatch.setitem(bench.MIN_RUN_TIME, ("cpu", False), 0.001)
    monkeypatch.setattr(matrix, "targets", lambda *cell: [_core.Target("time", 1e9, "softmax")])
    monkeypatch.setattr(cpu, "cold_compile_seconds", lambda: 0.25)


def test_full_run_judges_targets_draws_the_run_and_never_overwrites(monkeypatch, tmp_path, capsys):
    """One full run on an idle machine, every target met: verdicts, no load warning, the
    figure drawn; a second --plot to the same file is refused before anything is measured,
    and the saved run draws again without measuring once --overwrite is given."""
    _fast_softmax_rows(monkeypatch)
    monkeypatch.setattr(bench, "load_average", lambda: 0.0)
    fig, data = tmp_path / "ratios.png", tmp_path / "run.json"
    argv = ["--cases", "masked_softmax", "--no-memory", "--threads", "1", "--plot", str(fig)]
    assert main([*argv, "--json", str(data)]) == 0
    out, err = capsys.readouterr()
    assert "Smoke run" not in out and "| met |" in out and "| yes |" in out
    assert "| **NO** |" not in out and "target(s) missed" not in err
    assert "| masked_softmax | fwd | 9 |" in out and "| masked_softmax | fwd+bwd | 9 |" in out
    assert out.count("| masked_softmax | ") == 2 + 18  # summary rows, then the cells
    assert "load average" not in err and "Busy machine" not in out
    assert "| ratio (median of per-round ratios) |" in out
    assert "cold compile + load with an empty cache: 0.25 s" in out
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = fig.read_bytes()
    monkeypatch.setattr(bench, "run", _no_run)  # refused before anything is measured
    assert main(argv) == 2
    assert "--plot" in capsys.readouterr().err and fig.read_bytes() == drawn
    # The saved run draws again without measuring, once --overwrite is given.
    assert main(["--from-json", str(data), "--plot", str(fig), "--overwrite"]) == 0
    out = capsys.readouterr().out
    assert out.count("| masked_softmax | ") == 2 + 18


def test_from_json_renders_the_committed_full_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "run", _no_run)
    fig = tmp_path / "cpu.svg"
    assert main(["--from-json", str(SAVED), "--plot", str(fig)]) == 0
    out = capsys.readouterr().out
    saved = json.loads(SAVED.read_text())
    assert (
        out.count("\n| ")
        == len(saved["rows"]) + 1 + len({(r["case"], r["step"]) for r in saved["rows"]}) + 1
    )  # the two tables: headers and lines
    assert "(issue)" not in out and "<svg" in fig.read_text()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist"),
        ("{not json", "cannot read"),
        ('{"rows": [{"case": "dot"}]}', 'a "rows" list'),
        ("[1, 2]", 'a "rows" list'),
        ('{"rows": []}', "no time ratio to draw"),
    ],
)
def test_from_json_refuses_what_is_not_a_saved_run(content, message, tmp_path, capsys):
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    assert main(["--from-json", str(path), "--plot", str(tmp_path / "f.png")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and message in err
    assert not (tmp_path / "f.png").exists()


def test_plot_refused_in_one_line_without_matplotlib(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    monkeypatch.setattr(bench, "run", _no_run)
    assert main(["--quick", "--plot", str(tmp_path / "f.png")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "needs matplotlib" in err
    assert not list(tmp_path.iterdir())


def test_a_missed_target_on_a_busy_machine_exits_1_and_the_load_is_said_once(
    monkeypatch, tmp_path, capsys
):
    _fast_softmax_rows(monkeypatch)
    monkeypatch.setattr(matrix, "targets", lambda *cell: [_core.Target("time", 1e-9, "softmax")])
    monkeypatch.setattr(bench, "load_average", lambda: 10.0 * (os.cpu_count() or 1) + 1)
    out = tmp_path / "run.json"
    argv = ["--cases", "masked_softmax", "--no-memory", "--threads", "1", "--quiet"]
    assert main([*argv, "--json", str(out)]) == 1
    table, err = capsys.readouterr()
    assert "Smoke run" not in table and "| met |" in table and "| **NO** |" in table
    assert "| masked_softmax | fwd | 9 |" in table and "| masked_softmax | fwd+bwd | 9 |" in table
    assert table.count("| masked_softmax | ") == 2 + 18
    assert "target(s) missed" in err
    warnings = [line for line in err.splitlines() if "load average" in line]
    assert len(warnings) == 1 and "exceeds" in warnings[0]
    assert "Busy machine" in table
    load = json.loads(out.read_text())["load"]
    assert load["busy"] is True and load["readings"] == 1 + 18


def test_help_and_names_say_what_users_see(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "about 12 minutes" in text and "about 1 minute" in text and "issue" not in text
    assert not [name for name in bench.case_names("cpu") if "issue" in name]


def test_a_smoke_run_on_a_busy_machine_says_so_beside_its_slow_cells():
    row = {
        "case": "dot", "mask": "none", "shapes": {"B": 1}, "dtype": "float32", "step": "fwd",
        "median_s": {"attnscore": 2e-3, "sdpa": 1e-3}, "peak_mib": {}, "peak_rss_mib": {},
        "targets": [{"kind": "time", "vs": "sdpa", "value": 2.0, "bound": 1.05, "met": None}],
        "notes": [],
    }  # fmt: skip
    result = {"device": "cpu", "device_name": "x", "threads": 2, "quick": True, "rows": [row]}
    busy = {**result, "load": {"busy": True, "max_load_1min": 9.0, "cores": 2}}
    assert "busy" not in bench.render(result).lower()
    text = bench.render(busy)
    assert "load average reached 9.0 on 2 cores" in text
    assert "(> 1.05x) (on a busy machine: see above): 1" in text
