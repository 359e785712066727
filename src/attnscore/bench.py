"""``attnscore bench`` / ``python -m attnscore.bench``: attnscore against the textbook code and
PyTorch's fused SDPA, side by side in one process (issue 3).

Times are medians from ``torch.utils.benchmark`` (``blocked_autorange``). Peak memory is the
peak RSS (``VmHWM``) of a fresh subprocess that builds the inputs and runs the case once, so it is
the peak of the whole process (including ~300 MiB of torch itself).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["main"]

Shapes = dict[str, int]

FULL: dict[str, Shapes] = {
    "masked_softmax": {"B": 64, "n": 256, "m": 1024},
    "additive_fwd_bwd": {"B": 8, "n": 128, "m": 512, "h": 128, "d": 64},
    "additive_memory": {"B": 4, "n": 1024, "m": 1024, "h": 256, "d": 64},
    "dot_no_grad": {"B": 32, "n": 1024, "m": 1024, "d": 64},
    "dot_fwd_bwd": {"B": 32, "n": 1024, "m": 1024, "d": 64},
}
QUICK: dict[str, Shapes] = {
    "masked_softmax": {"B": 16, "n": 64, "m": 256},
    "additive_fwd_bwd": {"B": 2, "n": 32, "m": 128, "h": 32, "d": 16},
    "additive_memory": {"B": 1, "n": 256, "m": 256, "h": 64, "d": 16},
    "dot_no_grad": {"B": 8, "n": 256, "m": 256, "d": 32},
    "dot_fwd_bwd": {"B": 8, "n": 256, "m": 256, "d": 32},
}
# (baseline, bound): attnscore time / baseline time must be <= bound; "rss" is a MiB bound.
TARGETS: dict[str, list[tuple[str, float]]] = {
    "masked_softmax": [("softmax", 1.3), ("textbook", 0.25)],
    "additive_fwd_bwd": [("textbook", 1 / 3)],
    "additive_memory": [("rss", 1024.0)],
    "dot_no_grad": [("sdpa", 0.7), ("textbook", 0.2)],
    "dot_fwd_bwd": [("sdpa", 1.0)],
}


# ------------------------------------------------------------------ textbook formulations
def textbook_sequence_mask(X: Tensor, valid_len: Tensor, value: float = 0.0) -> Tensor:
    """D2L's sequence_mask, in place as in the book (repeated runs are idempotent)."""
    maxlen = X.size(1)
    mask = torch.arange(maxlen, dtype=torch.float32, device=X.device)[None, :] < valid_len[:, None]
    X[~mask] = value
    return X


def textbook_masked_softmax(X: Tensor, valid_lens: Tensor) -> Tensor:
    """D2L's masked_softmax: sequence_mask with -1e6, then softmax."""
    shape = X.shape
    if valid_lens.dim() == 1:
        valid_lens = torch.repeat_interleave(valid_lens, shape[1])
    else:
        valid_lens = valid_lens.reshape(-1)
    X = textbook_sequence_mask(X.reshape(-1, shape[-1]), valid_lens, value=-1e6)
    return F.softmax(X.reshape(shape), dim=-1)


class TextbookAdditive(nn.Module):
    """D2L's AdditiveAttention: broadcast tanh over a (B, n, m, h) tensor."""

    def __init__(self, key_size: int, query_size: int, num_hiddens: int) -> None:
        super().__init__()
        self.W_k = nn.Linear(key_size, num_hiddens, bias=False)
        self.W_q = nn.Linear(query_size, num_hiddens, bias=False)
        self.w_v = nn.Linear(num_hiddens, 1, bias=False)

    def forward(self, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor) -> Tensor:
        queries, keys = self.W_q(queries), self.W_k(keys)
        features = torch.tanh(queries.unsqueeze(2) + keys.unsqueeze(1))
        scores = self.w_v(features).squeeze(-1)
        return torch.bmm(textbook_masked_softmax(scores, valid_lens), values)


def textbook_dot(q: Tensor, k: Tensor, v: Tensor, valid_lens: Tensor) -> Tensor:
    """D2L's DotProductAttention: bmm, masked softmax, bmm."""
    scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(q.shape[-1])
    return torch.bmm(textbook_masked_softmax(scores, valid_lens), v)


def sdpa_masked(q: Tensor, k: Tensor, v: Tensor, valid_lens: Tensor) -> Tensor:
    """SDPA at its best on CPU: 4-D (B, 1, n, d) layout (flash kernel), boolean mask."""
    m = k.shape[1]
    mask = torch.arange(m)[None, :] < valid_lens[:, None]
    out = F.scaled_dot_product_attention(
        q[:, None], k[:, None], v[:, None], attn_mask=mask[:, None, None, :]
    )
    return out[:, 0]


