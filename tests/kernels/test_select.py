"""The one selection point of dot-product attention (attnscore.kernels._select): every
implementation that says it takes a call gives the float64 row-by-row reference's result,
and says why where it declines; ``use`` restricts and orders; ``explain`` and the DEBUG log
say what ran."""

from __future__ import annotations

import json
import logging
import threading

import pytest
import torch
from test_dot_dispatch import MASKS, TOL, _inputs, reference

import attnscore
from attnscore import kernels as K
from attnscore.kernels import _measured, _select
from attnscore.masking import build_mask

CPU = _select.PRIORITY["cpu"]
# Sizes at which every CPU implementation gets its chance: no threshold in the way.
EVERY_SIZE = dict(
    small_work=1 << 40,
    by_lengths_work=0,
    call_work=0,
    threads_work=1 << 60,
    unpadded_work=0,
    unpadded_inference=0,
)


def _call(mask_kind, dtype, grad, *, batch=(3, 2), n=7, m=9, seed=0):
    q, k, v, g = _inputs(batch, n, m, d=8, dv=8, dtype=dtype, seed=seed)
    mask = build_mask(torch.Size(batch), n, m, q.device, **MASKS[mask_kind](batch, n, m, g))
    return [t.requires_grad_(grad) for t in (q, k, v)], mask


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "mask_kind", ["none", "lengths (B,)", "lengths per head", "causal", "causal + lengths", "bool"]
)
@pytest.mark.parametrize("name", CPU)
def test_each_implementation_is_right_where_it_says_it_runs(
    name, mask_kind, dtype, grad, thresholds
):
    """Restricted to one implementation: either it runs the call, with the reference's
    output and gradients, or the error names it with its reason."""
    thresholds(**EVERY_SIZE)
    (q, k, v), mask = _call(mask_kind, dtype, grad, n=9)  # (n >= 8: every unpadded lane too)
    with K.use(name):
        try:
            seen = K.explain(K.dot_product_attention, q, k, v, mask, scale=0.3)
        except K.NoImplementationError as error:
            assert f"{name}: " in str(error)
            return
        out = K.dot_product_attention(q, k, v, mask, scale=0.3)
    assert seen.chosen == [name]
    theirs = [t.detach().double().requires_grad_(grad) for t in (q, k, v)]
    expected = reference(*theirs, mask, 0.3)
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), expected.detach(), atol=tol, rtol=tol)
    if grad:
        upstream = torch.randn(expected.shape, dtype=torch.float64)
        out.backward(upstream.to(dtype))
        expected.backward(upstream)
        for a, b in zip((q, k, v), theirs, strict=True):
            torch.testing.assert_close(a.grad.double(), b.grad, atol=8 * tol, rtol=8 * tol)


def test_every_mask_kind_has_some_implementation_and_plain_takes_all(thresholds):
    """Without ``use`` every call runs; ``plain`` alone takes every call."""
    for mask_kind in MASKS:
        (q, k, v), mask = _call(mask_kind, torch.float32, False)
        assert len(K.explain(K.dot_product_attention, q, k, v, mask, scale=0.3).chosen) == 1
        with K.use("plain"):
            out = K.dot_product_attention(q, k, v, mask, scale=0.3)
        torch.testing.assert_close(out.double(), reference(q, k, v, mask, 0.3), atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    ("mask_kind", "kind"),
    [("none", "none"), ("lengths (B,)", "lengths"), ("causal", "causal"), ("bool", "boolean")],
)
def test_no_implementation_is_offered_a_mask_it_does_not_take(mask_kind, kind, thresholds):
    """Restricted to one implementation, or explained (both offer every candidate): an
    implementation that does not take a call's kind of mask declines it by that kind, and the
    call's output is the reference's (a boolean mask once reached the kernel for unpadded
    calls, which ran it without its mask)."""
    thresholds(**{**EVERY_SIZE, "small_work": 0})
    (q, k, v), mask = _call(mask_kind, torch.float32, False, n=9)
    expected = reference(q, k, v, mask, 0.3)
    for impl in _select.implementations("cpu"):
        with K.use(impl.name):
            try:
                out = K.dot_product_attention(q, k, v, mask, scale=0.3)
            except K.NoImplementationError as error:
                if kind not in impl.kinds:
                    assert f"{impl.name}: a {kind} mask (it takes " in str(error)
                continue
        assert kind in impl.kinds
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=0)
    with K.explaining() as seen:
        out = K.dot_product_attention(q, k, v, mask, scale=0.3)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=0)
    assert kind in _select._load(seen.chosen[0]).kinds


