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
