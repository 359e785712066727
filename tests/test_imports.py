"""The package's import structure (issue 35): no cycles, no upward imports, no tooling.

The static graph of module-level imports inside src/attnscore is read with ``ast`` (an
import under ``if TYPE_CHECKING:`` is no import) and must be acyclic, so that any module
can be imported first and the package never depends on the order of its own imports.
Imports inside functions are where such a cycle would hide: in the library proper (outside
its command line and its benchmark, which import a command's needs when it runs) each one
is listed in :data:`LAZY` with the reason it is not at the top. The library never imports
the benchmark, nothing but the command line imports the command line, and nothing in the
package imports the developer tools of tools/. Finally every module is imported alone in
a fresh interpreter.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
TOOLS = ROOT / "tools"

# Function-level imports of attnscore modules in the library proper: (importer, imported)
# -> why the import is not at the top of the module.
LAZY: dict[tuple[str, str], str] = {}
# Packages that import what a command or a benchmark row needs only when it runs.
ON_DEMAND = ("attnscore.cli", "attnscore.bench")


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str  # the most specific module the statement names
    line: int
    top: bool  # executed when the importer is imported (not inside a function)


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / "attnscore").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _target(node: ast.ImportFrom, importer: str) -> str:
    """The absolute module a ``from ... import`` statement starts from."""
    if not node.level:
        return node.module or ""
    package = importer.split(".")
    if MODULES[importer].name != "__init__.py":
        package.pop()
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _named(name: str) -> str:
    """``name``, or the longest prefix of it that is a module of the package."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(importer: str) -> list[Import]:
    """Every import statement of ``importer`` naming a module of the package (and, with
    ``imported`` left as written, any other module)."""
    found: list[Import] = []

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child, top)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(importer, alias.name, node.lineno, top))
            return
        if isinstance(node, ast.ImportFrom):
            base = _target(node, importer)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(importer, sub if sub in MODULES else base, node.lineno, top))
            return
        inner = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, top and not inner)

    visit(ast.parse(MODULES[importer].read_text(), str(MODULES[importer])), True)
    return found


IMPORTS = [i for m in MODULES for i in _imports(m)]


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in IMPORTS:
        target = _named(i.imported)
        if i.top and target and target != i.importer:
            graph[i.importer].add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in order, the first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := walk(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := walk(start)) is not None:
            return found
    return None


def _inside(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_module_level_imports_have_no_cycle() -> None:
    graph = _graph()
    assert len(graph) > 50 and graph["attnscore.kernels._ops"] >= {"attnscore.kernels._dispatch"}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_cycles() -> None:
    """The check above can fail: the cycle issue 35 found, as it was."""
    graph = {
        "_dispatch": {"_plain"},
        "_plain": {"_sdpa"},
        "_sdpa": {"_ops", "_mask"},
        "_ops": {"_dispatch", "_plain"},
        "_mask": set(),
    }
    assert _cycle(graph) == ["_dispatch", "_plain", "_sdpa", "_ops", "_dispatch"]
    graph["_sdpa"] = {"_mask"}
    assert _cycle(graph) is None


def test_lazy_imports_in_the_library_are_listed_with_their_reason() -> None:
    lazy = {
        (i.importer, _named(i.imported))
        for i in IMPORTS
        if not i.top and _named(i.imported) and not _inside(i.importer, ON_DEMAND)
    }
    assert lazy == set(LAZY), "a function-level import: move it to the top or add it to LAZY"


def test_the_library_never_imports_the_benchmark() -> None:
    wrong = [
        f"{i.importer}:{i.line} imports {i.imported}"
        for i in IMPORTS
        if _inside(_named(i.imported), ("attnscore.bench",)) and not _inside(i.importer, ON_DEMAND)
    ]
    assert not wrong
    assert any(i.importer == "attnscore.cli.bench" for i in IMPORTS if "bench" in i.imported)


def test_only_the_command_line_imports_the_command_line() -> None:
    """The command line sits on top: the library and the benchmark never import it; the
    ``python -m`` entry points (``__main__``) are the command line."""
    wrong = [
        f"{i.importer}:{i.line} imports {i.imported}"
        for i in IMPORTS
        if _inside(_named(i.imported), ("attnscore.cli",))
        and not _inside(i.importer, ("attnscore.cli",))
        and not i.importer.endswith(".__main__")
        and i.importer != "attnscore.__main__"
    ]
    assert not wrong


def test_the_package_never_imports_the_tools() -> None:
    tools = {"tools"} | {p.stem for p in TOOLS.glob("*.py")}
    assert {"triton_aot", "tanh_error", "fuzz_kernels"} <= tools
    wrong = [
        f"{i.importer}:{i.line} imports {i.imported}"
        for i in IMPORTS
        if i.imported.split(".")[0] in tools
    ]
    assert not wrong
    # nor loads a file by its path, the other way to reach tools/
    text = {m: p.read_text() for m, p in MODULES.items()}
    assert not [m for m, t in text.items() if "spec_from_file_location" in t or "run_path" in t]


# One interpreter imports torch (which every module leans on), then forks a child per
# module that imports that module alone: a fresh attnscore each time, without paying for
# torch each time (no attnscore module is imported before the fork). It prints
# {module: "ok" | "skipped: ..." | the traceback} as JSON.
_IMPORT_EACH = """
import importlib, json, os, sys, traceback

# what attnscore's own imports pull in (torch's compiler stack, with triton where installed)
import torch._dynamo  # noqa: F401

try:
    import triton  # noqa: F401
except ImportError:
    pass


def one(name):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "attnscore":  # an optional extra is missing
            return "skipped: " + str(exc)
        return traceback.format_exc()
    except BaseException:
        return traceback.format_exc()
    return "ok"


out, running, jobs = {}, {}, max(1, min(4, os.cpu_count() or 1))


def reap():
    pid, _ = os.wait()
    name, r = running.pop(pid)
    with os.fdopen(r) as f:
        out[name] = f.read() or "the child died"


for name in json.loads(sys.argv[1]):
    if len(running) >= jobs:
        reap()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, one(name).encode())
        os._exit(0)
    os.close(w)
    running[pid] = (name, r)
while running:
    reap()
print(json.dumps(out))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the check forks a child per module")
def test_every_module_imports_alone_in_a_fresh_interpreter() -> None:
    names = [m for m in MODULES if not m.endswith("__main__")]  # those run the CLI
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, json.dumps(names)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(results) == sorted(names)
    failed = {n: r for n, r in results.items() if r != "ok" and not r.startswith("skipped: ")}
    assert not failed, "\n".join(f"{n}:\n{r}" for n, r in failed.items())
    # attnscore itself and its core never need an extra
    assert results["attnscore"] == results["attnscore.kernels._dispatch"] == "ok"
