"""Ctrl-C ends every command with exit code 130 and one line (no traceback) and leaves no
partial file; the commands show no warnings from torch's (or ONNX's) internals."""

from __future__ import annotations

import signal
import subprocess
import sys
import warnings

from clitools import _env

import attnscore.cli.demo
from attnscore.cli import main
from attnscore.cli._files import write_atomic


def _demo_runs(handler, monkeypatch):
    """Make ``attnscore demo`` run ``handler`` instead of the demo."""
    real = attnscore.cli.demo.add_parser

    def add_parser(sub):
        parser = real(sub)
        parser.set_defaults(handler=handler)
        return parser

    monkeypatch.setattr(attnscore.cli.demo, "add_parser", add_parser)


def test_ctrl_c_while_writing_leaves_no_file_and_exits_130(monkeypatch, capsys, tmp_path):
    out = tmp_path / "out.json"

    def interrupted_write(f):
        f.write(b'{"half": ')
        raise KeyboardInterrupt

    def handler(args):
        write_atomic(out, interrupted_write, "--json")
        return 0

    _demo_runs(handler, monkeypatch)
    assert main(["demo"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "attnscore: interrupted\n" and captured.out == ""
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary


def test_torch_internal_warnings_are_not_shown(monkeypatch):
    def handler(args):
        # as torch.export's pytree deprecation reaches the user (attributed to copyreg)
        warnings.warn_explicit("isinstance(treespec, LeafSpec) is deprecated", FutureWarning,
                               "copyreg.py", 105, module="copyreg")  # fmt: skip
        warnings.warn_explicit("internal", UserWarning, "x.py", 1, module="torch.export.x")
        warnings.warn("the user's own concern", UserWarning, stacklevel=1)
        return 0

    _demo_runs(handler, monkeypatch)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        assert main(["demo"]) == 0
    assert [str(w.message) for w in shown] == ["the user's own concern"]


def test_ctrl_c_during_bench_is_one_line_and_exit_130(tmp_path):
    """A real SIGINT, as Ctrl-C sends it, to ``attnscore bench --quick`` once it runs."""
    out = tmp_path / "run.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnscore", "bench", "--quick", "--json", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=tmp_path,
    )
    assert proc.stderr is not None
    first = proc.stderr.readline()  # the first progress line: the run has started
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (first, err)
    assert "Traceback" not in err and err.splitlines()[-1] == "attnscore: interrupted"
    assert list(tmp_path.iterdir()) == []
