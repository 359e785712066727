"""The threshold table (attnscore._thresholds) and its public door, kernels.thresholds():
the documented table is the rendered one, every entry says what justifies it, the modules
bind what the table holds, overrides are checked, reach every binding and are undone."""

from __future__ import annotations

import importlib
import json
import re
import threading
import types
from pathlib import Path

import pytest
import torch

from attnscore import _thresholds
from attnscore import kernels as K

ROOT = Path(__file__).resolve().parents[2]


def _bindings(entry):
    for where in entry.bound_as:
        module, attribute = where.split(":")
        yield importlib.import_module(module), attribute


def _plain_modules_only(entry):
    """Bindings in modules that import without triton (the CUDA backend's may not)."""
    return [(m, a) for m, a in _bindings(entry) if m.__name__ != "attnscore.kernels._cuda"]


def test_architecture_doc_shows_the_rendered_table():
    text = (ROOT / "docs" / "architecture.md").read_text()
    found = re.search(r"<!-- thresholds: begin -->\n(.*?)<!-- thresholds: end -->", text, re.S)
    assert found, "docs/architecture.md lost its thresholds table markers"
    assert found.group(1) == _thresholds.markdown()


def test_every_entry_is_justified_or_says_why_not():
    names = [t.name for t in K.THRESHOLDS]
    assert len(names) == len(set(names))
    for t in K.THRESHOLDS:
        assert t.decides and t.why and t.bound_as, t.name
        if t.justified_by is None:
            assert t.note, f"{t.name}: no bench row and no note saying what it rests on"
        assert "/tmp/" not in t.note + (t.justified_by or "")


@pytest.mark.parametrize("entry", K.THRESHOLDS, ids=lambda t: t.name)
def test_the_modules_bind_the_table(entry):
    for module, attribute in _plain_modules_only(entry):
        assert getattr(module, attribute) == entry.value, f"{module.__name__}.{attribute}"


def test_the_cpu_backend_has_no_threshold_outside_the_table():
    """Every upper-case int constant of kernels/_cpu.py is a table binding, or geometry
    named in docs/architecture.md's Thresholds section."""
    from attnscore.kernels import _cpu

    bound = {
        where.split(":")[1]
        for t in K.THRESHOLDS
        for where in t.bound_as
        if where.startswith("attnscore.kernels._cpu:")
    }
    ints = {
        name
        for name, v in vars(_cpu).items()
        if re.fullmatch(r"_[A-Z][A-Z0-9_]*", name) and type(v) is int
    }
    assert ints - bound == {"_FA_ROWS"}


def test_an_override_reaches_every_binding_and_is_undone():
    entry = next(t for t in K.THRESHOLDS if t.name == "look_numel")
    places = _plain_modules_only(entry)
    assert len(places) == 3  # _checks, _engine, _sdpa
    with K.thresholds(look_numel=7, small_work=-1) as now:
        assert all(getattr(m, a) == 7 for m, a in places)
        assert now["look_numel"] == 7 and now["small_work"] == -1
        with K.thresholds(look_numel=9):  # blocks nest
            assert all(getattr(m, a) == 9 for m, a in places)
        assert all(getattr(m, a) == 7 for m, a in places)
    assert all(getattr(m, a) == entry.value for m, a in places)
    with pytest.raises(RuntimeError), K.thresholds(look_numel=3):
        raise RuntimeError("the body fails")
    assert all(getattr(m, a) == entry.value for m, a in places)


@pytest.fixture
def kernel_softmax_calls():
    """The sizes of the CPU backend's masked softmax calls made in the test, counted
    through a backend put in with use_backend (the C kernel itself runs them)."""
    from attnscore.kernels import _cpu
    from attnscore.kernels._dispatch import FUNCTIONS

    if _cpu.load_library() is None:
        pytest.skip("C kernels unavailable")
    calls: list[int] = []
    counting = types.ModuleType("counting_cpu")
    for name in FUNCTIONS:
        setattr(counting, name, getattr(_cpu, name))

    def counted(x, lengths):
        calls.append(x.numel())
        return _cpu.masked_softmax(x, lengths)

    counting.masked_softmax = counted
    with K.use_backend("cpu", counting):
        yield calls


