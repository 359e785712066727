"""attnscore bench: its baselines compute the same thing, and the command runs."""

from __future__ import annotations

import json

import torch

from attnscore import bench


def test_baselines_compute_what_attnscore_computes():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 5, 4), torch.randn(3, 7, 4), torch.randn(3, 7, 2)
    lens = torch.tensor([1, 7, 4])
    # the reference: float64 softmax over the first lens keys, written out here
    scores = (q.double() @ k.double().transpose(1, 2)) / 2.0
    scores = scores.masked_fill(torch.arange(7) >= lens[:, None, None], float("-inf"))
    expected = torch.softmax(scores, -1) @ v.double()
    for fn in (bench.textbook_dot, bench.sdpa_masked):
        torch.testing.assert_close(fn(q, k, v, lens).double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        bench.textbook_masked_softmax(scores.float().nan_to_num(neginf=0.0), lens).double(),
        torch.softmax(scores, -1),
        atol=1e-6,
        rtol=1e-6,
    )


def test_quick_run_prints_table_and_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = bench.main(
        [
            "--quick",
            "--threads",
            "1",
            "--cases",
            "masked_softmax",
            "additive_memory",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "| masked_softmax |" in table and "| additive_memory |" in table
    result = json.loads(out.read_text())
    rows = {row["case"]: row for row in result["rows"]}
    assert set(rows["masked_softmax"]["median_s"]) == {"attnscore", "softmax", "textbook"}
    assert [c["vs"] for c in rows["masked_softmax"]["targets"]] == ["softmax", "textbook"]
    assert rows["additive_memory"]["peak_rss_mib"]["attnscore"] > 0
    assert result["torch"] == torch.__version__
