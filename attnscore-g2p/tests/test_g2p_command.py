"""``attnscore g2p``: the ``attnscore`` command finds this package's command through its
entry point, lists it without importing torch, and the task's library modules stay below
the command line."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import attnscore
import attnscore_g2p
from attnscore.cli import _root
from attnscore.cli import main as attnscore_main
from attnscore_g2p import command

HERE = Path(__file__).resolve().parent


def _python(code: str) -> str:
    """stdout of ``python -c code`` with this checkout's packages first on the path."""
    src = [str(Path(m.__file__).resolve().parents[1]) for m in (attnscore_g2p, attnscore)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(src)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_entry_point_names_this_command() -> None:
    assert _root.installed()["g2p"] is command
    assert 'g2p = "attnscore_g2p.command"' in (HERE.parent / "pyproject.toml").read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["g2p", "--no-such-option"], "required"),
        (["g2p", "train", "--steps", "0"], "--steps: expected a positive integer"),
    ],
)
def test_attnscore_g2p_usage_errors_are_one_line_exit_2(capsys, argv, message) -> None:
    assert attnscore_main(argv) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert captured.out == "" and line.startswith("attnscore: error: ") and message in line


def test_help_lists_g2p_without_importing_torch() -> None:
    out = _python(
        "import sys\nfrom attnscore.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules)"
    )
    assert f"g2p       {command.HELP}" in out
    assert out.splitlines()[-1] == "False"


def test_the_task_never_imports_the_command_line() -> None:
    """Only :mod:`attnscore_g2p.cli` and its handlers import ``attnscore.cli`` (whose
    UsageError is the command line's alone)."""
    library = [
        f"attnscore_g2p.{m.name}"
        for m in pkgutil.iter_modules(attnscore_g2p.__path__)
        if m.name not in ("__main__", "cli", "_handlers", "command")
    ]
    out = _python(
        "import importlib, sys\n"
        f"for name in {library!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('attnscore.cli')))\n"
    )
    assert out == "[]\n" and len(library) > 15
