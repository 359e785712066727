import contextlib
import os
import sys

import matplotlib
import pytest
import torch
from hypothesis import settings

matplotlib.use("Agg")

# CI gates a merge, so it replays the same examples every run (a failure there is then
# reproducible); local runs keep exploring new random examples.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True, scope="session")
def _no_tune_file(tmp_path_factory):
    """Choices as shipped: no tune file of this machine (``attnscore tune``) and no
    first-call benchmark (ATTNSCORE_BENCHMARK) steer the tests."""
    from attnscore import kernels

    kernels.benchmark = False
    with kernels.tuned(tmp_path_factory.mktemp("tune") / "none.json"):
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def thresholds():
    """``thresholds(**values)``: :func:`attnscore.kernels.thresholds` for the rest of the
    test, as ``monkeypatch`` would set them (later calls add to earlier ones; all are
    undone when the test ends). How tests steer which implementation runs."""
    from attnscore import kernels

    with contextlib.ExitStack() as stack:

        def set_values(**values):
            return stack.enter_context(kernels.thresholds(**values))

        yield set_values


# The files whose tests take the most time on 2 cores (subprocesses, training, compiling,
# the Triton interpreter, every code block of the docs): marked `slow`, so that
# `python -m pytest -m "not slow" --no-cov` is the quick subset the README names. CI runs
# everything.
SLOW = (
    "tests/test_docs_blocks.py",
    "tests/test_imports.py",
    "tests/test_startup.py",
    "tests/bench/test_bench.py",
    "tests/cli/test_cli_bench.py",
    "tests/cli/test_cli_export.py",
    "tests/cli/test_cli_interrupt.py",
    "tests/core/test_compile_modules.py",
    "tests/integrations/",
    "tests/kernels/test_cuda_backend.py",
    "tests/kernels/test_triton_aot.py",
    "tests/tools/",
)


def pytest_collection_modifyitems(config, items):
    root = config.rootpath
    for item in items:
        try:
            where = item.path.relative_to(root).as_posix()
        except ValueError:
            continue
        if where.startswith(SLOW) or where.endswith(".ipynb"):
            item.add_marker(pytest.mark.slow)
