"""The kernel fuzz (tools/fuzz_kernels.py) itself: its draw is reproducible, a clean
implementation passes its budgets, and a wrong one is caught and reported."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

import attnscore

TOOL = Path(__file__).resolve().parents[2] / "tools" / "fuzz_kernels.py"


@pytest.fixture(scope="module")
def fuzz():
    """The tool as a module; the process state it sets (threads, OMP_WAIT_POLICY) restored."""
    threads, policy = torch.get_num_threads(), os.environ.get("OMP_WAIT_POLICY")
    spec = importlib.util.spec_from_file_location("fuzz_kernels", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_kernels"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("fuzz_kernels", None)
    torch.set_num_threads(threads)
    if policy is None:
        os.environ.pop("OMP_WAIT_POLICY", None)
    else:
        os.environ["OMP_WAIT_POLICY"] = policy


def _softmax_cases(fuzz, count: int) -> list[int]:
    return [i for i in range(count) if fuzz.draw(5, i).api == "masked_softmax"]


def test_the_draw_is_reproducible(fuzz):
    a, b = fuzz.draw(3, 11), fuzz.draw(3, 11)
    assert a.label() == b.label()
    assert all(torch.equal(a.t[k].nan_to_num(), b.t[k].nan_to_num()) for k in a.t)


def test_a_correct_softmax_passes(fuzz, capsys):
    cases = _softmax_cases(fuzz, 60)
    args = ["--seed", "5", "--threads", "1"] + [f"--case={i}" for i in cases]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        assert fuzz.main(args) == 0
    out = capsys.readouterr().out
    assert f"total: {len(cases)} cases, 0 failed" in out


def test_a_wrong_softmax_is_caught(fuzz, capsys, monkeypatch):
    def off_by_one(x, valid_lens=None):  # lengths one short: the bug a fuzz must see
        if valid_lens is None:
            return torch.softmax(x.float(), -1).to(x.dtype)
        lens = torch.as_tensor(valid_lens).long().clamp(min=1) - 1
        return attnscore.masked_softmax(x, lens.contiguous())

    monkeypatch.setattr(fuzz.attnscore, "masked_softmax", off_by_one)
    cases = _softmax_cases(fuzz, 60)
    args = ["--seed", "5", "--threads", "1"] + [f"--case={i}" for i in cases]
    assert fuzz.main(args) == 1
    out = capsys.readouterr().out
    assert "failing cases" in out and "--seed 5 --case" in out
