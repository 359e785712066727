"""The old-against-new tools (tools/ab_compare.py, tools/ab_bench.py) import an old tree
beside the new one: the renamed copy is a package of its own, which imports nothing of
``attnscore`` and computes what attnscore computes; each side is judged on the bench's
targets by the rounds it was timed in."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tool_modules import load_tool

SRC = Path(__file__).resolve().parents[2] / "src"

PROGRAM = """
import sys
sys.path[:0] = [{into!r}]
import torch
import attnscore_old
q = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
out = attnscore_old.dot_product_attention(q, q, q, torch.tensor([1, 3]))
padded = torch.arange(3) >= torch.tensor([1, 3]).view(2, 1, 1)
scores = (q @ q.mT / 2.0).masked_fill(padded, -torch.inf)
expected = torch.softmax(scores.double(), -1) @ q.double()
torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=0)
assert not [m for m in sys.modules if m == "attnscore" or m.startswith("attnscore.")]
print(attnscore_old.kernels.__name__, type(attnscore_old.DotProductAttention()).__module__)
"""


def test_the_renamed_copy_is_a_package_of_its_own(tmp_path):
    tool = load_tool("ab_compare")
    tool.renamed_copy(str(SRC), str(tmp_path))
    for path in (tmp_path / "attnscore_old").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert "import attnscore\n" not in text and "from attnscore." not in text, path
    run = subprocess.run(
        [sys.executable, "-c", PROGRAM.format(into=str(tmp_path))],
        capture_output=True,
        text=True,
        env={**os.environ, "ATTNSCORE_DISABLE_KERNELS": "1", "PYTHONPATH": ""},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["attnscore_old.kernels", "attnscore_old.modules"]


def test_each_side_is_judged_against_the_baseline_of_the_same_rounds():
    """tools/ab_bench.py --targets: old and new each divided, round by round, by the
    baseline's time in that round (the bench's rule), so a drift of the machine cancels."""
    tool = load_tool("ab_bench")
    core = importlib.import_module("attnscore.bench._core")
    rounds = {"old": [1.0, 2.0, 1.0], "new": [1.2, 2.4, 1.2], "sdpa": [1.0, 2.0, 1.0]}
    peaks = {"old": 4.0, "new": 8.0, "sdpa": 4.0}
    time = tool._verdict(core, core.Target("time", 1.05, "sdpa"), rounds, peaks)
    assert time["old"] == pytest.approx(1.0) and time["old_met"] is True
    assert time["new"] == pytest.approx(1.2) and time["new_met"] is False
    assert tool._lost({"verdicts": [time]}) == [time]
    peak = tool._verdict(core, core.Target("peak", 1.05, "sdpa"), rounds, peaks)
    assert (peak["old"], peak["new"]) == (1.0, 2.0)
    assert (peak["old_met"], peak["new_met"]) == (True, False)
    us = tool._verdict(core, core.Target("us", 1.1e6), rounds, peaks)  # (seconds to µs)
    assert (us["old_met"], us["new_met"]) == (True, False)
    assert tool._lost({"verdicts": [us | {"old_met": False}]}) == []
