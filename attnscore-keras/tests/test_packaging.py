"""The package imports without PyTorch, and its docs page's examples run."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import attnscore_keras
import keras
import pytest

HERE = Path(__file__).resolve().parent
DOCS = HERE.parents[1] / "docs" / "tensorflow_and_jax.md"


def _env() -> dict[str, str]:
    """This environment, with the folder the package was imported from on the path."""
    where = str(Path(attnscore_keras.__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [where, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "MPLBACKEND": "Agg"}


@pytest.mark.skipif(
    os.environ.get("ATTNSCORE_KERAS_NO_TORCH") != "1",
    reason="run where ATTNSCORE_KERAS_NO_TORCH=1 says torch is not installed (CI's first run)",
)
def test_imports_without_torch():
    """In a fresh interpreter: importing the package (and using it) imports no torch.

    Run with ATTNSCORE_KERAS_NO_TORCH=1 in a venv without torch (CI's first run): torch
    must not be installed there."""
    code = (
        "import sys, numpy as np, attnscore_keras as ak\n"
        "ak.MultiHeadAttention(4, 2)(np.ones((1, 2, 4), 'float32'), np.ones((1, 3, 4), 'float32'),"
        " np.ones((1, 3, 4), 'float32'), np.array([2]))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "import importlib.util\n"
        "print(importlib.util.find_spec('torch') is None)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=_env()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("True"), "torch is installed here"


def test_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", attnscore_keras.__version__)


def _python_blocks(page: Path) -> list[str]:
    text = page.read_text()
    return re.findall(r"<!-- skip: needs keras -->\n```python\n(.*?)```", text, re.S)


@pytest.mark.skipif(
    not DOCS.exists(), reason="docs/tensorflow_and_jax.md is in the repository only"
)
@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="once: on Keras's default backend"
)
@pytest.mark.parametrize("index", range(3))
def test_docs_page_examples_run(index, tmp_path):
    blocks = _python_blocks(DOCS)
    assert len(blocks) >= 2
    if index >= len(blocks):
        pytest.skip("no such block")
    if "import torch" in blocks[index] and importlib.util.find_spec("torch") is None:
        pytest.skip("the block needs torch")
    done = subprocess.run(
        [sys.executable, "-c", blocks[index]], capture_output=True, text=True, cwd=tmp_path,
        timeout=300, env=_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
