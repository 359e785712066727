"""The contributor's task runner: the same commands CI (``.ci/run``) runs.

    nox -s lint       # ruff check, ruff format --check, mypy (strict)
    nox -s tests      # python -m pytest (coverage floor, doctests included)
    nox -s docs       # the documentation site, warnings as errors, notebook executed
    nox -s dist       # sdist + wheel (python -m build), twine check
    nox -s bench      # attnscore bench --quick (a smoke run)
    nox -s sanitize   # the C kernels under ASan + UBSan: tests/kernels and the fuzz
    nox -s hf_suite   # transformers' own model tests with attnscore as "sdpa" (not in CI)

Each session installs the package as the README says (CPU torch pinned). ``nox -R``
reuses existing session environments; ``nox --no-venv`` runs in the current one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nox

nox.options.sessions = ["lint", "tests", "docs"]
TORCH = "torch==2.13.0"
CI_EXTRAS = "test,docs,dist,hf,onnx"  # what .ci/run and the README's test command install
ROOT = Path(__file__).resolve().parent
#: The transformers release whose own tests ``hf_suite`` clones by default (tag v<this>).
HF_SUITE_TRANSFORMERS = "5.24.0"
#: What transformers' model tests import beyond transformers itself and pytest.
HF_SUITE_DEPS = (
    "parameterized",
    "pytest-xdist",
    "pytest-timeout",
    "timeout-decorator",
    "datasets",
    "accelerate",
)


def _install(session: nox.Session, extras: str = "test", *, g2p: bool = False) -> None:
    if session.venv_backend == "none":  # --no-venv: use what is installed
        return
    session.install(TORCH)
    # g2p: attnscore-g2p (attnscore-g2p/), whose tests the suite runs
    session.install("-e", f".[{extras}]", *(["-e", "./attnscore-g2p"] if g2p else []))


@nox.session
def tests(session: nox.Session) -> None:
    _install(session, CI_EXTRAS, g2p=True)  # hf and onnx tests are skipped without them
    session.run("python", "-m", "pytest", *session.posargs, env={"MPLBACKEND": "Agg"})


@nox.session
def lint(session: nox.Session) -> None:
    _install(session)  # mypy needs torch's annotations
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the site into docs/_build/html; any warning or notebook error fails it."""
    _install(session, "docs")
    session.run(
        "python", "-m", "sphinx", "-W", "--keep-going", "-b", "html",
        "docs", "docs/_build/html", *session.posargs,
    )  # fmt: skip


@nox.session
def dist(session: nox.Session) -> None:
    """Build the sdist and the wheel into dist/ and check their metadata."""
    if session.venv_backend != "none":
        session.install("build>=1.2,<2", "twine>=5,<8")
    shutil.rmtree(ROOT / "dist", ignore_errors=True)
    session.run("python", "-m", "build", "--outdir", "dist")
    session.run("twine", "check", "--strict", *map(str, sorted((ROOT / "dist").iterdir())))


@nox.session
def bench(session: nox.Session) -> None:
    _install(session)
    session.run("attnscore", "bench", "--quick", *session.posargs)


@nox.session
def sanitize(session: nox.Session) -> None:
    """The C kernels built with AddressSanitizer and UndefinedBehaviorSanitizer, run by the
    kernel tests and ``tools/fuzz_kernels.py`` (tools/sanitize.sh); any sanitizer report
    fails. posargs go to the fuzz (default ``--cases 2000``)."""
    _install(session)
    session.run("bash", "tools/sanitize.sh", *session.posargs, external=True)


@nox.session
def hf_suite(session: nox.Session) -> None:
    """transformers' own model tests (llama, mistral, qwen2, bert, gpt2, bart, t5;
    ``-m "not slow"``), once as they are and once with attnscore registered as ``"sdpa"``;
    a table of both and the tests whose outcome differs (tools/hf_suite/run.py; exit 1 if
    any does). Not in CI: it needs the network (a clone) and takes about 90 minutes on 2 cores.

        nox -s hf_suite                                   # clone v5.24.0, all suites
        nox -s hf_suite -- --checkout ~/src/transformers  # a checkout you have
        nox -s hf_suite -- --models llama,t5 -- -x         # some suites; pytest arguments

    The tests run against the checkout's own ``src/transformers`` (library and tests of one
    version); this session installs the checkout (so its dependencies, pinned by it) and
    ``HF_SUITE_DEPS``. Without ``--checkout`` it clones the tag
    ``v{HF_SUITE_TRANSFORMERS}`` into .nox/hf_suite-transformers (kept for the next run).
    Results: hf_suite_results/ (table.md, differences.txt, one log and JUnit report per
    suite and mode).
    """
    args = list(session.posargs)
    if "--checkout" in args:
        checkout = Path(args[args.index("--checkout") + 1]).expanduser().resolve()
    else:
        checkout = ROOT / ".nox" / "hf_suite-transformers"
        if not (checkout / "tests" / "models").is_dir():
            session.run(
                "git", "clone", "--depth", "1", "--branch", f"v{HF_SUITE_TRANSFORMERS}",
                "https://github.com/huggingface/transformers", str(checkout), external=True,
            )  # fmt: skip
        args = ["--checkout", str(checkout), *args]
    if session.venv_backend != "none":
        _install(session, "test,hf")
        session.install(str(checkout), *HF_SUITE_DEPS)
    session.run("python", "tools/hf_suite/run.py", *args, env={"HF_HUB_OFFLINE": "1"})
