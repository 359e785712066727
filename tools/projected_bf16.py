"""General and cosine attention without a mask in bfloat16: the plain formulation, the
scorer's own pipeline (what the selection runs) and the C kernel by lengths on the
projections (which the selection declines for projected bfloat16 calls), interleaved in
one process. It backs the rule in ``attnscore.kernels._cpu._unpadded_pays`` that keeps
those calls on the pipeline (docs/benchmarks.md):

    python tools/projected_bf16.py [--rounds 11] [--train]

The kernel's column lifts that one rule for the call (the thresholds stay the shipped
ones), so it is the kernel wherever the shipped thresholds would take a float32 call.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

import attnscore
from attnscore.kernels import _cpu, _select

SHAPES = ((2, 64, 64, 32), (4, 128, 128, 64), (8, 256, 256, 64))


@contextlib.contextmanager
def _kernel_for_projected() -> Iterator[None]:
    """The kernel's verdict for projected bfloat16 calls as for unprojected ones."""
    rule = _cpu._unpadded_pays

    def lifted(call: Any, kernel: Any) -> str | None:
        project = call.project
        call.project = None
        try:
            return rule(call, kernel)
        finally:
            call.project = project

    _cpu._unpadded_pays = lifted
    _select.replan()
    try:
        yield
    finally:
        _cpu._unpadded_pays = rule
        _select.replan()


def _cases(shape: tuple[int, int, int, int], train: bool) -> Iterator[tuple[str, Any, Any]]:
    """(name, module call, plain formulation) for general and cosine at ``shape``."""
    B, n, m, d = shape
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, s, d).to(torch.bfloat16).requires_grad_(train) for s in (n, m, m))
    general = attnscore.MultiplicativeAttention(d, d).to(torch.bfloat16).train(train)
    cosine = attnscore.CosineAttention().to(torch.bfloat16).train(train)

    def plain_general() -> torch.Tensor:
        return torch.softmax((q @ general.W_a.weight) @ k.mT, -1) @ v

    def plain_cosine() -> torch.Tensor:
        scale = cosine.log_scale.exp()
        return torch.softmax(scale * F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).mT, -1) @ v

    rows = (("general", general, plain_general), ("cosine", cosine, plain_cosine))
    for name, module, plain in rows:
        wrt = [q, k, v, *module.parameters()]
        yield name, _step(lambda m=module: m(q, k, v), wrt, train), _step(plain, wrt, train)


def _step(fn: Callable[[], torch.Tensor], wrt: list[torch.Tensor], train: bool) -> Any:
    def step() -> None:
        if train:
            torch.autograd.grad(fn().sum(), wrt)
        else:
            with torch.no_grad():
                fn()

    return step


def _time(step: Any, calls: int = 10) -> float:
    for _ in range(2):
        step()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - start) / calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--train", action="store_true", help="forward + backward")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    importlib.import_module("attnscore._memory").keep_freed_memory()  # as the bench does
    print("row, shape, step: median ms (ratio to plain) over interleaved rounds")
    for shape in SHAPES:
        for name, ours, plain in _cases(shape, args.train):
            times: dict[str, list[float]] = {"plain": [], "pipeline": [], "kernel": []}
            for _ in range(args.rounds):
                times["plain"].append(_time(plain))
                times["pipeline"].append(_time(ours))
                with _kernel_for_projected():
                    times["kernel"].append(_time(ours))
            base = statistics.median(times["plain"])
            cells = "  ".join(
                f"{k} {statistics.median(t) * 1e3:.3f} ({statistics.median(t) / base:.2f}x)"
                for k, t in times.items()
            )
            print(f"{name} {shape} {'fwd+bwd' if args.train else 'fwd'}: {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
