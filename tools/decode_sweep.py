"""Where the C kernel by lengths overtakes SDPA on decoder steps (one query over a cache of
m keys, no mask, no gradients): the sweep behind the ``decode_work`` thresholds
(attnscore._thresholds). Both run on the same tensors, in turn, best of 5 rounds each.

    PYTHONPATH=src python tools/decode_sweep.py [--threads 2]

Prints one line per (dtype, B·H, m, d): each side's microseconds and the kernel's ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from attnscore.kernels import _cpu

#: (B·H, m, d): from a few heads over a short cache to a 7B model's layer over 4096 keys.
SHAPES = [
    (8, 16, 64),
    (8, 32, 64),
    (8, 64, 64),
    (8, 128, 64),
    (8, 256, 64),
    (2, 512, 64),
    (8, 512, 64),
    (32, 512, 64),
    (64, 512, 64),
    (32, 1024, 128),
    (32, 4096, 128),
]


def best_us(fn: Callable[..., object], args: tuple[object, ...], runs: int) -> float:
    """The fastest of 5 rounds of ``runs`` calls of ``fn(*args)``, microseconds per call."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(runs):
            fn(*args)
        best = min(best, (time.perf_counter() - start) / runs * 1e6)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads")
    for dtype in (torch.float32, torch.bfloat16):
        for pairs, m, d in SHAPES:
            q = torch.randn(1, pairs, 1, d, generator=g).to(dtype)
            k, v = (torch.randn(1, pairs, m, d, generator=g).to(dtype) for _ in range(2))
            by = _cpu._unpadded_by(1, m, False)
            runs = max(3, 3000 * 512 // (pairs * m))
            with torch.no_grad():
                sdpa = best_us(F.scaled_dot_product_attention, (q, k, v), runs)
                ours = best_us(_cpu._by_lengths_forward, (q, k, v, by, 0.125, False), runs)
            work = pairs * m * 2 * d
            print(
                f"{str(dtype).removeprefix('torch.'):8} B·H {pairs:3} m {m:5} d {d:3} "
                f"work 2^{work.bit_length() - 1:<2}  sdpa {sdpa:9.1f} us  kernel {ours:9.1f} us"
                f"  {ours / sdpa:.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
