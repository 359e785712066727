"""The runner of transformers' own model tests (tools/hf_suite/: ``nox -s hf_suite``):
its reading of pytest's JUnit reports and its table, on reports a real pytest run writes,
and its plugin, which must put attnscore behind ``"sdpa"`` in a real transformers model."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools" / "hf_suite"
SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(scope="module")
def run_module():
    spec = importlib.util.spec_from_file_location("hf_suite_run", TOOLS / "run.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def _pytest(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TOOLS)])}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "test_sample.py", "-q", "-p", "no:cacheprovider",
         "-o", "addopts=", "--junitxml=report.xml", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_outcomes_and_table_from_a_real_report(run_module, tmp_path: Path) -> None:
    _pytest(
        tmp_path,
        "import pytest\n"
        "def test_a(): pass\n"
        "def test_b(): assert False\n"
        "def test_c(): pytest.skip('no')\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError\n"
        "def test_d(broken): pass\n",
    )
    outcomes = run_module.outcomes(tmp_path / "report.xml")
    assert outcomes == {
        "test_sample::test_a": "passed",
        "test_sample::test_b": "failed",
        "test_sample::test_c": "skipped",
        "test_sample::test_d": "failed",  # an error counts as a failure
    }
    assert run_module.outcomes(tmp_path / "missing.xml") == {}
    changed = {**outcomes, "test_sample::test_b": "passed"}
    text = run_module.table([("m", outcomes, changed)], "9.9.9")
    assert "transformers 9.9.9" in text
    assert "| m | 1 | 2 | 2 | 1 | 1 | 1 |" in text
    assert "| **total** | **1** | **2** | **2** | **1** | **1** | **1** |" in text


def test_the_plugin_puts_attnscore_behind_sdpa(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    result = _pytest(
        tmp_path,
        "import torch\n"
        "from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM\n"
        "from attnscore.integrations.transformers import attention_function\n"
        "def test_sdpa_is_attnscore():\n"
        "    assert AttentionInterface()['sdpa'] is attention_function('softmax')\n"
        "    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32,\n"
        "                         num_hidden_layers=1, num_attention_heads=2)\n"
        "    model = LlamaForCausalLM._from_config(config, attn_implementation='sdpa')\n"
        "    out = model(torch.randint(0, 16, (1, 4)), output_attentions=True)\n"
        "    assert out.attentions[0] is not None  # only attnscore returns weights as sdpa\n",
        "-p",
        "sdpa_is_attnscore",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
