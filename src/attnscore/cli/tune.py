"""``attnscore tune``: measure, on this machine, which of the C kernel by lengths and SDPA
runs dense CPU attention faster (no mask, or causal masking alone), and which of the C
softmax and ``torch.softmax`` a softmax without a mask, per bucket, and write the tune file
the selection reads (:mod:`attnscore.kernels._measured`).

Buckets: mask (none, causal) x dtype (float32, bfloat16) x step (inference, training) x
work ((B·H) · n · m · (d + dv) to within 4x, 2^16 to 2^26), each timed at one shape (B = 1,
B·H = torch's threads (at least 2), n = m, d = 64), and decoder steps (inference, both
dtypes, one query, B·H = 8 or the threads, m keys for the work): one run of each
implementation in turn,
the fastest of at least 10 each; buckets out of line with their neighbours (disturbed by
other processes) are measured again. Then the softmax without a mask: the C kernel against
``torch.softmax`` between the two products of attention, per dtype (float32, bfloat16,
float16), step and size (2^16 to 2^22 elements). At most 2 minutes: buckets left when it
is spent are not measured.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .._progress import Progress
from ..bench.load import LoadWatch, load_average
from ..kernels import _measured, load_library, thresholds
from ..kernels._cpu import ByLengths
from ..kernels._sdpa import Sdpa
from ..kernels._select import AttentionCall
from ..masking import build_mask, masked_softmax
from ._files import check_output, write_atomic
from ._usage import ArgumentParser, UsageError, add_overwrite

__all__ = ["add_parser", "tune"]

BUDGET_S = 110.0  # of the 2 minutes; the rest for the C build and the file


def add_parser(subparsers: argparse._SubParsersAction[ArgumentParser]) -> ArgumentParser:
    """Add ``attnscore tune`` to ``subparsers``; its ``handler`` runs :func:`tune`.

    >>> parser = ArgumentParser(prog="attnscore")
    >>> _ = add_parser(parser.add_subparsers())
    >>> parser.parse_args(["tune", "--out", "t.json"]).out
    PosixPath('t.json')
    """
    tune_ = subparsers.add_parser(
        "tune",
        help="measure the C kernels against PyTorch's calls on this machine for the selection "
        "(<= 2 min)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tune_.add_argument(
        "--out",
        type=Path,
        metavar="FILE",
        help="write here (.json) instead of the cache dir's tune.json ($ATTNSCORE_CACHE or "
        "~/.cache/attnscore), which the selection reads",
    )
    add_overwrite(tune_, "--out if it exists")
    tune_.set_defaults(handler=tune)
    return tune_


def _call(kind: str, dtype: torch.dtype, grad: bool, work: int) -> AttentionCall:
    pairs = max(2, torch.get_num_threads())
    n = min(max(round(math.sqrt(work / (128 * pairs))), 8), 4096)
    m = n
    if kind == "decode":  # one query over a cache of m keys, more heads
        pairs = max(8, pairs)
        n, m = 1, max(work // (128 * pairs), 8)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, pairs, n, 64, generator=g, dtype=dtype)
    k, v = (torch.randn(1, pairs, m, 64, generator=g, dtype=dtype) for _ in range(2))
    mask = build_mask(torch.Size([1, pairs]), n, m, q.device, causal=kind == "causal")
    with torch.set_grad_enabled(grad):
        q, k, v = (t.requires_grad_(grad) for t in (q, k, v))
        return AttentionCall(q, k, v, mask, scale=0.125)


def _measure_softmax(dtype: torch.dtype, grad: bool, e: int) -> dict[str, Any]:
    """Time the C softmax without a mask (``c_softmax``: :func:`attnscore.masked_softmax`
    with the kernel allowed at every size) against ``torch.softmax`` (``torch``) between
    the two products of attention, ``softmax(Q Kᵀ) V`` at (2^(e-16), 256, 256), d = 64: the
    scores come hot from the product, where the kernel gains least (alone it wins from
    smaller sizes). :func:`~attnscore.kernels._measured.fastest` of at least 3 and up to
    100 runs or 0.3 s."""
    g = torch.Generator().manual_seed(0)
    shape = (1 << (e - 16), 256, 64)
    q, k, v = (torch.randn(shape, generator=g).to(dtype).requires_grad_(grad) for _ in "qkv")
    softmaxes: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "c_softmax": masked_softmax,
        "torch": lambda x: torch.softmax(x, -1),
    }

    def step(softmax: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            out = softmax(q @ k.transpose(-1, -2)) @ v
            if grad:
                out.sum().backward()

        return run

    sides = {name: step(softmax) for name, softmax in softmaxes.items()}
    with thresholds(softmax_inference=0, softmax_training=0), torch.set_grad_enabled(grad):
        return _measured.fastest(sides, 3, 100, 0.3)


def tune(args: argparse.Namespace) -> int:
    """Measure every bucket and write the tune file; prints one line (where, how long)."""
    out = args.out
    if out is not None:
        check_output(out, "--out", (".json",), overwrite=args.overwrite)
    if load_library() is None:
        raise UsageError("the C kernels cannot be built or loaded here: nothing to tune")
    cells = [
        (kind, dtype, grad, 1 << (16 + 2 * b))
        for b in range(_measured.WORK_BUCKETS)
        for kind in ("none", "causal", "decode")
        for dtype in (torch.float32, torch.bfloat16)
        for grad in (False, True)
        if not (kind == "decode" and grad)  # (decoder steps are inference)
    ]
    start = time.perf_counter()
    buckets: dict[str, dict[str, Any]] = {}
    shapes: dict[tuple[str, torch.dtype, bool, int], str] = {}
    watch = LoadWatch()
    progress = Progress(len(cells), "attnscore tune", interval=10.0)

    def measure(cell: tuple[str, torch.dtype, bool, int]) -> None:
        call = _call(*cell)
        key = shapes[cell] = _measured.bucket_of(call)
        ms = _measured.measure(call, ByLengths(), Sdpa())
        ms = {n: min(t, buckets.get(key, ms)[n]) for n, t in ms.items() if n != "winner"}
        buckets[key] = {**ms, "winner": min(ms, key=ms.__getitem__)}
        if watch.see(load_average()):
            progress.write(f"busy: load average above {watch.threshold} (timings disturbed)")

    for done, cell in enumerate(cells, 1):
        if time.perf_counter() - start > BUDGET_S:
            break
        measure(cell)
        progress.update(done)
    progress.close()

    # Work 4x larger takes longer, but not 16x: a bucket slower than the next one or 16x
    # the one before was disturbed by other processes; measured again (up to 3 times, while
    # time is left; the fastest runs kept).
    per = len(cells) // _measured.WORK_BUCKETS  # cells of one work bucket

    def disturbed(i: int) -> bool:  # against the same cell 4x smaller and 4x larger
        for a, b in ((i - per, i), (i, i + per)):
            if a >= 0 and b < len(cells) and cells[b] in shapes:
                small, big = buckets[shapes[cells[a]]], buckets[shapes[cells[b]]]
                if any(not small[n] < big[n] < 16 * small[n] for n in ("c_by_lengths", "sdpa")):
                    return True
        return False

    for _ in range(3):
        for i, cell in enumerate(cells):
            if cell in shapes and time.perf_counter() - start < BUDGET_S and disturbed(i):
                measure(cell)
    # The softmax without a mask: the C kernel (every length m) against torch.softmax.
    softmax_cells = [
        (dtype, grad, e)
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
        for grad in (False, True)
        for e in _measured.SOFTMAX_SIZES
    ]
    progress = Progress(len(softmax_cells), "attnscore tune (softmax)", interval=10.0)
    for done, (dtype, grad, e) in enumerate(softmax_cells, 1):
        if time.perf_counter() - start > BUDGET_S:
            break
        buckets[_measured.softmax_bucket(dtype, grad, e)] = _measure_softmax(dtype, grad, e)
        progress.update(done)
    progress.close()
    seconds = time.perf_counter() - start
    found = {"key": _measured.machine(), "seconds": round(seconds, 1), "load": watch.as_dict()}
    found["buckets"] = buckets
    path = out or _measured.default_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(found, indent=1).encode()
    write_atomic(path, lambda f: f.write(text), "--out", overwrite=out is None or args.overwrite)
    faster = sum(b["winner"] in ("c_by_lengths", "c_softmax") for b in buckets.values())
    print(
        f"wrote {path}: {len(buckets)} buckets in {seconds:.0f} s, the C kernels faster in "
        f"{faster}; highest load average {watch.highest or 0:.1f} on {watch.cores} cores"
    )
    return 0
