"""What every bench cell shares: the case description, the timing loop, peak memory, targets
and the table.

A :class:`Case` says what to build (a zero-argument ``build`` returning the forward callables
of each implementation), whether a step includes the backward pass, and the targets.
:func:`measure` builds it, times the implementations **interleaved** (rounds of
``torch.utils.benchmark`` timings, one implementation after the other, median over rounds,
so that a drift of the machine's speed hits all of them alike), reads each one's peak memory
during one step, and judges the targets.

Peak memory is the memory a call needs: its inputs and parameters (the tensors in
``grad_inputs``) plus the most that one step holds allocated on top of them, read on CUDA
from ``torch.cuda.max_memory_allocated`` and on the CPU from the running total of the
allocations and frees that ``torch.profiler`` records during the step.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

Shapes = dict[str, int]
Forward = Callable[[], Tensor]

ROUNDS = (4, 10)
"""Interleaved timing rounds per implementation, fewest and most (the median of the rounds
is reported): as many as fit the time given, since a long step's time varies less."""


@dataclass(frozen=True)
class Target:
    """One target of a cell.

    ``kind``: ``"time"`` (attnscore's median / ``vs``'s median <= ``bound``), ``"peak"``
    (attnscore's peak memory / ``vs``'s <= ``bound``), ``"rss_mib"`` (attnscore's peak RSS
    <= ``bound`` MiB), ``"us"`` (attnscore's median <= ``bound`` microseconds).
    """

    kind: str
    bound: float
    vs: str | None = None


@dataclass
class Built:
    """The implementations of one case, ready to run.

    ``forwards``: name -> forward callable (returns the output). ``grad_inputs``: name ->
    the tensors a fwd+bwd step differentiates with respect to. ``same``: the names whose
    output equals attnscore's (the others, such as an unmasked softmax, only set a pace).
    """

    forwards: dict[str, Forward]
    grad_inputs: Mapping[str, Sequence[Tensor]] = field(default_factory=dict)
    same: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)


@dataclass
class Case:
    """One cell of the table: its row, mask, shapes and dtype, how to build it, its targets."""

    name: str
    shapes: Shapes
    dtype: str
    build: Callable[[], Built]
    targets: list[Target] = field(default_factory=list)
    backward: bool = False
    timed: bool = True
    mask: str = ""


def lengths(
    B: int, m: int, device: torch.device | str = "cpu", seed: int = 0, low: int = 1
) -> Tensor:
    """(B,) int64 valid lengths, uniform in [low, m], from a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, m + 1, (B,), generator=gen).to(device)


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""The CPU flags a run records: the vector and matrix units PyTorch's kernels may use."""


def processor(cpuinfo: str = "/proc/cpuinfo") -> dict[str, Any]:
    """The CPU's model name and :data:`ISA_FLAGS` (from ``cpuinfo``; without it the platform's
    name, no flags), and the instruction set torch's CPU kernels run (``capability``)."""
    model, flags = platform.processor() or platform.machine() or "CPU", []
    with contextlib.suppress(OSError), open(cpuinfo) as f:
        info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in f)}
        model, flags = info.get("model name", model), info.get("flags", "").split()
    capability = torch.backends.cpu.get_cpu_capability()
    return {"model": model, "flags": [x for x in ISA_FLAGS if x in flags], "capability": capability}


def describe(device: torch.device) -> str:
    """One line naming the GPU, or the CPU with its ISA flags and torch's capability; the
    torch and CUDA versions."""
    cpu, cuda = processor(), torch.version.cuda
    name = f"{cpu['model']} ({' '.join(cpu['flags']) or 'no avx2'}; ATen {cpu['capability']})"
    if device.type == "cuda":
        name = str(torch.cuda.get_device_name(device))
    return f"{name}, torch {torch.__version__}" + (f", CUDA {cuda}" if cuda else "")


def make_step(
    fwd: Forward, grad_inputs: Sequence[Tensor] | None, backward: bool
) -> Callable[[], Any]:
    """One timed step: the forward under ``no_grad``, or forward + gradients of the sum."""
    if backward:
        inputs = list(grad_inputs or ())

        def fwd_bwd() -> Any:
            return torch.autograd.grad(fwd().sum(), inputs)

        return fwd_bwd

    def no_grad() -> Any:
        with torch.no_grad():
            return fwd()

    return no_grad