# ------------------------------------------------------------------ cases
def _lens(B: int, m: int) -> Tensor:
    return torch.randint(1, m + 1, (B,))


def make_case(case: str, s: Shapes) -> dict[str, Callable[[], Any]]:
    """Return impl name -> zero-argument callable running one iteration of the case."""
    import attnscore

    torch.manual_seed(0)
    B, n, m = s["B"], s["n"], s["m"]
    if case == "masked_softmax":
        X, vl = torch.randn(B, n, m), _lens(B, m)
        return {
            "attnscore": lambda: attnscore.masked_softmax(X, vl),
            "softmax": lambda: torch.softmax(X, -1),
            "textbook": lambda: textbook_masked_softmax(X, vl),
        }
    if case.startswith("additive"):
        h, d = s["h"], s["d"]
        q, k, v = torch.randn(B, n, d), torch.randn(B, m, d), torch.randn(B, m, d)
        vl = _lens(B, m)
        ours = attnscore.AdditiveAttention(key_size=d, query_size=d, num_hiddens=h)
        book = TextbookAdditive(d, d, h)
        with torch.no_grad():  # same parameters for both
            book.W_q.weight.copy_(ours.W_q.weight)
            book.W_k.weight.copy_(ours.W_k.weight)
            book.w_v.weight.copy_(ours.w_v.weight)

        def step(module: nn.Module) -> Callable[[], Any]:
            def run() -> None:
                module.zero_grad(set_to_none=True)
                module(q, k, v, vl).sum().backward()

            return run

        impls = {"attnscore": step(ours)}
        if case == "additive_fwd_bwd":
            impls["textbook"] = step(book)
        return impls
    d = s["d"]
    grad = case == "dot_fwd_bwd"
    q, k, v = (torch.randn(B, x, d, requires_grad=grad) for x in (n, m, m))
    vl = _lens(B, m)
    dot = attnscore.DotProductAttention()

    def wrap(fn: Callable[[], Tensor]) -> Callable[[], Any]:
        if grad:
            return lambda: fn().sum().backward()

        def run() -> Tensor:
            with torch.no_grad():
                return fn()

        return run

    impls = {
        "attnscore": wrap(lambda: dot(q, k, v, vl)),
        "sdpa": wrap(lambda: sdpa_masked(q, k, v, vl)),
    }
    if not grad:
        impls["textbook"] = wrap(lambda: textbook_dot(q, k, v, vl))
    return impls


