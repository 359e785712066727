"""Every size and work threshold that decides which implementation runs, as data.

One table (:data:`THRESHOLDS` of :class:`Threshold`); the modules that use a threshold bind
its value at import to a module-level constant (``bound_as``), a global for the hot paths.
:func:`thresholds` (:func:`attnscore.kernels.thresholds`) sets other values for a ``with``
block: tests steer which implementation runs through it, not by patching private names.
A leaf module (it imports torch only), read by :mod:`attnscore._checks` and the kernels.

:func:`markdown` renders the table that docs/architecture.md shows (a test keeps the two
equal): ``python -c "from attnscore._thresholds import markdown; print(markdown(), end='')"``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

__all__ = ["CPUS", "NEVER", "THRESHOLDS", "Threshold", "markdown", "thresholds", "value"]

_ZEN4 = "2-core AMD EPYC Zen 4 VM (family 25), torch 2.13.0+cpu, 2 threads"
_ZEN5 = "2-core AMD EPYC Zen 5 VM (family 26), torch 2.13.0+cpu, 2 threads"
_XEON = "2-core Intel Xeon VM with AMX (avx512f, amx_bf16), torch 2.13.0+cpu, 2 threads"
#: The CPUs the per-CPU entries (mappings keyed by these names) were measured on, and what
#: identifies each in /proc/cpuinfo: (vendor_id, cpu family or None, a flag it has).
ZEN4 = "AMD EPYC Zen 4 (family 25, avx512f)"
XEON_AMX = "Intel Xeon with AMX (amx_bf16)"
CPUS: dict[str, tuple[str, int | None, str]] = {
    ZEN4: ("AuthenticAMD", 25, "avx512f"),
    XEON_AMX: ("GenuineIntel", None, "amx_bf16"),
}
NEVER = 1 << 62  # a work no call reaches: SDPA always
_CPU_RUN = "the CPU run at commit 481b016, docs/bench/cpu-full-481b016.json; docs/benchmarks.md"


@dataclass(frozen=True)
class Threshold:
    """One threshold: ``name`` (what :func:`thresholds` takes), its ``value``, what it
    ``decides`` and ``why`` (one line each), the ``machine`` it was measured on (None: not
    recorded), the bench row that ``justified_by`` it (None: no bench row does; ``note``
    says what it rests on), where it is bound (``bound_as``: ``"module:ATTRIBUTE"``), and
    the smallest value an override may take (``minimum``, ints only)."""

    name: str
    value: int | frozenset[torch.dtype] | Mapping[tuple[torch.dtype, bool], int] | Mapping[str, int]
    decides: str
    why: str
    machine: str | None
    justified_by: str | None
    note: str = ""
    bound_as: tuple[str, ...] = ()
    minimum: int | None = None


_CPU = "attnscore.kernels._cpu"

THRESHOLDS: tuple[Threshold, ...] = (
    Threshold(
        "min_work_per_thread",
        1 << 15,
        "CPU C kernels: a call runs on the calling thread below twice this work (about one "
        "operation per element); above, each thread's row range gets at least this much.",
        "Below it a second thread's start and join cost more than the work it takes over.",
        None,
        None,
        "Set with the first C kernels (commit 0148d07); no bench row isolates it.",
        (f"{_CPU}:_MIN_WORK_PER_THREAD",),
        minimum=1,
    ),
    Threshold(
        "huge_min_bytes",
        4 << 20,
        "CPU C kernels: outputs from this many bytes get the transparent-huge-page hint.",
        "First-touch page faults dominated large masked softmax outputs; small outputs "
        "touch few pages.",
        None,
        None,
        "Set with the hint (commit 9f7f0fe); no bench row compares values.",
        (f"{_CPU}:_HUGE_MIN_BYTES",),
        minimum=0,
    ),
    Threshold(
        "softmax_inference",
        1 << 18,
        "A softmax without a mask (inference) runs the C masked softmax with every length "
        "m, instead of torch.softmax, from this many elements on.",
        "Below it torch.softmax's lower per-call cost wins; above, the C pass is faster.",
        _ZEN5,
        f"masked_softmax, mask none, fwd ({_CPU_RUN})",
        "The crossover itself was measured at shapes outside the matrix (commit eaed4bd).",
        (f"{_CPU}:_SOFTMAX_INFERENCE",),
    ),
    Threshold(
        "softmax_training",
        1 << 19,
        "The same in training (PyTorch's softmax backward of the kernel's output), from "
        "this many elements on, for the dtypes of softmax_training_dtypes.",
        "From here the kernel's forward with PyTorch's backward measured faster than "
        "torch.softmax's step; our own backward kernel did not pay and is not used there.",
        _ZEN5,
        f"masked_softmax, mask none, fwd+bwd ({_CPU_RUN})",
        "The crossover itself was measured at shapes outside the matrix (commit eaed4bd).",
        (f"{_CPU}:_SOFTMAX_TRAINING",),
    ),
    Threshold(
        "softmax_training_dtypes",
        frozenset({torch.float32, torch.bfloat16, torch.float16}),
        "The dtypes softmax_training applies to (others keep torch.softmax in training).",
        "float64 training did not measure faster through the kernel.",
        _ZEN5,
        f"masked_softmax, mask none, fwd+bwd: float32, bfloat16, float16 cells ({_CPU_RUN})",
        "float64 is not a dtype of the bench matrix.",
        (f"{_CPU}:_SOFTMAX_TRAINING_DTYPES",),
    ),
    Threshold(
        "small_work",
        1 << 14,
        "CPU dot-product and additive attention by key lengths without gradients (float32, "
        "float64): up to this many multiply-adds, one C pass from the caller's tensors.",
        "There SDPA's fixed cost and the ops around it (mask, zeroed padding) are most of a "
        "call; the one pass reads no padding and builds no mask.",
        _ZEN4,
        f"dot / heads / multihead / general / cosine / additive (tiny), fwd ({_CPU_RUN})",
        "Set in commit 31d941c.",
        (f"{_CPU}:_SMALL_WORK",),
    ),
    Threshold(
        "by_lengths_work",
        0,
        "CPU dot-product attention by lengths runs the C kernel by lengths from this many "
        "multiply-adds on (0: every call it takes; small inference calls take their C "
        "pass first).",
        "It computes each query over its own keys only, which SDPA's CPU kernel cannot.",
        _ZEN5,
        f"dot / heads / multihead / general / cosine, lengths masks, fwd and fwd+bwd ({_CPU_RUN})",
        "Tests raise it to keep the kernel out of the routes they test.",
        (f"{_CPU}:_BY_LENGTHS_WORK",),
    ),
    Threshold(
        "by_lengths_keys",
        8192,
        "The C kernel by lengths runs with at most this many keys (else the flash loop or "
        "SDPA with the mask).",
        "Its scratch per thread grows with m (d + dv) floats: about 11 MiB in the backward "
        "at 8192 keys with d = dv = 64.",
        None,
        None,
        "A memory bound, not a speed crossover (commit 7991b28).",
        (f"{_CPU}:_BY_LENGTHS_KEYS",),
    ),
    Threshold(
        "by_lengths_chunk",
        64,
        "A task of the kernel by lengths is one (example, head) or a chunk of at least this "
        "many of its sorted queries.",
        "A few examples and heads still give every thread work.",
        None,
        None,
        "Task geometry, set with the kernel (commit 7991b28); no bench row compares values.",
        (f"{_CPU}:_BY_LENGTHS_CHUNK",),
        minimum=1,
    ),
    Threshold(
        "kept_order",
        1 << 16,
        "The kernel by lengths keeps the queries' order for (B, H, n) up to this many "
        "values (512 KiB), instead of making it per call.",
        "A copy costs microseconds per call; keeping larger ones would hold memory for "
        "calls whose work dwarfs the copy.",
        None,
        None,
        "A memory bound on a cache (commit 8129962).",
        (f"{_CPU}:_KEPT_ORDER",),
    ),
    Threshold(
        "unpadded_work",
        MappingProxyType({ZEN4: 1 << 22, XEON_AMX: NEVER}),
        "CPU attention with nothing padded (no mask, causal alone) in training, and causal "
        "masking in any step, runs the kernel by lengths from this many multiply-adds on, "
        "per CPU measured (elsewhere: a tune file, else SDPA).",
        "Below it SDPA's fixed cost is small and its own loop fast; above, the kernel skips "
        "the keys causal masking excludes, which SDPA's CPU kernel skips only by 512.",
        f"{_ZEN4}; {_XEON}",
        f"general (mid), cosine (mid), mask causal, fwd ({_CPU_RUN})",
        "The crossover for dot-product attention was measured at shapes outside the matrix "
        "(commit dad3afa). On the Xeon SDPA beat the kernel on dense and bfloat16 work "
        "(dot bfloat16 no mask 3.11x, causal 1.88x, causal (1, 8, 4096, 4096, 128) 1.69x).",
        (f"{_CPU}:_UNPADDED_WORK",),
    ),
    Threshold(
        "decode_work",
        MappingProxyType({ZEN4: 1 << 18, XEON_AMX: NEVER}),
        "A float32 decoder step (fewer than 8 queries, no mask, no gradients) runs the kernel "
        "by lengths instead of SDPA from this many multiply-adds on, per CPU measured "
        "(elsewhere: a tune file, else SDPA).",
        "The kernel takes a step row by row over unpacked keys, four keys a pass; SDPA's CPU "
        "kernel tiles for many queries. The crossover: 2^18 (B·H 8, m 256, d 64) at 0.92x "
        "SDPA, 2^17 at 1.11x.",
        _ZEN4,
        "decode, mask none, fwd (docs/benchmarks.md)",
        "The sweep: `python tools/decode_sweep.py` (B·H 2 to 64, m 16 to 4096, d 64, 128).",
        (f"{_CPU}:_DECODE_WORK",),
    ),
    Threshold(
        "decode_work_bf16",
        MappingProxyType({ZEN4: 1 << 14, XEON_AMX: NEVER}),
        "decode_work for bfloat16 decoder steps.",
        "SDPA's bfloat16 CPU path is slow at one query (B·H 8, m 512: the kernel took 0.16x "
        "its time); the kernel was faster from the smallest size measured (2^14: 0.83x).",
        _ZEN4,
        "decode, mask none, bfloat16, fwd (docs/benchmarks.md)",
        "The sweep: `python tools/decode_sweep.py`.",
        (f"{_CPU}:_DECODE_WORK_BF16",),
    ),
    Threshold(
        "unpadded_head",
        128,
        "The kernel by lengths takes calls with nothing padded only up to this head size "
        "(q, k and v) in float32 and bfloat16.",
        "At larger heads SDPA's own kernel was as fast or faster.",
        _ZEN4,
        None,
        "d = 256 measured 1.0x-1.1x SDPA at shapes outside the matrix (commit dad3afa); "
        "the matrix's heads are smaller.",
        (f"{_CPU}:_UNPADDED_HEAD",),
    ),
    Threshold(
        "unpadded_inference",
        MappingProxyType({ZEN4: 1 << 17, XEON_AMX: NEVER}),
        "The same in inference (no gradients), with or without causal masking: the kernel "
        "by lengths from this many multiply-adds on, per CPU measured.",
        "Without gradients the kernel's call costs less than SDPA's from here on (Zen 4).",
        f"{_ZEN4}; {_XEON}",
        None,
        "The crossover was measured by a scratch script that is not in the repository "
        "(commit 92e345a); the rows dot / heads / general / cosine (mid), masks none and "
        "causal, lie above it.",
        (f"{_CPU}:_UNPADDED_INFERENCE",),
    ),
    Threshold(
        "call_work",
        1 << 21,
        "CPU dot-product attention by lengths off the kernel (dropout, float64): cutting "
        "examples into flash calls pays where it saves this much work per example.",
        "A call of the per-example loop costs about this much work in overhead.",
        _ZEN4,
        None,
        "Measured with the rows dot / heads / multihead (commit b149a2a) before the kernel "
        "by lengths took those cells; dropout and float64, which the loop now serves, are "
        "no bench row.",
        (f"{_CPU}:_CALL_WORK",),
    ),
    Threshold(
        "threads_work",
        1 << 30,
        "The same loop in training with fewer heads than threads: from this much work its "
        "backward runs examples on threads of its own, below it examples go in groups.",
        "Starting those threads (milliseconds) pays only in a large backward.",
        _ZEN4,
        None,
        "Measured at (8, 512, 512, 64) (no) and (32, 1024, 1024, 64) (yes) before the "
        "kernel by lengths took those shapes (commit 73aec49); no bench row measures it now.",
        (f"{_CPU}:_THREADS_WORK",),
    ),
    Threshold(
        "look_numel",
        1 << 15,
        "Attention inputs of at least this many elements (together) have their padding "
        "looked at (one read) before it is zeroed; smaller ones have it zeroed always.",
        "A few masked_fill calls cost less than the looking in small calls.",
        None,
        None,
        "Set in commit e5728db; no bench row compares values.",
        (
            "attnscore._checks:LOOK_NUMEL",
            "attnscore._engine:LOOK_NUMEL",
            "attnscore.kernels._sdpa:LOOK_NUMEL",
        ),
    ),
    Threshold(
        "small_values",
        256,
        "Integer tensors (lengths) up to this many values are read into Python at once "
        "instead of reduced by aminmax.",
        "A .tolist() of a few values is cheaper than a reduction op and its .item().",
        None,
        None,
        "Set in commit 380e1ff; no bench row compares values.",
        ("attnscore._checks:SMALL_VALUES",),
    ),
    Threshold(
        "plain_chunk_elements",
        1 << 22,
        "The plain additive scores compute tanh in blocks of at most this many elements "
        "(16 MiB in float32).",
        "Large enough for efficient matrix products, small enough that no (B, n, m, h) "
        "tensor exists.",
        None,
        None,
        "Memory geometry of the plain twin (commit 0148d07); no bench row compares values.",
        ("attnscore.kernels._plain:CHUNK_ELEMENTS",),
        minimum=1,
    ),
    Threshold(
        "varlen_min_keys",
        MappingProxyType(
            {
                (torch.bfloat16, False): 1,
                (torch.bfloat16, True): 1,
                (torch.float16, False): 1,
                (torch.float16, True): 1,
            }
        ),
        "CUDA: (dtype, training) -> the fewest keys from which flash attention's "
        "variable-length kernel (padded keys never read) runs calls by one key length per "
        "example instead of SDPA with the dense mask.",
        "It took less time than attnscore's SDPA route in 142 of 144 rows over two runs, m "
        "from 32 to 8192, lengths uniform in [1, m] or all m, forward and forward + "
        "backward; the two others were host-bound rows (m <= 256) faster in the other run.",
        "one NVIDIA H200, torch 2.11 (26 November 2026)",
        None,
        "tools/gpu_measure.py --only varlen (docs/benchmarks.md, 'On a GPU (CUDA backend)', "
        "rows 'uniform' and 'full').",
        ("attnscore.kernels._varlen:VARLEN_MIN_KEYS",),
    ),
    Threshold(
        "varlen_causal_min_keys",
        MappingProxyType(
            {
                (torch.bfloat16, False): 4096,
                (torch.bfloat16, True): 1024,
                (torch.float16, False): 4096,
                (torch.float16, True): 1024,
            }
        ),
        "CUDA: (dtype, training) -> the fewest keys from which causal masking with key "
        "lengths runs as two variable-length flash calls instead of SDPA with the dense mask.",
        "Two calls and their offsets cost host time that small calls do not win back: "
        "forward took longer than the SDPA route at some shapes up to m = 1024 and less at "
        "4096 and 8192; forward + backward took less at every shape from m = 1024.",
        "one NVIDIA H200, torch 2.11 (26 November 2026)",
        None,
        "tools/gpu_measure.py --only varlen (docs/benchmarks.md, 'On a GPU (CUDA backend)', "
        "rows 'causal + uniform').",
        ("attnscore.kernels._varlen:VARLEN_CAUSAL_MIN_KEYS",),
    ),
)

_BY_NAME = {t.name: t for t in THRESHOLDS}
# The values in force: the table's, or a thresholds() block's (modules imported inside a
# block bind these).
_current: dict[str, Any] = {t.name: t.value for t in THRESHOLDS}
_lock = threading.RLock()


def value(name: str) -> Any:
    """The value in force of threshold ``name`` (what a module binds at import)."""
    return _current[name]


def _checked(name: str, given: object) -> Any:
    """``given`` as a value of threshold ``name``, or the error that says why not."""
    entry = _BY_NAME.get(name)
    if entry is None:
        raise TypeError(
            f"Expected a threshold name ({', '.join(sorted(_BY_NAME))}), but got `{name}` instead."
        )
    default = entry.value
    if isinstance(default, Mapping) and all(isinstance(k, str) for k in default):
        if isinstance(given, int) and not isinstance(given, bool):  # on every CPU
            return given
        if not isinstance(given, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int) for k, v in given.items()
        ):
            raise TypeError(
                f"Expected threshold `{name}` to be an int or a mapping CPU -> int, but got "
                f"{given!r} instead."
            )
        return MappingProxyType(dict(given))
    if isinstance(default, int):
        if not isinstance(given, int) or isinstance(given, bool):
            raise TypeError(
                f"Expected threshold `{name}` to be an int, but got {type(given).__name__} instead."
            )
        if entry.minimum is not None and given < entry.minimum:
            raise ValueError(
                f"Expected threshold `{name}` >= {entry.minimum}, but got {given} instead."
            )
        return given
    if isinstance(default, frozenset):
        if not isinstance(given, (set, frozenset)) or not all(
            isinstance(d, torch.dtype) for d in given
        ):
            raise TypeError(
                f"Expected threshold `{name}` to be a set of torch dtypes, but got {given!r} "
                "instead."
            )
        return frozenset(given)
    if not isinstance(given, Mapping) or not all(
        isinstance(k, tuple)
        and len(k) == 2
        and isinstance(k[0], torch.dtype)
        and isinstance(k[1], bool)
        and isinstance(v, int)
        and not isinstance(v, bool)
        for k, v in given.items()
    ):
        raise TypeError(
            f"Expected threshold `{name}` to be a mapping (dtype, training) -> int, but got "
            f"{given!r} instead."
        )
    return MappingProxyType(dict(given))


def _bind(name: str, v: Any) -> None:
    """Set threshold ``name`` to ``v`` where it is in force: the modules imported so far
    that bind it (the others bind :data:`_current` when they are imported)."""
    _current[name] = v
    for where in _BY_NAME[name].bound_as:
        module, attribute = where.split(":")
        loaded = sys.modules.get(module)
        if loaded is not None:
            setattr(loaded, attribute, v)


@contextlib.contextmanager
def thresholds(**overrides: Any) -> Iterator[Mapping[str, Any]]:
    """Run the body with these thresholds (names of :data:`THRESHOLDS`) set to other
    values, process-wide; every one is restored on leaving. Yields the values in force
    (read-only). Blocks nest; a block holds a lock, so blocks of other threads wait for it
    to end (for tests: the kernels themselves never take the lock).

    Raises:
        TypeError: an unknown name (the error lists the known ones), or a value of another
            kind than the threshold's (int; set of dtypes; mapping (dtype, training) -> int).
        ValueError: an int below the threshold's smallest value (e.g. 1 for
            ``min_work_per_thread``).

    >>> from attnscore.kernels import thresholds
    >>> with thresholds(small_work=-1) as now:  # no call is small
    ...     now["small_work"]
    -1
    """
    checked = {name: _checked(name, given) for name, given in overrides.items()}
    with _lock:
        saved = {name: _current[name] for name in checked}
        try:
            for name, v in checked.items():
                _bind(name, v)
            yield MappingProxyType(_current)
        finally:
            for name, v in saved.items():
                _bind(name, v)


def _shown(v: object) -> str:
    if isinstance(v, int):
        if v == NEVER:
            return "never (SDPA)"
        if v >= 1 << 14 and v & (v - 1) == 0:
            return f"2^{v.bit_length() - 1}"
        return str(v)
    if isinstance(v, frozenset):
        return ", ".join(sorted(str(d).removeprefix("torch.") for d in v))
    assert isinstance(v, Mapping)
    return "{} (none)" if not v else ", ".join(f"{k}: {_shown(n)}" for k, n in v.items())


def markdown() -> str:
    """The table as docs/architecture.md shows it (a markdown table, one row per entry)."""
    rows = [
        "| threshold | value | decides | why | machine | justified by |",
        "|---|---|---|---|---|---|",
    ]
    for t in THRESHOLDS:
        justified = f"{t.justified_by or 'no bench row'}. {t.note}".strip()
        machine = t.machine or "not recorded"
        cells = (f"`{t.name}`", _shown(t.value), t.decides, t.why, machine, justified)
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"
