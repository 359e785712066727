"""Old code against new, side by side: the calls a change touches, timed in interleaved
rounds (old, new, new, old, ...), with PyTorch's own call timed beside each where there is
one.

By default both run in one process: the old tree's package is copied under the name
``attnscore_old`` (every ``attnscore`` name in its Python files rewritten, so that its
backend table, custom ops, logger and C build cache are its own) and imported beside the
new one. Each case's rounds alternate between the two, and ``new/old`` is the median of the
per-round ratios: the machine's drift between processes does not enter it.

``--processes`` runs each round in its own process instead (the only way for old trees
whose C library set FTZ/DAZ for its whole process when it loaded: before 67123f3); then
the ratio to PyTorch's call, timed in the same process, corrects for the drift.

    git worktree add /tmp/old f440755
    python tools/ab_compare.py /tmp/old/src src --rounds 5 [CASE SUBSTRINGS ...]

Prints one row per case: the median ms of each, new/old, and (``--processes``) each one's
ratio to PyTorch's call, or (one process) new minus old in microseconds and new's ratio to
PyTorch's call timed in the same rounds (``--threads``, default 2; torch.utils.benchmark
medians).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from types import ModuleType
from typing import Any

THREADS = 2
"""Torch threads for every timed call (``--threads``)."""


def cases_of(attnscore: ModuleType) -> dict[str, tuple[Any, Any]]:
    """Every case, name -> (attnscore's call, PyTorch's or None), on inputs from a fixed
    seed (each package's cases read equal inputs)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(THREADS)
    # as the bench does: freed blocks stay in the heap (otherwise whether a call's buffers
    # fault in fresh pages decides its time; attnscore._memory.keep_freed_memory, which
    # trees before it lack: in one process the new tree's call covers both)
    with contextlib.suppress(ModuleNotFoundError):
        importlib.import_module(f"{attnscore.__name__}._memory").keep_freed_memory()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)

    def rn(*s, dt=torch.float32, grad=False):
        return torch.randn(*s, generator=g).to(dt).requires_grad_(grad)

    def lens_b(B, m):
        return torch.randint(1, m + 1, (B,), generator=g)

    def lens_bn(B, n, m):
        return torch.randint(1, m + 1, (B, n), generator=g)

    cases = {}

    def case(name, fn, baseline=None):
        cases[name] = (fn, baseline)

    def fwdbwd(f, *ts):
        def run():
            for t in ts:
                t.grad = None
            f().sum().backward()

        return run

    def nothing_padded(name, q, k, v, module):
        """The cases without a mask and with causal masking alone (``name`` formats the
        mask's word), each against SDPA (``is_causal``)."""
        case(
            name.format("none"),
            lambda: module(q, k, v),
            lambda: F.scaled_dot_product_attention(q, k, v),
        )
        case(
            name.format("causal"),
            lambda: module(q, k, v, causal=True),
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        )

    # dot rows (8, 512, 512, 64)
    for dt_name, dt in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        q, k, v = rn(8, 512, 64, dt=dt), rn(8, 512, 64, dt=dt), rn(8, 512, 64, dt=dt)
        dpa = attnscore.DotProductAttention().eval()
        L, Ln = lens_b(8, 512), lens_bn(8, 512, 512)
        nothing_padded("dot {} " + dt_name + " fwd", q, k, v, dpa)
        mask = torch.arange(512) < L.view(8, 1, 1)
        case(
            f"dot lengths (B,) {dt_name} fwd",
            lambda q=q, k=k, v=v, dpa=dpa, L=L: dpa(q, k, v, L),
            lambda q=q, k=k, v=v, mask=mask: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask
            ),
        )
        case(
            f"dot lengths (B, n) {dt_name} fwd",
            lambda q=q, k=k, v=v, dpa=dpa, L=Ln: dpa(q, k, v, L),
        )
        am = torch.rand(8, 512, 512, generator=g) > 0.3
        case(
            f"dot bool {dt_name} fwd",
            lambda q=q, k=k, v=v, dpa=dpa, am=am: dpa(q, k, v, attend_mask=am),
            lambda q=q, k=k, v=v, am=am: F.scaled_dot_product_attention(q, k, v, attn_mask=am),
        )
    qg, kg, vg = rn(8, 512, 64, grad=True), rn(8, 512, 64, grad=True), rn(8, 512, 64, grad=True)
    dpa = attnscore.DotProductAttention()
    L = lens_b(8, 512)
    mask = torch.arange(512) < L.view(8, 1, 1)
    L8 = L
    mask8 = mask
    case(
        "dot lengths (B,) f32 fwd+bwd",
        fwdbwd(lambda: dpa(qg, kg, vg, L8), qg, kg, vg),
        fwdbwd(lambda: F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask8), qg, kg, vg),
    )
    qgb, kgb, vgb = (t.detach().to(torch.bfloat16).requires_grad_(True) for t in (qg, kg, vg))
    case(
        "dot lengths (B,) bf16 fwd+bwd",
        fwdbwd(lambda: dpa(qgb, kgb, vgb, L8), qgb, kgb, vgb),
        fwdbwd(
            lambda: F.scaled_dot_product_attention(qgb, kgb, vgb, attn_mask=mask8), qgb, kgb, vgb
        ),
    )
    case(
        "dot none f32 fwd+bwd",
        fwdbwd(lambda: dpa(qg, kg, vg), qg, kg, vg),
        fwdbwd(lambda: F.scaled_dot_product_attention(qg, kg, vg), qg, kg, vg),
    )
    # heads (4, 8, 256, 256, 64) training by lengths
    qh, kh, vh = (rn(4, 8, 256, 64, grad=True) for _ in range(3))
    Lh = lens_b(4, 256)
    case("heads lengths (B,) f32 fwd+bwd", fwdbwd(lambda: dpa(qh, kh, vh, Lh), qh, kh, vh))
    qc, kc, vc = (t.detach() for t in (qh, kh, vh))
    case("heads causal + lengths f32 fwd", lambda: dpa(qc, kc, vc, Lh, causal=True))
    # the function (not the module): it keeps nothing for weights
    fdpa = attnscore.dot_product_attention
    case(
        "function heads lengths (B,) f32 fwd+bwd",
        fwdbwd(lambda: fdpa(qh, kh, vh, Lh), qh, kh, vh),
    )
    case("function heads lengths (B,) f32 fwd", lambda: fdpa(qc, kc, vc, Lh))
    case(
        "dot causal + lengths f32 fwd+bwd",
        fwdbwd(lambda: dpa(qg, kg, vg, L8, causal=True), qg, kg, vg),
    )
    # decode steps against a KV cache: one query, no_grad (B, H, m, d): the keys and values
    # are the cache, whatever else the call reads of them is what a step pays on top
    for B, H, m, d in ((1, 32, 4096, 128), (8, 32, 4096, 128), (4, 8, 512, 64), (1, 8, 512, 64)):
        for dt_name, dt in (("f32", torch.float32), ("bf16", torch.bfloat16)):
            qd, kd, vd = rn(B, H, 1, d, dt=dt), rn(B, H, m, d, dt=dt), rn(B, H, m, d, dt=dt)
            Ld = torch.randint(m // 2, m + 1, (B,), generator=g)
            maskd = (torch.arange(m) < Ld.view(B, 1, 1, 1)).expand(B, 1, 1, m)
            dec = attnscore.DotProductAttention().eval()
            shape = f"({B}, {H}, {m}, {d}) {dt_name}"

            def step(dec=dec, qd=qd, kd=kd, vd=vd, L=None):
                with torch.no_grad():
                    return dec(qd, kd, vd, L)

            def sdpa_step(qd=qd, kd=kd, vd=vd, mask=None):
                with torch.no_grad():
                    return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask)

            case(f"decode none {shape}", step, sdpa_step)
            case(
                f"decode lengths (B,) {shape}",
                lambda step=step, Ld=Ld: step(L=Ld),
                lambda sdpa_step=sdpa_step, maskd=maskd: sdpa_step(mask=maskd),
            )
    # multihead B=8 n=256 E=256 H=4
    mha = attnscore.MultiHeadAttention(256, 4)
    x = rn(8, 256, 256)
    Lm = lens_b(8, 256)
    mha(x, x, x, Lm)
    case("multihead lengths (B,) fwd+bwd", fwdbwd(lambda: mha(x, x, x, Lm), x))
    case("multihead causal + lengths fwd", lambda: mha(x, x, x, Lm, causal=True))
    # a decoder's step of cross-attention: B=1, one query, m=50 encoder outputs, E=256, H=8
    cross = attnscore.MultiHeadAttention(256, 8).eval()
    torch_cross = torch.nn.MultiheadAttention(256, 8, batch_first=True).eval()
    memory, xq = rn(1, 50, 256), rn(1, 1, 256)
    case(
        "multihead cross-attention decode step",
        lambda: cross(xq, memory, memory),
        lambda: torch_cross(xq, memory, memory, need_weights=False),
    )
    # additive B=4 n=128 m=256 h=128 d=64
    add = attnscore.AdditiveAttention(64, 64, 128)
    qa, ka, va = rn(4, 128, 64, grad=True), rn(4, 256, 64, grad=True), rn(4, 256, 64, grad=True)
    La = lens_b(4, 256)
    case("additive lengths (B,) fwd+bwd", fwdbwd(lambda: add(qa, ka, va, La), qa, ka, va))
    # general (8, 256, 256, 64)
    gen = attnscore.MultiplicativeAttention(64, 64)
    qq, kk, vv = rn(8, 256, 64), rn(8, 256, 64), rn(8, 256, 64)
    Lg = lens_bn(8, 256, 256)
    case("general lengths (B, n) fwd", lambda: gen(qq, kk, vv, Lg))
    case("cosine none fwd", lambda: attnscore.CosineAttention()(qq, kk, vv))
    gb = attnscore.MultiplicativeAttention(64, 64).to(torch.bfloat16).eval()
    qb, kb, vb = (t.to(torch.bfloat16) for t in (qq, kk, vv))
    case("general none bf16 fwd", lambda: gb(qb, kb, vb))
    # heads with a boolean mask (4, 8, 256, 256, 64), and the finite scan of such inputs
    am = torch.rand(4, 1, 256, 256, generator=g) > 0.3
    heads_e = attnscore.DotProductAttention().eval()
    case("heads bool f32 fwd", lambda: heads_e(qc, kc, vc, attend_mask=am))
    scan = importlib.import_module(f"{attnscore.__name__}.kernels._cpu").all_finite
    for dt_name, dt in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        qkv = [t.to(dt) for t in (qc, kc, vc)]
        case(f"finite scan (4, 8, 256, 64) x 3 {dt_name}", lambda qkv=qkv: scan(qkv))
    # masked softmax (32, 256, 1024)
    X = rn(32, 256, 1024)
    Ls = lens_b(32, 1024)
    case(
        "masked_softmax lengths (B,) f32 fwd",
        lambda: attnscore.masked_softmax(X, Ls),
        lambda: torch.softmax(X, -1),
    )
    # tiny (2, 4, 8, 8) and mid (2, 64, 64, 32)
    for size, (B, n, m, d) in (("tiny", (2, 4, 8, 8)), ("mid", (2, 64, 64, 32))):
        q, k, v = rn(B, n, d), rn(B, m, d), rn(B, m, d)
        L = lens_b(B, m)
        dpa_e = attnscore.DotProductAttention().eval()
        case(
            f"dot ({size}) lengths",
            lambda q=q, k=k, v=v, L=L, f=dpa_e: f(q, k, v, L),
            lambda q=q, k=k, v=v, L=L, B=B, m=m: F.scaled_dot_product_attention(
                q, k, v, attn_mask=torch.arange(m) < L.view(B, 1, 1)
            ),  # the mask built per call, as a user would
        )
        nothing_padded(f"dot ({size}) {{}}", q, k, v, dpa_e)
        a = attnscore.AdditiveAttention(d, d, 8).eval()
        case(f"additive ({size}) lengths", lambda q=q, k=k, v=v, L=L, f=a: f(q, k, v, L))
        gm = attnscore.MultiplicativeAttention(d, d).eval()
        case(f"general ({size}) lengths", lambda q=q, k=k, v=v, L=L, f=gm: f(q, k, v, L))
        case(
            f"general ({size}) none",
            lambda q=q, k=k, v=v, f=gm: f(q, k, v),
            lambda q=q, k=k, v=v, W=gm.W_a.weight: torch.softmax((q @ W) @ k.mT, -1) @ v,
        )  # (the plain formulation: PyTorch has no general attention)
        cos = attnscore.CosineAttention().eval()
        case(
            f"cosine ({size}) none",
            lambda q=q, k=k, v=v, f=cos: f(q, k, v),
            lambda q=q, k=k, v=v, s=cos.log_scale: (
                torch.softmax(s.exp() * F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).mT, -1) @ v
            ),
        )
    # general and cosine without a mask, the matrix's (8, 256, 256, 64), against the plain
    # formulation: their pipeline (a softmax without a mask between two products)
    for dt_name, dt in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        for grad in (False, True):
            q, k, v = (rn(8, 256, 64, dt=dt, grad=grad) for _ in "qkv")
            gm = attnscore.MultiplicativeAttention(64, 64).to(dt).train(grad)
            cos = attnscore.CosineAttention().to(dt).train(grad)
            step = "fwd+bwd" if grad else "fwd"
            pairs = {
                "general": (gm, lambda q, k, W=gm.W_a.weight: (q @ W) @ k.mT),
                "cosine": (
                    cos,
                    lambda q, k, s=cos.log_scale: (
                        s.exp() * F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).mT
                    ),
                ),
            }
            for name, (module, scores) in pairs.items():
                ours = lambda q=q, k=k, v=v, f=module: f(q, k, v)  # noqa: E731
                plain = lambda q=q, k=k, v=v, s=scores: torch.softmax(s(q, k), -1) @ v  # noqa: E731
                if grad:
                    ours, plain = fwdbwd(ours, q, k, v), fwdbwd(plain, q, k, v)
                case(f"{name} (8, 256, 256, 64) none {dt_name} {step}", ours, plain)
    # general by key lengths (B,) in training, bfloat16: the C kernel by lengths, whose
    # backward has one task per example (8 on the threads), against the plain formulation
    ql, kl, vl = (rn(8, 256, 64, dt=torch.bfloat16, grad=True) for _ in "qkv")
    gl = attnscore.MultiplicativeAttention(64, 64).to(torch.bfloat16)
    Ll = lens_b(8, 256)
    keep = torch.arange(256) < Ll.view(8, 1, 1)

    def plain_masked(q, k, v, W):  # general attention's plain formulation with the mask
        return torch.softmax(((q @ W) @ k.mT).masked_fill(~keep, float("-inf")), -1) @ v

    case(
        "general (8, 256, 256, 64) lengths (B,) bf16 fwd+bwd",
        fwdbwd(lambda: gl(ql, kl, vl, Ll), ql, kl, vl),
        fwdbwd(lambda: plain_masked(ql, kl, vl, gl.W_a.weight), ql, kl, vl),
    )
    # decoder step: additive, B=128, m=20, h=256
    dec = attnscore.AdditiveAttention(256, 256, 256).eval()
    enc = rn(128, 20, 256)
    qd = rn(128, 1, 256)
    Ld = lens_b(128, 20)
    case("decoder_step", lambda: dec(qd, enc, enc, Ld))
    # lengths that cut no key (a batch without padding), against SDPA with the all-True
    # mask a user's code builds from them
    uncut = attnscore.DotProductAttention().eval()
    for name, shape, dt in (
        ("tiny", (2, 1, 4, 8, 8), torch.float32),
        ("mid", (2, 1, 64, 64, 32), torch.float32),
        ("serving", (8, 12, 128, 128, 64), torch.bfloat16),
    ):
        B, H, n, m, d = shape
        qu, ku, vu = rn(B, H, n, d, dt=dt), rn(B, H, m, d, dt=dt), rn(B, H, m, d, dt=dt)
        Lu = torch.full((B,), m)
        every = torch.arange(m) < Lu.view(B, 1, 1, 1)
        case(
            f"uncut lengths {name} {shape}",
            lambda q=qu, k=ku, v=vu, L=Lu: uncut(q, k, v, L),
            lambda q=qu, k=ku, v=vu, mask=every: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask
            ),
        )
    return cases