def test_explain_says_why_each_one_ahead_declined():
    """A float64 training call by lengths: the C kernels decline by gradients and dtype;
    every reason is in the report, in priority order, before the chosen one."""
    (q, k, v), mask = _call("lengths (B,)", torch.float64, True)
    seen = K.explain(K.dot_product_attention, q, k, v, mask, scale=0.3)
    (choice,) = seen.choices
    declined = dict(choice.declined)
    assert list(declined) == list(CPU[: CPU.index(choice.chosen)])
    assert "gradients" in declined["c_small"] and "torch.float64" in declined["c_by_lengths"]
    text = str(seen)
    assert text.startswith(f"attention on cpu (checked): {choice.chosen}\n  call: mask lengths")
    assert [n for n, _ in choice.rows] == list(CPU)
    rows = dict(choice.rows)
    assert all(rows[n] == f"declined: {why}" for n, why in choice.declined)
    assert rows[choice.chosen] == "chosen" and rows["plain"].startswith("not asked")
    assert all(f". {n} " in text and f"declined: {why}" in text for n, why in choice.declined)


def test_explain_is_a_table_of_every_candidate_with_the_call():
    """One row per candidate in priority order: excluded by ``use``, chosen, not asked;
    the call's mask kind and sizes above them."""
    q = torch.randn(2, 8, 256, 64)
    with K.use("sdpa", "plain"):
        (choice,) = attnscore.explain(attnscore.DotProductAttention().eval(), q, q, q).choices
    assert choice.call == "mask none, B·H 16, n 256, m 256, d 64, float32, inference"
    assert dict(choice.rows) == {
        **{n: "excluded by attnscore.kernels.use" for n in CPU[:4]},
        "sdpa": "chosen",
        "plain": "not asked (sdpa took the call first)",
    }
    assert str(choice).splitlines()[2] == "  1. c_small        excluded by attnscore.kernels.use"


DENSE = torch.randn(2, 8, 256, 64)  # 2^26 multiply-adds, no mask: both take it
NOT_MEASURED = {"unpadded_work": {}, "unpadded_inference": {}}  # shipped for no CPU


def _dense(causal=False):
    """The implementation of a dense inference call, and what its row says."""
    (choice,) = K.explain(
        attnscore.dot_product_attention, DENSE, DENSE, DENSE, causal=causal
    ).choices
    return choice.chosen, dict(choice.rows)["c_by_lengths"]


def _tune_file(path, key, winner):
    buckets = {
        _measured.bucket(kind, torch.float32, False, 1 << 26): {
            "c_by_lengths": 1.0, "sdpa": 2.0, "winner": winner
        }
        for kind in ("none", "causal")
    }  # fmt: skip
    path.write_text(json.dumps({"key": key, "buckets": buckets}))
    return path


