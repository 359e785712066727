"""Where the C kernel by lengths and SDPA both take a dense CPU call (no mask, or causal
masking alone) and neither wins by construction, the choice measured on this machine, as
``torch.backends.cudnn.benchmark`` makes it for convolutions (:func:`verdict`: a
``thresholds`` block, the first-call benchmark, this machine's tune file, the thresholds
shipped for this CPU, else SDPA). The machine is read once, lazily (:func:`machine`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from .._thresholds import CPUS, NEVER
from ._build import _cache_dir
from ._sdpa import Sdpa
from ._select import AttentionCall, Implementation, replan

ISA = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
#: Work buckets: bucket b holds (B·H)·n·m·(d + dv) in [2^(15+2b), 2^(17+2b)) (0: below,
#: the last: above), measured at 2^(16+2b).
WORK_BUCKETS = 6
NOT_MEASURED = "not measured on this machine: PyTorch's call"


@functools.cache
def _cpuinfo() -> dict[str, str]:
    info: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if not line.strip():
                break  # the first processor's block
            name, _, value = line.partition(":")
            info[name.strip()] = value.strip()
    return info


@functools.cache
def cpu_name() -> str | None:
    """The shipped CPU (a key of ``attnscore._thresholds.CPUS``) this machine is, or None."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    for name, (vendor, family, flag) in CPUS.items():
        same_family = family is None or info.get("cpu family") == str(family)
        if info.get("vendor_id") == vendor and flag in flags and same_family:
            return name
    return None