def test_an_override_steers_the_implementation(kernel_softmax_calls):
    """softmax_inference: a softmax without a mask runs the CPU backend's masked softmax
    (counted through a backend put in with use_backend) from that size on, torch.softmax
    below it and on a CPU a per-CPU value does not name; the same result either way
    (float64 reference)."""
    from attnscore import masked_softmax
    from attnscore.kernels._measured import cpu_name

    x = torch.randn(4, 6, 33, generator=torch.Generator().manual_seed(3))
    expected = torch.softmax(x.double(), -1)
    with K.thresholds(softmax_inference=1 << 60):
        below = masked_softmax(x)
    assert kernel_softmax_calls == []
    with K.thresholds(softmax_inference=x.numel()):
        at = masked_softmax(x)
    assert kernel_softmax_calls == [x.numel()]
    # measured on other CPUs only: PyTorch's call here, at any size
    with K.thresholds(softmax_inference={"a CPU this is not": 1}):
        elsewhere = masked_softmax(x)
    assert kernel_softmax_calls == [x.numel()]
    here = cpu_name()
    if here is not None:  # a CPU the shipped table names: its entry decides
        with K.thresholds(softmax_inference={here: x.numel()}):
            masked_softmax(x)
        assert kernel_softmax_calls == [x.numel()] * 2
    for y in (below, at, elsewhere):
        torch.testing.assert_close(y.double(), expected, atol=1e-6, rtol=1e-5)


def test_this_machines_tune_file_decides_the_softmax_without_a_mask(tmp_path, kernel_softmax_calls):
    """A tune file of this machine with softmax buckets decides where the shipped values do
    (from the smallest size at which the kernel won every larger bucket; nowhere where it
    lost the largest); a file of another machine is ignored; a thresholds block set to an
    int decides over the file. Counted through a backend put in with use_backend."""
    from attnscore import masked_softmax
    from attnscore.kernels import _measured

    calls = kernel_softmax_calls

    def tune_file(name, winners, key=None):
        buckets = {
            _measured.softmax_bucket(torch.float32, False, e): {
                "c_softmax": 1.0, "torch": 1.0, "winner": w
            }
            for e, w in zip(_measured.SOFTMAX_SIZES, winners, strict=True)
        }  # fmt: skip
        path = tmp_path / name
        path.write_text(json.dumps({"key": key or _measured.machine(), "buckets": buckets}))
        return path

    g = torch.Generator().manual_seed(0)
    small, large = (torch.randn(s, 256, 256, generator=g) for s in (2, 8))  # 2^17, 2^19
    expected = [torch.softmax(x.double(), -1) for x in (small, large)]
    lost_first = tune_file("mine.json", ["torch", "c_softmax", "c_softmax", "c_softmax"])
    lost_last = tune_file("never.json", ["c_softmax", "c_softmax", "c_softmax", "torch"])
    other = tune_file("other.json", ["c_softmax"] * 4, {**_measured.machine(), "cpu": "another"})
    with K.thresholds(softmax_inference={"a CPU this is not": 0}):
        for path, ran in ((lost_first, [1 << 19]), (lost_last, []), (other, [])):
            calls.clear()
            with K.tuned(path):
                out = [masked_softmax(x) for x in (small, large)]
            assert calls == ran, path.name
            for y, want in zip(out, expected, strict=True):
                torch.testing.assert_close(y.double(), want, atol=1e-6, rtol=1e-5)
        calls.clear()
        with K.tuned(lost_last), K.thresholds(softmax_inference=1 << 17):
            masked_softmax(small)
        assert calls == [1 << 17]


@pytest.mark.parametrize(
    ("values", "error", "words"),
    [
        ({"no_such_threshold": 1}, TypeError, "`no_such_threshold`"),
        ({"small_work": 1.5}, TypeError, "`small_work` to be an int, but got float"),
        ({"small_work": True}, TypeError, "`small_work` to be an int, but got bool"),
        ({"min_work_per_thread": 0}, ValueError, "`min_work_per_thread` >= 1, but got 0"),
        ({"softmax_training_dtypes": {"float32"}}, TypeError, "set of torch dtypes"),
        ({"varlen_min_keys": {torch.float32: 8}}, TypeError, "(dtype, training) -> int"),
    ],
)
def test_bad_overrides_are_refused_before_anything_changes(values, error, words):
    from attnscore.kernels import _cpu

    before = _cpu._CALL_WORK
    with pytest.raises(error, match=re.escape(words)), K.thresholds(**{"call_work": 5, **values}):
        pass
    assert before == _cpu._CALL_WORK


def test_another_threads_block_waits_for_this_one():
    from attnscore.kernels import _cpu

    seen = []
    entered = threading.Event()

    def other():
        entered.set()
        with K.thresholds(small_work=2):
            seen.append(_cpu._SMALL_WORK)

    with K.thresholds(small_work=1):
        thread = threading.Thread(target=other)
        thread.start()
        entered.wait()
        thread.join(0.2)  # blocked on this block's lock
        assert thread.is_alive() and _cpu._SMALL_WORK == 1
    thread.join()
    default = next(t.value for t in K.THRESHOLDS if t.name == "small_work")
    assert seen == [2] and default == _cpu._SMALL_WORK