def test_dense_calls_follow_this_machines_measurements(thresholds, tmp_path):
    """No mask or causal alone (the kernel and SDPA both take them): the thresholds shipped
    for this CPU; a CPU none was measured on gets SDPA; this machine's tune file decides
    over both; a file of another machine is ignored, a corrupted one with a warning."""
    from attnscore.kernels._measured import cpu_name, machine

    shipped = {t.name: t.value for t in K.THRESHOLDS}
    assert all(shipped[n]["Intel Xeon with AMX (amx_bf16)"] >= 1 << 62 for n in NOT_MEASURED)
    if cpu_name() is not None:
        assert _dense() == ("c_by_lengths", f"chosen (thresholds shipped for {cpu_name()})")
        with K.thresholds(**{n: {cpu_name(): 1 << 62} for n in NOT_MEASURED}):  # as the Xeon's
            reason = f"declined: SDPA faster here (thresholds shipped for {cpu_name()})"
            assert _dense() == _dense(causal=True) == ("sdpa", reason)
    thresholds(**NOT_MEASURED)
    not_measured = "declined: not measured on this machine: PyTorch's call"
    assert _dense() == _dense(causal=True) == ("sdpa", not_measured)
    mine = _tune_file(tmp_path / "mine.json", machine(), "c_by_lengths")
    with K.tuned(mine):
        chosen, row = _dense(causal=True)
        assert chosen == "c_by_lengths" and f"tune file {mine} (causal float32 inference" in row
    with K.tuned(_tune_file(tmp_path / "sdpa.json", machine(), "sdpa")):
        chosen, row = _dense()
        assert chosen == "sdpa" and row.startswith("declined: SDPA faster here (tune file")
    other = _tune_file(tmp_path / "other.json", {**machine(), "cpu": "another"}, "c_by_lengths")
    with K.tuned(other):
        assert _dense() == ("sdpa", not_measured)
    broken = tmp_path / "broken.json"
    broken.write_text('{"key": ')
    with K.tuned(broken):
        with pytest.warns(UserWarning, match="ignored the tune file") as warned:
            assert _dense() == _dense() == ("sdpa", not_measured)
        assert len(warned) == 1
    thresholds(unpadded_work=0, unpadded_inference=0)  # a thresholds block decides over all
    with K.tuned(_tune_file(tmp_path / "sdpa.json", machine(), "sdpa")):
        assert _dense()[0] == "c_by_lengths"


def test_the_first_call_benchmark_measures_a_bucket_once(thresholds):
    """``kernels.benchmark = True``: the first call of a bucket times both on its inputs,
    keeps the winner for the process and says so."""
    thresholds(**NOT_MEASURED)
    K.benchmark = True
    try:
        chosen, row = _dense()
        again = _dense()
    finally:
        K.benchmark = False
    assert "first-call benchmark of none float32 inference 2^26: c_by_lengths " in row
    assert again == (chosen, row)


def test_use_restricts_orders_and_fails_with_every_reason(thresholds):
    thresholds(**EVERY_SIZE)
    (q, k, v), mask = _call("lengths (B, n)", torch.float32, False)

    def chosen():
        return K.explain(K.dot_product_attention, q, k, v, mask, scale=0.3).chosen

    assert chosen() == ["c_small"]
    with K.use("sdpa", "c_by_lengths"):  # the device's order
        assert chosen() == ["c_by_lengths"]
        with K.use("sdpa", "c_by_lengths", ordered=True):  # the given order; nests
            assert chosen() == ["sdpa"]
        assert chosen() == ["c_by_lengths"]
    q.requires_grad_(True)
    with K.use("c_small"), pytest.raises(K.NoImplementationError, match="c_small: gradients"):
        K.dot_product_attention(q, k, v, mask, scale=0.3)
    expected = r"Expected `names` among \[.*'sdpa'.*\], but got \['flash'\]"
    with pytest.raises(ValueError, match=expected), K.use("flash"):
        pass


def test_use_is_per_thread():
    """One thread's restriction does not reach another's calls (as torch.no_grad)."""
    (q, k, v), mask = _call("lengths (B,)", torch.float32, False)
    inside, outside = threading.Event(), threading.Event()
    seen = {}

    def restricted():
        with K.use("plain"):
            inside.set()
            outside.wait(10)
            seen["thread"] = K.explain(K.dot_product_attention, q, k, v, mask, scale=0.3).chosen

    worker = threading.Thread(target=restricted)
    worker.start()
    inside.wait(10)
    seen["main"] = K.explain(K.dot_product_attention, q, k, v, mask, scale=0.3).chosen
    outside.set()
    worker.join()
    assert seen == {"thread": ["plain"], "main": ["c_small"]}


