"""The attnscore command tree: one parser, one error convention, --version, python -m."""

from __future__ import annotations

import importlib.metadata
import os
import re
import runpy
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
from clitools import one_error_line, python_m

import attnscore
import attnscore.cli.demo
from attnscore.cli import _root, build_parser, main
from attnscore.cli._root import top_parser
from attnscore.cli._usage import UsageError

ROOT = Path(__file__).resolve().parents[2]


def test_one_tree_with_every_subcommand(monkeypatch):
    monkeypatch.setattr(_root, "installed", dict)  # attnscore's own commands only
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    assert list(sub.choices) == ["demo", "run", "bench", "export", "tune"]
    assert all(type(p) is type(parser) for p in sub.choices.values())
    for argv in (["demo"], ["run", "--input", "x.npz"], ["bench"]):
        assert callable(parser.parse_args(argv).handler)


def _hello_command() -> types.ModuleType:
    """What an entry point of group attnscore.commands names: HELP and add_parser."""
    module = types.ModuleType("hello_command")

    def add_parser(sub):
        parser = sub.add_parser("hello", help=module.HELP)
        parser.add_argument("--times", type=int, default=1)
        parser.set_defaults(handler=lambda args: print("hello " * args.times) or 0)
        return parser

    module.HELP, module.add_parser = "say hello", add_parser
    return module


def test_commands_of_other_distributions_join_the_tree(monkeypatch, capsys):
    monkeypatch.setattr(_root, "installed", lambda: {"hello": _hello_command()})
    assert main(["hello", "--times", "2"]) == 0
    assert capsys.readouterr().out == "hello hello \n"
    assert top_parser().format_help() == build_parser().format_help()
    assert main(["--help"]) == 0
    assert re.search(r"^ +hello +say hello$", capsys.readouterr().out, re.M)


def test_the_entry_points_are_read_from_the_installed_distributions(monkeypatch):
    class EntryPoint:
        name, value = "hello", "hello_command"

        def load(self):
            return _hello_command()

    def entry_points(group):
        assert group == _root.ENTRY_POINTS == "attnscore.commands"
        return [EntryPoint()]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    assert list(_root.installed.__wrapped__()) == ["hello"]


def test_a_command_of_this_repository_not_installed_is_one_line_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(_root, "installed", dict)
    assert main(["g2p", "train", "--steps", "3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and one_error_line(captured.err) == (
        "attnscore: error: g2p: this command is not installed; install it from attnscore's "
        "repository with: pip install ./attnscore-g2p\n"
    )
    assert main(["--help"]) == 0
    assert "g2p" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "required"),
        (["nope"], "invalid choice"),
        (["run"], "--input"),
        (["run", "--input", "x.npz", "--bogus"], "unrecognized arguments: --bogus"),
        (["bench", "--no-such-option"], "unrecognized arguments: --no-such-option"),
        (["bench", "--threads", "0"], "--threads: expected a positive integer"),
        (["tune", "--out", "t.txt"], "--out"),
    ],
)
def test_usage_errors_while_parsing_are_one_line_exit_2(capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in one_error_line(captured.err) and captured.out == ""


def _demo_runs(handler, monkeypatch):
    """Make ``attnscore demo`` run ``handler`` instead of the demo."""
    real = attnscore.cli.demo.add_parser

    def add_parser(sub):
        parser = real(sub)
        parser.set_defaults(handler=handler)
        return parser

    monkeypatch.setattr(attnscore.cli.demo, "add_parser", add_parser)


def test_usage_error_raised_by_a_handler_is_one_line_exit_2(monkeypatch, capsys):
    def boom(args):
        raise UsageError("--out: something the handler found")

    _demo_runs(boom, monkeypatch)
    assert main(["demo"]) == 2
    assert one_error_line(capsys.readouterr().err).endswith("something the handler found\n")


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("demo", "run", "bench", "export", "tune", "--version"))


def test_version_prints_the_package_version(capsys):
    assert main(["--version"]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"attnscore {attnscore.__version__}\n"
    assert captured.err == ""


def test_version_through_python_dash_m():
    proc = python_m("--version")
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout == f"attnscore {attnscore.__version__}\n"


def test_a_handler_exiting_with_a_message_exits_1(monkeypatch, capsys):
    def give_up(args):
        raise SystemExit("attnscore: demo gave up")

    _demo_runs(give_up, monkeypatch)
    assert main(["demo"]) == 1
    assert capsys.readouterr().err == "attnscore: demo gave up\n"


@pytest.mark.parametrize("module", ["attnscore", "attnscore.cli"])
def test_python_dash_m_in_process(module, tmp_path, monkeypatch, capsys):
    """``python -m attnscore`` and ``python -m attnscore.cli`` exit with main()'s code."""
    monkeypatch.setattr(sys, "argv", [module, "run", "--input", str(tmp_path / "missing.npz")])
    with warnings.catch_warnings():
        # the package is imported already; -m runs its __main__ again, which runpy notes
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(SystemExit) as done:
            runpy.run_module(module, run_name="__main__")
    assert done.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--input: no such file" in one_error_line(captured.err)


def test_python_dash_m_usage_error(tmp_path):
    proc = python_m("run", "--input", tmp_path / "missing.npz")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "--input: no such file" in one_error_line(proc.stderr)


def test_the_console_script_is_main():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'attnscore = "attnscore.cli:main"' in text


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_gitignore_covers_command_outputs():
    paths = [
        "demo/additive_attention.png",
        "runs/additive/model.pt",
        "attnscore-demo/exercise1_dot.png",
        "weights.png",
        "att.pdf",
        "w.svg",
        "out.npz",
        "g2p_attention.png",
    ]
    proc = subprocess.run(
        ["git", "check-ignore", "--no-index", *paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert sorted(proc.stdout.split()) == sorted(paths)
    kept = subprocess.run(
        ["git", "check-ignore", "--no-index", "docs/img/exercise1_additive.png"],
        cwd=ROOT,
        capture_output=True,
    )
    assert kept.returncode == 1  # the docs' own figures stay tracked


def test_the_library_never_imports_the_command_line():
    """The layers: attnscore and its benchmark import nothing of ``attnscore.cli`` (whose
    UsageError is the command line's alone; attnscore-g2p's tests check its modules)."""
    code = (
        "import importlib, sys\n"
        f"for name in {['attnscore', 'attnscore.bench']!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('attnscore.cli')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[]\n"
