"""Every fenced code block of the README and of docs/*.md runs, as a reader would paste it.

Each ``python`` block runs as a script in a fresh process (forked from an interpreter that
has imported torch and nothing of attnscore), in an empty folder, offline: a block must
bring its own imports and inputs. A ``text`` block right after it (at most one
line between them, such as "prints") is what the script must print, exactly. Each ``bash``
block runs as a bash script the same way, with ``attnscore`` and ``python`` meaning this
checkout's (``attnscore`` is ``python -m attnscore``). Install commands (``pip install``,
``python3 -m venv``, ``. .venv/bin/activate``) change the environment and reach the network,
so they are checked instead of run: the extras they name exist in pyproject.toml, the
PyTorch pin is CI's, and the README's test command installs what ``.ci/run`` installs and
runs what it runs. A block marked on the line before it with ``<!-- skip: needs a GPU -->``
or ``<!-- skip: long run -->`` is not run (its ``attnscore`` commands are still parsed, by
tests/test_docs_commands.py); ``<!-- skip: needs keras -->`` marks the blocks of
docs/tensorflow_and_jax.md, which attnscore-keras's own tests run where Keras is installed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP_REASONS = ("needs a GPU", "long run", "needs keras")
SHELLS = ("bash", "console", "sh", "shell")
FENCE = re.compile(r"^( *)```(\S*)[^\n]*$")
# Blocks known to fail when pasted, (page, index) -> why; strict xfails, so that a fixed
# block must leave this list. Empty: every block runs.
KNOWN_BROKEN: dict[tuple[str, int], str] = {}


@dataclass
class Block:
    page: str
    index: int  # among the page's blocks of the same kind (python or shell)
    lang: str
    code: str
    skip: str | None
    output: str | None = None  # the text block shown as its output

    @property
    def id(self) -> str:
        first = next((line for line in self.code.splitlines() if line.strip()), "")
        return f"{self.page}[{self.lang} {self.index}]: {first.strip()[:50]}"


def _blocks(page: Path) -> list[Block]:
    """The page's fenced blocks in order (text blocks folded into the block they show)."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    counts: dict[str, int] = {}
    last_end: int | None = None
    last: int | None = None
    i = 0
    while i < len(lines):
        start = FENCE.match(lines[i])
        if not start:
            i += 1
            continue
        indent, lang = len(start.group(1)), start.group(2)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        code = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
        mark = re.fullmatch(r"\s*<!-- skip: (.*) -->\s*", lines[i - 1]) if i else None
        between = [line for line in lines[(last_end or 0) + 1 : i] if line.strip()]
        kind = "python" if lang == "python" else "shell" if lang in SHELLS else None
        if lang == "text" and last is not None and last_end is not None and len(between) <= 1:
            found[last].output = code
        elif kind is not None:
            found.append(Block(page.name, counts.get(kind, 0), lang, code, mark and mark[1]))
            counts[kind] = counts.get(kind, 0) + 1
        last = len(found) - 1 if kind == "python" else None
        last_end = end
        i = end + 1
    return found


BLOCKS = [block for page in PAGES for block in _blocks(page)]
INSTALL = re.compile(r"^\s*(pip install|python3? -m venv|\. \S*/bin/activate|source )")


def _commands(code: str) -> list[str]:
    """The block's commands: lines (continuations joined) split at ``&&``, comments dropped."""
    joined = code.replace("\\\n", " ")
    return [
        c.strip()
        for line in joined.splitlines()
        for c in line.split("&&")
        if c.strip() and not c.strip().startswith("#")
    ]


def _is_install(block: Block) -> bool:
    return any(INSTALL.match(c) for c in _commands(block.code))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(ROOT / "src"),  # this checkout, ahead of any installed copy
        MPLBACKEND="Agg",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    return env


def _folder(tmp_path: Path) -> Path:
    """An empty folder where the repository's files a page names (docs/, tools/) are found."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name in ("docs", "tools"):
        if not (tmp_path / name).exists():
            (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def _run(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=_folder(tmp_path), env=_env(), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


# Serves the python blocks: one interpreter imports torch (which every block leans on), then
# forks a child per block that runs it as `python -c` would, in the block's folder, with its
# own globals (so it must bring its own imports) and its stdout and stderr to files: a fresh
# process for attnscore and the block (no attnscore module is imported before the fork),
# without paying for torch's import each time. Reads one JSON request a line (code, cwd,
# stdout, stderr), answers with the child's exit code (-9: killed after 300 s).
_FORK_SERVER = r"""
import atexit, json, os, signal, sys, time, traceback