def test_modules_lanes_and_functions_are_explained_and_logged(caplog):
    """The fast lanes record their choice too (with their route), and every choice is
    logged at DEBUG under the ``attnscore`` logger."""
    q, k, v = (torch.randn(2, 5, 8) for _ in range(3))
    lens = torch.tensor([2, 5])
    module = attnscore.DotProductAttention().eval()
    with caplog.at_level(logging.DEBUG, logger="attnscore"):
        small = attnscore.explain(module, q, k, v, lens)
        unpadded = attnscore.explain(module, q, k, v, causal=True)
    assert [(c.chosen, c.route) for c in small.choices] == [("c_small", "small lane")]
    assert [(c.chosen, c.route) for c in unpadded.choices] == [("c_small", "unpadded lane")]
    logged = [r.getMessage() for r in caplog.records if r.name == "attnscore"]
    assert logged[0] == "attention on cpu (small lane): c_small"
    assert logged[1] == "attention on cpu (unpadded lane): c_small"
    with K.use("sdpa"):  # the small lane stands aside: the checked path obeys the restriction
        assert attnscore.explain(module, q, k, v, lens).chosen == ["sdpa"]
    additive = attnscore.explain(attnscore.AdditiveAttention(num_hiddens=4), q, k, v, lens)
    assert [(c.chosen, c.route) for c in additive.choices] == [("pipeline", "checked")]
    assert str(attnscore.explain(attnscore.masked_softmax, q, lens)) == "no attention ran"


def test_a_users_fused_path_that_declines_is_explained_as_the_pipeline():
    """A registered scorer's own fused path that declines a call (returns None): the
    scorer's pipeline runs it, and explain says so, with the fused path's refusal; where it
    runs the call, explain records nothing (no dot-product implementation ran)."""
    from attnscore.registry import SCORERS

    taken = []

    def fused(q, k, v, mask, dropout_p, score_bias=None):
        if not taken:
            return None
        output = torch.zeros((*q.shape[:-1], v.shape[-1]))
        return output, lambda: torch.zeros((*q.shape[:-1], k.shape[-2]))

    attnscore.register_scorer(
        "declining_dot", lambda q, k: q @ k.mT, formula="qᵀk", source="a test",
        same_feature_size=True, fused=fused,
    )  # fmt: skip
    try:
        q, k, v = (torch.randn(2, 3, 4) for _ in range(3))
        module = attnscore.make_scorer("declining_dot", 4)
        explained = attnscore.explain(module, q, k, v, torch.tensor([1, 3]))
        assert [(c.chosen, c.route, c.declined) for c in explained.choices] == [
            ("pipeline", "checked", (("fused path", "it declined the call"),))
        ]
        taken.append(True)
        assert attnscore.explain(module, q, k, v, torch.tensor([1, 3])).choices == []
    finally:
        del SCORERS["declining_dot"]


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_nan_inputs_run_the_plain_formulation(grad: bool):
    """NaN where a query attends: every fused implementation declines (its tiles would
    carry NaN to other queries); the plain formulation carries it exactly. The call finds
    out from its first result (not finite), which it drops, in inference and in training."""
    (q, k, v), mask = _call("lengths (B,)", torch.float32, False)
    k = k.clone().requires_grad_(grad)
    with torch.no_grad():
        k[1, 0, 0, 0] = float("nan")  # example 1 attends every key
    with torch.set_grad_enabled(grad):
        seen = K.explain(K.dot_product_attention, q, k, v, mask, scale=0.3)
    *dropped, choice = seen.choices
    assert len(dropped) == 1
    assert choice.chosen == "plain"
    assert all("NaN" in why or "gradients" in why for _, why in choice.declined)


def test_architecture_doc_shows_the_priority_lists():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    found = re.search(
        r"<!-- implementations: begin -->\n(.*?)<!-- implementations: end -->", text, re.S
    )
    assert found, "docs/architecture.md lost its implementations table markers"
    assert found.group(1) == _select.markdown()


def test_the_call_trace_tool_sees_the_selection():
    """tools/call_trace.py (the decisions count of docs and notes) lists the attnscore
    functions of a training call after a first one: the choice kept for it (the plan) and
    the kernel by lengths among them."""
    from tool_modules import load_tool

    calls = load_tool("call_trace").trace(True, (2, 16, 16, 8))
    assert ("kernels/_select.py", "planned") in calls
    assert calls[0] == ("modules.py", "forward")
