"""The attnscore functions one call runs, in order: how many Python calls a module's forward
makes and in which files, for the decisions count of a change (docs/architecture.md's call
path). Run it in two trees to compare them:

    PYTHONPATH=src python tools/call_trace.py [--train] [--shape B n m d]

It times nothing. The call is DotProductAttention with key lengths (B,), warmed once first.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from types import FrameType
from typing import Any


def trace(train: bool, shape: tuple[int, int, int, int]) -> list[tuple[str, str]]:
    """(file under attnscore/, function) of each Python call inside attnscore, in order."""
    import torch

    import attnscore

    B, n, m, d = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, s, d, generator=g).requires_grad_(train) for s in (n, m, m))
    lens = torch.randint(1, m + 1, (B,), generator=g)
    module = attnscore.DotProductAttention().train(train)
    calls: list[tuple[str, str]] = []
    # The package's own folder, whatever the folders above it are called (a clone named
    # attnscore holds src/attnscore/: cutting at the first "/attnscore/" would keep "src/").
    package = str(Path(attnscore.__file__).parent) + "/"

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(package):
            calls.append((name[len(package) :], frame.f_code.co_name))

    with torch.set_grad_enabled(train):
        module(q, k, v, lens)  # warm: first calls build and cache
        sys.setprofile(profile)
        try:
            module(q, k, v, lens)
        finally:
            sys.setprofile(None)
    return calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", action="store_true", help="with gradients (else inference)")
    parser.add_argument("--shape", type=int, nargs=4, default=(8, 128, 128, 64),
                        metavar=("B", "n", "m", "d"))  # fmt: skip
    args = parser.parse_args(argv)
    calls = trace(args.train, tuple(args.shape))
    files = collections.Counter(f for f, _ in calls)
    print(f"{len(calls)} Python calls in {len(files)} files: {dict(files)}")
    print(" -> ".join(f"{f}:{fn}" for f, fn in calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