def machine() -> dict[str, Any]:
    """This machine as a tune file's key: the CPU model and its ISA flags of
    :data:`ISA`, torch's threads, the torch and attnscore versions."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    return {
        "cpu": info.get("model name") or platform.processor() or platform.machine(),
        "isa": [f for f in ISA if f in flags],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "attnscore": sys.modules["attnscore"].__version__,
    }


def bucket(kind: str, dtype: torch.dtype, grad: bool, work: int) -> str:
    """A call's bucket: ``"causal bfloat16 training 2^20"`` (the work it is measured at);
    ``kind`` is the mask's, or ``"decode"`` (:func:`bucket_of`)."""
    b = min(max((work.bit_length() - 16) // 2, 0), WORK_BUCKETS - 1)
    step = "training" if grad else "inference"
    return f"{kind} {str(dtype).removeprefix('torch.')} {step} 2^{16 + 2 * b}"


#: Fewer queries than this (the C kernel's tile) make a decoder step.
DECODE_QUERIES = 8


def decoding(call: AttentionCall) -> bool:
    """Whether ``call`` is a decoder step: no mask, fewer than :data:`DECODE_QUERIES`
    queries, no gradients, scores of q and k themselves. The kernel by lengths runs those
    row by row, so they have thresholds (``decode_work``) and buckets of their own."""
    return (
        call.kind == "none"
        and call.sizes[1] < DECODE_QUERIES
        and not call.needs_grad
        and call.project is None
    )


def bucket_of(call: AttentionCall) -> str:
    """``call``'s :func:`bucket`, decoder steps (:func:`decoding`) apart."""
    kind = "decode" if decoding(call) else call.kind
    return bucket(kind, call.q.dtype, call.needs_grad, call.work)


class _Tuning:
    path: Path | None = None  # None: the cache dir's tune.json
    loaded: dict[str, Any] | None = None  # the buckets of a matching file ({}: none)
    first_calls: ClassVar[dict[str, tuple[bool, str]]] = {}
    # (dtype, training) -> the size the file's softmax buckets start the kernel from
    softmax: dict[tuple[torch.dtype, bool], int] | None = None


def default_file() -> Path:
    """Where ``attnscore tune`` writes and the selection reads: ``tune.json`` in the cache
    dir (``$ATTNSCORE_CACHE``, else ``~/.cache/attnscore``, as the C build's)."""
    return _cache_dir() / "tune.json"


def _file() -> Path:
    return _Tuning.path or default_file()


def _buckets() -> dict[str, Any]:
    if _Tuning.loaded is None:
        _Tuning.loaded, path = {}, _file()
        try:
            found = json.loads(path.read_text())
            if found["key"] == machine():
                _Tuning.loaded = dict(found["buckets"])
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as error:
            warnings.warn(f"attnscore: ignored the tune file {path} ({error!r})", stacklevel=2)
    return _Tuning.loaded


@contextlib.contextmanager
def tuned(path: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Run the body with the measurements of the tune file at ``path`` (None: the one
    ``attnscore tune`` writes in the cache dir, ``$ATTNSCORE_CACHE`` or
    ``~/.cache/attnscore``), read on the first call that needs it; process-wide. A file of
    another machine is ignored; a corrupted one with a warning.

    >>> import attnscore
    >>> with attnscore.kernels.tuned("no-such-file.json"):
    ...     pass
    """
    saved = _Tuning.path, _Tuning.loaded, _Tuning.softmax
    _Tuning.path, _Tuning.loaded = None if path is None else Path(path), None
    _Tuning.softmax = None
    replan()  # (the choices kept were made from other measurements)
    try:
        yield
    finally:
        _Tuning.path, _Tuning.loaded, _Tuning.softmax = saved
        replan()


def fastest(
    sides: Mapping[str, Callable[[], object]], rounds: int, most: int, seconds: float
) -> dict[str, Any]:
    """Run each of ``sides`` once in turn, after a warm-up round, at least ``rounds`` and
    up to ``most`` rounds or ``seconds`` of all runs: the fastest milliseconds of each (the
    runs others disturbed least) and the winner's name (``"winner"``)."""
    best = dict.fromkeys(sides, float("inf"))
    spent, done = 0.0, -1
    while done < rounds or (spent < seconds and done < most):
        for name, run in sides.items():
            start = time.perf_counter()
            run()
            took = time.perf_counter() - start
            spent += took
            if done >= 0:  # (round -1 warms up)
                best[name] = min(best[name], 1e3 * took)
        done += 1
    return {**best, "winner": min(best, key=best.__getitem__)}


def measure(call: AttentionCall, kernel: Implementation, sdpa: Implementation) -> dict[str, Any]:
    """Time ``kernel`` and ``sdpa`` on ``call``'s inputs (copies; forward and backward where
    it needs gradients), :func:`fastest` of at least 10 and up to 400 runs or 0.5 s."""
    grad = call.needs_grad
    q, k, v = (t.detach().requires_grad_(grad) for t in (call.q, call.k, call.v))

    def timed(impl: Implementation) -> Callable[[], None]:
        def run() -> None:
            with torch.set_grad_enabled(grad):
                out = impl.run(AttentionCall(q, k, v, call.mask, scale=call.scale))
                if grad and out is not None:
                    out.sum().backward()

        return run

    return fastest({impl.name: timed(impl) for impl in (kernel, sdpa)}, 10, 400, 0.5)


#: The softmax buckets: elements of the softmax's input, 2^16 to 2^22 (measured at these).
SOFTMAX_SIZES = (16, 18, 20, 22)


def softmax_bucket(dtype: torch.dtype, grad: bool, e: int) -> str:
    """A softmax bucket of the tune file: ``"softmax bfloat16 training 2^20"``."""
    step = "training" if grad else "inference"
    return f"softmax {str(dtype).removeprefix('torch.')} {step} 2^{e}"


def softmax_from(dtype: torch.dtype, grad: bool) -> int | None:
    """The size from which this machine's tune file runs the C softmax without a mask
    (``dtype``, training or not): the smallest size measured from which the kernel won in
    every larger bucket; NEVER where it lost the largest; None without such buckets (no
    file, another machine's, or one written before softmax buckets)."""
    table = _Tuning.softmax
    if table is None:
        table = _Tuning.softmax = {}
        buckets = _buckets()
        for d in (torch.float32, torch.bfloat16, torch.float16):
            for training in (False, True):
                won = [buckets.get(softmax_bucket(d, training, e)) for e in SOFTMAX_SIZES]
                if None in won:
                    continue
                start = NEVER
                for e, found in reversed(list(zip(SOFTMAX_SIZES, won, strict=True))):
                    if found["winner"] != "c_softmax":
                        break
                    start = 1 << e
                table[d, training] = start
    return table.get((dtype, grad))


def _per_cpu(v: Any) -> int | None:
    return v if isinstance(v, int) else v.get(cpu_name())


def verdict(
    call: AttentionCall,
    kernel: Implementation,
    given: tuple[Any, ...],
    shipped: Callable[..., bool],
) -> tuple[bool, str]:
    """Whether ``kernel`` (the kernel by lengths) runs dense ``call`` rather than SDPA, and
    the measurement that decided (for :func:`attnscore.explain`); ``given`` are the
    thresholds in force (ints, or mappings CPU -> int), ``shipped(*ints)`` their rule."""
    if all(isinstance(g, int) for g in given):
        return shipped(*given), "thresholds set by attnscore.kernels.thresholds"
    measured = call.project is None  # (projected calls compare with their own pipeline)
    if measured and sys.modules[__package__].benchmark:
        key = bucket_of(call)
        found = _Tuning.first_calls.get(key)
        if found is None:
            ms = measure(call, kernel, Sdpa())
            found = ms["winner"] == "c_by_lengths", f"first-call benchmark of {key}: {_ms(ms)}"
            _Tuning.first_calls[key] = found
        return found
    tuned = _buckets() if measured else None
    if tuned:  # (no file, or another machine's: {})
        key = bucket_of(call)
        timed = tuned.get(key)
        if timed is not None:
            return timed["winner"] == "c_by_lengths", f"tune file {_file()} ({key}: {_ms(timed)})"
    here = cpu_name()
    resolved = tuple(map(_per_cpu, given))
    if here is not None and None not in resolved:
        return shipped(*resolved), f"thresholds shipped for {here}"
    return False, NOT_MEASURED


def _ms(found: dict[str, Any]) -> str:
    return ", ".join(f"{n} {found[n]:.3g} ms" for n in ("c_by_lengths", "sdpa"))
