"""Every public function and class shows a runnable ``>>>`` example (run by --doctest-modules)."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

PUBLIC_MODULES = [
    "attnscore",
    "attnscore.masking",
    "attnscore.normalizers",
    "attnscore.scoring",
    "attnscore.functional",
    "attnscore.registry",
    "attnscore.modules",
    "attnscore.plotting",
    "attnscore.cli.demo",
    "attnscore.cli",
]


def _public_names():
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                yield pytest.param(obj, id=f"{module_name}.{name}")


@pytest.mark.parametrize("obj", list(_public_names()))
def test_public_name_has_a_doctest(obj):
    assert ">>>" in (inspect.getdoc(obj) or "")


def test_readme_says_how_to_get_the_cpu_build_of_the_pinned_torch():
    """Issue 21.10: on PyPI the plain pin is the CUDA build; the README names the index."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    install = readme[readme.index("## Install") : readme.index("## A 30-second example")]
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in install


def _site_checks():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "docs" / "_ext" / "site_checks.py"
    spec = importlib.util.spec_from_file_location("site_checks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_site_checks_find_missing_anchors_and_remote_scripts(tmp_path):
    """Issue 21.9: the docs build fails on links to missing anchors (viewcode's back-links
    were 12) and on scripts from other sites (MathJax from a CDN)."""
    checks = _site_checks()
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "f.html").write_text('<dt id="attnscore.functional.f">f</dt>')
    (tmp_path / "src.html").write_text(
        '<a href="api/f.html#attnscore.functional.f">ok</a>'
        '<a href="api/f.html#attnscore.f">[docs]</a>'
        '<script src="_static/mathjax/tex-chtml.js"></script>'
    )
    assert checks.broken_anchors(tmp_path) == ["src.html -> api/f.html#attnscore.f"]
    assert checks.remote_scripts(tmp_path) == []
    (tmp_path / "math.html").write_text('<script defer src="https://cdn.example/mathjax.js">')
    assert checks.remote_scripts(tmp_path) == ["math.html: https://cdn.example/mathjax.js"]


def _raises_entries(doc: str) -> list[str]:
    """The entries of a Google-style "Raises:" section, one string per exception entry."""
    lines = doc.splitlines()
    if "Raises:" not in [line.strip() for line in lines]:
        return []
    start = [line.strip() for line in lines].index("Raises:") + 1
    indent = len(lines[start]) - len(lines[start].lstrip()) if start < len(lines) else 0
    entries: list[str] = []
    for line in lines[start:]:
        if not line.strip() or len(line) - len(line.lstrip()) < indent:
            break
        if len(line) - len(line.lstrip()) == indent:
            entries.append(line.strip())
        else:
            entries[-1] += " " + line.strip()
    return entries


@pytest.mark.parametrize("obj", list(_public_names()))
def test_each_raises_entry_names_one_kind_of_error(obj):
    """Issue 21.9: "ValueError: ...; TypeError: ..." rendered as one bullet; entries name
    their exceptions first (``TypeError, ValueError: ...`` is one entry for both)."""
    for entry in _raises_entries(inspect.getdoc(obj) or ""):
        head, _, rest = entry.partition(":")
        assert head and all(
            name.strip().endswith(("Error", "Exception")) for name in head.split(",")
        )
        assert not re.search(r"[;.] *[A-Z]\w*(Error|Exception):", rest), entry