def _timed(name: str, fn: Any, min_run_time: float) -> float:
    """Seconds per call of ``fn`` (a median of torch.utils.benchmark's blocks), with
    gradients for the forward + backward cases."""
    import torch
    from torch.utils import benchmark

    with torch.enable_grad() if "bwd" in name else torch.no_grad():
        fn()
        fn()
        # (Timer's own default is one thread: time on the process's, as the bench does)
        timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
        return float(timer.blocked_autorange(min_run_time=min_run_time).median)


def _wanted(name: str, only: list[str]) -> bool:
    return not only or any(o in name for o in only)


def worker(only: list[str]) -> None:
    """Time every case (whose name contains one of ``only``, if given); print JSON."""
    import attnscore

    out = {}
    for name, (fn, base) in cases_of(attnscore).items():
        if _wanted(name, only):
            b = None if base is None else _timed(name, base, 0.4)
            out[name] = (_timed(name, fn, 0.4), b)
    print(json.dumps(out))


def renamed_copy(src: str, into: str, name: str = "attnscore_old") -> None:
    """Copy the package ``src``/attnscore to ``into``/``name``, every ``attnscore`` name in its
    Python files rewritten to ``name``."""
    target = os.path.join(into, name)
    shutil.copytree(
        os.path.join(src, "attnscore"), target, ignore=shutil.ignore_patterns("__pycache__")
    )
    word = re.compile(r"\battnscore\b")
    for folder, _, files in os.walk(target):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                with open(path, "w", encoding="utf-8") as f:
                    f.write(word.sub(name, text))


