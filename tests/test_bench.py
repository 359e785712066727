"""attnscore bench: its baselines compute what attnscore computes, every case list runs, the
smoke run gives no verdicts, the full run fails on a miss, bad options exit 2."""

from __future__ import annotations

import json

import pytest
import torch

from attnscore import bench
from attnscore._usage import ArgumentParser, UsageError
from attnscore.bench import _cases, _core, cpu, cuda
from reference import broadcast_lengths, np_attention, np_dot_scores, np_masked_softmax

CPU = torch.device("cpu")


def _tolerance(dtype: str) -> dict[str, float]:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == "float32" else {"atol": 5e-2, "rtol": 5e-2}


def _assert_same_outputs(case: _core.Case) -> None:
    built = case.build()
    with torch.no_grad():
        ours = built.forwards["attnscore"]().float()
        compared = [name for name in built.same if name in built.forwards]
        assert compared, f"{case.name}: nothing to compare attnscore with"
        for name in compared:
            torch.testing.assert_close(
                built.forwards[name]().float(), ours, **_tolerance(case.dtype), msg=name
            )


@pytest.mark.parametrize(
    "case",
    # not additive_memory (attnscore alone) nor the compiled rows (slow to build; their
    # eager twins are here)
    [
        c
        for c in cpu.cases(quick=True)
        if c.name in ("masked_softmax", "additive_fwd_bwd", "dot_no_grad", "dot_fwd_bwd")
    ],
    ids=lambda c: c.name,
)
def test_cpu_baselines_compute_what_attnscore_computes(case):
    _assert_same_outputs(case)


@pytest.mark.parametrize(
    "case", cuda.cases(CPU, 1 / 64, flex=True), ids=lambda c: f"{c.name}-{c.dtype}"
)
def test_cuda_rows_baselines_agree_on_cpu(case):
    """The CUDA case list, run on the CPU at tiny shapes (not on hardware here)."""
    _assert_same_outputs(case)


def test_baselines_against_float64_reference():
    """SDPA with the bench's mask and the textbook agree with a float64 NumPy reference."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 5, 4), torch.randn(3, 7, 4), torch.randn(3, 7, 2)
    lens = torch.tensor([1, 7, 4])
    weights = np_masked_softmax(
        np_dot_scores(q.numpy(), k.numpy()), broadcast_lengths(lens.numpy(), (3,), 5)
    )
    expected = torch.from_numpy(np_attention(weights, v.numpy()))
    torch.testing.assert_close(
        _core.sdpa_masked(q, k, v, lens).double(), expected, atol=1e-5, rtol=1e-5
    )
    heads = _core.sdpa_masked(q[:, None], k[:, None], v[:, None], lens)[:, 0]
    torch.testing.assert_close(heads.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lens", [[16, 20, 1, 40], [40, 40, 32, 17]])
def test_flex_block_mask_from_lengths(lens):
    """Full blocks, a partial block and skipped blocks give SDPA's masked result."""
    torch.manual_seed(0)
    valid_lens = torch.tensor(lens)
    q, k, v = torch.randn(4, 2, 24, 8), torch.randn(4, 2, 40, 8), torch.randn(4, 2, 40, 8)
    mask = _cases.flex_block_mask(valid_lens, 24, 40, block=16)
    flex = _cases.flex_attention_fn(CPU)
    assert flex is not None
    torch.testing.assert_close(flex(q, k, v, mask), _core.sdpa_masked(q, k, v, valid_lens))


def test_cuda_case_list_measures_on_cpu():
    """Every CUDA row times every implementation and judges its time targets."""
    rows = [
        _core.measure(c, CPU, threads=1, min_time=0.001, judge=True)
        for c in cuda.cases(CPU, 1 / 128, flex=False)
    ]
    names = [(r["case"], r["dtype"]) for r in rows]
    assert ("masked_softmax", "bfloat16") in names and ("dot_heads_fwd", "bfloat16") in names
    assert ("multihead_fwd_bwd", "bf16 autocast") in names
    for row in rows:
        assert "attnscore" in row["median_s"], row
        for check in row["targets"]:
            if check["kind"] == "time":
                assert isinstance(check["met"], bool) and check["value"] > 0
            else:  # no CUDA memory on the CPU: no verdict
                assert check["met"] is None
    table = "\n".join(_core.render_rows(rows, verdicts=True))
    assert "| multihead_fwd_bwd |" in table and "vs torch_mha" in table


def test_textbook_skipped_when_it_would_not_fit(monkeypatch):
    monkeypatch.setattr(_cases, "free_bytes", lambda device: 0)
    (case,) = [c for c in cuda.cases(CPU, 1 / 128) if c.name == "additive_fwd_bwd"][:1]
    built = case.build()
    assert list(built.forwards) == ["attnscore"]
    assert "textbook not run" in built.notes[0]


def test_quick_run_is_a_smoke_run(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--quick", "--threads", "1", "--cases", "masked_softmax", "additive_memory"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "Smoke run" in table and "no target verdicts" in table
    assert "| masked_softmax |" in table and "| additive_memory |" in table
    assert "| met |" not in table and "| NO |" not in table and "| yes |" not in table
    result = json.loads(out.read_text())
    rows = {row["case"]: row for row in result["rows"]}
    assert set(rows["masked_softmax"]["median_s"]) == {"attnscore", "softmax", "textbook"}
    assert [c["vs"] for c in rows["masked_softmax"]["targets"]] == ["softmax", "textbook"]
    assert all(c["met"] is None for row in result["rows"] for c in row["targets"])
    assert rows["additive_memory"]["peak_rss_mib"]["attnscore"] > 0
    assert result["torch"] == torch.__version__


@pytest.mark.parametrize(("bound", "code", "verdict"), [(1e-9, 1, "| NO |"), (1e9, 0, "| yes |")])
def test_full_run_judges_targets(monkeypatch, capsys, bound, code, verdict):
    monkeypatch.setitem(cpu.FULL, "masked_softmax", cpu.QUICK["masked_softmax"])
    monkeypatch.setitem(cpu.TARGETS, "masked_softmax", [_core.Target("time", bound, "softmax")])
    monkeypatch.setitem(bench.MIN_RUN_TIME, ("cpu", False), 0.01)
    assert bench.main(["--cases", "masked_softmax", "--no-memory", "--threads", "1"]) == code
    out, err = capsys.readouterr()
    assert "Smoke run" not in out and "| met |" in out and verdict in out
    assert ("target(s) missed" in err) == (code == 1)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "cuda"], "no GPU"),
        (["--device", "tpu"], "--device"),
        (["--threads", "0"], "--threads"),
        (["--cases", "nope"], "--cases"),
        (["--json", "out.txt"], "--json"),
    ],
)
def test_bad_options_exit_2_with_one_line(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "run", _no_run) if argv[0] == "--json" else None
    assert bench.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and message in err
    assert not list(tmp_path.iterdir())


def _no_run(**kwargs):
    raise AssertionError("bench ran although its options were bad")


def test_add_parser_joins_the_command_tree():
    parser = ArgumentParser(prog="attnscore")
    bench.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "--quick", "--cases", "masked_softmax"])
    assert args.handler is bench.handle and args.quick and args.device == "cpu"
    with pytest.raises(UsageError, match="--threads"):
        parser.parse_args(["bench", "--threads", "x"])


def test_cuda_case_names():
    names = bench.case_names("cuda")
    assert names[:2] == ["masked_softmax", "dot_fwd"] and "multihead_fwd_bwd" in names
    assert bench.case_names("cpu") == list(cpu.FULL)
