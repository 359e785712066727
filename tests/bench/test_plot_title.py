"""The figure's title names the machine and the torch build once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnscore.bench.plot import _title

BENCH = Path(__file__).resolve().parents[2] / "docs" / "bench"


@pytest.mark.parametrize("name", ["cpu-full-481b016.json", "gpu-h100-run5/bench.json"])
def test_the_title_names_torch_once(name: str) -> None:
    title = _title(json.loads((BENCH / name).read_text()))
    assert title.count("torch") == 1, title


def test_a_device_name_without_torch_gets_it_added() -> None:
    title = _title({"device_name": "x86_64", "torch": "2.13.0", "threads": 2})
    assert title == "attnscore bench, full run: x86_64, torch 2.13.0, 2 threads"
