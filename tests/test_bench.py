"""attnscore bench: its baselines compute what attnscore computes, every case list runs, the
smoke run gives no verdicts, the full run fails on a miss, bad options exit 2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnscore import bench
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


def test_cuda_case_names():
    names = bench.case_names("cuda")
    assert names[:2] == ["masked_softmax", "dot_fwd"] and "multihead_fwd_bwd" in names
    assert bench.case_names("cpu") == list(cpu.FULL)


@pytest.mark.parametrize(
    ("stdout", "value"),
    [
        ("512.5\n", 512.5),
        ("a warning\n12.25\n", 12.25),
        ("", None),
        ("oops\n", None),
        ("nan", None),
    ],
)
def test_last_float_of_a_child(stdout, value):
    assert cpu._last_float(stdout) == value


def test_compiled_rows_build_lazily_beside_an_eager_twin():
    """Building a compiled row compiles nothing yet; its eager twin computes the masked
    softmax (the compiled one runs only in the full bench, its build is slow here)."""
    built = cpu.build("masked_softmax_compiled", {"B": 2, "n": 3, "m": 5})
    assert list(built.forwards) == ["attnscore", "eager"] and built.same == ("eager",)
    torch.manual_seed(0)  # the row's own inputs (it seeds itself, as every row), drawn again
    X, vl = torch.randn(2, 3, 5), _core.lengths(2, 5)
    expected = np_masked_softmax(X.numpy(), broadcast_lengths(vl.numpy(), (2,), 3))
    got = built.forwards["eager"]()
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-6)
    small = {"B": 1, "n": 2, "m": 3, "h": 4, "d": 2}
    additive = cpu.build("additive_fwd_bwd_compiled", small)
    assert list(additive.forwards) == ["attnscore", "textbook"]
    assert any("torch.compile" in note for note in additive.notes)


class _FakeCudaMemory:
    """torch.cuda's memory counters and device name, without a GPU: 1 MiB is allocated
    before each step; the forward of ``run(mib)`` peaks ``mib`` MiB above that."""

    def __init__(self, monkeypatch):
        self.peak = self.allocated = 2**20
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU 80GB")

    def reset(self, device=None):
        self.peak = self.allocated

    def run(self, mib):
        def forward():
            self.peak = max(self.peak, self.allocated + int(mib * 2**20))
            return torch.ones(2)

        return forward


def test_measure_reads_cuda_peaks_and_judges_memory_targets(monkeypatch):
    fake = _FakeCudaMemory(monkeypatch)
    case = _core.Case(
        "fake",
        {"B": 1},
        "float32",
        lambda: _core.Built({"attnscore": fake.run(2), "textbook": fake.run(8)}),
        [
            _core.Target("peak", 0.5, "textbook"),
            _core.Target("peak_mib", 1.0),
            _core.Target("peak", 0.5, "missing"),
        ],
        timed=False,
    )
    row = _core.measure(case, torch.device("cuda"), threads=1, min_time=0.01, judge=True)
    assert row["peak_mib"] == {"attnscore": 2.0, "textbook": 8.0} and row["median_s"] == {}
    assert [(c["value"], c["met"]) for c in row["targets"]] == [
        (0.25, True),
        (2.0, False),
        (None, None),
    ]
    assert _core.device_name(torch.device("cuda")) == "Fake GPU 80GB"


def test_measure_leaves_out_an_implementation_that_fails():
    def out_of_memory():
        raise RuntimeError("out of memory\nwhile allocating 3 GiB")

    case = _core.Case(
        "flaky",
        {"B": 1},
        "float32",
        lambda: _core.Built({"attnscore": lambda: torch.ones(2), "sdpa": out_of_memory}),
        [_core.Target("time", 1.0, "sdpa")],
    )
    row = _core.measure(case, CPU, threads=1, min_time=0.001, judge=True)
    assert list(row["median_s"]) == ["attnscore"]
    assert row["notes"] == ["sdpa not measured: RuntimeError: out of memory"]
    assert row["targets"][0]["met"] is None  # no baseline, no verdict


def test_render_cuda_result_and_times():
    text = bench.render(
        {"device": "cuda", "device_name": "Fake GPU", "threads": 2, "quick": False, "rows": []}
    )
    assert text.startswith("attnscore bench on Fake GPU, 2 CPU threads")
    assert "torch.cuda.max_memory_allocated" in text and "C kernels" not in text
    assert [_core._ms(t) for t in (None, 0.0015, 0.25)] == ["-", "1.500", "250.0"]


def test_run_refuses_unknown_cases():
    with pytest.raises(
        ValueError, match=r"Expected `cases` among \[.*\] for cpu, but got \['nope'\]"
    ):
        bench.run(cases=["nope"], memory=False, threads=1)
