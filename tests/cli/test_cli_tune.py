"""``attnscore tune``: the tune file it writes is keyed by this machine and read by the
selection; bad input is one line and exit 2 (tests/cli/test_cli_root.py)."""

from __future__ import annotations

import json

import attnscore.cli.tune
from attnscore.cli import main
from attnscore.kernels._measured import machine


def test_tune_writes_this_machines_file_in_its_budget(tmp_path, monkeypatch, capsys):
    """With a budget of a fraction of a second it measures the smallest buckets (the rest
    are left out) and writes a file of this machine's key, which it refuses to replace
    without --overwrite."""
    monkeypatch.setattr(attnscore.cli.tune, "BUDGET_S", 0.2)
    out = tmp_path / "t.json"
    assert main(["tune", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["key"] == machine() and set(written) == {"key", "seconds", "load", "buckets"}
    first = written["buckets"]["none float32 inference 2^16"]
    assert first["winner"] == min(("c_by_lengths", "sdpa"), key=first.__getitem__)
    assert len(written["buckets"]) < 48
    assert not any(name.startswith("softmax") for name in written["buckets"])  # (after)
    assert capsys.readouterr().out.startswith(f"wrote {out}: ")
    assert main(["tune", "--out", str(out)]) == 2
    assert main(["tune", "--out", str(out), "--overwrite"]) == 0


def test_a_softmax_bucket_times_both_sides_between_the_products():
    """One softmax bucket (2^16 elements, float32, training): the fastest ms of the C
    kernel's and torch.softmax's attention step, and which of them won."""
    import torch

    found = attnscore.cli.tune._measure_softmax(torch.float32, True, 16)
    assert set(found) == {"c_softmax", "torch", "winner"}
    assert 0 < found["c_softmax"] < 1e3 and 0 < found["torch"] < 1e3
    assert found["winner"] == min(("c_softmax", "torch"), key=found.__getitem__)
