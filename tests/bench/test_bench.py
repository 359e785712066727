"""attnscore bench: its baselines compute what attnscore computes (checked against float64
references written here), every cell of the matrix builds, the timing loop interleaves,
peak memory is read, targets are judged (the command line is tested in tests/cli)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from attnscore import bench
from attnscore.bench import _cases, _core, _hf, cpu, matrix
from reference import broadcast_lengths, np_masked_softmax

CPU = torch.device("cpu")
# Every row's dimensions, at sizes where float64 runs in milliseconds (B = 3 and n = 5
# where dot attention reads them: no dimension equal to another).
_SMALL = {"B": 2, "H": 2, "n": 3, "m": 6, "d": 4, "h": 5, "E": 8}
TINY = {
    row: {k: _SMALL[k] if row != "dot" else {"B": 3, "n": 5}.get(k, _SMALL[k]) for k in shape}
    for row, shape in matrix.SHAPES["quick"].items()
}


def _cells():
    for row, s in TINY.items():
        masks = _cases.SOFTMAX_MASKS if row == "masked_softmax" else _cases.MASKS
        yield from ((row, s, mask) for mask in masks)


@pytest.mark.parametrize(("row", "shapes", "mask"), list(_cells()), ids=str)
def test_every_baseline_computes_what_attnscore_computes(row, shapes, mask):
    """Each cell's PyTorch baseline does the same work as attnscore (same outputs and, for
    fwd+bwd, same gradients); float64 makes the comparison exact."""
    built = _cases.BUILDERS[row](shapes, mask, dtype=torch.float64, device=CPU, backward=True)
    compared = [name for name in built.same if name in built.forwards]
    if row == "masked_softmax":
        compared = []  # torch.softmax without a mask sets a pace, it is not the same
    for name in compared:
        ours, theirs = built.forwards["attnscore"](), built.forwards[name]()
        torch.testing.assert_close(ours, theirs, atol=1e-10, rtol=1e-10, msg=name)
        # the inputs both differentiate (their parameters are each their own)
        shared = [t for t in built.grad_inputs[name] if t.ndim >= 3]
        grads = [torch.autograd.grad(out.sum(), shared) for out in (ours, theirs)]
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("kind", [*_cases.MASKS, _cases.CACHE])
def test_mask_columns_against_the_lengths_they_come_from(kind):
    masks = _cases.Masks(kind, 3, 4, 6, CPU)
    dense = masks.dense()
    if kind == "none":
        assert dense is None and masks.kwargs() == {}
        return
    assert dense.dtype == torch.bool and dense.shape[-1] == 6
    expected = torch.ones(3, 4, 6, dtype=torch.bool)
    if masks.valid_lens is not None:
        lens = masks.valid_lens if masks.valid_lens.ndim == 2 else masks.valid_lens[:, None]
        expected &= torch.arange(6) < lens[..., None]
        low = 3 if kind == _cases.CACHE else 1  # a KV cache's lengths: in [m/2, m]
        assert masks.valid_lens.min() >= low and masks.valid_lens.max() <= 6
    if masks.causal:
        expected &= torch.ones(4, 6, dtype=torch.bool).tril()
    if masks.attend is not None:
        expected &= masks.attend
        assert masks.attend[..., 0].all()  # no empty rows
    assert torch.equal(dense.expand(3, 4, 6), expected)


def test_softmax_textbook_and_pace():
    built = _cases.softmax(
        {"B": 2, "n": 3, "m": 5}, "lengths (B,)", dtype=torch.float32, device=CPU, backward=False
    )
    torch.manual_seed(0)  # the row's own inputs (every builder seeds itself), drawn again
    X, vl = torch.randn(2, 3, 5), _core.lengths(2, 5)
    expected = np_masked_softmax(X.numpy(), broadcast_lengths(vl.numpy(), (2,), 3))
    for name in ("attnscore", "textbook"):
        np.testing.assert_allclose(built.forwards[name]().numpy(), expected, atol=1e-6)
    np.testing.assert_allclose(built.forwards["softmax"]().numpy(), torch.softmax(X, -1), 1e-6)


def test_matrix_covers_rows_masks_dtypes_and_steps():
    cells = matrix.matrix("cpu", quick=True)
    seen = {(c.name, c.mask, c.dtype, c.backward) for c in cells}
    for row in matrix.SHAPES["cpu"]:
        masks = _cases.SOFTMAX_MASKS if row == "masked_softmax" else _cases.MASKS
        for mask, dtype, step in itertools.product(masks, matrix.DTYPES, (False, True)):
            assert (row, mask, dtype, step) in seen
    assert len(cells) == len(seen)
    for c in cells:  # every cell: time and memory against its baseline
        kinds = [(t.kind, t.vs) for t in c.targets]
        assert ("time", matrix.BASELINE[c.name]) in kinds
        assert ("peak", matrix.BASELINE[c.name]) in kinds


def test_targets_of_issue_16():
    def bound(row, mask, dtype="float32", backward=False):
        return matrix.targets(row, mask, dtype, backward)[0].bound

    assert (
        bound("dot", "lengths (B,)") == 0.8 and bound("dot", "lengths (B,)", backward=True) == 0.9
    )
    assert bound("multihead", "lengths (B,)", backward=True) == 0.9
    assert bound("multihead", "lengths (B,)") == 1.05
    assert bound("masked_softmax", "lengths (B,)", "bfloat16") == 1.0
    assert bound("additive", "lengths (B,)", backward=True) == 0.1
    assert bound("additive", "bool", backward=True) == 1.05
    assert bound("additive", "lengths (B,)", "bfloat16", backward=True) == 1.05
    assert bound("general", "lengths (B, n)") == bound("cosine", "causal") == 1.0
    assert bound("general", "none") == 1.05
    assert bound("dot", "bool") == 1.05
    extra = matrix.targets("masked_softmax", "lengths (B,)", "float32", False)
    assert ("time", 0.25, "textbook") in [(t.kind, t.bound, t.vs) for t in extra]


def test_extra_rows_build_and_agree():
    """The decoder step and the tiny calls compute what their baselines compute; the
    compiled rows build lazily (compiling runs only in the full bench)."""
    for case in matrix.extras("cpu", quick=True):
        if case.name == "additive_memory" or (case.name == "hf_llama" and not _hf.available()):
            continue
        built = case.build()
        tol = 1e-5 if case.dtype == "float32" else 2e-2
        with torch.no_grad():
            ours = built.forwards["attnscore"]()
            for name in built.same:
                torch.testing.assert_close(ours, built.forwards[name](), atol=tol, rtol=tol)
    names = [c.name for c in matrix.extras("cpu", quick=False)]
    assert "additive_compiled" in names and "masked_softmax_compiled" in names
    assert [c.name for c in matrix.extras("cuda", quick=False)].count("additive_memory") == 0
    built = _cases.compiled_softmax({"B": 2, "n": 3, "m": 5}, device=CPU)
    assert list(built.forwards) == ["attnscore", "eager"] and built.same == ("eager",)


_USERS = ("decode", "decode_multihead", "long_causal", "serving")


def test_rows_users_run_at_their_shapes_and_targets():
    """Decoding against a KV cache (n = 1), long causal attention (full runs only), small-model
    serving (padded batches, and batches without padding): each cell against its PyTorch
    call, <= 1.0x with lengths, 1.05x without, and 1.05x in peak memory; each row
    selectable by name."""
    full = [c for c in matrix.extras("cpu", quick=False) if c.name in _USERS]
    quick = [c for c in matrix.extras("cpu", quick=True) if c.name in _USERS]
    assert {c.name for c in full} == set(_USERS) <= set(bench.case_names("cpu"))
    assert "long_causal" not in {c.name for c in quick}
    masks, dtypes = (_cases.CACHE, "none"), ("float32", "bfloat16")
    sizes = ((512, 8, 64), (4096, 32, 128))  # m, H, d
    decode = {(c.shapes["B"], c.shapes["m"], c.shapes["H"], c.shapes["d"], c.mask, c.dtype)
              for c in full if c.name == "decode"}  # fmt: skip
    assert decode == {(B, *size, mask, dtype) for B in (1, 8) for size in sizes
                      for mask in masks for dtype in dtypes}  # fmt: skip
    assert all(c.shapes["n"] == 1 and not c.backward for c in full if c.name.startswith("decode"))
    long = [(c.shapes, c.mask, c.dtype, c.backward) for c in full if c.name == "long_causal"]
    assert {(dtype, bwd) for _, _, dtype, bwd in long} == set(
        itertools.product(dtypes, (False, True))
    )
    assert all(
        s == {"B": 1, "H": 8, "n": 4096, "m": 4096, "d": 128} and m == "causal" for s, m, *_ in long
    )
    serving = [(c.shapes, c.mask, c.dtype) for c in full if c.name == "serving"]
    shape = {"B": 8, "H": 12, "n": 128, "m": 128, "d": 64}
    # padded batches, and batches that happen to hold no padding (every length m)
    assert serving == [(shape, mask, "bfloat16") for mask in ("lengths (B,)", _cases.UNCUT)]
    for c in full + quick:
        base = "torch_mha" if c.name == "decode_multihead" else "sdpa"
        bound = 1.0 if "lengths" in c.mask else 1.05
        assert [(t.kind, t.bound, t.vs) for t in c.targets] == [
            ("time", bound, base),
            ("peak", 1.05, base),
        ]


@pytest.mark.parametrize("mask", ["none", _cases.CACHE])
@pytest.mark.parametrize(
    ("row", "shapes"),
    [("heads", {"B": 3, "H": 2, "n": 1, "m": 7, "d": 4}),
     ("multihead", {"B": 3, "n": 1, "m": 7, "E": 8, "H": 2})],
)  # fmt: skip
def test_decode_steps_compute_what_their_baselines_compute(row, shapes, mask):
    """One query against m cached keys (cross-attention for multihead), in float64."""
    built = _cases.BUILDERS[row](shapes, mask, dtype=torch.float64, device=CPU, backward=True)
    (name,) = built.same
    ours, theirs = built.forwards["attnscore"](), built.forwards[name]()
    assert ours.shape[-2] == 1
    torch.testing.assert_close(ours, theirs, atol=1e-10, rtol=1e-10)
    inputs = [t for t in built.grad_inputs[name] if t.ndim >= 3]  # not the parameters
    grads = [torch.autograd.grad(out.sum(), inputs) for out in (ours, theirs)]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_processor_names_the_cpu_and_its_isa_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
        "flags\t\t: fpu sse2 amx_tile avx2 avx512f amx_bf16 avx512_bf16 avx512bw\n"
    )
    found = _core.processor(str(cpuinfo))
    assert found["model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert found["flags"] == ["avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"]
    assert found["capability"] == torch.backends.cpu.get_cpu_capability()
    elsewhere = _core.processor(str(tmp_path / "missing"))  # no /proc: the platform's name
    assert elsewhere["flags"] == [] and elsewhere["model"]
    here = _core.processor()
    assert set(here["flags"]) <= set(_core.ISA_FLAGS)
    assert _core.describe(CPU).startswith(f"{here['model']} (")


def test_measure_interleaves_and_reads_peak_memory():
    calls = []

    def implementation(name, mib):
        def forward():
            calls.append(name)
            return torch.ones(int(mib * 2**20) // 4)

        return forward

    case = _core.Case(
        "fake",
        {"B": 1},
        "float32",
        lambda: _core.Built({"attnscore": implementation("a", 1), "pace": implementation("b", 4)}),
        [_core.Target("time", 1e9, "pace"), _core.Target("peak", 0.5, "pace")],
        mask="none",
    )
    row = _core.measure(case, CPU, threads=1, min_time=0.01, judge=True)
    assert set(row["median_s"]) == {"attnscore", "pace"}
    assert row["peak_mib"]["attnscore"] == pytest.approx(1, rel=0.01)
    assert row["peak_mib"]["pace"] == pytest.approx(4, rel=0.01)
    assert [c["met"] for c in row["targets"]] == [True, True]
    # rounds alternate between the implementations
    changes = sum(1 for x, y in itertools.pairwise(calls) if x != y)
    assert changes >= 2 * _core.ROUNDS[0] - 1


def test_peak_memory_counts_inputs_and_parameters():
    x = torch.ones(2**18)  # 1 MiB, held before the step
    case = _core.Case(
        "fake",
        {"B": 1},
        "float32",
        lambda: _core.Built({"attnscore": lambda: x * 2}, {"attnscore": [x, x[:10]]}),
        timed=False,
    )
    row = _core.measure(case, CPU, threads=1, min_time=0.01, judge=True)
    assert row["peak_mib"]["attnscore"] == pytest.approx(2, rel=0.01)


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
            _core.Target("peak", 0.2, "textbook"),
            _core.Target("peak", 0.5, "missing"),
        ],
        timed=False,
    )
    row = _core.measure(case, torch.device("cuda"), threads=1, min_time=0.01, judge=True)
    assert row["peak_mib"] == {"attnscore": 2.0, "textbook": 8.0} and row["median_s"] == {}
    assert [(c["value"], c["met"]) for c in row["targets"]] == [
        (0.25, True),
        (0.25, False),
        (None, None),
    ]
    assert _core.describe(torch.device("cuda")).startswith("Fake GPU 80GB, torch ")


def test_measure_leaves_out_an_implementation_that_fails():
    def out_of_memory():
        raise RuntimeError("out of memory\nwhile allocating 3 GiB")

    case = _core.Case(
        "flaky",
        {"B": 1},
        "float32",
        lambda: _core.Built({"attnscore": lambda: torch.ones(2), "sdpa": out_of_memory}),
        [_core.Target("time", 1.0, "sdpa"), _core.Target("us", 1e9)],
    )
    row = _core.measure(case, CPU, threads=1, min_time=0.001, judge=True, memory=False)
    assert list(row["median_s"]) == ["attnscore"]
    assert row["notes"] == ["sdpa not measured: RuntimeError: out of memory"]
    assert row["targets"][0]["met"] is None  # no baseline, no verdict
    assert row["targets"][1]["met"] is True and row["targets"][1]["value"] > 0


def test_render_missed_and_slower():
    row = {
        "case": "dot",
        "mask": "bool",
        "shapes": {"B": 2},
        "dtype": "float32",
        "step": "fwd",
        "median_s": {"attnscore": 0.002, "sdpa": 0.001},
        "peak_mib": {"attnscore": 3.0},
        "peak_rss_mib": {},
        "targets": [
            {"kind": "time", "vs": "sdpa", "value": 2.0, "bound": 1.05, "met": False},
            {"kind": "rss_mib", "vs": None, "value": 500.0, "bound": 1024.0, "met": True},
        ],
        "notes": [],
    }
    result = {"device": "cuda", "device_name": "Fake GPU", "threads": 2, "quick": False}
    text = bench.render({**result, "rows": [row]})
    assert text.startswith("attnscore bench on Fake GPU, 2 CPU threads\n")
    load = {"cores": 2, "max_load_1min": 1.5, "busy": False}
    assert bench.render({**result, "rows": [row], "load": load}).startswith(
        "attnscore bench on Fake GPU, 2 CPU threads, load average up to 1.5 on 2 cores\n"
    )
    assert "| dot | bool | float32 | fwd | B=2 | attnscore 2.000, sdpa 1.000 |" in text
    assert "2.00x sdpa; peak RSS 500 MiB" in text and "**NO**; yes" in text
    assert _core.missed({"rows": [row]}) == [
        "dot (bool, float32, fwd): 2.00x sdpa (target <= 1.05)"
    ]
    assert _core.slower({"rows": [row]}) == ["dot (bool, float32, fwd): 2.00x sdpa"]
    smoke = bench.render({**result, "quick": True, "rows": [row]})
    assert "| met |" not in smoke and "slower than their PyTorch baseline (> 1.05x): 1" in smoke
    assert [_core._ms(t) for t in (None, 0.0015, 0.25)] == ["-", "1.500", "250.0"]


def test_run_refuses_unknown_cases():
    with pytest.raises(
        ValueError, match=r"Expected names among \[.*\] for cpu, but got \['nope'\]"
    ):
        bench.run(cases=["nope"], memory=False, threads=1)


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


def test_additive_memory_note_gives_the_size_of_the_run_it_describes():
    """Issue 21.8: the quick run's note said '0.0 GiB'; it says the size at its shape."""
    quick = _cases.additive_memory(matrix.ADDITIVE_MEMORY_QUICK, device=CPU).notes[0]
    s = matrix.ADDITIVE_MEMORY_QUICK
    mib = s["B"] * s["n"] * s["m"] * s["h"] * 4 / 2**20
    assert f"would take {mib:.0f} MiB here" in quick and "0.0 GiB" not in quick
    full = matrix.ADDITIVE_MEMORY
    gib = full["B"] * full["n"] * full["m"] * full["h"] * 4 / 2**30
    assert f"would take {gib:.1f} GiB here" in _cases.additive_memory(full, device=CPU).notes[0]


