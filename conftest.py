"""Root conftest: names every doctest may use without importing them."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace["torch"] = torch
