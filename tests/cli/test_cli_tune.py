"""``attnscore tune``: the tune file it writes is keyed by this machine and read by the
selection; bad input is one line and exit 2 (tests/cli/test_cli_root.py)."""

from __future__ import annotations

import json

import attnscore.cli.tune
from attnscore.cli import main
from attnscore.kernels._measured import machine


def test_tune_writes_this_machines_file_in_its_budget(tmp_path, monkeypatch, capsys):
    """With its time budget spent at once it measures nothing more, and still writes a file
    of this machine's key, refusing to replace it without --overwrite."""
    monkeypatch.setattr(attnscore.cli.tune, "BUDGET_S", 0.0)
    out = tmp_path / "t.json"
    assert main(["tune", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["key"] == machine() and set(written) == {"key", "seconds", "load", "buckets"}
    assert capsys.readouterr().out.startswith(f"wrote {out}: ")
    assert main(["tune", "--out", str(out)]) == 2
    assert main(["tune", "--out", str(out), "--overwrite"]) == 0