def test_hf_row_pads_on_the_left_to_the_bench_lengths():
    """The Llama row's batch: example b keeps its last valid_lens[b] tokens, pads the rest
    with id 0, and its attention mask says so."""
    ids, attention_mask = _hf.padded_batch(4, 9, 50, CPU)
    valid_lens = _core.lengths(4, 9)
    for b, length in enumerate(valid_lens.tolist()):
        expected = [0] * (9 - length) + [1] * length
        assert attention_mask[b].tolist() == expected
        assert (ids[b, : 9 - length] == 0).all() and (ids[b, 9 - length :] >= 3).all()


def test_hf_row_without_transformers_is_a_note_not_a_verdict(monkeypatch):
    """Without the [hf] extra the row is measured as nothing: a note, no verdict, no miss."""
    monkeypatch.setattr(_hf, "available", lambda: False)
    (case,) = [c for c in matrix.extras("cpu", quick=True) if c.name == "hf_llama"]
    row = _core.measure(case, CPU, threads=1, min_time=0.01, judge=True)
    assert row["median_s"] == {} and _hf.MISSING in row["notes"]
    assert [t["met"] for t in row["targets"]] == [None, None]
    assert bench.missed({"rows": [row]}) == []


def test_hf_row_matches_sdpa_and_both_train():
    """With transformers, the row's two models are the same model: equal logits, and a
    gradient for every parameter of each."""
    pytest.importorskip("transformers")
    built = _hf.llama(_hf.LLAMA_QUICK, device=CPU)
    assert set(built.forwards) == {"attnscore", "sdpa"} and built.same == ("sdpa",)
    ours, theirs = built.forwards["attnscore"](), built.forwards["sdpa"]()
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    for name, forward in built.forwards.items():
        params = built.grad_inputs[name]
        grads = torch.autograd.grad(forward().sum(), params)
        assert len(grads) == len(params) and all(g.isfinite().all() for g in grads)


def test_load_readings_where_the_system_reports_none(monkeypatch):
    """No load average (Windows) reads as None; no affinity (macOS) falls back to the CPUs."""
    import os

    from attnscore.bench import load

    def unavailable():
        raise OSError("no load average here")

    monkeypatch.setattr(os, "getloadavg", unavailable)
    assert load.load_average() is None
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    assert load.usable_cores() == (os.cpu_count() or 1)
    watch = load.LoadWatch()
    assert not watch.see(load.load_average()) and watch.as_dict()["readings"] == 0
