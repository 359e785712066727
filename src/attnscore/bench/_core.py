"""What every bench row shares: the case description, the timing loop, targets, the table.

A :class:`Case` says what to build (a zero-argument ``build`` returning the forward
callables of each implementation), whether a step includes the backward pass, and the
targets. :func:`measure` builds it, times each implementation with
``torch.utils.benchmark`` (median of ``blocked_autorange``; on CUDA its timer
synchronizes), reads CUDA peak memory, and judges the targets.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

Shapes = dict[str, int]
Forward = Callable[[], Tensor]


@dataclass(frozen=True)
class Target:
    """One target of a row.

    ``kind``: ``"time"`` (attnscore's median / ``vs``'s median <= ``bound``), ``"peak"``
    (attnscore's CUDA peak / ``vs``'s <= ``bound``), ``"peak_mib"`` (attnscore's CUDA peak
    <= ``bound`` MiB), ``"rss_mib"`` (attnscore's peak RSS <= ``bound`` MiB).
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
    """One row of the table: a name, its shapes and dtype, how to build it, its targets."""

    name: str
    shapes: Shapes
    dtype: str
    build: Callable[[], Built]
    targets: list[Target] = field(default_factory=list)
    backward: bool = False
    timed: bool = True


def lengths(B: int, m: int, device: torch.device | str = "cpu", seed: int = 0) -> Tensor:
    """(B,) int64 valid lengths, uniform in [1, m], from a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, m + 1, (B,), generator=gen).to(device)


def key_mask(valid_lens: Tensor, m: int) -> Tensor:
    """(B, m) bool, True where key j < valid_lens[b] may be attended."""
    return torch.arange(m, device=valid_lens.device)[None, :] < valid_lens[:, None]


def sdpa_masked(q: Tensor, k: Tensor, v: Tensor, valid_lens: Tensor) -> Tensor:
    """SDPA with the equivalent boolean mask: (B, n, d) as a 4-D (B, 1, n, d) layout, or
    (B, H, n, d) as is; ``valid_lens`` (B,). Returns q's layout."""
    mask = key_mask(valid_lens, k.shape[-2])[:, None, None, :]
    if q.dim() == 3:
        return F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], attn_mask=mask)[
            :, 0
        ]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def device_name(device: torch.device) -> str:
    """The GPU's name for CUDA, the processor's for the CPU."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return platform.processor() or platform.machine() or "CPU"


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


def _peak_mib(step: Callable[[], Any], device: torch.device) -> float | None:
    """Run ``step`` once; on CUDA, its peak allocation above what was allocated before."""
    if device.type != "cuda":
        step()
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:160]}"


def measure(
    case: Case,
    device: torch.device,
    *,
    threads: int,
    min_time: float,
    judge: bool,
    rss: dict[str, float | None] | None = None,
) -> dict[str, Any]:
    """Build ``case``, time each implementation, and (when ``judge``) check its targets.

    An implementation that raises (out of memory, a compile failure) is left out of the
    row with a note; a target whose baseline is missing is not judged (``met`` None), one
    whose attnscore value is missing is a miss.
    """
    from torch.utils import benchmark

    built = case.build()
    times: dict[str, float] = {}
    peaks: dict[str, float] = {}
    notes = list(built.notes)
    for name, fwd in built.forwards.items():
        step = make_step(fwd, built.grad_inputs.get(name), case.backward)
        try:
            step()  # warm-up (compiles, for compiled rows)
            peak = _peak_mib(step, device)
            if case.timed:
                timer = benchmark.Timer("step()", globals={"step": step}, num_threads=threads)
                times[name] = timer.blocked_autorange(min_run_time=min_time).median
        except Exception as err:  # a row must survive one failing implementation
            notes.append(f"{name} not measured: {_first_line(err)}")
            continue
        if peak is not None:
            peaks[name] = peak
    del built
    rss = rss or {}
    checks = [_check(t, times, peaks, rss, judge) for t in case.targets]
    return {
        "case": case.name,
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
    times: dict[str, float],
    peaks: dict[str, float],
    rss: dict[str, float | None],
    judge: bool,
) -> dict[str, Any]:
    value: float | None = None
    judged = judge
    if t.kind in ("time", "peak"):
        table = times if t.kind == "time" else peaks
        ours, base = table.get("attnscore"), table.get(t.vs or "")
        judged = judged and bool(base)  # no baseline, no verdict
        if ours is not None and base:
            value = ours / base
    elif t.kind == "peak_mib":
        value = peaks.get("attnscore")
    elif t.kind == "rss_mib":
        value = rss.get("attnscore")
    if (t.kind in ("peak", "peak_mib") and not peaks) or (t.kind == "rss_mib" and not rss):
        judged = False  # memory not measured (not on CUDA, or --no-memory): no verdict
    met = (value is not None and value <= t.bound) if judged else None
    return {"kind": t.kind, "vs": t.vs, "value": value, "bound": t.bound, "met": met}


# ------------------------------------------------------------------ the table
def _ms(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t * 1e3:.3f}" if t < 0.01 else f"{t * 1e3:.1f}"


def _ratio(c: dict[str, Any]) -> str:
    v = c["value"]
    if c["kind"] == "time":
        return "n/a" if v is None else f"{v:.3f} vs {c['vs']}"
    if c["kind"] == "peak":
        return "n/a" if v is None else f"peak {v:.2f}x {c['vs']}'s"
    label = "peak" if c["kind"] == "peak_mib" else "peak RSS"
    return "n/a" if v is None else f"{label} {v:.0f} MiB"


def _target(c: dict[str, Any]) -> str:
    bound = c["bound"]
    if c["kind"] in ("peak_mib", "rss_mib"):
        return f"<= {bound:.0f} MiB"
    if c["kind"] == "peak":
        return f"<= {bound:.1f}x"
    faster = f" (>= {1 / bound:.1f}x faster)" if bound < 1 else ""
    return f"<= {bound:.2f}{faster}"


def _verdict(c: dict[str, Any]) -> str:
    return {True: "yes", False: "NO", None: "n/a"}[c["met"]]


def _impl_cell(values: dict[str, float], fmt: Callable[[float], str]) -> str:
    return ", ".join(f"{name} {fmt(v)}" for name, v in values.items()) or "-"


def render_rows(rows: list[dict[str, Any]], *, verdicts: bool) -> list[str]:
    """Markdown lines of the table; ``verdicts=False`` (smoke runs) drops target and met."""
    head = ["operation", "shapes", "dtype", "step", "median ms", "ratio"]
    head += ["target", "met"] if verdicts else []
    head += ["peak MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        peaks = {**row["peak_mib"], **{k: v for k, v in row["peak_rss_mib"].items() if v}}
        first = [
            row["case"],
            " ".join(f"{k}={v}" for k, v in row["shapes"].items()),
            row["dtype"],
            row["step"],
            _impl_cell(row["median_s"], lambda t: _ms(t)),
        ]
        for i, c in enumerate(row["targets"] or [None]):
            cells = first if i == 0 else [""] * len(first)
            cells = [*cells, "-" if c is None else _ratio(c)]
            if verdicts:
                cells += ["-", "-"] if c is None else [_target(c), _verdict(c)]
            cells.append(_impl_cell(peaks, lambda x: f"{x:.0f}") if i == 0 else "")
            lines.append("| " + " | ".join(cells) + " |")
    for row in rows:
        lines.extend(f"- {row['case']}: {note}" for note in row["notes"])
    return lines


def missed(result: dict[str, Any]) -> list[str]:
    """``"case: ratio"`` for each target judged and missed."""
    return [
        f"{row['case']}: {_ratio(c)} (target {_target(c)})"
        for row in result["rows"]
        for c in row["targets"]
        if c["met"] is False
    ]


def scaled(shapes: Shapes, scale: float, keep: Sequence[str] = ()) -> Shapes:
    """``shapes`` with every size not in ``keep`` multiplied by ``scale`` (at least 1)."""
    return {k: v if k in keep else max(1, math.floor(v * scale)) for k, v in shapes.items()}
