"""Every command in the README and docs/*.md exists and takes the options shown (issue 21.1).

The fenced shell blocks are read, split into commands, and each ``attnscore ...``,
``python -m attnscore...`` or ``python tools/...`` command of a tool in :data:`TOOLS_PARSED`
is parsed by the very parser that would run it (a misspelt command or option, or a missing
required one, fails here). The commands that
cost seconds are also run; the ones that train or benchmark for minutes are parsed only.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest
import torch

from attnscore.cli import main
from attnscore.cli._root import build_parser
from attnscore.cli._usage import UsageError
from tool_modules import load_tool

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# What the pages leave to the reader, given a value that parses.
PLACEHOLDERS = {"$N": "100", "$s": "0", "T": "1", "P": "1"}
RUN = {("demo",), ("--version",)}  # commands quick enough to run, by their first words
# The developer tools (tools/, outside the package) whose ``main(argv)`` parses its
# arguments with ``parse_args`` before it does anything.
TOOLS_PARSED = {
    "tools/triton_aot.py",
    "tools/tanh_error.py",
    "tools/gpu_measure.py",
    "tools/gpu_ab.py",
}


def _commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        fences = re.findall(r"```(?:bash|console|sh|shell)\n(.*?)```", page.read_text(), re.S)
        for block in fences:
            for line in block.replace("\\\n", " ").splitlines():
                for command in line.split("&&"):
                    words = [PLACEHOLDERS.get(w, w) for w in shlex.split(command, comments=True)]
                    words = [w for w in words if w != "&" and "=" not in w[:1]]
                    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                        words = words[1:]  # an environment assignment
                    if words[:3] == ["python", "-m", "attnscore"]:
                        words = ["attnscore", *words[3:]]  # the same command
                    ours = words[:2] == ["python", "-m"] and words[2].startswith("attnscore")
                    tool = len(words) > 1 and words[0] == "python" and words[1] in TOOLS_PARSED
                    if words[:1] == ["attnscore"] or ours or tool:
                        found.append((page.name, words))
    return found


COMMANDS = _commands()


def test_the_pages_show_commands():
    assert len(COMMANDS) >= 20 and any(w[:2] == ["attnscore", "g2p"] for _, w in COMMANDS)


class _ParsedError(Exception):
    """Raised right after a parser accepted its arguments: nothing runs."""


def _parse_module_command(module: str, argv: list[str], monkeypatch) -> None:
    """Parse ``python -m module argv`` (or ``python tools/NAME.py argv`` for a module
    ``tools/NAME.py``) with the module's own parser, running nothing."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        real(self, args, namespace)
        raise _ParsedError

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    if module.startswith("tools/"):
        loaded = load_tool(Path(module).stem)
    else:
        loaded = importlib.import_module(module)
    with pytest.raises(_ParsedError):
        loaded.main(argv)


@pytest.mark.parametrize(
    ("page", "words"), [pytest.param(p, w, id=f"{p}: {' '.join(w)[:70]}") for p, w in COMMANDS]
)
def test_every_command_shown_parses(page, words, monkeypatch, tmp_path, capsys):
    if words[:2] == ["python", "-m"]:
        _parse_module_command(words[2], words[3:], monkeypatch)
        return
    if words[0] == "python":  # a tool of TOOLS_PARSED
        _parse_module_command(words[1], words[2:], monkeypatch)
        return
    argv = words[1:]
    if not torch.cuda.is_available():  # GPU commands: every option but the device checked
        argv = ["cpu" if i and argv[i - 1] == "--device" and w.startswith("cuda") else w
                for i, w in enumerate(argv)]  # fmt: skip
    try:
        build_parser().parse_args(argv)
    except (SystemExit, UsageError) as err:
        pytest.fail(f"{page}: `{shlex.join(words)}` does not parse: {err}")
    if tuple(argv[:1]) in RUN:
        monkeypatch.chdir(tmp_path)
        assert main(argv) == 0, f"{page}: `{shlex.join(words)}` failed"


def test_a_command_that_does_not_exist_fails_here():
    """The check above can fail: the command the issue found in the docs."""
    with pytest.raises((SystemExit, UsageError)):
        build_parser().parse_args(["run", "--queries", "q.npy", "--keys", "k.npy"])
