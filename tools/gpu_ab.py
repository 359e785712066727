"""Old code against new on a CUDA GPU: the calls the GPU work touches, timed in interleaved
processes (old, new, new, old, ...), each with PyTorch's own call timed beside them.

    git worktree add /tmp/old 65ae72d      # or: git archive REV src | tar -x -C DIR
    python tools/gpu_ab.py /tmp/old/src src --rounds 2 --out ab.json

Cases: dot-product attention by key lengths at (B, H, n, m, d) = (32, 8, 1024, 1024, 64)
bfloat16 (the function and the module, forward + backward by ``torch.autograd.grad``, also
"stream": wall time per call of 40 calls in a row, host time included), the masked softmax
forward at (64, 1024, 1024), and AdditiveAttention forward + backward. Times: medians of
``triton.testing.do_bench`` (ms) over the rounds. Prints one row per case: old, new,
new / old; writes every round to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any


def _additive_step(module: Any, inputs: tuple[Any, ...], grad: Any) -> None:
    module(*inputs).backward(grad)


def worker(src: str) -> None:
    """Time every case with the attnscore found in ``src``; print one RESULT line."""
    sys.path.insert(0, src)
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    import attnscore

    def bench(fn: Callable[[], Any]) -> float:
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))

    def stream(fn: Callable[[], Any], calls: int = 40) -> float:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / calls * 1e3

    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator().manual_seed(0)
    res: dict[str, float] = {}
    B, H, n, m, d = 32, 8, 1024, 1024, 64
    lens = torch.randint(1, m + 1, (B,), generator=g).to(dev)
    q, k, v = (torch.randn(B, H, s, d, generator=g).to(dev, bf).requires_grad_() for s in (n, m, m))
    grad = torch.randn(B, H, n, d, generator=g).to(dev, bf)
    key_mask = (torch.arange(m, device=dev) < lens[:, None])[:, None, None, :]
    module = attnscore.DotProductAttention(0.0)
    trained = {
        "SDPA + key mask, fwd+bwd": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=key_mask
        ),
        "dot_product_attention, fwd+bwd": lambda: attnscore.dot_product_attention(q, k, v, lens),
        "DotProductAttention, fwd+bwd": lambda: module(q, k, v, lens),
    }
    for name, fn in trained.items():

        def step(fn: Callable[[], Any] = fn) -> Any:
            return torch.autograd.grad(fn(), (q, k, v), grad)

        res[name] = bench(step)
        res[name + " (stream)"] = stream(step)
    with torch.no_grad():
        res["dot_product_attention, fwd"] = bench(trained["dot_product_attention, fwd+bwd"])
        res["SDPA + key mask, fwd"] = bench(trained["SDPA + key mask, fwd+bwd"])
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(64, 1024, 1024, generator=g).to(dev, dtype)
            full = torch.full((64, 1024), 1024, device=dev)
            res[f"masked_softmax {dtype}, fwd"] = bench(partial(attnscore.masked_softmax, x, full))
            res[f"torch.softmax {dtype}, fwd"] = bench(partial(torch.softmax, x, -1))
    for B_, n_, m_, h_, dtype in ((8, 128, 512, 128, torch.float32), (16, 256, 1024, 128, bf)):
        torch.manual_seed(0)
        qa, ka, va = (
            torch.randn(B_, s, 64, device=dev, dtype=dtype, requires_grad=True)
            for s in (n_, m_, m_)
        )
        la = torch.randint(1, m_ + 1, (B_,), device=dev)
        additive = attnscore.AdditiveAttention(64, 64, h_, 0.0).to(dev, dtype)
        ga = torch.randn(B_, n_, 64, device=dev, dtype=dtype)
        res[f"AdditiveAttention {(B_, n_, m_, h_)} {dtype}, fwd+bwd"] = bench(
            partial(_additive_step, additive, (qa, ka, va, la), ga)
        )
    print("RESULT " + json.dumps(res), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="the old code's src folder")
    parser.add_argument("new", help="the new code's src folder")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", required=True, help="write every round here (JSON)")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for which in ("old", "new") if r % 2 == 0 else ("new", "old"):
            src = args.old if which == "old" else args.new
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", src],
                capture_output=True,
                text=True,
                timeout=300,
            )
            found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if not found:
                print(f"gpu_ab: the {which} round {r} failed:\n{proc.stderr[-3000:]}")
                return 1
            runs[which].append(json.loads(found[0][len("RESULT ") :]))
    print("| case | old ms | new ms | new / old |\n|---|---|---|---|")
    table = {}
    for case in runs["new"][0]:
        old = statistics.median(run[case] for run in runs["old"])
        new = statistics.median(run[case] for run in runs["new"])
        table[case] = {"old": old, "new": new, "new/old": new / old}
        print(f"| {case} | {old:.3f} | {new:.3f} | {new / old:.2f} |")
    with open(args.out, "w") as fh:
        json.dump({"runs": runs, "table": table}, fh, indent=1)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2])
        raise SystemExit(0)
    raise SystemExit(main())
