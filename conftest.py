"""Root conftest: the Triton interpreter switch, the modules doctest collection must skip
where their dependency is missing, and the names every doctest may use without importing
them."""

import importlib.util
import os

import pytest
import torch

# Without a GPU the Triton kernels run under Triton's interpreter (tests/test_cuda_backend.py).
# Triton reads TRITON_INTERPRET when it is first imported, and torch.compile may import it
# early in the session, so the switch is set here, before any test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The CUDA backend imports triton at module level; without triton, doctest collection
# leaves those modules alone.
collect_ignore_glob = (
    []
    if importlib.util.find_spec("triton")
    else ["src/attnscore/kernels/_cuda.py", "src/attnscore/kernels/_triton_*.py"]
)
# The test folders' conftest files hold no doctests, and two share the module name conftest
# (tests/ and attnscore-g2p/tests/): collected as doctest modules, one would be imported in
# place of the other.
collect_ignore_glob += ["tests/conftest.py", "attnscore-g2p/tests/conftest.py"]


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace["torch"] = torch