def resident_mib(tensors: Sequence[Tensor]) -> float:
    """MiB held by ``tensors`` (each storage counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values()) / 2**20


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the process's file descriptor 2: the profiler's C++ side writes two log
    lines per use there (the step has run before, so its own warnings were seen)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def peak_mib(step: Callable[[], Any], device: torch.device) -> float:
    """Run ``step`` once; the peak memory it allocated above what was allocated before."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = prof.profiler.kineto_results.events()
    changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    current = peak = 0
    for _, nbytes in changes:
        current += nbytes
        peak = max(peak, current)
    return peak / 2**20


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:160]}"


def _time(
    steps: dict[str, Callable[[], Any]], threads: int, min_time: float, device: torch.device
) -> dict[str, list[float]]:
    """Seconds per step of each implementation in each of several interleaved rounds (see
    :data:`ROUNDS`; the order alternates between rounds)."""
    from torch.utils import benchmark

    timers, once = {}, {}
    for name, step in steps.items():
        timers[name] = benchmark.Timer("step()", globals={"step": step}, num_threads=threads)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        once[name] = max(time.perf_counter() - start, 1e-7)
    fewest, most = ROUNDS
    rounds = max(fewest, min(most, int(min_time / max(once.values()))))
    rounds += rounds % 2  # even: each implementation goes first equally often
    per_round = min_time / rounds
    numbers = {name: max(1, int(per_round / t)) for name, t in once.items()}
    samples: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            samples[name].append(timers[name].timeit(numbers[name]).median)
    return samples


def measure(
    case: Case,
    device: torch.device,
    *,
    threads: int,
    min_time: float,
    judge: bool,
    memory: bool = True,
    rss: dict[str, float | None] | None = None,
) -> dict[str, Any]:
    """Build ``case``, time its implementations side by side, read their peak memory, and
    (when ``judge``) check its targets.

    An implementation that raises (out of memory, a compile failure) is left out of the
    cell with a note; a target whose baseline is missing is not judged (``met`` None), one
    whose attnscore value is missing is a miss.
    """
    built = case.build()
    steps: dict[str, Callable[[], Any]] = {}
    peaks: dict[str, float] = {}
    notes = list(built.notes)
    for name, fwd in built.forwards.items():
        step = make_step(fwd, built.grad_inputs.get(name), case.backward)
        try:
            step()  # warm-up (compiles, for compiled rows)
            if memory:
                resident = resident_mib(built.grad_inputs.get(name, ()))
                peaks[name] = resident + peak_mib(step, device)
        except Exception as err:  # a cell must survive one failing implementation
            notes.append(f"{name} not measured: {_first_line(err)}")
            continue
        steps[name] = step
    samples = _time(steps, threads, min_time, device) if case.timed and steps else {}
    times = {name: statistics.median(values) for name, values in samples.items()}
    del built, steps
    rss = rss or {}
    checks = [_check(t, samples, peaks, rss, judge) for t in case.targets]
    return {
        "case": case.name,
        "mask": case.mask,
        "shapes": case.shapes,
        "dtype": case.dtype,
        "step": "fwd+bwd" if case.backward else "fwd",
        "median_s": times,
        "peak_mib": peaks,
        "peak_rss_mib": rss,
        "targets": checks,
        "notes": notes,
    }


def _check(
    t: Target,
    samples: dict[str, list[float]],
    peaks: dict[str, float],
    rss: dict[str, float | None],
    judge: bool,
) -> dict[str, Any]:
    value: float | None = None
    judged = judge
    if t.kind == "time":
        ours, base = samples.get("attnscore"), samples.get(t.vs or "")
        judged = judged and bool(base)  # no baseline, no verdict
        if ours and base:
            # The median of the rounds' ratios: each round times both side by side, so a
            # drift of the machine's speed cancels.
            value = statistics.median(a / b for a, b in zip(ours, base, strict=True))
    elif t.kind == "peak":
        ours_mib, base_mib = peaks.get("attnscore"), peaks.get(t.vs or "")
        judged = judged and bool(base_mib)
        if ours_mib is not None and base_mib:
            # Below 1 MiB both ways the ratio says nothing (allocator granularity).
            value = max(ours_mib, 1.0) / max(base_mib, 1.0)
    elif t.kind == "rss_mib":
        value = rss.get("attnscore")
    elif t.kind == "us" and "attnscore" in samples:
        value = statistics.median(samples["attnscore"]) * 1e6
    if (t.kind == "peak" and not peaks) or (t.kind == "rss_mib" and not rss):
        judged = False  # memory not measured (--no-memory): no verdict
    met = (value is not None and value <= t.bound) if judged else None
    return {"kind": t.kind, "vs": t.vs, "value": value, "bound": t.bound, "met": met}


