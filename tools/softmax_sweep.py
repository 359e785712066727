"""Where the C masked softmax (every length m) overtakes ``torch.softmax`` on a softmax
without a mask: the sweep behind the ``softmax_inference`` and ``softmax_training``
thresholds (attnscore._thresholds), per dtype, in two settings:

- ``alone``: the softmax of a (B, 256, 256) tensor (``masked_softmax(X)``, the ``softmax``
  normalizer without a mask);
- ``attention``: ``softmax(Q Kᵀ) V`` with d = 64, as general and cosine attention's pipeline
  runs it: the scores come hot from the product and the weights go straight into the next.

Both sides run on the same tensors, in interleaved rounds; the ratio is the median over
rounds of ours over torch's (below 1: the kernel is faster). Training steps run the
backward pass too (PyTorch's softmax backward of the kernel's output, as the library does).

    PYTHONPATH=src python tools/softmax_sweep.py [--threads 2] [--rounds 11]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from attnscore._memory import keep_freed_memory
from attnscore.kernels import _ops

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: log2 of the elements of the softmax's input: B = 2^(e - 16) rows of 256 x 256.
SIZES = range(16, 24)


def _ours(x: torch.Tensor, grad: bool) -> torch.Tensor:
    return _ops._Softmax.apply(x) if grad else _ops._every_key_softmax(x)  # type: ignore[no-any-return,no-untyped-call]


def _theirs(x: torch.Tensor, grad: bool) -> torch.Tensor:
    return torch.softmax(x, -1)


def _step(
    setting: str, softmax: Callable[[torch.Tensor, bool], torch.Tensor], e: int, dtype: torch.dtype,
    grad: bool,
) -> Callable[[], None]:  # fmt: skip
    """One call of ``setting`` with ``softmax``, on inputs made once (seed 0)."""
    g = torch.Generator().manual_seed(0)
    B = 1 << (e - 16)
    if setting == "alone":
        x = torch.randn(B, 256, 256, generator=g).to(dtype).requires_grad_(grad)
        up = torch.randn(B, 256, 256, generator=g).to(dtype)

        def alone() -> None:
            y = softmax(x, grad)
            if grad:
                y.backward(up)

        return alone
    q, k, v = (torch.randn(B, 256, 64, generator=g).to(dtype).requires_grad_(grad) for _ in "qkv")

    def attention() -> None:
        out = softmax(q @ k.transpose(-1, -2), grad) @ v
        if grad:
            out.sum().backward()

    return attention


def ratio(setting: str, e: int, dtype: torch.dtype, grad: bool, rounds: int) -> tuple[float, float]:
    """(median of ours / torch's over ``rounds`` interleaved rounds, torch's median µs)."""
    ours, theirs = (_step(setting, f, e, dtype, grad) for f in (_ours, _theirs))
    calls = max(2, 1 << max(0, 21 - e))
    for fn in (ours, theirs, ours, theirs):  # warm
        fn()
    ratios, took = [], []
    for _ in range(rounds):
        times = []
        for fn in (ours, theirs):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - start) / calls)
        ratios.append(times[0] / times[1])
        took.append(times[1])
    return statistics.median(ratios), 1e6 * statistics.median(took)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--rounds", type=int, default=11, help="interleaved rounds (default 11)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the bench: no page faults of fresh buffers in either side
    print("setting    step       dtype     elements  torch µs  ours/torch")
    for setting in ("alone", "attention"):
        for grad in (False, True):
            for dtype in DTYPES:
                for e in SIZES:
                    r, us = ratio(setting, e, dtype, grad, args.rounds)
                    step = "training" if grad else "inference"
                    name = str(dtype).removeprefix("torch.")
                    print(f"{setting:10s} {step:10s} {name:9s} 2^{e:<6d} {us:9.0f}  {r:.3f}",
                          flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