def _child(case: str, quick: bool, impl: str) -> None:
    """Run one case once in this fresh process and print its peak RSS in MiB."""
    shapes = (QUICK if quick else FULL)[case]
    make_case(case, shapes)[impl]()
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork + exec, so a child would
    # report the parent's peak; VmHWM belongs to this process image only.
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                print(int(line.split()[1]) / 1024)
                return
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def _env(**extra: str) -> dict[str, str]:
    """Environment for subprocesses: import this very attnscore (not another install)."""
    import attnscore

    root = os.path.dirname(os.path.dirname(os.path.abspath(attnscore.__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def _peak_rss(case: str, quick: bool, impl: str, threads: int) -> float | None:
    cmd = [sys.executable, "-m", "attnscore.bench", "--child", case, impl]
    cmd += ["--threads", str(threads)] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_env())
    try:
        return float(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return None


def _cold_compile_seconds() -> float | None:
    """First-call compile + load time, measured in a subprocess with an empty cache."""
    code = (
        "import time, torch; t = time.perf_counter(); from attnscore import kernels; "
        "ok = kernels.load_library() is not None; "
        "print(time.perf_counter() - t if ok else -1)"
    )
    with tempfile.TemporaryDirectory() as cache:
        env = _env(ATTNSCORE_CACHE=cache)
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
        )
    try:
        seconds = float(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return None
    return None if seconds < 0 else seconds


def _fmt_shape(s: Shapes) -> str:
    return " ".join(f"{k}={v}" for k, v in s.items())


def run(quick: bool, memory: bool, threads: int, cases: list[str] | None = None) -> dict[str, Any]:
    from torch.utils import benchmark

    from attnscore import kernels

    torch.set_num_threads(threads)
    start = time.perf_counter()
    kernels.load_library()
    load_seconds = time.perf_counter() - start
    info = kernels.build_info().as_dict()
    cold = _cold_compile_seconds()
    shapes = QUICK if quick else FULL
    min_time = 0.1 if quick else 1.5
    rows = []
    for case, s in shapes.items():
        if cases and case not in cases:
            continue
        impls = make_case(case, s)
        times: dict[str, float] = {}
        if case != "additive_memory":
            for name, fn in impls.items():
                fn()  # warm-up
                timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=threads)
                times[name] = timer.blocked_autorange(min_run_time=min_time).median
        # --quick measures only attnscore's memory, to stay well under a minute.
        names = ["attnscore"] if quick else list(impls)
        rss = {name: _peak_rss(case, quick, name, threads) for name in names} if memory else {}
        checks = []
        for base, bound in TARGETS[case]:
            if base == "rss":
                value = rss.get("attnscore")
                ok = value is not None and value <= bound
                checks.append({"vs": "peak RSS MiB", "value": value, "bound": bound, "met": ok})
            elif base in times:
                ratio = times["attnscore"] / times[base]
                checks.append({"vs": base, "value": ratio, "bound": bound, "met": ratio <= bound})
        rows.append(
            {
                "case": case,
                "shapes": s,
                "dtype": "float32",
                "threads": threads,
                "median_s": times,
                "peak_rss_mib": rss,
                "targets": checks,
            }
        )
        del impls
    return {
        "quick": quick,
        "torch": torch.__version__,
        "kernel_first_load_s": load_seconds,
        "kernel_cold_compile_s": cold,
        "kernel_build": info,
        "rows": rows,
    }


def render(result: dict[str, Any]) -> str:
    lines = [
        "| operation | shapes | dtype | threads | attnscore ms | textbook ms | softmax/SDPA ms "
        "| ratio (attnscore / baseline) | target | met | peak RSS MiB (ours / textbook / other) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def ms(t: float | None) -> str:
        return "-" if t is None else f"{t * 1e3:.1f}"

    def mib(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    for row in result["rows"]:
        t, r = row["median_s"], row["peak_rss_mib"]
        other = t.get("sdpa", t.get("softmax"))
        other_rss = r.get("sdpa", r.get("softmax"))
        for i, c in enumerate(row["targets"] or [None]):
            first = i == 0
            if c is None:
                ratio = target = met = "-"
            elif c["vs"] == "peak RSS MiB":
                ratio, target = f"RSS {mib(c['value'])} MiB", f"< {c['bound']:.0f} MiB"
                met = "yes" if c["met"] else "NO"
            else:
                ratio = f"{c['value']:.3f} vs {c['vs']}"
                bound = c["bound"]
                target = f"<= {bound:.2f}" + (f" (>= {1 / bound:.1f}x faster)" if bound < 1 else "")
                met = "yes" if c["met"] else "NO"
            lines.append(
                "| "
                + " | ".join(
                    [
                        row["case"] if first else "",
                        _fmt_shape(row["shapes"]) if first else "",
                        row["dtype"] if first else "",
                        str(row["threads"]) if first else "",
                        ms(t.get("attnscore")) if first else "",
                        ms(t.get("textbook")) if first else "",
                        ms(other) if first else "",
                        ratio,
                        target,
                        met,
                        (f"{mib(r.get('attnscore'))} / {mib(r.get('textbook'))} / {mib(other_rss)}")
                        if first
                        else "",
                    ]
                )
                + " |"
            )
    cold = result["kernel_cold_compile_s"]
    lines.append("")
    lines.append(
        f"C kernels: first load in this process {result['kernel_first_load_s']:.2f} s "
        f"(compiled now: {result['kernel_build']['compiled']}); cold compile + load with an "
        f"empty cache: {'n/a' if cold is None else f'{cold:.2f} s'}. Peak RSS: VmHWM of a "
        "fresh subprocess per case (whole process, torch included). additive_memory: "
        "textbook not run (its (B, n, m, h) float32 tensor alone is B*n*m*h*4 bytes = "
        + _textbook_gib(result)
        + ")."
    )
    return "\n".join(lines)


def _textbook_gib(result: dict[str, Any]) -> str:
    for row in result["rows"]:
        if row["case"] == "additive_memory":
            s = row["shapes"]
            return f"{s['B'] * s['n'] * s['m'] * s['h'] * 4 / 2**30:.1f} GiB"
    return "n/a"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="attnscore bench", description="Time attnscore against textbook code and SDPA."
    )
    parser.add_argument("--quick", action="store_true", help="small shapes (CI smoke run)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--no-memory", action="store_true", help="skip peak-memory subprocesses")
    parser.add_argument("--cases", nargs="+", choices=list(FULL), help="run only these cases")
    parser.add_argument("--child", nargs=2, metavar=("CASE", "IMPL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"Expected --threads >= 1, but got {args.threads} instead")
    if args.child:
        torch.set_num_threads(args.threads)
        _child(args.child[0], args.quick, args.child[1])
        return 0
    result = run(args.quick, not args.no_memory, args.threads, args.cases)
    print(render(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    ok = all(c["met"] for row in result["rows"] for c in row["targets"])
    return 0 if ok or args.quick else 1


if __name__ == "__main__":
    raise SystemExit(main())