# ------------------------------------------------------------------ the table
def _ms(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t * 1e3:.3f}" if t < 0.01 else f"{t * 1e3:.1f}"


# A target kind: how the table shows its measured value and its bound.
_FORMATS = {
    "time": ("{v:.2f}x {vs}", "<= {b:.2f}"),
    "peak": ("mem {v:.2f}x {vs}", "mem <= {b:.2f}"),
    "us": ("{v:.1f} us", "<= {b:.0f} us"),
    "rss_mib": ("peak RSS {v:.0f} MiB", "<= {b:.0f} MiB"),
}


_VERDICTS = {True: "yes", False: "**NO**", None: "n/a"}


def ratio_text(c: dict[str, Any]) -> str:
    """A target's measured value, as the table shows it."""
    if c["value"] is None:
        return "n/a"
    return _FORMATS[c["kind"]][0].format(v=c["value"], vs=c.get("vs"))


def target_text(c: dict[str, Any]) -> str:
    """A target's bound, as the table shows it."""
    return _FORMATS[c["kind"]][1].format(b=c["bound"])


def render_rows(rows: list[dict[str, Any]], *, verdicts: bool) -> list[str]:
    """Markdown lines of the table, one line per cell; ``verdicts=False`` (smoke runs) gives
    the ratios without targets."""
    # The ratio is the median of the rounds' ratios (each round times both sides back to
    # back), not the quotient of the medians beside it: on a machine whose speed drifts the
    # two differ, and the header says which one the verdicts use.
    head = ["row", "mask", "dtype", "step", "shapes", "median ms per side", "peak MiB"]
    head += ["ratio (median of per-round ratios)"]
    head += ["targets", "met"] if verdicts else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        peaks = {**row["peak_mib"], **{k: v for k, v in row["peak_rss_mib"].items() if v}}
        checks = row["targets"]
        cells = [
            row["case"],
            row.get("mask", "") or "-",
            row["dtype"],
            row["step"],
            " ".join(f"{k}={v}" for k, v in row["shapes"].items()),
            ", ".join(f"{k} {_ms(t)}" for k, t in row["median_s"].items()) or "-",
            ", ".join(f"{k} {p:.0f}" for k, p in peaks.items()) or "-",
            "; ".join(ratio_text(c) for c in checks) or "-",
        ]
        if verdicts:
            cells += [
                "; ".join(target_text(c) for c in checks) or "-",
                "; ".join(_VERDICTS[c["met"]] for c in checks) or "-",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _worst(members: list[dict[str, Any]], kind: str) -> str:
    """The largest ratio of ``kind`` among the cells, with its cell; "-" if none."""
    found = [
        (c["value"], r)
        for r in members
        for c in r["targets"]
        if c["kind"] == kind and c["value"] is not None
    ]
    if not found:
        return "-"
    value, r = max(found, key=lambda pair: pair[0])
    return f"{value:.2f} ({r.get('mask') or '-'}, {r['dtype']})"


def render_summary(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines of a summary: per row and step, how many targets were met and the
    worst time and memory ratios against the PyTorch baseline (with their cells)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["case"], row["step"]), []).append(row)
    head = "| row | step | cells | targets met | worst time ratio | worst memory ratio |"
    lines = [head, "|---|---|---|---|---|---|"]
    for (case, step), members in groups.items():
        judged = [c for r in members for c in r["targets"] if c["met"] is not None]
        met = sum(1 for c in judged if c["met"])
        lines.append(
            f"| {case} | {step} | {len(members)} | {met}/{len(judged)} | "
            f"{_worst(members, 'time')} | {_worst(members, 'peak')} |"
        )
    return lines


def _label(row: dict[str, Any], c: dict[str, Any]) -> str:
    return (
        f"{row['case']} ({row.get('mask') or '-'}, {row['dtype']}, {row['step']}): {ratio_text(c)}"
    )


def missed(result: dict[str, Any]) -> list[str]:
    """``"row (mask, dtype, step): ratio"`` for each target judged and missed."""
    return [
        f"{_label(row, c)} (target {target_text(c)})"
        for row in result["rows"]
        for c in row["targets"]
        if c["met"] is False
    ]


def slower(result: dict[str, Any]) -> list[str]:
    """Cells slower than their PyTorch baseline (time ratio above 1.05), judged or not: what
    a smoke run reports."""
    return [
        _label(row, c)
        for row in result["rows"]
        for c in row["targets"]
        if c["kind"] == "time" and c["value"] is not None and c["value"] > 1.05
    ]
