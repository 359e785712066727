"""Shared fixtures: tiny cmudict-format lexicons (:mod:`g2p_toy`) written by the tests; the
seed, the kernel choices as shipped and the ``slow`` marks, as attnscore's tests/conftest.py
sets them (these tests run in attnscore's suite and on their own, from attnscore-g2p/)."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import pytest
import torch

from g2p_toy import toy_lexicon_text

matplotlib.use("Agg")

HERE = Path(__file__).resolve().parent
SLOW = ("test_g2p_training.py", "test_g2p_cli.py", "test_g2p_onnx.py")
"""The files that train for long on 2 cores: marked ``slow`` (``-m "not slow"`` skips them)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent == HERE and item.path.name in SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="session")
def _no_tune_file(tmp_path_factory: pytest.TempPathFactory):
    """Choices as shipped: no tune file of this machine and no first-call benchmark."""
    from attnscore import kernels

    kernels.benchmark = False
    with kernels.tuned(tmp_path_factory.mktemp("tune") / "none.json"):
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def toy_dict(tmp_path: Path) -> Path:
    path = tmp_path / "toy.dict"
    path.write_text(toy_lexicon_text())
    return path