import torch  # noqa: F401
# what attnscore's own imports pull in (torch's compiler stack), as tests/test_imports.py does
import torch._dynamo  # noqa: F401


def child(request):
    os.chdir(request["cwd"])
    for fd, name, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        f = os.open(name, flags, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = ["-c"]
    code = 0
    try:
        exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as stop:  # as the interpreter treats it
        if isinstance(stop.code, int) or stop.code is None:
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        child(request)
    deadline = time.monotonic() + 300
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.fixture(scope="module")
def run_python():
    """``run_python(code, tmp_path)``: the python block ``code`` run in a child forked by
    :data:`_FORK_SERVER`, in the folder ``tmp_path / "block"``, as a CompletedProcess."""
    if not hasattr(os, "fork"):
        pytest.skip("the python blocks run in forked children")
    server = subprocess.Popen(
        [sys.executable, "-c", _FORK_SERVER],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_env(), cwd=ROOT, text=True,
    )  # fmt: skip
    assert server.stdin is not None and server.stdout is not None

    def run(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
        folder = _folder(tmp_path / "block")
        out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        request = {"code": code, "cwd": str(folder), "stdout": str(out), "stderr": str(err)}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        answer = server.stdout.readline()
        assert answer, "the server of the python blocks died"
        return subprocess.CompletedProcess(
            ["python", "-c", code], int(answer), out.read_text(), err.read_text()
        )

    yield run
    server.stdin.close()
    server.wait(timeout=60)


def _params(kind: str) -> list:
    chosen = []
    for b in BLOCKS:
        if (b.lang == "python") != (kind == "python"):
            continue
        marks = []
        if b.skip:
            marks.append(pytest.mark.skip(reason=f"marked in the page: {b.skip}"))
        elif (b.page, b.index) in KNOWN_BROKEN and kind == "python":
            reason = KNOWN_BROKEN[b.page, b.index]
            marks.append(pytest.mark.xfail(reason=reason, strict=True))
        chosen.append(pytest.param(b, id=b.id, marks=marks))
    return chosen


def test_the_pages_have_blocks_and_marks_are_known():
    assert sum(b.lang == "python" for b in BLOCKS) >= 8
    assert sum(b.lang != "python" for b in BLOCKS) >= 10
    assert {b.skip for b in BLOCKS if b.skip} <= set(SKIP_REASONS)
    readme = [b for b in BLOCKS if b.page == "README.md"]
    assert not [b for b in readme if b.skip], "the README's blocks all run"
    assert [b for b in readme if b.lang == "python" and b.output], "README shows no output"


@pytest.mark.parametrize("block", _params("python"))
def test_python_block_runs_and_prints_what_the_page_shows(block, tmp_path, run_python):
    done = run_python(block.code, tmp_path)
    assert done.returncode == 0, f"{block.id} failed:\n{done.stderr[-3000:]}"
    if block.output is not None:
        assert done.stdout.rstrip() == block.output.rstrip(), f"{block.id} printed otherwise"


@pytest.mark.parametrize("block", _params("shell"))
def test_shell_block_runs(block, tmp_path):
    if _is_install(block):
        _check_install_block(block)
        return
    prelude = (
        "set -euo pipefail\n"
        f'attnscore() {{ {shlex.quote(sys.executable)} -m attnscore "$@"; }}\n'
        f'python() {{ {shlex.quote(sys.executable)} "$@"; }}\n'
        'python3() { python "$@"; }\n'
    )
    done = _run(["bash", "-c", prelude + block.code], tmp_path)
    assert done.returncode == 0, f"{block.id} failed:\n{done.stderr[-3000:]}"


# ------------------------------------------------------------------ install commands
def _extras() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^(\w+) = \[", section, re.M))


def _ci_install() -> tuple[str, set[str]]:
    """.ci/run's PyTorch pin and the extras it installs the checkout with."""
    ci = (ROOT / ".ci" / "run").read_text()
    torch_pin = re.search(r'^TORCH="([^"]+)"', ci, re.M)
    extras = re.search(r'pip" install -q -e "\.\[([\w,]+)\]"', ci)
    assert torch_pin and extras, ".ci/run no longer installs as this test reads it"
    return torch_pin[1], set(extras[1].split(","))


def _named_extras(command: str) -> set[str]:
    found = re.findall(r"(?:\.|attnscore)\[([\w,]+)\]", command)
    return {e for group in found for e in group.split(",")}


EDITABLE = r"\.(\[[\w,]+\])?|\./attnscore-g2p"
"""What ``pip install -e`` takes in the pages: the checkout, or its G2P distribution."""


def _check_install_block(block: Block) -> None:
    torch_pin, _ = _ci_install()
    for command in _commands(block.code):
        words = shlex.split(command, comments=True)
        if words[:2] == ["pip", "install"]:
            assert _named_extras(command) <= _extras(), f"{block.id}: unknown extra in {command}"
            pinned = [w for w in words if w.startswith("torch==")]
            assert all(w == torch_pin for w in pinned), f"{block.id}: {pinned} is not CI's pin"
            # from the clone: the checkout itself, with or without extras, and attnscore-g2p
            for target in (words[i + 1] for i, w in enumerate(words) if w == "-e"):
                assert re.fullmatch(EDITABLE, target), f"{block.id}: -e {target}"
        else:
            assert INSTALL.match(command) or command == "python -m pytest", (
                f"{block.id}: `{command}` is neither an install command nor the test command; "
                "put it in a block of its own"
            )


def test_install_lines_name_extras_that_exist():
    """The check above can fail: a misspelt extra is caught."""
    assert _named_extras('pip install -e ".[hf,onnx]"') == {"hf", "onnx"}
    assert not _named_extras('pip install "attnscore[hugginface]"') <= _extras()


def test_the_readme_test_command_is_what_ci_runs():
    torch_pin, ci_extras = _ci_install()
    readme = (ROOT / "README.md").read_text()
    (command,) = [b.code for b in BLOCKS if b.page == "README.md" and "python -m pytest" in b.code]
    commands = _commands(command)
    assert f"pip install {torch_pin}" in commands
    (install,) = [c for c in commands if c.startswith("pip install -e")]
    assert _named_extras(install) == ci_extras
    assert commands[-1] == "python -m pytest"
    ci = (ROOT / ".ci" / "run").read_text()
    # attnscore-g2p's tests are in the suite (pyproject's testpaths): installed by both
    assert install.endswith(" -e ./attnscore-g2p") and "-e ./attnscore-g2p\n" in ci
    assert re.search(r"^\s*python -m pytest \|\| rc=\$\?$", ci, re.M), ".ci/run's test step"
    assert "The command CI runs" in readme
    nox = (ROOT / "noxfile.py").read_text()
    assert f'CI_EXTRAS = "{",".join(sorted(ci_extras, key=install.index))}"' in nox


@pytest.mark.parametrize("page", ["README.md", "docs/getting_started.md"])
def test_the_extras_table_lists_every_extra(page):
    text = (ROOT / page).read_text()
    table = text[text.index("| extra | adds | for |") :].split("\n\n", 1)[0]
    listed = set(re.findall(r"^\| `(\w+)` \|", table, re.M))
    assert listed == _extras()


def test_a_block_that_fails_fails_here(tmp_path, run_python):
    """The runner reports a failing block and a wrong shown output."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nprint(undefined_name)\n```\n\n```python\nprint(1 + 1)\n```\n\nprints\n\n"
        "```text\n3\n```\n\n<!-- skip: long run -->\n```bash\nattnscore bench\n```\n"
    )
    first, second, third = _blocks(page)
    failed = run_python(first.code, tmp_path / "a")
    assert failed.returncode == 1 and "NameError: name 'undefined_name'" in failed.stderr
    assert second.output == "3\n"
    assert run_python(second.code, tmp_path / "b").stdout.strip() == "2"
    # a block starts with its own globals: the names of an earlier block are not there
    assert run_python("defined = 1", tmp_path / "c").returncode == 0
    assert run_python("print(defined)", tmp_path / "d").returncode == 1
    assert run_python("import sys; sys.exit(3)", tmp_path / "e").returncode == 3
    assert third.skip == "long run" and third.lang == "bash"
