"""The contributor's task runner: the same test / lint / bench commands CI runs.

    nox -s tests      # python -m pytest (coverage floor 90%, doctests included)
    nox -s lint       # ruff check, ruff format --check, mypy (strict)
    nox -s bench      # attnscore bench --quick (a smoke run)

Each session installs the package as the README says (CPU torch pinned). ``nox -R``
reuses existing session environments; ``nox --no-venv`` runs in the current one.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "tests"]
TORCH = "torch==2.13.0"


def _install(session: nox.Session) -> None:
    if session.venv_backend == "none":  # --no-venv: use what is installed
        return
    session.install(TORCH)
    session.install("-e", ".[test]")


@nox.session
def tests(session: nox.Session) -> None:
    _install(session)
    session.run("python", "-m", "pytest", *session.posargs, env={"MPLBACKEND": "Agg"})


@nox.session
def lint(session: nox.Session) -> None:
    _install(session)  # mypy needs torch's annotations
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")


@nox.session
def bench(session: nox.Session) -> None:
    _install(session)
    session.run("attnscore", "bench", "--quick", *session.posargs)