def one_process(old: str, new: str, only: list[str], rounds: int) -> int:
    """Both trees in this process (:func:`renamed_copy`), rounds interleaved per case."""
    into = tempfile.mkdtemp(prefix="ab-old-")
    try:
        renamed_copy(old, into)
        sys.path[:0] = [new, into]
        packages = {
            "old": importlib.import_module("attnscore_old"),
            "new": importlib.import_module("attnscore"),
        }
        where = os.path.dirname(os.path.dirname(os.path.abspath(packages["new"].__file__ or "")))
        if where != os.path.abspath(new):
            sys.stderr.write(f"attnscore was imported from {where}, not {new}\n")
            return 1
        cases = {tag: cases_of(package) for tag, package in packages.items()}
        print(f"{'case':40s} {'old ms':>9s} {'new ms':>9s} {'new/old':>8s} {'new-old us':>10s} "
              f"{'new/torch':>9s}")  # fmt: skip
        for name in cases["new"]:
            if not _wanted(name, only) or name not in cases["old"]:
                continue
            times: dict[str, list[float]] = {"old": [], "new": [], "torch": []}
            base = cases["new"][name][1]
            for r in range(rounds):
                for tag in ("old", "new") if r % 2 == 0 else ("new", "old"):
                    times[tag].append(_timed(name, cases[tag][name][0], 0.2))
                if base is not None:  # (PyTorch's call in the same round, for new/torch)
                    times["torch"].append(_timed(name, base, 0.2))
            ratio = statistics.median(
                n / o for o, n in zip(times["old"], times["new"], strict=True)
            )
            o, n = (statistics.median(times[tag]) * 1e3 for tag in ("old", "new"))
            vs = "-"
            if times["torch"]:
                pairs = zip(times["new"], times["torch"], strict=True)
                vs = f"{statistics.median(a / b for a, b in pairs):.2f}x"
            print(f"{name:40s} {o:9.4f} {n:9.4f} {ratio:7.3f}x {(n - o) * 1e3:+10.2f} {vs:>9s}")
    finally:
        shutil.rmtree(into, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="the old tree's src folder")
    parser.add_argument("new", help="the new tree's src folder")
    parser.add_argument("cases", nargs="*", help="only cases whose name contains one of these")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument(
        "--processes", action="store_true", help="each round in its own process (old trees)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_intermixed_args(argv)
    global THREADS
    THREADS = args.threads
    if args.worker:
        worker(args.cases)
        return 0
    if not args.processes:
        return one_process(
            os.path.abspath(args.old), os.path.abspath(args.new), args.cases, args.rounds
        )
    trees = {"old": os.path.abspath(args.old), "new": os.path.abspath(args.new)}
    res: dict[str, dict[str, list[tuple[float, float | None]]]] = {k: {} for k in trees}
    for r in range(args.rounds):
        for tag in ("old", "new") if r % 2 == 0 else ("new", "old"):
            env = {**os.environ, "PYTHONPATH": trees[tag]}
            env["ATTNSCORE_CACHE"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ab-{tag}")
            cmd = [sys.executable, __file__, args.old, args.new, *args.cases, "--worker"]
            cmd += ["--threads", str(args.threads)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.stderr.write(proc.stderr[-3000:])
                return 1
            for name, (t, b) in json.loads(proc.stdout.strip().splitlines()[-1]).items():
                res[tag].setdefault(name, []).append((t, b))
    print(f"{'case':40s} {'old ms':>9s} {'new ms':>9s} {'new/old':>8s} {'old/torch':>9s} "
          f"{'new/torch':>9s}")  # fmt: skip
    for name in res["new"]:
        o = statistics.median(t for t, _ in res["old"][name]) * 1e3
        n = statistics.median(t for t, _ in res["new"][name]) * 1e3

        def vs(tag: str, name: str = name) -> str:
            rs = [t / b for t, b in res[tag][name] if b]
            return f"{statistics.median(rs):.2f}x" if rs else "-"

        print(f"{name:40s} {o:9.4f} {n:9.4f} {n / o:7.3f}x {vs('old'):>9s} {vs('new'):>9s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
