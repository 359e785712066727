"""Every public function and class shows a runnable ``>>>`` example (run by --doctest-modules)."""

from __future__ import annotations

import importlib
import inspect

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
    quick_start = readme[readme.index("## Quick start") : readme.index("Run the tests")]
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in (
        quick_start
    )
